/* Private to the engine's files (engine.c: configuration, creation, requests;
 * engine_step.c: one step; engine_spec.c: the speculation policy). Not part of the
 * engine's interface: nothing outside engine/core/engine*.c includes it. */
#ifndef SPECD_ENGINE_INTERNAL_H
#define SPECD_ENGINE_INTERNAL_H

#include "engine/core/engine.h"
#include "engine/core/kv.h"
#include "engine/core/ngram.h"
#include "engine/core/runner.h"
#include "engine/tp/runner_tp.h"
#include "engine/core/sample.h"
#include "engine/core/sched.h"
#include "engine/core/spec_cost.h"

/* A declined drafter is still tried every this many declines (one draft token per row for
 * prompt lookup, a whole step for a draft model), so that an acceptance estimate that once
 * fell below the break-even point can rise again: it only moves when drafts are tried. */
#define SPEC_PROBE_EVERY 16

typedef struct req {
    sched_seq seq;               /* seq.user points back here */
    uint64_t id;
    engine_sampling sp;
    int32_t *lb_ids;
    float *lb_vals;
    sample_params spp;
    sample_stats stats;          /* with a penalty: the distinct ids of its output (and of
                                  * its prompt, with a repetition penalty) and their output
                                  * counts, kept by emit_token, for on-device penalties */
    uint64_t seed;
    int max_new;                 /* new tokens at most */
    int n_out;                   /* generated so far */
    uint32_t synced_epoch;       /* slot epoch mirrored into the runner */
    int synced_blocks;           /* block-table entries mirrored into the runner */
    int synced_dropped;          /* ... and of those, the leading ones mirrored as released */
    int synced_win_blocks, synced_win_dropped;   /* the same for the window-pool table */
    int record;                  /* keep the logits that chose the first output token */
    float *first_logits;
    int n_cached;                /* prompt tokens served from the prefix cache */
    int verify_steps, draft_tokens, accepted;
    matcher *m;                  /* constrained decoding state, or NULL */
    matcher_saved *msave;        /* with prompt lookup: m's state while the masks of its
                                  * verified positions are computed past its drafts */
    engine_token *pl;            /* prompt logprobs (n_prompt), until the event that
                                  * delivers them; NULL when not asked or delivered */
    /* speculation policy (engine_spec.c) */
    ngram_index *ng;             /* prompt lookup: the index of its tokens, or NULL */
    float acc_s, acc_t;          /* decayed accepted / tried draft positions */
    int fails, skip;             /* prompt lookup: failed verifies in a row, steps to skip */
    int declined;                /* prompt lookup: steps the cost model declined its drafts */
    int decode_steps;            /* steps in which it decoded (speculating or not) */
    /* async scheduling (engine_step.c) */
    int pend_row;                /* its row in the last decode step queued */
    int pend_tok;                /* its last tokens are this many placeholders for the tokens
                                  * the step in flight samples (fed to the next step on the
                                  * device): 1, or k + 1 for a speculative step, which emits
                                  * 1..k+1 (the scheduler sees the most it can emit) */
    int m_pre, m_pre_rc;         /* the matcher already took that token (to mask the next
                                  * step's row while it ran), with this result: emit_token
                                  * uses it instead of taking the token again */
    uint64_t ev_stamp;           /* the engine_step call whose output has its event ... */
    int ev_idx;                  /* ... at this index */
} req;

/* Prompt positions whose logits one step computes at most (prompt logprobs): the extra
 * rows of e->logits they need (49k vocab: 50 MB), and the scheduler's max_logit_tokens. */
#define ENGINE_PROMPT_LOGIT_ROWS 256

typedef enum { ENGINE_DRAFTER_NONE = 0, ENGINE_DRAFTER_MODEL, ENGINE_DRAFTER_NGRAM } engine_drafter;

/* Per-row plan of one step. */
typedef struct {
    req *r;
    int n_new;                   /* target tokens to feed (from the scheduler) */
    int spec;                    /* draft tokens this decoding row verifies this step (0: none;
                                  * before engine_spec_plan: 1 if it may speculate) */
    int target_logits;           /* 0, 1 or k+1 rows of target logits */
    int logits_off;              /* first target logits row (sampling / verify) */
    int pl_rows, pl_off;         /* logits rows of prompt positions (prompt logprobs) */
    int32_t drafts[ENGINE_MAX_STEP_TOKENS];
} row_plan;

/* Whether row p decodes this step (feeds its one new token), as opposed to a prompt chunk. */
static inline int row_decodes(const row_plan *p) {
    return p->n_new == 1 && p->r->seq.n_tokens - p->r->seq.n_computed == 1;
}

