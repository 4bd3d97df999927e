/* cmocka tests for the continuous-batching scheduler (engine/core/sched.c) on top of the real
 * block manager. A tiny simulated engine plays the other side of a step: it advances
 * n_computed by what was fed, commits the KV, and appends "sampled" tokens that depend
 * only on (request, position), so runs with and without preemption must end identical. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/err.h"
#include "engine/core/kv.h"
#include "engine/core/sched.h"

enum { H_MAX_SEQS = 1500, H_MAX_TOK = 256 };

typedef struct {
    sched_seq q;
    int32_t tok[H_MAX_TOK];
    int max_new;         /* generated tokens at which the request finishes */
    int live, done;
    int computed_total;  /* every token fed to the model, recomputation included */
    int was_decoding;    /* running and past its prompt when the step was scheduled (h_schedule) */
} h_seq;

typedef struct {
    kv_pool *kv;
    kv_pool *win;        /* a window pool (h_add_window_pool), or NULL */
    int window;
    sched *s;
    sched_config cfg;
    h_seq seq[H_MAX_SEQS];
    int n_seq;
    uint64_t rng;
    int spec;            /* simulate speculation: append 1..1+lookahead tokens per step */
} harness;

static harness *h_new(int num_blocks, int bs, int cache, int max_batch, int budget,
                      int max_seq_len, int lookahead) {
    static harness h;   /* large; one at a time */
    memset(&h, 0, sizeof(h));
    char err[256] = "";
    kv_pool_config kc = {.num_blocks = num_blocks, .block_size = bs, .enable_prefix_cache = cache};
    h.kv = kv_pool_create(&kc, err, sizeof(err));
    if (!h.kv) fail_msg("kv_pool_create: %s", err);
    h.cfg = (sched_config){.max_batch = max_batch, .max_tokens_per_step = budget,
                           .max_seq_len = max_seq_len, .lookahead = lookahead};
    h.s = sched_create(&h.cfg, h.kv, err, sizeof(err));
    if (!h.s) fail_msg("sched_create: %s", err);
    h.rng = 0x9e3779b97f4a7c15ULL;
    return &h;
}

/* Recreate the scheduler from h->cfg (before any request is added). */
static void h_remake(harness *h) {
    char err[256] = "";
    sched_destroy(h->s);
    h->s = sched_create(&h->cfg, h->kv, err, sizeof(err));
    if (!h->s) fail_msg("sched_create: %s", err);
}

/* A window pool of win_blocks blocks beside the main pool (before any request). */
static void h_add_window_pool(harness *h, int win_blocks, int window) {
    char err[256] = "";
    kv_pool_config kc = {.num_blocks = win_blocks, .block_size = kv_block_size(h->kv), .enable_prefix_cache = 1};
    h->win = kv_pool_create(&kc, err, sizeof(err));
    if (!h->win) fail_msg("kv_pool_create: %s", err);
    h->window = window;
    h->cfg.win = h->win;
    h->cfg.window = window;
    h_remake(h);
}

static void h_free(harness *h) {
    for (int i = 0; i < h->n_seq; i++) {
        if (h->seq[i].live) sched_remove(h->s, &h->seq[i].q);
        kv_seq_destroy(&h->seq[i].q.kv);
        kv_seq_destroy(&h->seq[i].q.kvw);
    }
    sched_destroy(h->s);
    kv_pool_destroy(h->kv);
    kv_pool_destroy(h->win);
}

/* The "model": the token sampled at position pos of request id. */
static int32_t gen_token(uint64_t id, int pos) { return (int32_t)((id * 7 + (uint64_t)pos * 3) % 13); }

/* Add a request whose prompt is stem tokens (shared between requests with the same stem)
 * followed by n - stem_len tokens unique to it. Returns its index, or the sched_add code. */
static int h_add(harness *h, int n_prompt, int stem, int stem_len, int max_new) {
    assert_true(h->n_seq < H_MAX_SEQS && n_prompt + max_new <= H_MAX_TOK);
    int i = h->n_seq;
    h_seq *x = &h->seq[i];
    memset(x, 0, sizeof(*x));
    assert_int_equal(kv_seq_init(&x->q.kv, (h->cfg.max_seq_len + h->cfg.lookahead +
                                            kv_block_size(h->kv) - 1) / kv_block_size(h->kv)), 0);
    if (h->win) assert_int_equal(kv_seq_init(&x->q.kvw, x->q.kv.cap), 0);
    for (int t = 0; t < n_prompt; t++)
        x->tok[t] = t < stem_len ? (int32_t)(1000 + stem * 100 + t) : (int32_t)(5000 + i * 200 + t);
    x->q.id = (uint64_t)i;
    x->q.tokens = x->tok;
    x->q.n_tokens = n_prompt;
    x->q.n_prompt = n_prompt;
    x->max_new = max_new;
    h->n_seq++;
    int rc = sched_add(h->s, &x->q);
    if (rc != 0) return rc;
    x->live = 1;
    return i;
}

