/* The serving loop's core (see loop.h and loop_internal.h): the inbound queue, admission,
 * and the engine steps on the libuv pool with host work overlapped.
 *
 * Everything below the "loop thread" marker runs on the loop thread only, so it needs no
 * locks; the only shared state is the inbound queue (mu), the atomics (state, failed,
 * inflight) and each job's sse_chan (which has its own lock). Engine request ids are
 * (job id << 8) | choice index, so an event finds its choice through the job table.
 *
 * Steps run on the engine thread (loop_engine.c), back to back. With overlap on, step N+1
 * runs while this thread processes step N's events. A choice that a stop string or a
 * vanished client ends in step N is therefore still in step N+1: its abort is applied when
 * step N+1 returns, and the token step N+1 made for it is dropped (its choice is done or
 * its job gone), never sent. max_tokens and stop tokens end a request inside the engine,
 * so they are exact either way. Admission validates and copies a request here
 * (engine_prepare: a bad prompt is a 400 at once) and the engine thread submits it. */
#include "server/loop_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/core/err.h"
#include "server/log.h"

double loop_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void on_async(uv_async_t *h);
static void on_timer(uv_timer_t *h);
static void on_step(uv_async_t *h);

loop *loop_create(uv_loop_t *uv, const loop_config *cfg, metrics *m, char *err, size_t errlen) {
    loop *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->uv = uv;
    l->cfg = *cfg;
    l->m = m;
    atomic_store(&l->next_id, 1);
    pthread_mutex_init(&l->mu, NULL);
    pthread_mutex_init(&l->emu, NULL);
    pthread_cond_init(&l->ecv, NULL);
    if (loop_output_init(l, cfg->output_threads)) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory for the output pool");
        goto fail;
    }
    if (uv_async_init(uv, &l->async, on_async) || uv_async_init(uv, &l->step_async, on_step) ||
        uv_timer_init(uv, &l->timer)) {
        specd_errf(err, errlen, SPECD_EIO, "libuv: cannot create loop handles");
        goto fail;
    }
    l->async.data = l->step_async.data = l->timer.data = l;
    l->handles_open = 1;
    uv_timer_start(&l->timer, on_timer, LOOP_TICK_MS, LOOP_TICK_MS);
    return l;
fail:
    loop_output_free(l);
    pthread_mutex_destroy(&l->mu);
    pthread_mutex_destroy(&l->emu);
    pthread_cond_destroy(&l->ecv);
    free(l);
    return NULL;
}

void loop_destroy(loop *l) {
    if (!l) return;
    loop_engine_stop(l);
    for (loop_job *j = l->in_head, *n; j; j = n) n = j->next, loop_job_free(j);
    for (loop_job *j = l->wait_head, *n; j; j = n) n = j->next, loop_job_free(j);
    for (int b = 0; b < LOOP_N_BUCKETS; b++)
        for (loop_job *j = l->buckets[b], *n; j; j = n) n = j->hnext, loop_job_free(j);
    pthread_mutex_destroy(&l->mu);
    free(l->in_cancel);
    free(l->cancels);
    free(l->pfd);
    free(l->pfd_job);
    free(l->cmds);
    free(l->add_failed);
    pthread_mutex_destroy(&l->emu);
    pthread_cond_destroy(&l->ecv);
    loop_output_free(l);
    free(l);
}

void loop_set_engine(loop *l, engine *e) {
    l->eng = e;
    l->tok = engine_tokenizer(e);
    engine_stats st;
    engine_get_stats(e, &st);
    l->spec = st.num_draft_tokens > 0;
    l->drafter = st.spec_drafter;
    metrics_set_engine(l->m, &st);
    l->snap = st;
    if (loop_engine_start(l)) {
        log_msg(LOG_ERROR, "cannot start the engine thread");
        atomic_store(&l->failed, 1);
    }
    atomic_store(&l->state, LOOP_READY);
}

