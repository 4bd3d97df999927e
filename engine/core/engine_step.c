/* One engine step = schedule -> run -> commit and emit (see engine.h; creation and
 * requests are in engine.c).
 *
 * Phases of engine_step:
 *   1. the scheduler picks rows and how many tokens each feeds;
 *   2. slot sync: a row that got a (new) slot has its block table and lengths written
 *      into the runner; a row whose table grew has the new block ids appended;
 *      the speculation policy (engine_spec.c) picks each decoding row's drafts: prompt
 *      lookup proposes them from the row's own tokens, and the cost model keeps only drafts
 *      expected to pay for their verify tokens;
 *   3. run: the speculative step op where a draft model's rows all fit it (draft and
 *      target in one graph on CUDA), else the draft's passes (a draft model) and one
 *      runner_step (runner.h) over every row -- prefill chunks, decode rows, verify rows of
 *      drafts -- which picks the runner's op itself (its decode graph, its verify graph, or
 *      the forward pass) and samples in the runner wherever one of them takes every row's
 *      sampling, else returns logits for the host to sample; the rows' results go to
 *      row_result;
 *   4. commit and emit, the same for every path: speculation counters, computed
 *      positions, tokens and their logprobs, prefix-cache commit, finish checks, events.
 * With async scheduling a decode step may instead be queued in flight and committed by
 * the next call (see "async scheduling" below). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/core/engine_internal.h"
#include "engine/core/err.h"
#include "engine/core/sample.h"
#include "engine/core/spec.h"
#include "engine/core/threadpool.h"

/* ---- one step -------------------------------------------------------------------------- */

typedef int (*write_table_fn)(runner *r, int slot, int first, const int32_t *blocks, int n);

/* Mirror table t into the runner's row (whole: a new slot; else what changed): entries
 * appended since the last sync, and the leading entries released behind a window since
 * then, which become the null block there too, so that nothing reads a block another
 * request may be given next. */
static int sync_table(runner *run, write_table_fn write, int slot, int whole, const kv_seq *t, int *synced,
                      int *dropped) {
    int rc;
    if (whole) {
        if ((rc = write(run, slot, 0, t->blocks, t->n_blocks))) return rc;
        *synced = t->n_blocks;
        *dropped = t->n_dropped;
        return 0;
    }
    if (t->n_blocks > *synced) {
        if ((rc = write(run, slot, *synced, t->blocks + *synced, t->n_blocks - *synced))) return rc;
        *synced = t->n_blocks;
    }
    if (t->n_dropped > *dropped) {   /* from entry 0 the whole row: a write at 0 resets what follows */
        int first = *dropped, n = first ? t->n_dropped - first : t->n_blocks;
        if ((rc = write(run, slot, first, t->blocks + first, n))) return rc;
        *dropped = t->n_dropped;
    }
    return 0;
}

/* Mirror the scheduler's slot decisions into the runner (phase 2). */
static int sync_slot(engine *e, req *r) {
    sched_seq *s = &r->seq;
    runner *run = e->run;
    int rc;
    /* new slot (admission or re-admission after preemption): whole rows + lengths */
    const int whole = s->slot_epoch != r->synced_epoch || r->synced_blocks == 0;
    if ((rc = sync_table(run, run->ops->slot_write_blocks, s->slot, whole, &s->kv, &r->synced_blocks,
                         &r->synced_dropped)))
        return rc;
    if (e->win_kv && (rc = sync_table(run, run->ops->slot_write_win_blocks, s->slot, whole, &s->kvw,
                                      &r->synced_win_blocks, &r->synced_win_dropped)))
        return rc;
    if (whole) {
        if ((rc = run->ops->slot_set_len(run, s->slot, RUNNER_TARGET, s->n_computed))) return rc;
        if ((rc = run->ops->slot_set_len(run, s->slot, RUNNER_DRAFT, s->n_computed))) return rc;
        r->synced_epoch = s->slot_epoch;
        if (r->n_cached == 0 && s->n_computed > 0 && r->n_out == 0) {
            r->n_cached = s->n_computed;
            e->st.prefix_cache_hit_tokens += (uint64_t)s->n_computed;
        }
    }
    return 0;
}

/* Commit the computed blocks' hashes; release the blocks every later query's window has
 * left (kv_window_drop_upto): the whole table's when every layer slides, the window
 * pool's when the model mixes window and full layers. */
static void commit_kv(engine *e, sched_seq *s, int c) {
    int bs = kv_block_size(e->kv);
    kv_seq_commit(e->kv, &s->kv, s->tokens, c);
    if (e->window_release > 0) kv_seq_drop_front(e->kv, &s->kv, kv_window_drop_upto(c, e->window_release, bs));
    if (e->win_kv) {
        kv_seq_commit(e->win_kv, &s->kvw, s->tokens, c);
        kv_seq_drop_front(e->win_kv, &s->kvw, kv_window_drop_upto(c, e->win_window, bs));
    }
}

/* Forward sampling of constrained rows: the masks of plan row e->mask_rows[i] into the
 * row_masks rows of its sampling rows, their grammar_mask results into e->mask_res. A
 * speculating row (prompt lookup) has one per verified position: its grammar's state after
 * the drafts before it, walked ahead on the request's matcher and back (the drafts were
 * checked against the grammar when they were made); after a position where nothing fits,
 * none is computed (-1). */
typedef struct {
    engine *e;
    size_t mw;
} mask_job;

static int grammar_mask_ahead(engine *e, req *r, int ahead, uint32_t *mask);

static void mask_task(void *ctx, int i) {
    const mask_job *mj = ctx;
    engine *e = mj->e;
    const row_plan *p = &e->plan[e->mask_rows[i]];
    req *r = p->r;
    const int off = p->logits_off, npos = p->spec + 1;
    if (npos > 1) matcher_save(r->m, r->msave);
    int j = 0;
    for (; j < npos; j++) {
        e->mask_res[off + j] = grammar_mask_ahead(e, r, j, e->row_masks + (size_t)(off + j) * mj->mw);
        if (e->mask_res[off + j] < 0 || (j + 1 < npos && matcher_accept_token(r->m, p->drafts[j]))) break;
    }
    for (j++; j < npos; j++) e->mask_res[off + j] = -1;
    if (npos > 1) matcher_restore(r->m, r->msave);
}

/* runner_batch.prepare_sp of a forward that samples constrained rows on the device: their
 * masks (e->mask_rows, e->mask_res), in parallel, while the runner's pass runs. A row where
 * only eos fits lets it through min_tokens (as apply_grammar does on the host); a row where
 * nothing fits samples unmasked and is ended with an error after the step (mask_result). */
static int prepare_masks(void *ctx) {
    engine *e = ctx;
    const int nm = e->n_mask_rows;
    mask_job mj = {e, vocab_mask_words(e->vocab)};
    if (e->mask_pool) tp_run(e->mask_pool, mask_task, &mj, nm);
    else for (int i = 0; i < nm; i++) mask_task(&mj, i);
    for (int j = 0; j < nm; j++) {
        const row_plan *p = &e->plan[e->mask_rows[j]];
        for (int o = p->logits_off; o <= p->logits_off + p->spec; o++) {
            runner_sampling *sp = &e->dec_sp[o];
            if (e->mask_res[o] == 0) sp->n_suppress = 0;
            if (e->mask_res[o] < 0) sp->mask = NULL;
        }
    }
    e->masks_done = 1;
    return 0;
}

/* runner prepare_sp of a step queued in flight (async scheduling) with constrained rows:
 * a row fed the token of the step in flight needs its matcher past that token first. So
 * wait for that step's outputs (the runner has already queued this step's pass, which
 * runs meanwhile), let each such row's matcher take its token ahead of the commit (m_pre),
 * then compute the masks as prepare_masks does. */
static int prepare_masks_async(void *ctx) {
    engine *e = ctx;
    pend_step *fl = e->mask_fl;
    if (fl && fl->n && !fl->waited) {
        int rc = e->run->ops->wait_queued(e->run);
        fl->waited = 1;
        if (rc) return rc;
    }
    for (int j = 0; j < e->n_mask_rows; j++) {
        req *r = e->plan[e->mask_rows[j]].r;
        if (r && r->pend_tok && fl && !r->m_pre) {
            r->m_pre_rc = matcher_accept_token(r->m, fl->o.tok[r->pend_row]);
            r->m_pre = 1;
        }
    }
    return prepare_masks(ctx);
}

/* The mask result of sampling row o of a constrained row in this step's prepare_masks
 * (-1: nothing fits, or not computed: the runner did not call back). */
static int mask_result_at(const engine *e, int o) { return e->masks_done ? e->mask_res[o] : -1; }

/* ... of plan row i's (first) sampling row. */
static int mask_result(const engine *e, int i) { return mask_result_at(e, e->plan[i].logits_off); }

/* The request's event in this call's output: a new one, or (async scheduling, where one
 * call commits the step in flight and then runs another) the one it already has, so a
 * request reports at most once per call and its tokens stay in order. Each buffer holds
 * 3 * max_batch + 8 events; only mass rejection or failure can exceed that, and then it
 * grows (a caller holds a buffer only until the second call after). */
