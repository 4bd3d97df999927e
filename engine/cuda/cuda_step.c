/* The CUDA runner's compute: one forward pass enqueued on the runner's stream (shared by
 * the eager forward() op and the captured decode step), the lm_head over selected rows,
 * the decode step with on-device sampling, and CUDA-graph capture of that step.
 *
 * A pass, per layer: RMSNorm -> fused QKV GEMM -> bias / q,k-norm / rotary / KV write ->
 * paged attention -> O GEMM accumulated into the fp32 residual (beta = 1) -> RMSNorm ->
 * fused gate|up GEMM -> SiLU * up -> down GEMM accumulated into the residual (a
 * mixture-of-experts layer instead: router GEMM, top-k routing, grouped expert GEMMs that
 * read only the chosen experts, weighted combine; kernels/moe.cu; up to 8 tokens that is
 * three launches, see k_moe_route_gemv). At batch 1-2 the GEMVs absorb most of the small
 * kernels (see cuda_enqueue_pass), MoE models' included. With GGUF blocks on the int8 GEMV
 * (k_gemv_qi8) the RMSNorm and the gated product before QKV, gate|up and down, and the
 * attention before O, round the activations themselves (k_rmsnorm_q8, k_gated_mul_q8,
 * k_attn_work.x8), so no rounding launch runs there.
 * Everything that changes per step (tokens, slots, sampling parameters, lengths) lives in
 * device buffers at fixed addresses, so a captured step replays with fresh inputs. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cuda_profiler_api.h>

#include "engine/cuda/cuda_internal.h"
#include "engine/cuda/cuda_tp.h"
#include "engine/core/err.h"
#include "engine/tp/runner_tp.h"
#include "kernels/quant_blocks.h"

/* Decode passes whose experts average up to this many rows (n * K / E) put every expert
 * on the MoE tensor-core GEMV, one pass over its weights per 16 rows (measured on the
 * Qwen3-30B-A3B shape at 16 / 64 / 256 rows, 1 / 4 / 16 on average, on an H100:
 * tests/gpu/BENCH.md, thirty-third session; a model of few experts, e.g. Mixtral's 8, keeps
 * the tiles from 64 rows). */
#define MOE_TCV_DECODE_ROWS 16

static int gemm(cuda_runner *r, const uint16_t *W, int out, int in, const uint16_t *X, int n,
                float *Y, float beta) {
    /* Batch 1-2 decode streams the weights through our GEMV (8B shape, batch 1: 7.13 ->
     * 5.75 ms/token together with device-sized attention splits). Above two rows its fp32
     * FMAs, not memory, bound it: H200 start-up timings (decode step at batch 4 / 8, ms,
     * cuBLAS vs GEMV rows): 8B 4.80 / 5.13 vs 5.67 / 10.35, 1B 1.13 / 1.19 vs 1.25 / 2.12,
     * and SmolLM2-135M no longer gains either (captured step of 4 rows, 2026-12-02: GEMV
     * 0.873 vs cuBLAS 0.832 ms; an earlier build measured 0.82 vs 0.99), so the default
     * stays 2 rows and SPECD_CUDA_GEMV_ROWS raises it (tests/gpu/BENCH.md). */
    if (n <= r->gemv_rows_now && in % 8 == 0 && !r->tune.no_gemv) {
        K_CHECK(r, k_gemv_bf16(W, X, Y, out, in, n, beta != 0.f, r->stream));
        return 0;
    }
    return cuda_gemm_bf16(r, W, out, in, X, n, Y, out, beta);
fail:
    return SPECD_ECUDA;
}

/* Which kernel reads a GGUF-block matrix [out, in] for n token rows in place: Q4_K / Q5_K
 * (and Q6_K / Q8_0 where switched on) passes of tune.gemvq_tc_min .. tune.gemvq_tc tokens
 * the tensor-core GEMV (k_gemv_qtc); tune.gemm_q_min .. tune.gemm_q_rows token rows (-1: 64
 * for K-quant matrices of both sides >= 4096, else none, as measured) the tensor-core GEMM
 * over the blocks; Q8_0 passes of K_GEMV_MAX_N + 1 .. tune.gemm_qi8_rows tokens over matrices
 * of both sides >= 4096 the int8 tensor-core GEMM (k_gemm_qi8); up to K_GEMV_MAX_N the
 * quantized GEMV, with int8 activations (k_gemv_qi8) from tune.gemvq_i8 tokens for the
 * 32-element types and tune.gemvq_i8_k for the K-quants; else none (Q_COPY: a bf16 copy
 * and cuBLAS). The int8 kernels keep the rounded activations in the scratch buffer. */
enum { Q_COPY, Q_GEMV_TC, Q_GEMM, Q_GEMV, Q_GEMV_I8, Q_GEMM_I8 };
static int q_kernel(const cuda_runner *r, int type, int out, int in, int n) {
    const int i8_room = r->qscratch_bytes >= k_gemv_qi8_scratch(in, n);
    if (n > K_GEMV_MAX_N && n <= r->tune.gemm_qi8_rows && out >= 4096 && in >= 4096 && k_gemm_qi8_takes(type, in) &&
        i8_room)
        return Q_GEMM_I8;
    if (n >= r->tune.gemvq_tc_min && n <= r->tune.gemvq_tc && k_gemv_qtc_takes(type) &&
        (type != QB_Q6_K || r->tune.gemvq_tc_q6k) && (type != QB_Q8_0 || r->tune.gemvq_tc_q8))
        return Q_GEMV_TC;
    const int kquant = qb_elems(type) == 256;   /* Q4_K, Q5_K, Q6_K */
    const int gq_rows = r->tune.gemm_q_rows >= 0 ? r->tune.gemm_q_rows : kquant && out >= 4096 && in >= 4096 ? 64 : 0;
    if (n >= r->tune.gemm_q_min && n <= gq_rows) return Q_GEMM;
    if (n > K_GEMV_MAX_N) return Q_COPY;
    const int i8_from = kquant ? r->tune.gemvq_i8_k : r->tune.gemvq_i8;
    return i8_from > 0 && n >= i8_from && k_gemv_qi8_takes(type) && i8_room ? Q_GEMV_I8 : Q_GEMV;
}

/* Y[:, 0:rows] (+)= X . W^T (Y's rows ldy apart) for rows of W in GGUF type `type` on
 * q_kernel's choice `kind`; Q_COPY, and Q8_0's int8 GEMM where Y has a stride (it takes
 * none), dequantize W into the scratch buffer for cuBLAS (ldc ldy: more than K_GEMV_MAX_N
 * rows). x_ready: X's int8 rounding is in the scratch buffer already (Q_GEMV_I8). */
static int q_part(cuda_runner *r, int kind, int type, const uint8_t *w, int rows, int in, const uint16_t *X, int n,
                  float *Y, int ldy, float beta, int x_ready) {
    const int acc = beta != 0.f;
    switch (kind) {
    case Q_GEMV:
        K_CHECK(r, k_gemv_q_ld(type, w, X, Y, ldy, rows, in, n, acc, r->stream));
        return 0;
    case Q_GEMV_I8:
        K_CHECK(r, k_gemv_qi8_ld(type, w, X, Y, ldy, rows, in, n, acc, r->d_qscratch, r->qscratch_bytes, x_ready,
                                 r->stream));
        return 0;
    case Q_GEMV_TC:
        K_CHECK(r, k_gemv_qtc_ld(type, w, X, Y, ldy, rows, in, n, acc, r->stream));
        return 0;
    case Q_GEMM:
        K_CHECK(r, k_gemm_q_ld(type, w, X, Y, ldy, rows, in, n, acc, (float *)r->d_qscratch, r->qscratch_bytes,
                               r->stream));
        return 0;
    case Q_GEMM_I8:
        if (ldy != rows) break;
        K_CHECK(r, k_gemm_qi8(type, w, X, Y, rows, in, n, acc, r->d_qscratch, r->qscratch_bytes, r->stream));
        return 0;
    }
    K_CHECK(r, k_dequant_q(type, w, r->d_qscratch, rows, in, r->stream));
    return cuda_gemm_bf16(r, r->d_qscratch, rows, in, X, n, Y, ldy, beta);
fail:
    return SPECD_ECUDA;
}

