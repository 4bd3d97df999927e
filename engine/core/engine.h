/* The engine (prefix engine_): model(s) + tokenizer + chat template + KV block manager +
 * scheduler + runner, and one step = schedule -> run -> postprocess. With async
 * scheduling (engine_config.sync_scheduling 0, the default) a step can be left running
 * on the device while the next call schedules and queues the one after it, and only then
 * postprocesses it (engine_step.c, "async scheduling").
 *
 * Threading: an engine is NOT thread safe. The server's engine thread runs steps back to
 * back and applies engine_submit / engine_abort between them; only engine_prepare may run
 * on another thread during a step. engine_model_config, engine_tokenizer,
 * engine_template and engine_max_token_bytes return what never changes: any thread may
 * use them.
 *
 * Requests are identified by a caller-chosen uint64 id. Generated tokens come back in
 * engine_output events; stop strings and detokenization are the caller's (the loop's). */
#ifndef SPECD_ENGINE_H
#define SPECD_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model/model.h"
#include "engine/text/grammar.h"
#include "engine/text/tokenizer.h"
#include "engine/text/tmpl.h"
#include "engine/tp/tp.h"

typedef enum { ENGINE_DEVICE_CPU = 0, ENGINE_DEVICE_CUDA = 1 } engine_device;

/* --dtype: GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K projections kept in their blocks on the GPU when their
 * bf16 form would take more than half of it (auto), always dequantized to bf16 at load
 * (bf16), or always kept (gguf). */
enum { ENGINE_WEIGHTS_AUTO = 0, ENGINE_WEIGHTS_BF16, ENGINE_WEIGHTS_GGUF, ENGINE_WEIGHTS_FP8 };
/* The KV cache's element type: bf16 on the GPU, fp32 in the CPU runner (auto), or FP8 E4M3
 * with a per-layer scale for K and one for V (the checkpoint's, else 1). */
enum { ENGINE_KV_AUTO = 0, ENGINE_KV_FP8 };

typedef struct {
    const char *model_path;
    const char *random_shape;     /* instead of model_path: random weights of a named real
                                   * shape (model_shape_preset), for benchmarks */
    const char *tokenizer_path;   /* NULL: from model_path */
    const char *chat_template_path; /* a Jinja file replacing the tokenizer's chat template
                                   * (or giving one to a model that has none); NULL: none */
    const char *draft_path;       /* NULL: no draft model */
    const char *draft_random_shape; /* instead of draft_path: random weights of a named shape */
    int draft_layers;             /* > 0: self-speculation with the target's first N layers */
    int num_draft_tokens;         /* k, at most (default 4 when a drafter is given) */
    int spec_ngram;               /* prompt-lookup drafting (--speculative ngram): drafts are
                                   * the tokens that followed the longest earlier match of a
                                   * request's last tokens in its prompt and output */
    int ngram_min, ngram_max;     /* n-gram lengths matched (default 2 .. 4) */
    int cpu_verify;               /* the CPU runner verifies prompt-lookup drafts through its
                                   * verify op, as the CUDA runner does (tests and A/B) */
    int spec_always;              /* skip the cost model: speculate whenever drafts exist
                                   * (tests; the default measures when speculation pays) */
    engine_device device;
    int max_seq_len;              /* runtime context limit (default 4096) */
    int max_batch;                /* running sequences at most (default 64) */
    int max_tokens_per_step;      /* scheduler token budget (default 2048) */
    int max_prefill_decoding;     /* prompt tokens a step that also decodes feeds at most
                                   * (sched_config.max_prefill_decoding; 0: default 512,
                                   * < 0: no bound but the budget) */
    int sync_scheduling;          /* 1: every step is committed before the next is queued.
                                   * Default 0 (async scheduling): while a decode step runs
                                   * where the runner pipelines decodes (runner.decode_async),
                                   * the next decode step is scheduled and queued before the
                                   * host commits the running one, its tokens fed on the
                                   * device; a request that ends is known a step late and its
                                   * extra token is dropped (engine_step) */
    int block_size;               /* default 16 */
    double mem_fraction;          /* share of free memory for the KV pool (default 0.9) */
    size_t kv_bytes;              /* explicit KV budget in bytes; 0 = from mem_fraction */
    int threads;                  /* CPU runner threads (0 = all cores) */
    int disable_prefix_cache;     /* prefix caching is on unless set */
    int grammar_threads;          /* threads computing a step's grammar masks (0: half the
                                   * cores, at most 8; 1: on the engine thread) */
    int keep_window_kv;           /* keep the KV blocks a sliding window has left behind
                                   * (for A/B runs; by default they go back to the pool when
                                   * every layer of the model(s) slides) */
    int rope_bf16_freqs;          /* bf16-rounded rotary frequencies (runner_config) */
    int weights_dtype;            /* ENGINE_WEIGHTS_*: a quantized GGUF's projections on the
                                   * GPU (runner_config.weights_gguf), FP8 projections
                                   * (runner_config.weights_fp8) */
    int kv_dtype;                 /* ENGINE_KV_* (runner_config.kv_fp8) */
    int verbose;                  /* print start-up decisions to stderr */
    /* Tensor parallelism (docs/tensor-parallel.md; CPU runner only so far): with
     * tp.world_size > 1 the target is split over that many processes. Rank 0 calls
     * engine_create; every other rank calls engine_tp_worker_run with the same options. */
    tp_config tp;
    char *const *tp_spawn_argv;   /* set: this process starts its node's other ranks by
                                   * re-executing itself with these arguments (main's argv) */
    tp_fail_fn tp_fail;           /* rank 0: called once from a watchdog thread when a rank
                                   * or a spawned process dies (NULL: no watchdog); it should
                                   * return promptly: the engine then aborts the group's
                                   * collectives so a stuck step fails */
    void *tp_fail_ctx;
} engine_config;