static uint64_t h_rand(harness *h) {
    h->rng ^= h->rng << 13;
    h->rng ^= h->rng >> 7;
    h->rng ^= h->rng << 17;
    return h->rng;
}

static void h_check(harness *h, const kv_seq *const *extra, int n_extra) {
    const kv_seq *t[H_MAX_SEQS * 2];
    int n = 0;
    for (int i = 0; i < h->n_seq; i++) t[n++] = &h->seq[i].q.kv;
    for (int i = 0; i < n_extra; i++) t[n++] = extra[i];
    char err[256] = "";
    if (kv_check(h->kv, t, n, err, sizeof(err)) != 0) fail_msg("%s", err);
    if (sched_check(h->s, err, sizeof(err)) != 0) fail_msg("%s", err);
    if (!h->win) return;
    n = 0;
    for (int i = 0; i < h->n_seq; i++) t[n++] = &h->seq[i].q.kvw;
    if (kv_check(h->win, t, n, err, sizeof(err)) != 0) fail_msg("window pool: %s", err);
}

/* Properties every batch must have, whatever the scenario. */
static void h_check_batch(harness *h, const sched_batch *b) {
    int sum = 0, bs = kv_block_size(h->kv), prefill = 0, decoding = 0;
    assert_true(b->n <= h->cfg.max_batch);
    for (int i = 0; i < b->n; i++) {
        const sched_seq *q = b->seqs[i];
        assert_int_equal(q->state, SEQ_RUNNING);
        assert_true(q->slot >= 0 && q->slot < h->cfg.max_batch);
        assert_true(b->n_new[i] >= 1 && q->n_computed + b->n_new[i] <= q->n_tokens);
        for (int j = 0; j < i; j++) {
            assert_ptr_not_equal(b->seqs[j], q);
            assert_int_not_equal(b->seqs[j]->slot, q->slot);
        }
        int need = q->n_computed + b->n_new[i];
        if (q->n_computed >= q->n_prompt) need += h->cfg.lookahead;
        int cap = q->kv.cap * bs;
        assert_true(q->kv.n_blocks * bs >= (need < cap ? need : cap));
        if (h->win) {   /* the window table: as long, live from where the first query's window starts */
            assert_int_equal(q->kvw.n_blocks, q->kv.n_blocks);
            int lo = q->n_computed - h->window + 1 > 0 ? (q->n_computed - h->window + 1) / bs : 0;
            for (int k = lo; k < q->kvw.n_blocks; k++) assert_true(q->kvw.blocks[k] > 0);
        }
        sum += b->n_new[i];
        /* prompt tokens: a prompt chunk, or a sequence (re)admitted in this step */
        if (q->n_computed < q->n_prompt || !h->seq[q->id].was_decoding) prefill += b->n_new[i];
        else decoding = 1;
    }
    assert_true(sum <= h->cfg.max_tokens_per_step);
    if (decoding && h->cfg.max_prefill_decoding > 0) assert_true(prefill <= h->cfg.max_prefill_decoding);
}

/* Play the engine for one scheduled batch. */
static void h_engine(harness *h, const sched_batch *b) {
    h_check_batch(h, b);
    for (int i = 0; i < b->n; i++) {
        sched_seq *q = b->seqs[i];
        h_seq *x = &h->seq[q->id];
        q->n_computed += b->n_new[i];
        x->computed_total += b->n_new[i];
        kv_seq_commit(h->kv, &q->kv, q->tokens, q->n_computed);
        if (h->win) {   /* as the engine does (commit_kv) */
            kv_seq_commit(h->win, &q->kvw, q->tokens, q->n_computed);
            kv_seq_drop_front(h->win, &q->kvw, kv_window_drop_upto(q->n_computed, h->window, kv_block_size(h->win)));
        }
        if (q->n_computed < q->n_tokens) continue;   /* mid-prefill chunk: no logits used */
        int gen = h->spec ? 1 + (int)(h_rand(h) % (uint64_t)(h->cfg.lookahead + 1)) : 1;
        for (int g = 0; g < gen && q->n_tokens - q->n_prompt < x->max_new; g++) {
            q->tokens[q->n_tokens] = gen_token(q->id, q->n_tokens);
            q->n_tokens++;
        }
        if (q->n_tokens - q->n_prompt >= x->max_new) {
            sched_remove(h->s, q);
            x->live = 0;
            x->done = 1;
        }
    }
    for (int i = 0; i < b->n_rejected; i++) {
        h_seq *x = &h->seq[b->rejected[i]->id];
        sched_remove(h->s, &x->q);
        x->live = 0;
    }
}

/* sched_schedule, noting which sequences were decoding before it (h_check_batch). */
static void h_schedule(harness *h, sched_batch *b) {
    for (int i = 0; i < h->n_seq; i++) {
        const sched_seq *q = &h->seq[i].q;
        h->seq[i].was_decoding = h->seq[i].live && q->state == SEQ_RUNNING && q->n_computed >= q->n_prompt && !q->paused;
    }
    assert_int_equal(sched_schedule(h->s, b), 0);
}