static engine_event *new_event(engine *e, engine_output *out, req *r) {
    if (r->ev_stamp == e->out_stamp) return &out->events[r->ev_idx];
    int b = e->ev_cur;
    if (out->n_events == e->cap_events[b]) {
        engine_event *n = realloc(e->events[b], sizeof *n * (size_t)e->cap_events[b] * 2);
        if (!n) abort();
        e->events[b] = out->events = n;
        e->cap_events[b] *= 2;
    }
    r->ev_stamp = e->out_stamp;
    r->ev_idx = out->n_events;
    engine_event *ev = &e->events[b][out->n_events++];
    memset(ev, 0, sizeof *ev);
    ev->req_id = r->id;
    return ev;
}

static void fill_counts(engine_event *ev, const req *r) {
    ev->n_prompt_tokens = r->seq.n_prompt;
    ev->n_output_tokens = r->n_out;
    ev->n_cached_tokens = r->n_cached;
    ev->spec_verify_steps = r->verify_steps;
    ev->spec_draft_tokens = r->draft_tokens;
    ev->spec_accepted_tokens = r->accepted;
    ev->spec_decode_steps = r->decode_steps;
}

static int is_eos(const engine *e, int32_t t) {
    for (int i = 0; i < e->n_eos; i++)
        if (e->eos[i] == t) return 1;
    return 0;
}

/* Record one emitted token (logprobs from the raw target logits, or the chosen token's
 * logprob as the device computed it when dev_lp is given). Returns a finish reason when
 * this token ends the request. */
static engine_finish emit_token(engine *e, req *r, engine_event *ev, int32_t t, const float *raw,
                                const float *dev_lp) {
    engine_token *et = &ev->tokens[ev->n_tokens++];
    et->id = t;
    if (dev_lp && r->sp.logprobs >= 0) et->logprob = *dev_lp;
    if (raw && r->sp.logprobs >= 0) {
        et->logprob = sample_logprob(raw, e->vocab, t);
        if (r->sp.logprobs > 0)
            et->n_top = sample_top_logprobs(raw, e->vocab, r->sp.logprobs, et->top_ids, et->top_logprobs);
    }
    if (raw && r->record && r->n_out == 0) memcpy(r->first_logits, raw, (size_t)e->vocab * sizeof(float));
    r->seq.tokens[r->seq.n_tokens++] = t;
    if (r->stats.cap) sample_stats_add(&r->stats, t, 1);   /* capacity: prompt + max_new */
    r->n_out++;
    e->st.generation_tokens++;
    if (r->m) {
        /* t came from the mask, so the matcher takes it; eos ends a complete sentence,
         * and so does a sentence nothing may follow (no step spent on eos) */
        const int rc = r->m_pre ? r->m_pre_rc : matcher_accept_token(r->m, t);
        r->m_pre = 0;
        if (rc) return ENGINE_FINISH_ERROR;
        if (matcher_done(r->m)) return ENGINE_FINISH_STOP;
    }
    if (!r->sp.ignore_eos && is_eos(e, t) && r->n_out > r->sp.min_tokens - 1) return ENGINE_FINISH_STOP;
    if (r->n_out >= r->max_new || r->seq.n_tokens >= e->cfg.max_seq_len) return ENGINE_FINISH_LENGTH;
    return ENGINE_RUNNING;
}

/* Within this many bytes of the last token, a constrained row keeps only tokens after which
 * its grammar can still end in the tokens left (no single token lengthens the shortest
 * way to the end by more than this in practice): the output stays valid at max_tokens. */
#define GRAMMAR_BUDGET_SLACK 256

/* A constrained row's mask for its next token into mask (ahead = 0), or for the token
 * after `ahead` drafts its matcher has been walked through (prompt lookup): the grammar's,
 * narrowed near max_tokens to tokens after which the document can still close. Returns
 * the number of tokens allowed besides eos, or -1 when nothing fits (a grammar needing
 * bytes no token spells). */
static int grammar_mask_ahead(engine *e, req *r, int ahead, uint32_t *mask) {
    /* (a token the matcher took ahead of its commit, m_pre, is not in n_out yet; its
     * placeholder is in n_tokens) */
    int left = r->max_new - r->n_out - r->m_pre - ahead, ctx_left = e->cfg.max_seq_len - r->seq.n_tokens - ahead;
    if (ctx_left < left) left = ctx_left;
    int n_ok = -1, dist = matcher_distance(r->m);
    /* (not when even 8 bytes a token could not close it: then the plain mask only; once
     * the budget holds, dist <= left stays true, so it keeps holding to the end; nor when
     * no token can bring it within the budget, as a token shortens the way by at most its
     * bytes: that walk would find nothing, and the plain mask is cached) */
    if (left - 1 < dist + GRAMMAR_BUDGET_SLACK && dist <= 8 * left && dist - e->max_tok_bytes <= left - 1) {
        n_ok = matcher_fill_mask_within(r->m, mask, left - 1);
        if (n_ok == 0 && !matcher_accepting(r->m)) n_ok = -1;   /* too late to close: plain mask */
    }
    if (n_ok < 0) n_ok = matcher_fill_mask(r->m, mask);
    return n_ok == 0 && !matcher_accepting(r->m) ? -1 : n_ok;
}


/* Constrained decoding: tokens outside the grammar get -inf before any other processing.
 * Returns 0, or -1 when no token fits. */
static int apply_grammar(engine *e, req *r, int ahead, float *logits) {
    int n_ok = grammar_mask_ahead(e, r, ahead, e->mask);
    if (n_ok < 0) return -1;
    const uint32_t *mask = e->mask;
    for (int i = 0; i < e->vocab; i++)
        if (!((mask[i >> 5] >> (i & 31)) & 1)) logits[i] = -INFINITY;
    if (n_ok == 0) r->spp.suppress_eos = 0;   /* only eos fits: min_tokens yields */
    return 0;
}

/* Processed logits -> token for a non-speculative row (logits are modified); -1 when a
 * constrained row has no allowed token. */
static int32_t sample_row(engine *e, req *r, float *logits, const int32_t *hist, int n_hist) {
    r->spp.suppress_eos = r->n_out < r->sp.min_tokens;
    if (r->m && apply_grammar(e, r, 0, logits)) return -1;
    sample_apply_penalties(logits, e->vocab, &r->spp, hist, n_hist, r->seq.n_prompt, e->scratch);
    if (r->sp.temperature <= 0) return sample_argmax(logits, e->vocab);
    sample_probs(logits, e->vocab, &r->spp, e->scratch);
    return sample_from_probs(logits, e->vocab, sample_uniform(r->seed, 2 * (uint64_t)r->n_out));
}


static runner_sampling device_sampling(const engine *e, const req *r, int ahead);
static int host_only(const req *r);
static int reserve_pos_stats(engine *e, int n);
static void position_stats(engine *e, const row_plan *p, int j, runner_sampling *sp, size_t *used);

/* The draft's pick at position j of a greedy speculating row, as a runner sampling row:
 * the argmax of its logits adjusted as the target's are there (device_sampling at output
 * position n_out + j, the drafts before it in its statistics). */
static runner_sampling draft_sampling(engine *e, const row_plan *p, int j, size_t *used) {
    runner_sampling sp = device_sampling(e, p->r, j);
    sp.temperature = 0;
    sp.stats_fed = sp.logprob = sp.n_top = 0;
    sp.mask = NULL;   /* (a draft model drafts for no constrained row) */
    position_stats(e, p, j, &sp, used);
    return sp;
}

/* Whether the draft's picks are sampled in the runner's forward pass (only their tokens
 * come back): the runner samples the draft's logits (runner.draft_samples), and every
 * speculating row is greedy (a sampled draft's distribution is needed on the host, for
 * rejection sampling) with a sampling the pass takes. */
static int draft_on_device(engine *e, int n) {
    if (!e->run->draft_samples || reserve_pos_stats(e, n)) return 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        if (!p->spec) continue;
        size_t used = 0;
        const runner_sampling sp = draft_sampling(e, p, 0, &used);
        if (p->r->sp.temperature > 0 || host_only(p->r) || !runner_takes(e->run, RUNNER_OP_FORWARD, &sp, 0)) return 0;
    }
    return 1;
}

/* One pass of the draft over e->rows / e->tokens (nr rows, nt tokens), its logits rows
 * into e->dlogits, or (dev) its picks sampled in the runner into e->dec.tok. */
static int draft_pass(engine *e, int nr, int nt, int dev) {
    if (nr == 0) return 0;
    runner_batch b = {.which = RUNNER_DRAFT, .n_rows = nr, .rows = e->rows, .tokens = e->tokens, .n_tokens = nt,
                      .logits = e->dlogits, .sp = dev ? e->dec_sp : NULL, .out_tokens = dev ? e->dec.tok : NULL};
    if (dev) e->st.draft_passes_sampled++;
    return runner_forward(e->run, &b);
}

/* Phase 3: the draft takes in prompt chunks with the target and proposes k tokens for
 * speculating rows, first catching up on the tokens it has not seen. A decoding row that
 * does not speculate leaves the draft behind (its KV is written the next time the row
 * speculates), so a step where no row speculates costs what plain decoding costs. Its
 * picks are sampled in the runner where draft_on_device, else from its logits here. */
