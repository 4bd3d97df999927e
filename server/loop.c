/* The serving loop: request state, engine steps on the libuv pool, fan-out (see loop.h).
 *
 * Everything below the "loop thread" marker runs on the loop thread only, so it needs no
 * locks; the only shared state is the inbound queue (mu), the atomics (state, failed,
 * inflight) and each job's sse_chan (which has its own lock). Engine request ids are
 * (job id << 8) | choice index, so an event finds its choice through the job table. */
#include "server/loop.h"

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/err.h"
#include "server/log.h"

#define N_BUCKETS 1024
#define DETOK_CAP 65536
#define TICK_MS 100

struct loop_choice {
    loop_job *job;
    int index, prompt;
    uint64_t req_id;
    int in_engine, done;
    const char *finish;
    tok_stream *ts;
    char *pending;              /* decoded text not yet emitted (stop-string hold-back) */
    size_t plen, pcap;
    char *text;                 /* non-streaming: everything emitted (echo included) */
    size_t tlen, tcap;
    long long offset;           /* bytes of text produced so far (logprobs text_offset) */
    json_t *lp;                 /* non-streaming logprobs accumulator */
    int n_out;
    long long spec_verify, spec_draft, spec_accept;
    double t_last;
};

struct loop {
    uv_loop_t *uv;
    uv_async_t async;
    uv_timer_t timer;
    uv_work_t work;
    loop_config cfg;
    metrics *m;
    engine *eng;
    const tok_tokenizer *tok;
    int spec;
    _Atomic int state, failed, inflight;
    _Atomic uint64_t next_id;
    /* inbound, guarded by mu */
    pthread_mutex_t mu;
    loop_job *in_head, *in_tail;
    uint64_t *in_cancel;
    int n_in_cancel, cap_in_cancel;
    /* loop thread */
    loop_job *wait_head, *wait_tail;   /* submitted, not yet admitted */
    loop_job *buckets[N_BUCKETS];
    int n_jobs;
    uint64_t *cancels;
    int n_cancels, cap_cancels;
    int stepping, step_rc, handles_open;
    engine_output out;
    double drain_deadline, last_deadline_check;
    struct pollfd *pfd;
    loop_job **pfd_job;
    int cap_pfd;
    char *detok;
};

double loop_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void on_async(uv_async_t *h);
static void on_timer(uv_timer_t *h);

loop *loop_create(uv_loop_t *uv, const loop_config *cfg, metrics *m, char *err, size_t errlen) {
    loop *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->uv = uv;
    l->cfg = *cfg;
    l->m = m;
    atomic_store(&l->next_id, 1);
    pthread_mutex_init(&l->mu, NULL);
    l->detok = malloc(DETOK_CAP);
    if (!l->detok) goto fail;
    if (uv_async_init(uv, &l->async, on_async) || uv_timer_init(uv, &l->timer)) {
        specd_errf(err, errlen, SPECD_EIO, "libuv: cannot create loop handles");
        goto fail;
    }
    l->async.data = l->timer.data = l;
    l->handles_open = 1;
    uv_timer_start(&l->timer, on_timer, TICK_MS, TICK_MS);
    return l;
fail:
    free(l->detok);
    free(l);
    return NULL;
}

void loop_destroy(loop *l) {
    if (!l) return;
    for (loop_job *j = l->in_head, *n; j; j = n) n = j->next, loop_job_free(j);
    for (loop_job *j = l->wait_head, *n; j; j = n) n = j->next, loop_job_free(j);
    for (int b = 0; b < N_BUCKETS; b++)
        for (loop_job *j = l->buckets[b], *n; j; j = n) n = j->hnext, loop_job_free(j);
    pthread_mutex_destroy(&l->mu);
    free(l->in_cancel);
    free(l->cancels);
    free(l->pfd);
    free(l->pfd_job);
    free(l->detok);
    free(l);
}

void loop_set_engine(loop *l, engine *e) {
    l->eng = e;
    l->tok = engine_tokenizer(e);
    engine_stats st;
    engine_get_stats(e, &st);
    l->spec = st.num_draft_tokens > 0;
    metrics_set_engine(l->m, &st);
    atomic_store(&l->state, LOOP_READY);
}

