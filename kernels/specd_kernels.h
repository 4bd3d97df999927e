/* Launchers of specd's CUDA kernels (prefix k_): plain C declarations of thin host
 * functions in the kernels/ .cu files that check shapes, compute a grid and launch on a stream.
 * No engine header is included here; callers pass raw device pointers and dims.
 *
 * Conventions shared by every launcher:
 * - bf16 tensors are passed as uint16_t * (raw bits, round-to-nearest-even from fp32).
 * - Return value: 0, or a cudaError_t value (> 0) from the launch, or -1 for bad dims.
 * - Row-major shapes, outermost first; the shape is written next to each pointer.
 * - Paged KV pool (bf16, or FP8 E4M3 bytes with k_kv_geom.kv_fp8): one block holds every layer; inside a block, a layer owns
 *   K [kvh][block_size][head_dim] followed by V [kvh][block_size][head_dim] starting at
 *   element `layer_off`. Block b starts at element b * block_elems. The pool base is
 *   read from device memory (*pool_pp) so captured graphs survive a pool that is
 *   allocated after capture.
 * - Slot lengths: lens[slot * 2 + which] (which 0 = target, 1 = draft), int32 on the
 *   device; block tables: bt[slot * max_blocks + i]. Positions are read from lens at
 *   run time, never passed by value, so a captured graph never bakes a position. */
#ifndef SPECD_KERNELS_H
#define SPECD_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Launch choices the caller may switch for A/B timing and bisecting (kernels/ reads no
 * environment: the runner reads its switches once and hands them over here). The
 * defaults are the measured-fastest paths; k_set_tuning copies *t for every later launch
 * in the process (call it before capturing graphs). */
typedef struct {
    int pdl;          /* programmatic dependent launches (default 1) */
    int attn_pdl;     /* decode attention: 0 ordinary launch, 1 PDL, 2 PDL that lets the O
                       * GEMV in after the key loop (default 2) */
    int attn_simt;    /* 1: prefill/verify attention on the SIMT kernel, not tensor cores */
    int attn_tiled;   /* 1: decode rows on the tiled kernel, not the decode kernel */
    int attn_dec;     /* SPECD_ATTN_DEC: decode attention over at least as many (row, KV head)
                       * pairs as SMs, which form: 8 (default) the tensor-core form
                       * (attention_tc.cu) with keys asked of L2 ahead where that keeps its
                       * registers (an FP8 cache or head dim 64), 7 with it everywhere, 6
                       * without it; 0 the SIMT form (attention.cu), 1 and 2 its earlier
                       * forms, for A/B (3-5: retired tensor-core forms) */
    int gemvq_rows;   /* k_gemv_q's rows per warp: 4, or 2 for anything else (gemv_q.cu) */
    int gemvq_split;  /* k_gemv_q splits K over warps until about this many warps per SM are
                       * busy (default 32; test_gpu_gemv "*split_report*" sweeps 8..128) */
    int gemvq_rows_q6k; /* rows per warp of Q6_K blocks where they take the streaming form
                         * (default 2: 4 rows stage 84 KB a block, two blocks an SM; 0:
                         * gemvq_rows) */
    int gemvq_stream;   /* 1 (default): k_gemv_q / k_gemv_qi8 at 1-2 tokens over matrices with
                         * at least two steps a warp as gemv_qs_kernel, a fixed grid of blocks
                         * per SM whose warps each stream one run of steps, units cut between
                         * warps (gemv_q.cu); 0: one unit of rows per warp everywhere; 2:
                         * the streaming form for every shape and token count (tests) */
    int gemvq_tc_split; /* the same for k_gemv_qtc (default 32) */
    int gemm_qi8_bps;   /* k_gemm_qi8 splits its reduction until about this many blocks per SM
                         * (default 8; test_gpu_gemv "*gemm_q_speed*" sweeps 2..16: on the 8B
                         * shapes at 64 tokens 8 took 214 us over the three against 222 at 4) */
    int sample_hist;    /* 1 (default): the radix selects of k_sample / k_probs (top-k,
                         * top-p, top logprobs) add into one histogram per warp (sample.cuh
                         * radix_select's agg; the same keys in count mode); 0: one histogram
                         * per block, an atomic per logit (8B Q4_K_M at batch 1 on an H100:
                         * top logprobs 4.12 ms a token against 3.29, greedy 3.02) */
    int gemv_tc_min;    /* k_gemv_bf16 / k_gemv_w and their fused forms: passes of this many
                         * tokens or more (up to 8) on the tensor-core form, fewer on the FMA
                         * form (default 3; on an H100 the tensor-core form at 1-2 tokens
                         * decoded 13-33% slower). Each form sums a token's dot in an order
                         * that does not depend on the pass's other tokens; above 8 the FMA
                         * form everywhere (a verify pass that must equal decode steps) */
    int moe_r1;         /* 1 (default): the MoE gate|up GEMV of single-token passes in its
                         * one-row form, 4 blocks an SM (moe.cu moe_gemv_launch); 0: the form
                         * for up to 8 rows an expert */
    int sample_vec;     /* 1 (default): the row passes of k_sample (max, argmax, log-sum-exp,
                         * the top logprobs' chunks) and of the speculative argmaxes with four
                         * 16-byte loads in flight per thread (sample.cuh sample_row_visit,
                         * sample_chunk_visit; H100, a greedy row of 151,936 logits with its
                         * logprob: 15.5 us against 17.4); 0: one 4-byte load at a time */
    int attn_rope;      /* 1 (default): k_rope_attention's single-token rows get their q/k
                         * norm, rotary and KV write inside the decode attention kernel (one
                         * launch a layer fewer; H100, Qwen3-30B-A3B shape at batch 1: 3.79
                         * against 3.84 ms a token); 0: k_qkv_rope_kv then k_attention */
    int moe_tcv;        /* the runner's tcv_rows for k_moe_gemm (passes of 9+ tokens): -1
                         * (default) every expert on the tensor-core GEMV in decode passes of
                         * up to 16 rows an expert on average (Qwen3-30B-A3B: 256 rows; H100,
                         * Qwen3-30B-A3B widths, bench_moe at 64 tokens:
                         * 429.7 against 612.6 us a layer) and the tiles in the others (a
                         * 128-token prefill ran at 4.7k tok/s on the GEMV against 9.8k on
                         * the tiles); 0: the tiles only; N > 0: in every
                         * pass experts of up to N rows on the GEMV, the rest on the tiles
                         * (not yet run on a GPU: tests/gpu/UNRUN.md) */
    int attn_dec_pipe;  /* 1: the batch-1 form of the decode kernel requests a warp's next
                         * chunk of keys before the current one's math (long contexts: one
                         * wait on memory a chunk instead of two; the same bits); 0 (default
                         * until run on a GPU: tests/gpu/UNRUN.md): each chunk loaded when
                         * its turn comes */
} k_tuning;
extern const k_tuning k_tuning_default;
void k_set_tuning(const k_tuning *t);

