/* Internals of the CUDA runner shared by engine/cuda/cuda_runner.c (life cycle, slots, ops),
 * engine/cuda/cuda_weights.c (weight upload) and engine/cuda/cuda_step.c (forward pass, decode
 * step, graphs). Plain C11; device work goes through the launchers in kernels/.
 *
 * Storage: weights bf16, residual stream fp32, GEMM outputs fp32 (cuBLAS, bf16 in, fp32
 * accumulate), GEMM inputs bf16. KV pool bf16 (or FP8 E4M3 with --kv-cache-dtype fp8), block-major (see kernels/specd_kernels.h).
 * With FP8 projections (--dtype fp8, FP8 checkpoints) a layer's Q|K|V, O, gate|up and down
 * hold E4M3 bytes with a scale per row (engine/cuda/cuda_fp8.c). */
#ifndef SPECD_CUDA_INTERNAL_H
#define SPECD_CUDA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "engine/cuda/cuda_runner.h"
#include "engine/core/runner.h"
#include "kernels/specd_kernels.h"

/* A projection kept in its GGUF block format on the device (--dtype gguf / auto;
 * work in progress): type 0 means the layer's bf16 matrix is used instead. */
typedef struct {
    uint8_t *w;          /* rows x row_bytes, logical row order */
    int type;            /* ggml type id (kernels/quant_blocks.h), 0: not quantized */
    int rows, cols;
    /* Rows in two types (a Q4_K_M file's Q|K in Q4_K, V in Q6_K): rows [0, rows1) are of
     * type at w, rows [rows1, rows) of type2 at w + off2 (16-byte aligned); type2 0: one
     * type, rows1 == rows. */
    int rows1, type2;
    size_t off2;
} cuda_qmat;

typedef struct {
    uint16_t *wqkv;      /* (H+2KVH)*D, hidden: q rows, then k rows, then v rows */
    float *bqkv;         /* (H+2KVH)*D or NULL (Qwen2 bias) */
    float *q_norm;       /* D or NULL (Qwen3) */
    float *k_norm;       /* D or NULL */
    uint16_t *wo;        /* hidden, H*D */
    float *attn_norm;    /* hidden */
    float *ffn_norm;     /* hidden */
    uint16_t *wgu;       /* 2*ffn, hidden: gate rows, then up rows */
    uint16_t *wdown;     /* hidden, ffn */
    float *post_attn_norm, *post_ffn_norm;  /* hidden, or NULL (Gemma 3's sandwich norms) */
    const float *inv_freq; /* this layer's rotary frequencies: the model's global or local */
    /* mixture of experts (c.n_experts > 0; wgu / wdown are then NULL) */
    uint16_t *router;    /* n_experts, hidden */
    uint16_t *exp_gu;    /* n_experts x [2*ffn, hidden]: each expert's gate rows, then up rows (ffn:
                          * this rank's share of moe_ffn) */
    uint16_t *exp_down;  /* n_experts x [hidden, ffn] */
    int window;          /* sliding window of this layer, 0: full attention */
    cuda_qmat qqkv, qo, qgu, qdown;   /* quantized forms (then the bf16 pointer is NULL) */
    /* FP8 projections: when a scale array [rows] is set, the matching pointer above
     * (wqkv / wo / wgu / wdown) holds [rows, cols] E4M3 bytes, not bf16 */
    float *sqkv, *so, *sgu, *sdown;
} cuda_layer;

typedef struct {
    int loaded;
    model_config c;
    int H, KVH, D, ffn;  /* this rank's share of heads / intermediate */
    int pool_layer0;     /* first pool layer of this model */
    uint16_t *embed;     /* vocab, hidden; NULL when qembed holds the table */
    uint16_t *lm_head;   /* vocab_rows, hidden; == embed when tied and not split; NULL when
                          * qlm holds it */
    /* --dtype gguf on one GPU: the token embedding and the output matrix in their blocks
     * (qlm.w == qembed.w when tied); type 0: the bf16 pointers above */
    cuda_qmat qembed, qlm;
    int vocab_parts;     /* set before loading: 1, or world to split lm_head by vocabulary */
    int vocab_rows, vocab_row0;   /* this rank's lm_head rows: [vocab_row0, + vocab_rows) */
    float *out_norm;     /* hidden */
    float *inv_freq;     /* D/2 */
    float *inv_freq_local; /* D/2, sliding layers' frequencies (Gemma 3), or NULL */
    int plain;           /* 1: Gemma-style layers (sandwich norms, GELU, scales) or projections
                          * kept in GGUF blocks: the unfused kernels only */
    cuda_layer *layers;  /* n_layers (host array of device pointers) */
    size_t q_scratch;    /* elements of the largest quantized projection (its bf16 copy) */
    int fp8;             /* the dense projections are FP8 (cuda_layer.s*) */
    int moe_one;         /* experts, tune.moe_one and k_moe_decode1_fits: one-token MoE layers in one launch */
    size_t weight_bytes;
} cuda_model;