loop_state loop_get_state(const loop *l) { return (loop_state)atomic_load(&l->state); }
int loop_engine_failed(const loop *l) { return atomic_load(&l->failed); }

void loop_job_free(loop_job *j) {
    if (!j) return;
    for (int i = 0; i < j->n_choices; i++) {
        loop_choice *c = &j->choices[i];
        if (c->ts) tok_stream_free(c->ts);
        free(c->pending);
        free(c->text);
        json_decref(c->lp);
    }
    free(j->choices);
    for (int p = 0; p < j->n_prompts; p++) {
        if (j->prompt_ids) free(j->prompt_ids[p]);
        if (j->echo_text) free(j->echo_text[p]);
    }
    free(j->prompt_ids);
    free(j->n_prompt_ids);
    free(j->echo_text);
    free(j->echo_len);
    api_request_free(j->req);
    sse_chan_unref(j->chan);
    free(j);
}

int loop_submit(loop *l, loop_job *job, uint64_t *id) {
    if (atomic_load(&l->state) != LOOP_READY || atomic_load(&l->failed)) {
        loop_job_free(job);
        return SPECD_ESTATE;
    }
    int want = job->n_prompts * job->req->n;
    int cap = l->cfg.max_batch + l->cfg.max_queued;
    if (atomic_fetch_add(&l->inflight, want) + want > cap) {
        atomic_fetch_sub(&l->inflight, want);
        loop_job_free(job);
        return SPECD_ENOSPACE;
    }
    job->id = atomic_fetch_add(&l->next_id, 1);
    *id = job->id;  /* before the job becomes visible to the loop, which may free it */
    job->next = NULL;
    pthread_mutex_lock(&l->mu);
    if (l->in_tail) l->in_tail->next = job;
    else l->in_head = job;
    l->in_tail = job;
    pthread_mutex_unlock(&l->mu);
    uv_async_send(&l->async);
    return 0;
}

void loop_cancel(loop *l, uint64_t job_id) {
    pthread_mutex_lock(&l->mu);
    if (l->n_in_cancel == l->cap_in_cancel) {
        int cap = l->cap_in_cancel ? l->cap_in_cancel * 2 : 64;
        uint64_t *n = realloc(l->in_cancel, (size_t)cap * sizeof *n);
        if (!n) {  /* the request still ends normally; only its early cancel is lost */
            pthread_mutex_unlock(&l->mu);
            return;
        }
        l->in_cancel = n;
        l->cap_in_cancel = cap;
    }
    l->in_cancel[l->n_in_cancel++] = job_id;
    pthread_mutex_unlock(&l->mu);
    uv_async_send(&l->async);
}

/* ================================ loop thread ================================ */

static loop_job *find_job(loop *l, uint64_t id) {
    for (loop_job *j = l->buckets[id % N_BUCKETS]; j; j = j->hnext)
        if (j->id == id) return j;
    return NULL;
}

static void unlink_job(loop *l, loop_job *job) {
    loop_job **pp = &l->buckets[job->id % N_BUCKETS];
    while (*pp && *pp != job) pp = &(*pp)->hnext;
    if (*pp) {
        *pp = job->hnext;
        l->n_jobs--;
    }
}

static void refresh_stats(loop *l) {
    if (!l->eng) return;
    engine_stats st;
    engine_get_stats(l->eng, &st);
    if (st.failed) atomic_store(&l->failed, 1);
    metrics_set_engine(l->m, &st);
}

static void push_json(loop_job *job, json_t *v) {
    size_t len;
    char *ev = api_sse_event(v, &len);
    json_decref(v);
    if (ev) sse_chan_push(job->chan, ev, len);
    free(ev);
}

static int buf_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t nc = *cap ? *cap : 256;
        while (nc < *len + n + 1) nc *= 2;
        char *nb = realloc(*buf, nc);
        if (!nb) return SPECD_ENOMEM;
        *buf = nb;
        *cap = nc;
    }
    if (n) memcpy(*buf + *len, s, n);  /* s may be NULL when n is 0 */
    *len += n;
    (*buf)[*len] = 0;
    return 0;
}