/* out[t, :] = fp32(table[tokens[t], :]).  table [vocab, hidden] bf16, out [n, hidden].
 * Token ids outside [0, vocab) read row 0 (a bad id must not fault the device). */
int k_embed(const uint16_t *table, const int32_t *tokens, float *out, int n, int hidden,
            int vocab, cudaStream_t s);

/* out[i, :] = bf16(x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w) with r = rows ? rows[i] : i.
 * x [*, hidden] fp32 (the residual stream; the residual add itself is done by the GEMM
 * that produces x with beta = 1), w [hidden] fp32, out [n, hidden] bf16. */
int k_rmsnorm(const float *x, const int32_t *rows, const float *w, uint16_t *out, int n,
              int hidden, float eps, cudaStream_t s);
/* Activations for the int8 kernels (gemv_q.cu k_gemv_qi8, gemm_q.cu k_gemm_qi8): X [n, in]
 * bf16 (16-byte aligned, in % 32 == 0) rounded per 32 elements into scratch: int8 codes
 * [n, in] first (padded to 16 bytes), then (scale = max |x| / 127, sum of the 32 codes)
 * float2 [n, in / 32]; at least k_gemv_qi8_scratch(in, n) bytes. Launched with PDL like the
 * kernels it feeds. */
int k_quant_x8(const uint16_t *X, int n, int in, void *scratch, cudaStream_t s);
/* k_rmsnorm (rows NULL) that also leaves its output rounded to int8 in scratch as
 * k_quant_x8 would (its layout, at least k_gemv_qi8_scratch(hidden, n) bytes), for
 * the int8 GEMV after it (k_gemv_qi8_ld with x_ready). hidden % 32 == 0, x, w, scratch
 * 16-byte aligned, out 8-byte aligned; else -1. */
int k_rmsnorm_q8(const float *x, const float *w, uint16_t *out, int n, int hidden, float eps, void *scratch,
                 cudaStream_t s);

/* out[t, j] = bf16(silu(gu[t, j]) * gu[t, ffn + j]).  gu [n, 2*ffn] fp32 (gate | up). */
int k_silu_mul(const float *gu, uint16_t *out, int n, int ffn, cudaStream_t s);
/* The same with GELU (tanh approximation, HF's gelu_pytorch_tanh) for the gate: Gemma. */
int k_gelu_tanh_mul(const float *gu, uint16_t *out, int n, int ffn, cudaStream_t s);
/* Either (gelu) that also leaves its output rounded to int8 in scratch as k_quant_x8
 * would, for the int8 GEMV after it (ffn % 32 == 0, scratch 16-byte aligned). */
int k_gated_mul_q8(const float *gu, uint16_t *out, int n, int ffn, int gelu, void *scratch, cudaStream_t s);
/* Either (gelu) over the unscaled products of an FP8 gate|up GEMM: gate j and up j are
 * first multiplied by sw[j] * sx[t] and sw[ffn + j] * sx[t] (row scales [2 ffn], token
 * scales [n]). */
int k_gated_mul_fp8(const float *gu, const float *sw, const float *sx, uint16_t *out, int n, int ffn, int gelu,
                    cudaStream_t s);
/* resid[t, :] += rmsnorm(x[t, :]) * w (fp32): a post-sublayer norm before the residual
 * add (Gemma 3). x, resid [n, hidden], w [hidden]. */
int k_rmsnorm_add(const float *x, const float *w, float *resid, int n, int hidden, float eps, cudaStream_t s);
/* Mixture of experts (kernels/moe.cu). Route: logits [n, E] fp32 -> ids, w [n, K] (top K
 * of the softmax, renormalised when norm), each pair p = t*K + k appended to rows
 * [E][n] of its expert; counts [E] must be zero before. K <= 16. */
int k_moe_route(const float *logits, int n, int E, int K, int norm, int32_t *ids, float *w,
                int32_t *counts, int32_t *rows, cudaStream_t s);
/* Grouped GEMM over experts: for each expert e and each pair p in rows[e][0..counts[e]),
 * out[p] = W_e . X[p / x_div]. gated: W [E][2N][Kd] (gate; up), Yb[p][N] = bf16(act(g) * u)
 * with act GELU-tanh when gelu, else SiLU; plain: W [E][N][Kd], Yf[p][N] fp32. cap = n
 * (the row lists' stride); Kd % 8 == 0. Blocks of experts without rows return at once.
 * Above 8 tokens, experts with up to tcv_rows rows run on the tensor-core GEMV (moe.cu
 * moe_tcv_kernel) and the rest on the tiles (0: the tiles only; >= cap: the GEMV only). */