/* Passes of up to cuda_tuning.gemv_rows token rows (default CUDA_GEMV_DEFAULT_ROWS, at most
 * CUDA_GEMV_MAX_ROWS: the fold buffers' size) run their projections on kernels/gemv.cu's
 * GEMV and its fused epilogues; larger ones on cuBLAS. */
#define CUDA_GEMV_MAX_ROWS 8
#define CUDA_GEMV_DEFAULT_ROWS 2

/* Device arrays describing one forward pass (all device pointers). */
typedef struct {
    int which, n_tok, n_rows;
    const int32_t *tokens, *tok_slot, *tok_j;
    const int32_t *row_slot, *row_tok_off, *row_n_new;
    const int32_t *item_row, *item_q0;
    int n_items, qt, n_splits, split_len;
    int gemv_rows;   /* passes of up to this many tokens on the GEMV (0: tune.gemv_rows); the
                      * logits that follow the pass use it too (cuda_runner.gemv_rows_now) */
} cuda_pass;

/* Offsets (in int32 units) of the per-pass metadata inside meta buffers of T entries. */
enum { META_TOKENS, META_TOK_SLOT, META_TOK_J, META_ROW_SLOT, META_ROW_TOK_OFF,
       META_ROW_N_NEW, META_ITEM_ROW, META_ITEM_Q0, META_LOGIT_ROWS, META_PREV, META_N };

/* Every switch of the CUDA runner, read from the environment once at creation
 * (cuda_tuning_read) and passed down from here; the kernels' part goes to k_set_tuning.
 * Switches that make results wrong exist only in a debug build (make DEBUG=1). */
