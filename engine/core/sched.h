/* Continuous-batching scheduler (prefix sched_), after vLLM v1: it thinks in tokens.
 * Every sequence has tokens (prompt + generated) and n_computed (tokens whose KV is in
 * the cache); each step it gives each scheduled sequence a number of new tokens to feed
 * (a prefill chunk, 1 for decode, or 1 + lookahead with speculation) under a token
 * budget and max_batch, preferring running sequences (decode first), then admitting
 * waiting ones FCFS with chunked prefill and prefix-cache hits. When blocks run out it
 * preempts the newest running sequence (recompute: its blocks are freed and it goes back
 * to the head of the waiting queue), so the oldest always make progress.
 *
 * Slots: a running sequence holds a slot in [0, max_batch); waiting ones hold none.
 * The engine mirrors slot changes into the runner (see sched_seq.slot_epoch).
 *
 * Order: running sequences are kept in arrival order and every running sequence arrived
 * before every waiting one (admission takes the waiting head; a preempted sequence is the
 * newest running one and goes back to the waiting head). So "newest running" is the
 * running tail, and the oldest request always progresses: nobody starves.
 *
 * Rejection: a sequence that can never fit (its tokens need more blocks than the whole
 * pool, or more than its block table / max_seq_len) is never retried forever. sched_add
 * refuses such a prompt up front (SPECD_ERANGE / SPECD_ENOSPACE); a sequence that grows
 * too large while it runs (or while it waits after a preemption) is taken out of the
 * queues, its KV and slot freed, its state set to SEQ_REJECTED with reject_code, and it
 * is listed in sched_batch.rejected: the engine fails that request, then sched_remove.
 *
 * One step (sched_schedule):
 *   1. running sequences in order (paused ones skipped): n_new = min(n_tokens -
 *      n_computed, budget left);
 *      reserve KV for n_computed + n_new (+ lookahead once the prompt is computed);
 *      on SPECD_ENOSPACE preempt the newest running sequence (possibly itself) and retry.
 *      The budget counts fed tokens (n_new), not the draft's lookahead tokens.
 *   2. if nothing was preempted: admit waiting sequences FCFS while budget, slots and
 *      blocks allow (prefix-cache hit first, then a prefill chunk of at most the budget
 *      left); stop at the first one whose chunk does not fit.
 *   Prompt tokens (1 and 2) stop at max_prefill_decoding when any running sequence is
 *   decoding (the oldest prompts first).
 *   In both, a sequence with all_logits still in its prompt feeds at most what is left of
 *   the step's max_logit_tokens (none left: a running one waits for the next step, a
 *   waiting one stops admission, FCFS) and is admitted without a prefix-cache hit.
 * The engine then computes, advances n_computed by the tokens actually computed, calls
 * kv_seq_commit, and appends sampled tokens (n_tokens - n_computed may be > 1 after a
 * speculative step: the next step simply feeds them all).
 *
 * Pure logic: no CUDA, no I/O. Not thread safe. */
#ifndef SPECD_SCHED_H
#define SPECD_SCHED_H

#include <stdint.h>

#include "engine/core/kv.h"

typedef enum { SEQ_WAITING = 0, SEQ_RUNNING, SEQ_FINISHED, SEQ_REJECTED } sched_state;

typedef struct sched_seq {
    uint64_t id;
    int32_t *tokens;         /* prompt + generated; owned by the engine */
    int n_tokens;
    int n_prompt;
    int n_computed;          /* tokens whose target KV is in the cache */
    int slot;                /* running: slot row; otherwise -1 */
    uint32_t slot_epoch;     /* bumped each time the sequence gets a (new) slot */
    int n_preemptions;
    int n_cached_tokens;     /* prefix-cache hit (tokens) at the latest admission */
    int reject_code;         /* SEQ_REJECTED: SPECD_ENOSPACE (pool too small for it) or
                              * SPECD_ERANGE (beyond its table / max_seq_len); else 0 */
    kv_seq kv;
    kv_seq kvw;              /* its table in the window pool (sched_config.win), if any;
                              * the caller initialises it like kv */
    sched_state state;
    uint64_t arrival;        /* set by sched_add: FCFS order */
    int paused;              /* set by the engine: a running sequence that keeps its KV and
                              * slot but is not scheduled (its client stopped reading); it
                              * can still be preempted */
    int all_logits;          /* set by the engine: its prompt wants logits at every position
                              * (prompt logprobs): no prefix-cache hit at admission, and its
                              * prompt chunks count against max_logit_tokens */
    void *user;              /* engine's request */
    struct sched_seq *prev, *next; /* intrusive queue links (scheduler-owned) */
} sched_seq;