static int draft_phase(engine *e, int n) {
    runner *run = e->run;
    const int dev = draft_on_device(e, n);
    size_t used = 0;
    int nr = 0, nt = 0, no = 0;
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        sched_seq *s = &p->r->seq;
        if (!p->spec && row_decodes(p)) continue;
        int dlen = run->ops->slot_get_len(run, s->slot, RUNNER_DRAFT);
        int upto = p->spec ? s->n_tokens : s->n_computed + p->n_new;
        if (upto <= dlen) continue;
        runner_row *row = &e->rows[nr++];
        *row = (runner_row){.slot = s->slot, .n_new = upto - dlen, .tok_off = nt,
                            .n_logits = p->spec ? 1 : 0, .logits_off = p->spec ? no : 0};
        memcpy(e->tokens + nt, s->tokens + dlen, (size_t)(upto - dlen) * sizeof(int32_t));
        nt += upto - dlen;
        if (p->spec && dev) e->dec_sp[no] = draft_sampling(e, p, 0, &used);
        if (p->spec) p->logits_off = no++;   /* draft logits row of this plan row */
    }
    int rc = draft_pass(e, nr, nt, dev);
    int kmax = 0;   /* a probe drafts fewer than k */
    for (int i = 0; i < n; i++)
        if (e->plan[i].spec > kmax) kmax = e->plan[i].spec;
    for (int j = 0; rc == 0 && j < kmax; j++) {
        /* pick draft token j for each row drafting that far, then feed it (except its last) */
        nr = 0;
        used = 0;
        for (int i = 0; i < n; i++) {
            row_plan *p = &e->plan[i];
            if (j >= p->spec) continue;
            req *r = p->r;
            int32_t d;
            if (dev) {
                d = e->dec.tok[p->logits_off];
            } else {
                float *lg = e->dlogits + (size_t)p->logits_off * e->vocab;
                /* the history the target will see at this position: tokens + earlier drafts */
                int nh = r->seq.n_tokens;
                memcpy(e->hist, r->seq.tokens, (size_t)nh * sizeof(int32_t));
                memcpy(e->hist + nh, p->drafts, (size_t)j * sizeof(int32_t));
                r->spp.suppress_eos = r->n_out + j < r->sp.min_tokens;
                sample_apply_penalties(lg, e->vocab, &r->spp, e->hist, nh + j, r->seq.n_prompt, e->scratch);
                if (r->sp.temperature <= 0) {
                    d = sample_argmax(lg, e->vocab);
                } else {
                    float *q = e->dprobs + ((size_t)i * e->k + j) * e->vocab;
                    memcpy(q, lg, (size_t)e->vocab * sizeof(float));
                    sample_probs(q, e->vocab, &r->spp, e->scratch);
                    d = sample_from_probs(q, e->vocab,
                                          sample_uniform(r->seed ^ SPEC_SALT_DRAFT, (uint64_t)r->n_out + j));
                }
            }
            p->drafts[j] = d;
            if (j + 1 < p->spec) {
                /* host picks: logits rows addressed by logits_off (the rows kept in plan
                 * order); runner picks: a sampling row per row of this pass */
                if (dev) {
                    p->logits_off = nr;
                    e->dec_sp[nr] = draft_sampling(e, p, j + 1, &used);
                }
                e->rows[nr] = (runner_row){.slot = r->seq.slot, .n_new = 1, .tok_off = nr,
                                           .n_logits = 1, .logits_off = p->logits_off};
                e->tokens[nr++] = d;
            }
        }
        rc = draft_pass(e, nr, nr, dev);
    }
    return rc;
}

/* Speculation counters of one verify step of one row (per request and engine-wide). */
static void count_verify(engine *e, req *r, int k, int accepted) {
    r->verify_steps++;
    r->draft_tokens += k;
    r->accepted += accepted;
    engine_spec_observe(e, r, k, accepted);
    e->st.spec_drafts++;
    e->st.spec_draft_tokens += (uint64_t)k;
    e->st.spec_accepted_tokens += (uint64_t)accepted;
    for (int j = 0; j < accepted; j++) e->st.spec_accepted_per_pos[j]++;
}

/* A constrained row whose grammar lets no token through ends with an error. */
static void grammar_dead_end(const req *r, row_result *o) {
    fprintf(stderr, "specd: request %llu: no token fits its grammar here\n", (unsigned long long)r->id);
    o->forced = ENGINE_FINISH_ERROR;
}

/* After a speculating row's acceptance (m tokens of k drafts; k < 0: nothing fits its
 * grammar even now): both models' lengths rolled back to what stands, the row's result. KV
 * holds the fed token and the accepted drafts; the emitted last token is not in it yet.
 * The draft saw the fed tokens and drafts 1..k-1. */
static void settle_verified(engine *e, const row_plan *p, row_result *o, int k, int m) {
    const sched_seq *s = &p->r->seq;
    const int new_len = s->n_computed + m;
    o->event = 1;
    e->run->ops->slot_set_len(e->run, s->slot, RUNNER_TARGET, new_len);
    if (k < 0) {
        grammar_dead_end(p->r, o);
        return;
    }
    if (e->drafter == ENGINE_DRAFTER_MODEL) {
        int dlen = e->run->ops->slot_get_len(e->run, s->slot, RUNNER_DRAFT);
        e->run->ops->slot_set_len(e->run, s->slot, RUNNER_DRAFT, dlen < new_len ? dlen : new_len);
    }
    o->fed = o->n = m;
    o->drafted = k;
    o->accepted = m - 1;
}

/* A speculating row of a composed step: acceptance over the target's logits on the host,
 * then the rollback of both models' lengths; its tokens go to o (emitted by
 * commit_and_emit with their raw logits). */
static void accept_row(engine *e, row_plan *p, row_result *o) {
    req *r = p->r;
    sched_seq *s = &r->seq;
    int k = p->spec, V = e->vocab;
    float *L = e->logits + (size_t)p->logits_off * V;   /* (k+1, V) raw target logits */
    int m = 0;
    /* processed target distributions at each position, history including earlier drafts */
    int nh = s->n_tokens;
    memcpy(e->hist, s->tokens, (size_t)nh * sizeof(int32_t));
    memcpy(e->hist + nh, p->drafts, (size_t)k * sizeof(int32_t));
    /* A constrained row (prompt lookup only) masks each position with its grammar's state
     * after the drafts before it (the drafts were checked against the grammar when they
     * were made), walking the matcher ahead and back; where nothing fits after a draft,
     * that draft and those after it are dropped. */
    if (r->m) matcher_save(r->m, e->msave);
    for (int j = 0; j <= k; j++) {
        float *pj = e->pprobs + (size_t)j * V;
        memcpy(pj, L + (size_t)j * V, (size_t)V * sizeof(float));
        r->spp.suppress_eos = r->n_out + j < r->sp.min_tokens;
        if (r->m && apply_grammar(e, r, j, pj)) {
            k = j - 1;
            break;
        }
        sample_apply_penalties(pj, V, &r->spp, e->hist, nh + j, s->n_prompt, e->scratch);
        if (r->sp.temperature > 0) sample_probs(pj, V, &r->spp, e->scratch);
        if (r->m && j < k && matcher_accept_token(r->m, p->drafts[j])) k = j;   /* cannot happen: checked */
    }
    if (r->m) matcher_restore(r->m, e->msave);
    if (k >= 0 && r->sp.temperature <= 0) {
        m = spec_accept_greedy(e->pprobs, V, p->drafts, k, o->tok);
    } else if (k >= 0 && e->drafter == ENGINE_DRAFTER_NGRAM) {   /* a deterministic proposal: a point mass */
        double u[ENGINE_MAX_STEP_TOKENS];
        spec_point_uniforms(r->seed, (uint64_t)r->n_out, k, u);
        m = spec_accept_point(e->pprobs, V, p->drafts, k, u, o->tok);
    } else if (k >= 0) {
        double ua[ENGINE_MAX_STEP_TOKENS];
        for (int j = 0; j < k; j++) ua[j] = sample_uniform(r->seed ^ SPEC_SALT_ACCEPT, (uint64_t)r->n_out + j);
        int i = (int)(p - e->plan);
        double ur = sample_uniform(r->seed, 2 * (uint64_t)r->n_out);
        m = spec_accept_sample(e->pprobs, e->dprobs + (size_t)i * k * V, V, p->drafts, k, ua, ur, e->work, 0, o->tok);
    }
    o->raw = L;
    settle_verified(e, p, o, k, m);
}

/* A speculating row whose every verified position the runner sampled (runner_step): m
 * tokens stand (spec_accept_draws: the drafts while they equal the sampled tokens, then
 * the first that differs), cut where a constrained row's grammar found nothing after a
 * draft (its position sampled unmasked), as accept_row does. */
static void accept_sampled(engine *e, row_plan *p, row_result *o, int m) {
    const int off = p->logits_off;
    int k = p->spec;
    for (int j = 0; p->r->m && j <= k; j++)
        if (mask_result_at(e, off + j) < 0) k = j - 1;
    if (m > k + 1) m = k + 1;
    memcpy(o->tok, e->dec.tok + off, (size_t)m * sizeof(int32_t));
    o->dev = off;
    settle_verified(e, p, o, k, m);
}

/* Features only the engine's host sampler has, whatever the runner: a request's
 * first-token logits recorded (tests), max_tokens 0 (the prompt only), prompt logprobs or
 * top logprobs beyond what a runner reports. Everything else the runner's step op decides
 * from the rows' runner_sampling (runner_takes): a request samples there unless one of
 * the step's rows uses a feature no op of this runner has. */