typedef struct {
    int no_fuse;             /* SPECD_CUDA_NO_FUSE=1: the batch-1/2 path without its fused epilogues */
    int no_fuse_norm;        /* SPECD_CUDA_NO_FUSE_NORM=1: ... with its RMSNorm kernels (the rest fused) */
    int no_gemv;             /* SPECD_CUDA_NO_GEMV=1: decode-sized GEMMs on cuBLAS (to bisect numerics) */
    int quant_weights;       /* from runner_config.weights_gguf (--dtype), not the environment:
                              * GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K projections stay in their blocks (one GPU) */
    int fp8_weights;         /* runner_config.weights_fp8 (--dtype fp8): 1 quantize the dense
                              * projections at load, 0 keep an FP8 checkpoint's, -1 bf16 */
    int gemv_rows;           /* SPECD_CUDA_GEMV_ROWS=N (1..CUDA_GEMV_MAX_ROWS): passes of up to N token
                              * rows on kernels/gemv.cu, fused (decode batches, verify steps) */
    int spec_async;          /* SPECD_CUDA_SPEC_ASYNC=0: runner.spec_async off, each speculative
                              * step op synchronous (default 1: queued in flight, chained) */
    int verify_gemv;         /* SPECD_CUDA_VERIFY_GEMV: a verify pass of B rows whose decode step
                              * runs on the GEMV (B <= gemv_rows), all its tokens fitting it (at
                              * most CUDA_GEMV_MAX_ROWS), may run as that decode step would, token
                              * by token: the GEMV's FMA form (each token's dot in the same order
                              * as at one token), one attention item per token, the decode step's
                              * key splits; its tokens then get the decode step's bits (greedy
                              * speculation emits what plain decoding would). 1: where the
                              * captured step timed at most 3% slower than the cuBLAS form at
                              * start-up (default; on an H100 the decode form timed faster at
                              * k 1-4 for SmolLM2-135M, at k 1-2 for the 8B shape); 2:
                              * always; 0: never */
    /* SPECD_CUDA_GEMM_Q_ROWS=N, SPECD_CUDA_GEMM_Q_MIN=M (default K_GEMV_QTC_MAX_N + 1): passes
     * of M .. N token rows over GGUF quantized projections on the tensor-core GEMM that
     * decodes the blocks in shared memory (k_gemm_q); N -1, the default: 64 for K-quant
     * matrices of both sides >= 4096, none for the others (gemm_q in cuda_step.c) */
    int gemm_q_rows, gemm_q_min;
    /* SPECD_CUDA_LM_HEAD_BF16=1: a quantized output matrix goes to bf16 at load (as before
     * 2026-12-05) instead of staying in its blocks; the embedding stays in its blocks */
    int lm_head_bf16;
    /* SPECD_CUDA_GEMVQ_TC=N, _TC_MIN=M, _TC_Q6K=1, _TC_Q8=1 (defaults 16, 8, 0, 0): Q4_K / Q5_K
     * passes of M .. N tokens on the tensor-core GEMV k_gemv_qtc, Q6_K / Q8_0 too with
     * _TC_Q6K / _TC_Q8 */
    int gemvq_tc, gemvq_tc_min, gemvq_tc_q6k, gemvq_tc_q8;
    int gemvq_i8;   /* Q8_0 / Q4_0 / Q4_1 GEMV passes of at least this many tokens on k_gemv_qi8 (0: none) */
    int gemvq_i8_k; /* the same for Q4_K / Q5_K / Q6_K */
    int gemm_qi8_rows; /* Q8_0 passes of 9 .. this many tokens on k_gemm_qi8 (0: none) */
    int fp8_chain;  /* FP8 GEMM passes of at least this many tokens chained (cuda_step.c fp8_chain; 0: none) */
    int fp8_fast_accum;   /* SPECD_CUDA_FP8_FAST_ACCUM=1: cuBLASLt's FP8 fast accumulation (cuda_fp8.c) */
    int fp8_tune;   /* SPECD_CUDA_FP8_TUNE: FP8 GEMM candidates timed per decode size (cuda_fp8.c) */
    int attn_x8;    /* SPECD_CUDA_ATTN_X8=0: a rounding launch before an int8 O GEMV instead of attention rounding its output */
    int attn_l2pf;  /* SPECD_CUDA_ATTN_L2PF=P: at batch 1-2 the decode attention asks L2 for the O
                     * projection's weights, up to P% of the L2 (k_attn_work.l2_next; 0: off) */
    int moe_one;    /* SPECD_CUDA_MOE_ONE=1: a one-token MoE layer on one GPU in one launch
                     * (k_moe_decode1) instead of three (off: not yet run on a GPU) */
    int moe_l2pf;   /* SPECD_CUDA_MOE_L2PF=KB: a one-token MoE routing asks L2 for the first KB
                     * of each picked expert's gate and up rows (k_moe_route_buf.l2_gu; 0: off) */
    int gemm_band;           /* SPECD_CUDA_GEMM_BAND=B (1..64; 0 off, the default: first
                              * requests of new lengths faster, some warm ones slower):
                              * bf16 GEMMs of more than B tokens on cuBLASLt with one
                              * algorithm per band of B token counts (engine/cuda/cuda_gemm.c) */
    int fixed_splits;        /* SPECD_CUDA_FIXED_SPLITS=1: decode attention splits sized on the host */
    int verify_item_splits;  /* SPECD_CUDA_VERIFY_ITEM_SPLITS=1: a verify pass run as a decode step
                              * (verify_gemv) splits its keys for its items, as other verify
                              * passes do, not as a decode step of its rows does (to show the
                              * split matters: the exactness test then fails) */
    int no_forward_sampling; /* SPECD_CUDA_NO_FORWARD_SAMPLING=1: composed steps copy logits to the
                              * host and sample there (A/B of runner_batch.sp) */
    int tp_vocab_split;      /* SPECD_TP_VOCAB_SPLIT=0 turns it off: lm_head replicated under TP */
    int tp_shard_draft;      /* SPECD_TP_SHARD_DRAFT=1: the draft split like the target */
    /* SPECD_CUDA_TP_UNRUN_LAYERS=1: tensor parallelism also takes experts and Gemma 3's
     * layers (built, run on the CPU runner; tests/gpu/tp_test.sh sets it for its MoE and
     * Gemma 3 checks until they have passed on two GPUs, after which the switch goes) */
    int tp_unrun_layers;
    /* SPECD_CUDA_PROFILE_STEP=N: the N-th decode step (counted from 1 over this runner's
     * decode steps, start-up ones included) runs between cudaProfilerStart and
     * cudaProfilerStop, so `ncu --profile-from-start off` lists that one step's kernels */
    int profile_step;
    k_tuning k;              /* SPECD_CUDA_PDL=0, SPECD_ATTN_PDL=0|1|2, SPECD_ATTN_SIMT=1, SPECD_ATTN_TILED=1,
                              * SPECD_ATTN_DEC=0|1|2|6|7|8, SPECD_CUDA_GEMVQ_ROWS=2|4, SPECD_SAMPLE_HIST=0 */
    /* debug build only (zero otherwise): results are WRONG, for timing and negative tests */
    int dbg_skip;            /* SPECD_DEBUG_SKIP=norm,qkv,attn,o,gu,down,moe: those stages left out */
    int tp_skip_allreduce;   /* SPECD_DEBUG_TP_SKIP_ALLREDUCE=1: no all-reduces */
    int skip_dummy_reset;    /* SPECD_DEBUG_SKIP_DUMMY_RESET=1: spec graphs keep the dummy slot */
} cuda_tuning;

