/* Private to the engine's two files (engine.c: configuration, creation, requests;
 * engine_step.c: one step). Not part of the engine's interface: nothing outside engine/
 * engine*.c includes it. */
#ifndef SPECD_ENGINE_INTERNAL_H
#define SPECD_ENGINE_INTERNAL_H

#include "engine/core/engine.h"
#include "engine/core/kv.h"
#include "engine/core/runner.h"
#include "engine/tp/runner_tp.h"
#include "engine/core/sample.h"
#include "engine/core/sched.h"

typedef struct req {
    sched_seq seq;               /* seq.user points back here */
    uint64_t id;
    engine_sampling sp;
    int32_t *lb_ids;
    float *lb_vals;
    sample_params spp;
    uint64_t seed;
    int max_new;                 /* new tokens at most */
    int n_out;                   /* generated so far */
    uint32_t synced_epoch;       /* slot epoch mirrored into the runner */
    int synced_blocks;           /* block-table entries mirrored into the runner */
    int record;                  /* keep the logits that chose the first output token */
    float *first_logits;
    int n_cached;                /* prompt tokens served from the prefix cache */
    int verify_steps, draft_tokens, accepted;
    matcher *m;                  /* constrained decoding state, or NULL */
} req;

/* Per-row plan of one step. */
typedef struct {
    req *r;
    int n_new;                   /* target tokens to feed (from the scheduler) */
    int spec;                    /* decoding row that speculates this step */
    int target_logits;           /* 0, 1 or k+1 rows of target logits */
    int logits_off;              /* first target logits row */
    int32_t drafts[ENGINE_MAX_STEP_TOKENS];
} row_plan;

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
    int k;                       /* draft tokens per step (0: no speculation) */
    int vocab;
    int32_t eos[MODEL_MAX_EOS + 5];  /* model, tokenizer and end-of-turn stop ids */
    int n_eos;
    vocab_trie *vtrie;           /* the vocabulary as bytes, for constrained decoding (NULL
                                  * without a tokenizer) */
    uint32_t *mask;              /* (vocab_mask_words(vocab)) one row's allowed tokens */

    req **reqs;                  /* live requests (unordered) */
    int n_reqs, cap_reqs;
    int n_paused;                /* requests of reqs with seq.paused set */

    /* step buffers, sized at creation: no allocation per token */
    row_plan *plan;
    runner_row *rows;
    int32_t *tokens;
    float *logits;               /* target: (max_batch*(k+1), vocab) */
    float *dlogits;              /* draft:  (max_batch, vocab) */
    float *dprobs;               /* draft distributions (max_batch, k, vocab) */
    float *pprobs;               /* target distributions of one row (k+1, vocab) */
    float *work;                 /* (vocab) */
    int *scratch;                /* (vocab) */
    int32_t *hist;               /* (max_seq_len + k) history with pending drafts */
    int *dec_slots;              /* on-device decode fast path: (max_batch) each */
    int32_t *dec_tokens, *dec_out;
    float *dec_lp;               /* (max_batch) the chosen tokens' logprobs from the device */
    int32_t *spec_out;           /* (max_batch, k+1) tokens of a runner speculative step */
    int *spec_n;                 /* (max_batch) */
    runner_sampling *dec_sp;
    engine_event *events[2];     /* double-buffered: step N's events stay valid while */
    int cap_events[2];           /* step N+1 runs (the server processes them meanwhile) */
    int ev_cur;                  /* the buffer this step writes */
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

/* engine.c: take a request out of the scheduler and the table, and free it. */
void engine_req_drop(engine *e, req *r);

#endif