static int host_only(const req *r) {
    return r->record || r->max_new <= 0 || (r->pl && r->sp.prompt_logprobs > RUNNER_MAX_TOP) ||
           r->sp.logprobs > ENGINE_MAX_TOP_LOGPROBS;
}

_Static_assert(ENGINE_MAX_TOP_LOGPROBS <= RUNNER_MAX_TOP, "top logprobs the runners report");

/* A row's runner_sampling: its filters and seed, and what the host sampler would apply
 * before them (logit bias, eos suppressed before min_tokens, penalties over its token
 * statistics), with the logprobs it wants; a constrained row's mask goes to its sampling
 * row's place in row_masks (set by step_sampling; here any non-NULL pointer, for what
 * runner_takes asks). `ahead`: tokens the row will have emitted before this one (async
 * scheduling: the one the step in flight samples, which its statistics lack and the
 * runner counts, stats_fed). */
static runner_sampling device_sampling(const engine *e, const req *r, int ahead) {
    const int n_out = r->n_out + ahead, suppress = n_out < r->sp.min_tokens;
    return (runner_sampling){.temperature = r->sp.temperature, .top_p = r->sp.top_p, .min_p = r->sp.min_p,
                             .top_k = r->sp.top_k, .seed = r->seed, .counter = (uint64_t)n_out,
                             .mask = r->m ? e->row_masks : NULL,
                             .n_logit_bias = r->sp.n_logit_bias, .logit_bias_ids = r->lb_ids,
                             .logit_bias_vals = r->lb_vals, .n_suppress = suppress ? r->spp.n_eos : 0,
                             .suppress_ids = suppress ? r->spp.eos_ids : NULL,
                             .presence_penalty = r->sp.presence_penalty, .frequency_penalty = r->sp.frequency_penalty,
                             .repetition_penalty = r->sp.repetition_penalty, .n_stats = r->stats.n,
                             .stat_ids = r->stats.ids, .stat_counts = r->stats.counts, .stats_fed = ahead > 0,
                             .logprob = r->sp.logprobs >= 0, .n_top = r->sp.logprobs > 0 ? r->sp.logprobs : 0};
}

/* emit_token for the token the runner sampled into d->tok[i], with its logprob and top
 * logprobs as the device computed them (raw logits, like emit_token's). */
static engine_finish emit_sampled(engine *e, req *r, engine_event *ev, const dec_outs *d, int i) {
    engine_token *et = &ev->tokens[ev->n_tokens];
    engine_finish f = emit_token(e, r, ev, d->tok[i], NULL, &d->lp[i]);
    if (r->sp.logprobs > 0) {
        et->n_top = r->sp.logprobs < e->vocab ? r->sp.logprobs : e->vocab;
        memcpy(et->top_ids, d->top_ids + (size_t)i * RUNNER_MAX_TOP, (size_t)et->n_top * sizeof(int32_t));
        memcpy(et->top_logprobs, d->top_lp + (size_t)i * RUNNER_MAX_TOP, (size_t)et->n_top * sizeof(float));
    }
    return f;
}

/* Room in e->pos_ids / pos_counts for the statistics spec_rows_sampling writes for the
 * step's speculating rows: position j of a row lists its statistics plus the j drafts
 * before it (at most j new ids). 0, or -1 when out of memory (the step samples on the
 * host then). */
static int reserve_pos_stats(engine *e, int n) {
    size_t need = 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        const size_t ns = (size_t)p->r->stats.n, k = (size_t)p->spec;
        if (k && p->r->stats.cap) need += k * ns + k * (k + 1) / 2;
    }
    if (need <= e->pos_cap) return 0;
    int32_t *ids = realloc(e->pos_ids, need * sizeof *ids);
    if (ids) e->pos_ids = ids;
    int32_t *cnt = ids ? realloc(e->pos_counts, need * sizeof *cnt) : NULL;
    if (!cnt) return -1;
    e->pos_counts = cnt;
    e->pos_cap = need;
    return 0;
}

/* Position j's token statistics of speculating row p (its own, with its drafts before
 * position j counted in as generated tokens), written at *used of e->pos_ids / pos_counts,
 * into sp (which holds the row's own; unchanged at j = 0 or without a penalty). */
static void position_stats(engine *e, const row_plan *p, int j, runner_sampling *sp, size_t *used) {
    const sample_stats *st = &p->r->stats;
    if (j == 0 || !st->cap) return;
    int32_t *ids = e->pos_ids + *used, *cnt = e->pos_counts + *used;
    int n = st->n;
    memcpy(ids, st->ids, (size_t)n * sizeof *ids);
    memcpy(cnt, st->counts, (size_t)n * sizeof *cnt);
    for (int t = 0; t < j; t++) {
        const int32_t d = p->drafts[t];
        int at = sample_stats_find(st, d);
        for (int x = st->n; at < 0 && x < n; x++)   /* an id an earlier draft added */
            if (ids[x] == d) at = x;
        if (at < 0) {
            ids[at = n++] = d;
            cnt[at] = 0;
        }
        cnt[at]++;
    }
    sp->stat_ids = ids;
    sp->stat_counts = cnt;
    sp->n_stats = n;
    *used += (size_t)n;
}

/* The runner's sampling rows of a speculating row (logits rows logits_off .. + spec):
 * position j samples what plain decoding would sample there once the drafts before it
 * stand -- its output position n_out + j (the counter, so the same uniform, and eos
 * suppressed while that is below min_tokens), and its statistics with those drafts counted
 * in (position_stats). */
static void spec_rows_sampling(engine *e, const row_plan *p, size_t *used) {
    for (int j = 0; j <= p->spec; j++) {
        runner_sampling *sp = &e->dec_sp[p->logits_off + j];
        *sp = device_sampling(e, p->r, j);
        sp->stats_fed = 0;   /* (device_sampling's ahead counts a token in flight) */
        position_stats(e, p, j, sp, used);
    }
}

/* Plan row i's token as the runner sampled it into e->dec.tok[j], unless its mask found
 * nothing (mask_result): then its unconstrained draw is dropped. */
static void take_sampled(engine *e, const req *r, row_result *o, int i, int j) {
    if (r->m && mask_result(e, i) < 0) {
        grammar_dead_end(r, o);
        return;
    }
    o->n = 1;
    o->tok[0] = e->dec.tok[j];
    o->dev = j;
}

/* Whether the whole step can be one runner speculative step (one graph on CUDA): every
 * row speculates, has at least two tokens, samples as that op does (runner_spec_takes: no
 * logprobs, adjustments or masks), and its draft holds every token but the last two (the
 * op re-feeds those; a draft further behind catches up in a composed step first). */
static int runner_spec_ok(const engine *e, int n) {
    if (!e->run->ops->spec_step || e->drafter != ENGINE_DRAFTER_MODEL || n == 0) return 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        const req *r = p->r;
        const runner_sampling sp = device_sampling(e, r, 0);
        if (p->spec != e->k || r->seq.n_tokens < 2 || host_only(r) || !runner_spec_takes(e->run, &sp) ||
            e->run->ops->slot_get_len(e->run, r->seq.slot, RUNNER_DRAFT) < r->seq.n_tokens - 2)
            return 0;
    }
    return 1;
}

/* The speculative step op's inputs for the plan's n rows: slots, each row's last two
 * tokens, or where it continues a row of the op in flight that row (e->dec_prev: the op
 * feeds them, and advances the sampling counter, one step behind here, by that row's
 * tokens), and its sampling. */
static void spec_inputs(engine *e, int n) {
    for (int i = 0; i < n; i++) {
        const req *r = e->plan[i].r;
        const sched_seq *s = &r->seq;
        e->dec_slots[i] = s->slot;
        e->dec_prev[i] = r->pend_tok ? r->pend_row : -1;
        e->tokens[2 * i] = r->pend_tok ? 0 : s->tokens[s->n_tokens - 2];
        e->tokens[2 * i + 1] = r->pend_tok ? 0 : s->tokens[s->n_tokens - 1];
        e->dec_sp[i] = device_sampling(e, r, 0);
    }
}

static int runner_spec(engine *e, int n) {
    int k = e->k;
    spec_inputs(e, n);   /* (nothing in flight: every row's tokens are known) */
    runner_spec_batch sb = {.n = n, .k = k, .slots = e->dec_slots, .tokens = e->tokens, .sp = e->dec_sp,
                            .out_tokens = e->spec_out, .out_n = e->spec_n};
    int rc = e->run->ops->spec_step(e->run, &sb);
    for (int i = 0; rc == 0 && i < n; i++) {
        row_result *o = &e->res[i];
        int m = e->spec_n[i];
        o->event = 1;
        o->fed = o->n = m;
        memcpy(o->tok, e->spec_out + (size_t)i * (k + 1), (size_t)m * sizeof(int32_t));
        o->drafted = k;
        o->accepted = m - 1;
        o->kv_cap = e->plan[i].r->seq.n_computed + (k < m ? k : m);   /* what the draft holds */
    }
    return rc;
}

/* Whether the step's prompt-lookup drafts could be checked by the runner's verify op (one
 * graph on CUDA), which engine_spec_plan asks before drafting: every row decodes one
 * token and samples as that op does (runner_step_verifies). */