/* The step input blocks (decode, speculative, verify): head bytes of int32 row arrays, then
 * MB sampling parameters at a 16-byte boundary (their seed and counter are 8-byte fields:
 * the decode block's 12 * MB bytes alone misaligned them for odd MB, e.g. --max-batch 1). */
static inline size_t cuda_par_off(size_t head) { return (head + 15) / 16 * 16; }
static inline size_t cuda_par_block_bytes(size_t head, int MB) {
    return cuda_par_off(head) + (size_t)MB * sizeof(k_sample_params);
}
/* The decode step's: tokens, slots and prev rows (MB each). */
static inline size_t cuda_dec_par_off(int MB) { return cuda_par_off((size_t)MB * 12); }
static inline size_t cuda_dec_in_bytes(int MB) { return cuda_par_block_bytes((size_t)MB * 12, MB); }

/* The device sampler's parameters for a row's runner_sampling. */
static inline k_sample_params cuda_sample_params(const runner_sampling *x) {
    return (k_sample_params){.temperature = x->temperature, .top_p = x->top_p, .min_p = x->min_p,
                             .top_k = x->top_k, .seed = x->seed, .counter = x->counter};
}

/* Fill t from the environment; prints a warning for each debug switch that is on. */
void cuda_tuning_read(cuda_tuning *t, int world);