static void h_step(harness *h, sched_batch *b) {
    h_schedule(h, b);
    h_engine(h, b);
    h_check(h, NULL, 0);
}

/* ---- tests -------------------------------------------------------------------------- */

static void test_sched_token_budget_respected(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 0, 8, 10, 64, 0);
    for (int i = 0; i < 3; i++) assert_int_equal(h_add(h, 7, i, 0, 5), i);
    sched_batch b;
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 2);                 /* 7 + 3 = 10: the third gets no budget */
    assert_ptr_equal(b.seqs[0], &h->seq[0].q);
    assert_ptr_equal(b.seqs[1], &h->seq[1].q);
    assert_int_equal(b.n_new[0], 7);
    assert_int_equal(b.n_new[1], 3);
    assert_int_equal(sched_num_running(h->s), 2);
    assert_int_equal(sched_num_waiting(h->s), 1);
    h_engine(h, &b);
    /* Step 2: 1 decode + 4 rest of prefill, then 5 for the third. */
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 3);
    assert_int_equal(b.n_new[0], 1);
    assert_int_equal(b.n_new[1], 4);
    assert_int_equal(b.n_new[2], 5);
    h_engine(h, &b);
    h_free(h);
}

static void test_sched_chunked_prefill_splits_long_prompt(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 0, 4, 8, 64, 0);
    assert_int_equal(h_add(h, 20, 0, 0, 3), 0);
    sched_seq *q = &h->seq[0].q;
    int want_new[] = {8, 8, 4, 1, 1};
    int want_computed[] = {8, 16, 20, 21, 22};
    int want_blocks[] = {2, 4, 5, 6, 6};
    sched_batch b;
    for (int step = 0; step < 5; step++) {
        assert_int_equal(sched_schedule(h->s, &b), 0);
        assert_int_equal(b.n, 1);
        assert_int_equal(b.n_new[0], want_new[step]);
        assert_int_equal(q->kv.n_blocks, want_blocks[step]);
        h_engine(h, &b);
        if (step < 4) assert_int_equal(q->n_computed, want_computed[step]);
    }
    assert_int_equal(h->seq[0].done, 1);
    assert_int_equal(h->seq[0].computed_total, 22);
    h_free(h);
}

static void test_sched_decode_first_then_admission(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 0, 4, 8, 64, 0);
    assert_int_equal(h_add(h, 3, 0, 0, 10), 0);
    sched_batch b;
    h_step(h, &b);                            /* prefill of the first */
    assert_int_equal(h_add(h, 30, 1, 0, 2), 1);
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 2);
    assert_ptr_equal(b.seqs[0], &h->seq[0].q);   /* the decode comes first */
    assert_int_equal(b.n_new[0], 1);
    assert_ptr_equal(b.seqs[1], &h->seq[1].q);
    assert_int_equal(b.n_new[1], 7);             /* the rest of the budget */
    h_engine(h, &b);
    h_free(h);
}

/* max_prefill_decoding: while a sequence decodes, prompt chunks (a running one's and
 * admissions alike) share that many tokens per step, oldest first; once nothing decodes
 * the whole budget feeds prompts again. */
static void test_sched_prefill_capped_while_decoding(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 0, 4, 32, 64, 0);
    h->cfg.max_prefill_decoding = 8;
    h_remake(h);
    assert_int_equal(h_add(h, 3, 0, 0, 3), 0);
    sched_batch b;
    h_step(h, &b);                               /* nothing decodes yet: the whole prompt */
    assert_int_equal(b.n_new[0], 3);
    assert_int_equal(h_add(h, 30, 1, 0, 2), 1);
    assert_int_equal(h_add(h, 20, 2, 0, 2), 2);
    for (int step = 0; step < 2; step++) {       /* the decode, and 8 prompt tokens of the oldest */
        h_step(h, &b);
        assert_int_equal(b.n, 2);
        assert_ptr_equal(b.seqs[0], &h->seq[0].q);
        assert_int_equal(b.n_new[0], 1);
        assert_ptr_equal(b.seqs[1], &h->seq[1].q);
        assert_int_equal(b.n_new[1], 8);
    }
    assert_int_equal(h->seq[0].done, 1);
    h_step(h, &b);                               /* nothing decodes: the rest, and a newcomer */
    assert_int_equal(b.n, 2);
    assert_int_equal(b.n_new[0], 14);
    assert_ptr_equal(b.seqs[1], &h->seq[2].q);
    assert_int_equal(b.n_new[1], 18);
    h_free(h);
}

static void test_sched_max_batch_respected_and_slots_recycled(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 0, 2, 100, 64, 0);
    for (int i = 0; i < 4; i++) assert_int_equal(h_add(h, 3, i, 0, 1 + 2 * i), i);
    sched_batch b;
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 2);
    assert_int_equal(h->seq[0].q.slot, 0);
    assert_int_equal(h->seq[1].q.slot, 1);
    assert_int_equal(h->seq[2].q.slot, -1);
    assert_int_equal(h->seq[0].q.slot_epoch, 1);
    assert_int_equal(sched_num_waiting(h->s), 2);
    h_engine(h, &b);                          /* seq 0 (max_new 1) finishes: slot 0 free */
    assert_int_equal(h->seq[0].done, 1);
    assert_int_equal(h->seq[0].q.slot, -1);
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 2);
    assert_ptr_equal(b.seqs[1], &h->seq[2].q);
    assert_int_equal(h->seq[2].q.slot, 0);
    assert_int_equal(h->seq[2].q.slot_epoch, 1);
    assert_int_equal(sched_num_running(h->s), 2);
    h_engine(h, &b);
    h_free(h);
}

