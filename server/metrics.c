/* Prometheus text exposition for /metrics (see metrics.h). Histogram buckets follow
 * vLLM's choices so dashboards built for vLLM read specd the same way. */
#include "server/metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/sse.h"

static const double ttft_buckets[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                      0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
static const double itl_buckets[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                     0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
static const double e2e_buckets[] = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                                     20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0};
#define MAX_BUCKETS 20

typedef struct {
    const double *le;
    int n;
    unsigned long long counts[MAX_BUCKETS]; /* per bucket, not cumulative */
    unsigned long long count;
    double sum;
} histogram;

static const char *const reasons[] = {"stop", "length", "abort", "error"};
#define N_REASONS 4
static const int statuses[] = {400, 401, 404, 405, 413, 429, 500, 503};
#define N_STATUSES 8

struct metrics {
    pthread_mutex_t mu;
    char model[256];
    engine_stats st;
    histogram ttft, itl, e2e;
    unsigned long long finished[N_REASONS];
    unsigned long long http_errors[N_STATUSES];
    double host_output_s, engine_wait_s;
    unsigned long long host_output_tokens;
};

metrics *metrics_create(const char *model_name) {
    metrics *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    /* Label values are quoted: keep them free of quotes, backslashes and newlines. */
    size_t j = 0;
    for (size_t i = 0; model_name[i] && j + 1 < sizeof m->model; i++) {
        char c = model_name[i];
        m->model[j++] = (c == '"' || c == '\\' || c == '\n') ? '_' : c;
    }
    m->ttft.le = ttft_buckets, m->ttft.n = sizeof ttft_buckets / sizeof(double);
    m->itl.le = itl_buckets, m->itl.n = sizeof itl_buckets / sizeof(double);
    m->e2e.le = e2e_buckets, m->e2e.n = sizeof e2e_buckets / sizeof(double);
    return m;
}

void metrics_destroy(metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

void metrics_set_engine(metrics *m, const engine_stats *st) {
    pthread_mutex_lock(&m->mu);
    m->st = *st;
    pthread_mutex_unlock(&m->mu);
}

/* n observations of the same value under one lock */
static void observe(metrics *m, histogram *h, double v, int n) {
    pthread_mutex_lock(&m->mu);
    int i = 0;
    while (i < h->n && v > h->le[i]) i++;
    if (i < h->n) h->counts[i] += (unsigned long long)n;
    h->count += (unsigned long long)n;
    h->sum += v * n;
    pthread_mutex_unlock(&m->mu);
}

void metrics_observe_ttft(metrics *m, double s) { observe(m, &m->ttft, s, 1); }
void metrics_observe_itl_n(metrics *m, double s, int n) { observe(m, &m->itl, s, n); }
void metrics_set_host_output(metrics *m, double seconds, unsigned long long tokens) {
    pthread_mutex_lock(&m->mu);
    m->host_output_s = seconds;
    m->host_output_tokens = tokens;
    pthread_mutex_unlock(&m->mu);
}
void metrics_set_engine_wait(metrics *m, double seconds) {
    pthread_mutex_lock(&m->mu);
    m->engine_wait_s = seconds;
    pthread_mutex_unlock(&m->mu);
}
void metrics_observe_e2e(metrics *m, double s) { observe(m, &m->e2e, s, 1); }

void metrics_request_finished(metrics *m, const char *reason) {
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < N_REASONS; i++)
        if (reason && !strcmp(reason, reasons[i])) m->finished[i]++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_http_error(metrics *m, int status) {
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < N_STATUSES; i++)
        if (statuses[i] == status) m->http_errors[i]++;
    pthread_mutex_unlock(&m->mu);
}

typedef struct {
    char *s;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int w = vsnprintf(b->s + b->n, b->cap - b->n, fmt, ap);
        va_end(ap);
        if (w < 0) { b->oom = 1; return; }
        if ((size_t)w < b->cap - b->n) { b->n += (size_t)w; return; }
        size_t cap = b->cap * 2 + (size_t)w;
        char *ns = realloc(b->s, cap);
        if (!ns) { b->oom = 1; return; }
        b->s = ns;
        b->cap = cap;
    }
}