int k_moe_gemm(const uint16_t *W, const uint16_t *X, int x_div, const int32_t *rows, const int32_t *counts,
               int cap, int E, int N, int Kd, int gated, int gelu, int tcv_rows, float *Yf, uint16_t *Yb,
               cudaStream_t s);
/* resid[t] += sum_k w[t, k] * out[t*K + k] (k in order), out [n*K, hidden] fp32. */
int k_moe_combine(const float *out, const float *w, int n, int K, int hidden, float *resid, cudaStream_t s);
/* logits [n, vocab]: for rows with has[r] != 0, ids whose bit in mask [n, ceil(vocab/32)]
 * is 0 become -inf (a grammar's mask before on-device sampling). */
int k_mask_logits(float *logits, int n, int vocab, const uint32_t *mask, const int32_t *has, cudaStream_t s);
/* x[i] *= a for i < n (Gemma's scaled embeddings). */
int k_scale_f32(float *x, size_t n, float a, cudaStream_t s);

typedef struct {
    const int32_t *tok_slot;   /* [n] slot of each token */
    const int32_t *tok_j;      /* [n] index of the token inside its row: pos = len + j */
    const int32_t *lens;       /* [(max_batch+1) * 2] */
    int which;                 /* 0 target, 1 draft: which length gives the position */
    const int32_t *bt;         /* [(max_batch+1) * max_blocks] */
    int max_blocks;
    int block_size;
    uint16_t *const *pool_pp;  /* device pointer to the pool base */
    size_t block_elems;        /* elements per block (all layers) */
    size_t layer_off;          /* element offset of this layer's K inside a block */
    /* kv_fp8: the pool's elements are FP8 E4M3 bytes (offsets above still count
     * elements), k = code * k_scale and v = code * v_scale for this layer; the writers
     * store e4m3(x / scale) (round to nearest even, saturating, as engine/model/fp8.c).
     * The scales are read only with kv_fp8. */
    int kv_fp8;
    float k_scale, v_scale;
} k_kv_geom;

/* For each token t of qkv [n, (H + 2*KVH) * D] fp32 (q heads | k heads | v heads):
 * add bias [(H+2KVH)*D] (if non-NULL), RMS-normalise each q / k head with q_norm / k_norm
 * [D] (if non-NULL, Qwen3), rotate q and k (rotate_half convention, angle =
 * pos * inv_freq[i], inv_freq [D/2]), write q to q_out [n, H, D] fp32 and k, v into the
 * paged pool at position pos = lens[slot*2+which] + tok_j[t]. Positions at or past
 * max_blocks * block_size are not written (the attention clamps the same way). */
int k_qkv_rope_kv(const float *qkv, const float *bias, const float *q_norm,
                  const float *k_norm, const float *inv_freq, float eps, float *q_out,
                  int n, int H, int KVH, int D, const k_kv_geom *g, cudaStream_t s);
/* The same over an unscaled FP8 GEMM's output: element (t, o) first multiplied by
 * sw[o] * sx[t] as k_fp8_scale_rows would (both NULL: k_qkv_rope_kv). */
int k_qkv_rope_kv_fp8(const float *qkv, const float *sw, const float *sx, const float *bias, const float *q_norm,
                      const float *k_norm, const float *inv_freq, float eps, float *q_out, int n, int H, int KVH,
                      int D, const k_kv_geom *g, cudaStream_t s);

/* Paged attention for rows of n_new query tokens attending causally over the row's
 * context: query token j of row r sits at position len + j and sees keys 0..len + j
 * (with a sliding window W, keys len + j - W + 1 .. len + j).
 * One kernel serves decode (n_new = 1), speculative verify (n_new = k+1) and chunked
 * prefill. Work is split into items (row, first query token, up to qt tokens) per
 * KV head, and keys into n_splits chunks of split_len keys (flash-decoding); with
 * n_splits > 1 partial results go to ws_o / ws_ml and a combine pass writes out.
 *   q   [n_tok, H, D] fp32 (kept fp32: one bf16 rounding fewer), out [n_tok, H, D] bf16.
 *   row_slot/row_tok_off/row_n_new [n_rows]; item_row/item_q0 [n_items].
 *   ws_o  [n_splits, n_tok, H, D] fp32, ws_ml [n_splits, n_tok, H, 2] fp32 (may be NULL
 *   when n_splits == 1). split_len == 0: each item divides its own context (read on the
 *   device) evenly over n_splits, so a captured graph spreads any length. D must be 32, 64, 128 or 256; qt * (H / KVH) <= 64. */
typedef struct {
    const int32_t *row_slot, *row_tok_off, *row_n_new;
    const int32_t *item_row, *item_q0;
    int n_items, qt, n_tok;
    int n_splits, split_len;
    float *ws_o, *ws_ml;
    /* Sliding window (0: none): query position p sees keys p - window + 1 .. p only; the
     * splits then divide that span (with split_len 0) instead of the whole context. */
    int window;
    /* Optional (may be NULL): n_items * KVH zeroed counters. With them the SIMT kernel
     * merges the splits itself (the last split block of an item and KV head to finish
     * does the combine and re-zeroes its counter), so no combine kernel runs. */
    unsigned *counters;
    /* Optional (may be NULL): out's int8 rounding as well, in k_quant_x8's scratch layout
     * for [n_tok, H * D] (for an int8 GEMV after it: k_gemv_qi8_ld with x_ready). The
     * decode kernel and both of its merges round as they write; other kernels are followed
     * by a k_quant_x8 launch. Bit-equal to k_quant_x8 of out either way. */
    void *x8;
    /* Optional (may be NULL): bytes [l2_next, l2_next + l2_next_bytes) that the SIMT
     * decode kernel (the batch-1 form, and SPECD_ATTN_DEC 0-2; the other kernels ignore
     * it) asks L2 to fetch once its wait is over: the next launch's weights (the runner
     * gives the O projection's at batch 1-2), fetched while DRAM would idle under the
     * attention's chain of dependent loads. A hint: results do not change. Address and
     * length 16-byte multiples (else -1). */
    const void *l2_next;
    size_t l2_next_bytes;
} k_attn_work;
int k_attention(const float *q, uint16_t *out, int H, int KVH, int D, float scale,
                const k_kv_geom *g, const k_attn_work *w, cudaStream_t s);