static void test_sched_preempts_newest_when_blocks_run_out(void **state) {
    (void)state;
    /* 6 allocatable blocks of 4: three 8-token prompts fill the pool exactly. */
    harness *h = h_new(7, 4, 0, 4, 100, 64, 0);
    for (int i = 0; i < 3; i++) assert_int_equal(h_add(h, 8, i, 0, 4), i);
    sched_batch b;
    h_step(h, &b);
    assert_int_equal(b.n, 3);
    assert_int_equal(kv_num_free(h->kv), 0);
    /* Each now needs a third block: the oldest preempts the newest (2), the second takes
     * one of the two freed blocks. */
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 2);
    assert_ptr_equal(b.seqs[0], &h->seq[0].q);
    assert_ptr_equal(b.seqs[1], &h->seq[1].q);
    assert_int_equal(b.n_preempted, 1);
    sched_seq *c = &h->seq[2].q;
    assert_ptr_equal(b.preempted[0], c);
    assert_int_equal(c->state, SEQ_WAITING);
    assert_int_equal(c->n_computed, 0);
    assert_int_equal(c->slot, -1);
    assert_int_equal(c->kv.n_blocks, 0);
    assert_int_equal(c->n_preemptions, 1);
    assert_int_equal(c->n_tokens, 9);         /* its generated token is kept */
    sched_seq *w[4];
    assert_int_equal(sched_waiting(h->s, w, 4), 1);
    assert_ptr_equal(w[0], c);
    h_engine(h, &b);
    h_check(h, NULL, 0);
    for (int step = 0; step < 40 && sched_num_running(h->s) + sched_num_waiting(h->s); step++)
        h_step(h, &b);
    for (int i = 0; i < 3; i++) assert_int_equal(h->seq[i].done, 1);
    /* Recompute: its 8-token prompt was fed once, then all 9 tokens again (nothing is
     * cached), then 2 decodes for its last 2 tokens. */
    assert_int_equal(h->seq[2].computed_total, 8 + 9 + 2);
    assert_int_equal(h->seq[2].q.n_preemptions, 1);
    assert_int_equal(kv_num_free(h->kv), 6);
    h_free(h);
}

static void test_sched_newest_preempts_itself(void **state) {
    (void)state;
    /* Old a holds 1 block with room; new b fills the rest and then needs one more. */
    harness *h = h_new(4, 4, 0, 4, 100, 64, 0);
    assert_int_equal(h_add(h, 2, 0, 0, 2), 0);
    assert_int_equal(h_add(h, 8, 1, 0, 2), 1);
    sched_batch b;
    h_step(h, &b);
    assert_int_equal(kv_num_free(h->kv), 0);
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 1);
    assert_ptr_equal(b.seqs[0], &h->seq[0].q);
    assert_int_equal(b.n_preempted, 1);
    assert_ptr_equal(b.preempted[0], &h->seq[1].q);
    assert_int_equal(h->seq[1].q.state, SEQ_WAITING);
    h_engine(h, &b);
    h_check(h, NULL, 0);
    h_free(h);
}

static void test_sched_no_admission_in_a_step_that_preempted(void **state) {
    (void)state;
    /* 4 blocks of 4, budget 5: a (4 tokens) decodes while c (12) prefills in chunks. */
    harness *h = h_new(5, 4, 0, 4, 5, 64, 0);
    assert_int_equal(h_add(h, 4, 0, 0, 20), 0);
    assert_int_equal(h_add(h, 12, 1, 0, 20), 1);
    sched_seq *a = &h->seq[0].q, *c = &h->seq[1].q;
    sched_batch b;
    h_step(h, &b);                             /* a 4, c 1 */
    h_step(h, &b);                             /* a 1, c 4: 2 + 2 blocks, pool full */
    assert_int_equal(kv_num_free(h->kv), 0);
    assert_int_equal(c->n_computed, 5);
    /* c needs a third block: it is the newest, so it preempts itself. Its 2 blocks and 4
     * tokens of budget would fit a first chunk again, but re-admitting it in the same
     * step would only thrash. */
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 1);
    assert_ptr_equal(b.seqs[0], a);
    assert_int_equal(b.n_preempted, 1);
    assert_ptr_equal(b.preempted[0], c);
    assert_int_equal(c->state, SEQ_WAITING);
    assert_int_equal(kv_num_free(h->kv), 2);
    h_engine(h, &b);
    h_check(h, NULL, 0);
    /* Next step it is admitted again from scratch. */
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 2);
    assert_ptr_equal(b.seqs[1], c);
    assert_int_equal(b.n_new[1], 4);
    assert_int_equal(c->n_computed, 0);
    assert_int_equal(c->slot_epoch, 2);
    h_engine(h, &b);
    h_free(h);
}