typedef struct {
    runner base;
    runner_ops ops;      /* base.ops points here: the shared table plus this runner's optional ops */
    cuda_runner_opts opts;
    cuda_tuning tune;
    float *d_lpart, *d_lgather;   /* vocabulary-split lm_head: [LR, V/world], [world, LR, V/world] */
    cuda_model m[2];
    int device, n_sm;
    size_t l2_bytes;   /* the device's L2 (cudaDeviceProp.l2CacheSize) */
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    size_t blas_ws_bytes;

    /* slots */
    int max_blocks, dummy;
    int32_t *d_bt;       /* (max_batch+1) * max_blocks */
    int32_t *d_lens;     /* (max_batch+1) * 2 */
    int32_t *h_bt;       /* host copy of d_bt (pinned) */
    int *h_len;          /* host mirror of d_lens (each op advances it as its kernels
                          * advance the device's, when it is queued) */
    int32_t *h_len_up;   /* (pinned) the dirty lengths as cuda_upload_slots copies them, so
                          * that the mirror can move on while the copies wait on the stream */
    /* Slot changes not yet on the device (cuda_upload_slots, at the start of every op):
     * block-table rows [bt_lo, bt_hi) and the lengths flagged in len_dirty, listed in
     * len_list. Writing a slot costs no device round trip. */
    int bt_lo, bt_hi, n_len_dirty;
    /* runner_config.win_blocks > 0: the window pool's tables (same shape, host copy and
     * dirty rows [btw_lo, btw_hi)) */
    int32_t *d_bt_win, *h_bt_win;
    int btw_lo, btw_hi;
    uint8_t *len_dirty;
    int *len_list;

    /* KV pool */
    int n_pool_layers;
    size_t *layer_off;   /* n_pool_layers: element offset of a layer inside a block of its pool */
    size_t block_elems;
    /* with a window pool (runner.h): which pool layers live there, its block size in
     * elements, its storage and the device cell holding it (as d_pool_pp) */
    unsigned char *in_win;
    size_t win_block_elems;
    uint16_t *d_win_pool;
    uint16_t **d_win_pp;
    /* bytes per pool element: 2 (bf16), or 1 with runner_config.kv_fp8 (E4M3 codes, scaled
     * per pool layer by kv_scale[2 l] for K and kv_scale[2 l + 1] for V); d_pool is then
     * addressed in bytes (cuda_pool_block) */
    int kv_esize;
    float *kv_scale;
    uint16_t *d_pool;
    uint16_t **d_pool_pp;/* one device cell holding d_pool */

    /* workspace, sized for T tokens of the wider model */
    int T;               /* max(max_tokens_per_step, max_batch) */
    int LR;              /* logits rows per lm_head chunk */
    float *d_resid;      /* T, hidden */
    uint16_t *d_xb;      /* T, max(hidden, H*D, ffn) */
    float *d_f32;        /* T, max((H+2KVH)*D, 2*ffn) */
    float *d_q;          /* T, H*D (fp32) */
    float *d_ws_o, *d_ws_ml; /* attention partials: ws_tok_splits * H*D, * H*2 */
    uint16_t *d_act;     /* CUDA_GEMV_MAX_ROWS, ffn: SiLU(gate) * up from the gated GEMV */
    uint16_t *d_xg;      /* CUDA_GEMV_MAX_ROWS, hidden: bf16(h * g), the folded norm's input */
    unsigned long long *d_ss;   /* 2 * layers * CUDA_GEMV_MAX_ROWS: fixed-point sums of h^2 per folded norm, per pass */
    int ss_layers;       /* layers d_ss holds (the deeper model) */
    unsigned *d_counts;  /* T * KVH zeroed counters, one per attention (item, KV head):
                            the last split block merges; kernels leave them zero */
    size_t ws_tok_splits;
    /* mixture of experts (either model has experts): router logits [T, E], choices and
     * weights [T, K], per-expert counts [E] and row lists [E, T], activations [T*K, F']
     * bf16, expert outputs [T*K, hidden] fp32 */
    float *d_moe_lg, *d_moe_w, *d_moe_out;
    int32_t *d_moe_ids, *d_moe_rows;
    int32_t *d_moe_cnt;   /* [2 E + 3]: the fused routing's done counter, counts [E], active [1 + E],
                           * k_moe_decode1's barrier counter */
    float *d_moe_part;    /* k_moe_decode1's partial sums (with tune.moe_one) */
    unsigned *d_moe_bar;  /* k_moe_decode1's barrier counter: d_moe_cnt[2 E + 2] of the model
                           * with the most experts (past both models' lists) */
    uint16_t *d_moe_act;
    float *d_logits;     /* LR, vocab */
    uint16_t *d_qscratch;/* bf16 copy of one quantized projection, for passes past the GEMV,
                          * or k_gemm_q's split partial sums */
    size_t qscratch_bytes;
    /* FP8 GEMMs (engine/cuda/cuda_fp8.c; either model with FP8 projections): activations
     * quantized per token [T, xbw] E4M3 and their scales [T]; cuBLASLt and its plans per
     * shape; without cuBLASLt's per-row scale vectors (lt_outer 0) the unscaled products
     * of up to CUDA_FP8_CHUNK tokens go through d_f8tmp [CUDA_FP8_CHUNK, widest out] */
    uint8_t *d_xq;
    float *d_xs, *d_f8tmp;
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t lt_desc;
    int lt_outer;
    struct cuda_fp8_plan *fp8_plans;
    /* plans made while fp8_tune_now is set (the eager run of a decode size before its graph
     * is captured) time the heuristic's first candidates and keep the fastest; d_fp8_tune
     * is their scratch output, freed when the graphs are captured */
    int fp8_tune_now;
    float *d_fp8_tune;
    size_t fp8_tune_bytes;
    int fp8_tuned, fp8_tune_changed;
    double fp8_tune_us[2];   /* the changed plans: their heuristic picks' us, the chosen ones' */
    /* bf16 GEMMs by bands of token counts (engine/cuda/cuda_gemm.c; tune.gemm_band) */
    cublasLtHandle_t gemm_lt;
    cublasLtMatmulDesc_t gemm_desc;
    struct cuda_gemm_plan *gemm_plans;
    long gemm_lt_plans, gemm_lt_calls;   /* plans made, cuBLASLt GEMMs run (for tests) */
    int32_t *d_meta, *h_meta;  /* META_N * T int32, pinned host copy */
    int32_t *d_iota, *d_zeros, *d_ones;  /* T each: static graph inputs */
    size_t work_bytes;

    /* decode step: static inputs/outputs for max_batch rows */
    int dec_splits, dec_split_len;
    int gemv_rows_now;           /* the latest pass's GEMV bound (cuda_pass.gemv_rows) */
    void *d_dec_in, *h_dec_in;     /* tokens[MB] int32 | slots[MB] int32 | prev[MB] int32 | sp[MB]
                                    * (prev: runner_decode_batch.prev_row, -1 for none) */
    void *d_dec_out, *h_dec_out;   /* tok[MB] int32 | logprob[MB] float (host: two of them) */
    int32_t *h_dec_top_ids;        /* [2][MB, K_MAX_TOP] decode top logprobs (host) */
    float *h_dec_top_lps;
    /* Ops queued and not yet waited for (at most two; runner.decode_async, decodes and
     * async forwards): each copies its outputs into its half of h_dec_out / h_dec_top_*,
     * then records ev_out; an async one records ev_in once its inputs are on the device,
     * and every host write to pinned memory an op copies from (slot tables, lengths,
     * decode inputs, metadata, logit adjustments) first waits for the latest one
     * (cuda_dec_inputs_done). */
    struct cuda_dec_pending {
        runner_decode_batch b;   /* the caller's out_* arrays and n */
        int half, want_top;
        int *spec_n;             /* a speculative step's out_n (its tokens: b.out_tokens; its
                                  * slots: sp_pslots' half; cuda_spec_wait): non-NULL */
    } dpend[2];
    int n_dpend, dpend_head, dec_half;
    int n_decode_steps;      /* decode steps queued so far (tune.profile_step counts them) */
    cudaEvent_t ev_in[2], ev_out[2];
    void *d_fs_par, *h_fs_par;     /* eager forward sampling: k_sample_params [T] */
    int32_t *d_fs_tok, *h_fs_tok;  /* its tokens [T] */
    float *d_fs_lp, *h_fs_lp;      /* and their logprobs [T] */
    int32_t *d_fs_rank, *h_fs_rank;/* forced rows' ranks [T] (runner_batch.out_ranks) */
    uint32_t *d_fs_mask, *h_fs_mask; /* grammar masks of sampled rows [max_batch][vocab/32] */
    int32_t *d_fs_has, *h_fs_has;  /* which of them have one [max_batch] */
    /* on-device sampling of either kind: the step's logit adjustments (k_sample_params.adj
     * points into d_adj; staged in h_adj, copied before the launch or graph replay; both
     * grow, doubling, when a step needs more: graphs read them through the parameters),
     * and the top logprobs of sampled rows [T, K_MAX_TOP] */
    k_logit_adj *d_adj, *h_adj;
    size_t adj_cap;
    int32_t *d_top_ids, *h_top_ids;
    float *d_top_lps, *h_top_lps;
    int n_graphs;
    int graph_sizes[64];
    cudaGraphExec_t graphs[64];
    /* the same step for constrained rows, split where the host's masks go in: [0] the pass
     * to the logits, [1] mask, sample and advance (per graphs[] size, captured on first use) */
    cudaGraphExec_t mgraphs[64][2];
    size_t graph_bytes;

    /* speculative step (engine/cuda/cuda_spec.c), allocated when a draft and k > 0 are given */
    int sp_k;                      /* k the spec graphs were captured for (0: none) */
    void *d_sp_in, *h_sp_in;       /* tokens[2MB] | slots[MB] | prev[MB] | params[MB] */
    void *d_sp_out, *h_sp_out;     /* tok[MB(k+1)] | n[MB] (host: one per dec_half) */
    int *sp_pslots;                /* [2][MB] the slots of the step in each half */
    int sp_last_rows;              /* rows of the latest speculative step, whose outputs stay
                                    * in d_sp_out for a next one's prev_row; 0 once another
                                    * sampling op (decode, forward) has run */
    int32_t *d_sp_i32;             /* per-step and layout int arrays, see cuda_spec.c */
    float *d_sp_tl;                /* MB(k+1), vocab: target logits / probabilities */
    float *d_sp_q;                 /* k, MB, vocab: draft probabilities (sampled rows) */
    int sp_n_graphs;
    int sp_graph_sizes[64];
    cudaGraphExec_t sp_graphs[64];

    /* verify of drafts proposed outside the runner (cuda_spec.c), allocated without a draft
     * model when k > 0: graphs per (padded batch size <= vf_mb, k in 1..vf_k) */
    int vf_k, vf_mb;
    void *d_vf_in, *h_vf_in;       /* tokens[vf_mb(vf_k+1)] | slots | n_drafts [vf_mb] | params */
    void *d_vf_out, *h_vf_out;     /* tok[vf_mb(vf_k+1)] | n[vf_mb] */
    int32_t *d_vf_i32;             /* per k: the pass's fixed layout; then tok_slot */
    float *d_vf_tl;                /* vf_mb(vf_k+1), vocab: target logits / probabilities */
    int vf_n_graphs;
    int vf_graph_b[256], vf_graph_k[256];
    cudaGraphExec_t vf_graphs[256];
    /* [B][k]: the verify step of B rows of k drafts runs as a decode step would
     * (verify_as_decode, exact greedy), chosen at capture where it timed no slower */
    unsigned char vf_vd[CUDA_GEMV_MAX_ROWS + 1][CUDA_GEMV_MAX_ROWS];
    float vf_vd_ms[CUDA_GEMV_MAX_ROWS + 1][CUDA_GEMV_MAX_ROWS][2];   /* [..][0] cuBLAS form, [1] decode form */

    int failed;
    char errmsg[512];
} cuda_runner;

