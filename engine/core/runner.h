/* The runner seam (prefix runner_): everything between "these rows feed these tokens"
 * and logits. The scheduler and block manager never see how compute is done; a runner
 * never sees requests. Two implementations: the CPU reference (runner_cpu.c, fp32) and
 * the CUDA runner (cuda_runner.c, bf16 + cuBLAS + CUDA graphs).
 *
 * KV: a runner owns the storage of ONE paged pool of `num_blocks` blocks of
 * `block_size` tokens for n_layers(target) + n_layers(draft) layers; draft layer i is
 * pool layer L_target + i. Block 0 is the null block: never handed to a request,
 * padding rows write there.
 *
 * Window pool: with runner_config.win_blocks > 0 the sliding-window layers (the target's
 * and the draft's) keep their KV in a second pool of win_blocks blocks (same block size,
 * its own null block 0), addressed through a second block table per slot
 * (slot_write_win_blocks); the first pool then holds the other layers (full attention).
 * The engine gives the window pool's blocks back once every window has left them (Gemma
 * 3: five of six layers), while the full layers keep the whole context.
 *
 * Slots: a table of max_batch + 1 rows; row max_batch is the dummy slot. Each row holds a
 * block table (max_blocks_per_seq entries, unused entries = 0) and a context length per
 * model (target, draft). The host writes a row when a request enters or leaves it (and
 * appends block ids as the request grows); forward() reads positions from the lengths
 * and advances them by the tokens it fed. Rollback after speculation is set_len.
 *
 * Threading: a runner is driven by one thread at a time. */
#ifndef SPECD_RUNNER_H
#define SPECD_RUNNER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model/model.h"

enum { RUNNER_TARGET = 0, RUNNER_DRAFT = 1 };

typedef struct {
    int num_blocks;          /* including the null block 0 */
    int block_size;          /* tokens per block */
    int max_batch;           /* live slots; the dummy slot is one more */
    int max_seq_len;         /* max_blocks_per_seq = ceil(max_seq_len / block_size) */
    int max_tokens_per_step; /* upper bound of runner_batch.n_tokens */
    int threads;             /* CPU runner: worker threads (0 = number of cores) */
    int device;              /* CUDA runner: device ordinal */
    /* CUDA runner: when num_blocks == 0 it sizes the pool itself as
     * floor(mem_fraction * free_bytes_after_weights_workspace_graphs / block_bytes) and
     * writes the result back into runner.cfg.num_blocks. */
    double mem_fraction;
    size_t kv_bytes;         /* CUDA runner: when > 0, caps that pool at this many bytes */
    int num_draft_tokens;    /* k, for capturing speculative steps with a draft model, or
                              * without one the verify steps of 1..k drafts (0: none) */
    /* Round the rotary frequencies to bf16 (see model_rope_inv_freq): reproduces a
     * reference whose rotary buffer was held in bf16, as the fixtures' was. Off by default,
     * as in transformers' own bf16 inference and vLLM. */
    int rope_bf16_freqs;
    /* CPU runner without a draft, num_draft_tokens > 0: also expose ops.verify (the CUDA
     * runner always does); for tests and A/B, since its padding is real work on a CPU. */
    int cpu_verify;
    /* CUDA runner, one GPU: a GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K projections stay in their blocks on
     * the device (1), are dequantized to bf16 at load (0), or -1: stay when the model's
     * bf16 weights would take more than half of the GPU's memory. */
    int weights_gguf;
    /* The dense projections (Q/K/V, O, gate/up, down; not embeddings, lm_head or experts)
     * in FP8 E4M3 with one scale per output row: 1 quantizes them at load (--dtype fp8;
     * the CUDA runner keeps the bytes and runs FP8 GEMVs / GEMMs, the CPU runner rounds its
     * fp32 weights to the same values), 0 keeps an FP8 checkpoint's as they are stored
     * (the CPU runner dequantizes), -1 dequantizes an FP8 checkpoint to bf16 on the GPU. */
    int weights_fp8;
    /* The KV pool holds FP8 E4M3 codes (one byte per element) of k / k_scale and
     * v / v_scale, per-layer scales from the checkpoint (model_layer.k_scale, v_scale) or 1:
     * twice the tokens of bf16 in the same bytes. Attention reads the codes times the scale
     * (the CPU runner the same values in fp32). */
    int kv_fp8;
    /* CUDA runner: when nonzero the model's tensors are not read (it may be a model_shape)
     * and the weights are filled on the device with uniform random values from this seed:
     * benchmarks of real shapes without host weights. The CPU runner refuses it. */
    uint64_t random_weights_seed;
    /* Blocks of the window pool (see the top of this file), including its null block;
     * 0: one pool for every layer. The CPU and single-GPU CUDA runners take it, cut to
     * runner_window_pool_fit of their KV budget (the CUDA runner writes the count back). */
    int win_blocks;
    int win_min_blocks;      /* the fewest the engine can run with (one slot's window and
                              * one step's prompt chunks) */
    /* Tensor parallelism (see docs/tensor-parallel.md). With tp_world > 1 the
     * runner holds shard tp_rank of the TARGET (shard_model: its Q/KV heads and ffn rows,
     * so its pool holds n_kv_heads / tp_world heads per target layer) and calls
     * allreduce(allreduce_ctx, buf, n) -- an in-place sum over all ranks that leaves the
     * same bits on every rank -- on the [n_tokens, hidden] partial outputs of the O and
     * down projections. Embedding, lm_head and the draft are replicated: every rank
     * computes the same full logits and the same draft tokens. 0 / 1: no parallelism.
     * The CPU runner calls the hook; the CUDA runner ignores it and all-reduces with the
     * NCCL communicator it is given (runner_cuda_tp_backend, engine/cuda/cuda_runner.h). */
    int tp_rank, tp_world;
    int (*allreduce)(void *ctx, float *buf, size_t n);
    void *allreduce_ctx;
} runner_config;