/* Where a decode op puts its outputs (the runner's out_* arrays), per row. */
typedef struct {
    int32_t *tok;
    float *lp;
    int32_t *top_ids;            /* (rows, RUNNER_MAX_TOP) */
    float *top_lp;
    int32_t *rank;               /* forced rows' (prompt positions') ranks */
} dec_outs;

/* What one step did for a row (engine_step's run phase, whatever path ran it), applied by
 * its one commit loop (commit_and_emit). */
typedef struct {
    int event;                   /* the row reports this step (it sampled, or it ended) */
    int fed;                     /* positions computed: n_computed advances by this */
    int n;                       /* tokens to emit */
    int32_t tok[ENGINE_MAX_STEP_TOKENS];
    const float *raw;            /* host logits of token j at raw + j * vocab, or NULL */
    int dev;                     /* >= 0: the tokens were sampled by the runner; tok[j]'s
                                  * logprob and top logprobs at index dev + j of the step's
                                  * dec_outs */
    int drafted, accepted;       /* a verified row: drafts checked, drafts accepted */
    int kv_cap;                  /* KV committed at most up to here (what a draft model holds) */
    engine_finish forced;        /* an end the path decided (no token fits, max_tokens 0) */
    int placed;                  /* placeholders at the end of its tokens that tok[0..n)
                                  * replace (async scheduling: pre_commit advanced
                                  * n_computed as if the step emitted one each) */
} row_result;

/* A step queued without waiting for it (async scheduling: a decode op, a forward that
 * samples, or a draft model's speculative step op): its rows (r NULL once the request is
 * dropped) and where the runner leaves its outputs. */
typedef struct {
    int n;                       /* 0: none in flight */
    int spec;                    /* k of a draft model's speculative step op; 0: a decode
                                  * op or a forward */
    int32_t *spec_out;           /* (max_batch, k + 1) its tokens */
    int *spec_n;                 /* (max_batch) tokens per row */
    row_plan *plan;              /* (max_batch) */
    row_result *res;             /* (max_batch) */
    dec_outs o;
    int *dead;                   /* (max_batch) a constrained row that no token fitted (its
                                  * draw is unmasked: the row ends with an error) */
    int waited;                  /* its outputs are in o already (the next step's mask
                                  * callback waited for them) */
} pend_step;

struct engine {
    engine_config cfg;
    model *target;
    model *draft;                /* loaded draft, or NULL */
    model draft_view;            /* --draft-layers: target's first N layers (no ownership) */
    const model *draft_used;     /* draft or &draft_view or NULL */
    tok_tokenizer *tok;
    tmpl_template *tmpl;
    kv_pool *kv;
    sched *sched;
    runner *run;
    int k;                       /* draft tokens per step at most (0: no speculation) */
    int window_release;          /* > 0: every layer slides with this window, so blocks
                                  * behind it are released (kv_seq_drop_front) */
    kv_pool *win_kv;             /* a model that mixes window and full layers (Gemma 3):
                                  * the window layers' pool, whose blocks are released
                                  * behind win_window; NULL otherwise */
    int win_window, win_layers;  /* its window and how many target layers it holds */
    engine_drafter drafter;
    spec_cost cost;              /* measured step times (n_b == 0: always speculate) */
    spec_cost cost_fwd;          /* prompt lookup on a runner with a verify op: its composed
                                  * steps' times (a forward pass sampling every position),
                                  * for steps the verify op does not take (rows with logprobs,
                                  * logit adjustments, penalties, min_tokens or a grammar, or
                                  * prompt chunks beside them); n_b == 0: such steps draft
                                  * nothing */
    int spec_rows, spec_extra;   /* this step's decoding rows and draft + prefill tokens */
    float acc_s, acc_t;          /* decayed accepted / tried drafts over all requests */
    int declined;                /* draft model: steps declined since the last probe */
    int probe_every;             /* draft model: declined steps between probes (backs off) */
    int step_spec;               /* rows speculating in this step */
    int step_verify;             /* this step may be one runner verify (prompt lookup through
                                  * runner_ops.verify: every row decodes, none samples on the
                                  * host, all fit); engine_spec_plan then drafts a uniform depth */
    int step_fwd;                /* else it may draft through the composed path (cost_fwd:
                                  * every row the forward pass samples on the device) */
    int *cand_row, *cand_avail, *cand_k;   /* (max_batch) engine_spec_plan scratch */
    float *cand_alpha;
    spec_cost_cand *cands;       /* (max_batch * k) */
    int vocab;
    int32_t eos[MODEL_MAX_EOS + 5];  /* model, tokenizer and end-of-turn stop ids */
    int n_eos;
    vocab_trie *vtrie;           /* the vocabulary as bytes, for constrained decoding (NULL
                                  * without a tokenizer) */
    int max_tok_bytes;           /* its longest token */
    uint32_t *mask;              /* (vocab_mask_words(vocab)) one row's allowed tokens */
    matcher_saved *msave;        /* a constrained row's grammar state while its drafts are
                                  * tried ahead of it (prompt lookup) */
    uint32_t *row_masks;         /* (max_batch, vocab_mask_words) the step's grammar masks
                                  * for a forward that samples on the device */
    int *mask_rows;              /* (max_batch) constrained plan rows of the step */
    int *mask_res;               /* (sampling rows) per sampling row of theirs, the mask's
                                  * result: tokens allowed besides eos, -1 nothing fits */
    int n_mask_rows, masks_done; /* the step's constrained rows (mask_rows); whether
                                  * prepare_masks computed their masks */
    struct tp_pool *mask_pool;   /* computes those masks in parallel (each row's matcher is
                                  * its own; the trie and grammars are read only) */