typedef struct {
    int max_batch;           /* running sequences at most (= slots) */
    int max_tokens_per_step; /* token budget of one step */
    int max_seq_len;
    int lookahead;           /* extra KV slots reserved per decode step (speculation: k):
                              * a decoding sequence (prompt fully computed) gets blocks for
                              * n_computed + n_new + lookahead, clamped to its table's
                              * capacity (the engine must not draft past max_seq_len) */
    int max_logit_tokens;    /* prompt tokens of all_logits sequences fed per step at most
                              * (the engine's buffer for their logits; 0: none may run) */
    int max_prefill_decoding;/* prompt tokens a step feeds at most while it also feeds
                              * decode rows (0: only the token budget bounds them): a
                              * burst of prompts then lengthens decode steps by at most
                              * this much (inter-token latency) and is admitted over more
                              * steps; with nothing decoding the whole budget applies */
    kv_pool *win;            /* a window pool beside the main one (kv.h), or NULL: every
                              * reservation, release and prefix hit covers both tables */
    int window;              /* its layers' sliding window (tokens), with win */
} sched_config;

typedef struct sched sched;

typedef struct {
    int n;                   /* scheduled sequences this step */
    sched_seq **seqs;        /* [n], scheduler-owned arrays, valid until next call */
    int *n_new;              /* [n] tokens to feed: tokens[n_computed .. n_computed+n_new) */
    int n_preempted;         /* sequences preempted during this call (now WAITING) */
    sched_seq **preempted;
    int n_rejected;          /* sequences rejected during this call (see top of file) */
    sched_seq **rejected;
} sched_batch;

sched *sched_create(const sched_config *cfg, kv_pool *kv, char *err, size_t errlen);
void sched_destroy(sched *s);

/* Queue a new sequence (state WAITING). The caller initialised s->kv (kv_seq_init, empty),
 * tokens, n_tokens, n_prompt; n_computed, slot, state, arrival, n_preemptions are set
 * here. Errors (sequence not queued): SPECD_EINVAL (n_tokens < 1, n_prompt out of
 * [1, n_tokens], table not empty), SPECD_ERANGE (n_tokens > max_seq_len or beyond its
 * table), SPECD_ENOSPACE (its tokens need more blocks than the pool has). */
int sched_add(sched *s, sched_seq *seq);
/* Remove a sequence in any state (finished, cancelled, rejected): frees its blocks and
 * slot; state becomes SEQ_FINISHED. Safe to call twice. */
void sched_remove(sched *s, sched_seq *seq);

/* Build the next step into *out (arrays owned by the scheduler, valid until the next
 * call). out->n == 0 with sequences queued means nothing can run now. Returns 0. */
int sched_schedule(sched *s, sched_batch *out);

/* Draft tokens the engine may write after feeding n_new tokens of a scheduled sequence
 * (call before advancing n_computed): min(lookahead, reserved KV tokens beyond
 * n_computed + n_new); 0 while the prompt is not fully computed (no speculation during
 * prefill). Less than lookahead only near the end of the block table. */
int sched_lookahead_room(const sched *s, const sched_seq *seq, int n_new);

int sched_num_running(const sched *s);
int sched_num_waiting(const sched *s);
/* Iterate running sequences (for invariant checks): fills up to cap, returns count. */
int sched_running(const sched *s, sched_seq **out, int cap);
int sched_waiting(const sched *s, sched_seq **out, int cap);

/* Invariant check for tests: queue links and counts, states, slots unique and in range,
 * arrival order (running < waiting), waiting sequences hold no KV. 0 or SPECD_ESTATE. */
int sched_check(const sched *s, char *err, size_t errlen);

#endif
