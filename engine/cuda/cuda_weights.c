/* Weight upload for the CUDA runner: converts each tensor view to bf16 on the host
 * (tensor_to_bf16 also dequantizes GGUF and undoes its Q/K permutation), fuses Q|K|V and
 * gate|up into one matrix each so one GEMM serves them, and copies this rank's slice to
 * the device. Tensor parallelism (rank of world) splits Q/K/V/gate/up by output rows
 * (heads / intermediate) and O/down by input columns (the same offsets as shard.c, which
 * tests/test_shard.c checks on the CPU); embedding, lm_head and norms are replicated.
 *
 * With opts.random_weights the views are ignored and weights are filled on the device
 * (uniform, std 0.02; norms near 1), so benchmarks of 8B shapes need no host weights;
 * a shard's fill is its slice of the unsharded fill.
 *
 * FP8 projections (cm->fp8: --dtype fp8, or an FP8 checkpoint left as it is; one GPU):
 * Q|K|V, O, gate|up and down become E4M3 bytes with a scale per row. A checkpoint's
 * bytes and per-tensor / per-row scales are copied as they are; anything else (bf16,
 * GGUF, block-scaled FP8, random fills) goes to the device as bf16 through a staging
 * matrix and is quantized there per row (k_quant_fp8_rows: the bytes the CPU runner's
 * fp8_round_row rounds to). Embeddings, lm_head, norms, routers and experts stay bf16.
 *
 * GGUF blocks kept (--dtype gguf, one GPU): the projections, the token embedding (rows
 * decoded by k_embed_q as they are gathered) and the output matrix (cuda_step.c lm_head_q;
 * SPECD_CUDA_LM_HEAD_BF16=1 dequantizes it at load instead) stay in their Q8_0 / Q4_0 /
 * Q4_1 / Q4_K / Q5_K / Q6_K blocks. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cuda/cuda_internal.h"
#include "engine/core/err.h"
#include "kernels/quant_blocks.h"
#include "engine/model/fp8.h"

/* Host staging for one conversion, reused across tensors. */
typedef struct {
    uint16_t *bf;
    float *f;
    size_t cap_bf, cap_f;   /* elements */
} staging;

static int stage_reserve(staging *s, size_t n, int f32) {
    size_t *cap = f32 ? &s->cap_f : &s->cap_bf;
    void **buf = f32 ? (void **)&s->f : (void **)&s->bf;
    if (n <= *cap) return 0;
    free(*buf);
    *buf = malloc(n * (f32 ? sizeof(float) : sizeof(uint16_t)));
    *cap = *buf ? n : 0;
    return *buf ? 0 : SPECD_ENOMEM;
}

static int check_view(const tensor_view *t, int64_t rows, int64_t cols, const char *name,
                      int layer, char *err, size_t errlen) {
    int64_t want = rows * (cols ? cols : 1);
    if (!t->data)
        return specd_errf(err, errlen, SPECD_ENOTFOUND, "cuda runner: layer %d: tensor %s missing",
                          layer, name);
    if (tensor_numel(t) != want)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "cuda runner: layer %d: tensor %s has %lld elements, expected %lld",
                          layer, name, (long long)tensor_numel(t), (long long)want);
    return 0;
}

static void *dalloc(cuda_runner *r, cuda_model *cm, size_t bytes) {
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cuda_fail(r, __FILE__, __LINE__, "cudaMalloc(weights)", "out of device memory");
        return NULL;
    }
    cm->weight_bytes += bytes;
    return p;
}

/* Upload rows [row0, row0+nrows) x cols [col0, col0+ncols) of view t (full shape
 * rows_all x cols_all) as bf16 into dst with leading dimension ncols. */
static int upload_bf16(cuda_runner *r, staging *s, const tensor_view *t, int64_t rows_all,
                       int64_t cols_all, int64_t row0, int64_t nrows, int64_t col0,
                       int64_t ncols, uint16_t *dst) {
    if (stage_reserve(s, (size_t)(rows_all * cols_all), 0)) return SPECD_ENOMEM;
    int rc = tensor_to_bf16(t, s->bf);
    if (rc) return rc;
    CU_CHECK(r, cudaMemcpy2D(dst, (size_t)ncols * 2, s->bf + row0 * cols_all + col0,
                             (size_t)cols_all * 2, (size_t)ncols * 2, (size_t)nrows,
                             cudaMemcpyHostToDevice));
    return 0;
fail:
    return SPECD_ECUDA;
}