/* Send text (and this step's logprobs, stolen) of a choice to the client. A stream gets a
 * chunk for every step that produced tokens, even when their text is empty (held back,
 * partial character, no tokenizer): the write is also how a vanished client is noticed
 * (a parked MHD connection sees no disconnects), so it must happen per step. */
static void emit(loop *l, loop_choice *c, const char *s, size_t n, json_t *lp, int had_tokens) {
    loop_job *job = c->job;
    api_request *r = job->req;
    if (r->stream) {
        if (!n && !lp && !had_tokens) return;
        push_json(job, api_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, c->index, 0, s,
                                      n, NULL, lp, r->include_usage));
        return;
    }
    json_decref(lp);
    buf_append(&c->text, &c->tlen, &c->tcap, s, n);
}

static void finish_job(loop *l, loop_job *job);

static void finish_choice(loop *l, loop_choice *c, const char *reason) {
    if (c->done) return;
    c->done = 1;
    c->finish = reason;
    loop_job *job = c->job;
    if (job->req->stream && !job->error_status)
        push_json(job, api_chunk_json(job->req->kind, job->rid, job->created, l->cfg.model_name, c->index,
                                      0, NULL, 0, reason, NULL, job->req->include_usage));
    metrics_request_finished(l->m, reason);
    if (++job->n_done == job->n_choices) finish_job(l, job);
}

static void abort_choices(loop *l, loop_job *job) {
    for (int i = 0; i < job->n_choices; i++)
        if (job->choices[i].in_engine) {
            engine_abort(l->eng, job->choices[i].req_id);
            job->choices[i].in_engine = 0;
        }
}

static api_usage job_usage(loop *l, loop_job *job) {
    api_usage u = {0, 0, l->spec, 0, 0, 0};
    for (int p = 0; p < job->n_prompts; p++) u.prompt_tokens += job->n_prompt_ids[p];
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        u.completion_tokens += c->n_out;
        u.draft_tokens += c->spec_draft;
        u.accepted_tokens += c->spec_accept;
        u.verify_steps += c->spec_verify;
    }
    return u;
}

static void send_error_body(loop_job *job) {
    api_error e;
    api_fail(&e, job->error_status, job->error_type, NULL, NULL, "%s", job->error_msg);
    json_t *v = api_error_json(&e);
    if (job->req->stream) {
        push_json(job, v);
        sse_chan_push(job->chan, API_SSE_DONE, strlen(API_SSE_DONE));
        sse_chan_close(job->chan, 200);
        return;
    }
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    sse_chan_push_close(job->chan, s ? s : "", s ? strlen(s) : 0, job->error_status);
    free(s);
}

static void send_success(loop *l, loop_job *job) {
    api_request *r = job->req;
    api_usage u = job_usage(l, job);
    if (r->stream) {
        if (r->include_usage) push_json(job, api_usage_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, &u));
        sse_chan_push(job->chan, API_SSE_DONE, strlen(API_SSE_DONE));
        sse_chan_close(job->chan, 200);
        return;
    }
    json_t *choices = json_array();
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        json_t *lp = c->lp;
        c->lp = NULL;
        json_array_append_new(choices, r->kind == API_CHAT
                                            ? api_chat_choice(c->index, c->text, c->tlen, c->finish, lp)
                                            : api_completion_choice(c->index, c->text, c->tlen, c->finish, lp));
    }
    json_t *v = api_response_json(r->kind, job->rid, job->created, l->cfg.model_name, choices, &u);
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    if (!s) {
        job->error_status = 500;
        snprintf(job->error_msg, sizeof job->error_msg, "could not serialise the response");
        send_error_body(job);
        return;
    }
    sse_chan_push_close(job->chan, s, strlen(s), 200);
    free(s);
}

static void log_job(loop *l, loop_job *job, int status) {
    (void)l;
    api_usage u = job_usage(l, job);
    const char *finish = job->error_status ? "error" : job->cancelled ? "abort"
                                                      : job->n_choices ? job->choices[0].finish : NULL;
    log_request_line line = {job->rid, "POST", job->path, status, u.prompt_tokens, u.completion_tokens,
                             job->t_first > 0 ? job->t_first - job->t_arrival : -1.0,
                             loop_now() - job->t_arrival, finish};
    log_request(&line);
}