/* What the rotary step needs besides the geometry: the QKV projection's fp32 output
 * [n, (H + 2*KVH) * D] and k_qkv_rope_kv's other inputs (q_out: where q goes when the
 * separate kernels run). */
typedef struct {
    const float *qkv, *bias, *q_norm, *k_norm, *inv_freq;
    float eps;
    float *q_out;
} k_rope_in;
/* k_qkv_rope_kv then k_attention, for passes whose every row holds exactly one new token
 * (w->qt == 1, n_items == n_tok, one item a row: decode; the caller vouches for the rows).
 * Where the batch-1-sized decode kernel takes the pass (fewer (row, KV head) pairs than
 * SMs, H / KVH <= 8, D 64 or 128) and k_tuning.attn_rope is on, one launch does both:
 * each block norms and rotates its own q heads from qkv, and the split block that holds
 * the new key computes its K and V, stores them in the pool and uses them from shared
 * memory. The result and the pool are the same bits as the two launches'. */
int k_rope_attention(const k_rope_in *rp, uint16_t *out, int H, int KVH, int D, float scale, const k_kv_geom *g,
                     const k_attn_work *w, cudaStream_t s);
/* The same attention on tensor cores (bf16 mma, fp32 softmax and accumulators; q is
 * rounded to bf16). k_attention calls it itself when D is 64 or 128 and qt * G >= 16
 * (unless SPECD_ATTN_SIMT=1); exposed for tests. D must be 64 or 128 (else -1). */
int k_attention_tc(const float *q, uint16_t *out, int H, int KVH, int D, float scale,
                   const k_kv_geom *g, const k_attn_work *w, cudaStream_t s);

/* Skinny GEMM for decode: Y[t, o] = (accumulate ? Y[t, o] : 0) + sum_k W[o, k] X[t, k] for
 * t < n <= K_GEMV_MAX_N. W [out, in] bf16, X [n, in] bf16, Y [n, out] fp32; in % 8 == 0
 * and W, X 16-byte aligned (else -1: use cuBLAS). */
#define K_GEMV_MAX_N 8
int k_gemv_bf16(const uint16_t *W, const uint16_t *X, float *Y, int out, int in, int n,
                int accumulate, cudaStream_t s);

/* RMSNorm folded into the decode GEMVs (batch 1-2 on one GPU). Since
 *   W . rmsnorm(h, g) = rsqrt(mean(h^2) + eps) * (W . (h * g)),
 * the GEMV that adds into the residual h (O, down) also writes xg = bf16(h * g) for the
 * next norm's weight g and adds each row's sum of h^2 into ss (block sums, one atomic per
 * block and row), and the GEMV that consumes the norm (QKV, gate|up) reads xg and scales
 * its dot products by rsqrt(ss / in + eps). No norm kernel runs between them.
 * k_norm_out: g [out] fp32, xg [n, out] bf16 (must not alias X), ss [n] zeroed before
 *   the launch. k_norm_in: ss [n] as left by that launch, eps; NULL = X is already
 *   normalised. The sums are fixed point, K_SS_FRAC_BITS fractional bits (integer
 *   atomics: the same bits whatever order the blocks add in); K_SS_VALUE converts. Range:
 *   a row's sum of h^2 below 2^36 (~6.9e10: an rms of ~4100 at hidden 4096); a block's
 *   share is rounded to 2^-29. */
#define K_SS_FRAC_BITS 28
#define K_SS_VALUE(u) ((double)(u) * (1.0 / (double)(1ull << K_SS_FRAC_BITS)))
typedef struct {
    const float *g;
    uint16_t *xg;
    unsigned long long *ss;
} k_norm_out;
typedef struct {
    const unsigned long long *ss;
    float eps;
} k_norm_in;

/* k_gemv_bf16 with the fold: nin scales the dots, nout (only with accumulate) writes
 * xg and ss from the updated rows of Y. n <= K_GEMV_FUSED_MAX_N when either is given. */
int k_gemv_norm_bf16(const uint16_t *W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
                     const k_norm_in *nin, const k_norm_out *nout, cudaStream_t s);

/* Decode steps of n <= K_MOE_DEC_MAX_N tokens: one MoE layer in three launches.
 * k_moe_route_gemv: the router GEMV (Wr [E, hidden] bf16, X [n, hidden] bf16; nin the
 *   norm fold or NULL) and k_moe_route's routing in one launch (its last block routes);
 *   it zeroes counts itself and lists the experts that got rows in active [1 + E] (how
 *   many, then their ids in no set order). done: one counter, zero before the first
 *   launch; each launch leaves it zero.
 * k_moe_gated_dec: k_moe_gemm's gated form (x_div K, act [n*K, N]) over the listed
 *   experts only (a grid of min(E, n*K) experts, not E); nin as above.
 * k_moe_down_combine: resid[t] += sum_k w[t, k] * W_ids[t,k] . act[t*K + k] (k in order;
 *   W [E][N][Kd]), and with nout the norm fold's xg / ss for the next layer. */
