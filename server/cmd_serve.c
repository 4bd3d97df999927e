/* `specd serve`: configuration, start-up (HTTP first so /health and /ready answer while
 * the model loads), the libuv loop, signals and drain.
 *
 * Shutdown: the first SIGTERM/SIGINT turns /ready to 503 and makes new requests 503;
 * in-flight requests get up to drain_timeout seconds, then the rest end with an error and
 * the process exits 0 once their replies are written. A second signal exits at once. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "engine/core/engine.h"
#include "server/cli.h"
#include "server/cmd.h"
#include "server/config.h"
#include "server/http.h"
#include "server/log.h"
#include "server/loop.h"
#include "server/metrics.h"

typedef struct {
    loop *lp;
    double drain_timeout;
    double drain_grace;
    http_server *http;
    uv_timer_t grace;
    int signals;
    int hard_exit;
    int group_failed;            /* tensor parallelism: the group broke, exit non-zero */
    uv_signal_t sigterm, sigint;
    uv_timer_t group_watch;
} serve_state;

/* A tensor-parallel group that failed (a rank hung past the step timeout, or a collective
 * failed) cannot recover: leave non-zero so the orchestrator restarts every rank. A rank
 * that dies is also caught by the watchdog (cli.c), which exits on its own. */
static void on_group_watch(uv_timer_t *t) {
    serve_state *s = t->data;
    if (s->group_failed || !loop_engine_failed(s->lp)) return;
    s->group_failed = 1;
    log_msg(LOG_ERROR, "tensor-parallel group failed: exiting");
    uv_timer_stop(t);
    loop_drain(s->lp, 0);
}

static void on_grace_over(uv_timer_t *t) {
    serve_state *s = t->data;
    log_msg(LOG_INFO, "drain grace over: new requests are refused now");
    loop_drain(s->lp, s->drain_timeout);
}

static void on_signal(uv_signal_t *h, int signum) {
    serve_state *s = h->data;
    if (++s->signals == 1) {
        const char *sig = signum == SIGINT ? "SIGINT" : "SIGTERM";
        if (s->drain_grace > 0) {
            /* Lame duck first: /ready says 503 so load balancers take this replica out,
             * while requests that still arrive are served; then the drain proper. */
            log_msg(LOG_INFO, "%s: /ready is 503; serving on for %.1fs of drain grace, then draining "
                    "(again to exit now)", sig, s->drain_grace);
            http_set_lame_duck(s->http);
            uv_timer_start(&s->grace, on_grace_over, (uint64_t)(s->drain_grace * 1000), 0);
            return;
        }
        log_msg(LOG_INFO, "%s: draining (again to exit now)", sig);
        loop_drain(s->lp, s->drain_timeout);
        return;
    }
    log_msg(LOG_WARN, "second signal: exiting now");
    s->hard_exit = 1;
    uv_stop(h->loop);
}