static void head(sbuf *b, const char *name, const char *type, const char *help) {
    sb_printf(b, "# HELP specd:%s %s\n# TYPE specd:%s %s\n", name, help, name, type);
}

static void gauge(sbuf *b, const char *model, const char *name, const char *help, double v) {
    head(b, name, "gauge", help);
    sb_printf(b, "specd:%s{model_name=\"%s\"} %.17g\n", name, model, v);
}

static void counter(sbuf *b, const char *model, const char *name, const char *help,
                    unsigned long long v) {
    head(b, name, "counter", help);
    sb_printf(b, "specd:%s{model_name=\"%s\"} %llu\n", name, model, v);
}

static void fcounter(sbuf *b, const char *model, const char *name, const char *help, double v) {
    head(b, name, "counter", help);
    sb_printf(b, "specd:%s{model_name=\"%s\"} %.9f\n", name, model, v);
}

static void hist(sbuf *b, const char *model, const char *name, const char *help, const histogram *h) {
    head(b, name, "histogram", help);
    unsigned long long cum = 0;
    for (int i = 0; i < h->n; i++) {
        cum += h->counts[i];
        sb_printf(b, "specd:%s_bucket{le=\"%g\",model_name=\"%s\"} %llu\n", name, h->le[i], model, cum);
    }
    sb_printf(b, "specd:%s_bucket{le=\"+Inf\",model_name=\"%s\"} %llu\n", name, model, h->count);
    sb_printf(b, "specd:%s_count{model_name=\"%s\"} %llu\n", name, model, h->count);
    sb_printf(b, "specd:%s_sum{model_name=\"%s\"} %.17g\n", name, model, h->sum);
}