loop_state loop_get_state(const loop *l) { return (loop_state)atomic_load(&l->state); }
int loop_engine_failed(const loop *l) { return atomic_load(&l->failed); }

void loop_job_free(loop_job *j) {
    if (!j) return;
    for (int i = 0; i < j->n_choices; i++) {
        loop_choice *c = &j->choices[i];
        if (c->ts) tok_stream_free(c->ts);
        rp_parser_free(c->rp);
        tc_parser_free(c->tc);
        free(c->pending);
        free(c->text);
        json_decref(c->lp);
        json_decref(c->prompt_lp);
        api_rstream_free(c->rs);
        api_mstream_free(c->ms);
    }
    free(j->choices);
    grammar_unref(j->tool_grammar);
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
    if (want > cap) {   /* could never be admitted, however long the client retries */
        loop_job_free(job);
        return SPECD_ERANGE;
    }
    if (atomic_fetch_add(&l->inflight, want) + want > cap) {
        atomic_fetch_sub(&l->inflight, want);
        loop_job_free(job);
        return SPECD_ENOSPACE;
    }
    job->seats = want;
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

loop_job *loop_find_job(loop *l, uint64_t id) {
    for (loop_job *j = l->buckets[id % LOOP_N_BUCKETS]; j; j = j->hnext)
        if (j->id == id) return j;
    return NULL;
}

static void unlink_job(loop *l, loop_job *job) {
    loop_job **pp = &l->buckets[job->id % LOOP_N_BUCKETS];
    while (*pp && *pp != job) pp = &(*pp)->hnext;
    if (*pp) {
        *pp = job->hnext;
        l->n_jobs--;
    }
}

void loop_give_seats(loop *l, loop_job *job) {
    atomic_fetch_sub(&l->inflight, job->seats);
    job->seats = 0;
}

void loop_release_job(loop *l, loop_job *job) {
    unlink_job(l, job);
    if (job->paused) l->n_paused--;
    loop_give_seats(l, job);
    loop_job_free(job);
}

void loop_abort_choices(loop *l, loop_job *job) {
    for (int i = 0; i < job->n_choices; i++)
        if (job->choices[i].in_engine) {
            loop_abort_req(l, job->choices[i].req_id);
            job->choices[i].in_engine = 0;
        }
}

/* Engine counters into the metrics (the engine thread's latest snapshot); jobs whose
 * request the engine could not take are failed. */
static void refresh_stats(loop *l) {
    if (!l->eng) return;
    engine_stats st;
    uint64_t failed[64];
    double out_wait_s;
    int n;
    while ((n = loop_engine_snapshot(l, &st, &out_wait_s, failed, 64)) > 0)
        for (int i = 0; i < n; i++) {
            loop_job *job = loop_find_job(l, failed[i] >> 8);
            if (job) loop_fail_job(l, job, 503, "server_error", "the engine could not take the request");
        }
    if (st.failed) atomic_store(&l->failed, 1);
    metrics_set_engine(l->m, &st);
    metrics_set_engine_wait(l->m, out_wait_s);
    metrics_set_host_output(l->m, (double)atomic_load(&l->host_ns) * 1e-9,
                            (unsigned long long)atomic_load(&l->host_tokens));
}

/* Admit one job: one engine request per choice. */
static void admit(loop *l, loop_job *job) {
    api_request *r = job->req;
    job->n_choices = job->n_prompts * r->n;
    job->choices = calloc((size_t)job->n_choices, sizeof *job->choices);
    job->hnext = l->buckets[job->id % LOOP_N_BUCKETS];
    l->buckets[job->id % LOOP_N_BUCKETS] = job;
    l->n_jobs++;
    if (!job->choices) {
        job->n_choices = 0;
        loop_fail_job(l, job, 500, "server_error", "out of memory");
        return;
    }
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        c->job = job;
        c->index = i;
        c->prompt = i / r->n;
        c->req_id = (job->id << 8) | (uint64_t)i;
        if (l->tok && !(c->ts = tok_stream_new(l->tok, r->skip_special))) {
            loop_fail_job(l, job, 500, "server_error", "out of memory");
            return;
        }
        if (r->logprobs >= 0 && !r->stream) c->lp = api_logprobs_new(r->kind);
    }
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        engine_sampling sp = r->sp;
        if (job->tool_grammar) sp.grammar = job->tool_grammar;
        int np = job->n_prompt_ids[c->prompt];
        sp.max_tokens = r->max_tokens >= 0 ? r->max_tokens : api_default_max_tokens(r->kind, np, l->cfg.max_seq_len);
        if (sp.has_seed) sp.seed += (uint64_t)(i % r->n);
        char err[256] = "";
        engine_pending *p;
        int rc = engine_prepare(l->eng, c->req_id, job->prompt_ids[c->prompt], np, &sp, &p, err, sizeof err);
        if (!rc && (rc = loop_engine_add(l, c->req_id, p))) snprintf(err, sizeof err, "out of memory");
        if (rc) {
            int status = rc == SPECD_ERANGE || rc == SPECD_EINVAL ? 400 : rc == SPECD_ESTATE ? 503 : 500;
            loop_fail_job(l, job, status, status == 400 ? "invalid_request_error" : "server_error", err);
            return;
        }
        c->in_engine = 1;
        c->t_last = loop_now();
    }
    /* Echo and the chat role chunk go out before any token. */
    loop_output_start(l, job);
}