/* A matrix whose rows come in two types (cuda_qmat.type2): each part on q_kernel's choice
 * for its own rows, into its columns of Y (row stride out); the int8 activations of two
 * GEMV parts rounded once (or not at all: x_ready, k_rmsnorm_q8 left them in the scratch). */
static int gemm_q2(cuda_runner *r, const cuda_qmat *q, int out, int in, const uint16_t *X, int n, float *Y,
                   float beta, int x_ready) {
    const int rows[2] = {q->rows1, out - q->rows1}, types[2] = {q->type, q->type2};
    const uint8_t *w[2] = {q->w, q->w + q->off2};
    for (int i = 0; i < 2; i++) {
        const int kind = q_kernel(r, types[i], rows[i], in, n);
        const int rc = q_part(r, kind, types[i], w[i], rows[i], in, X, n, Y + (i ? q->rows1 : 0), out, beta, x_ready);
        if (rc) return rc;
        x_ready = kind == Q_GEMV_I8;   /* (any other kernel may have used the scratch buffer) */
    }
    return 0;
}

/* Whether every part of a quantized projection runs on the int8 GEMV (Q_GEMV_I8) for n
 * tokens: then the RMSNorm before it may round its activations (k_rmsnorm_q8, x_ready). */
static int q_takes_x8(const cuda_runner *r, const cuda_qmat *q, const float *sw, int out, int in, int n) {
    if (!q->type || sw || r->tune.no_fuse || in % 32) return 0;
    if (!q->type2) return q_kernel(r, q->type, out, in, n) == Q_GEMV_I8;
    return q_kernel(r, q->type, q->rows1, in, n) == Q_GEMV_I8 && q_kernel(r, q->type2, out - q->rows1, in, n) == Q_GEMV_I8;
}

/* gemm() for a projection that may be kept in its GGUF blocks (q->type): on q_kernel's
 * choice (k_gemm_q's split partial sums in the scratch buffer), else through its bf16
 * copy in the scratch buffer and cuBLAS. Or FP8 (sw, the row
 * scales, set: W holds E4M3 bytes): up to K_GEMV_MAX_N rows on the GEMV reading the bytes,
 * more on FP8 tensor cores. x_ready: X's int8 rounding is in the scratch buffer already
 * (only where q_takes_x8). */
static int gemm_qx(cuda_runner *r, const uint16_t *W, const cuda_qmat *q, const float *sw, int out, int in,
                   const uint16_t *X, int n, float *Y, float beta, int x_ready) {
    if (sw) {
        if (n <= K_GEMV_MAX_N && !r->tune.no_gemv) {
            K_CHECK(r, k_gemv_w((k_wmat){W, sw}, X, Y, out, in, n, beta != 0.f, NULL, NULL, r->stream));
            return 0;
        }
        return cuda_fp8_gemm(r, (const uint8_t *)W, sw, out, in, X, n, Y, beta);
    }
    if (!q->type) return gemm(r, W, out, in, X, n, Y, beta);
    if (q->type2) return gemm_q2(r, q, out, in, X, n, Y, beta, x_ready);
    return q_part(r, q_kernel(r, q->type, out, in, n), q->type, q->w, out, in, X, n, Y, out, beta, x_ready);
fail:
    return SPECD_ECUDA;
}

static int gemm_q(cuda_runner *r, const uint16_t *W, const cuda_qmat *q, const float *sw, int out, int in,
                  const uint16_t *X, int n, float *Y, float beta) {
    return gemm_qx(r, W, q, sw, out, in, X, n, Y, beta, 0);
}

/* The output matrix in its blocks (cuda_model.qlm): Y [n, vocab] = X . W^T. Passes gemm_q
 * sends to a GEMV or to k_gemm_q go there; the rest dequantize it in chunks of rows the
 * scratch buffer holds, each chunk's columns of Y by cuBLAS (ldc = vocab), so the bf16
 * copy of the whole matrix is never made. */
static int lm_head_q(cuda_runner *r, const cuda_qmat *q, const uint16_t *X, int n, float *Y) {
    const int vocab = q->rows, in = q->cols;
    if (q_kernel(r, q->type, vocab, in, n) != Q_COPY) return gemm_q(r, NULL, q, NULL, vocab, in, X, n, Y, 0.f);
    const size_t row_bytes = (size_t)(in / qb_elems(q->type)) * (size_t)qb_bytes(q->type);
    const int chunk = (int)(r->qscratch_bytes / 2 / (size_t)in);
    if (chunk < 1) return SPECD_EINVAL;
    for (int r0 = 0, rc; r0 < vocab; r0 += chunk) {
        const int rows = vocab - r0 < chunk ? vocab - r0 : chunk;
        if ((rc = q_part(r, Q_COPY, q->type, q->w + (size_t)r0 * row_bytes, rows, in, X, n, Y + r0, vocab, 0.f, 0)))
            return rc;
    }
    return 0;
}

int cuda_tp_allreduce(cuda_runner *r, int which, float *buf, size_t n) {
    /* Rank 0 accumulated its partial into the residual and the others started from zero,
     * so the sum over ranks is exactly the new residual, the same bits on every rank. */
    if (r->opts.world <= 1 || (which != RUNNER_TARGET && !r->tune.tp_shard_draft) || r->tune.tp_skip_allreduce) return 0;
    int rc = cuda_tp_all_reduce_f32(r->opts.tp, buf, n, r->stream);
    if (rc) cuda_fail(r, __FILE__, __LINE__, "all-reduce", cuda_tp_error(r->opts.tp));
    return rc ? SPECD_ECUDA : 0;
}

int cuda_step_sync(cuda_runner *r) {
    if (r->opts.world <= 1) {
        CU_CHECK(r, cudaStreamSynchronize(r->stream));
        return 0;
    }
    int rc = cuda_tp_wait(r->opts.tp, r->stream, RUNNER_TP_STEP_TIMEOUT_MS);
    if (rc) cuda_fail(r, __FILE__, __LINE__, "tensor-parallel step", cuda_tp_error(r->opts.tp));
    return rc;
fail:
    return SPECD_ECUDA;
}

static k_kv_geom kv_geom(const cuda_runner *r, int which, const int32_t *tok_slot,
                         const int32_t *tok_j, int pool_layer) {
    k_kv_geom g = {
        .tok_slot = tok_slot, .tok_j = tok_j, .lens = r->d_lens, .which = which,
        .bt = r->in_win[pool_layer] ? r->d_bt_win : r->d_bt,
        .max_blocks = r->max_blocks, .block_size = r->base.cfg.block_size,
        .pool_pp = r->in_win[pool_layer] ? r->d_win_pp : r->d_pool_pp,
        .block_elems = r->in_win[pool_layer] ? r->win_block_elems : r->block_elems,
        .layer_off = r->layer_off[pool_layer],
        .kv_fp8 = r->kv_esize == 1,
        .k_scale = r->kv_scale[2 * pool_layer], .v_scale = r->kv_scale[2 * pool_layer + 1],
    };
    return g;
}

/* A pass of FP8 projections past the GEMV sizes where cuBLASLt cannot scale by vectors
 * (Hopper): instead of quantizing before and rescaling after each GEMM, the layer's GEMMs
 * run unscaled (cuda_fp8_gemm_raw) and their neighbours do that work as they pass the
 * data on -- the norms add the O / down products into the residual and quantize what they
 * write (k_rmsnorm_fp8), rotary applies the QKV scales (k_qkv_rope_kv_fp8), the gated
 * product quantizes for down (k_gated_mul_fp8q). Only the attention output is quantized
 * by a launch of its own. Every value is computed by the same expressions in the same
 * order as the separate kernels', so the pass gives the same bits (SPECD_CUDA_FP8_CHAIN=0
 * runs those). From tune.fp8_chain tokens (per-row kernels: fewer rows than that were
 * slower), one GPU, dense layers without sandwich norms. */