    req **reqs;                  /* live requests (unordered) */
    int n_reqs, cap_reqs;
    int n_paused;                /* requests of reqs with seq.paused set */

    /* step buffers, sized at creation: no allocation per token */
    row_plan *plan;
    row_result *res;             /* (max_batch) */
    runner_row *rows;
    int32_t *tokens;
    float *logits;               /* target: (max_batch*(k+1), vocab) */
    float *dlogits;              /* draft:  (max_batch, vocab) */
    float *dprobs;               /* draft distributions (max_batch, k, vocab) */
    float *pprobs;               /* target distributions of one row (k+1, vocab) */
    float *work;                 /* (vocab) */
    int *scratch;                /* (vocab) */
    int32_t *hist;               /* (max_seq_len + k) history with pending drafts */
    int *dec_slots;              /* (max_batch) the rows' slots for a speculative step op or
                                  * the verify question (verify_possible) */
    dec_outs dec;                /* (sampling rows: max_batch * (k + 1) +
                                  * ENGINE_PROMPT_LOGIT_ROWS, a composed step's logits rows)
                                  * the decode op's and a sampling forward's tokens, their
                                  * logprobs, top logprobs (rows, RUNNER_MAX_TOP), prompt
                                  * positions' ranks */
    int *dec_prev;               /* (max_step_tokens) runner_decode_batch.prev_row, or
                                  * runner_batch.prev_tok */
    pend_step pend[2];           /* async scheduling: the step in flight is pend[pend_cur]
                                  * (when its n > 0); the next one is queued in the other */
    int pend_cur;
    pend_step *mask_fl;          /* while a step is queued behind the one in flight: that
                                  * one, whose tokens prepare_masks_async waits for */
    int n_plan;                  /* rows of e->plan in use (a dropped request leaves them) */
    uint64_t out_stamp;          /* engine_step calls: one event per request per call */
    int32_t *spec_out;           /* (max_batch, k+1) tokens of a runner speculative step */
    int *spec_n;                 /* (max_batch) */
    int *spec_nd;                /* (max_batch) drafts per row of a runner verify step */
    runner_sampling *dec_sp;     /* (sampling rows) per sampling row */
    int32_t *pos_ids, *pos_counts;   /* a composed step's token statistics of speculating
                                  * rows at their verified positions (drafts counted in) */
    size_t pos_cap;
    engine_event *events[2];     /* double-buffered: step N's events stay valid while */
    int cap_events[2];           /* step N+1 runs (the server processes them meanwhile) */
    int ev_cur;                  /* the buffer this step writes */
    engine_token **pl_keep[2];   /* prompt logprobs delivered with each event buffer: freed
                                  * when that buffer is reused */
    int n_pl_keep[2], cap_pl_keep[2];
    int pl_logit_rows;           /* rows of e->logits beyond the sampling ones, for prompt
                                  * positions (0 until a request asks for prompt logprobs) */
    int max_step_tokens;

    /* first-token logits of finished requests added with record=1, until read */
    struct { uint64_t id; float *logits; } rec[16];
    int n_rec;

    int failed;
    engine_stats st;

    /* tensor parallelism (cfg.tp.world_size > 1) */
    tp_children *tp_ch;          /* ranks this process spawned */
    tp_comm *tp;                 /* the group; run->ops is the TP wrapper on rank 0 */
    tp_watchdog *tp_wd;
};

/* Whether decoding row p may speculate this step: room for k more tokens in its context,
 * its blocks and its output (a constrained row: prompt lookup only, its drafts checked
 * against the grammar). */