/* Fill defaults into every zero field. */
void engine_config_defaults(engine_config *c);

typedef struct {
    float temperature;            /* 0 = greedy */
    float top_p;                  /* 1 = off */
    int top_k;                    /* 0 = off */
    float min_p;                  /* 0 = off */
    uint64_t seed;
    int has_seed;                 /* else a random seed */
    float presence_penalty, frequency_penalty; /* OpenAI, additive */
    float repetition_penalty;     /* 1 = off; HF style, over prompt + output */
    int n_logit_bias;
    const int32_t *logit_bias_ids; /* copied by engine_add */
    const float *logit_bias_vals;
    int max_tokens;               /* new tokens at most (capped by max_seq_len) */
    int min_tokens;               /* EOS suppressed before this many */
    int ignore_eos;
    int logprobs;                 /* -1: none; 0: chosen token only; N: + top N (<= 20) */
    int prompt_logprobs;          /* -1: none; 0: each prompt token's logprob given the tokens
                                   * before it; N: + top N (<= 20). The prompt is then
                                   * computed in full (no prefix-cache hit) and its logprobs
                                   * come with the event that ends the prompt (see
                                   * engine_event.prompt_tokens). max_tokens 0 finishes
                                   * ("length") right after the prompt, with or without. */
    /* Constrained decoding: every token keeps the output inside this grammar, and the
     * request stops ("stop") once the grammar is complete and nothing may follow. NULL:
     * none. Borrowed: engine_prepare / engine_add take their own reference. A constrained
     * request is sampled with its mask (on the device where the runner takes masks) and
     * does not speculate. */
    grammar *grammar;
} engine_sampling;

void engine_sampling_defaults(engine_sampling *s);

typedef enum { ENGINE_RUNNING = 0, ENGINE_FINISH_STOP, ENGINE_FINISH_LENGTH,
               ENGINE_FINISH_ABORT, ENGINE_FINISH_ERROR } engine_finish;

#define ENGINE_MAX_TOP_LOGPROBS 20
#define ENGINE_MAX_STEP_TOKENS 16   /* tokens one request can get in one step (k+1) */

typedef struct {
    int32_t id;
    float logprob;                 /* of the chosen token under the target */
    int rank;                      /* prompt tokens (engine_event.prompt_tokens) only: 1 + the
                                    * tokens more likely than it; 0 elsewhere */
    int n_top;
    int32_t top_ids[ENGINE_MAX_TOP_LOGPROBS];
    float top_logprobs[ENGINE_MAX_TOP_LOGPROBS];
} engine_token;