#define K_MOE_DEC_MAX_N 8
typedef struct {
    float *logits;       /* [n, E] */
    int32_t *ids;        /* [n, K] */
    float *w;            /* [n, K] */
    int32_t *counts;     /* [E] */
    int32_t *rows;       /* [E][n] */
    int32_t *active;     /* [1 + E] */
    unsigned int *done;  /* [1] */
    /* Optional (may be NULL): with one token, k_moe_route_gemv's routing block asks L2 for
     * the first l2_bytes (16-byte multiple) of each picked expert's gate rows and of its
     * up rows in l2_gu (the gate|up weights, [E][2 * l2_F][hidden] bf16) before it ends, so
     * k_moe_gated_dec's first loads find them on the way. A hint: results do not change. */
    const uint16_t *l2_gu;
    int l2_F;
    size_t l2_bytes;
} k_moe_route_buf;
int k_moe_route_gemv(const uint16_t *Wr, const uint16_t *X, const k_norm_in *nin, int n, int hidden, int E, int K,
                     int norm, const k_moe_route_buf *b, cudaStream_t s);
int k_moe_gated_dec(const uint16_t *W, const uint16_t *X, const k_norm_in *nin, const k_moe_route_buf *b, int n,
                    int E, int K, int N, int Kd, int gelu, uint16_t *act, cudaStream_t s);
int k_moe_down_combine(const uint16_t *W, const uint16_t *act, const k_moe_route_buf *b, int n, int K, int N, int Kd,
                       float *resid, const k_norm_out *nout, cudaStream_t s);
/* One token's MoE layer in one launch (router, routing, gate|up, down, combine; grid
 * barriers between them, so every block must be resident: at most one an SM): the same
 * logits, picks and activations as the three launches above (their orders of sums), the
 * down sums in another order. Wr / Wgu / Wd / X / nin / nout / resid as there; b's logits,
 * ids and w are written (nothing else of b is used); part: k_moe_decode1_part_floats(hidden)
 * floats of scratch; bar: one counter, zero before the first launch and left so by each;
 * act (NULL: not written): the picks' activations [K, F] bf16. -1 where the form does not
 * apply (shapes, shared memory, residency): use the three launches. */
size_t k_moe_decode1_part_floats(int hidden);
int k_moe_decode1_fits(int hidden, int E, int K, int F);   /* 0: k_moe_decode1 applies to these widths */
int k_moe_decode1(const uint16_t *Wr, const uint16_t *Wgu, const uint16_t *Wd, const uint16_t *X, const k_norm_in *nin,
                  int hidden, int E, int K, int F, int norm, int gelu, const k_moe_route_buf *b, float *part,
                  unsigned *bar, float *resid, const k_norm_out *nout, uint16_t *act, cudaStream_t s);

/* k_gemv_bf16 over GGUF-quantized weights read in place (kernels/gemv_q.cu; work in
 * --dtype gguf): type is the ggml type id (2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14
 * Q6_K, see kernels/quant_blocks.h), W's rows in / block elements blocks each, stored one
 * after another (row starts need not be aligned); W and X [n, in] bf16 16-byte aligned,
 * n <= K_GEMV_MAX_N; -1 for anything else. */
int k_gemv_q(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
             cudaStream_t s);
/* k_gemv_q with the activations quantized to int8 as well, for every type it reads
 * (k_gemv_qi8_takes): X is first rounded per 32 elements to int8 codes and a
 * scale (max |x| / 127) in scratch (at least k_gemv_qi8_scratch(in, n) bytes, 16-byte
 * aligned), then each block's codes are dotted with them by integer dp4a and scaled once.
 * Fewer instructions per weight than k_gemv_q's fp32 FMAs on every token, at the price of
 * the activations' rounding (relative ~1e-3 per product, as llama.cpp's int8 GEMVs). */
int k_gemv_qi8_takes(int type);
size_t k_gemv_qi8_scratch(int in, int n);
int k_gemv_qi8(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
               void *scratch, size_t scratch_bytes, cudaStream_t s);
/* Both with Y[t, o] at Y + t * ldy + o (ldy >= out), so a matrix whose rows come in two
 * types (a Q4_K_M file's Q|K in Q4_K and V in Q6_K) runs as two launches into one output;
 * k_gemv_qi8_ld with x_ready reuses the int8 activations a call before it left in scratch
 * (the same X, n and in). */
int k_gemv_q_ld(int type, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                int accumulate, cudaStream_t s);
int k_gemv_qi8_ld(int type, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                  int accumulate, void *scratch, size_t scratch_bytes, int x_ready, cudaStream_t s);
/* The same for more tokens on int8 tensor cores (kernels/gemm_q.cu; Q8_0, in % 64 == 0:
 * k_gemm_qi8_takes): k_gemm_q's tiling, one mma m16n8k32 per block of 32 codes, scaled by
 * the token's and the weight's block scales. scratch holds the rounded X (as k_gemv_qi8's:
 * k_gemv_qi8_scratch(in, n) bytes at least); the rest of it, when there is some, holds
 * partial sums for a split reduction (deterministic, like k_gemm_q's). */
int k_gemm_qi8_takes(int type, int in);
int k_gemm_qi8(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
               void *scratch, size_t scratch_bytes, cudaStream_t s);
/* The same product on tensor cores for the K-quant types and Q8_0 (Q4_K, Q5_K, Q6_K, Q8_0:
 * k_gemv_qtc_takes) and n <= K_GEMV_QTC_MAX_N tokens (kernels/gemv_q.cu): one mma per 16
 * codes of a sub-block (Q8_0: two, a nibble each), the codes as exact bf16 integers; -1 for
 * anything else. */
