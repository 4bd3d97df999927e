/* Tensor-parallel sharding of a model (prefix shard_). Pure C, no CUDA, no I/O.
 *
 * Given a loaded model (tensor views) and (rank, world), shard_model() builds the rank's
 * shard as an ordinary `model` that any runner can upload. The split is Megatron's:
 *
 *   tensor            split                      rank r keeps
 *   wq, bq            column-parallel (by head)   Q heads [r*H/W, (r+1)*H/W)
 *   wk, wv, bk, bv    column-parallel (by head)   KV heads [r*KV/W, (r+1)*KV/W)
 *   wo                row-parallel                input columns of its Q heads
 *   w_gate, w_up      column-parallel             ffn rows [r*F/W, (r+1)*F/W)
 *   w_down            row-parallel                input columns of its ffn rows
 *   each expert's     as w_gate, w_up, w_down     its rows [r*MF/W, (r+1)*MF/W) of every
 *     gate, up, down                              expert (MF = moe_ffn): all experts on
 *                                                 every rank, each a 1/W slice
 *   norms, q/k norm,  replicated
 *   sandwich norms,
 *   router
 *   tok_embd, lm_head replicated (see below)
 *
 * "Column-parallel" is Megatron's name (the output features are split); for our [out, in]
 * weights it means a ROW slice, which is contiguous in memory, so the shard's view points
 * into the source model's mapping (no copy; GGUF's per-head Q/K row permutation stays
 * valid because a slice of whole heads is a whole-head block of stored rows).
 * "Row-parallel" splits the input features: a COLUMN slice of [out, in], which is not
 * contiguous, so it is an owned copy: same dtype when the column boundary and width are
 * multiples of the dtype's block (1 for F32/F16/BF16, 32 for Q8_0/Q4_0/Q4_1, 256 for
 * Q4_K/Q6_K), else dequantized to an owned F32 copy.
 *
 * A row-parallel layer produces a PARTIAL output on each rank; the full output is the sum
 * over ranks (the all-reduce). Everything between two all-reduces is rank-local, so per
 * layer there are exactly two all-reduces: after the O projection and after down (for
 * experts: after the router-weighted sum of every chosen expert's partial down output; the
 * router is replicated, so every rank picks the same experts with the same weights).
 * Gemma 3's sandwich norms act on the sublayer's whole output, so they come after the
 * all-reduce, as the residual add does.
 *
 * GQA rule: n_heads % W == 0 and n_kv_heads % W == 0 (shard_check says which fails). Then
 * rank r's Q heads map exactly onto its own KV heads: Q head h uses KV head h / G with
 * G = n_heads / n_kv_heads, and rank r's Q heads [r*H/W, (r+1)*H/W) use KV heads
 * [r*KV/W, (r+1)*KV/W), so attention needs no communication and each rank's KV pool
 * holds only its KV/W heads. (vLLM replicates KV heads when KV < W; we refuse instead.)
 * ffn % W == 0 as well (moe_ffn % W == 0 for experts).
 *
 * Embedding and lm_head are replicated: the embedding lookup is a gather (no FLOPs), and
 * a vocabulary-split lm_head needs an all-gather of logits (and a split argmax/sampler)
 * on every step; for the models we serve the replicated lm_head costs vocab*hidden*2
 * bytes per rank (1 GiB for Llama-3-8B) and no communication. Measure before changing.
 *
 * The shard's config: n_heads/W, n_kv_heads/W, ffn/W, moe_ffn/W; hidden, head_dim, vocab,
 * n_experts unchanged.
 *
 * Ownership: the shard's row-sliced views point into `full`'s mapping, so `full` must
 * outlive the shard. Free a shard with shard_free(), never model_free(). */
#ifndef SPECD_SHARD_H
#define SPECD_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model/model.h"

/* 0 when `c` can be split over `world` ranks, else SPECD_EINVAL with a message naming
 * the field (n_heads, n_kv_heads, ffn or moe_ffn) that is not divisible. */
int shard_check(const model_config *c, int world, char *err, size_t errlen);

/* The rank's shard (see above). world == 1 gives a full copy of the views. NULL on error
 * with a message. */
model *shard_model(const model *full, int rank, int world, char *err, size_t errlen);
void shard_free(model *m);

/* Slices, exposed for tests and for the CUDA runner's upload path.
 * Rows [r0, r0+n) of a 2-D view (or elements of a 1-D view): a view into t's data. With
 * unpermute_heads > 0 the slice must cover whole heads. May make an owned F32 copy (a 1-D
 * quantized view cut off its block grid) registered with `owner` (a shard; NULL: refuse). */
int shard_slice_rows(model *owner, const tensor_view *t, int64_t r0, int64_t n, tensor_view *out);
/* Columns [c0, c0+n) of a 2-D view: an owned copy registered with `owner` (same dtype if
 * block-aligned, else F32). */
int shard_slice_cols(model *owner, const tensor_view *t, int64_t c0, int64_t n, tensor_view *out);

/* CPU simulation of tensor parallelism (tests and documentation of where the all-reduces
 * go): runs the forward of one causal sequence tokens[0..n) on all `world` shards, each
 * rank computing only its heads / ffn rows, summing the row-parallel partial outputs where
 * the all-reduce would be. logits: [n, vocab] fp32 for every position. Uses fp32 weights
 * (converted per layer) and double accumulation. Llama / Qwen layers only: a model with
 * experts, sliding windows or Gemma 3's layers is refused (SPECD_EUNSUPPORTED). */
int shard_simulate_forward(model *const *shards, int world, const int32_t *tokens, int n,
                           float *logits, char *err, size_t errlen);

#endif