static void release_job(loop *l, loop_job *job) {
    unlink_job(l, job);
    atomic_fetch_sub(&l->inflight, job->n_prompts * job->req->n);
    loop_job_free(job);
}

static void finish_job(loop *l, loop_job *job) {
    abort_choices(l, job);
    if (job->error_status) send_error_body(job);
    else send_success(l, job);
    metrics_observe_e2e(l->m, loop_now() - job->t_arrival);
    log_job(l, job, job->error_status ? job->error_status : 200);
    release_job(l, job);
}

/* End a job with an error (engine failure, timeout, shutdown). */
static void fail_job(loop *l, loop_job *job, int status, const char *type, const char *msg) {
    if (!job->error_status) {
        job->error_status = status;
        job->error_type = type;
        snprintf(job->error_msg, sizeof job->error_msg, "%s", msg);
    }
    abort_choices(l, job);
    for (int i = 0; i < job->n_choices; i++)
        if (!job->choices[i].done) {
            job->choices[i].done = 1;
            job->choices[i].finish = "error";
            metrics_request_finished(l->m, "error");
        }
    job->n_done = job->n_choices;
    finish_job(l, job);
}

/* Admit one job: one engine request per choice. */
static void admit(loop *l, loop_job *job) {
    api_request *r = job->req;
    job->n_choices = job->n_prompts * r->n;
    job->choices = calloc((size_t)job->n_choices, sizeof *job->choices);
    job->hnext = l->buckets[job->id % N_BUCKETS];
    l->buckets[job->id % N_BUCKETS] = job;
    l->n_jobs++;
    if (!job->choices) {
        job->n_choices = 0;
        fail_job(l, job, 500, "server_error", "out of memory");
        return;
    }
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        c->job = job;
        c->index = i;
        c->prompt = i / r->n;
        c->req_id = (job->id << 8) | (uint64_t)i;
        if (l->tok && !(c->ts = tok_stream_new(l->tok, r->skip_special))) {
            fail_job(l, job, 500, "server_error", "out of memory");
            return;
        }
        if (r->logprobs >= 0 && !r->stream) c->lp = api_logprobs_new(r->kind);
    }
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        engine_sampling sp = r->sp;
        int np = job->n_prompt_ids[c->prompt];
        sp.max_tokens = r->max_tokens > 0 ? r->max_tokens : api_default_max_tokens(r->kind, np, l->cfg.max_seq_len);
        if (sp.has_seed) sp.seed += (uint64_t)(i % r->n);
        char err[256] = "";
        int rc = engine_add(l->eng, c->req_id, job->prompt_ids[c->prompt], np, &sp, err, sizeof err);
        if (rc) {
            int status = rc == SPECD_ERANGE || rc == SPECD_EINVAL ? 400 : rc == SPECD_ESTATE ? 503 : 500;
            fail_job(l, job, status, status == 400 ? "invalid_request_error" : "server_error", err);
            return;
        }
        c->in_engine = 1;
        c->t_last = loop_now();
    }
    /* Echo and the chat role chunk go out before any token. */
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        const char *echo = job->echo_text ? job->echo_text[c->prompt] : NULL;
        size_t elen = echo ? job->echo_len[c->prompt] : 0;
        if (r->stream && r->kind == API_CHAT)
            push_json(job, api_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, c->index, 1, "", 0,
                                          NULL, NULL, r->include_usage));
        if (echo && r->echo) {
            c->offset = (long long)elen;
            if (r->stream)
                push_json(job, api_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, c->index, 0,
                                              echo, elen, NULL, NULL, r->include_usage));
            else buf_append(&c->text, &c->tlen, &c->tcap, echo, elen);
        }
    }
}

/* Text of one token for logprobs (not the streamed text: that comes from tok_stream). */
static void token_text(loop *l, int32_t id, char *buf, size_t cap, size_t *len) {
    char *t = NULL;
    size_t n = 0;
    if (l->tok && !tok_decode(l->tok, &id, 1, 0, &t, &n) && t && n < cap) {
        memcpy(buf, t, n);
        *len = n;
    } else {
        *len = (size_t)snprintf(buf, cap, "token_id:%d", (int)id);
    }
    free(t);
}