static void stop_loop(loop *l) {
    if (!l->handles_open) return;
    l->handles_open = 0;
    atomic_store(&l->state, LOOP_STOPPED);
    loop_engine_stop(l);
    uv_close((uv_handle_t *)&l->async, NULL);
    uv_close((uv_handle_t *)&l->step_async, NULL);
    uv_close((uv_handle_t *)&l->timer, NULL);
    uv_stop(l->uv);
}

/* ---- steps ------------------------------------------------------------------------------ */

/* Published steps, oldest first: their events become text while the next step runs. */
static void on_step(uv_async_t *h) {
    loop *l = h->data;
    loop_step st;
    while (loop_engine_next(l, &st)) {
        if (st.rc < 0 && st.rc != SPECD_ESTATE) {
            log_msg(LOG_ERROR, "engine step failed: %s; failing all requests", specd_strerror(st.rc));
            atomic_store(&l->failed, 1);
        }
        loop_output_process(l, &st.out);
        loop_engine_done(l);
    }
    loop_pump(l);
}

/* Between and beside steps: cancels, admission, deadlines, metrics, the end of a drain. */
void loop_pump(loop *l) {
    if (!l->eng || !l->handles_open) return;
    loop_process_cancels(l);
    while (l->wait_head) {
        loop_job *job = l->wait_head;
        l->wait_head = job->next;
        if (!l->wait_head) l->wait_tail = NULL;
        job->next = NULL;
        admit(l, job);
    }
    loop_check_deadlines(l);
    loop_check_paused(l);
    refresh_stats(l);
    if (atomic_load(&l->state) == LOOP_DRAINING && !l->n_jobs) {
        pthread_mutex_lock(&l->mu);
        int inbound = l->in_head != NULL;   /* submitted before the drain, not picked up yet */
        pthread_mutex_unlock(&l->mu);
        if (inbound) uv_async_send(&l->async);
        else stop_loop(l);
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
    loop_pump(l);
}

static void on_timer(uv_timer_t *h) { loop_pump(h->data); }

void loop_drain(loop *l, double timeout) {
    if (atomic_load(&l->state) == LOOP_STOPPED) return;
    atomic_store(&l->state, LOOP_DRAINING);
    l->drain_deadline = loop_now() + timeout;
    log_msg(LOG_INFO, "draining: %d request(s) in flight, up to %.1fs", l->n_jobs, timeout);
    if (!l->eng) {
        stop_loop(l);
        return;
    }
    loop_pump(l);
}