/* Rows a verify step takes at most (its logits buffer is rows x (k+1) x vocab floats). */
#define CUDA_VERIFY_MAX_ROWS RUNNER_VERIFY_MAX_ROWS

/* Record a CUDA / cuBLAS failure (file, line, call, text) and mark the runner failed. */
void cuda_fail(cuda_runner *r, const char *file, int line, const char *what, const char *msg);

#define CU_CHECK(r, call)                                                                  \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            cuda_fail((r), __FILE__, __LINE__, #call, cudaGetErrorString(e_));             \
            goto fail;                                                                     \
        }                                                                                  \
    } while (0)

#define BLAS_CHECK(r, call)                                                                \
    do {                                                                                   \
        cublasStatus_t s_ = (call);                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
            cuda_fail((r), __FILE__, __LINE__, #call, cublasGetStatusString(s_));          \
            goto fail;                                                                     \
        }                                                                                  \
    } while (0)

/* Kernel launchers return 0, a cudaError_t, or -1 for bad dims. */
#define K_CHECK(r, call)                                                                   \
    do {                                                                                   \
        int k_ = (call);                                                                   \
        if (k_ != 0) {                                                                     \
            cuda_fail((r), __FILE__, __LINE__, #call,                                      \
                      k_ < 0 ? "bad launch dimensions" : cudaGetErrorString((cudaError_t)k_)); \
            goto fail;                                                                     \
        }                                                                                  \
    } while (0)