static void add_logprobs(loop *l, loop_choice *c, json_t *lp, const engine_token *t) {
    char tok[256], tops[ENGINE_MAX_TOP_LOGPROBS][256];
    const char *top_ptr[ENGINE_MAX_TOP_LOGPROBS];
    size_t tok_len, top_len[ENGINE_MAX_TOP_LOGPROBS];
    token_text(l, t->id, tok, sizeof tok, &tok_len);
    int n_top = t->n_top < ENGINE_MAX_TOP_LOGPROBS ? t->n_top : ENGINE_MAX_TOP_LOGPROBS;
    for (int i = 0; i < n_top; i++) {
        token_text(l, t->top_ids[i], tops[i], sizeof tops[i], &top_len[i]);
        top_ptr[i] = tops[i];
    }
    api_logprobs_add(lp, c->job->req->kind, tok, tok_len, t->logprob, n_top, top_ptr, top_len,
                     t->top_logprobs, c->offset + (long long)c->plen);
}

/* Emit what the stop strings allow; returns 1 when a stop string ended the choice. With
 * final set, nothing more will come, so nothing is held back. */
static int drain_pending(loop *l, loop_choice *c, json_t *lp, int final, int had_tokens) {
    api_request *r = c->job->req;
    size_t n = 0;
    int hit = api_stop_scan(c->pending, c->plen, r->stop, r->n_stop, &n);
    if (final && !hit) n = c->plen;
    if (n || lp || had_tokens) emit(l, c, c->pending, n, lp, had_tokens);
    c->offset += (long long)n;
    if (c->plen > n) memmove(c->pending, c->pending + n, c->plen - n);
    c->plen -= n;
    if (hit) c->plen = 0;
    return hit;
}

static void on_event(loop *l, const engine_event *ev) {
    loop_job *job = find_job(l, ev->req_id >> 8);
    if (!job) return;  /* cancelled or already finished (stop string) */
    int idx = (int)(ev->req_id & 0xff);
    if (idx >= job->n_choices) return;
    loop_choice *c = &job->choices[idx];
    if (c->done) return;
    api_request *r = job->req;
    double now = loop_now();
    if (ev->finish != ENGINE_RUNNING) c->in_engine = 0;
    c->spec_verify = ev->spec_verify_steps;
    c->spec_draft = ev->spec_draft_tokens;
    c->spec_accept = ev->spec_accepted_tokens;
    if (ev->finish == ENGINE_FINISH_ERROR) {
        fail_job(l, job, 500, "server_error", "the engine failed while running this request");
        return;
    }
    if (ev->n_tokens > 0) {
        if (job->t_first <= 0) {
            job->t_first = now;
            metrics_observe_ttft(l->m, now - job->t_arrival);
        } else if (c->n_out > 0) {
            for (int i = 0; i < ev->n_tokens; i++) metrics_observe_itl(l->m, (now - c->t_last) / ev->n_tokens);
        }
        c->t_last = now;
    }
    json_t *lp = r->logprobs >= 0 ? (r->stream ? api_logprobs_new(r->kind) : json_incref(c->lp)) : NULL;
    int stopped = 0;
    for (int i = 0; i < ev->n_tokens && !stopped; i++) {
        const engine_token *t = &ev->tokens[i];
        c->n_out++;
        if (lp) add_logprobs(l, c, lp, t);
        if (c->ts) {
            int w = tok_stream_push(c->ts, t->id, l->detok, DETOK_CAP);
            if (w > 0 && buf_append(&c->pending, &c->plen, &c->pcap, l->detok, (size_t)w)) w = -1;
            if (w < 0) {
                json_decref(lp);
                fail_job(l, job, 500, "server_error", "detokenization failed");
                return;
            }
        }
        /* Check after every token so tokens past a stop string are not counted. */
        if (r->n_stop && c->plen) {
            size_t dummy;
            stopped = api_stop_scan(c->pending, c->plen, r->stop, r->n_stop, &dummy);
        }
    }
    int final = ev->finish != ENGINE_RUNNING;
    if (final && c->ts && !stopped) {
        int w = tok_stream_flush(c->ts, l->detok, DETOK_CAP);
        if (w > 0) buf_append(&c->pending, &c->plen, &c->pcap, l->detok, (size_t)w);
    }
    if (drain_pending(l, c, r->stream ? lp : (json_decref(lp), NULL), final, ev->n_tokens > 0 && !final)) {
        if (c->in_engine) {
            engine_abort(l->eng, c->req_id);
            c->in_engine = 0;
        }
        finish_choice(l, c, "stop");
        return;
    }
    if (final) finish_choice(l, c, api_finish_reason(ev->finish));
}