static int upload_f32(cuda_runner *r, staging *s, const tensor_view *t, int64_t off, int64_t n,
                      float *dst) {
    if (stage_reserve(s, (size_t)tensor_numel(t), 1)) return SPECD_ENOMEM;
    int rc = tensor_to_f32(t, s->f);
    if (rc) return rc;
    CU_CHECK(r, cudaMemcpy(dst, s->f + off, (size_t)n * 4, cudaMemcpyHostToDevice));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* A norm's weights, as (1 + w) when the model stores them that way (Gemma, HF). */
static int upload_norm(cuda_runner *r, staging *s, const tensor_view *t, int64_t n, float *dst, int plus_one) {
    if (stage_reserve(s, (size_t)tensor_numel(t), 1)) return SPECD_ENOMEM;
    int rc = tensor_to_f32(t, s->f);
    if (rc) return rc;
    for (int64_t i = 0; plus_one && i < n; i++) s->f[i] += 1.0f;
    CU_CHECK(r, cudaMemcpy(dst, s->f, (size_t)n * 4, cudaMemcpyHostToDevice));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* ---- FP8 projections ------------------------------------------------------------------ */

/* Where a projection's bf16 goes first: its own matrix, or for FP8 the staging matrix
 * that fp8_finish quantizes from. */
static uint16_t *proj_bf16(const cuda_model *cm, uint16_t *w, uint16_t *stage) { return cm->fp8 ? stage : w; }

/* The staged bf16 [rows, cols] quantized per row into w (E4M3 bytes) and scale [rows];
 * waits, so the staging matrix can be overwritten by the host next. */
static int fp8_finish(cuda_runner *r, const cuda_model *cm, const uint16_t *stage, uint16_t *w, float *scale,
                      int64_t rows, int64_t cols) {
    if (!cm->fp8) return 0;
    K_CHECK(r, k_quant_fp8_rows(stage, (int)rows, (int)cols, (uint8_t *)w, scale, r->stream));
    CU_CHECK(r, cudaStreamSynchronize(r->stream));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* One FP8 projection from views v[0..n) (their rows one after another, as the bf16 form
 * fuses Q|K|V and gate|up): a checkpoint's bytes and row scales as stored when every view
 * has them and the runner keeps them, else through bf16 and the device quantizer. */
static int fp8_upload(cuda_runner *r, const cuda_model *cm, staging *s, const tensor_view *const *v, int n,
                      uint16_t *w, float *scale, uint16_t *stage) {
    int64_t rows = 0, cols = v[0]->shape[1];
    int raw = r->tune.fp8_weights >= 0, rc = 0;
    for (int i = 0; i < n; i++) {
        rows += v[i]->shape[0];
        raw &= v[i]->dtype == TDT_F8_E4M3 && v[i]->scale_cols == 1 && v[i]->scale_block[1] >= cols;
    }
    if (raw) {
        uint8_t *hb = malloc((size_t)rows * (size_t)cols);
        float *hs = malloc((size_t)rows * sizeof *hs);
        int64_t r0 = 0;
        rc = hb && hs ? 0 : SPECD_ENOMEM;
        for (int i = 0; i < n && !rc; i++) {
            if (!(rc = tensor_rows_raw(v[i], 0, v[i]->shape[0], hb + r0 * cols, NULL)))
                rc = tensor_fp8_row_scales(v[i], hs + r0);
            r0 += v[i]->shape[0];
        }
        if (!rc && (cudaMemcpy(w, hb, (size_t)rows * (size_t)cols, cudaMemcpyHostToDevice) != cudaSuccess ||
                    cudaMemcpy(scale, hs, (size_t)rows * sizeof *hs, cudaMemcpyHostToDevice) != cudaSuccess)) {
            cuda_fail(r, __FILE__, __LINE__, "cudaMemcpy(FP8 weights)", "copy failed");
            rc = SPECD_ECUDA;
        }
        free(hb);
        free(hs);
        return rc;
    }
    int64_t r0 = 0;
    for (int i = 0; i < n && !rc; i++) {
        rc = upload_bf16(r, s, v[i], v[i]->shape[0], cols, 0, v[i]->shape[0], 0, cols, stage + r0 * cols);
        r0 += v[i]->shape[0];
    }
    /* A copy from pageable memory may return before its DMA lands, and the quantizer runs
     * on r->stream, which does not wait for the legacy stream: wait for the copies. */
    if (!rc && cudaDeviceSynchronize() != cudaSuccess) {
        cuda_fail(r, __FILE__, __LINE__, "cudaDeviceSynchronize(FP8 staging)", "failed");
        rc = SPECD_ECUDA;
    }
    return rc ? rc : fp8_finish(r, cm, stage, w, scale, rows, cols);
}

/* ---- projections kept quantized (--dtype gguf, or auto on a GPU too small for bf16) ------ */

/* The block type all of views v[0..n) share when the kernels read it in place (Q8_0, Q4_K,
 * Q6_K, Q4_0, Q4_1, Q5_K; rows a whole number of blocks), else 0: the matrix goes to bf16. */
static int quant_type(const cuda_runner *r, const tensor_view *const *v, int n) {
    if (!r->tune.quant_weights || r->opts.random_weights || r->opts.world > 1) return 0;
    int t = tensor_ggml_type(v[0]);
    if (!qb_bytes(t)) return 0;   /* a type kernels/gemv_q.cu does not read */
    for (int i = 0; i < n; i++)
        if (!v[i]->data || v[i]->ndim != 2 || tensor_ggml_type(v[i]) != t || v[i]->shape[1] % qb_elems(t)) return 0;
    return t;
}

static size_t qrow_bytes(int t, int64_t cols) { return (size_t)(cols / qb_elems(t)) * (size_t)qb_bytes(t); }

size_t cuda_qmat_bytes(const cuda_qmat *q) {
    if (!q->type) return 0;
    if (!q->type2) return (size_t)q->rows * qrow_bytes(q->type, q->cols);
    return q->off2 + (size_t)(q->rows - q->rows1) * qrow_bytes(q->type2, q->cols);
}

/* Device storage for the concatenated rows of v[0..n) (their logical rows, one after
 * another, as the bf16 form fuses Q|K|V and gate|up): v[0..n1) in type t, v[n1..n) in t2
 * (0: n1 == n, one type) from a 16-byte boundary on. */
static int quant_alloc2(cuda_runner *r, cuda_model *cm, cuda_qmat *q, const tensor_view *const *v, int n, int t,
                        int n1, int t2) {
    int64_t rows = 0, rows1 = 0, cols = v[0]->shape[1];
    for (int i = 0; i < n; i++) {
        rows += v[i]->shape[0];
        if (i < n1) rows1 += v[i]->shape[0];
    }
    q->type = t;
    q->rows = (int)rows;
    q->cols = (int)cols;
    q->rows1 = t2 ? (int)rows1 : (int)rows;
    q->type2 = t2;
    q->off2 = t2 ? ((size_t)rows1 * qrow_bytes(t, cols) + 15) & ~(size_t)15 : 0;
    if (!(q->w = dalloc(r, cm, cuda_qmat_bytes(q)))) return SPECD_ENOMEM;
    if ((size_t)rows * (size_t)cols > cm->q_scratch) cm->q_scratch = (size_t)rows * (size_t)cols;
    return 0;
}
static int quant_alloc(cuda_runner *r, cuda_model *cm, cuda_qmat *q, const tensor_view *const *v, int n, int t) {
    return quant_alloc2(r, cm, q, v, n, t, n, 0);
}

/* The token embedding or the output matrix in its blocks: view v [rows, hidden] when
 * quant_type takes it; its bf16 copy is never made (k_embed_q gathers decoded rows; the
 * lm_head runs in vocabulary chunks through the scratch buffer past the GEMVs, so the
 * scratch grows to at least LM_CHUNK_ROWS rows of it, not to the whole matrix). */
#define LM_CHUNK_ROWS 16384
static void lm_scratch(cuda_model *cm, int64_t rows, int64_t hidden) {
    const size_t chunk = (size_t)(rows < LM_CHUNK_ROWS ? rows : LM_CHUNK_ROWS) * (size_t)hidden;
    if (chunk > cm->q_scratch) cm->q_scratch = chunk;
}
static int quant_table(cuda_runner *r, cuda_model *cm, cuda_qmat *q, const tensor_view *v, int64_t rows,
                       int64_t hidden, int lm) {
    const tensor_view *vs[1] = {v};
    int t = v && v->ndim == 2 && v->shape[0] == rows && v->shape[1] == hidden ? quant_type(r, vs, 1) : 0;
    if (!t) return 0;
    const size_t keep = cm->q_scratch;
    if (quant_alloc(r, cm, q, vs, 1, t)) return SPECD_ENOMEM;
    cm->q_scratch = keep;
    if (lm) lm_scratch(cm, rows, hidden);
    return 0;
}

static int quant_upload(cuda_runner *r, const cuda_qmat *q, const tensor_view *const *v, int n) {
    const size_t rb1 = qrow_bytes(q->type, q->cols), rb2 = q->type2 ? qrow_bytes(q->type2, q->cols) : rb1;
    const size_t bytes = q->type2 ? q->off2 + (size_t)(q->rows - q->rows1) * rb2 : (size_t)q->rows * rb1;
    uint8_t *h = calloc(1, bytes), *p = h;
    int rc = h ? 0 : SPECD_ENOMEM;
    for (int i = 0, row = 0; i < n && !rc; i++) {
        const int second = row >= q->rows1;
        const size_t want = second ? rb2 : rb1;
        size_t rb = 0;
        if (second && p < h + q->off2) p = h + q->off2;
        rc = tensor_rows_raw(v[i], 0, v[i]->shape[0], p, &rb);
        if (!rc && rb != want) rc = SPECD_EFORMAT;
        p += (size_t)v[i]->shape[0] * want;
        row += (int)v[i]->shape[0];
    }
    if (!rc && cudaMemcpy(q->w, h, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        cuda_fail(r, __FILE__, __LINE__, "cudaMemcpy(quantized weights)", "copy failed");
        rc = SPECD_ECUDA;
    }
    free(h);
    return rc;
}

static uint64_t mix_seed(uint64_t seed, uint64_t tag) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (tag + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Random device weights: std 0.02 for matrices (uniform +-0.02*sqrt(3)), norms in
 * [0.9, 1.1], biases +-0.02. Each logical tensor (q, k, v, o, gate, up, down, ...) has its
 * own stream indexed by its unsharded element index, so rank `rank` of a group holds
 * exactly its slice of what one GPU holds: TP 2 and TP 1 run the same model. */
static int fill_random(cuda_runner *r, cuda_model *cm, uint64_t seed, int rank, uint16_t *stage) {
    const model_config *c = &cm->c;
    const size_t hidden = (size_t)c->hidden, D = (size_t)cm->D, H = (size_t)cm->H, KVH = (size_t)cm->KVH;
    const size_t F = (size_t)cm->ffn, qd = H * D, kd = KVH * D, rk = (size_t)rank;
    const size_t full_qd = (size_t)c->n_heads * D, full_F = (size_t)c->ffn;
    float a = 0.02f * sqrtf(3.f);
    uint64_t tag = 0;
    cudaStream_t st = r->stream;
    const uint64_t embed_seed = mix_seed(seed, tag++);
    K_CHECK(r, k_fill_uniform_bf16(cm->embed, (size_t)c->vocab * hidden, embed_seed, a, st));
    if (cm->lm_head != cm->embed)   /* its own tensor, or a vocabulary slice of the tied one */
        K_CHECK(r, k_fill_uniform_bf16_slice(cm->lm_head, (size_t)cm->vocab_rows, hidden, (size_t)cm->vocab_row0, 0,
                                             hidden, c->tied_embeddings ? embed_seed : mix_seed(seed, tag++), a, st));
    K_CHECK(r, k_fill_uniform_f32(cm->out_norm, hidden, mix_seed(seed, tag++), 0.9f, 1.1f, st));
    for (int l = 0; l < c->n_layers; l++) {
        cuda_layer *L = &cm->layers[l];
        uint16_t *q = proj_bf16(cm, L->wqkv, stage), *k = q + qd * hidden, *v = k + kd * hidden;
        K_CHECK(r, k_fill_uniform_bf16_slice(q, qd, hidden, rk * qd, 0, hidden, mix_seed(seed, tag++), a, st));
        K_CHECK(r, k_fill_uniform_bf16_slice(k, kd, hidden, rk * kd, 0, hidden, mix_seed(seed, tag++), a, st));
        K_CHECK(r, k_fill_uniform_bf16_slice(v, kd, hidden, rk * kd, 0, hidden, mix_seed(seed, tag++), a, st));
        if (fp8_finish(r, cm, stage, L->wqkv, L->sqkv, (int64_t)(qd + 2 * kd), (int64_t)hidden)) goto fail;
        K_CHECK(r, k_fill_uniform_bf16_slice(proj_bf16(cm, L->wo, stage), hidden, qd, 0, rk * qd, full_qd,
                                             mix_seed(seed, tag++), a, st));
        if (fp8_finish(r, cm, stage, L->wo, L->so, (int64_t)hidden, (int64_t)qd)) goto fail;
        if (L->router) {   /* experts: each rank its rows [rk * F, (rk + 1) * F) of every expert */
            const size_t E = (size_t)c->n_experts, MF = (size_t)c->moe_ffn;
            K_CHECK(r, k_fill_uniform_bf16(L->router, E * hidden, mix_seed(seed, tag++), a, st));
            const uint64_t gu_seed = mix_seed(seed, tag++);
            for (size_t e = 0; e < E; e++)   /* the unsharded tensor: [E][gate MF; up MF][hidden] */
                for (size_t h = 0; h < 2; h++)
                    K_CHECK(r, k_fill_uniform_bf16_slice(L->exp_gu + (e * 2 + h) * F * hidden, F, hidden,
                                                         (e * 2 + h) * MF + rk * F, 0, hidden, gu_seed, a, st));
            /* [E][hidden][MF]: rows of every expert, this rank's columns */
            K_CHECK(r, k_fill_uniform_bf16_slice(L->exp_down, E * hidden, F, 0, rk * F, MF, mix_seed(seed, tag++),
                                                 a, st));
        } else {
            uint16_t *gu = proj_bf16(cm, L->wgu, stage);
            K_CHECK(r, k_fill_uniform_bf16_slice(gu, F, hidden, rk * F, 0, hidden, mix_seed(seed, tag++), a, st));
            K_CHECK(r, k_fill_uniform_bf16_slice(gu + F * hidden, F, hidden, rk * F, 0, hidden,
                                                 mix_seed(seed, tag++), a, st));
            if (fp8_finish(r, cm, stage, L->wgu, L->sgu, (int64_t)(2 * F), (int64_t)hidden)) goto fail;
            K_CHECK(r, k_fill_uniform_bf16_slice(proj_bf16(cm, L->wdown, stage), hidden, F, 0, rk * F, full_F,
                                                 mix_seed(seed, tag++), a, st));
            if (fp8_finish(r, cm, stage, L->wdown, L->sdown, (int64_t)hidden, (int64_t)F)) goto fail;
        }
        K_CHECK(r, k_fill_uniform_f32(L->attn_norm, hidden, mix_seed(seed, tag++), 0.9f, 1.1f, st));
        K_CHECK(r, k_fill_uniform_f32(L->ffn_norm, hidden, mix_seed(seed, tag++), 0.9f, 1.1f, st));
        if (L->bqkv) {
            K_CHECK(r, k_fill_uniform_f32_at(L->bqkv, qd, rk * qd, mix_seed(seed, tag++), -0.02f, 0.02f, st));
            K_CHECK(r, k_fill_uniform_f32_at(L->bqkv + qd, kd, rk * kd, mix_seed(seed, tag++), -0.02f, 0.02f, st));
            K_CHECK(r, k_fill_uniform_f32_at(L->bqkv + qd + kd, kd, rk * kd, mix_seed(seed, tag++), -0.02f, 0.02f, st));
        }
        if (L->q_norm) K_CHECK(r, k_fill_uniform_f32(L->q_norm, D, mix_seed(seed, tag++), 0.9f, 1.1f, st));
        if (L->k_norm) K_CHECK(r, k_fill_uniform_f32(L->k_norm, D, mix_seed(seed, tag++), 0.9f, 1.1f, st));
        if (L->post_attn_norm) {   /* Gemma 3's norms after attention and MLP */
            K_CHECK(r, k_fill_uniform_f32(L->post_attn_norm, hidden, mix_seed(seed, tag++), 0.9f, 1.1f, st));
            K_CHECK(r, k_fill_uniform_f32(L->post_ffn_norm, hidden, mix_seed(seed, tag++), 0.9f, 1.1f, st));
        }
    }
    CU_CHECK(r, cudaStreamSynchronize(st));
    return 0;
fail:
    return SPECD_ECUDA;
}

static int load_layer(cuda_runner *r, cuda_model *cm, staging *s, const model_layer *ml, int l,
                      int rank, uint16_t *stage, char *err, size_t errlen) {
    const model_config *c = &cm->c;
    cuda_layer *L = &cm->layers[l];
    int64_t hidden = c->hidden, D = c->head_dim, H = c->n_heads, KVH = c->n_kv_heads;
    int64_t h = cm->H, kvh = cm->KVH, F = cm->ffn;
    int rc;
    if ((rc = check_view(&ml->wq, H * D, hidden, "q_proj", l, err, errlen)) ||
        (rc = check_view(&ml->wk, KVH * D, hidden, "k_proj", l, err, errlen)) ||
        (rc = check_view(&ml->wv, KVH * D, hidden, "v_proj", l, err, errlen)) ||
        (rc = check_view(&ml->wo, hidden, H * D, "o_proj", l, err, errlen)) ||
        (!c->n_experts && (rc = check_view(&ml->w_gate, c->ffn, hidden, "gate_proj", l, err, errlen))) ||
        (!c->n_experts && (rc = check_view(&ml->w_up, c->ffn, hidden, "up_proj", l, err, errlen))) ||
        (!c->n_experts && (rc = check_view(&ml->w_down, hidden, c->ffn, "down_proj", l, err, errlen))) ||
        (rc = check_view(&ml->attn_norm, hidden, 0, "input_layernorm", l, err, errlen)) ||
        (rc = check_view(&ml->ffn_norm, hidden, 0, "post_attention_layernorm", l, err, errlen)))
        return rc;
    const tensor_view *vqkv[3] = {&ml->wq, &ml->wk, &ml->wv}, *vgu[2] = {&ml->w_gate, &ml->w_up};
    const tensor_view *vo[1] = {&ml->wo}, *vdown[1] = {&ml->w_down};
    if ((L->qqkv.type && (rc = quant_upload(r, &L->qqkv, vqkv, 3))) ||
        (L->qo.type && (rc = quant_upload(r, &L->qo, vo, 1))) ||
        (L->qgu.type && (rc = quant_upload(r, &L->qgu, vgu, 2))) ||
        (L->qdown.type && (rc = quant_upload(r, &L->qdown, vdown, 1))))
        goto out;
    uint16_t *q = L->wqkv, *k = q + h * D * hidden, *v = k + kvh * D * hidden;
    if (cm->fp8 && ((rc = fp8_upload(r, cm, s, vqkv, 3, L->wqkv, L->sqkv, stage)) ||
                    (rc = fp8_upload(r, cm, s, vo, 1, L->wo, L->so, stage)) ||
                    (!c->n_experts && (rc = fp8_upload(r, cm, s, vgu, 2, L->wgu, L->sgu, stage))) ||
                    (!c->n_experts && (rc = fp8_upload(r, cm, s, vdown, 1, L->wdown, L->sdown, stage)))))
        goto out;
    if (cm->fp8) {
        /* projections done */
    } else if ((L->wqkv && (rc = upload_bf16(r, s, &ml->wq, H * D, hidden, rank * h * D, h * D, 0, hidden, q))) ||
        (L->wqkv && (rc = upload_bf16(r, s, &ml->wk, KVH * D, hidden, rank * kvh * D, kvh * D, 0, hidden, k))) ||
        (L->wqkv && (rc = upload_bf16(r, s, &ml->wv, KVH * D, hidden, rank * kvh * D, kvh * D, 0, hidden, v))) ||
        (L->wo && (rc = upload_bf16(r, s, &ml->wo, hidden, H * D, 0, hidden, rank * h * D, h * D, L->wo))) ||
        (L->wgu && (rc = upload_bf16(r, s, &ml->w_gate, c->ffn, hidden, rank * F, F, 0, hidden, L->wgu))) ||
        (L->wgu && (rc = upload_bf16(r, s, &ml->w_up, c->ffn, hidden, rank * F, F, 0, hidden, L->wgu + F * hidden))) ||
        (L->wdown && (rc = upload_bf16(r, s, &ml->w_down, hidden, c->ffn, 0, hidden, rank * F, F, L->wdown)))) {
        goto out;
    }
    if ((rc = upload_norm(r, s, &ml->attn_norm, hidden, L->attn_norm, c->norm_plus_one)) ||
        (rc = upload_norm(r, s, &ml->ffn_norm, hidden, L->ffn_norm, c->norm_plus_one)))
        goto out;
    if (L->post_attn_norm) {
        if ((rc = check_view(&ml->post_attn_norm, hidden, 0, "post_attention_norm", l, err, errlen)) ||
            (rc = check_view(&ml->post_ffn_norm, hidden, 0, "post_feedforward_norm", l, err, errlen)))
            return rc;
        if ((rc = upload_norm(r, s, &ml->post_attn_norm, hidden, L->post_attn_norm, c->norm_plus_one)) ||
            (rc = upload_norm(r, s, &ml->post_ffn_norm, hidden, L->post_ffn_norm, c->norm_plus_one)))
            goto out;
    }
    if (L->router) {   /* experts: the router, then each expert's [gate; up] and down (this
                        * rank's F of its MF rows, as the dense MLP's) */
        const int64_t E = c->n_experts, MF = c->moe_ffn;
        if ((rc = check_view(&ml->router, E, hidden, "router", l, err, errlen))) return rc;
        for (int64_t e = 0; e < E; e++)
            if ((rc = check_view(&ml->exp_gate[e], MF, hidden, "expert gate", l, err, errlen)) ||
                (rc = check_view(&ml->exp_up[e], MF, hidden, "expert up", l, err, errlen)) ||
                (rc = check_view(&ml->exp_down[e], hidden, MF, "expert down", l, err, errlen)))
                return rc;
        if ((rc = upload_bf16(r, s, &ml->router, E, hidden, 0, E, 0, hidden, L->router))) goto out;
        for (int64_t e = 0; e < E; e++) {
            uint16_t *gu = L->exp_gu + (size_t)e * 2 * F * hidden, *dn = L->exp_down + (size_t)e * hidden * F;
            if ((rc = upload_bf16(r, s, &ml->exp_gate[e], MF, hidden, rank * F, F, 0, hidden, gu)) ||
                (rc = upload_bf16(r, s, &ml->exp_up[e], MF, hidden, rank * F, F, 0, hidden, gu + F * hidden)) ||
                (rc = upload_bf16(r, s, &ml->exp_down[e], hidden, MF, 0, hidden, rank * F, F, dn)))
                goto out;
        }
    }
    if (L->bqkv) {
        if ((rc = check_view(&ml->bq, H * D, 0, "q_proj.bias", l, err, errlen)) ||
            (rc = check_view(&ml->bk, KVH * D, 0, "k_proj.bias", l, err, errlen)) ||
            (rc = check_view(&ml->bv, KVH * D, 0, "v_proj.bias", l, err, errlen)))
            return rc;
        if ((rc = upload_f32(r, s, &ml->bq, rank * h * D, h * D, L->bqkv)) ||
            (rc = upload_f32(r, s, &ml->bk, rank * kvh * D, kvh * D, L->bqkv + h * D)) ||
            (rc = upload_f32(r, s, &ml->bv, rank * kvh * D, kvh * D, L->bqkv + (h + kvh) * D)))
            goto out;
    }
    if (L->q_norm) {
        if ((rc = check_view(&ml->q_norm, D, 0, "q_norm", l, err, errlen)) ||
            (rc = check_view(&ml->k_norm, D, 0, "k_norm", l, err, errlen)))
            return rc;
        if ((rc = upload_norm(r, s, &ml->q_norm, D, L->q_norm, c->norm_plus_one)) ||
            (rc = upload_norm(r, s, &ml->k_norm, D, L->k_norm, c->norm_plus_one)))
            goto out;
    }
    return 0;
out:
    return specd_errf(err, errlen, rc, "cuda runner: layer %d: converting weights: %s%s%s", l,
                      specd_strerror(rc), r->errmsg[0] ? ": " : "", r->errmsg);
}

int cuda_model_load(cuda_runner *r, cuda_model *cm, const model *m, int rank, int world,
                    char *err, size_t errlen) {
    const model_config *c = &m->cfg;
    staging s = {0};
    uint16_t *stage = NULL;   /* FP8: the bf16 staging matrix (the largest projection) */
    int rc = SPECD_ECUDA;
    memset(cm, 0, sizeof *cm);
    cm->c = *c;
    const int ffn_all = c->n_experts ? c->moe_ffn : c->ffn;   /* MoE: an expert's width */
    if (world < 1 || rank < 0 || rank >= world || c->n_heads % world || c->n_kv_heads % world || ffn_all % world)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "cuda runner: %s: heads %d / kv heads %d / ffn %d do not split over %d ranks",
                          m->path, c->n_heads, c->n_kv_heads, ffn_all, world);
    if (c->n_heads % c->n_kv_heads ||
        (c->head_dim != 32 && c->head_dim != 64 && c->head_dim != 128 && c->head_dim != 256))
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "cuda runner: %s: head_dim %d (32, 64, 128 or 256 supported), heads %d, kv heads %d",
                          m->path, c->head_dim, c->n_heads, c->n_kv_heads);
    cm->H = c->n_heads / world;
    cm->KVH = c->n_kv_heads / world;
    cm->D = c->head_dim;
    cm->ffn = ffn_all / world;   /* this rank's rows of the MLP (MoE: of each expert) */
    size_t hidden = (size_t)c->hidden, D = (size_t)cm->D, qkv = (size_t)(cm->H + 2 * cm->KVH) * D;
    cm->layers = calloc((size_t)c->n_layers, sizeof *cm->layers);
    if (!cm->layers) return specd_errf(err, errlen, SPECD_ENOMEM, "cuda runner: out of host memory");

    /* GGUF blocks kept (one GPU, quant_type): the embedding, and the output matrix unless
     * SPECD_CUDA_LM_HEAD_BF16; a tied output shares the embedding's blocks */
    const tensor_view *lm_view = r->opts.random_weights ? NULL : c->tied_embeddings ? &m->tok_embd : &m->lm_head;
    if (!r->opts.random_weights && quant_table(r, cm, &cm->qembed, &m->tok_embd, c->vocab, c->hidden, 0)) goto oom;
    if (!cm->qembed.type && !(cm->embed = dalloc(r, cm, (size_t)c->vocab * hidden * 2))) goto oom;
    /* lm_head: all rows, or this rank's 1/world of the vocabulary (tensor parallelism) */
    int parts = cm->vocab_parts > 1 && c->vocab % cm->vocab_parts == 0 ? cm->vocab_parts : 1;
    cm->vocab_parts = parts;
    cm->vocab_rows = c->vocab / parts;
    cm->vocab_row0 = parts > 1 ? rank * cm->vocab_rows : 0;
    if (lm_view && parts == 1 && !r->tune.lm_head_bf16) {
        if (c->tied_embeddings && cm->qembed.type) {
            cm->qlm = cm->qembed;
            lm_scratch(cm, c->vocab, c->hidden);
        } else if (quant_table(r, cm, &cm->qlm, lm_view, c->vocab, c->hidden, 1))
            goto oom;
    }
    cm->lm_head = c->tied_embeddings && parts == 1 ? cm->embed : NULL;
    if (!cm->qlm.type && !cm->lm_head && !(cm->lm_head = dalloc(r, cm, (size_t)cm->vocab_rows * hidden * 2)))
        goto oom;
    if (!(cm->out_norm = dalloc(r, cm, hidden * 4))) goto oom;
    if (!(cm->inv_freq = dalloc(r, cm, D / 2 * 4))) goto oom;
    cm->plain = c->sandwich_norms || c->act != ACT_SILU || c->embed_scale > 0 || c->attn_scale > 0;
    /* FP8 projections on one GPU (the runner refuses --dtype fp8 with tensor parallelism;
     * an FP8 checkpoint's shards are dequantized to bf16 there) */
    cm->fp8 = world == 1 && (r->tune.fp8_weights > 0 || (r->tune.fp8_weights == 0 && c->fp8));
    const size_t esz = cm->fp8 ? 1 : 2;   /* bytes per projection element */
    if (cm->fp8) {
        size_t big = qkv * hidden;
        big = hidden * cm->H * D > big ? hidden * cm->H * D : big;
        big = !c->n_experts && 2 * (size_t)cm->ffn * hidden > big ? 2 * (size_t)cm->ffn * hidden : big;
        if (cudaMalloc((void **)&stage, big * 2) != cudaSuccess) goto oom;
    }
    if (c->rope_local_theta > 0 && !(cm->inv_freq_local = dalloc(r, cm, D / 2 * 4))) goto oom;
    for (int l = 0; l < c->n_layers; l++) {
        cuda_layer *L = &cm->layers[l];
        const model_layer *ml = r->opts.random_weights ? NULL : &m->layers[l];
        const tensor_view *vqkv[3] = {ml ? &ml->wq : NULL, ml ? &ml->wk : NULL, ml ? &ml->wv : NULL};
        const tensor_view *vo[1] = {ml ? &ml->wo : NULL}, *vgu[2] = {ml ? &ml->w_gate : NULL, ml ? &ml->w_up : NULL};
        const tensor_view *vdown[1] = {ml ? &ml->w_down : NULL};
        int tq = ml && !cm->fp8 ? quant_type(r, vqkv, 3) : 0, to = ml && !cm->fp8 ? quant_type(r, vo, 1) : 0;
        /* Q|K in one type and V in another (Q4_K_M gives half the layers' V more bits):
         * both kept in their blocks, run as two GEMVs into one output (cuda_step.c gemm_q) */
        const int tqk = ml && !cm->fp8 && !tq ? quant_type(r, vqkv, 2) : 0;
        const int tv = tqk ? quant_type(r, vqkv + 2, 1) : 0;
        int tgu = ml && !cm->fp8 && !c->n_experts ? quant_type(r, vgu, 2) : 0;
        int tdn = ml && !cm->fp8 && !c->n_experts ? quant_type(r, vdown, 1) : 0;
        if ((tq ? quant_alloc(r, cm, &L->qqkv, vqkv, 3, tq)
                : tv ? quant_alloc2(r, cm, &L->qqkv, vqkv, 3, tqk, 2, tv)
                     : !(L->wqkv = dalloc(r, cm, qkv * hidden * esz))) ||
            (to ? quant_alloc(r, cm, &L->qo, vo, 1, to) : !(L->wo = dalloc(r, cm, hidden * cm->H * D * esz))) ||
            !(L->attn_norm = dalloc(r, cm, hidden * 4)) || !(L->ffn_norm = dalloc(r, cm, hidden * 4)))
            goto oom;
        if (cm->fp8 && (!(L->sqkv = dalloc(r, cm, qkv * 4)) || !(L->so = dalloc(r, cm, hidden * 4)) ||
                        (!c->n_experts && (!(L->sgu = dalloc(r, cm, 2 * (size_t)cm->ffn * 4)) ||
                                           !(L->sdown = dalloc(r, cm, hidden * 4))))))
            goto oom;
        if (tq || tv || to || tgu || tdn) cm->plain = 1;   /* the fused GEMV forms read bf16 only */
        if (c->n_experts) {
            size_t E = (size_t)c->n_experts, MF = (size_t)cm->ffn;
            if (!(L->router = dalloc(r, cm, E * hidden * 2)) || !(L->exp_gu = dalloc(r, cm, E * 2 * MF * hidden * 2)) ||
                !(L->exp_down = dalloc(r, cm, E * hidden * MF * 2)))
                goto oom;
        } else if ((tgu ? quant_alloc(r, cm, &L->qgu, vgu, 2, tgu) : !(L->wgu = dalloc(r, cm, 2 * (size_t)cm->ffn * hidden * esz))) ||
                   (tdn ? quant_alloc(r, cm, &L->qdown, vdown, 1, tdn) : !(L->wdown = dalloc(r, cm, hidden * cm->ffn * esz)))) {
            goto oom;
        }
        if (c->qkv_bias && !(L->bqkv = dalloc(r, cm, qkv * 4))) goto oom;
        if (c->qk_norm && (!(L->q_norm = dalloc(r, cm, D * 4)) || !(L->k_norm = dalloc(r, cm, D * 4))))
            goto oom;
        if (c->sandwich_norms &&
            (!(L->post_attn_norm = dalloc(r, cm, hidden * 4)) || !(L->post_ffn_norm = dalloc(r, cm, hidden * 4))))
            goto oom;
        L->window = model_layer_window(c, l);
        L->inv_freq = L->window && cm->inv_freq_local ? cm->inv_freq_local : cm->inv_freq;
    }

    /* The same frequencies as the CPU reference (bf16-rounded only when asked). */
    float inv[128];
    model_rope_inv_freq(c, r->base.cfg.rope_bf16_freqs, inv);
    CU_CHECK(r, cudaMemcpy(cm->inv_freq, inv, D / 2 * 4, cudaMemcpyHostToDevice));
    if (cm->inv_freq_local) {   /* any sliding layer: the local base */
        int l = 0;
        while (l < c->n_layers && !model_layer_window(c, l)) l++;
        model_rope_inv_freq_layer(c, l < c->n_layers ? l : 0, r->base.cfg.rope_bf16_freqs, inv);
        CU_CHECK(r, cudaMemcpy(cm->inv_freq_local, inv, D / 2 * 4, cudaMemcpyHostToDevice));
    }

    if (r->opts.random_weights) {
        if ((rc = fill_random(r, cm, mix_seed(r->opts.seed, (uint64_t)cm->pool_layer0), rank, stage)))
            goto cuda_err;
    } else {
        if ((rc = check_view(&m->tok_embd, c->vocab, c->hidden, "embed_tokens", -1, err, errlen)) ||
            (rc = check_view(&m->out_norm, c->hidden, 0, "norm", -1, err, errlen)))
            goto out;
        const tensor_view *ev[1] = {&m->tok_embd};
        if ((rc = cm->qembed.type ? quant_upload(r, &cm->qembed, ev, 1)
                                  : upload_bf16(r, &s, &m->tok_embd, c->vocab, c->hidden, 0, c->vocab, 0, c->hidden,
                                                cm->embed)) ||
            (rc = upload_norm(r, &s, &m->out_norm, c->hidden, cm->out_norm, c->norm_plus_one)))
            goto cuda_err;
        if (cm->qlm.type && cm->qlm.w != cm->qembed.w) {
            const tensor_view *lv[1] = {lm_view};
            if ((rc = quant_upload(r, &cm->qlm, lv, 1))) goto cuda_err;
        } else if (cm->lm_head && cm->lm_head != cm->embed) {
            const tensor_view *lv = c->tied_embeddings ? &m->tok_embd : &m->lm_head;
            if ((rc = check_view(lv, c->vocab, c->hidden, "lm_head", -1, err, errlen))) goto out;
            if ((rc = upload_bf16(r, &s, lv, c->vocab, c->hidden, cm->vocab_row0, cm->vocab_rows, 0, c->hidden,
                                  cm->lm_head)))
                goto cuda_err;
        }
        for (int l = 0; l < c->n_layers; l++)
            if ((rc = load_layer(r, cm, &s, &m->layers[l], l, rank, stage, err, errlen))) goto out;
    }
    /* the last pageable copies may still be landing; r->stream does not wait for them */
    CU_CHECK(r, cudaDeviceSynchronize());
    free(s.bf);
    free(s.f);
    cudaFree(stage);
    cm->loaded = 1;
    return 0;
oom:
    rc = specd_errf(err, errlen, SPECD_ENOMEM,
                    "cuda runner: %s: out of device memory after %.2f GiB of weights", m->path,
                    (double)cm->weight_bytes / (1 << 30));
    goto out;
fail:
    rc = SPECD_ECUDA;
cuda_err:
    specd_errf(err, errlen, rc, "cuda runner: %s: uploading weights: %s", m->path,
               r->errmsg[0] ? r->errmsg : specd_strerror(rc));
out:
    free(s.bf);
    free(s.f);
    cudaFree(stage);
    return rc;
}

void cuda_model_free(cuda_model *cm) {
    if (cm->layers) {
        for (int l = 0; l < cm->c.n_layers; l++) {
            cuda_layer *L = &cm->layers[l];
            void *ps[] = {L->wqkv, L->bqkv, L->q_norm, L->k_norm, L->wo, L->attn_norm, L->ffn_norm,
                          L->wgu, L->wdown, L->post_attn_norm, L->post_ffn_norm, L->router, L->exp_gu,
                          L->exp_down, L->qqkv.w, L->qo.w, L->qgu.w, L->qdown.w, L->sqkv, L->so, L->sgu, L->sdown};
            for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) cudaFree(ps[i]);
        }
        free(cm->layers);
    }
    if (cm->lm_head != cm->embed) cudaFree(cm->lm_head);
    cudaFree(cm->embed);
    if (cm->qlm.w != cm->qembed.w) cudaFree(cm->qlm.w);
    cudaFree(cm->qembed.w);
    cudaFree(cm->out_norm);
    cudaFree(cm->inv_freq);
    cudaFree(cm->inv_freq_local);
    memset(cm, 0, sizeof *cm);
}
