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
 * Pure logic: no CUDA, no I/O. Not thread safe. */
#ifndef SPECD_SCHED_H
#define SPECD_SCHED_H

#include <stdint.h>

#include "engine/kv.h"

typedef enum { SEQ_WAITING = 0, SEQ_RUNNING, SEQ_FINISHED } sched_state;

typedef struct sched_seq {
    uint64_t id;
    int32_t *tokens;         /* prompt + generated; owned by the engine */
    int n_tokens;
    int n_prompt;
    int n_computed;          /* tokens whose target KV is in the cache */
    int slot;                /* running: slot row; otherwise -1 */
    uint32_t slot_epoch;     /* bumped each time the sequence gets a (new) slot */
    int n_preemptions;
    kv_seq kv;
    sched_state state;
    uint64_t arrival;        /* set by sched_add: FCFS order */
    void *user;              /* engine's request */
    struct sched_seq *prev, *next; /* intrusive queue links (scheduler-owned) */
} sched_seq;

typedef struct {
    int max_batch;           /* running sequences at most (= slots) */
    int max_tokens_per_step; /* token budget of one step */
    int max_seq_len;
    int lookahead;           /* extra KV slots reserved per decode step (speculation: k):
                              * a decoding sequence needs blocks for n_tokens + lookahead */
} sched_config;

typedef struct sched sched;

typedef struct {
    int n;                   /* scheduled sequences this step */
    sched_seq **seqs;        /* [n], scheduler-owned arrays, valid until next call */
    int *n_new;              /* [n] tokens to feed: tokens[n_computed .. n_computed+n_new) */
    int n_preempted;         /* sequences preempted during this call */
    sched_seq **preempted;
} sched_batch;

sched *sched_create(const sched_config *cfg, kv_pool *kv, char *err, size_t errlen);
void sched_destroy(sched *s);

/* Queue a new sequence (state WAITING). The caller initialised s->kv (kv_seq_init),
 * tokens, n_tokens, n_prompt; n_computed is set here. */
int sched_add(sched *s, sched_seq *seq);
/* Remove a sequence in any state (finished or cancelled): frees its blocks and slot. */
void sched_remove(sched *s, sched_seq *seq);

/* Build the next step. */
int sched_schedule(sched *s, sched_batch *out);

int sched_num_running(const sched *s);
int sched_num_waiting(const sched *s);
/* Iterate running sequences (for invariant checks): fills up to cap, returns count. */
int sched_running(const sched *s, sched_seq **out, int cap);
int sched_waiting(const sched *s, sched_seq **out, int cap);

#endif