static inline int row_may_speculate(const engine *e, const row_plan *p) {
    const req *r = p->r;
    const sched_seq *s = &r->seq;
    return e->k > 0 && row_decodes(p) && s->n_tokens + e->k <= e->cfg.max_seq_len && r->max_new - r->n_out > 1 &&
           s->kv.n_blocks * e->cfg.block_size >= s->n_tokens + e->k && (!r->m || e->drafter == ENGINE_DRAFTER_NGRAM);
}

/* engine.c: take a request out of the scheduler and the table, and free it. */
void engine_req_drop(engine *e, req *r);
/* engine_step.c: clear r from the step in flight and the step being planned. */
void engine_step_forget(engine *e, const req *r);
/* engine_step.c: wait for any step in flight and forget it (failure, destruction). */
void engine_step_drain(engine *e);

/* engine_spec.c */
const char *engine_spec_drafter_name(const engine *e);
/* A new request's speculation state (its n-gram index for `capacity` tokens). */
int engine_spec_req_init(const engine *e, req *r, int capacity);
/* Phase 1b of a step: on entry plan[i].spec says whether row i may speculate; on return
 * it is the number of drafts row i verifies, with prompt-lookup drafts in plan[i].drafts,
 * and e->step_spec counts the speculating rows. */
void engine_spec_plan(engine *e, int n);
/* A verify of k drafts of r accepted `accepted`. */
void engine_spec_observe(engine *e, req *r, int k, int accepted);
/* Whether a draft model would have every one of n decoding rows speculate in a step now
 * (no cost model, or one that finds k drafts pay at the current acceptance); counts
 * nothing. A speculative step can then be queued behind the one in flight. */
int engine_spec_chain(const engine *e, int n);
/* Whether a step of n decoding rows drafts nothing, whatever its rows hold: no drafter,
 * prompt lookup through the runner's verify op with more rows than that op takes
 * (engine_spec_plan then looks nothing up), or a draft model whose step would not pay at
 * this many rows even if every draft stood (the cost model). */
int engine_spec_never(const engine *e, int n);
/* A step of n rows, all decoding, in which a draft model would not speculate now (the cost
 * model declines at the current acceptance and no probe is due): 1 after counting the
 * decline as engine_spec_plan would, so the step can go in flight without a plan (async
 * scheduling hides its host work, as for steps that never speculate); 0 where the plan
 * must decide (then nothing is counted). */
int engine_spec_skip(engine *e, int n);
/* Prompt lookup, a step of the n rows of e->plan about to be queued in flight (each row's
 * last token may still be the placeholder of the step in flight: its lookup then uses the
 * tokens before it). verify (engine_spec_ngram_mode): 1 the runner's verify op would take
 * the step, 0 neither it nor the composed path would (such a step drafts nothing), -1 the
 * composed path would (no verify op, or one that does not take the step). 1 when
 * engine_spec_plan would draft nothing and probe nothing, after counting what it would
 * (back-off steps, declines toward the probes), so the step can go in flight as a plain
 * one; 0 where the plan must decide (then nothing is counted). */
int engine_spec_ngram_idle(engine *e, int n, int verify);
/* A step of `rows` rows ended that spent `host` seconds in the engine's own work (not in
 * the runner). Where a queued op runs on a device while the host goes on, plain steps
 * hide that work under the step in flight and a synchronous speculating step exposes it:
 * the cost model learns it per batch size (spec_cost.host). Not where a draft model's
 * speculating steps go in flight too (engine_spec_async_ok): they hide it as plain steps
 * do, and spec_cost.host stays 0. */
void engine_spec_host(engine *e, int rows, double host);
/* Whether a draft model's speculative step ops may go in flight: async scheduling, a
 * runner whose op can be queued (runner.spec_async), and room in one event for the tokens
 * of the op in flight and of a synchronous speculative step after it. */
int engine_spec_async_ok(const engine *e);
/* Prompt lookup on a runner with a verify op whose steps the op does not take can draft
 * through the composed path (a forward pass sampling every position on the device), its
 * cost measured (cost_fwd) unless the cost model is off. */
int engine_spec_ngram_fwd(const engine *e);
/* The mode engine_spec_ngram_idle takes for a step the verify op would take (verify) or
 * else the composed path would (fwd): 1 the verify op, -1 the composed path, 0 neither. */
int engine_spec_ngram_mode(const engine *e, int verify, int fwd);
/* A prompt-lookup step that speculated took `seconds` in the runner: the table it was
 * chosen by learns (spec_cost_observe). */
void engine_spec_observe_step(engine *e, double seconds);
/* Measure the cost model (creation, before any request: it times passes on free slots). */
int engine_spec_measure(engine *e, char *err, size_t errlen);

#endif