/* Top logprobs a sampling op reports per row at most (runner_sampling.n_top). */
#define RUNNER_MAX_TOP 20

/* Per-row sampling parameters for on-device sampling (optional fast paths). A zeroed
 * struct is greedy with no adjustments. */
typedef struct {
    float temperature;       /* 0: greedy argmax */
    float top_p, min_p;
    int top_k;
    uint64_t seed;           /* counter-based RNG: (seed, step counter) -> uniform */
    uint64_t counter;        /* e.g. the row's output position */
    const uint32_t *mask;    /* NULL, or one bit per vocabulary id (bit i of word i / 32):
                              * ids whose bit is 0 are never sampled (a grammar's mask,
                              * applied before anything else); forward sampling only, where
                              * runner.forward_masks */
    /* Logit adjustments, where runner.sample_adjusts (decode, and forward sampling): after
     * the mask and before temperature and the filters, in the host sampler's order and
     * arithmetic (engine/core/sample.c sample_apply_penalties_sparse):
     *   1. logits[logit_bias_ids[j]] += logit_bias_vals[j], j in order (repeats add up);
     *   2. logits[suppress_ids[j]] = -inf (eos while min_tokens is not reached);
     *   3. for each stat_ids[j] (distinct ids): a repetition penalty (> 0, != 1) divides
     *      a positive logit by it and multiplies a negative one; then, where
     *      stat_counts[j] > 0, frequency_penalty * count + presence_penalty is subtracted.
     * The stats list the row's history: its generated tokens with their counts, and, when
     * the repetition penalty is on, its prompt tokens too (count 0 if only there). Ids
     * outside the vocabulary are skipped. */
    int n_logit_bias;
    const int32_t *logit_bias_ids;
    const float *logit_bias_vals;
    int n_suppress;
    const int32_t *suppress_ids;
    float presence_penalty, frequency_penalty, repetition_penalty;   /* 0, 0, 0 or 1: off */
    int n_stats;
    const int32_t *stat_ids, *stat_counts;
    /* Where runner.async_stats: 1 counts the token this row is fed (its last position's
     * input; under async scheduling the token the op before sampled, which the host has not
     * seen, so the stats above lack it) as one more occurrence: its count + 1, or a new id
     * of count 1, exactly as if the stats listed it. 0: the stats are complete. */
    int stats_fed;
    /* The chosen token's logprob is wanted (runner_step: the verify op reports none, so a
     * row that wants it is not given to that op; decode and forward report it anyway). */
    int logprob;
    /* Top logprobs wanted (0..RUNNER_MAX_TOP), where runner.sample_adjusts: the n_top
     * largest log softmax values of the logits before the adjustments (as the chosen
     * token's logprob; a masked row's are of the logits before the mask only where
     * runner.masked_raw_logprobs, else the engine samples constrained rows that want
     * logprobs on the host), descending, ties to the lower id (sample_top_logprobs), into
     * the op's out_top_ids / out_top_logprobs row. */
    int n_top;
    /* A prompt position (prompt logprobs), where runner.forced_tokens and in forward()
     * only: force 1 makes force_token the row's token without a draw (the adjustments,
     * the filters and the mask are not applied); the op reports its logprob, its rank in
     * out_ranks and the n_top top logprobs, all of the logits as they come. */
    int force;
    int32_t force_token;
} runner_sampling;