static int fp8_chain(const cuda_runner *r, const cuda_model *cm, int n, int partial) {
    const model_config *c = &cm->c;
    const int hidden = c->hidden, qd = cm->H * cm->D, qkvd = (cm->H + 2 * cm->KVH) * cm->D, F = cm->ffn;
    if (r->tune.fp8_chain <= 0 || n < r->tune.fp8_chain || r->tune.no_fuse || r->tune.dbg_skip || partial ||
        !cm->fp8 || hidden % 4 || (size_t)F * 2 > K_GATED_FP8Q_MAX_SMEM || !cuda_fp8_chain_ok(r, n, qkvd, hidden) ||
        !cuda_fp8_chain_ok(r, n, hidden, qd) || !cuda_fp8_chain_ok(r, n, 2 * F, hidden) ||
        !cuda_fp8_chain_ok(r, n, hidden, F))
        return 0;
    for (int l = 0; l < c->n_layers; l++) {
        const cuda_layer *L = &cm->layers[l];
        if (!L->sqkv || !L->so || !L->sgu || !L->sdown || L->router || L->post_attn_norm || L->post_ffn_norm)
            return 0;
    }
    return 1;
}

/* Layer l of an fp8_chain pass. The residual holds the previous layer's output but its
 * down products, which are in d_f32 (unscaled, token scales in d_xs) until this layer's
 * norm adds them; the last layer adds its own. */