/* ---- scheduling --------------------------------------------------------------------------- */

static void pump(loop *l);

static void work_cb(uv_work_t *w) {
    loop *l = w->data;
    l->step_rc = engine_step(l->eng, &l->out);
}

static void after_work_cb(uv_work_t *w, int status) {
    loop *l = w->data;
    (void)status;
    l->stepping = 0;
    if (l->step_rc < 0 && l->step_rc != SPECD_ESTATE) {
        log_msg(LOG_ERROR, "engine step failed: %s; failing all requests", specd_strerror(l->step_rc));
        atomic_store(&l->failed, 1);
    }
    for (int i = 0; i < l->out.n_events; i++) on_event(l, &l->out.events[i]);
    refresh_stats(l);
    pump(l);
}

static void process_cancels(loop *l) {
    for (int i = 0; i < l->n_cancels; i++) {
        uint64_t id = l->cancels[i];
        loop_job *job = find_job(l, id);
        if (!job) {  /* maybe still waiting for admission */
            loop_job **pp = &l->wait_head, *prev = NULL;
            while (*pp && (*pp)->id != id) prev = *pp, pp = &(*pp)->next;
            if (!*pp) continue;
            job = *pp;
            *pp = job->next;
            if (l->wait_tail == job) l->wait_tail = prev;
            atomic_fetch_sub(&l->inflight, job->n_prompts * job->req->n);
            loop_job_free(job);
            continue;
        }
        job->cancelled = 1;
        abort_choices(l, job);
        for (int k = 0; k < job->n_choices; k++)
            if (!job->choices[k].done) metrics_request_finished(l->m, "abort");
        log_job(l, job, 499);  /* nginx's "client closed request" */
        release_job(l, job);
    }
    l->n_cancels = 0;
}

static void stop_loop(loop *l) {
    if (!l->handles_open) return;
    l->handles_open = 0;
    atomic_store(&l->state, LOOP_STOPPED);
    uv_close((uv_handle_t *)&l->async, NULL);
    uv_close((uv_handle_t *)&l->timer, NULL);
    uv_stop(l->uv);
}

/* The client of a job is gone: end it without a reply. */
static void client_gone(loop *l, loop_job *job) {
    job->cancelled = 1;
    abort_choices(l, job);
    for (int k = 0; k < job->n_choices; k++)
        if (!job->choices[k].done) metrics_request_finished(l->m, "abort");
    log_job(l, job, 499);  /* nginx's "client closed request" */
    sse_chan_close(job->chan, 499);  /* resumes a parked connection so MHD can clean it up */
    release_job(l, job);
}

/* MHD does not watch a suspended connection, so a client that hangs up while its request
 * waits (queued, or a non-streaming reply) would go unnoticed until the reply. One poll()
 * over the sockets of all in-flight jobs, every TICK_MS, finds them. A socket stays open
 * while its job is in the table: MHD never closes a suspended connection, and the handler
 * that submitted the job has not returned before it suspends. */