typedef struct {
    uint64_t req_id;
    int n_tokens;                  /* new tokens this step (0 is possible with finish) */
    engine_token tokens[ENGINE_MAX_STEP_TOKENS];
    engine_finish finish;          /* != RUNNING: the request is gone from the engine */
    /* With sampling prompt_logprobs >= 0, on the event that ends the prompt (the first
     * token's, or the finish of max_tokens 0): n_prompt entries, entry i is prompt token i
     * with its logprob given tokens 0..i-1 (entry 0 has none: logprob NAN, n_top 0).
     * Engine-owned, valid as long as the event. NULL otherwise. */
    const engine_token *prompt_tokens;
    int n_prompt_tokens, n_output_tokens, n_cached_tokens;
    /* speculative decoding counters of this request so far */
    int spec_verify_steps, spec_draft_tokens, spec_accepted_tokens;
    int spec_decode_steps;         /* steps it decoded in, speculating or not */
} engine_event;

typedef struct {
    int n_events;
    engine_event *events;          /* engine-owned; valid until the second engine_step after
                                    * the one that filled it (two buffers alternate, so a
                                    * caller may read step N's events while step N+1 runs) */
    int n_scheduled_tokens;
} engine_output;

typedef struct {
    int running, waiting, paused;
    int kv_blocks_total, kv_blocks_used, kv_blocks_free;
    int kv_blocks_cached;          /* blocks the prefix cache knows (held or evictable) */
    /* A model of window and full layers (Gemma 3) keeps its window layers' KV in a pool
     * of its own whose blocks go back behind the window: kv_layers (target + draft) live
     * in the blocks above, kv_win_layers in these (all 0 without a window pool). */
    int kv_win_blocks_total, kv_win_blocks_used;
    int kv_layers, kv_win_layers;
    double kv_bytes_used;    /* bytes of the blocks in use, both pools */
    int max_seq_len, max_batch;
    uint64_t prompt_tokens, generation_tokens, preemptions, prefix_cache_hit_tokens;
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens;
    uint64_t spec_accepted_per_pos[ENGINE_MAX_STEP_TOKENS];
    /* steps by the runner op that ran them: the speculative step of a draft model (one
     * graph on CUDA), and runner_step's verify op, forward pass ("composed": mixed batches,
     * sampled in the runner or on the host) and decode op */
    uint64_t steps_runner_spec, steps_runner_verify, steps_composed, steps_device_decode;
    uint64_t steps_forward_sampled;  /* composed steps that sampled inside the forward pass */
    uint64_t spec_rows_runner_sampled;   /* speculating rows whose drafts the runner's step
                                          * checked (its verify op, or its forward pass
                                          * sampling every verified position: drafts stand
                                          * while they equal those tokens) */
    uint64_t draft_passes_sampled;   /* a draft model's passes in composed steps whose picks
                                      * the runner sampled (greedy rows) */
    uint64_t steps_async;            /* steps queued while the one before was in flight (async
                                      * scheduling; counted in steps_device_decode or, prompt
                                      * chunks with decode rows, in steps_composed) */
    uint64_t steps_async_composed;   /* steps of prompt chunks queued in flight (a forward
                                      * sampling on the device) */
    uint64_t steps_async_spec;       /* a draft model's speculative steps queued while the
                                      * one before was in flight (in steps_async and
                                      * steps_runner_spec too) */
    /* seconds engine_step spent running its steps (the runner's op; on the composed path
     * also the draft's picks and host sampling / acceptance) and in all of engine_step:
     * the difference is the engine's own host work (scheduling, planning, commit, emit) */
    double run_seconds, step_seconds;
    int num_draft_tokens;
    const char *spec_drafter;      /* "none", "draft_model" or "ngram" (static) */
    /* steps with decoding rows, those of them where a row speculated, decoding rows */
    uint64_t spec_steps_decoding, spec_steps_speculated, spec_rows_decoding;
    uint64_t spec_steps_fwd;       /* prompt lookup: steps whose drafts went through the
                                    * composed path where the runner's verify op would not
                                    * take the step (cost_fwd) */
    double spec_host_seconds;      /* the cost model's host time of a step at the batch size
                                    * of the latest one (spec_cost.host; 0 where not learned) */
    int failed;                    /* engine hit a runner error; every request fails */
} engine_stats;

typedef struct engine engine;