/* One decode step: n rows, one new token each (optional op). */
typedef struct {
    int n;
    const int *slots;             /* [n] */
    const int32_t *tokens;        /* [n] the token fed */
    const runner_sampling *sp;    /* [n] */
    int32_t *out_tokens;          /* [n] sampled */
    float *out_logprobs;          /* [n] logprob of the sampled token (may be NULL) */
    int32_t *out_top_ids;         /* [n, RUNNER_MAX_TOP]: row i's first sp[i].n_top entries */
    float *out_top_logprobs;      /* (both may be NULL when no row has n_top > 0) */
    /* Optional, as runner_batch.prepare_sp: called once the pass is under way, before the
     * runner reads sp; sp[i].mask is honoured where runner.decode_masks. */
    int (*prepare_sp)(void *ctx);
    void *prepare_ctx;
    /* Pipelining, where runner.decode_async (with prepare_sp and masks only where
     * runner.async_masks):
     * async: the op returns once the step is queued; its outputs reach the out_* arrays
     *   above (which must stay valid until then) at a later wait_queued. At most two
     *   ops (decode or forward) are pending, and no op runs without async while one is.
     *   With prepare_sp, the op calls it once its pass is queued, and the callback may call
     *   wait_queued for the op queued before this one (the engine needs that op's tokens
     *   to compute this one's masks); the op is pending only after the callback returns.
     * prev_row (may be NULL): prev_row[i] >= 0 feeds row i the token that the op queued
     *   just before this one sampled into its output row prev_row[i] (that op may still
     *   be pending: the token never travels through the host); tokens[i] is not read. */
    int async;
    const int *prev_row;
} runner_decode_batch;

/* One speculative step (optional op), for rows whose target length L is the position of
 * their last token (not yet in either model's KV):
 *   1. the draft's length is set to L-1 and it is fed [tokens[i][0], tokens[i][1]] at
 *      positions L-1, L (re-feeding the second-to-last token rewrites the KV the draft
 *      already had, so one fixed shape covers a draft that is in step and one that is a
 *      token behind, as after a fully accepted step); its argmax / sample is d1;
 *   2. k-1 more draft passes of one token per row give d2..dk;
 *   3. one target pass over [tokens[i][1], d1..dk] at positions L..L+k;
 *   4. acceptance (greedy: longest prefix where the target argmax equals the draft, then
 *      the target's token; sampling: rejection sampling, lossless in distribution);
 *   5. target length = L + 1 + accepted, draft length = min(L + k, that); on CUDA the
 *      dummy slot's lengths are zeroed after the advance, all inside one graph.
 * Requires L >= 1 and L + k + 1 <= max_seq_len for every row. */
typedef struct {
    int n, k;
    const int *slots;             /* [n] */
    const int32_t *tokens;        /* [n, 2]: second-to-last and last token of each row */
    const runner_sampling *sp;    /* [n] (counter: output index of the first new token) */
    int32_t *out_tokens;          /* [n, k+1]: accepted drafts then the target's token */
    int *out_n;                   /* [n] tokens emitted per row: accepted + 1 */
    /* Pipelining, where runner.spec_async (as runner_decode_batch's async; the two pending
     * ops at most may be speculative steps or decode / forward ops):
     * async: the op returns once the step is queued; out_tokens and out_n (which must stay
     *   valid until then) are written at a later wait_queued.
     * prev_row (may be NULL): prev_row[i] >= 0 continues row prev_row[i] of the speculative
     *   step op queued just before this one (which may still be pending, and must have
     *   been one of the same k): row i's two tokens are that row's last two (of its fed
     *   last token and the m tokens it emitted), and sp[i].counter is advanced by its m;
     *   tokens[2i], tokens[2i+1] are not read. Its lengths are the ones that op left (the
     *   runner advanced them), so nothing of the row travels through the host. */
    int async;
    const int *prev_row;
} runner_spec_batch;