static void check_clients(loop *l) {
    if (!l->n_jobs) return;
    if (l->n_jobs > l->cap_pfd) {
        int cap = l->n_jobs * 2;
        struct pollfd *p = realloc(l->pfd, (size_t)cap * sizeof *p);
        loop_job **j = realloc(l->pfd_job, (size_t)cap * sizeof *j);
        if (p) l->pfd = p;
        if (j) l->pfd_job = j;
        if (!p || !j) return;
        l->cap_pfd = cap;
    }
    int n = 0;
    for (int b = 0; b < N_BUCKETS; b++)
        for (loop_job *j = l->buckets[b]; j; j = j->hnext)
            if (j->fd >= 0 && n < l->cap_pfd) {
                l->pfd[n] = (struct pollfd){.fd = j->fd, .events = POLLRDHUP};
                l->pfd_job[n++] = j;
            }
    if (poll(l->pfd, (nfds_t)n, 0) <= 0) return;
    for (int i = 0; i < n; i++)
        if (l->pfd[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) client_gone(l, l->pfd_job[i]);
}

/* Request timeouts and the drain deadline. Between steps only: fail_job aborts engine
 * requests. Runs at most every TICK_MS. */
static void check_deadlines(loop *l) {
    double now = loop_now();
    if (now - l->last_deadline_check < TICK_MS * 1e-3) return;
    l->last_deadline_check = now;
    check_clients(l);
    int past_drain = atomic_load(&l->state) == LOOP_DRAINING && now > l->drain_deadline;
    if (l->cfg.request_timeout <= 0 && !past_drain) return;
    for (int b = 0; b < N_BUCKETS; b++) {
        for (loop_job *j = l->buckets[b], *n; j; j = n) {
            n = j->hnext;
            if (past_drain)
                fail_job(l, j, 503, "server_error", "server is shutting down (drain timeout)");
            else if (now - j->t_arrival > l->cfg.request_timeout)
                fail_job(l, j, 504, "timeout", "request exceeded the server's request_timeout");
        }
    }
}

static void pump(loop *l) {
    if (l->stepping || !l->eng) return;
    process_cancels(l);
    while (l->wait_head) {
        loop_job *job = l->wait_head;
        l->wait_head = job->next;
        if (!l->wait_head) l->wait_tail = NULL;
        job->next = NULL;
        admit(l, job);
    }
    check_deadlines(l);
    refresh_stats(l);
    if (atomic_load(&l->state) == LOOP_DRAINING && !l->n_jobs) {
        stop_loop(l);
        return;
    }
    if (engine_has_work(l->eng)) {
        l->stepping = 1;
        l->work.data = l;
        if (uv_queue_work(l->uv, &l->work, work_cb, after_work_cb)) {
            l->stepping = 0;
            log_msg(LOG_ERROR, "cannot queue an engine step");
        }
    }
}

static void on_async(uv_async_t *h) {
    loop *l = h->data;
    pthread_mutex_lock(&l->mu);
    loop_job *head = l->in_head, *tail = l->in_tail;
    l->in_head = l->in_tail = NULL;
    if (l->n_in_cancel) {
        if (l->n_cancels + l->n_in_cancel > l->cap_cancels) {
            int cap = (l->n_cancels + l->n_in_cancel) * 2;
            uint64_t *n = realloc(l->cancels, (size_t)cap * sizeof *n);
            if (n) l->cancels = n, l->cap_cancels = cap;
        }
        if (l->n_cancels + l->n_in_cancel <= l->cap_cancels) {
            memcpy(l->cancels + l->n_cancels, l->in_cancel, (size_t)l->n_in_cancel * sizeof *l->cancels);
            l->n_cancels += l->n_in_cancel;
        }
        l->n_in_cancel = 0;
    }
    pthread_mutex_unlock(&l->mu);
    if (head) {
        if (l->wait_tail) l->wait_tail->next = head;
        else l->wait_head = head;
        l->wait_tail = tail;
    }
    pump(l);
}

static void on_timer(uv_timer_t *h) {
    /* Deadlines are checked in pump, between steps (the engine is busy during one). */
    pump(h->data);
}

void loop_drain(loop *l, double timeout) {
    if (atomic_load(&l->state) == LOOP_STOPPED) return;
    atomic_store(&l->state, LOOP_DRAINING);
    l->drain_deadline = loop_now() + timeout;
    log_msg(LOG_INFO, "draining: %d request(s) in flight, up to %.1fs", l->n_jobs, timeout);
    if (!l->eng) {
        stop_loop(l);
        return;
    }
    pump(l);
}