static int verify_possible(engine *e, int n) {
    if (!e->run->ops->verify || e->drafter != ENGINE_DRAFTER_NGRAM || n == 0) return 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        if (!row_decodes(p) || host_only(p->r)) return 0;
        e->dec_slots[i] = p->r->seq.slot;
        e->dec_sp[i] = device_sampling(e, p->r, 0);
    }
    return runner_step_verifies(e->run, n, e->dec_slots, e->dec_sp, e->k);
}

/* Else whether they could go through the composed path, the forward pass sampling every
 * position on the device (engine_spec_ngram_fwd; its own cost table): no row sampled on
 * the host, every sampling row one the forward pass takes (a prompt chunk that does not
 * end its prompt samples nothing: async_ok's peek asks the same). */
static int fwd_possible(engine *e, int n) {
    if (!engine_spec_ngram_fwd(e) || n == 0) return 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        const req *r = p->r;
        if (host_only(r)) return 0;
        if (r->seq.n_computed + p->n_new < r->seq.n_tokens) continue;
        const runner_sampling sp = device_sampling(e, r, 0);
        if (!runner_takes(e->run, RUNNER_OP_FORWARD, &sp, 0)) return 0;
    }
    return 1;
}

void engine_step_drain(engine *e) {
    for (int q = 0; q < 2; q++)
        if (e->pend[q].n) {
            e->run->ops->wait_queued(e->run);   /* a failed runner answers at once */
            e->pend[q].n = e->pend[q].spec = 0;
        }
}

static void fail_all(engine *e, engine_output *out) {
    engine_step_drain(e);
    e->failed = 1;
    e->st.failed = 1;
    while (e->n_reqs > 0) {
        req *r = e->reqs[e->n_reqs - 1];
        engine_event *ev = new_event(e, out, r);
        ev->finish = ENGINE_FINISH_ERROR;
        fill_counts(ev, r);
        engine_req_drop(e, r);
    }
}

/* Keep a finished request's first-token logits for engine_first_logits (oldest dropped). */
static void record_finished_logits(engine *e, req *r) {
    if (!r->record || r->n_out == 0) return;
    if (e->n_rec == (int)(sizeof e->rec / sizeof e->rec[0])) {
        free(e->rec[0].logits);
        memmove(e->rec, e->rec + 1, sizeof e->rec[0] * (size_t)--e->n_rec);
    }
    e->rec[e->n_rec].id = r->id;
    e->rec[e->n_rec++].logits = r->first_logits;
    r->first_logits = NULL;
}

/* Top logprobs wanted at each prompt position (prompt_logprobs -1: none, 0: the token's only). */
static int prompt_top(const req *r) { return r->sp.prompt_logprobs > 0 ? r->sp.prompt_logprobs : 0; }

/* Prompt logprobs of one prompt chunk (before n_computed advances): logits row j is
 * position n_computed + j and gives the logprob of the prompt token after it. From the
 * logits on the host, or (on_device) as the runner computed them for its forced rows
 * (prompt_rows_sampling). */
static void record_prompt_logprobs(engine *e, req *r, const row_plan *p, int on_device) {
    const sched_seq *s = &r->seq;
    for (int j = 0; j < p->pl_rows; j++) {
        int t = s->n_computed + j + 1;
        if (t >= s->n_prompt) break;
        engine_token *et = &r->pl[t];
        const int o = p->pl_off + j, n_top = prompt_top(r);
        if (on_device) {
            et->logprob = e->dec.lp[o];
            et->rank = e->dec.rank[o];
            et->n_top = n_top < e->vocab ? n_top : e->vocab;
            memcpy(et->top_ids, e->dec.top_ids + (size_t)o * RUNNER_MAX_TOP, (size_t)et->n_top * sizeof(int32_t));
            memcpy(et->top_logprobs, e->dec.top_lp + (size_t)o * RUNNER_MAX_TOP, (size_t)et->n_top * sizeof(float));
            continue;
        }
        const float *lg = e->logits + (size_t)o * e->vocab;
        et->logprob = sample_logprob(lg, e->vocab, s->tokens[t]);
        et->rank = sample_rank(lg, e->vocab, s->tokens[t]);
        et->n_top = n_top ? sample_top_logprobs(lg, e->vocab, n_top, et->top_ids, et->top_logprobs) : 0;
    }
}

/* The runner's sampling rows of a prompt chunk whose logprobs are wanted: each position but
 * one that ends the prompt is forced to the prompt token after it (the runner reports its
 * logprob, rank and top logprobs); the one that ends the prompt samples the first token. */
static void prompt_rows_sampling(engine *e, const row_plan *p) {
    const req *r = p->r;
    const sched_seq *s = &r->seq;
    for (int j = 0; j < p->pl_rows; j++) {
        const int t = s->n_computed + j + 1;
        if (t >= s->n_prompt) break;   /* the last row: p->logits_off, sampled as any */
        e->dec_sp[p->pl_off + j] = (runner_sampling){.force = 1, .force_token = s->tokens[t], .n_top = prompt_top(r)};
    }
}

/* Hand the prompt logprobs to the event that ends the prompt; the array lives as long as
 * the event buffer (freed when engine_step reuses it). */
static void deliver_prompt_logprobs(engine *e, req *r, engine_event *ev) {
    int b = e->ev_cur;
    if (e->n_pl_keep[b] == e->cap_pl_keep[b]) {
        int cap = e->cap_pl_keep[b] ? 2 * e->cap_pl_keep[b] : 16;
        engine_token **n = realloc(e->pl_keep[b], (size_t)cap * sizeof *n);
        if (!n) abort();   /* as new_event: an event cannot be lost */
        e->pl_keep[b] = n;
        e->cap_pl_keep[b] = cap;
    }
    e->pl_keep[b][e->n_pl_keep[b]++] = r->pl;
    ev->prompt_tokens = r->pl;
    r->pl = NULL;
    r->seq.all_logits = 0;   /* a recompute after preemption may use the prefix cache */
}

/* Runner row `row` for plan row p feeding its next n_new tokens (a prompt chunk or a
 * decode row) from token nt of the step, with one logits row at `no` when they end the
 * row's tokens. */
static void feed_row(engine *e, const row_plan *p, runner_row *row, int nt, int no) {
    const sched_seq *s = &p->r->seq;
    *row = (runner_row){.slot = s->slot, .tok_off = nt, .n_new = p->n_new,
                        .n_logits = s->n_computed + p->n_new == s->n_tokens, .logits_off = no};
    memcpy(e->tokens + nt, s->tokens + s->n_computed, (size_t)p->n_new * sizeof(int32_t));
}

/* The step's one runner_step batch of the target in e->rows / e->tokens: each plan row
 * feeds its next tokens -- a prompt chunk (logits at every position where prompt logprobs
 * are wanted), its one decoding token (async: the token the step in flight samples, fed on
 * the device, prev_tok), or its last token and its drafts (a verify row) -- with its
 * logits rows after the rows before it; each plan row's logits_off (its sampling row),
 * target_logits and prompt-logprob rows set. Nothing is sampled yet (step_sampling). */
static void build_step(engine *e, int n, int async, runner_step_batch *sb) {
    int nt = 0, no = 0, any_prev = 0;
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        req *r = p->r;
        const sched_seq *s = &r->seq;
        runner_row *row = &e->rows[i];
        p->pl_rows = 0;
        if (p->spec) {
            *row = (runner_row){.slot = s->slot, .tok_off = nt, .n_new = p->spec + 1, .n_logits = p->spec + 1,
                                .logits_off = no};
            e->tokens[nt] = s->tokens[s->n_computed];
            memcpy(e->tokens + nt + 1, p->drafts, (size_t)p->spec * sizeof(int32_t));
        } else {
            feed_row(e, p, row, nt, no);
            if (r->pl && s->n_computed < s->n_prompt) {
                /* prompt logprobs: logits at every position (the scheduler keeps these
                 * within e->pl_logit_rows); the last one samples when the prompt ends */
                p->pl_rows = row->n_logits = p->n_new;
                p->pl_off = no;
            }
        }
        e->spec_nd[i] = p->spec;
        for (int t = 0; t < row->n_new; t++) e->dec_prev[nt + t] = -1;
        if (async && r->pend_tok) {   /* a decode row fed the token the step in flight samples */
            e->dec_prev[nt] = r->pend_row;
            e->tokens[nt] = 0;
            any_prev = 1;
        }
        p->logits_off = p->pl_rows ? no + p->pl_rows - 1 : no;
        p->target_logits = p->pl_rows ? s->n_computed + p->n_new == s->n_tokens : row->n_logits;
        no += row->n_logits;
        nt += row->n_new;
    }
    *sb = (runner_step_batch){.b = {.which = RUNNER_TARGET, .n_rows = n, .rows = e->rows, .tokens = e->tokens,
                                    .n_tokens = nt, .logits = e->logits, .async = async,
                                    .prev_tok = any_prev ? e->dec_prev : NULL},
                              .n_drafts = e->spec_nd, .out_n = e->spec_n};
}