/* One verify step of drafts proposed outside the runner (optional op; prompt lookup), for
 * rows whose target length L is the position of their last token (not yet in the KV):
 *   1. one target pass over [last, d1..dk] at positions L..L+k (row i's drafts past its
 *      n_drafts[i] are padding: computed, never accepted);
 *   2. acceptance of row i's first n_drafts[i] drafts as point masses (engine/core/spec.h
 *      spec_accept_point): at each position j the target's own token x_j (greedy: its
 *      argmax; sampling: its draw with the uniform the runner's decode sampler uses at that
 *      output position, counter + j), draft j standing while x_j == d_j; the first x_j that
 *      differs, or x_n after n_drafts standing drafts, ends the row;
 *   3. target length = L + accepted + 1.
 * Requires L + k + 1 <= max_seq_len for every row (padding positions are written too) and
 * n <= runner.verify_max_rows. On CUDA one graph per (padded batch size, k). */
typedef struct {
    int n, k;                     /* k: 1..runner.verify_max_k, at least every n_drafts */
    const int *slots;             /* [n] */
    const int32_t *tokens;        /* [n, k+1]: the last token, then the drafts (padded) */
    const int *n_drafts;          /* [n]: 0..k */
    const runner_sampling *sp;    /* [n] (counter: output index of the first new token) */
    int32_t *out_tokens;          /* [n, k+1]: accepted drafts then the target's token */
    int *out_n;                   /* [n]: accepted + 1 */
} runner_verify_batch;

typedef struct {
    int slot;                /* row of the slot table (0..max_batch; max_batch = dummy) */
    int n_new;               /* tokens this row feeds, at positions len .. len+n_new-1 */
    int tok_off;             /* index of its first token in runner_batch.tokens */
    int n_logits;            /* 0: none, 1: last position only, n_new: every position */
    int logits_off;          /* its first row in runner_batch.logits */
} runner_row;

typedef struct {
    int which;               /* RUNNER_TARGET or RUNNER_DRAFT */
    int n_rows;
    const runner_row *rows;
    const int32_t *tokens;   /* [n_tokens] */
    int n_tokens;
    float *logits;           /* [sum of n_logits, vocab], fp32, host memory */
    /* Optional, only where runner.forward_samples: sample every logits row where the
     * logits are (sp[i] for logits row i; on CUDA as its decode op does, on the CPU as
     * the engine's host sampler does) and write out_tokens[i]; the logits are then not
     * returned (CUDA: no vocab-wide copy to the host; CPU: the buffer is scratch). */
    const runner_sampling *sp;
    int32_t *out_tokens;
    float *out_logprobs;     /* with sp, may be NULL: log softmax of the raw logits at the
                              * sampled token, per logits row */
    int32_t *out_top_ids;    /* with sp, [logits rows, RUNNER_MAX_TOP]: sp[i].n_top top */
    float *out_top_logprobs; /* logprobs of row i (may be NULL when no row wants any) */
    int32_t *out_ranks;      /* with sp, may be NULL: for each row with sp[i].force, 1 + the
                              * ids whose logit is larger than force_token's */
    /* Optional, with sp: called once per forward after the pass is under way and before the
     * runner reads sp (CUDA: enqueued, so the host work overlaps the device's; CPU: after the
     * pass). The caller may fill or change sp then, masks included: the runner reads none of
     * it before. A nonzero return fails the forward with that code. The engine computes its
     * grammar masks here. */
    int (*prepare_sp)(void *ctx);
    void *prepare_ctx;
    /* Pipelining, where runner.forward_async, with sp (prepare_sp and masks only where
     * runner.async_masks, as for decode; at most max_batch logits rows): async and
     * prev_tok as runner_decode_batch's async and prev_row, per token (prev_tok[t] >= 0:
     * token t is the one the op queued just before sampled into its output row
     * prev_tok[t]). */
    int async;
    const int *prev_tok;
} runner_batch;

typedef struct runner runner;

/* Rows of one verify op at most (runner.verify_max_rows: the CUDA runner captures its
 * verify graphs up to this many rows; the CPU runner keeps the same limit, so a
 * prompt-lookup step above it behaves alike on both). */
#define RUNNER_VERIFY_MAX_ROWS 64