static int fp8_chain_layer(cuda_runner *r, const cuda_model *cm, int l, int n, const k_kv_geom *g,
                           const k_attn_work *w, float scale) {
    const model_config *c = &cm->c;
    const cuda_layer *L = &cm->layers[l], *P = l ? &cm->layers[l - 1] : NULL;
    const int hidden = c->hidden, H = cm->H, KVH = cm->KVH, D = cm->D, F = cm->ffn;
    cudaStream_t s = r->stream;
    int rc;
    K_CHECK(r, k_rmsnorm_fp8(P ? r->d_f32 : NULL, P ? P->sdown : NULL, r->d_xs, r->d_resid, L->attn_norm, n, hidden,
                             c->rms_eps, r->d_xq, r->d_xs, s));
    if ((rc = cuda_fp8_gemm_raw(r, (const uint8_t *)L->wqkv, (H + 2 * KVH) * D, hidden, NULL, n, r->d_f32, 1)))
        return rc;
    K_CHECK(r, k_qkv_rope_kv_fp8(r->d_f32, L->sqkv, r->d_xs, L->bqkv, L->q_norm, L->k_norm, L->inv_freq, c->rms_eps,
                                 r->d_q, n, H, KVH, D, g, s));
    K_CHECK(r, k_attention(r->d_q, r->d_xb, H, KVH, D, scale, g, w, s));
    if ((rc = cuda_fp8_gemm_raw(r, (const uint8_t *)L->wo, hidden, H * D, r->d_xb, n, r->d_f32, 1))) return rc;
    K_CHECK(r, k_rmsnorm_fp8(r->d_f32, L->so, r->d_xs, r->d_resid, L->ffn_norm, n, hidden, c->rms_eps, r->d_xq,
                             r->d_xs, s));
    if ((rc = cuda_fp8_gemm_raw(r, (const uint8_t *)L->wgu, 2 * F, hidden, NULL, n, r->d_f32, 0))) return rc;
    K_CHECK(r, k_gated_mul_fp8q(r->d_f32, L->sgu, r->d_xs, n, F, c->act == ACT_GELU_TANH, r->d_xq, r->d_xs, s));
    if ((rc = cuda_fp8_gemm_raw(r, (const uint8_t *)L->wdown, hidden, F, NULL, n, r->d_f32, 1))) return rc;
    if (l + 1 == c->n_layers) K_CHECK(r, k_fp8_scale_rows(r->d_f32, L->sdown, r->d_xs, r->d_resid, n, hidden, 1, s));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* Passes on the GEMVs (batch 1-2; bf16, FP8 or GGUF blocks): the decode attention asks L2
 * for the O projection's weights, up to tune.attn_l2pf percent of the L2, so the O GEMV
 * after it reads them from L2; the attention's dependent loads leave DRAM idle meanwhile
 * (k_attn_work.l2_next). */
static void o_l2_prefetch(const cuda_runner *r, const cuda_layer *L, int hidden, int qd, k_attn_work *w) {
    if (!r->tune.attn_l2pf) return;
    const void *p = L->qo.type ? (const void *)L->qo.w : (const void *)L->wo;
    size_t bytes = L->qo.type ? cuda_qmat_bytes(&L->qo) : (size_t)hidden * qd * (L->so ? 1 : 2);
    const size_t cap = r->l2_bytes / 100 * (size_t)r->tune.attn_l2pf;
    if (!p || (uintptr_t)p % 16) return;
    if (bytes > cap) bytes = cap;
    w->l2_next = p;
    w->l2_next_bytes = bytes / 16 * 16;
}

int cuda_enqueue_pass(cuda_runner *r, const cuda_pass *p) {
    cuda_model *cm = &r->m[p->which];
    const model_config *c = &cm->c;
    const int n = p->n_tok, hidden = c->hidden, H = cm->H, KVH = cm->KVH, D = cm->D;
    const int qd = H * D, qkvd = (H + 2 * KVH) * D, F = cm->ffn;
    /* the target's row-parallel partials: only rank 0 adds the residual (see cuda_tp_allreduce) */
    const int partial = r->opts.world > 1 && (p->which == RUNNER_TARGET || r->tune.tp_shard_draft);
    const float beta_res = !partial || r->opts.rank == 0 ? 1.f : 0.f;
    const float scale = c->attn_scale > 0 ? c->attn_scale : 1.f / sqrtf((float)D);
    cudaStream_t s = r->stream;
    int rc;
    /* Up to tune.gemv_rows tokens (batch 1-2 by default; a verify pass may ask for more:
     * cuda_pass.gemv_rows) on our GEMV: SiLU-and-mul folds into the gate|up GEMV and, for models
     * without q/k norm, rotary + KV write into the QKV GEMV (kernels/gemv.cu). Decode
     * attention merges its splits itself (no combine kernel). SPECD_CUDA_NO_FUSE=1 runs
     * the separate kernels. At any batch, passes of single-token rows (decode) hand the
     * rotary step with q/k norm to the attention (k_rope_attention: inside the decode
     * kernel where that kernel takes the pass; SPECD_ATTN_ROPE=0 keeps it apart). */
    r->gemv_rows_now = p->gemv_rows > 0 ? p->gemv_rows : r->tune.gemv_rows;
    const int fused = !cm->plain && n <= K_GEMV_FUSED_MAX_N && n <= r->gemv_rows_now && !r->tune.no_gemv && !r->tune.no_fuse &&
                      hidden % 8 == 0 && F % 8 == 0;
    const int fuse_rope = fused && !cm->layers[0].q_norm;
    /* ... and, on one GPU, every RMSNorm but the first folds into the GEMVs around it: O
     * and down add into the residual and write bf16(h * g_next) with the row's sum of
     * h^2, QKV and gate|up scale their dots by rsqrt(mean + eps) (kernels/gemv.cu).
     * d_ss holds one sum per (layer, norm, row), zeroed at the start of the pass. */
    const int fuse_norm = fused && !partial && !r->tune.no_fuse_norm && !(r->tune.dbg_skip & ~64) && qd % 8 == 0 &&
                          c->n_layers <= r->ss_layers;
    k_norm_in nin_attn = {0}, nin_ffn = {0};
    k_norm_out nout_ffn = {0}, nout_attn = {0};

    if (cm->qembed.type)
        K_CHECK(r, k_embed_q(cm->qembed.type, cm->qembed.w, p->tokens, r->d_resid, n, hidden, c->vocab, s));
    else
        K_CHECK(r, k_embed(cm->embed, p->tokens, r->d_resid, n, hidden, c->vocab, s));
    if (c->embed_scale > 0) K_CHECK(r, k_scale_f32(r->d_resid, (size_t)n * hidden, c->embed_scale, s));
    if (fuse_norm)
        CU_CHECK(r, cudaMemsetAsync(r->d_ss, 0, (size_t)2 * c->n_layers * CUDA_GEMV_MAX_ROWS * sizeof *r->d_ss, s));
    const int chain = !fused && fp8_chain(r, cm, n, partial);
    for (int l = 0; l < c->n_layers; l++) {
        const cuda_layer *L = &cm->layers[l];
        k_kv_geom g = kv_geom(r, p->which, p->tok_slot, p->tok_j, cm->pool_layer0 + l);
        k_attn_work w = {
            .row_slot = p->row_slot, .row_tok_off = p->row_tok_off, .row_n_new = p->row_n_new,
            .item_row = p->item_row, .item_q0 = p->item_q0, .n_items = p->n_items, .qt = p->qt,
            .n_tok = n, .n_splits = p->n_splits, .split_len = L->window ? 0 : p->split_len, .window = L->window,
            .ws_o = r->d_ws_o, .ws_ml = r->d_ws_ml, .counters = r->tune.no_fuse ? NULL : r->d_counts,
        };
        if (chain) {
            if ((rc = fp8_chain_layer(r, cm, l, n, &g, &w, scale))) return rc;
            continue;
        }
        /* the norms folded into this layer's GEMVs: sums of squares [l][0] (attention input,
         * written by the previous layer's down GEMV) and [l][1] (MLP input, by O) */
        unsigned long long *ss_l = r->d_ss + (size_t)l * 2 * CUDA_GEMV_MAX_ROWS;
        const k_norm_in *qkv_nin = fuse_norm && l > 0 ? &nin_attn : NULL;
        const uint16_t *qkv_x = qkv_nin ? r->d_xg : r->d_xb;
        if (fuse_norm) {
            nin_attn = (k_norm_in){.ss = ss_l, .eps = c->rms_eps};
            nin_ffn = (k_norm_in){.ss = ss_l + CUDA_GEMV_MAX_ROWS, .eps = c->rms_eps};
            nout_ffn = (k_norm_out){.g = L->ffn_norm, .xg = r->d_xg, .ss = ss_l + CUDA_GEMV_MAX_ROWS};
            if (l + 1 < c->n_layers)
                nout_attn = (k_norm_out){.g = cm->layers[l + 1].attn_norm, .xg = r->d_xg,
                                         .ss = ss_l + 2 * CUDA_GEMV_MAX_ROWS};
        }
        /* where the QKV pass runs on the int8 GEMV, the norm rounds its activations too */
        const int qkv_x8 = !(r->tune.dbg_skip & 1) && !qkv_nin && !fuse_rope &&
                           q_takes_x8(r, &L->qqkv, L->sqkv, qkvd, hidden, n);
        if (qkv_x8)
            K_CHECK(r, k_rmsnorm_q8(r->d_resid, L->attn_norm, r->d_xb, n, hidden, c->rms_eps, r->d_qscratch, s));
        else if (!(r->tune.dbg_skip & 1) && !qkv_nin)
            K_CHECK(r, k_rmsnorm(r->d_resid, NULL, L->attn_norm, r->d_xb, n, hidden, c->rms_eps, s));
        /* every row one new token (decode): rotary, q/k norm and the KV write go with the
         * attention (k_rope_attention: one kernel where the decode kernel takes the pass) */
        const int rope_late = !fuse_rope && !r->tune.no_fuse && p->n_rows == n && p->qt == 1 && p->n_items == n && !(r->tune.dbg_skip & 6);
        const k_rope_in rope = {.qkv = r->d_f32, .bias = L->bqkv, .q_norm = L->q_norm, .k_norm = L->k_norm,
                                .inv_freq = L->inv_freq, .eps = c->rms_eps, .q_out = r->d_q};
        if (r->tune.dbg_skip & 2) {
            /* SPECD_DEBUG_SKIP: stage left out (timing only) */
        } else if (fuse_rope) {
            K_CHECK(r, k_gemv_qkv_rope_w((k_wmat){L->wqkv, L->sqkv}, qkv_x, L->bqkv, L->inv_freq, r->d_q, n, H, KVH,
                                         D, hidden, &g, qkv_nin, s));
        } else if (qkv_nin) {
            K_CHECK(r, k_gemv_w((k_wmat){L->wqkv, L->sqkv}, qkv_x, r->d_f32, qkvd, hidden, n, 0, qkv_nin, NULL, s));
        } else if ((rc = gemm_qx(r, L->wqkv, &L->qqkv, L->sqkv, qkvd, hidden, r->d_xb, n, r->d_f32, 0.f, qkv_x8))) {
            return rc;
        }
        if (!(r->tune.dbg_skip & 2) && !fuse_rope && !rope_late)
            K_CHECK(r, k_qkv_rope_kv(r->d_f32, L->bqkv, L->q_norm, L->k_norm, L->inv_freq, c->rms_eps, r->d_q, n, H,
                                     KVH, D, &g, s));
        /* where O runs on the int8 GEMV, attention rounds its output for it (w.x8) */
        const int o_x8 = r->tune.attn_x8 && !(r->tune.dbg_skip & 12) && !fuse_norm &&
                         q_takes_x8(r, &L->qo, L->so, hidden, qd, n);
        w.x8 = o_x8 ? r->d_qscratch : NULL;
        if (n <= r->gemv_rows_now && !r->tune.no_gemv) o_l2_prefetch(r, L, hidden, qd, &w);
        if (rope_late) K_CHECK(r, k_rope_attention(&rope, r->d_xb, H, KVH, D, scale, &g, &w, s));
        else if (!(r->tune.dbg_skip & 4)) K_CHECK(r, k_attention(r->d_q, r->d_xb, H, KVH, D, scale, &g, &w, s));
        if (L->post_attn_norm) {   /* Gemma 3: the output (all-reduced first) normed, then added */
            if ((rc = gemm_qx(r, L->wo, &L->qo, L->so, hidden, qd, r->d_xb, n, r->d_f32, 0.f, o_x8)) ||
                (partial && (rc = cuda_tp_allreduce(r, p->which, r->d_f32, (size_t)n * hidden))))
                return rc;
            K_CHECK(r, k_rmsnorm_add(r->d_f32, L->post_attn_norm, r->d_resid, n, hidden, c->rms_eps, s));
        } else if (fuse_norm)
            K_CHECK(r, k_gemv_w((k_wmat){L->wo, L->so}, r->d_xb, r->d_resid, hidden, qd, n, 1, NULL, &nout_ffn, s));
        else if (!(r->tune.dbg_skip & 8) &&
                 (rc = gemm_qx(r, L->wo, &L->qo, L->so, hidden, qd, r->d_xb, n, r->d_resid, beta_res, o_x8)))
            return rc;
        if (!L->post_attn_norm && (rc = cuda_tp_allreduce(r, p->which, r->d_resid, (size_t)n * hidden))) return rc;
        const int gu_x8 = !(r->tune.dbg_skip & 1) && !fuse_norm && !L->router && !fused &&
                          q_takes_x8(r, &L->qgu, L->sgu, 2 * F, hidden, n);
        if (gu_x8)
            K_CHECK(r, k_rmsnorm_q8(r->d_resid, L->ffn_norm, r->d_xb, n, hidden, c->rms_eps, r->d_qscratch, s));
        else if (!(r->tune.dbg_skip & 1) && !fuse_norm)
            K_CHECK(r, k_rmsnorm(r->d_resid, NULL, L->ffn_norm, r->d_xb, n, hidden, c->rms_eps, s));
        const uint16_t *act = r->d_xb;
        if (L->router && (r->tune.dbg_skip & 64)) continue;   /* SPECD_DEBUG_SKIP=moe (timing only) */
        if (L->router) {   /* mixture of experts (kernels/moe.cu), added into the residual */
            /* MF: this rank's rows of each expert; the partial sums add into a zeroed
             * residual off rank 0 (as beta_res does for the dense MLP), then all-reduce */
            const int E = c->n_experts, K = c->n_experts_used, MF = F, gelu = c->act == ACT_GELU_TANH;
            if (beta_res == 0.f) CU_CHECK(r, cudaMemsetAsync(r->d_resid, 0, (size_t)n * hidden * sizeof(float), s));
            const k_moe_route_buf mb = {
                .logits = r->d_moe_lg, .ids = r->d_moe_ids, .w = r->d_moe_w, .counts = r->d_moe_cnt + 1,
                .rows = r->d_moe_rows, .active = r->d_moe_cnt + 1 + E, .done = (unsigned *)r->d_moe_cnt,
                .l2_gu = r->tune.moe_l2pf > 0 && n == 1 ? L->exp_gu : NULL, .l2_F = MF,
                .l2_bytes = (size_t)r->tune.moe_l2pf * 1024,
            };
            if (n == 1 && cm->moe_one && !r->tune.no_fuse) {
                /* one token: the whole layer in one launch (k_moe_decode1, tune.moe_one) */
                K_CHECK(r, k_moe_decode1(L->router, L->exp_gu, L->exp_down, fuse_norm ? r->d_xg : r->d_xb,
                                         fuse_norm ? &nin_ffn : NULL, hidden, E, K, MF, c->moe_norm_topk, gelu, &mb,
                                         r->d_moe_part, r->d_moe_bar, r->d_resid,
                                         fuse_norm && l + 1 < c->n_layers ? &nout_attn : NULL, NULL, s));
            } else if (n <= K_MOE_DEC_MAX_N && !r->tune.no_fuse) {
                /* decode: three launches, reading only the chosen experts; with the norm
                 * fold, x is h * g and the down GEMV writes the next layer's */
                const k_norm_in *min = fuse_norm ? &nin_ffn : NULL;
                const uint16_t *mx = fuse_norm ? r->d_xg : r->d_xb;
                K_CHECK(r, k_moe_route_gemv(L->router, mx, min, n, hidden, E, K, c->moe_norm_topk, &mb, s));
                K_CHECK(r, k_moe_gated_dec(L->exp_gu, mx, min, &mb, n, E, K, MF, hidden, gelu, r->d_moe_act, s));
                K_CHECK(r, k_moe_down_combine(L->exp_down, r->d_moe_act, &mb, n, K, hidden, MF, r->d_resid,
                                              fuse_norm && l + 1 < c->n_layers ? &nout_attn : NULL, s));
            } else {
                if ((rc = gemm(r, L->router, E, hidden, r->d_xb, n, r->d_moe_lg, 0.f))) return rc;
                CU_CHECK(r, cudaMemsetAsync(mb.counts, 0, (size_t)E * sizeof(int32_t), s));
                K_CHECK(r, k_moe_route(r->d_moe_lg, n, E, K, c->moe_norm_topk, mb.ids, mb.w, mb.counts, mb.rows, s));
                /* experts on the tensor-core GEMV (k_tuning.moe_tcv): by default every one in
                 * decode passes of up to MOE_TCV_DECODE_ROWS rows an expert on average, none
                 * in the others */
                const int tv = r->tune.k.moe_tcv;
                const int tcv_rows = tv >= 0 ? tv : p->n_rows == n && (long)n * K <= (long)MOE_TCV_DECODE_ROWS * E ? n : 0;
                K_CHECK(r, k_moe_gemm(L->exp_gu, r->d_xb, K, mb.rows, mb.counts, n, E, MF, hidden, 1, gelu, tcv_rows,
                                      NULL, r->d_moe_act, s));
                K_CHECK(r, k_moe_gemm(L->exp_down, r->d_moe_act, 1, mb.rows, mb.counts, n, E, hidden, MF, 0, 0,
                                      tcv_rows, r->d_moe_out, NULL, s));
                K_CHECK(r, k_moe_combine(r->d_moe_out, r->d_moe_w, n, K, hidden, r->d_resid, s));
            }
            if ((rc = cuda_tp_allreduce(r, p->which, r->d_resid, (size_t)n * hidden))) return rc;
            continue;
        }
        /* where the down pass runs on the int8 GEMV, the gated product rounds its output too */
        int down_x8 = 0;
        if (r->tune.dbg_skip & 16) {
            /* SPECD_DEBUG_SKIP: stage left out (timing only) */
        } else if (fused) {
            K_CHECK(r, k_gemv_gated_w((k_wmat){L->wgu, L->sgu}, fuse_norm ? r->d_xg : r->d_xb, r->d_act, F, hidden,
                                      n, fuse_norm ? &nin_ffn : NULL, s));
            act = r->d_act;
        } else {
            /* FP8 on cuBLASLt: the gated kernel applies the scales (no rescale pass) */
            const int raw = L->sgu ? cuda_fp8_gemm_unscaled(r, (const uint8_t *)L->wgu, 2 * F, hidden, r->d_xb, n, r->d_f32)
                                   : 1;
            if (raw < 0) return raw;
            if (raw && (rc = gemm_qx(r, L->wgu, &L->qgu, L->sgu, 2 * F, hidden, r->d_xb, n, r->d_f32, 0.f, gu_x8)))
                return rc;
            down_x8 = raw && q_takes_x8(r, &L->qdown, L->sdown, hidden, F, n);
            if (!raw) K_CHECK(r, k_gated_mul_fp8(r->d_f32, L->sgu, r->d_xs, r->d_xb, n, F, c->act == ACT_GELU_TANH, s));
            else if (down_x8)
                K_CHECK(r, k_gated_mul_q8(r->d_f32, r->d_xb, n, F, c->act == ACT_GELU_TANH, r->d_qscratch, s));
            else if (c->act == ACT_GELU_TANH) K_CHECK(r, k_gelu_tanh_mul(r->d_f32, r->d_xb, n, F, s));
            else K_CHECK(r, k_silu_mul(r->d_f32, r->d_xb, n, F, s));
        }
        if (L->post_ffn_norm) {
            if ((rc = gemm_qx(r, L->wdown, &L->qdown, L->sdown, hidden, F, act, n, r->d_f32, 0.f, down_x8)) ||
                (partial && (rc = cuda_tp_allreduce(r, p->which, r->d_f32, (size_t)n * hidden))))
                return rc;
            K_CHECK(r, k_rmsnorm_add(r->d_f32, L->post_ffn_norm, r->d_resid, n, hidden, c->rms_eps, s));
            continue;
        } else if (fuse_norm && l + 1 < c->n_layers)
            K_CHECK(r, k_gemv_w((k_wmat){L->wdown, L->sdown}, act, r->d_resid, hidden, F, n, 1, NULL, &nout_attn, s));
        else if (!(r->tune.dbg_skip & 32) &&
                 (rc = gemm_qx(r, L->wdown, &L->qdown, L->sdown, hidden, F, act, n, r->d_resid, beta_res, down_x8)))
            return rc;
        if ((rc = cuda_tp_allreduce(r, p->which, r->d_resid, (size_t)n * hidden))) return rc;
    }
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_enqueue_logits_out(cuda_runner *r, int which, const int32_t *rows, int n, float *out) {
    cuda_model *cm = &r->m[which];
    const model_config *c = &cm->c;
    K_CHECK(r, k_rmsnorm(r->d_resid, rows, cm->out_norm, r->d_xb, n, c->hidden, c->rms_eps,
                         r->stream));
    if (cm->qlm.type) return lm_head_q(r, &cm->qlm, r->d_xb, n, out);
    if (cm->vocab_parts <= 1) return gemm(r, cm->lm_head, c->vocab, c->hidden, r->d_xb, n, out, 0.f);
    /* Vocabulary-split lm_head: this rank's [n, V/W] slice, an all-gather of the slices
     * ([W][n][V/W], rank order), then each slice into its columns of out [n, V]: every
     * rank ends with the same full logits, so sampling agrees without another collective. */
    const int vp = cm->vocab_rows, W = cm->vocab_parts;
    int rc = gemm(r, cm->lm_head, vp, c->hidden, r->d_xb, n, r->d_lpart, 0.f);
    if (rc) return rc;
    if (!r->tune.tp_skip_allreduce) {
        if (cuda_tp_all_gather_f32(r->opts.tp, r->d_lpart, r->d_lgather, (size_t)n * vp, r->stream)) {
            cuda_fail(r, __FILE__, __LINE__, "all-gather of the logits", cuda_tp_error(r->opts.tp));
            return SPECD_ECUDA;
        }
    }
    for (int p = 0; p < W; p++)
        CU_CHECK(r, cudaMemcpy2DAsync(out + (size_t)p * vp, (size_t)c->vocab * 4, r->d_lgather + (size_t)p * n * vp,
                                      (size_t)vp * 4, (size_t)vp * 4, (size_t)n, cudaMemcpyDeviceToDevice, r->stream));
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_enqueue_logits(cuda_runner *r, int which, const int32_t *rows, int n) {
    return cuda_enqueue_logits_out(r, which, rows, n, r->d_logits);
}

/* ---- on-device sampling's per-step inputs ---------------------------------------------- */

_Static_assert(K_MAX_TOP == RUNNER_MAX_TOP, "top logprob rows are copied as they are");

/* Room for this many adjustment entries in d_adj / h_adj (kept when large enough). */
static int adj_reserve(cuda_runner *r, size_t n) {
    if (n <= r->adj_cap) return 0;
    size_t cap = r->adj_cap ? r->adj_cap : 1024;
    while (cap < n) cap *= 2;
    /* the previous step has finished (every op ends with a sync), so nothing reads them */
    if (r->d_adj) cudaFree(r->d_adj);
    if (r->h_adj) cudaFreeHost(r->h_adj);
    r->d_adj = r->h_adj = NULL;
    r->adj_cap = 0;
    CU_CHECK(r, cudaMalloc((void **)&r->d_adj, cap * sizeof(k_logit_adj)));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_adj, cap * sizeof(k_logit_adj)));
    r->adj_cap = cap;
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_sample_alloc(cuda_runner *r) {
    const size_t tk = (size_t)r->T * K_MAX_TOP;
    CU_CHECK(r, cudaMalloc((void **)&r->d_top_ids, tk * sizeof(int32_t)));
    CU_CHECK(r, cudaMalloc((void **)&r->d_top_lps, tk * sizeof(float)));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_top_ids, tk * sizeof(int32_t)));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_top_lps, tk * sizeof(float)));
    /* a few hundred entries a row before the first growth */
    return adj_reserve(r, (size_t)r->base.cfg.max_batch * 256);