/* The runner samples the step's rows (into d): each logits row's runner_sampling in
 * e->dec_sp -- a row's next token (device_sampling; async: past the token in flight), a
 * verify row's every position (spec_rows_sampling), prompt positions forced to the prompt's
 * tokens -- and constrained rows' masks, which `prepare` computes while the pass runs.
 * Returns 1 when the runner's step op samples them all (runner_step_plan), else 0: the
 * batch returns logits and the host samples. */
static int step_sampling(engine *e, int n, runner_step_batch *sb, const dec_outs *d, int (*prepare)(void *)) {
    runner_batch *b = &sb->b;
    const size_t mw = vocab_mask_words(e->vocab);
    int n_out = 0, masked = 0, nm = 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        /* a draft model's sampled drafts stand by rejection sampling against the draft's
         * distributions (accept_row), which the runner does not see */
        if (host_only(p->r) || (p->spec && e->drafter == ENGINE_DRAFTER_MODEL && p->r->sp.temperature > 0)) return 0;
        masked |= p->r->m != NULL;
        n_out += e->rows[i].n_logits;
    }
    /* grammar masks have room for max_batch sampling rows (row_masks; the CUDA runner's
     * mask staging too), which prompt positions or verified positions could exceed */
    if ((masked && n_out > e->cfg.max_batch) || reserve_pos_stats(e, n)) return 0;
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        const req *r = p->r;
        if (p->pl_rows) prompt_rows_sampling(e, p);
        if (!p->target_logits) continue;
        if (p->spec) spec_rows_sampling(e, p, &used);
        else e->dec_sp[p->logits_off] = device_sampling(e, r, b->async ? r->pend_tok : 0);
        if (!r->m) continue;
        for (int o = p->logits_off; o <= p->logits_off + p->spec; o++) e->dec_sp[o].mask = e->row_masks + (size_t)o * mw;
        e->mask_rows[nm++] = i;
    }
    e->n_mask_rows = nm;
    e->masks_done = 0;
    b->sp = e->dec_sp;
    b->out_tokens = d->tok;
    b->out_logprobs = d->lp;
    b->out_top_ids = d->top_ids;
    b->out_top_logprobs = d->top_lp;
    b->out_ranks = d->rank;
    b->prepare_sp = nm ? prepare : NULL;
    b->prepare_ctx = e;
    if (runner_step_plan(e->run, sb) != RUNNER_OP_NONE) return 1;   /* (runner_step runs that op) */
    *b = (runner_batch){.which = b->which, .n_rows = b->n_rows, .rows = b->rows, .tokens = b->tokens,
                        .n_tokens = b->n_tokens, .logits = b->logits};
    sb->op = 0;
    e->n_mask_rows = 0;
    return 0;
}

/* The step counters of one runner_step (on_device: it sampled). */
static void count_op(engine *e, int op, int on_device) {
    if (op == RUNNER_OP_DECODE) e->st.steps_device_decode++;
    if (op == RUNNER_OP_VERIFY) e->st.steps_runner_verify++;
    if (op != RUNNER_OP_FORWARD) return;
    e->st.steps_composed++;
    if (on_device) e->st.steps_forward_sampled++;
}

/* Phase 3 of a step that is not one speculative step op: the draft's passes (a draft
 * model), then one runner_step over every row (prefill chunks, decode rows, verify rows),
 * which samples in the runner where it can, else returns logits and the rows sample or
 * accept on the host. */
static int target_step(engine *e, int n) {
    const int V = e->vocab;
    int rc;
    if (n == 0) return 0;
    if (e->drafter == ENGINE_DRAFTER_MODEL && (rc = draft_phase(e, n))) return rc;
    runner_step_batch sb;
    build_step(e, n, 0, &sb);
    const int on_device = step_sampling(e, n, &sb, &e->dec, prepare_masks);
    if ((rc = runner_step(e->run, &sb))) return rc;
    count_op(e, sb.op, on_device);
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        req *r = p->r;
        sched_seq *s = &r->seq;
        row_result *o = &e->res[i];
        if (p->spec && on_device) {
            accept_sampled(e, p, o, e->spec_n[i]);
            e->st.spec_rows_runner_sampled++;
        } else if (p->spec) {
            accept_row(e, p, o);
        } else {
            if (p->pl_rows) record_prompt_logprobs(e, r, p, on_device);
            o->fed = p->n_new;
            o->event = p->target_logits != 0;
            if (p->target_logits && r->max_new <= 0) {   /* max_tokens 0: the prompt only */
                o->forced = ENGINE_FINISH_LENGTH;
            } else if (p->target_logits && on_device) {
                take_sampled(e, r, o, i, p->logits_off);
            } else if (p->target_logits) {
                float *lg = e->logits + (size_t)p->logits_off * V;
                memcpy(e->work, lg, (size_t)V * sizeof(float));
                int32_t t = sample_row(e, r, e->work, s->tokens, s->n_tokens);
                if (t < 0) {
                    grammar_dead_end(r, o);
                } else {
                    o->n = 1;
                    o->tok[0] = t;
                    o->raw = lg;
                }
            }
        }
        /* (a draft model: KV is committed no further than the draft holds) */
        if (e->drafter == ENGINE_DRAFTER_MODEL) o->kv_cap = e->run->ops->slot_get_len(e->run, s->slot, RUNNER_DRAFT);
    }
    return 0;
}

/* What every path did, applied the one way: speculation counters, the computed positions,
 * the tokens (logprobs from raw logits, or as the runner sampled them), the KV prefix
 * committed (no further than the draft holds), the event, and the end of a request. */
static void commit_and_emit(engine *e, int n, const row_plan *plan, const row_result *res, const dec_outs *d,
                            engine_output *out) {
    for (int i = 0; i < n; i++) {
        req *r = plan[i].r;
        if (!r) continue;   /* dropped while its step was in flight */
        sched_seq *s = &r->seq;
        const row_result *o = &res[i];
        if (o->drafted) count_verify(e, r, o->drafted, o->accepted);
        s->n_computed += o->fed;
        if (o->placed) {   /* the placeholders pre_commit appended make way for the tokens */
            s->n_tokens -= o->placed;
            r->pend_tok = 0;
        }
        engine_event *ev = o->event ? new_event(e, out, r) : NULL;
        engine_finish f = o->forced;
        for (int j = 0; j < o->n && f == ENGINE_RUNNING; j++)
            f = o->dev >= 0 ? emit_sampled(e, r, ev, d, o->dev + j)
                            : emit_token(e, r, ev, o->tok[j], o->raw ? o->raw + (size_t)j * e->vocab : NULL, NULL);
        commit_kv(e, s, o->kv_cap < s->n_computed ? o->kv_cap : s->n_computed);
        if (ev) {
            ev->finish = f;
            fill_counts(ev, r);
            if (r->pl && s->n_computed >= s->n_prompt) deliver_prompt_logprobs(e, r, ev);
        }
        if (f != ENGINE_RUNNING) {
            record_finished_logits(e, r);
            engine_req_drop(e, r);
        }
    }
}

static double step_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- async scheduling -------------------------------------------------------------------
 * Where the runner pipelines its ops (runner.decode_async, forward_async), a step whose
 * rows sample on the device with nothing the host must update between tokens (no host
 * sampling, no drafts this step; penalties only where the runner counts the token in
 * flight itself, runner.async_stats; grammars only where the runner calls back once the
 * pass is queued, runner.async_masks, so that prepare_masks_async can wait for the step in
 * flight's tokens and advance the rows' matchers past them: async_ok) is queued without
 * waiting for it, as one runner_step (the decode op when every row decodes, else one
 * forward that samples: prompt chunks beside decode rows): it is "in flight". The next engine_step
 * first assumes every row of it goes on: each row's fed positions count as computed and a
 * placeholder stands for the token it samples (pre_commit), unless max_tokens or the
 * context limit ends it with that token. Then the scheduler runs as always. If the next
 * step again qualifies, it is queued with those rows fed the tokens the step in flight
 * samples, on the device (runner_batch.prev_tok), and only then
 * does the host wait for the step in flight and commit it (finish_pending); otherwise the
 * host waits and commits first, drops the rows that ended from the new step, and runs it
 * the usual way. So the host's scheduling and commit of one step overlap the GPU's work
 * on the next. A row that ended (stop token, a client gone, an abort) is known one step
 * late: its token from the next step is never emitted (its plan row is cleared when the
 * request is dropped) and its KV goes back to the pool when it is dropped; the runner's
 * stream runs the queued step before any later op that could reuse its slot or blocks.
 * A draft model's speculative step op (runner.spec_step, one graph on CUDA) goes in flight
 * the same way where the runner queues it (runner.spec_async; engine_spec_async_ok): it
 * emits 1..k+1 tokens per row, so pre_commit counts the most (k + 1 placeholders,
 * positions to match), which can only over-reserve KV, and a row whose most could end it
 * (max_tokens, context) takes no placeholders and sits the next step out. The next step is
 * queued behind it only as another such op over rows that all continue its rows and would
 * speculate whatever it emits (spec_chain_ok): the runner feeds them their last two tokens
 * and advances their lengths and sampling counters on the device
 * (runner_spec_batch.prev_row), and the commit (finish_spec) puts the tokens in the
 * placeholders' place and corrects the positions. Otherwise the op is committed first.
 * Prompt lookup stays synchronous when it speculates: its drafts are looked up on the
 * tokens the step before emitted. A step a drafter would not speculate in is queued like
 * any other (engine_spec_skip, engine_spec_ngram_idle); prompt lookup, with a step in
 * flight, looks up on the tokens before its placeholder and prices what it finds lower
 * (the match must also predict the token in flight), so a copy in progress stays
 * synchronous and chat, which rarely matches, goes in flight. */