#define K_GEMV_QTC_MAX_N 16
int k_gemv_qtc_takes(int type);
int k_gemv_qtc(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
               cudaStream_t s);
int k_gemv_qtc_ld(int type, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                  int accumulate, cudaStream_t s);   /* Y's rows ldy apart (k_gemv_q_ld) */
/* The same matrix dequantized to bf16 out [rows, in] (16-byte aligned): for cuBLAS. */
int k_dequant_q(int type, const uint8_t *W, uint16_t *out, int rows, int in, cudaStream_t s);
/* k_embed over a table kept in its blocks (W [vocab, hidden] of type `type`, hidden a
 * multiple of the block's elements): each row decoded and rounded to bf16, so the
 * result equals k_embed over the table dequantized to bf16 at load. */
int k_embed_q(int type, const uint8_t *W, const int32_t *tokens, float *out, int n, int hidden, int vocab,
              cudaStream_t s);
/* The same product for any n on tensor cores, the weights decoded tile by tile into shared
 * memory (kernels/gemm_q.cu): Y [n, out] (+)= X [n, in] . W^T, in a multiple of the
 * block's elements, X 16-byte aligned, W 16-byte aligned for Q4_K / Q5_K and 2-byte
 * aligned for the other types. ws (16-byte
 * aligned, may be NULL): a workspace of ws_bytes for partial sums when the reduction is
 * split (few output tiles), added in a fixed order: the same bits on every run. */
int k_gemm_q(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
             float *ws, size_t ws_bytes, cudaStream_t s);
int k_gemm_q_ld(int type, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                int accumulate, float *ws, size_t ws_bytes, cudaStream_t s);   /* (k_gemv_q_ld) */

/* Fused forms of the decode GEMV for n <= K_GEMV_FUSED_MAX_N rows (small decode batches and
 * verify steps: they take kernels off the per-token chain). Same shape rules as k_gemv_bf16
 * (in % 8 == 0, W and X 16-byte aligned); -1 when they do not hold. nin as above (NULL:
 * X is the normalised input).
 *
 * k_gemv_gated_bf16: W [2F, in] is the fused gate|up matrix; act [n, F] bf16 =
 *   bf16(silu(W[o] . x) * (W[F + o] . x)) -- gate|up and SiLU-and-mul in one pass.
 *   act must not alias X.
 * k_gemv_qkv_rope: W [(H + 2KVH) * D, in], the fused QKV GEMV with k_qkv_rope_kv's work
 *   done in its epilogue (no q/k norm): a warp computes the rotate_half pair (i, i + D/2)
 *   of a head, adds bias (may be NULL), rotates q and k, writes q to q_out [n, H, D] fp32
 *   and k, v into the paged pool (token t at slot g->tok_slot[t], position
 *   lens + g->tok_j[t]). */
#define K_GEMV_FUSED_MAX_N 8
int k_gemv_gated_bf16(const uint16_t *W, const uint16_t *X, uint16_t *act, int F, int in, int n,
                      const k_norm_in *nin, cudaStream_t s);
int k_gemv_qkv_rope(const uint16_t *W, const uint16_t *X, const float *bias, const float *inv_freq,
                    float *q_out, int n, int H, int KVH, int D, int in, const k_kv_geom *g,
                    const k_norm_in *nin, cudaStream_t s);

/* A weight matrix of the decode GEMVs: bf16 [out, in] (scale NULL), or FP8 E4M3 bytes
 * [out, in] with one fp32 scale per row (--dtype fp8, FP8 checkpoints): the dots are taken
 * on the exact E4M3 values (fp32 FMAs, or bf16 mma at 3..8 rows) and multiplied by the
 * row's scale before the epilogue. The _w forms take either; the _bf16 ones are theirs
 * with a bf16 matrix. */
typedef struct {
    const void *w;
    const float *scale;
} k_wmat;
int k_gemv_w(k_wmat W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
             const k_norm_in *nin, const k_norm_out *nout, cudaStream_t s);
int k_gemv_gated_w(k_wmat W, const uint16_t *X, uint16_t *act, int F, int in, int n, const k_norm_in *nin,
                   cudaStream_t s);
int k_gemv_qkv_rope_w(k_wmat W, const uint16_t *X, const float *bias, const float *inv_freq, float *q_out, int n,
                      int H, int KVH, int D, int in, const k_kv_geom *g, const k_norm_in *nin, cudaStream_t s);

/* FP8 (kernels/fp8.cu). k_quant_fp8_rows: each row of X [rows, cols] bf16 (16-byte
 * aligned, cols % 8 == 0) to E4M3 Q [rows, cols] (8-byte aligned) and scale [rows]: the
 * bytes of engine/model/fp8.c's fp8_quantize_row (scale max|x| / 448, 1 for a zero row).
 * k_fp8_scale_rows: Y [n, out] = (accumulate ? Y : 0) + sw[o] * sx[t] * T[t, o], the
 * rescaling of an FP8 GEMM run with unit scales (out % 4 == 0; T, sw, Y 16-byte aligned).
 * -1 on bad arguments. */
int k_quant_fp8_rows(const uint16_t *X, int rows, int cols, uint8_t *Q, float *scale, cudaStream_t s);
int k_fp8_scale_rows(const float *T, const float *sw, const float *sx, float *Y, int n, int out, int accumulate,
                     cudaStream_t s);