fail:
    return SPECD_ECUDA;
}

void cuda_sample_free(cuda_runner *r) {
    if (r->d_adj) cudaFree(r->d_adj);
    if (r->h_adj) cudaFreeHost(r->h_adj);
    if (r->d_top_ids) cudaFree(r->d_top_ids);
    if (r->d_top_lps) cudaFree(r->d_top_lps);
    if (r->h_top_ids) cudaFreeHost(r->h_top_ids);
    if (r->h_top_lps) cudaFreeHost(r->h_top_lps);
    r->d_adj = r->h_adj = NULL;
    r->d_top_ids = r->h_top_ids = NULL;
    r->d_top_lps = r->h_top_lps = NULL;
    r->adj_cap = 0;
}

static int nonneg(int v) { return v > 0 ? v : 0; }

/* Whether row x's statistics get a placeholder for the token it is fed (its penalties
 * must count that token). */
static int counts_fed(const runner_sampling *x, const int32_t *d_fed) {
    return d_fed && x->stats_fed &&
           ((x->repetition_penalty > 0 && x->repetition_penalty != 1.f) || x->presence_penalty != 0 ||
            x->frequency_penalty != 0);
}

int cuda_sample_prepare(cuda_runner *r, const runner_sampling *sp, int n, const int32_t *d_fed,
                        const int32_t *fed_idx, k_sample_params *q, int *want_top) {
    const int adjusts = r->base.sample_adjusts;
    size_t need = 0, used = 0;
    *want_top = 0;
    for (int i = 0; adjusts && i < n; i++)
        need += (size_t)nonneg(sp[i].n_logit_bias) + (size_t)nonneg(sp[i].n_suppress) + (size_t)nonneg(sp[i].n_stats) +
                (size_t)counts_fed(&sp[i], d_fed);
    int rc = adj_reserve(r, need);
    if (rc) return rc;
    for (int i = 0; i < n; i++) {
        const runner_sampling *x = &sp[i];
        q[i] = cuda_sample_params(x);
        if (x->force) {   /* a prompt position (runner.forced_tokens): its token given */
            if (x->force_token < 0 || x->force_token >= r->base.vocab) return SPECD_EINVAL;
            q[i].force = 1;
            q[i].force_tok = x->force_token;
        }
        if (!adjusts) continue;
        q[i].presence = x->presence_penalty;
        q[i].frequency = x->frequency_penalty;
        q[i].repetition = x->repetition_penalty;
        q[i].n_top = x->n_top < K_MAX_TOP ? nonneg(x->n_top) : K_MAX_TOP;
        *want_top |= q[i].n_top > 0;
        const int fed = counts_fed(x, d_fed);
        const int nb = nonneg(x->n_logit_bias), ns = nonneg(x->n_suppress), nst = nonneg(x->n_stats) + fed;
        if (nb + ns + nst == 0) continue;
        k_logit_adj *a = r->h_adj + used;
        for (int j = 0; j < nb; j++) a[j] = (k_logit_adj){x->logit_bias_ids[j], x->logit_bias_vals[j]};
        for (int j = 0; j < ns; j++) a[nb + j] = (k_logit_adj){x->suppress_ids[j], 0.f};
        for (int j = 0; j < nst - fed; j++) a[nb + ns + j] = (k_logit_adj){x->stat_ids[j], (float)x->stat_counts[j]};
        if (fed) {   /* the placeholder, last */
            a[nb + ns + nst - 1] = (k_logit_adj){-1, 0.f};
            q[i].fed = d_fed + (fed_idx ? fed_idx[i] : i);
        }
        q[i].adj = r->d_adj + used;
        q[i].n_bias = nb;
        q[i].n_suppress = ns;
        q[i].n_stats = nst;
        used += (size_t)(nb + ns + nst);
    }
    if (used)
        CU_CHECK(r, cudaMemcpyAsync(r->d_adj, r->h_adj, used * sizeof(k_logit_adj), cudaMemcpyHostToDevice, r->stream));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* ---- the decode step ------------------------------------------------------------------- */

/* Decode-step buffers: in = tokens[MB] | slots[MB] | prev[MB] | params[MB] (at
 * cuda_dec_par_off: 16-byte aligned for the params' 8-byte fields whatever MB is);
 * out = tok[MB] | lp[MB]. */
static size_t dec_in_bytes(const cuda_runner *r) { return cuda_dec_in_bytes(r->base.cfg.max_batch); }

/* The decode inputs to the device (outside the graphs, which read d_dec_in). */
static int put_dec_in(cuda_runner *r) {
    CU_CHECK(r, cudaMemcpyAsync(r->d_dec_in, r->h_dec_in, dec_in_bytes(r), cudaMemcpyHostToDevice, r->stream));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* Splits per decode row so that B rows x KV heads x splits is about two waves; the
 * kernel divides each row's actual context over them at run time. */
static int dec_splits_for(const cuda_runner *r, int B) {
    long rows = (long)B * r->m[0].KVH;
    long n = (2L * r->n_sm + rows - 1) / rows;
    if (n > r->dec_splits) n = r->dec_splits;
    if (n * B > (long)r->ws_tok_splits) n = (long)r->ws_tok_splits / B;
    return n < 1 ? 1 : (int)n;
}

/* The decode step's first part (its inputs already in d_dec_in): the tokens that come from
 * the step before on the device (prev), the pass, the logits of B rows. */
static int enqueue_decode_pass(cuda_runner *r, int B) {
    const int MB = r->base.cfg.max_batch;
    int32_t *in = r->d_dec_in;
    int32_t *tokens = in, *slots = in + MB;
    int rc;

    K_CHECK(r, k_feed_prev(tokens, in + 2 * MB, r->d_dec_out, B, r->stream));
    cuda_pass p = {
        .which = RUNNER_TARGET, .n_tok = B, .n_rows = B, .tokens = tokens, .tok_slot = slots,
        .tok_j = r->d_zeros, .row_slot = slots, .row_tok_off = r->d_iota, .row_n_new = r->d_ones,
        .item_row = r->d_iota, .item_q0 = r->d_zeros, .n_items = B, .qt = 1,
        .n_splits = dec_splits_for(r, B), .split_len = 0,
    };
    if (r->tune.fixed_splits) {
        p.split_len = r->dec_split_len * 4;
        p.n_splits = (r->base.cfg.max_seq_len + p.split_len - 1) / p.split_len;
        if ((size_t)p.n_splits * B > r->ws_tok_splits) p.n_splits = (int)(r->ws_tok_splits / B);
    }
    if ((rc = cuda_enqueue_pass(r, &p))) return rc;
    return cuda_enqueue_logits(r, RUNNER_TARGET, NULL, B);
fail:
    return SPECD_ECUDA;
}

/* Its second part: sampling (masked: grammar masks and sampling parameters from the
 * d_fs_* buffers the host fills after the pass is enqueued; else the parameters that came
 * with the inputs), lengths advanced, the dummy slot reset. The tokens go back to the host
 * outside the graph (cuda_decode), each step into its half of h_dec_out. */
static int enqueue_decode_tail(cuda_runner *r, int B, int masked) {
    const int MB = r->base.cfg.max_batch, vocab = r->m[0].c.vocab;
    int32_t *in = r->d_dec_in;
    int32_t *slots = in + MB;
    const k_sample_params *sp = masked ? (const k_sample_params *)r->d_fs_par
                                       : (const k_sample_params *)((char *)in + cuda_dec_par_off(MB));
    int32_t *out_tok = r->d_dec_out;
    float *out_lp = (float *)(out_tok + MB);
    cudaStream_t s = r->stream;

    /* masks inside k_sample where it reports masked rows' logprobs of the logits before the
     * mask (runner.masked_raw_logprobs), else in place before it */
    const int in_sample = masked && r->base.masked_raw_logprobs;
    if (masked && !in_sample) K_CHECK(r, k_mask_logits(r->d_logits, B, vocab, r->d_fs_mask, r->d_fs_has, s));
    K_CHECK(r, k_sample_masked(r->d_logits, B, vocab, sp, in_sample ? r->d_fs_mask : NULL, r->d_fs_has, out_tok, out_lp,
                               r->d_top_ids, r->d_top_lps, NULL, s));
    K_CHECK(r, k_advance_lens(r->d_lens, slots, r->d_ones, B, RUNNER_TARGET, r->dummy, s));
    /* The captured store that resets the dummy slot after the advance: padding rows never
     * accumulate context, whatever a previous step or a bug left there. */
    CU_CHECK(r, cudaMemsetAsync(r->d_lens + 2 * r->dummy, 0, 2 * sizeof(int32_t), s));
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_enqueue_decode(cuda_runner *r, int B) {
    int rc = enqueue_decode_pass(r, B);
    return rc ? rc : enqueue_decode_tail(r, B, 0);
}

/* Fill the pinned decode inputs: n live rows then padding rows on the dummy slot (the
 * live rows' adjustments go to the device on the stream, ahead of the step). */
static int fill_dec_in(cuda_runner *r, const runner_decode_batch *b, int B, int params, int *want_top) {
    const int MB = r->base.cfg.max_batch;
    int32_t *tokens = r->h_dec_in, *slots = tokens + MB, *prev = tokens + 2 * MB;
    k_sample_params *sp = (k_sample_params *)((char *)tokens + cuda_dec_par_off(MB));
    int n = b ? b->n : 0, rc;
    *want_top = 0;
    if (params && b && b->sp && (rc = cuda_sample_prepare(r, b->sp, n, r->d_dec_in, NULL, sp, want_top))) return rc;
    for (int i = 0; i < B; i++) {
        if (i < n) {
            prev[i] = b->prev_row ? b->prev_row[i] : -1;
            tokens[i] = prev[i] >= 0 ? 0 : b->tokens[i];
            slots[i] = b->slots[i];
            if (!params || !b->sp) sp[i] = (k_sample_params){0};
        } else {
            tokens[i] = 0;
            prev[i] = -1;
            slots[i] = r->dummy;
            sp[i] = (k_sample_params){0};
        }
    }
    return 0;
}

void cuda_graph_size_list(int max_batch, int *sizes, int *n) {
    int k = 0, v[64];
    for (int b = 1; b <= 8 && b <= max_batch; b *= 2) v[k++] = b;
    for (int b = 16; b <= max_batch && b <= 64; b += 8) v[k++] = b;
    for (int b = 80; b <= max_batch && k < 63; b += 16) v[k++] = b;
    if (v[k - 1] != max_batch && k < 64) v[k++] = max_batch;
    for (int i = 0; i < k; i++) sizes[i] = v[k - 1 - i];   /* largest first */
    *n = k;
}

int cuda_capture_graphs(cuda_runner *r, char *err, size_t errlen) {
    int sizes[64], n = 0;
    cuda_graph_size_list(r->base.cfg.max_batch, sizes, &n);
    for (int i = 0; i < n; i++) {
        int B = sizes[i], rc;
        cudaGraph_t g = NULL;
        int no_top;
        if ((rc = fill_dec_in(r, NULL, B, 1, &no_top))) goto fail_rc;
        /* One eager run first: module loading and cuBLAS heuristics happen outside capture
         * (and FP8 GEMM plans are tuned for this size: cuda_fp8.c plan_tune). */
        r->fp8_tune_now = 1;
        rc = put_dec_in(r);
        if (!rc) rc = cuda_enqueue_decode(r, B);
        r->fp8_tune_now = 0;
        if (rc || (rc = cuda_step_sync(r))) goto fail_rc;
        CU_CHECK(r, cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeThreadLocal));
        rc = cuda_enqueue_decode(r, B);
        cudaError_t e = cudaStreamEndCapture(r->stream, &g);
        if (rc) goto fail_rc;
        CU_CHECK(r, e);
        e = cudaGraphInstantiate(&r->graphs[r->n_graphs], g, 0);
        cudaGraphDestroy(g);
        CU_CHECK(r, e);
        r->graph_sizes[r->n_graphs++] = B;
        CU_CHECK(r, cudaGraphLaunch(r->graphs[r->n_graphs - 1], r->stream));
        if ((rc = cuda_step_sync(r))) goto fail_rc;
    }
    if (r->fp8_tuned && !r->opts.quiet)
        fprintf(stderr, "cuda runner: FP8 GEMM plans timed at the decode sizes: %d, %d not the heuristic's first "
                        "(%.0f us -> %.0f us summed)\n", r->fp8_tuned, r->fp8_tune_changed, r->fp8_tune_us[0],
                r->fp8_tune_us[1]);
    cuda_fp8_tune_done(r);
    return 0;
fail:
fail_rc:
    r->fp8_tune_now = 0;
    cuda_fp8_tune_done(r);
    return specd_errf(err, errlen, SPECD_ECUDA, "cuda runner: capturing decode graphs: %s", r->errmsg);
}

void cuda_destroy_graphs(cuda_runner *r) {
    for (int i = 0; i < r->n_graphs; i++) {
        cudaGraphExecDestroy(r->graphs[i]);
        for (int h = 0; h < 2; h++)
            if (r->mgraphs[i][h]) cudaGraphExecDestroy(r->mgraphs[i][h]);
        r->mgraphs[i][0] = r->mgraphs[i][1] = NULL;
    }
    r->n_graphs = 0;
}

/* Capture graph size gi's two halves for constrained rows (first use of that size; the
 * stream is made idle first, as an op queued in flight may still run on it). */
static int capture_masked(cuda_runner *r, int gi) {
    const int B = r->graph_sizes[gi];
    CU_CHECK(r, cudaStreamSynchronize(r->stream));
    for (int h = 0; h < 2; h++) {
        cudaGraph_t g = NULL;
        CU_CHECK(r, cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeThreadLocal));
        int rc = h == 0 ? enqueue_decode_pass(r, B) : enqueue_decode_tail(r, B, 1);
        cudaError_t e = cudaStreamEndCapture(r->stream, &g);
        if (rc) return rc;
        CU_CHECK(r, e);
        e = cudaGraphInstantiate(&r->mgraphs[gi][h], g, 0);
        cudaGraphDestroy(g);
        CU_CHECK(r, e);
    }
    return 0;
fail:
    return SPECD_ECUDA;
}

/* A decode step with grammar masks: the pass (graph half 0) is under way while the caller
 * computes the masks (prepare_sp); then the sampling parameters and masks go to the device
 * and half 1 masks, samples and advances. Padding rows are unmasked and sample greedily. */
static int decode_masked(cuda_runner *r, const runner_decode_batch *b, int gi, int B, int half, int *want_top) {
    const int n = b->n;
    const size_t mw = ((size_t)r->m[0].c.vocab + 31) / 32;
    k_sample_params *par = r->h_fs_par;
    cudaStream_t s = r->stream;
    int rc;
    *want_top = 0;
    if (gi >= 0 && !r->mgraphs[gi][1] && (rc = capture_masked(r, gi))) return rc;
    if ((rc = fill_dec_in(r, b, B, 0, want_top)) || (rc = put_dec_in(r))) return rc;
    if (gi >= 0) CU_CHECK(r, cudaGraphLaunch(r->mgraphs[gi][0], s));
    else if ((rc = enqueue_decode_pass(r, B))) return rc;
    if (b->prepare_sp && (rc = b->prepare_sp(b->prepare_ctx))) {
        cudaStreamSynchronize(s);   /* the pass may still write; the lengths did not advance */
        return rc;
    }
    if ((rc = cuda_sample_prepare(r, b->sp, n, r->d_dec_in, NULL, par, want_top))) return rc;
    int rows = 0;   /* masked rows are within [0, rows) */
    for (int i = 0; i < B; i++) {
        const uint32_t *m = i < n ? b->sp[i].mask : NULL;
        if (i >= n) par[i] = (k_sample_params){0};
        r->h_fs_has[i] = m != NULL;
        if (m) {
            memcpy(r->h_fs_mask + (size_t)i * mw, m, mw * 4);
            rows = i + 1;
        }
    }
    CU_CHECK(r, cudaMemcpyAsync(r->d_fs_par, par, (size_t)B * sizeof *par, cudaMemcpyHostToDevice, s));
    CU_CHECK(r, cudaMemcpyAsync(r->d_fs_has, r->h_fs_has, (size_t)B * 4, cudaMemcpyHostToDevice, s));
    if (rows) CU_CHECK(r, cudaMemcpyAsync(r->d_fs_mask, r->h_fs_mask, (size_t)rows * mw * 4, cudaMemcpyHostToDevice, s));
    /* queued in flight: every staged input is on its way, so the next op may refill them */
    if (b->async) CU_CHECK(r, cudaEventRecord(r->ev_in[half], s));
    if (gi >= 0) CU_CHECK(r, cudaGraphLaunch(r->mgraphs[gi][1], s));
    else if ((rc = enqueue_decode_tail(r, B, 1))) return rc;
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_dec_inputs_done(cuda_runner *r) {
    if (r->n_dpend == 0) return 0;
    const struct cuda_dec_pending *p = &r->dpend[(r->dpend_head + r->n_dpend - 1) & 1];
    CU_CHECK(r, cudaEventSynchronize(r->ev_in[p->half]));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* The oldest queued op's outputs (a decode's, an async forward's, or a speculative
 * step's: cuda_spec_wait) into its batch's arrays. */
int cuda_wait_queued(runner *base) {
    cuda_runner *r = (cuda_runner *)base;
    if (r->n_dpend == 0) return 0;
    const struct cuda_dec_pending p = r->dpend[r->dpend_head];
    r->dpend_head ^= 1;
    r->n_dpend--;
    if (r->failed) return SPECD_ECUDA;
    if (p.spec_n) return cuda_spec_wait(r, &p);
    CU_CHECK(r, cudaEventSynchronize(r->ev_out[p.half]));
    const int MB = base->cfg.max_batch, n = p.b.n;
    const int32_t *tok = (const int32_t *)r->h_dec_out + (size_t)p.half * 2 * MB;
    const float *lp = (const float *)(tok + MB);
    memcpy(p.b.out_tokens, tok, (size_t)n * sizeof(int32_t));
    if (p.b.out_logprobs) memcpy(p.b.out_logprobs, lp, (size_t)n * sizeof(float));
    if (p.want_top) {   /* K_MAX_TOP == RUNNER_MAX_TOP: the same row stride */
        const size_t off = (size_t)p.half * MB * K_MAX_TOP, tk = (size_t)n * K_MAX_TOP;
        memcpy(p.b.out_top_ids, r->h_dec_top_ids + off, tk * sizeof(int32_t));
        memcpy(p.b.out_top_logprobs, r->h_dec_top_lps + off, tk * sizeof(float));
    }
    return 0;
fail:
    return SPECD_ECUDA;
}

/* A decode step: its inputs (and the slot changes before it) to the device, the graph of
 * the smallest captured size that holds its rows (or the eager pass), its outputs to its
 * half of the host buffers. The length mirror advances now. Async: queued, completed by
 * cuda_wait_queued; else waited for here. */
int cuda_decode(runner *base, const runner_decode_batch *b) {
    cuda_runner *r = (cuda_runner *)base;
    const int MB = base->cfg.max_batch;
    if (r->failed) return SPECD_ECUDA;
    if (!b || b->n < 1 || b->n > MB || !b->slots || !b->tokens || !b->out_tokens) return SPECD_EINVAL;
    if (b->async ? !base->decode_async || r->n_dpend == 2 : r->n_dpend != 0) return SPECD_ESTATE;
    int masked = b->prepare_sp != NULL;
    for (int i = 0; b->sp && i < b->n; i++) masked |= b->sp[i].mask != NULL;
    if (masked && (b->async || b->prev_row) && !base->async_masks) return SPECD_EINVAL;
    for (int i = 0; i < b->n; i++) {
        int s = b->slots[i];
        const int pr = b->prev_row ? b->prev_row[i] : -1;
        if (s < 0 || s >= MB || pr >= MB || (pr < 0 && (b->tokens[i] < 0 || b->tokens[i] >= r->m[0].c.vocab)))
            return SPECD_EINVAL;
        if (r->h_len[s * 2] + 1 > base->cfg.max_seq_len) return SPECD_ERANGE;
        for (int k = 0; k < i; k++)
            if (b->slots[k] == s) return SPECD_EINVAL;
    }
    /* Smallest captured size >= n (graph_sizes is largest first). */
    int gi = -1;
    for (int i = 0; i < r->n_graphs; i++)
        if (r->graph_sizes[i] >= b->n) gi = i;
    int B = gi >= 0 ? r->graph_sizes[gi] : b->n, want_top, rc;
    cudaStream_t s = r->stream;
    if ((rc = cuda_upload_slots(r))) return rc;   /* (after the last queued decode's inputs are in) */
    r->sp_last_rows = 0;   /* (a speculative step after this one has no rows to continue) */
    const int half = r->dec_half;
    const int profiled = r->tune.profile_step > 0 && ++r->n_decode_steps == r->tune.profile_step;
    if (profiled) CU_CHECK(r, cudaProfilerStart());
    if (masked) {
        if (!base->decode_masks || !b->sp) return SPECD_EINVAL;
        if ((rc = decode_masked(r, b, gi, B, half, &want_top))) return rc;
    } else {
        if ((rc = fill_dec_in(r, b, B, 1, &want_top)) || (rc = put_dec_in(r))) return rc;
        CU_CHECK(r, cudaEventRecord(r->ev_in[half], s));
        if (gi >= 0) {
            CU_CHECK(r, cudaGraphLaunch(r->graphs[gi], s));
        } else if (cuda_enqueue_decode(r, B)) {
            goto fail;
        }
    }
    want_top = want_top && b->out_top_ids && b->out_top_logprobs;
    CU_CHECK(r, cudaMemcpyAsync((int32_t *)r->h_dec_out + (size_t)half * 2 * MB, r->d_dec_out, (size_t)MB * 8,
                                cudaMemcpyDeviceToHost, s));
    if (want_top) {
        const size_t off = (size_t)half * MB * K_MAX_TOP, tk = (size_t)b->n * K_MAX_TOP;
        CU_CHECK(r, cudaMemcpyAsync(r->h_dec_top_ids + off, r->d_top_ids, tk * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
        CU_CHECK(r, cudaMemcpyAsync(r->h_dec_top_lps + off, r->d_top_lps, tk * sizeof(float), cudaMemcpyDeviceToHost, s));
    }
    CU_CHECK(r, cudaEventRecord(r->ev_out[half], s));
    if (profiled) CU_CHECK(r, cudaProfilerStop());
    r->dec_half ^= 1;
    for (int i = 0; i < b->n; i++) r->h_len[b->slots[i] * 2] += 1;
    r->h_len[2 * r->dummy] = r->h_len[2 * r->dummy + 1] = 0;   /* as the captured reset does */
    return cuda_push_pending(r, &(struct cuda_dec_pending){.b = *b, .half = half, .want_top = want_top}, b->async);
fail:
    return SPECD_ECUDA;
}

int cuda_push_pending(cuda_runner *r, const struct cuda_dec_pending *p, int async) {
    r->dpend[(r->dpend_head + r->n_dpend) & 1] = *p;
    r->n_dpend++;
    if (async) return 0;
    if (r->opts.world > 1) {   /* the group's collectives, watched */
        int rc = cuda_step_sync(r);
        if (rc) {
            r->n_dpend = 0;
            return rc;
        }
    }
    return cuda_wait_queued(&r->base);
}