/* Run a fixed workload to completion; returns the number of preemptions seen. */
static int run_workload(harness *h, int n_req, int max_steps) {
    for (int i = 0; i < n_req; i++)
        assert_int_equal(h_add(h, 3 + (i * 7) % 17, i % 3, (i % 2) * 4, 2 + (i * 5) % 9), i);
    int preemptions = 0;
    sched_batch b;
    int step = 0;
    for (; step < max_steps && sched_num_running(h->s) + sched_num_waiting(h->s); step++) {
        /* The oldest live request is scheduled in every step: nobody starves it. */
        const sched_seq *oldest = NULL;
        for (int i = 0; i < h->n_seq; i++)
            if (h->seq[i].live && (!oldest || h->seq[i].q.arrival < oldest->arrival))
                oldest = &h->seq[i].q;
        assert_int_equal(sched_schedule(h->s, &b), 0);
        int found = 0;
        for (int i = 0; i < b.n; i++) found |= b.seqs[i] == oldest;
        assert_true(found);
        preemptions += b.n_preempted;
        h_engine(h, &b);
        h_check(h, NULL, 0);
    }
    assert_true(step < max_steps);
    for (int i = 0; i < n_req; i++) {
        assert_int_equal(h->seq[i].done, 1);
        assert_int_equal(h->seq[i].q.n_tokens - h->seq[i].q.n_prompt, h->seq[i].max_new);
    }
    return preemptions;
}

static void test_sched_no_starvation_every_request_finishes(void **state) {
    (void)state;
    harness *h = h_new(10, 4, 1, 6, 16, 64, 0);   /* 9 blocks: heavy preemption */
    int pre = run_workload(h, 30, 2000);
    assert_true(pre > 0);
    assert_int_equal(kv_num_free(h->kv), 9);
    h_free(h);
}

static void test_sched_preemption_resumes_to_same_tokens(void **state) {
    (void)state;
    int32_t small_tok[30][H_MAX_TOK], big_tok[30][H_MAX_TOK];
    int small_n[30], big_n[30];
    harness *h = h_new(10, 4, 0, 6, 16, 64, 0);
    assert_true(run_workload(h, 30, 2000) > 0);
    for (int i = 0; i < 30; i++) {
        small_n[i] = h->seq[i].q.n_tokens;
        memcpy(small_tok[i], h->seq[i].tok, sizeof(small_tok[i]));
    }
    h_free(h);
    h = h_new(1000, 4, 0, 6, 16, 64, 0);
    assert_int_equal(run_workload(h, 30, 2000), 0);
    for (int i = 0; i < 30; i++) {
        big_n[i] = h->seq[i].q.n_tokens;
        memcpy(big_tok[i], h->seq[i].tok, sizeof(big_tok[i]));
        assert_int_equal(h->seq[i].q.n_preemptions, 0);
    }
    h_free(h);
    for (int i = 0; i < 30; i++) {
        assert_int_equal(small_n[i], big_n[i]);
        assert_memory_equal(small_tok[i], big_tok[i], sizeof(int32_t) * (size_t)big_n[i]);
    }
}

static void test_sched_prefix_hit_skips_computed_blocks(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 1, 4, 100, 64, 0);
    assert_int_equal(h_add(h, 20, 5, 18, 4), 0);
    sched_batch b;
    h_step(h, &b);                             /* a computes and commits 20 tokens */
    assert_int_equal(h_add(h, 21, 5, 18, 4), 1);   /* same 18-token stem */
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 2);
    sched_seq *q = &h->seq[1].q;
    assert_ptr_equal(b.seqs[1], q);
    assert_int_equal(q->n_computed, 16);       /* 4 full shared blocks */
    assert_int_equal(q->n_cached_tokens, 16);
    assert_int_equal(b.n_new[1], 5);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(q->kv.blocks[i], h->seq[0].q.kv.blocks[i]);
        assert_int_equal(kv_ref(h->kv, q->kv.blocks[i]), 2);
    }
    assert_int_not_equal(q->kv.blocks[4], h->seq[0].q.kv.blocks[4]);
    h_engine(h, &b);
    h_check(h, NULL, 0);
    h_free(h);
}

static void test_sched_lookahead_reserved_when_decoding(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 0, 4, 100, 64, 3);
    assert_int_equal(h_add(h, 4, 0, 0, 10), 0);
    sched_seq *q = &h->seq[0].q;
    sched_batch b;
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(q->kv.n_blocks, 1);       /* prefill: no lookahead */
    assert_int_equal(sched_lookahead_room(h->s, q, b.n_new[0]), 0);
    h_engine(h, &b);
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n_new[0], 1);
    assert_int_equal(q->kv.n_blocks, 2);       /* 4 + 1 + 3 = 8 tokens */
    assert_int_equal(sched_lookahead_room(h->s, q, b.n_new[0]), 3);
    h_engine(h, &b);
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(q->kv.n_blocks, 3);       /* 5 + 1 + 3 = 9 tokens */
    h_engine(h, &b);
    h_free(h);
}