/* Default served name: the model's file or directory name without ".gguf". */
static void default_name(const char *path, char *out, size_t cap) {
    char tmp[SRV_PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", path);
    size_t n = strlen(tmp);
    while (n > 1 && tmp[n - 1] == '/') tmp[--n] = 0;
    const char *base = strrchr(tmp, '/');
    base = base ? base + 1 : tmp;
    snprintf(out, cap, "%s", base);
    size_t bl = strlen(out);
    if (bl > 5 && !strcmp(out + bl - 5, ".gguf")) out[bl - 5] = 0;
}

static void fill_engine_config(const srv_config *c, engine_config *ec) {
    memset(ec, 0, sizeof *ec);
    ec->model_path = c->model[0] ? c->model : NULL;
    ec->random_shape = c->shape[0] ? c->shape : NULL;
    ec->tokenizer_path = c->tokenizer[0] ? c->tokenizer : NULL;
    ec->chat_template_path = c->chat_template[0] ? c->chat_template : NULL;
    ec->draft_path = c->draft_model[0] ? c->draft_model : NULL;
    ec->draft_layers = c->draft_layers;
    ec->num_draft_tokens = c->num_draft_tokens;
    cli_speculative(c->speculative, &ec->spec_ngram);   /* checked when the config was read */
    cli_dtype(c->dtype, &ec->weights_dtype);
    cli_kv_dtype(c->kv_cache_dtype, &ec->kv_dtype);
    ec->ngram_min = c->ngram_min;
    ec->ngram_max = c->ngram_max;
    ec->spec_always = !c->spec_cost_model;
    ec->device = strcmp(c->device, "cuda") ? ENGINE_DEVICE_CPU : ENGINE_DEVICE_CUDA;
    ec->max_seq_len = c->max_seq_len;
    ec->max_batch = c->max_batch;
    ec->max_tokens_per_step = c->max_num_batched_tokens;
    ec->max_prefill_decoding = c->max_prefill_decoding;
    ec->keep_window_kv = c->keep_window_kv;
    ec->sync_scheduling = !c->async_scheduling;
    ec->mem_fraction = c->mem_fraction;
    ec->kv_bytes = (size_t)c->kv_cache_bytes;
    ec->threads = c->threads;
    ec->tp.world_size = c->tensor_parallel_size;
    ec->tp.nnodes = c->nnodes;
    ec->tp.node_rank = c->node_rank;
    snprintf(ec->tp.master_addr, sizeof ec->tp.master_addr, "%s", c->master_addr);
    ec->tp.master_port = c->master_port;
    /* The engine prints its start-up decisions as plain stderr lines: keep them out of a
     * JSON log (the "loaded" line below carries the essentials). */
    ec->verbose = log_enabled(LOG_INFO) && !c->log_json;
    engine_config_defaults(ec);
}

static void close_cb(uv_handle_t *h) { (void)h; }

static const char *env_get(const char *name) { return getenv(name); }

int cmd_serve(int argc, char **argv) {
    static srv_config cfg;  /* large (paths); lives for the whole process */
    srv_config_action act;
    char err[1024] = "";
    if (srv_config_load(&cfg, &act, argc, argv, env_get, err, sizeof err)) {
        fprintf(stderr, "specd serve: %s\n", err);
        return 2;
    }
    if (act.help) {
        srv_config_usage(stdout);
        return 0;
    }
    if (act.print_config) {
        char *s = srv_config_to_json(&cfg);
        if (!s) return 1;
        puts(s);
        free(s);
        return 0;
    }
    if (!cfg.model[0] == !cfg.shape[0]) {
        fprintf(stderr, "specd serve: give --model (or SPECD_MODEL, or \"model\" in --config), or --shape for "
                        "random weights, not both\n");
        return 2;
    }
    log_configure((log_level)log_level_parse(cfg.log_level), cfg.log_json);
    signal(SIGPIPE, SIG_IGN);
    /* Tensor parallelism: worker ranks (started by rank 0 with the same argv) run the
     * runner ops rank 0 sends and never serve HTTP. */
    engine_config ec;
    fill_engine_config(&cfg, &ec);
    int tp_exit;   /* argv - 1 is main()'s argv, which spawned worker ranks re-execute */
    if (cli_tp_enter(&ec, argv - 1, &tp_exit)) return tp_exit;
    char name[SRV_NAME_MAX];
    if (cfg.served_model_name[0]) snprintf(name, sizeof name, "%s", cfg.served_model_name);
    else default_name(cfg.model[0] ? cfg.model : cfg.shape, name, sizeof name);

    int rc = 1;
    engine *eng = NULL;
    http_server *http = NULL;
    loop *lp = NULL;
    metrics *m = metrics_create(name);
    uv_loop_t uv;
    serve_state st = {0};
    if (!m || uv_loop_init(&uv)) {
        log_msg(LOG_ERROR, "out of memory at start-up");
        metrics_destroy(m);
        return 1;
    }
    int out_threads = cfg.output_threads;
    if (!out_threads) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        out_threads = cores >= 16 ? 8 : cores >= 2 ? (int)cores / 2 : 1;
    }
    loop_config lc = {.max_seq_len = cfg.max_seq_len, .max_batch = cfg.max_batch, .max_queued = cfg.max_queued,
                      .request_timeout = cfg.request_timeout, .model_name = name, .overlap = cfg.overlap,
                      .output_threads = out_threads, .stream_buffer_bytes = (size_t)cfg.stream_buffer_bytes,
                      .total_buffer_bytes = (size_t)cfg.total_buffer_bytes, .stall_timeout = cfg.stall_timeout};
    if (!(lp = loop_create(&uv, &lc, m, err, sizeof err))) {
        log_msg(LOG_ERROR, "%s", err[0] ? err : "cannot create the serving loop");
        goto out;
    }
    if (!(http = http_start(&cfg, name, lp, m, err, sizeof err))) {
        log_msg(LOG_ERROR, "%s", err);
        goto out;
    }
    log_msg(LOG_INFO, "specd listening on http://%s:%d (model '%s'; /ready is 503 until loaded)", cfg.host,
            http_port(http), name);
    /* Load on this thread: the uv loop is not running yet and SIGTERM keeps its default
     * action, so a signal during a long load ends the process at once. */
    log_msg(LOG_INFO, "loading %s on %s ...", cfg.model[0] ? cfg.model : cfg.shape, cfg.device);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!(eng = engine_create(&ec, err, sizeof err))) {
        log_msg(LOG_ERROR, "cannot load the model: %s", err);
        goto out;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    engine_stats es;
    engine_get_stats(eng, &es);
    const model_config *mc = engine_model_config(eng);
    log_msg(LOG_INFO, "loaded in %.1fs: %s, %d layers, vocab %d, device %s, %d KV blocks, max_seq_len %d, "
            "max_batch %d, tokenizer %s, chat template %s%s",
            (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9, mc->arch_name,
            mc->n_layers, mc->vocab, engine_device_name(eng), es.kv_blocks_total, es.max_seq_len,
            es.max_batch, engine_tokenizer(eng) ? "yes" : "no", engine_template(eng) ? "yes" : "no",
            es.num_draft_tokens ? ", speculative decoding on" : "");
    /* Warm-up before /ready turns 200 (the loop does not run yet: this thread owns the
     * engine). A failed warm-up is a failed start: the same passes would fail traffic. */
    if (!strcmp(cfg.warmup, "on") || (!strcmp(cfg.warmup, "auto") && ec.device == ENGINE_DEVICE_CUDA)) {
        engine_warmup_info wi;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        err[0] = 0;
        http_set_warming(http, 1);
        const int wrc = engine_warmup(eng, &wi, err, sizeof err);
        http_set_warming(http, 0);
        if (wrc) {
            log_msg(LOG_ERROR, "warm-up failed: %s", err);
            goto out;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        log_msg(LOG_INFO, "warm-up: %d passes (prompts of 1-%d tokens, up to %d decoding together, sampled rows) in %.2fs",
                wi.passes, wi.max_prompt, wi.max_batch,
                (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
    }
    http_set_engine(http, eng);
    loop_set_engine(lp, eng);

    st.lp = lp;
    st.drain_timeout = cfg.drain_timeout;
    st.drain_grace = cfg.drain_grace;
    st.http = http;
    uv_timer_init(&uv, &st.grace);
    st.grace.data = &st;
    uv_signal_init(&uv, &st.sigterm);
    uv_signal_init(&uv, &st.sigint);
    st.sigterm.data = st.sigint.data = &st;
    uv_signal_start(&st.sigterm, on_signal, SIGTERM);
    uv_signal_start(&st.sigint, on_signal, SIGINT);
    uv_timer_init(&uv, &st.group_watch);
    st.group_watch.data = &st;
    if (ec.tp.world_size > 1) uv_timer_start(&st.group_watch, on_group_watch, 200, 200);
    log_msg(LOG_INFO, "ready");
    uv_run(&uv, UV_RUN_DEFAULT);
    if (st.hard_exit) return 1;  /* suspended connections and a running step: no teardown */

    /* The loop stopped after the drain. Stop accepting first (a connection that arrives now
     * is refused by the kernel, which a client or proxy sees at once, rather than accepted
     * and then dropped), then let the last replies reach their clients. */
    http_quiesce(http);
    for (int i = 0; i < 500 && http_pending(http) > 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    rc = st.group_failed ? 1 : 0;
    log_msg(LOG_INFO, "stopped");
out:
    http_stop(http);
    if (st.lp) {
        uv_close((uv_handle_t *)&st.sigterm, close_cb);
        uv_close((uv_handle_t *)&st.sigint, close_cb);
        uv_close((uv_handle_t *)&st.group_watch, close_cb);
        uv_close((uv_handle_t *)&st.grace, close_cb);
    }
    if (lp && loop_get_state(lp) != LOOP_STOPPED) loop_drain(lp, 0);
    uv_run(&uv, UV_RUN_DEFAULT);  /* run the close callbacks */
    loop_destroy(lp);
    engine_destroy(eng);
    uv_loop_close(&uv);
    metrics_destroy(m);
    return rc;
}
