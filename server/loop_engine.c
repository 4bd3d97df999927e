/* The engine thread of the serving loop (see loop_internal.h): it owns the engine, runs
 * steps back to back, and between two steps applies the loop's commands (submit prepared
 * requests, abort requests) in the order they were given. Each step's output is published
 * to the loop thread (l->pub, then step_async); the loop hands it back once processed.
 *
 * Overlap: a step may start while at most one earlier output is unprocessed (cfg.overlap)
 * or none (serial). The engine double-buffers events, so the output the loop is reading
 * is never the one the running step writes. No thread hop lies between two steps: the
 * next one starts as soon as the last returns, unless the loop is a whole step behind. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/core/err.h"
#include "server/log.h"
#include "server/loop_internal.h"

static int push_cmd(loop *l, loop_cmd c) {
    if (l->n_cmds == l->cap_cmds) {
        int cap = l->cap_cmds ? l->cap_cmds * 2 : 256;
        loop_cmd *n = realloc(l->cmds, (size_t)cap * sizeof *n);
        if (!n) return SPECD_ENOMEM;
        l->cmds = n;
        l->cap_cmds = cap;
    }
    l->cmds[l->n_cmds++] = c;
    pthread_cond_signal(&l->ecv);
    return 0;
}

int loop_engine_add(loop *l, uint64_t req_id, engine_pending *p) {
    pthread_mutex_lock(&l->emu);
    int rc = push_cmd(l, (loop_cmd){.op = CMD_ADD, .add = p, .req_id = req_id});
    pthread_mutex_unlock(&l->emu);
    if (rc) engine_pending_free(p);
    return rc;
}

static void post(loop *l, loop_cmd_op op, uint64_t req_id) {
    pthread_mutex_lock(&l->emu);
    int rc = push_cmd(l, (loop_cmd){.op = op, .req_id = req_id});
    pthread_mutex_unlock(&l->emu);
    if (rc)  /* an abort: the request runs to its end, its tokens dropped; a pause: it runs on */
        log_msg(LOG_ERROR, "out of memory: command %d for request %llu lost", (int)op, (unsigned long long)req_id);
}

void loop_abort_req(loop *l, uint64_t req_id) { post(l, CMD_ABORT, req_id); }
void loop_pause_req(loop *l, uint64_t req_id, int paused) { post(l, paused ? CMD_PAUSE : CMD_RESUME, req_id); }

/* Engine thread, emu held. A submit that fails is reported back through add_failed. */
static void apply_cmds(loop *l) {
    for (int i = 0; i < l->n_cmds; i++) {
        loop_cmd *c = &l->cmds[i];
        if (c->op != CMD_ADD) {   /* the request may have ended meanwhile: not found is fine */
            if (c->op == CMD_ABORT) engine_abort(l->eng, c->req_id);
            else engine_pause(l->eng, c->req_id, c->op == CMD_PAUSE);
            continue;
        }
        char err[256];
        if (!engine_submit(l->eng, c->add, err, sizeof err)) continue;
        log_msg(LOG_ERROR, "request %llu not queued: %s", (unsigned long long)c->req_id, err);
        if (l->n_add_failed == l->cap_add_failed) {
            int cap = l->cap_add_failed ? l->cap_add_failed * 2 : 64;
            uint64_t *n = realloc(l->add_failed, (size_t)cap * sizeof *n);
            if (!n) continue;  /* its job ends at its request timeout */
            l->add_failed = n;
            l->cap_add_failed = cap;
        }
        l->add_failed[l->n_add_failed++] = c->req_id;
    }
    l->n_cmds = 0;
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *engine_main(void *arg) {
    loop *l = arg;
    pthread_mutex_lock(&l->emu);
    for (;;) {
        apply_cmds(l);
        engine_get_stats(l->eng, &l->snap);
        if (l->quit) break;
        const int has_work = engine_has_work(l->eng);
        if (!has_work || l->n_pub > (l->cfg.overlap ? 1 : 0)) {
            const double t0 = has_work ? mono_s() : 0;
            pthread_cond_wait(&l->ecv, &l->emu);
            if (has_work) l->out_wait_s += mono_s() - t0;
            continue;
        }
        pthread_mutex_unlock(&l->emu);
        engine_output out;
        int rc = engine_step(l->eng, &out);
        pthread_mutex_lock(&l->emu);
        l->pub[(l->pub_head + l->n_pub) % 2] = (loop_step){out, rc};
        l->n_pub++;
        uv_async_send(&l->step_async);
    }
    pthread_mutex_unlock(&l->emu);
    return NULL;
}

int loop_engine_start(loop *l) {
    if (pthread_create(&l->eng_thread, NULL, engine_main, l)) return SPECD_ENOMEM;
    l->eng_started = 1;
    return 0;
}

void loop_engine_stop(loop *l) {
    if (!l->eng_started) return;
    pthread_mutex_lock(&l->emu);
    l->quit = 1;
    pthread_cond_signal(&l->ecv);
    pthread_mutex_unlock(&l->emu);
    pthread_join(l->eng_thread, NULL);
    l->eng_started = 0;
    for (int i = 0; i < l->n_cmds; i++)
        if (l->cmds[i].op == CMD_ADD) engine_pending_free(l->cmds[i].add);
    l->n_cmds = 0;
}

int loop_engine_next(loop *l, loop_step *s) {
    pthread_mutex_lock(&l->emu);
    int have = l->n_pub > 0;
    if (have) *s = l->pub[l->pub_head];
    pthread_mutex_unlock(&l->emu);
    return have;
}

void loop_engine_done(loop *l) {
    pthread_mutex_lock(&l->emu);
    l->pub_head = (l->pub_head + 1) % 2;
    l->n_pub--;
    pthread_cond_signal(&l->ecv);
    pthread_mutex_unlock(&l->emu);
}

int loop_engine_snapshot(loop *l, engine_stats *st, double *out_wait_s, uint64_t *failed, int cap) {
    pthread_mutex_lock(&l->emu);
    *st = l->snap;
    *out_wait_s = l->out_wait_s;
    int n = l->n_add_failed < cap ? l->n_add_failed : cap;
    if (n) {
        memcpy(failed, l->add_failed, (size_t)n * sizeof *failed);
        memmove(l->add_failed, l->add_failed + n, (size_t)(l->n_add_failed - n) * sizeof *failed);
        l->n_add_failed -= n;
    }
    pthread_mutex_unlock(&l->emu);
    return n;
}