char *metrics_render(metrics *m) {
    sbuf b = {malloc(8192), 0, 8192, 0};
    if (!b.s) return NULL;
    pthread_mutex_lock(&m->mu);
    const engine_stats *st = &m->st;
    const char *mo = m->model;
    gauge(&b, mo, "num_requests_running", "Sequences running in the engine.", st->running);
    gauge(&b, mo, "num_requests_waiting", "Sequences waiting for admission.", st->waiting);
    gauge(&b, mo, "num_requests_paused", "Sequences paused because their client stopped reading.", st->paused);
    gauge(&b, mo, "stream_unread_bytes", "Output bytes pushed to streams and not yet taken by clients.",
          (double)sse_total_unread());
    gauge(&b, mo, "kv_cache_usage_perc", "KV cache usage (1 = full).",
          st->kv_blocks_total ? (double)st->kv_blocks_used / st->kv_blocks_total : 0.0);
    gauge(&b, mo, "kv_blocks_used", "KV blocks held by requests (blocks only the prefix cache keeps count as free).",
          st->kv_blocks_used);
    gauge(&b, mo, "kv_blocks_cached", "KV blocks the prefix cache can serve (held by requests or evictable).",
          st->kv_blocks_cached);
    gauge(&b, mo, "kv_blocks_total", "KV blocks in the pool.", st->kv_blocks_total);
    gauge(&b, mo, "kv_window_blocks_used",
          "Blocks held in the window layers' pool (models that mix sliding-window and full layers).",
          st->kv_win_blocks_used);
    gauge(&b, mo, "kv_window_blocks_total", "Blocks in the window layers' pool.", st->kv_win_blocks_total);
    gauge(&b, mo, "kv_bytes_used", "Bytes of the KV blocks in use (both pools).", st->kv_bytes_used);
    gauge(&b, mo, "engine_failed", "1 when the engine hit a runner error.", st->failed);
    counter(&b, mo, "prompt_tokens_total", "Prefill tokens processed.", st->prompt_tokens);
    counter(&b, mo, "generation_tokens_total", "Generated tokens.", st->generation_tokens);
    counter(&b, mo, "num_preemptions_total", "Sequences preempted (recomputed).", st->preemptions);
    counter(&b, mo, "prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.",
            st->prefix_cache_hit_tokens);
    head(&b, "request_success_total", "counter", "Finished requests by finish reason.");
    for (int i = 0; i < N_REASONS; i++)
        sb_printf(&b, "specd:request_success_total{finished_reason=\"%s\",model_name=\"%s\"} %llu\n",
                  reasons[i], mo, m->finished[i]);
    head(&b, "http_request_errors_total", "counter", "Requests rejected with an error status.");
    for (int i = 0; i < N_STATUSES; i++)
        sb_printf(&b, "specd:http_request_errors_total{status=\"%d\",model_name=\"%s\"} %llu\n",
                  statuses[i], mo, m->http_errors[i]);
    hist(&b, mo, "time_to_first_token_seconds", "Time to first token.", &m->ttft);
    hist(&b, mo, "inter_token_latency_seconds", "Time between output tokens.", &m->itl);
    hist(&b, mo, "e2e_request_latency_seconds", "Request latency, arrival to finish.", &m->e2e);
    fcounter(&b, mo, "host_output_seconds_total",
             "Wall time the serving loop spent turning engine events into text and chunks.", m->host_output_s);
    counter(&b, mo, "host_output_tokens_total", "Generated tokens that output processing handled.",
            m->host_output_tokens);
    head(&b, "engine_steps_total", "counter", "Engine steps by the runner path that ran them.");
    const struct { const char *path; uint64_t n; } paths[] = {
        {"decode", st->steps_device_decode}, {"verify", st->steps_runner_verify},
        {"speculative", st->steps_runner_spec}, {"composed", st->steps_composed}};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++)
        sb_printf(&b, "specd:engine_steps_total{path=\"%s\",model_name=\"%s\"} %llu\n", paths[i].path, mo,
                  (unsigned long long)paths[i].n);
    counter(&b, mo, "engine_async_steps_total",
            "Decode steps queued before the engine committed the step in flight (their inputs fed on the device).",
            st->steps_async);
    fcounter(&b, mo, "engine_step_seconds_total", "Wall time of engine steps (schedule, run, commit, emit).",
             st->step_seconds);
    fcounter(&b, mo, "engine_run_seconds_total", "Wall time of the runner's work within engine steps.",
             st->run_seconds);
    fcounter(&b, mo, "engine_output_wait_seconds_total",
             "Wall time the engine thread had work but waited for the loop to take earlier outputs.",
             m->engine_wait_s);
    counter(&b, mo, "spec_decode_num_drafts_total", "Speculative verify steps.", st->spec_drafts);
    counter(&b, mo, "spec_decode_num_draft_tokens_total", "Draft tokens proposed.", st->spec_draft_tokens);
    counter(&b, mo, "spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", st->spec_accepted_tokens);
    gauge(&b, mo, "spec_decode_acceptance_length", "Mean tokens per verify step (1 + accepted / drafts).",
          st->spec_drafts ? 1.0 + (double)st->spec_accepted_tokens / (double)st->spec_drafts : 0.0);
    counter(&b, mo, "spec_decode_num_decode_steps_total", "Engine steps with decoding rows.", st->spec_steps_decoding);
    counter(&b, mo, "spec_decode_num_speculated_steps_total", "Engine steps in which a row verified drafts.",
            st->spec_steps_speculated);
    counter(&b, mo, "spec_decode_num_composed_steps_total",
            "Prompt-lookup steps whose drafts went through the composed path (a forward pass sampling every "
            "position) because the runner's verify op does not take them.",
            st->spec_steps_fwd);
    gauge(&b, mo, "spec_decode_host_seconds",
          "The engine's host time per step at the latest step's batch size, as the speculation cost model "
          "learned it where plain steps hide it in flight (added to every speculating step's time).",
          st->spec_host_seconds);
    counter(&b, mo, "spec_decode_num_decode_rows_total", "Decoding rows over all steps (a verify is one).",
            st->spec_rows_decoding);
    head(&b, "spec_decode_drafter", "gauge", "The drafter in use (label kind), always 1.");
    sb_printf(&b, "specd:spec_decode_drafter{kind=\"%s\",model_name=\"%s\"} 1\n",
              st->spec_drafter ? st->spec_drafter : "none", mo);
    head(&b, "spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted draft tokens by position.");
    for (int i = 0; i < st->num_draft_tokens && i < ENGINE_MAX_STEP_TOKENS; i++)
        sb_printf(&b, "specd:spec_decode_num_accepted_tokens_per_pos{position=\"%d\",model_name=\"%s\"} %llu\n",
                  i, mo, (unsigned long long)st->spec_accepted_per_pos[i]);
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}