static void test_sched_lookahead_clamped_at_end_of_table(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 0, 4, 100, 8, 3);
    sched_seq q;
    int32_t t[8] = {1, 2, 3, 4, 5, 6, 0, 0};
    memset(&q, 0, sizeof(q));
    assert_int_equal(kv_seq_init(&q.kv, 2), 0);   /* ceil(max_seq_len / bs): no spare */
    q.tokens = t;
    q.n_tokens = q.n_prompt = 6;
    assert_int_equal(sched_add(h->s, &q), 0);
    sched_batch b;
    assert_int_equal(sched_schedule(h->s, &b), 0);
    q.n_computed += 6;
    t[q.n_tokens++] = 9;
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n, 1);
    assert_int_equal(q.kv.n_blocks, 2);           /* 6 + 1 + 3 = 10 clamped to 8 */
    assert_int_equal(sched_lookahead_room(h->s, &q, b.n_new[0]), 1);
    sched_remove(h->s, &q);
    kv_seq_destroy(&q.kv);
    h_free(h);
}

static void test_sched_feeds_all_tokens_after_speculative_step(void **state) {
    (void)state;
    harness *h = h_new(64, 4, 0, 4, 100, 64, 4);
    assert_int_equal(h_add(h, 5, 0, 0, 20), 0);
    sched_seq *q = &h->seq[0].q;
    sched_batch b;
    h_step(h, &b);
    /* The engine appended 3 accepted tokens on top of the sampled one. */
    for (int i = 0; i < 3; i++) q->tokens[q->n_tokens++] = 7;
    assert_int_equal(q->n_tokens - q->n_computed, 4);
    assert_int_equal(sched_schedule(h->s, &b), 0);
    assert_int_equal(b.n_new[0], 4);
    assert_int_equal(q->kv.n_blocks, 4);       /* 5 + 4 + 4 = 13 tokens */
    h_free(h);
}

static void test_sched_rejects_sequences_that_never_fit(void **state) {
    (void)state;
    harness *h = h_new(4, 4, 0, 4, 100, 64, 0);   /* 3 blocks = 12 tokens */
    /* Up front: the prompt needs more blocks than the pool has, or exceeds max_seq_len. */
    int i0 = h->n_seq;
    assert_int_equal(h_add(h, 13, 0, 0, 1), SPECD_ENOSPACE);
    assert_int_equal(h->seq[i0].q.state, SEQ_WAITING);
    assert_int_equal(sched_num_waiting(h->s), 0);
    /* While running: grows past the pool. */
    int i = h_add(h, 10, 1, 0, 8);
    assert_true(i >= 0);
    sched_seq *q = &h->seq[i].q;
    sched_batch b;
    int rejected_at = -1;
    for (int step = 0; step < 10 && rejected_at < 0; step++) {
        assert_int_equal(sched_schedule(h->s, &b), 0);
        if (b.n_rejected) {
            rejected_at = step;
            assert_int_equal(b.n_rejected, 1);
            assert_ptr_equal(b.rejected[0], q);
            assert_int_equal(b.n, 0);
        }
        h_engine(h, &b);
    }
    /* Steps: prefill 10 (samples token 11), decode 11 -> 12, then 13 tokens: reject. */
    assert_int_equal(rejected_at, 3);
    assert_int_equal(q->reject_code, SPECD_ENOSPACE);
    assert_int_equal(q->slot, -1);
    assert_int_equal(q->kv.n_blocks, 0);
    assert_int_equal(q->state, SEQ_FINISHED);   /* the harness called sched_remove */
    assert_int_equal(kv_num_free(h->kv), 3);
    assert_int_equal(sched_num_running(h->s) + sched_num_waiting(h->s), 0);
    h_check(h, NULL, 0);
    h_free(h);
    /* Beyond max_seq_len. */
    h = h_new(64, 4, 0, 4, 100, 16, 0);
    assert_int_equal(h_add(h, 17, 0, 0, 1), SPECD_ERANGE);
    h_free(h);
}