/* The producers that quantize as they write (bytes and scales equal to the separate
 * kernels followed by k_quant_fp8_rows), so the FP8 GEMMs of a layer follow each other
 * with no quantize or rescale launch between them:
 * k_rmsnorm_fp8: with T (an unscaled FP8 GEMM's output [n, hidden]; NULL: none) first
 *   resid += T * sw[o] * sx[t] as k_fp8_scale_rows adds it, then k_rmsnorm(resid, w)'s
 *   bf16 values to E4M3 Q [n, hidden] and scale [n]. hidden % 4 == 0; T, sw, resid, w
 *   16-byte aligned, Q 4-byte aligned.
 * k_gated_mul_fp8q: k_gated_mul_fp8's bf16 products of gu [n, 2 ffn] (scales sw [2 ffn],
 *   sx [n]) to E4M3 Q [n, ffn] and scale [n]; 2 ffn bytes of shared memory a row, at
 *   most K_GATED_FP8Q_MAX_SMEM.
 * sx may be the same buffer as scale (each row reads its token scale before writing its
 * new one). -1 on bad arguments. */
#define K_GATED_FP8Q_MAX_SMEM (96 * 1024)
int k_rmsnorm_fp8(const float *T, const float *sw, const float *sx, float *resid, const float *w, int n, int hidden,
                  float eps, uint8_t *Q, float *scale, cudaStream_t s);
int k_gated_mul_fp8q(const float *gu, const float *sw, const float *sx, int n, int ffn, int gelu, uint8_t *Q,
                     float *scale, cudaStream_t s);

/* One sparse logit adjustment of k_sample_params.adj: a logit_bias entry (v = the bias),
 * a suppressed id (v unused) or a token statistic (v = its count among generated tokens,
 * as a float). k_sample overwrites v with the logit it replaced, to put the row back. */
typedef struct {
    int32_t id;
    float v;
} k_logit_adj;

/* Top logprobs k_sample reports per row at most (the stride of its top outputs). */
#define K_MAX_TOP 20

/* Per-row sampling parameters (same meaning as runner_sampling). */
typedef struct {
    float temperature;     /* <= 0: greedy argmax */
    float top_p, min_p;
    int top_k;
    uint64_t seed, counter;
    /* Logit adjustments before everything above, in device memory: adj[0, n_bias) bias
     * entries, then n_suppress suppressed ids, then n_stats token statistics (distinct
     * ids). NULL: none. The arithmetic is engine/core/sample.c's, operation for operation
     * and rounded the same (no fused multiply-add):
     *   x[id] += v for each bias entry, in order;  x[id] = -inf for each suppressed id;
     *   for each statistic: x = x > 0 ? x / repetition : x * repetition when repetition
     *   > 0 and != 1, then x -= frequency * count + presence when count > 0. */
    k_logit_adj *adj;
    int n_bias, n_suppress, n_stats;
    float presence, frequency, repetition;
    /* NULL, or where in device memory the token this row was fed is (under async
     * scheduling the one the op before sampled, missing from the statistics): it counts
     * once more, and the statistics' last entry is a placeholder for it (the kernel writes
     * its id, or -1 when it applies nothing). */
    const int32_t *fed;
    int n_top;             /* top logprobs wanted, 0..K_MAX_TOP */
    /* force != 0: the row's token is force_tok (in [0, vocab)), not drawn; no adjustments
     * are applied (a prompt position whose logprob is wanted) */
    int force;
    int32_t force_tok;
} k_sample_params;

/* For each row r of logits [n, vocab] fp32: the row's logit adjustments (p.adj), then
 * greedy argmax (temperature <= 0) or a draw from softmax(logits / T) restricted by
 * top_k, then top_p (on the renormalised top-k distribution), then min_p (relative to the
 * most likely token), using Philox4x32-10 keyed by seed at counter; then the row is put
 * back as it was (the adjustments undone from the values their entries saved). out_tok
 * [n]; out_logprob [n] (may be NULL) gets the log softmax of the logits as given (before
 * the adjustments) at the chosen token; out_top_ids / out_top_lps [n, K_MAX_TOP] (may be
 * NULL) get the first min(p.n_top, vocab) of the row's largest logprobs of that
 * distribution, descending, ties to the lower id (engine/core/sample.c
 * sample_top_logprobs). One block per row; the top ids come from a radix select of the
 * n_top-th largest key and a block-wide scan in index order, without sorting the row.
 * out_rank [n] (may be NULL): for rows with p.force, 1 + the ids whose logit is larger
 * than the forced token's (other rows' entries are left as they are). */
int k_sample(float *logits, int n, int vocab, const k_sample_params *p, int32_t *out_tok, float *out_logprob,
             int32_t *out_top_ids, float *out_top_lps, int32_t *out_rank, cudaStream_t s);
/* k_sample with grammar masks (k_mask_logits's layout, [n, (vocab + 31) / 32] words): a row
 * with has[r] != 0 samples only among the tokens whose bit is set (the others are left at
 * -inf in logits, as k_mask_logits leaves them), while its logprob and top logprobs are of
 * its logits as given, before the mask and the adjustments, like every other row's
 * (runner.masked_raw_logprobs). mask NULL: k_sample. */
int k_sample_masked(float *logits, int n, int vocab, const k_sample_params *p, const uint32_t *mask,
                    const int32_t *has, int32_t *out_tok, float *out_logprob, int32_t *out_top_ids,
                    float *out_top_lps, int32_t *out_rank, cudaStream_t s);
/* k_sample's first step alone, left applied (for tests): each row's adjustments in place;
 * their entries' v then hold the values they replaced. */
int k_logit_adjust(float *logits, int n, int vocab, const k_sample_params *p, cudaStream_t s);

/* The distribution k_sample draws from for each row of logits [n, vocab]: probs[r, :] =
 * the renormalised softmax(logits / T) after top_k, top_p, min_p (0 outside). Row r uses
 * p[r / rows_per_param]; rows whose parameters are greedy are not written. probs may be
 * logits (in place). */
int k_probs(const float *logits, float *probs, int n, int vocab, const k_sample_params *p,
            int rows_per_param, cudaStream_t s);