/* engine/cuda/cuda_weights.c */
int cuda_model_load(cuda_runner *r, cuda_model *cm, const model *m, int rank, int world,
                    char *err, size_t errlen);
void cuda_model_free(cuda_model *cm);
size_t cuda_qmat_bytes(const cuda_qmat *q);   /* device bytes of a quantized matrix (0: type 0) */

/* One cuBLASLt plan: the layouts of D = A^T B (A [in, out]: the weights as stored, of type
 * ab; B [in, n]: the activations, of type ab; C = D [out, n] fp32, column stride ldc) and
 * the heuristic's first algorithm for them under desc. cuda_lt_plan_make returns 0, or -1
 * (no algorithm, or a cuBLASLt error) with nothing held; release frees the layouts. The
 * banded bf16 GEMM (cuda_gemm.c) and the FP8 GEMM (cuda_fp8.c) keep tables of them. */
typedef struct {
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} cuda_lt_plan;
int cuda_lt_plan_make(const cuda_runner *r, cublasLtHandle_t lt, cublasLtMatmulDesc_t desc, cudaDataType_t ab,
                      int out, int in, int n, int ldc, cuda_lt_plan *p);
void cuda_lt_plan_release(cuda_lt_plan *p);
/* bf16 GEMM past the GEMV (engine/cuda/cuda_gemm.c): Y [n, out] (row stride ldy) = X [n, in]
 * . W [out, in]^T (+ Y where beta is 1), on cuBLAS, or cuBLASLt by bands (tune.gemm_band). */
int cuda_gemm_init(cuda_runner *r);
void cuda_gemm_free(cuda_runner *r);
int cuda_gemm_bf16(cuda_runner *r, const uint16_t *W, int out, int in, const uint16_t *X, int n, float *Y, int ldy,
                   float beta);

/* engine/cuda/cuda_fp8.c: cuBLASLt and the FP8 buffers (after the models are loaded:
 * xbw = the widest GEMM input, outw = the widest output, T tokens), release, and
 * Y [n, out] = beta * Y + X [n, in] . W^T for FP8 W [out, in] with row scales sw: the
 * activations quantized per token, an E4M3 GEMM with fp32 accumulation. */
#define CUDA_FP8_CHUNK 1024
int cuda_fp8_init(cuda_runner *r, size_t xbw, size_t outw, int T);
void cuda_fp8_free(cuda_runner *r);
int cuda_fp8_gemm(cuda_runner *r, const uint8_t *W, const float *sw, int out, int in, const uint16_t *X, int n,
                  float *Y, float beta);
/* The same GEMM leaving Y = the unscaled products and d_xs the token scales, for a consumer
 * that applies sw[o] * d_xs[t] itself (k_gated_mul_fp8): 0 done, 1 not this form (few
 * tokens, widths off cuBLASLt's grid, or cuBLASLt scales by itself: use cuda_fp8_gemm),
 * or an error. */