typedef struct {
    const char *name;
    /* Run one forward pass of `which` over all rows: write K/V of every fed token into
     * the pool through the slot's block table, attend causally over the slot's context,
     * write requested logits, then advance each row's length by n_new. */
    int (*forward)(runner *r, const runner_batch *b);
    /* Write a slot's block table: entries [first, first+n) = blocks; with first == 0 the
     * rest of the row is reset to the null block. */
    int (*slot_write_blocks)(runner *r, int slot, int first, const int32_t *blocks, int n);
    /* The same for the slot's window-pool table (NULL: the runner has no window pool). */
    int (*slot_write_win_blocks)(runner *r, int slot, int first, const int32_t *blocks, int n);
    int (*slot_set_len)(runner *r, int slot, int which, int len);
    int (*slot_get_len)(runner *r, int slot, int which);
    /* Copy the K/V of pool block src to dst for every layer of the first pool. */
    int (*copy_block)(runner *r, int dst, int src);
    /* Optional fast paths (NULL when not implemented; runner_step then runs the step as
     * a forward, and a draft model's step is composed by the engine). */
    int (*decode)(runner *r, const runner_decode_batch *b);
    /* Where runner.decode_async: complete the oldest pending async op (its outputs into
     * the arrays of its batch). 0 when it succeeded or none is pending. */
    int (*wait_queued)(runner *r);
    int (*spec_step)(runner *r, const runner_spec_batch *b);
    int (*verify)(runner *r, const runner_verify_batch *b);
    /* Optional, callable from any thread: a peer rank of a tensor-parallel group died, so
     * make the collective a step may be waiting in (and every later one) fail at once. */
    void (*abort_group)(runner *r);
    void (*destroy)(runner *r);
} runner_ops;

struct runner_step_scratch;

struct runner {
    const runner_ops *ops;
    runner_config cfg;
    const model *target;
    const model *draft;      /* NULL without speculation */
    int vocab;
    int forward_samples;     /* forward() takes runner_batch.sp (set by the runner) */
    int draft_samples;       /* ... for the draft model's passes too (which = RUNNER_DRAFT) */
    int forward_masks;       /* ... and honours runner_sampling.mask */
    int decode_masks;        /* decode() honours runner_sampling.mask and prepare_sp */
    int sample_adjusts;      /* decode() and, where forward_samples, forward() honour
                              * runner_sampling's logit adjustments and n_top */
    int verify_max_k, verify_max_rows;   /* limits of ops.verify (set by the runner) */
    int verify_samples;      /* ops.verify takes sampled rows (temperature > 0); else the
                              * engine gives it greedy rows only */
    int decode_async;        /* decode() takes runner_decode_batch.async and prev_row */
    int async_stats;         /* decode() and sampling forward() honour runner_sampling.stats_fed,
                              * so rows with penalties can be queued in flight too */
    int async_masks;         /* async decode() / forward() take prepare_sp and masks (and
                              * let the callback wait for the op before): constrained rows
                              * can be queued in flight */
    int forward_async;       /* forward() takes runner_batch.async and prev_tok */
    int spec_async;          /* spec_step() takes runner_spec_batch.async and prev_row */
    int async_device;        /* a queued op runs on a device while the host goes on (the
                              * engine's work for the next step hides under it); 0 where
                              * the op is computed when queued (the CPU runner) */
    int forced_tokens;       /* sampling forward() takes runner_sampling.force (prompt positions
                              * whose logprobs are wanted: no logits to the host for them) */
    int masked_raw_logprobs; /* a masked row's logprob and top logprobs are of its logits
                              * before the mask, as the host reports them */
    size_t kv_block_bytes[2];/* bytes of one block of the first pool and of the window pool */
    struct runner_step_scratch *step_scratch;   /* runner_step's (its own; NULL until used) */
};

static inline int runner_forward(runner *r, const runner_batch *b) { return r->ops->forward(r, b); }
void runner_destroy(runner *r);

/* ---- the step operation (engine/core/runner_step.c) ------------------------------------
 * One step of the target over mixed rows -- prompt chunks, decode rows and verify rows (a
 * row's last token followed by drafts to check) -- that samples in the runner, whichever
 * of the runner's ops fits: the decode op when every row decodes one token (a captured
 * graph on CUDA), the verify op when every row decodes and some verify drafts (one graph
 * per batch size and depth on CUDA), else the forward pass (eager on CUDA; the CPU
 * runner's forward composes everything). What each op takes of runner_sampling is decided
 * here, from the rows' sampling alone (runner_takes), so a sampling feature is added in one
 * place: runner_sampling, the runners' samplers and runner_takes.
 *
 * The batch is a runner_batch of the target whose logits rows are laid out in row order
 * (row i's logits_off is the sum of n_logits before it) with one sampling row sp[o] per
 * logits row; sp NULL: the forward pass returns logits and nothing is sampled or accepted
 * (out_n is not written; every row's length advances by its n_new).
 * A verify row has n_drafts[i] > 0: its n_new = n_logits = n_drafts + 1 tokens are its last
 * token and the drafts, every position sampled (position j's sampling as plain decoding's
 * at that output position: its counter, its statistics with the drafts before it), and
 * the drafts stand while they equal the sampled tokens (spec_accept_draws: the point-mass
 * and the greedy rule); out_n[i] = accepted + 1, those tokens at out_tokens[logits_off ..],
 * and the row's target length is advanced by that many. Other rows as runner_batch says.
 * async / prev_tok / prepare_sp as runner_batch's (no verify rows when async). */