#define TOKEN_PENDING (-1)

/* A request is being dropped: no step of this engine may refer to it any more. */
void engine_step_forget(engine *e, const req *r) {
    for (int q = 0; q < 2; q++)
        for (int i = 0; i < e->pend[q].n; i++)
            if (e->pend[q].plan[i].r == r) e->pend[q].plan[i].r = NULL;
    for (int i = 0; i < e->n_plan; i++)
        if (e->plan[i].r == r) e->plan[i].r = NULL;
}

/* Whether the step planned in e->plan can be queued in flight: nothing speculates (a
 * step a draft model or prompt lookup would speculate in is not queued) and the op
 * runner_step will run it with -- the decode op when every row decodes, else a forward that
 * samples -- takes every row's sampling queued (runner_takes, async: penalties only where
 * the runner counts the token in flight, masks only where it calls back once the pass is
 * queued). */
static int async_ok(engine *e, int n) {
    const runner *run = e->run;
    /* (one call may commit the step in flight's token and then a speculative step's k + 1
     * tokens into one event) */
    if (e->cfg.sync_scheduling || !run->ops->wait_queued || n == 0 || e->k + 2 > ENGINE_MAX_STEP_TOKENS) return 0;
    int all_decode = 1, decode = 1, forward = 1, verify = run->ops->verify ? 1 : -1, fwd = 1;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        const req *r = p->r;
        const sched_seq *s = &r->seq;
        if (host_only(r) || r->pl) return 0;   /* prompt logprobs: forced rows, never queued */
        all_decode &= row_decodes(p);
        if (s->n_computed + p->n_new < s->n_tokens) continue;   /* a prompt chunk: no sampling */
        const runner_sampling sp = device_sampling(e, r, r->pend_tok);
        const int ops = runner_ops_taking(run, &sp, 1);
        decode &= ops >> RUNNER_OP_DECODE & 1;
        forward &= ops >> RUNNER_OP_FORWARD & 1;
        /* (the rows the runner's verify op, or else the composed path, would take,
         * synchronously, as verify_possible / fwd_possible ask once the token in flight is
         * in: no statistics fed) */
        if (verify > 0 || fwd) {
            runner_sampling vsp = sp;
            vsp.stats_fed = 0;
            if (verify > 0 && !runner_takes(run, RUNNER_OP_VERIFY, &vsp, 0)) verify = 0;
            fwd &= runner_takes(run, RUNNER_OP_FORWARD, &vsp, 0);   /* (fwd_possible's question) */
        }
    }
    if (!all_decode && verify > 0) verify = 0;   /* (the verify op takes decoding rows only) */
    if (verify >= 0) verify = engine_spec_ngram_mode(e, verify > 0, fwd && engine_spec_ngram_fwd(e));
    /* A step a drafter would not speculate in goes in flight too: a draft model that
     * declines (engine_spec_skip), or prompt lookup whose rows find no drafts that the cost
     * model would take (engine_spec_ngram_idle). Both count what the plan would (declines,
     * back-off), so the probes come as they would; they are asked last, as their answer is
     * used. A draft model takes in prompt chunks with the target (target_step): such steps
     * are not queued. */
    if (!(all_decode ? decode || forward : forward)) return 0;
    if (e->k == 0 || (all_decode && engine_spec_never(e, n))) return 1;
    if (e->drafter == ENGINE_DRAFTER_MODEL) return all_decode && engine_spec_skip(e, n);
    return engine_spec_ngram_idle(e, n, verify);
}

/* The step in flight is taken as done for the scheduler: its rows' fed positions
 * computed, a placeholder for each token it samples unless that token ends the row
 * (max_tokens, context). */
static void pre_commit(engine *e, const pend_step *q) {
    for (int i = 0; i < q->n; i++) {
        const row_plan *p = &q->plan[i];
        req *r = p->r;
        if (!r) continue;
        sched_seq *s = &r->seq;
        s->n_computed += p->n_new;
        if (q->spec) {   /* 1..k+1 tokens: the most, unless the most could end the row */
            const int k1 = q->spec + 1;
            if (r->n_out + k1 < r->max_new && s->n_tokens + k1 < e->cfg.max_seq_len) {
                s->n_computed += k1 - 1;
                for (int j = 0; j < k1; j++) s->tokens[s->n_tokens++] = TOKEN_PENDING;
                r->pend_tok = k1;
                r->pend_row = i;
            }
            continue;
        }
        if (p->target_logits && r->n_out + 1 < r->max_new && s->n_tokens + 1 < e->cfg.max_seq_len) {
            s->tokens[s->n_tokens++] = TOKEN_PENDING;
            r->pend_tok = 1;
            r->pend_row = p->logits_off;
        }
    }
}

/* After a step with constrained rows was queued into q: which of them no token fitted. */
static void keep_dead_rows(engine *e, int n, pend_step *q) {
    for (int i = 0; i < n; i++) q->dead[i] = 0;
    for (int j = 0; j < e->n_mask_rows; j++) q->dead[e->mask_rows[j]] = mask_result(e, e->mask_rows[j]) < 0;
}

/* Queue the planned step (slots synced; async_ok) in flight into q: one runner_step that
 * samples on the device, rows fed the tokens the step in flight samples on the device. */
static int launch_async(engine *e, int n, pend_step *q) {
    runner_step_batch sb;
    int nd = 0;
    for (int i = 0; i < n; i++) e->plan[i].spec = 0;   /* (sync_rows' "may speculate") */
    build_step(e, n, 1, &sb);
    if (!step_sampling(e, n, &sb, &q->o, prepare_masks_async)) return SPECD_ESTATE;   /* (async_ok said it would) */
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        q->plan[i] = *p;
        if (row_decodes(p)) {
            p->r->decode_steps++;
            nd++;
        }
    }
    if (nd) {   /* as engine_spec_plan counts a step with decoding rows */
        e->st.spec_rows_decoding += (uint64_t)nd;
        e->st.spec_steps_decoding++;
    }
    const double t = step_now();
    int rc = runner_step(e->run, &sb);
    e->st.run_seconds += step_now() - t;
    if (rc) return rc;
    keep_dead_rows(e, n, q);
    count_op(e, sb.op, 1);
    if (sb.op == RUNNER_OP_FORWARD) e->st.steps_async_composed++;
    q->n = n;
    q->spec = 0;
    return 0;
}

int engine_spec_async_ok(const engine *e) {
    return !e->cfg.sync_scheduling && e->run->spec_async && e->run->ops->wait_queued &&
           e->drafter == ENGINE_DRAFTER_MODEL && 2 * (e->k + 1) <= ENGINE_MAX_STEP_TOKENS;
}

/* Whether the planned rows (the scheduler's, with a speculative step op in flight) can be
 * the next speculative step op, queued behind that one before it is committed: every row
 * continues one of its rows (pre_commit's placeholders stand for the 1..k+1 tokens it
 * emits) and would speculate however many that turns out to be (row_may_speculate over
 * the most, output room past it), samples as the op does, and the draft model would have
 * every row speculate now (engine_spec_chain). So the step is the one the engine would
 * run after the commit. */
static int spec_chain_ok(engine *e, int n) {
    if (!engine_spec_async_ok(e) || n == 0) return 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        const req *r = p->r;
        if (r->pend_tok != e->k + 1 || !row_may_speculate(e, p) || r->n_out + e->k + 2 >= r->max_new || host_only(r))
            return 0;
        const runner_sampling sp = device_sampling(e, r, 0);
        if (!runner_spec_takes(e->run, &sp)) return 0;
    }
    return engine_spec_chain(e, n);
}

/* Queue the planned step (slots synced; every row speculates k: runner_spec_ok or
 * spec_chain_ok) as one speculative step op in flight into q (spec_inputs). */
static int launch_spec(engine *e, int n, pend_step *q) {
    spec_inputs(e, n);
    memcpy(q->plan, e->plan, (size_t)n * sizeof *q->plan);
    runner_spec_batch sb = {.n = n, .k = e->k, .slots = e->dec_slots, .tokens = e->tokens, .sp = e->dec_sp,
                            .out_tokens = q->spec_out, .out_n = q->spec_n, .async = 1, .prev_row = e->dec_prev};
    const double t = step_now();
    int rc = e->run->ops->spec_step(e->run, &sb);
    e->st.run_seconds += step_now() - t;
    if (rc) return rc;
    e->st.steps_runner_spec++;
    q->n = n;
    q->spec = e->k;
    return 0;
}

/* Commit a speculative step op that was in flight: each row's m tokens in place of its
 * placeholders, the positions pre_commit counted corrected to what stands (the fed token
 * and m - 1 drafts), KV committed no further than the draft holds. A row preempted
 * meanwhile (no slot) keeps its tokens and recomputes its KV. */