int cuda_fp8_gemm_unscaled(cuda_runner *r, const uint8_t *W, int out, int in, const uint16_t *X, int n, float *Y);
/* Whether the unscaled form runs for n tokens over [out, in] (cuda_fp8_gemm_unscaled's test),
 * and the unscaled products Y [n, out] of d_xq's E4M3 rows (X NULL: left there with their
 * token scales in d_xs by k_rmsnorm_fp8 / k_gated_mul_fp8q; else X quantized into them
 * first) and W, CUDA_FP8_CHUNK tokens a call where chunked (as cuda_fp8_gemm splits them,
 * so the products are the same bits as its own before its rescale). */
int cuda_fp8_chain_ok(const cuda_runner *r, int n, int out, int in);
void cuda_fp8_tune_done(cuda_runner *r);
int cuda_fp8_gemm_raw(cuda_runner *r, const uint8_t *W, int out, int in, const uint16_t *X, int n, float *Y,
                      int chunked);

/* engine/cuda/cuda_step.c */
int cuda_enqueue_pass(cuda_runner *r, const cuda_pass *p);
int cuda_enqueue_logits(cuda_runner *r, int which, const int32_t *rows, int n);
int cuda_enqueue_decode(cuda_runner *r, int B);
int cuda_capture_graphs(cuda_runner *r, char *err, size_t errlen);
void cuda_destroy_graphs(cuda_runner *r);
int cuda_decode(runner *base, const runner_decode_batch *b);
int cuda_enqueue_logits_out(cuda_runner *r, int which, const int32_t *rows, int n, float *out);
/* On-device sampling's buffers (d_adj, d_top_*; at creation) and their release. */
int cuda_sample_alloc(cuda_runner *r);
void cuda_sample_free(cuda_runner *r);
/* q[0..n) = the k_sample_params of rows sp[0..n): the base fields, and where
 * base.sample_adjusts the penalties, n_top and the adjustments, staged into h_adj (grown
 * as needed) and copied to d_adj on r->stream. A row with stats_fed and a penalty counts
 * the token it is fed, found on the device at d_fed[fed_idx ? fed_idx[i] : i]
 * (k_sample_params.fed). *want_top: whether a row wants top logprobs. Returns 0,
 * SPECD_ENOMEM or SPECD_ECUDA. */
int cuda_sample_prepare(cuda_runner *r, const runner_sampling *sp, int n, const int32_t *d_fed,
                        const int32_t *fed_idx, k_sample_params *q, int *want_top);
void cuda_graph_size_list(int max_batch, int *sizes, int *n);
/* engine/cuda/cuda_spec.c: buffers (before capture), capture, the op, cleanup. */
int cuda_spec_alloc(cuda_runner *r, int k);
int cuda_spec_capture(cuda_runner *r, char *err, size_t errlen);
int cuda_spec_step(runner *base, const runner_spec_batch *b);
/* The outputs of pending speculative step p (cuda_wait_queued): tokens and counts to the
 * batch's arrays, the length mirror advanced. */
int cuda_spec_wait(cuda_runner *r, const struct cuda_dec_pending *p);
void cuda_spec_free(cuda_runner *r);
/* The verify op over outside drafts (same file): buffers for up to k drafts, capture, the op. */
int cuda_verify_alloc(cuda_runner *r, int k);
int cuda_verify_capture(cuda_runner *r, char *err, size_t errlen);
int cuda_verify(runner *base, const runner_verify_batch *b);
/* Tensor-parallel hook: sum a partial [n, hidden] fp32 across ranks (no-op at world 1 and
 * for the replicated draft). Enqueued on r->stream, so captured with the pass. */
int cuda_tp_allreduce(cuda_runner *r, int which, float *buf, size_t n);
/* Wait for r->stream after a step: cudaStreamSynchronize at world 1; with a communicator a
 * wait with a deadline that also watches NCCL's asynchronous errors (a dead or hung peer
 * becomes an error, never a hang). Returns 0 or SPECD_ECUDA / SPECD_ETIMEOUT. */
int cuda_step_sync(cuda_runner *r);
/* Enqueue the slot changes written since the last op (block tables, lengths) on the
 * stream; every op calls it before its first kernel. */
int cuda_upload_slots(cuda_runner *r);
/* The latest queued decode's inputs are on the device (0 at once when none is pending). */
int cuda_dec_inputs_done(cuda_runner *r);
int cuda_wait_queued(runner *base);
/* Op p queued (its outputs on their way to its half, ev_out recorded): pending until
 * cuda_wait_queued; not async: waited for here (a group's collectives first). */
int cuda_push_pending(cuda_runner *r, const struct cuda_dec_pending *p, int async);

#endif