static void test_sched_remove_in_any_state(void **state) {
    (void)state;
    harness *h = h_new(7, 4, 1, 4, 100, 64, 0);
    for (int i = 0; i < 3; i++) assert_int_equal(h_add(h, 8, i, 0, 50), i);
    assert_int_equal(h_add(h, 4, 9, 0, 50), 3);
    sched_batch b;
    h_step(h, &b);                     /* 3 running (pool full), 1 waiting */
    assert_int_equal(sched_num_running(h->s), 3);
    assert_int_equal(sched_num_waiting(h->s), 1);
    sched_remove(h->s, &h->seq[3].q);  /* waiting */
    h->seq[3].live = 0;
    assert_int_equal(h->seq[3].q.state, SEQ_FINISHED);
    assert_int_equal(sched_num_waiting(h->s), 0);
    h_check(h, NULL, 0);
    assert_int_equal(sched_schedule(h->s, &b), 0);   /* preempts seq 2 */
    assert_int_equal(b.n_preempted, 1);
    h_engine(h, &b);
    sched_remove(h->s, &h->seq[2].q);  /* preempted, waiting again */
    h->seq[2].live = 0;
    sched_remove(h->s, &h->seq[0].q);  /* running */
    h->seq[0].live = 0;
    sched_remove(h->s, &h->seq[0].q);  /* twice is harmless */
    assert_int_equal(sched_num_running(h->s), 1);
    assert_int_equal(sched_num_waiting(h->s), 0);
    assert_int_equal(h->seq[0].q.slot, -1);
    h_check(h, NULL, 0);
    sched_remove(h->s, &h->seq[1].q);
    h->seq[1].live = 0;
    assert_int_equal(kv_num_free(h->kv), 6);
    h_check(h, NULL, 0);
    h_free(h);
}

static void test_sched_add_validates(void **state) {
    (void)state;
    harness *h = h_new(16, 4, 0, 2, 100, 32, 0);
    sched_seq q;
    int32_t t[4] = {1, 2, 3, 4};
    memset(&q, 0, sizeof(q));
    assert_int_equal(kv_seq_init(&q.kv, 8), 0);
    q.tokens = t;
    q.n_tokens = 0;
    q.n_prompt = 0;
    assert_int_equal(sched_add(h->s, &q), SPECD_EINVAL);
    q.n_tokens = 4;
    q.n_prompt = 5;
    assert_int_equal(sched_add(h->s, &q), SPECD_EINVAL);
    q.n_prompt = 4;
    assert_int_equal(sched_add(h->s, &q), 0);
    assert_int_equal(q.state, SEQ_WAITING);
    assert_int_equal(q.slot, -1);
    sched_remove(h->s, &q);
    kv_seq_destroy(&q.kv);
    char err[256] = "";
    sched_config bad = {.max_batch = 0, .max_tokens_per_step = 8, .max_seq_len = 8};
    assert_null(sched_create(&bad, h->kv, err, sizeof(err)));
    assert_non_null(strstr(err, "max_batch >= 1"));
    h_free(h);
}

/* A live request (running if want_running), scanning from a random index; NULL if none. */
static h_seq *h_pick_live(harness *h, int want_running) {
    if (h->n_seq == 0) return NULL;
    int start = (int)(h_rand(h) % (uint64_t)h->n_seq);
    for (int k = 0; k < h->n_seq; k++) {
        h_seq *x = &h->seq[(start + k) % h->n_seq];
        if (x->live && (!want_running || x->q.state == SEQ_RUNNING)) return x;
    }
    return NULL;
}

typedef struct {
    int steps, preempts, cancels;
} h_counts;

/* One operation of a random workload: kind < 2 adds a request (a prompt of up to
 * max_prompt tokens with a shared stem of up to max_stem, finishing by max_seq_len),
 * kind < n_step schedules a step and plays it, kind == n_step cancels a live request.
 * Returns 0 for the kinds above, left to the caller. */
static int h_random_op(harness *h, int kind, int max_prompt, int max_stem, int n_step, h_counts *c) {
    if (kind < 2) {
        if (h->n_seq >= H_MAX_SEQS) return 1;
        int n = 1 + (int)(h_rand(h) % (uint64_t)max_prompt);
        int rc = h_add(h, n, (int)(h_rand(h) % 3), (int)(h_rand(h) % (uint64_t)max_stem),
                       1 + (int)(h_rand(h) % (uint64_t)(h->cfg.max_seq_len - n)));
        assert_true(rc >= 0);
    } else if (kind < n_step) {
        sched_batch b;
        h_schedule(h, &b);
        c->preempts += b.n_preempted;
        h_engine(h, &b);
        c->steps++;
    } else if (kind == n_step) {
        h_seq *x = h_pick_live(h, 0);
        if (x) {
            sched_remove(h->s, &x->q);
            x->live = 0;
            c->cancels++;
        }
    } else {
        return 0;
    }
    return 1;
}

/* Seeded random workload: adds, steps with speculative multi-token appends, cancels, and
 * forks, with kv_check + sched_check after every operation. */