enum { RUNNER_OP_NONE = 0, RUNNER_OP_DECODE, RUNNER_OP_VERIFY, RUNNER_OP_FORWARD };

#define RUNNER_STEP_MAX_K 15   /* drafts of one verify row at most */

typedef struct {
    runner_batch b;
    const int *n_drafts;     /* [n_rows] 0..RUNNER_STEP_MAX_K, or NULL: no verify rows */
    int *out_n;              /* [n_rows], where sp (required with verify rows): tokens each row
                              * emitted -- accepted + 1 for a verify row, 1 for a row whose
                              * last logits row samples (is not forced), else 0 */
    int op;                  /* the op that runs it (RUNNER_OP_*): set by runner_step_plan,
                              * which runner_step calls first where it is still 0 */
} runner_step_batch;

/* Whether op (RUNNER_OP_*) samples a row with sampling sp (async: queued in flight);
 * runner_ops_taking: the ops that do, bit 1 << op each. */
int runner_takes(const runner *r, int op, const runner_sampling *sp, int async);
int runner_ops_taking(const runner *r, const runner_sampling *sp, int async);
/* The op runner_step will run b with (also into b->op), or RUNNER_OP_NONE when no op
 * samples every row. Changing b afterwards needs b->op reset to 0. */
int runner_step_plan(const runner *r, runner_step_batch *b);
int runner_step(runner *r, runner_step_batch *b);
/* Whether n decoding rows (slots, position-0 sampling sp) with up to k drafts each could be
 * one verify op: what the engine's prompt-lookup planning asks before drafting. */
int runner_step_verifies(const runner *r, int n, const int *slots, const runner_sampling *sp, int k);
/* Whether the speculative step op (spec_step, a draft model) samples a row with sp. */
int runner_spec_takes(const runner *r, const runner_sampling *sp);

/* CPU reference runner. Converts all weights to fp32 at creation. */
runner *runner_cpu_create(const model *target, const model *draft, const runner_config *cfg,
                          char *err, size_t errlen);
/* Which layers a KV block holds: every target + draft layer (one pool), or with a
 * window pool the first pool's layers (RUNNER_POOL_MAIN) or the window pool's. */
enum { RUNNER_POOL_ALL = 0, RUNNER_POOL_MAIN = 1, RUNNER_POOL_WINDOW = 2 };
/* Blocks of the window pool within a KV budget of `budget` bytes: what the engine asked
 * for (every slot's window), but at most half the budget, so that the full layers keep
 * room when memory is short; never fewer than min (the runner then fails to size the
 * first pool if even that does not fit). */
static inline int runner_window_pool_fit(const runner_config *c, size_t win_block_bytes, double budget) {
    double half = budget / 2 / (double)win_block_bytes;
    int n = c->win_blocks;
    if ((double)n > half) n = half > (double)c->win_min_blocks ? (int)half : c->win_min_blocks;
    return n;
}

/* Pool layer l's KV (target layers first, then the draft's: draft NULL without one)
 * lives in the window pool (win: the runner has one): every sliding-window layer of
 * either model. */
static inline int runner_layer_in_window_pool(const model_config *target, const model_config *draft, int win,
                                              int l) {
    if (!win) return 0;
    if (l < target->n_layers) return model_layer_window(target, l) > 0;
    l -= target->n_layers;
    return draft && l < draft->n_layers && model_layer_window(draft, l) > 0;
}
/* Bytes of one KV block of that pool in the CPU runner's storage. */
size_t runner_cpu_block_bytes(const model *target, const model *draft, int block_size, int kv_fp8, int pool);

#ifdef SPECD_HAVE_CUDA
/* CUDA runner (engine/cuda/cuda_runner.c): bf16 weights (or FP8 / GGUF blocks) and KV (or
 * FP8 with kv_fp8), cuBLAS GEMMs, CUDA graphs. */
runner *runner_cuda_create(const model *target, const model *draft, const runner_config *cfg,
                           char *err, size_t errlen);
#endif

#endif