/* Speculative step (kernels/spec.cu), B rows, k drafts each; see engine/core/runner.h.
 * k_spec_prep: for rows whose slot != dummy, lens[slot*2+1] = lens[slot*2] - 1; fills
 * tok_slot2 [2B] and tok_slotv [B(k+1)] with each row's slot (token -> slot maps of the
 * draft's 2-token pass and the verify pass). */
int k_spec_prep(int32_t *lens, const int32_t *slots, int B, int k, int dummy,
                int32_t *tok_slot2, int32_t *tok_slotv, cudaStream_t s);
/* A speculative step queued behind the one before (runner_spec_batch.prev_row): for rows
 * with prev[i] >= 0, tokens[2i], tokens[2i+1] = the last two tokens of row prev[i] of that
 * step (its outputs prev_out [*, K1] and prev_n, and its fed last token, prev_vtok[pr * K1])
 * and par[i].counter += its m. Other rows unchanged. */
int k_spec_feed_prev(int32_t *tokens, k_sample_params *par, const int32_t *prev, const int32_t *prev_out,
                     const int32_t *prev_n, const int32_t *prev_vtok, int K1, int n, cudaStream_t s);
/* vtok [B(k+1)]: row i is in_tokens[2i+1] then drafts[j*ld + i] for j < k. */
int k_spec_verify_tokens(const int32_t *in_tokens, const int32_t *drafts, int B, int k, int ld,
                         int32_t *vtok, cudaStream_t s);
/* Draft token j of each row: argmax of logits [B, vocab] for greedy rows, else a draw
 * from q [B, vocab] (probabilities from k_probs) at philox(seed ^ salt_draft, counter + j). */
int k_spec_draft_pick(const float *logits, const float *q, int B, int vocab,
                      const k_sample_params *params, int j, uint64_t salt_draft, int32_t *out,
                      cudaStream_t s);
/* Acceptance, then the length advance. tl [B(k+1), vocab]: target logits (greedy rows)
 * or probabilities (sampled rows); q [k][ldq][vocab] draft probabilities; drafts
 * [k][ldd]. Greedy: longest prefix of drafts equal to the target's argmax, then the
 * target's argmax. Sampled: rejection sampling (accept test j at philox(seed ^
 * salt_accept, counter + j), the one final draw at philox(seed, 2 * counter)).
 * out_tok [B, k+1], out_n [B] = accepted + 1. For rows whose slot != dummy, with L the
 * target length before the step: target length = L + out_n, draft = min(L + k, that). */
int k_spec_accept(const float *tl, const float *q, int B, int vocab, int k, int ldq,
                  const int32_t *drafts, int ldd, const k_sample_params *params,
                  const int32_t *slots, int dummy, uint64_t salt_accept, int32_t *lens,
                  int32_t *out_tok, int32_t *out_n, cudaStream_t s);

/* Verify of drafts proposed outside the runner (runner_verify_batch, engine/core/runner.h),
 * B rows of K1 = k + 1 tokens each. k_verify_prep: tok_slot [B*K1] = each row's slot.
 * k_verify_accept: tl [B*K1, vocab] target logits (greedy rows) or probabilities (sampled
 * rows, k_probs in place); tokens [B, K1] the fed token then the drafts; row i accepts
 * among its first n_drafts[i] drafts as point masses (engine/core/spec.h
 * spec_accept_point): x_j, the argmax of position j or its draw at philox(seed, counter +
 * j) (the decode sampler's uniform for that output position), and draft j stands while
 * x_j == d_j; the first x_j that differs, or x_nd, is the row's last token. out_tok [B, K1],
 * out_n [B] = accepted + 1; rows whose slot != dummy get target length += out_n. */
int k_verify_prep(const int32_t *slots, int B, int K1, int32_t *tok_slot, cudaStream_t s);
int k_verify_accept(const float *tl, int B, int vocab, int K1, const int32_t *tokens,
                    const int32_t *n_drafts, const k_sample_params *params, const int32_t *slots,
                    int dummy, int32_t *lens, int32_t *out_tok, int32_t *out_n, cudaStream_t s);

/* Async decode steps: tokens[i] = prev_out[prev[i]] where prev[i] >= 0 (the token the
 * step before sampled in that row, without a trip through the host); others unchanged. */
int k_feed_prev(int32_t *tokens, const int32_t *prev, const int32_t *prev_out, int n, cudaStream_t s);

/* lens[row_slot[r]*2 + which] += row_n[r] for each row whose slot != dummy. Callers then
 * zero the dummy slot's lengths with a captured memset. */
int k_advance_lens(int32_t *lens, const int32_t *row_slot, const int32_t *row_n, int n,
                   int which, int dummy, cudaStream_t s);

/* The uniform in [0, 1) that k_sample draws for (seed, counter): exported for tests. */
float k_philox_uniform_host(uint64_t seed, uint64_t counter);

/* Device fills for tests and benchmarks: uniform in [-scale, scale) from (seed, index). */
int k_fill_uniform_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale, cudaStream_t s);
int k_fill_uniform_f32(float *dst, size_t n, uint64_t seed, float lo, float hi,
                       cudaStream_t s);
/* Slices of one random tensor: the rows x cols block at (row0, col0) of a matrix with
 * full_cols columns gets the values the whole matrix's fill gives there (so a tensor-
 * parallel shard holds its slice of the unsharded tensor); f32: elements offset.. of a
 * vector. */
int k_fill_uniform_bf16_slice(uint16_t *dst, size_t rows, size_t cols, size_t row0, size_t col0,
                              size_t full_cols, uint64_t seed, float scale, cudaStream_t s);
int k_fill_uniform_f32_at(float *dst, size_t n, size_t offset, uint64_t seed, float lo, float hi,
                          cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