static void test_sched_random_ops_keep_invariants(void **state) {
    (void)state;
    harness *h = h_new(40, 4, 1, 6, 24, 48, 3);
    h->spec = 1;
    enum { N_FORK = 4 };
    kv_seq forks[N_FORK];
    const kv_seq *fork_t[N_FORK];
    for (int i = 0; i < N_FORK; i++) {
        assert_int_equal(kv_seq_init(&forks[i], 16), 0);
        fork_t[i] = &forks[i];
    }
    int nforks = 0, finished = 0;
    h_counts c = {0};
    for (int op = 0; op < 6000; op++) {
        if (!h_random_op(h, (int)(h_rand(h) % 10), 24, 12, 8, &c)) {   /* kind 9: fork */
            kv_seq *f = &forks[h_rand(h) % N_FORK];
            h_seq *x = h_pick_live(h, 1);
            if (f->n_blocks) {
                kv_seq_release(h->kv, f);
            } else if (x) {
                int32_t cs, cd;
                int rc = kv_seq_fork(h->kv, &x->q.kv, f, &cs, &cd);
                assert_true(rc == 0 || rc == 1 || rc == SPECD_ENOSPACE);
                nforks += rc >= 0;
            }
        }
        h_check(h, fork_t, N_FORK);
    }
    int hits = 0;
    for (int i = 0; i < h->n_seq; i++) {
        finished += h->seq[i].done;
        hits += h->seq[i].q.n_cached_tokens > 0;
    }
    fprintf(stderr, "random ops: steps %d preempts %d cancels %d forks %d hits %d finished %d of %d\n",
            c.steps, c.preempts, c.cancels, nforks, hits, finished, h->n_seq);
    assert_true(c.steps > 1000);
    assert_true(c.preempts > 20);
    assert_true(c.cancels > 20);
    assert_true(nforks > 20);
    assert_true(finished > 20);
    assert_true(hits > 20);
    for (int i = 0; i < N_FORK; i++) kv_seq_release(h->kv, &forks[i]);
    for (int i = 0; i < h->n_seq; i++)
        if (h->seq[i].live) {
            sched_remove(h->s, &h->seq[i].q);
            h->seq[i].live = 0;
        }
    h_check(h, fork_t, N_FORK);
    assert_int_equal(kv_num_free(h->kv), 39);
    assert_int_equal(kv_num_used(h->kv), 0);
    assert_int_equal(sched_num_running(h->s) + sched_num_waiting(h->s), 0);
    for (int i = 0; i < N_FORK; i++) kv_seq_destroy(&forks[i]);
    h_free(h);
}

/* A window pool beside the main one: random adds, steps and cancels keep both pools'
 * invariants; every scheduled table is live from where its first query's window starts
 * (h_check_batch); the window pool, a fifth the size of the main one, fills up and preempts too;
 * prefix hits take the window's last blocks; everything comes back at the end. */
static void test_sched_window_pool_keeps_invariants(void **state) {
    (void)state;
    harness *h = h_new(60, 4, 1, 6, 24, 64, 2);
    h->cfg.max_prefill_decoding = 10;   /* checked by h_check_batch too */
    h_add_window_pool(h, 12, 6);
    h->spec = 1;
    int finished = 0, hits = 0, win_max = 0;
    h_counts c = {0};
    for (int op = 0; op < 6000; op++) {
        h_random_op(h, (int)(h_rand(h) % 10), 40, 30, 9, &c);
        h_check(h, NULL, 0);
        if (kv_num_used(h->win) > win_max) win_max = kv_num_used(h->win);
    }
    for (int i = 0; i < h->n_seq; i++) {
        finished += h->seq[i].done;
        hits += h->seq[i].q.n_cached_tokens > 0;
    }
    fprintf(stderr, "window pool: steps %d preempts %d cancels %d hits %d finished %d of %d, window blocks held at most %d\n",
            c.steps, c.preempts, c.cancels, hits, finished, h->n_seq, win_max);
    assert_true(c.steps > 1000 && c.preempts > 20 && c.cancels > 20 && finished > 20 && hits > 20);
    assert_int_equal(win_max, 11);   /* the window pool filled up */
    for (int i = 0; i < h->n_seq; i++)
        if (h->seq[i].live) {
            sched_remove(h->s, &h->seq[i].q);
            h->seq[i].live = 0;
        }
    h_check(h, NULL, 0);
    assert_int_equal(kv_num_used(h->kv), 0);
    assert_int_equal(kv_num_used(h->win), 0);
    h_free(h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sched_token_budget_respected),
        cmocka_unit_test(test_sched_chunked_prefill_splits_long_prompt),
        cmocka_unit_test(test_sched_decode_first_then_admission),
        cmocka_unit_test(test_sched_prefill_capped_while_decoding),
        cmocka_unit_test(test_sched_max_batch_respected_and_slots_recycled),
        cmocka_unit_test(test_sched_preempts_newest_when_blocks_run_out),
        cmocka_unit_test(test_sched_newest_preempts_itself),
        cmocka_unit_test(test_sched_no_admission_in_a_step_that_preempted),
        cmocka_unit_test(test_sched_no_starvation_every_request_finishes),
        cmocka_unit_test(test_sched_preemption_resumes_to_same_tokens),
        cmocka_unit_test(test_sched_prefix_hit_skips_computed_blocks),
        cmocka_unit_test(test_sched_lookahead_reserved_when_decoding),
        cmocka_unit_test(test_sched_lookahead_clamped_at_end_of_table),
        cmocka_unit_test(test_sched_feeds_all_tokens_after_speculative_step),
        cmocka_unit_test(test_sched_rejects_sequences_that_never_fit),
        cmocka_unit_test(test_sched_remove_in_any_state),
        cmocka_unit_test(test_sched_add_validates),
        cmocka_unit_test(test_sched_random_ops_keep_invariants),
        cmocka_unit_test(test_sched_window_pool_keeps_invariants),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