engine *engine_create(const engine_config *cfg, char *err, size_t errlen);
/* Destroying a tensor-parallel rank 0 stops its workers (STOP, then reaps the spawned). */
void engine_destroy(engine *e);

/* A tensor-parallel worker (cfg->tp.rank > 0): load the model, join rank 0, and apply its
 * steps until it stops them (0) or fails / goes away (< 0, with a message). */
int engine_tp_worker_run(const engine_config *cfg, char *err, size_t errlen);

const model_config *engine_model_config(const engine *e);
const tok_tokenizer *engine_tokenizer(const engine *e);  /* NULL if none */
const tmpl_template *engine_template(const engine *e);   /* NULL if none */
/* Bytes of the vocabulary's longest token, for grammar_prepare_masks (0: no tokenizer). */
int engine_max_token_bytes(const engine *e);
const char *engine_device_name(const engine *e);

/* Queue a request. prompt is copied. Errors: SPECD_ERANGE (prompt + 1 > max_seq_len, or
 * empty), SPECD_EINVAL (token id out of vocabulary, bad params), SPECD_ESTATE (failed
 * engine). */
int engine_add(engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
               const engine_sampling *sp, char *err, size_t errlen);
/* engine_add in two halves, so a caller can check and build a request on one thread while
 * another runs a step: engine_prepare validates (the same errors as engine_add, except the
 * duplicate id) and copies everything into a new pending request, reading only what
 * engine_create fixed, so it may run concurrently with engine_step; engine_submit queues
 * it (not concurrently with a step) and owns it from then on, also when it fails
 * (SPECD_EINVAL duplicate id, SPECD_ESTATE failed engine, SPECD_ENOMEM). A pending request
 * never submitted is freed with engine_pending_free. */
typedef struct req engine_pending;
int engine_prepare(const engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
                   const engine_sampling *sp, engine_pending **out, char *err, size_t errlen);
int engine_submit(engine *e, engine_pending *p, char *err, size_t errlen);
void engine_pending_free(engine_pending *p);

/* Cancel: frees its KV at once. Emits no event. Returns SPECD_ENOTFOUND if unknown. */
int engine_abort(engine *e, uint64_t req_id);
/* Pause (1) or resume (0) a request: paused, it keeps its KV (unless preempted) but gets
 * no steps, and engine_has_work does not count it. SPECD_ENOTFOUND if unknown. */
int engine_pause(engine *e, uint64_t req_id, int paused);
/* Requests to step (paused ones aside), or a step still in flight (async scheduling). */
int engine_has_work(const engine *e);

/* One step. Fills out with at most one event per request, for each request that produced
 * tokens or finished. With async scheduling a call may queue a decode step and return
 * before it is done (its tokens come with the next call's events), or commit the step in
 * flight and run another (the request's tokens of both in its one event). A runner failure returns SPECD_ECUDA (or the runner's code), marks the engine failed,
 * and finishes every request with ENGINE_FINISH_ERROR events. */
int engine_step(engine *e, engine_output *out);

void engine_get_stats(const engine *e, engine_stats *st);

/* Start-up warm-up (engine_warmup.c): synthetic greedy prompts of every size of a ladder
 * up to the step's token budget, one at a time, then batches of short prompts decoding
 * together up to max_batch, then sampled rows, so a runner's first-use costs (kernels
 * loaded at first launch, GEMM heuristics) are paid before real traffic. The engine must
 * be idle; afterwards its prefix cache forgets the passes' blocks and its counters and
 * acceptance state are as before. A failure leaves the engine as engine_step left it. */
typedef struct {
    int passes;        /* engine runs to idle */
    int max_prompt;    /* longest prompt fed */
    int max_batch;     /* most prompts decoding together */
} engine_warmup_info;
int engine_warmup(engine *e, engine_warmup_info *info, char *err, size_t errlen);

/* Debug / golden tests: logits (vocab floats) that chose the first output token of the
 * given request are recorded if the request was added with engine_add_ex(record=1). */
int engine_add_ex(engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
                  const engine_sampling *sp, int record_first_logits, char *err, size_t errlen);
/* Copy the recorded logits into dst (vocab floats); SPECD_ENOTFOUND if none. Valid until
 * the request's finish event has been returned and the next step runs. */
int engine_first_logits(engine *e, uint64_t req_id, float *dst);

#endif