static int finish_spec(engine *e, int n, pend_step *q, engine_output *out) {
    const int k = q->spec;
    q->spec = 0;
    for (int i = 0; i < n; i++) {
        req *r = q->plan[i].r;
        row_result *o = &q->res[i];
        const int m = q->spec_n[i];
        if (m < 1 || m > k + 1) return SPECD_ESTATE;
        *o = (row_result){.event = 1, .n = m, .dev = -1, .drafted = k, .accepted = m - 1, .kv_cap = 0,
                          .forced = ENGINE_RUNNING};
        memcpy(o->tok, q->spec_out + (size_t)i * (k + 1), (size_t)m * sizeof(int32_t));
        if (!r) continue;
        const sched_seq *s = &r->seq;
        o->placed = r->pend_tok;
        if (s->slot >= 0) {
            const int L = s->n_computed - (r->pend_tok ? k + 1 : 1);   /* the fed token's position */
            o->fed = L + m - s->n_computed;
            o->kv_cap = L + (k < m ? k : m);
        }
    }
    commit_and_emit(e, n, q->plan, q->res, &q->o, out);
    return 0;
}

/* Wait for the step in flight and commit it. */
static int finish_pending(engine *e, pend_step *q, engine_output *out) {
    const double t = step_now();
    int rc = q->waited ? 0 : e->run->ops->wait_queued(e->run);   /* (a mask callback may have) */
    e->st.run_seconds += step_now() - t;
    const int n = q->n;
    q->n = 0;
    q->waited = 0;
    if (rc) return rc;
    if (q->spec) return finish_spec(e, n, q, out);
    for (int i = 0; i < n; i++) {
        const row_plan *p = &q->plan[i];
        const req *r = p->r;
        q->res[i] = (row_result){.event = p->target_logits, .n = p->target_logits, .dev = p->logits_off,
                                 .kv_cap = INT_MAX, .forced = ENGINE_RUNNING, .placed = r && r->pend_tok};
        q->res[i].tok[0] = q->o.tok[p->logits_off];
        if (r && q->dead[i]) grammar_dead_end(r, &q->res[i]);   /* its draw was unmasked */
        if (r && r->seq.slot >= 0 && e->drafter == ENGINE_DRAFTER_MODEL)   /* the draft stays behind,
                                                                             * as in target_step */
            q->res[i].kv_cap = e->run->ops->slot_get_len(e->run, r->seq.slot, RUNNER_DRAFT);
    }
    commit_and_emit(e, n, q->plan, q->res, &q->o, out);
    return 0;
}

/* Phase 2 over the planned rows: slots mirrored into the runner, whether each may
 * speculate. */
static int sync_rows(engine *e, int n, engine_output *out) {
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        req *r = p->r;
        int rc = sync_slot(e, r);
        if (rc) return rc;
        p->spec = row_may_speculate(e, p);
        out->n_scheduled_tokens += p->n_new;
    }
    return 0;
}

/* Phase 1b: what the step may draft through (verify_possible, fwd_possible) and the
 * speculation plan. */
static void plan_spec(engine *e, int n) {
    e->step_verify = verify_possible(e, n);
    e->step_fwd = !e->step_verify && fwd_possible(e, n);
    engine_spec_plan(e, n);
}

static int run_planned(engine *e, int n, engine_output *out);

/* Whether the plan has every row verify k drafts (a draft model's step: all or none). */
static int plan_all_speculate(const engine *e, int n) {
    for (int i = 0; i < n; i++)
        if (e->plan[i].spec != e->k) return 0;
    return 1;
}

/* Phases 2-4 for a step with no step in flight: queued in flight when it can be, else run
 * on the one path that fits every row, then committed. */
static int run_step(engine *e, int n, engine_output *out) {
    int rc = sync_rows(e, n, out);
    if (rc) return rc;
    if (async_ok(e, n)) return launch_async(e, n, &e->pend[e->pend_cur]);
    plan_spec(e, n);
    return run_planned(e, n, out);
}

/* Phases 3-4 of a planned step: one speculative step op where a draft model's rows all
 * fit it (queued in flight where engine_spec_async_ok: the next step may follow it
 * there), else one runner_step; then the commit. */
static int run_planned(engine *e, int n, engine_output *out) {
    int rc;
    if (engine_spec_async_ok(e) && runner_spec_ok(e, n)) return launch_spec(e, n, &e->pend[e->pend_cur]);
    for (int i = 0; i < n; i++)
        e->res[i] = (row_result){.dev = -1, .kv_cap = INT_MAX, .forced = ENGINE_RUNNING};
    /* Run the step -- one speculative step op where a draft model's rows all fit it, else
     * one runner_step -- then commit and emit. Prompt-lookup steps that speculate are timed:
     * the cost model learns what the runner's part cost (spec_cost_observe; the host's part
     * is learned by engine_step, engine_spec_host). */
    const double t_run = step_now();
    if (runner_spec_ok(e, n)) {
        rc = runner_spec(e, n);
        e->st.steps_runner_spec++;
    } else {
        rc = target_step(e, n);
    }
    const double run = step_now() - t_run;
    e->st.run_seconds += run;
    if (rc) return rc;
    commit_and_emit(e, n, e->plan, e->res, &e->dec, out);
    /* (where queued ops run on a device, the commit is part of the host time that
     * engine_spec_host learns; where they are computed when queued, plain steps pay their
     * commit too, and the scale takes the acceptance over host logits) */
    if (e->step_spec && e->drafter == ENGINE_DRAFTER_NGRAM && e->cost.n_b)
        engine_spec_observe_step(e, e->run->async_device ? run : step_now() - t_run);
    return 0;
}

static int engine_step_timed(engine *e, engine_output *out);

int engine_step(engine *e, engine_output *out) {
    const double t0 = step_now(), run0 = e->st.run_seconds;
    int rc = engine_step_timed(e, out);
    const double wall = step_now() - t0;
    e->st.step_seconds += wall;
    if (!rc && e->n_plan > 0) engine_spec_host(e, e->n_plan, wall - (e->st.run_seconds - run0));
    e->n_plan = 0;
    return rc;
}

static int engine_step_timed(engine *e, engine_output *out) {
    out->n_events = 0;
    e->ev_cur ^= 1;
    e->out_stamp++;
    out->events = e->events[e->ev_cur];
    for (int i = 0; i < e->n_pl_keep[e->ev_cur]; i++) free(e->pl_keep[e->ev_cur][i]);
    e->n_pl_keep[e->ev_cur] = 0;
    out->n_scheduled_tokens = 0;
    if (e->failed) return SPECD_ESTATE;
    pend_step *fl = e->pend[e->pend_cur].n ? &e->pend[e->pend_cur] : NULL;   /* in flight */
    if (fl) pre_commit(e, fl);
    sched_batch sb;
    int rc = sched_schedule(e->sched, &sb);
    if (rc) goto fail;
    e->st.preemptions += (uint64_t)sb.n_preempted;
    /* Sequences that can never fit (already out of the queues, KV and slot freed). */
    for (int i = 0; i < sb.n_rejected; i++) {
        req *r = sb.rejected[i]->user;
        engine_event *ev = new_event(e, out, r);
        ev->finish = ENGINE_FINISH_ERROR;
        fill_counts(ev, r);
        fprintf(stderr, "specd: request %llu rejected by the scheduler: %s\n",
                (unsigned long long)r->id, specd_strerror(sb.rejected[i]->reject_code));
        engine_req_drop(e, r);
    }
    /* Phase 1: plan rows. */
    int n = sb.n;
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        memset(p, 0, sizeof *p);
        p->r = sb.seqs[i]->user;
        p->n_new = sb.n_new[i];
    }
    e->n_plan = n;
    int planned = 0;
    if (fl && fl->spec && spec_chain_ok(e, n)) {
        /* a speculative step behind the one in flight: planned as the engine would after
         * the commit (spec_chain_ok), then queued unless the plan is not one op after all */
        if ((rc = sync_rows(e, n, out))) goto fail;
        plan_spec(e, n);
        planned = 1;
        if (plan_all_speculate(e, n)) {
            if ((rc = launch_spec(e, n, &e->pend[e->pend_cur ^ 1]))) goto fail;
            e->st.steps_async++;
            e->st.steps_async_spec++;
            e->pend_cur ^= 1;
            if ((rc = finish_pending(e, fl, out))) goto fail;
            return 0;
        }
    } else if (fl && !fl->spec && async_ok(e, n)) {   /* queue the next step, then commit the one in flight */
        e->mask_fl = fl;   /* constrained rows wait for its tokens (prepare_masks_async) */
        if (!(rc = sync_rows(e, n, out))) rc = launch_async(e, n, &e->pend[e->pend_cur ^ 1]);
        e->mask_fl = NULL;
        if (rc) goto fail;
        e->st.steps_async++;
        e->pend_cur ^= 1;
        if ((rc = finish_pending(e, fl, out))) goto fail;
        return 0;
    }
    if (fl) {
        if ((rc = finish_pending(e, fl, out))) goto fail;
        int m = 0;   /* rows whose request ended with the step in flight are gone */
        for (int i = 0; i < n; i++)
            if (e->plan[i].r) e->plan[m++] = e->plan[i];
        n = e->n_plan = m;
    }
    if ((rc = planned ? run_planned(e, n, out) : run_step(e, n, out))) goto fail;
    return 0;
fail:
    fprintf(stderr, "specd: engine step failed: %s\n", specd_strerror(rc));
    fail_all(e, out);
    return rc;
}
