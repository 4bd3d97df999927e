/* The CPU reference runner: a plain, readable fp32 transformer over the paged KV pool.
 *
 * It reads like a textbook forward pass (llama2.c is the model): embed, then per layer
 * RMSNorm -> QKV (+bias) -> q/k norm -> rotary -> KV write through the block table ->
 * causal attention over the slot's context (or its sliding window) -> output projection
 * -> residual, RMSNorm -> act(gate) * up -> down -> residual; final norm and lm_head only
 * where logits are wanted. The families' variations are explicit in cpu_forward: Gemma 3's
 * scaled embeddings, (1 + w) norms, sandwich norms around each sublayer, GELU-tanh, local
 * rotary base on sliding layers; mixture-of-experts MLPs (router softmax, top-k, each
 * expert run on the tokens routed to it, weighted sum). Matrix-vector work is spread over
 * the thread pool by output rows; attention by (token, head). Numbers match HF
 * transformers' fp32 forward to ~1e-5.
 *
 * KV layout: per pool layer, K and V are [num_blocks][block_size][n_kv_heads*head_dim]
 * floats (E4M3 bytes with runner_config.kv_fp8, see kv_row); target layers come first,
 * then the draft's (pool layer L_target + i).
 *
 * Tensor parallelism (cfg.tp_world > 1): the target is loaded from shard_model(), so
 * n_heads, n_kv_heads, ffn and moe_ffn below are this rank's share; the O and down
 * projections (for experts, their weighted sum) then give partial sums, which
 * cfg.allreduce adds up over the ranks before the sandwich norm and the residual add. The
 * draft stays whole (replicated). */
#include "engine/core/runner.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "engine/core/err.h"
#include "engine/core/sample.h"
#include "engine/tp/shard.h"
#include "engine/core/spec.h"
#include "engine/core/threadpool.h"
#include "engine/model/fp8.h"

typedef struct {
    float *attn_norm;   /* (hidden) */
    float *wq;          /* (n_heads*head_dim, hidden) */
    float *wk, *wv;     /* (n_kv_heads*head_dim, hidden) */
    float *bq, *bk, *bv;/* (out) or NULL */
    float *q_norm;      /* (head_dim) or NULL */
    float *k_norm;      /* (head_dim) or NULL */
    float *wo;          /* (hidden, n_heads*head_dim) */
    float *ffn_norm;    /* (hidden) */
    float *w_gate;      /* (ffn, hidden) */
    float *w_up;        /* (ffn, hidden) */
    float *w_down;      /* (hidden, ffn) */
    float *post_attn_norm, *post_ffn_norm;  /* (hidden) sandwich norms, or NULL */
    float *router;      /* (n_experts, hidden) or NULL: dense MLP */
    float **exp_gate, **exp_up, **exp_down; /* (n_experts) each (moe_ffn, hidden) / (hidden, moe_ffn) */
    const float *inv_freq; /* this layer's rotary frequencies (global or local) */
    int window;         /* sliding window, 0: full attention */
} cpu_layer;

typedef struct {
    model_config c;
    float *tok_embd;    /* (vocab, hidden) */
    float *out_norm;    /* (hidden) */
    float *lm_head;     /* (vocab, hidden); == tok_embd when tied */
    cpu_layer *layers;  /* (n_layers) */
    float *inv_freq;    /* (head_dim/2) rotary frequencies, llama3-scaled if asked */
    float *inv_freq_local; /* (head_dim/2) sliding layers' frequencies (Gemma 3), or NULL */
    int pool_layer0;    /* first pool layer of this model */
    int loaded;
} cpu_model;

typedef struct {
    runner base;
    cpu_model m[2];     /* RUNNER_TARGET, RUNNER_DRAFT */
    int n_pool_layers;
    float **k_cache;    /* (n_pool_layers) each (num_blocks, block_size, kv_dim) */
    float **v_cache;
    /* runner_config.kv_fp8: the cache holds E4M3 codes of k / k_scale and v / v_scale in
     * k8 / v8 (same layout, one byte each) instead; kv_scale (n_pool_layers, 2) holds each
     * layer's K and V scales and kv_lut the value of every code. */
    int kv_fp8;
    uint8_t **k8, **v8;
    float *kv_scale;
    float kv_lut[256];
    int max_blocks;     /* per sequence */
    int32_t *bt;        /* (max_batch+1, max_blocks) block tables */
    /* runner_config.win_blocks > 0: the window pool's tables (same shape) and which pool
     * layers live there (their caches hold win_blocks blocks) */
    int32_t *bt_win;
    unsigned char *in_win; /* (n_pool_layers) */
    int *len[2];        /* (max_batch+1) context lengths, target and draft */
    tp_pool *pool;
    /* scratch, sized for max_tokens_per_step tokens of the wider model */
    float *x, *xn, *q, *k, *v, *att, *o, *g, *u;
    /* mixture of experts: router output, choices, gathered rows */
    float *moe_logits;  /* (T, n_experts) */
    int *moe_ids;       /* (T, n_experts_used) */
    float *moe_w;       /* (T, n_experts_used) */
    int *moe_rows;      /* (T) tokens routed to the current expert */
    float *moe_wrow;    /* (T) their weights */
    float *moe_x, *moe_y; /* (T, hidden) gathered inputs and expert outputs */
    int *tok_pos, *tok_slot;
    int *out_tok;       /* tokens whose logits are wanted, in output order */
    /* speculative step scratch (allocated when a draft and num_draft_tokens are given) */
    runner_row *sp_rows;    /* (max_batch) */
    int32_t *sp_tokens;     /* (max_batch * (k+1)) */
    int32_t *sp_drafts;     /* (max_batch * k) */
    float *sp_dlogits;      /* (max_batch, vocab) */
    float *sp_tlogits;      /* (max_batch * (k+1), vocab) */
    float *sp_q;            /* (max_batch * k, vocab) draft distributions */
    float *sp_p;            /* ((k+1), vocab) */
    float *sp_res;          /* (vocab) */
    int *sp_scratch;        /* (vocab) */
    int32_t *sp_in;         /* (max_batch * 2) a speculative step's two tokens per row
                             * (prev_row resolved) */
    runner_sampling *sp_sp; /* (max_batch) its sampling rows, counters advanced (prev_row) */
    int32_t *sp_last;       /* (max_batch * 3) the latest speculative step's rows: their
                             * last two tokens and m (what a next step's prev_row reads) */
    int sp_last_rows;       /* its rows; 0 once another sampling op ran after it */
    int *fs_scratch;        /* (vocab) forward sampling */
    float *fs_raw;          /* (vocab) its raw logits, for the chosen token's logprob */
    runner_row *dec_rows;   /* (max_batch) decode op, allocated on its first call */
    float *dec_logits;      /* (max_batch, vocab) its logits (scratch) */
    int32_t *dec_fed;       /* (max_tokens_per_step) the tokens an op feeds (prev resolved) */
    int32_t *dec_last;      /* (max_batch) the tokens the latest sampling op (decode, or
                             * forward with sp) drew, by output row */
    /* Async ops (runner.decode_async, forward_async): computed when queued, into these,
     * and handed over at wait_queued, oldest first; so an engine that read its outputs
     * before the wait would read stale values and fail its tests. */
    struct cpu_pending {
        runner_decode_batch b;   /* the caller's arrays */
        int32_t *tok, *top_ids;
        float *lp, *top_lp;
        int spec_n, spec_k;      /* a speculative step's rows and k */
        int32_t *spec_tok;       /* (max_batch * (k+1)), with a draft model */
        int *spec_m;             /* (max_batch) */
        int32_t *spec_dst_tok;
        int *spec_dst_m;
    } pend[2];
    int n_pend, pend_head;
    runner_ops ops;         /* base.ops points here: cpu_ops, plus verify with cfg.cpu_verify */
} cpu_runner;

/* ---- math kernels ------------------------------------------------------------------ */

static float dot_generic(const float *a, const float *b, int n) {
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

#if defined(__x86_64__)
/* The sum of a vector's eight lanes. */
__attribute__((target("avx2,fma")))
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* Four dot products sharing one x: the weight rows stream once, x stays in L1. */
__attribute__((target("avx2,fma")))
static void dot4_avx2(const float *x, const float *w, size_t ldw, int n, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + i), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1 + i), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w2 + i), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w3 + i), a3);
    }
    __m256 acc[4] = {a0, a1, a2, a3};
    for (int r = 0; r < 4; r++) {
        float s = hsum8(acc[r]);
        const float *wr = w + (size_t)r * ldw;
        for (int j = i; j < n; j++) s += x[j] * wr[j];
        out[r] = s;
    }
}

/* 4 weight rows x 2 tokens: eight independent FMA chains cover the FMA latency and each
 * weight load feeds two tokens (batched decode and prefill are compute-bound). */
__attribute__((target("avx2,fma")))
static void dot4x2_avx2(const float *x0, const float *x1, const float *w, size_t ldw, int n,
                        float *out0, float *out1) {
    const float *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 xa = _mm256_loadu_ps(x0 + i), xb = _mm256_loadu_ps(x1 + i), wv;
        wv = _mm256_loadu_ps(w0 + i);
        a0 = _mm256_fmadd_ps(xa, wv, a0);
        b0 = _mm256_fmadd_ps(xb, wv, b0);
        wv = _mm256_loadu_ps(w1 + i);
        a1 = _mm256_fmadd_ps(xa, wv, a1);
        b1 = _mm256_fmadd_ps(xb, wv, b1);
        wv = _mm256_loadu_ps(w2 + i);
        a2 = _mm256_fmadd_ps(xa, wv, a2);
        b2 = _mm256_fmadd_ps(xb, wv, b2);
        wv = _mm256_loadu_ps(w3 + i);
        a3 = _mm256_fmadd_ps(xa, wv, a3);
        b3 = _mm256_fmadd_ps(xb, wv, b3);
    }
    __m256 acc[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
    for (int r = 0; r < 8; r++) {
        float s = hsum8(acc[r]);
        const float *x = r < 4 ? x0 : x1, *wr = w + (size_t)(r & 3) * ldw;
        for (int j = i; j < n; j++) s += x[j] * wr[j];
        (r < 4 ? out0 : out1)[r & 3] = s;
    }
}

__attribute__((target("avx2,fma")))
static float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc2);
    }
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(_mm256_add_ps(acc, acc2));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}
#endif

static int g_avx2;  /* set once at runner creation; read-only afterwards */

static inline float dot(const float *a, const float *b, int n) {
#if defined(__x86_64__)
    if (g_avx2) return dot_avx2(a, b, n);
#endif
    return dot_generic(a, b, n);
}

/* y (T, out) = x (T, in) @ W (out, in)^T + bias; work split by chunks of output rows. */
typedef struct {
    float *y;
    const float *x, *w, *bias;
    int T, in, out;
} mm_job;

#define MM_ROWS 16  /* output rows per task: W chunk of 16 rows stays in L2 */
#define MM_TOK 32   /* tokens per tile: x tile stays in L2 */

static void mm_task(void *ctx, int task) {
    const mm_job *j = ctx;
    int o0 = task * MM_ROWS, o1 = o0 + MM_ROWS < j->out ? o0 + MM_ROWS : j->out;
    for (int t0 = 0; t0 < j->T; t0 += MM_TOK) {
        int t1 = t0 + MM_TOK < j->T ? t0 + MM_TOK : j->T;
        int o = o0;
#if defined(__x86_64__)
        if (g_avx2) {
            for (; o + 4 <= o1; o += 4) {
                const float *w = j->w + (size_t)o * j->in;
                int t = t0;
                for (; t + 2 <= t1; t += 2) {
                    float r0[4], r1[4];
                    dot4x2_avx2(j->x + (size_t)t * j->in, j->x + (size_t)(t + 1) * j->in, w,
                                (size_t)j->in, j->in, r0, r1);
                    float *y0 = j->y + (size_t)t * j->out + o, *y1 = y0 + j->out;
                    for (int q = 0; q < 4; q++) {
                        float b = j->bias ? j->bias[o + q] : 0.f;
                        y0[q] = r0[q] + b;
                        y1[q] = r1[q] + b;
                    }
                }
                for (; t < t1; t++) {
                    float r[4];
                    dot4_avx2(j->x + (size_t)t * j->in, w, (size_t)j->in, j->in, r);
                    float *y = j->y + (size_t)t * j->out + o;
                    for (int q = 0; q < 4; q++) y[q] = r[q] + (j->bias ? j->bias[o + q] : 0.f);
                }
            }
        }
#endif
        for (; o < o1; o++) {
            const float *w = j->w + (size_t)o * j->in;
            for (int t = t0; t < t1; t++)
                j->y[(size_t)t * j->out + o] =
                    dot(j->x + (size_t)t * j->in, w, j->in) + (j->bias ? j->bias[o] : 0.f);
        }
    }
}

static void matmul(cpu_runner *r, float *y, const float *x, const float *w, const float *bias,
                   int T, int in, int out) {
    mm_job j = {y, x, w, bias, T, in, out};
    tp_run(r->pool, mm_task, &j, (out + MM_ROWS - 1) / MM_ROWS);
}

/* HF's RMSNorm: x * rsqrt(mean(x^2) + eps) * w. */
static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

/* HF's rotate_half rotary (non-interleaved): pairs (i, i + d/2). */
static void rope(float *v, int head_dim, int pos, const float *inv_freq) {
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        float ang = (float)pos * inv_freq[i];
        float c = cosf(ang), s = sinf(ang);
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}

/* ---- weights ------------------------------------------------------------------------ */

static int load_tensor(float **dst, const tensor_view *t, int required, char *err, size_t errlen,
                       const char *what) {
    *dst = NULL;
    if (!t->data) {
        if (required) return specd_errf(err, errlen, SPECD_ENOTFOUND, "missing tensor %s", what);
        return 0;
    }
    int64_t n = tensor_numel(t);
    *dst = malloc((size_t)n * sizeof(float));
    if (!*dst) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory for %s", what);
    int rc = tensor_to_f32(t, *dst);
    if (rc) return specd_errf(err, errlen, rc, "cannot convert tensor %s: %s", what, specd_strerror(rc));
    return 0;
}

static void free_model(cpu_model *m) {
    if (!m->loaded) return;
    for (int l = 0; m->layers && l < m->c.n_layers; l++) {
        cpu_layer *L = &m->layers[l];
        float *ps[] = {L->attn_norm, L->wq, L->wk, L->wv, L->bq, L->bk, L->bv, L->q_norm,
                       L->k_norm, L->wo, L->ffn_norm, L->w_gate, L->w_up, L->w_down,
                       L->post_attn_norm, L->post_ffn_norm, L->router};
        for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) free(ps[i]);
        for (int e = 0; L->exp_gate && e < m->c.n_experts; e++) {
            free(L->exp_gate[e]);
            free(L->exp_up[e]);
            free(L->exp_down[e]);
        }
        free(L->exp_gate);
    }
    free(m->layers);
    if (m->lm_head != m->tok_embd) free(m->lm_head);
    free(m->tok_embd);
    free(m->out_norm);
    free(m->inv_freq);
    free(m->inv_freq_local);
    memset(m, 0, sizeof *m);
}

/* Gemma's checkpoints store RMSNorm scales as w with the norm computing (1 + w). */
static void norm_plus_one(float *w, int64_t n) {
    for (int64_t i = 0; w && i < n; i++) w[i] += 1.0f;
}

/* --dtype fp8 (runner_config.weights_fp8 > 0): each row of a dense projection rounded to
 * what the CUDA runner's FP8 weights hold (engine/model/fp8.h), so the two runners
 * compute with the same weights; activations stay fp32 here. */
static void round_fp8(float *w, int64_t rows, int64_t cols) {
    for (int64_t r = 0; w && r < rows; r++) fp8_round_row(w + r * cols, cols);
}

static int load_model(cpu_model *m, const model *src, int pool_layer0, int rope_bf16, int fp8, char *err,
                      size_t errlen) {
    int rc;
    const model_config *c = &src->cfg;
    m->c = src->cfg;
    m->pool_layer0 = pool_layer0;
    m->loaded = 1;
    m->layers = calloc((size_t)m->c.n_layers, sizeof *m->layers);
    m->inv_freq = malloc(sizeof(float) * (size_t)(m->c.head_dim / 2));
    if (!m->layers || !m->inv_freq) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    model_rope_inv_freq(&m->c, rope_bf16, m->inv_freq);
    if ((rc = load_tensor(&m->tok_embd, &src->tok_embd, 1, err, errlen, "token embedding"))) return rc;
    if ((rc = load_tensor(&m->out_norm, &src->out_norm, 1, err, errlen, "final norm"))) return rc;
    if (src->lm_head.data == src->tok_embd.data || !src->lm_head.data) {
        m->lm_head = m->tok_embd;
    } else if ((rc = load_tensor(&m->lm_head, &src->lm_head, 1, err, errlen, "lm_head"))) {
        return rc;
    }
    for (int l = 0; l < m->c.n_layers; l++) {
        const model_layer *S = &src->layers[l];
        cpu_layer *L = &m->layers[l];
        struct { float **dst; const tensor_view *t; int req; const char *name; } ts[] = {
            {&L->attn_norm, &S->attn_norm, 1, "attn_norm"}, {&L->wq, &S->wq, 1, "q_proj"},
            {&L->wk, &S->wk, 1, "k_proj"}, {&L->wv, &S->wv, 1, "v_proj"},
            {&L->bq, &S->bq, 0, "q bias"}, {&L->bk, &S->bk, 0, "k bias"}, {&L->bv, &S->bv, 0, "v bias"},
            {&L->q_norm, &S->q_norm, 0, "q_norm"}, {&L->k_norm, &S->k_norm, 0, "k_norm"},
            {&L->wo, &S->wo, 1, "o_proj"}, {&L->ffn_norm, &S->ffn_norm, 1, "ffn_norm"},
            {&L->w_gate, &S->w_gate, !c->n_experts, "gate_proj"}, {&L->w_up, &S->w_up, !c->n_experts, "up_proj"},
            {&L->w_down, &S->w_down, !c->n_experts, "down_proj"},
            {&L->post_attn_norm, &S->post_attn_norm, c->sandwich_norms, "post_attention_norm"},
            {&L->post_ffn_norm, &S->post_ffn_norm, c->sandwich_norms, "post_feedforward_norm"},
            {&L->router, &S->router, c->n_experts > 0, "router"},
        };
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
            if ((rc = load_tensor(ts[i].dst, ts[i].t, ts[i].req, err, errlen, ts[i].name))) return rc;
        if (c->n_experts) {
            size_t E = (size_t)c->n_experts;
            if (!(L->exp_gate = calloc(3 * E, sizeof(float *))))
                return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
            L->exp_up = L->exp_gate + E;
            L->exp_down = L->exp_gate + 2 * E;
            for (size_t e = 0; e < E; e++)
                if ((rc = load_tensor(&L->exp_gate[e], &S->exp_gate[e], 1, err, errlen, "expert gate")) ||
                    (rc = load_tensor(&L->exp_up[e], &S->exp_up[e], 1, err, errlen, "expert up")) ||
                    (rc = load_tensor(&L->exp_down[e], &S->exp_down[e], 1, err, errlen, "expert down")))
                    return rc;
        }
        if (fp8) {
            const int64_t H = c->hidden, Q = (int64_t)c->n_heads * c->head_dim, KV = (int64_t)c->n_kv_heads * c->head_dim;
            round_fp8(L->wq, Q, H);
            round_fp8(L->wk, KV, H);
            round_fp8(L->wv, KV, H);
            round_fp8(L->wo, H, Q);
            round_fp8(L->w_gate, c->ffn, H);
            round_fp8(L->w_up, c->ffn, H);
            round_fp8(L->w_down, H, c->ffn);
        }
        if (c->norm_plus_one) {
            float *norms[] = {L->attn_norm, L->ffn_norm, L->post_attn_norm, L->post_ffn_norm};
            for (size_t i = 0; i < sizeof norms / sizeof norms[0]; i++) norm_plus_one(norms[i], c->hidden);
            norm_plus_one(L->q_norm, c->head_dim);
            norm_plus_one(L->k_norm, c->head_dim);
        }
        L->window = model_layer_window(c, l);
        L->inv_freq = m->inv_freq;
        if (L->window && c->rope_local_theta > 0) {
            if (!m->inv_freq_local) {
                if (!(m->inv_freq_local = malloc(sizeof(float) * (size_t)(c->head_dim / 2))))
                    return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
                model_rope_inv_freq_layer(c, l, rope_bf16, m->inv_freq_local);
            }
            L->inv_freq = m->inv_freq_local;
        }
    }
    if (c->norm_plus_one) norm_plus_one(m->out_norm, c->hidden);
    return 0;
}

/* ---- attention ---------------------------------------------------------------------- */

typedef struct {
    cpu_runner *r;
    const cpu_model *m;
    int pool_layer;
    int T;
    int window;         /* this layer's sliding window, 0: full */
} attn_job;

/* Head rows of an FP8 cache are decoded into a stack buffer of this many floats (a
 * longer head_dim is refused with --kv-cache-dtype fp8). */
#define KV_ROW_MAX 1024

/* n elements of pool layer pl's K (is_v 0) or V cache from element off: the fp32 cache
 * itself, or the E4M3 codes times the layer's scale decoded into buf. */
static const float *kv_row(const cpu_runner *r, int pl, int is_v, size_t off, int n, float *buf) {
    if (!r->kv_fp8) return (is_v ? r->v_cache[pl] : r->k_cache[pl]) + off;
    const uint8_t *c = (is_v ? r->v8[pl] : r->k8[pl]) + off;
    const float s = r->kv_scale[2 * pl + is_v];
    for (int i = 0; i < n; i++) buf[i] = r->kv_lut[c[i]] * s;
    return buf;
}

/* Store n elements into pool layer pl's K or V cache at element off (FP8: x / scale
 * rounded to E4M3, as the CUDA runner's KV write does). */
static void kv_store(cpu_runner *r, int pl, int is_v, size_t off, const float *x, int n) {
    if (!r->kv_fp8) {
        memcpy((is_v ? r->v_cache[pl] : r->k_cache[pl]) + off, x, sizeof(float) * (size_t)n);
        return;
    }
    uint8_t *c = (is_v ? r->v8[pl] : r->k8[pl]) + off;
    const float inv = 1.0f / r->kv_scale[2 * pl + is_v];
    for (int i = 0; i < n; i++) c[i] = fp8_e4m3_from_f32(x[i] * inv);
}

/* The block table of a slot for pool layer pl (the window pool's for its layers). */
static const int32_t *slot_table(const cpu_runner *r, int pl, int slot) {
    return (r->in_win[pl] ? r->bt_win : r->bt) + (size_t)slot * r->max_blocks;
}

/* One (token, head): causal attention of the token's query over positions 0..pos of its
 * slot (pos-W+1..pos with a sliding window W), read from the paged cache, with an online
 * softmax (no score buffer needed). */
static void attn_task(void *ctx, int task) {
    const attn_job *j = ctx;
    cpu_runner *r = j->r;
    const model_config *c = &j->m->c;
    int hd = c->head_dim, kvd = c->n_kv_heads * hd, bs = r->base.cfg.block_size;
    int t = task / c->n_heads, h = task % c->n_heads;
    int kvh = h / (c->n_heads / c->n_kv_heads);
    const float *q = r->q + (size_t)t * c->n_heads * hd + (size_t)h * hd;
    float *out = r->att + (size_t)t * c->n_heads * hd + (size_t)h * hd;
    const int32_t *bt = slot_table(r, j->pool_layer, r->tok_slot[t]);
    float kbuf[KV_ROW_MAX], vbuf[KV_ROW_MAX];
    float scale = c->attn_scale > 0 ? c->attn_scale : 1.0f / sqrtf((float)hd), mx = -INFINITY, sum = 0.f;
    for (int i = 0; i < hd; i++) out[i] = 0.f;
    int pos = r->tok_pos[t], p0 = j->window > 0 && pos >= j->window ? pos - j->window + 1 : 0;
    for (int p = p0; p <= pos; p++) {   /* a sliding window sees the last W positions */
        size_t off = ((size_t)bt[p / bs] * bs + (size_t)(p % bs)) * kvd + (size_t)kvh * hd;
        float s = dot(q, kv_row(r, j->pool_layer, 0, off, hd, kbuf), hd) * scale;
        const float *v = kv_row(r, j->pool_layer, 1, off, hd, vbuf);
        if (s > mx) {  /* rescale what we have to the new max */
            float f = expf(mx - s);
            sum *= f;
            for (int i = 0; i < hd; i++) out[i] *= f;
            mx = s;
        }
        float w = expf(s - mx);
        sum += w;
        for (int i = 0; i < hd; i++) out[i] += w * v[i];
    }
    for (int i = 0; i < hd; i++) out[i] /= sum;
}

/* ---- forward ------------------------------------------------------------------------ */

/* The engine's host sampler, step for step: the mask, then logit bias, eos suppression
 * and penalties (from the row's token statistics, with `fed`, the token the row was fed,
 * counted once more where sp->stats_fed), then greedy argmax, or a draw from the filtered
 * softmax with the uniform the host uses at (seed, 2 * counter). logits is overwritten. */
static int32_t sample_row_in_place(float *logits, int V, const runner_sampling *sp, int32_t fed, int *scratch) {
    for (int i = 0; sp->mask && i < V; i++)
        if (!((sp->mask[i >> 5] >> (i & 31)) & 1)) logits[i] = -INFINITY;
    sample_params p = {.temperature = sp->temperature, .top_p = sp->top_p, .top_k = sp->top_k, .min_p = sp->min_p,
                       .presence_penalty = sp->presence_penalty, .frequency_penalty = sp->frequency_penalty,
                       .repetition_penalty = sp->repetition_penalty, .n_logit_bias = sp->n_logit_bias,
                       .logit_bias_ids = sp->logit_bias_ids, .logit_bias_vals = sp->logit_bias_vals,
                       .suppress_eos = sp->n_suppress > 0, .eos_ids = sp->suppress_ids, .n_eos = sp->n_suppress};
    sample_apply_penalties_fed(logits, V, &p, sp->stat_ids, sp->stat_counts, sp->n_stats, sp->stats_fed ? fed : -1);
    if (sp->temperature <= 0) return sample_argmax(logits, V);
    sample_probs(logits, V, &p, scratch);
    return sample_from_probs(logits, V, sample_uniform(sp->seed, 2 * sp->counter));
}

static int check_batch(cpu_runner *r, const cpu_model *m, const runner_batch *b) {
    const runner_config *cfg = &r->base.cfg;
    if (!m->loaded) return SPECD_EINVAL;
    if (b->n_tokens < 0 || b->n_tokens > cfg->max_tokens_per_step) return SPECD_ERANGE;
    int seen_tokens = 0;
    for (int i = 0; i < b->n_rows; i++) {
        const runner_row *row = &b->rows[i];
        if (row->slot < 0 || row->slot > cfg->max_batch) return SPECD_EINVAL;
        if (row->n_new < 0 || row->tok_off < 0 || row->tok_off + row->n_new > b->n_tokens)
            return SPECD_EINVAL;
        if (row->n_logits != 0 && row->n_logits != 1 && row->n_logits != row->n_new)
            return SPECD_EINVAL;
        if (r->len[b->which][row->slot] + row->n_new > cfg->max_seq_len) return SPECD_ERANGE;
        for (int k = 0; k < i; k++)
            if (b->rows[k].slot == row->slot) return SPECD_EINVAL;  /* one row per slot */
        seen_tokens += row->n_new;
    }
    for (int t = 0; t < b->n_tokens; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= m->c.vocab) return SPECD_EINVAL;
    return seen_tokens <= b->n_tokens ? 0 : SPECD_EINVAL;
}

/* Sum a row-parallel partial output over the ranks (target only; the draft is whole). */
static int reduce(const cpu_runner *r, const runner_batch *b, float *buf, size_t n) {
    const runner_config *cfg = &r->base.cfg;
    if (cfg->tp_world <= 1 || b->which != RUNNER_TARGET) return 0;
    return cfg->allreduce(cfg->allreduce_ctx, buf, n);
}

/* x += norm(o) with a sandwich norm (Gemma 3), else x += o. o is overwritten. */
static void residual_add(float *x, float *o, const float *post_norm, int T, int D, float eps) {
    for (int t = 0; post_norm && t < T; t++) rmsnorm(o + (size_t)t * D, o + (size_t)t * D, post_norm, D, eps);
    for (size_t i = 0; i < (size_t)T * D; i++) x[i] += o[i];
}

/* HF's gelu_pytorch_tanh. */
static float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* y (T, D) = down(act(gate x) * up x) for x (T, D); scratch r->g, r->u of T x F. */
static void gated_mlp(cpu_runner *r, ffn_act act, float *y, const float *x, const float *wg, const float *wu,
                      const float *wd, int T, int D, int F) {
    matmul(r, r->g, x, wg, NULL, T, D, F);
    matmul(r, r->u, x, wu, NULL, T, D, F);
    for (size_t i = 0; i < (size_t)T * F; i++) {
        float g = r->g[i];
        r->g[i] = (act == ACT_GELU_TANH ? gelu_tanh(g) : g / (1.0f + expf(-g))) * r->u[i];
    }
    matmul(r, y, r->g, wd, NULL, T, F, D);
}

/* Mixture of experts on the normed rows r->xn into r->o: the router's softmax over all
 * experts, the top n_experts_used (renormalised when moe_norm_topk), then each expert's
 * gated MLP over the rows routed to it, added with its weight. */
static void moe_mlp(cpu_runner *r, const model_config *c, const cpu_layer *L, int T) {
    int D = c->hidden, E = c->n_experts, K = c->n_experts_used;
    matmul(r, r->moe_logits, r->xn, L->router, NULL, T, D, E);
    for (int t = 0; t < T; t++) {
        float *lg = r->moe_logits + (size_t)t * E, mx = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++) mx = lg[e] > mx ? lg[e] : mx;
        for (int e = 0; e < E; e++) sum += (lg[e] = expf(lg[e] - mx));
        for (int e = 0; e < E; e++) lg[e] /= sum;
        int *ids = r->moe_ids + (size_t)t * K;
        float *w = r->moe_w + (size_t)t * K, wsum = 0;
        for (int k = 0; k < K; k++) {   /* top-k by selection; ties go to the lower id */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int q = 0; q < k; q++) taken |= ids[q] == e;
                if (!taken && (best < 0 || lg[e] > lg[best])) best = e;
            }
            ids[k] = best;
            wsum += (w[k] = lg[best]);
        }
        for (int k = 0; c->moe_norm_topk && k < K; k++) w[k] /= wsum;
    }
    memset(r->o, 0, sizeof(float) * (size_t)T * D);
    for (int e = 0; e < E; e++) {
        int n = 0;
        for (int t = 0; t < T; t++)
            for (int k = 0; k < K; k++)
                if (r->moe_ids[(size_t)t * K + k] == e) {
                    r->moe_rows[n] = t;
                    r->moe_wrow[n] = r->moe_w[(size_t)t * K + k];
                    memcpy(r->moe_x + (size_t)n * D, r->xn + (size_t)t * D, sizeof(float) * D);
                    n++;
                }
        if (!n) continue;
        gated_mlp(r, c->act, r->moe_y, r->moe_x, L->exp_gate[e], L->exp_up[e], L->exp_down[e], n, D, c->moe_ffn);
        for (int i = 0; i < n; i++) {
            float *o = r->o + (size_t)r->moe_rows[i] * D;
            const float *y = r->moe_y + (size_t)i * D;
            for (int d = 0; d < D; d++) o[d] += r->moe_wrow[i] * y[d];
        }
    }
}

static int cpu_forward(runner *base, const runner_batch *b) {
    cpu_runner *r = (cpu_runner *)base;
    const cpu_model *m = &r->m[b->which == RUNNER_DRAFT];
    int rc = check_batch(r, m, b);
    if (rc) return rc;
    const model_config *c = &m->c;
    int D = c->hidden, hd = c->head_dim, qd = c->n_heads * hd, kvd = c->n_kv_heads * hd;
    int bs = r->base.cfg.block_size, T = 0, n_out = 0;

    /* Token metadata: slot and position of every fed token; which ones need logits. */
    for (int i = 0; i < b->n_rows; i++) {
        const runner_row *row = &b->rows[i];
        int len = r->len[b->which][row->slot];
        for (int j = 0; j < row->n_new; j++) {
            int t = row->tok_off + j;
            r->tok_slot[t] = row->slot;
            r->tok_pos[t] = len + j;
        }
        for (int j = row->n_new - row->n_logits; j < row->n_new; j++)
            r->out_tok[row->logits_off + (j - (row->n_new - row->n_logits))] = row->tok_off + j;
        if (row->n_logits) n_out = row->logits_off + row->n_logits > n_out ? row->logits_off + row->n_logits : n_out;
        T = row->tok_off + row->n_new > T ? row->tok_off + row->n_new : T;
    }
    for (int t = 0; t < T; t++)
        memcpy(r->x + (size_t)t * D, m->tok_embd + (size_t)b->tokens[t] * D, sizeof(float) * D);
    if (c->embed_scale > 0)
        for (size_t i = 0; i < (size_t)T * D; i++) r->x[i] *= c->embed_scale;

    for (int l = 0; l < c->n_layers; l++) {
        const cpu_layer *L = &m->layers[l];
        int pl = m->pool_layer0 + l;
        for (int t = 0; t < T; t++)
            rmsnorm(r->xn + (size_t)t * D, r->x + (size_t)t * D, L->attn_norm, D, c->rms_eps);
        matmul(r, r->q, r->xn, L->wq, L->bq, T, D, qd);
        matmul(r, r->k, r->xn, L->wk, L->bk, T, D, kvd);
        matmul(r, r->v, r->xn, L->wv, L->bv, T, D, kvd);
        for (int t = 0; t < T; t++) {
            float *q = r->q + (size_t)t * qd, *k = r->k + (size_t)t * kvd;
            for (int h = 0; h < c->n_heads; h++) {
                if (L->q_norm) rmsnorm(q + h * hd, q + h * hd, L->q_norm, hd, c->rms_eps);
                rope(q + h * hd, hd, r->tok_pos[t], L->inv_freq);
            }
            for (int h = 0; h < c->n_kv_heads; h++) {
                if (L->k_norm) rmsnorm(k + h * hd, k + h * hd, L->k_norm, hd, c->rms_eps);
                rope(k + h * hd, hd, r->tok_pos[t], L->inv_freq);
            }
            /* KV write through the block table (padding rows land in null block 0). */
            int p = r->tok_pos[t];
            int32_t blk = slot_table(r, pl, r->tok_slot[t])[p / bs];
            size_t off = ((size_t)blk * bs + (size_t)(p % bs)) * kvd;
            kv_store(r, pl, 0, off, k, kvd);
            kv_store(r, pl, 1, off, r->v + (size_t)t * kvd, kvd);
        }
        attn_job aj = {r, m, pl, T, L->window};
        tp_run(r->pool, attn_task, &aj, T * c->n_heads);
        matmul(r, r->o, r->att, L->wo, NULL, T, qd, D);
        if ((rc = reduce(r, b, r->o, (size_t)T * D))) return rc;
        residual_add(r->x, r->o, L->post_attn_norm, T, D, c->rms_eps);

        for (int t = 0; t < T; t++)
            rmsnorm(r->xn + (size_t)t * D, r->x + (size_t)t * D, L->ffn_norm, D, c->rms_eps);
        if (L->router) moe_mlp(r, c, L, T);
        else gated_mlp(r, c->act, r->o, r->xn, L->w_gate, L->w_up, L->w_down, T, D, c->ffn);
        if ((rc = reduce(r, b, r->o, (size_t)T * D))) return rc;
        residual_add(r->x, r->o, L->post_ffn_norm, T, D, c->rms_eps);
    }

    if (n_out > 0) {
        for (int i = 0; i < n_out; i++)
            rmsnorm(r->xn + (size_t)i * D, r->x + (size_t)r->out_tok[i] * D, m->out_norm, D, c->rms_eps);
        matmul(r, b->logits, r->xn, m->lm_head, NULL, n_out, D, c->vocab);
        /* Sampled here exactly as the engine samples on the host (the reference for what
         * the CUDA runner does on the device); the logits buffer is the scratch. */
        if (b->sp && b->prepare_sp && (rc = b->prepare_sp(b->prepare_ctx))) return rc;
        for (int i = 0; b->sp && i < n_out; i++) {
            float *lg = b->logits + (size_t)i * c->vocab;
            const runner_sampling *sp = &b->sp[i];
            int n_top = b->out_top_ids && b->out_top_logprobs ? sp->n_top : 0;
            n_top = n_top < RUNNER_MAX_TOP ? n_top : RUNNER_MAX_TOP;
            const float *raw = lg;   /* a forced row's logits stay as they are */
            if (sp->force) {
                if (sp->force_token < 0 || sp->force_token >= c->vocab) return SPECD_EINVAL;
                b->out_tokens[i] = sp->force_token;
                if (b->out_ranks) b->out_ranks[i] = sample_rank(lg, c->vocab, sp->force_token);
            } else {
                if (b->out_logprobs || n_top > 0) memcpy(r->fs_raw, lg, sizeof(float) * (size_t)c->vocab);
                b->out_tokens[i] = sample_row_in_place(lg, c->vocab, sp, b->tokens[r->out_tok[i]], r->fs_scratch);
                raw = r->fs_raw;
            }
            if (b->out_logprobs) b->out_logprobs[i] = sample_logprob(raw, c->vocab, b->out_tokens[i]);
            if (n_top > 0)
                sample_top_logprobs(raw, c->vocab, n_top, b->out_top_ids + (size_t)i * RUNNER_MAX_TOP,
                                    b->out_top_logprobs + (size_t)i * RUNNER_MAX_TOP);
        }
    }
    for (int i = 0; i < b->n_rows; i++) r->len[b->which][b->rows[i].slot] += b->rows[i].n_new;
    return 0;
}

/* The decode op (runner.h): one forward pass of n one-token rows that samples where the
 * logits are, as forward() with sp does; so the engine's device-decode path runs on the
 * CPU too. Its logits scratch (max_batch x vocab) is allocated on the first call. */
static void free_decode_bufs(cpu_runner *r) {
    free(r->dec_rows);
    free(r->dec_logits);
    free(r->dec_fed);
    free(r->dec_last);
    for (int q = 0; q < 2; q++) {
        free(r->pend[q].tok);
        free(r->pend[q].lp);
        free(r->pend[q].top_ids);
        free(r->pend[q].top_lp);
        r->pend[q].tok = r->pend[q].top_ids = NULL;
        r->pend[q].lp = r->pend[q].top_lp = NULL;
    }
    r->dec_rows = NULL;
    r->dec_logits = NULL;
    r->dec_fed = r->dec_last = NULL;
}

static int alloc_decode_bufs(cpu_runner *r) {
    const size_t MB = (size_t)r->base.cfg.max_batch, T = MB * RUNNER_MAX_TOP;
    r->dec_rows = malloc(MB * sizeof *r->dec_rows);
    r->dec_logits = malloc(MB * (size_t)r->base.vocab * sizeof(float));
    r->dec_fed = malloc((size_t)r->base.cfg.max_tokens_per_step * sizeof(int32_t));
    r->dec_last = calloc(MB, sizeof(int32_t));
    int ok = r->dec_rows && r->dec_logits && r->dec_fed && r->dec_last;
    for (int q = 0; q < 2; q++) {
        struct cpu_pending *p = &r->pend[q];
        p->tok = malloc(MB * sizeof(int32_t));
        p->lp = malloc(MB * sizeof(float));
        p->top_ids = malloc(T * sizeof(int32_t));
        p->top_lp = malloc(T * sizeof(float));
        ok = ok && p->tok && p->lp && p->top_ids && p->top_lp;
    }
    if (!ok) free_decode_bufs(r);
    return ok ? 0 : SPECD_ENOMEM;
}

/* A decode or sampling forward drew these n tokens (by output row): what a next op's
 * prev_row / prev_tok reads; a speculative step after it has no rows to continue. */
static void set_last_sampled(cpu_runner *r, const int32_t *tok, int n) {
    memcpy(r->dec_last, tok, (size_t)n * sizeof(int32_t));
    r->sp_last_rows = 0;
}

/* Hand the oldest pending op's outputs to its batch's arrays. */
static int cpu_wait_queued(runner *base) {
    cpu_runner *r = (cpu_runner *)base;
    if (r->n_pend == 0) return 0;
    struct cpu_pending *p = &r->pend[r->pend_head];
    if (p->spec_dst_tok) {   /* a speculative step */
        memcpy(p->spec_dst_tok, p->spec_tok, (size_t)p->spec_n * (size_t)(p->spec_k + 1) * sizeof(int32_t));
        memcpy(p->spec_dst_m, p->spec_m, (size_t)p->spec_n * sizeof(int));
        p->spec_dst_tok = NULL;
        r->pend_head ^= 1;
        r->n_pend--;
        return 0;
    }
    const runner_decode_batch *b = &p->b;
    const size_t n = (size_t)b->n;
    memcpy(b->out_tokens, p->tok, n * sizeof(int32_t));
    if (b->out_logprobs) memcpy(b->out_logprobs, p->lp, n * sizeof(float));
    if (b->out_top_ids && b->out_top_logprobs) {
        memcpy(b->out_top_ids, p->top_ids, n * RUNNER_MAX_TOP * sizeof(int32_t));
        memcpy(b->out_top_logprobs, p->top_lp, n * RUNNER_MAX_TOP * sizeof(float));
    }
    r->pend_head ^= 1;
    r->n_pend--;
    return 0;
}

/* The decode op (runner.h): one forward pass of n one-token rows that samples where the
 * logits are, as forward() with sp does; so the engine's device-decode path runs on the
 * CPU too. Its buffers are allocated on the first call. An async decode is computed at
 * once and handed over at wait_queued. */
static int cpu_decode(runner *base, const runner_decode_batch *db) {
    cpu_runner *r = (cpu_runner *)base;
    const int MB = base->cfg.max_batch;
    if (!db || db->n < 1 || db->n > MB || !db->slots || !db->tokens || !db->sp || !db->out_tokens)
        return SPECD_EINVAL;
    if (db->async && ((db->prepare_sp && !base->async_masks) || r->n_pend == 2)) return SPECD_EINVAL;
    if (!db->async && r->n_pend) return SPECD_ESTATE;
    if (!r->dec_rows && alloc_decode_bufs(r)) return SPECD_ENOMEM;
    for (int i = 0; i < db->n; i++) {
        const int pr = db->prev_row ? db->prev_row[i] : -1;
        if (pr >= MB || (db->async && db->sp[i].mask && !base->async_masks)) return SPECD_EINVAL;
        r->dec_fed[i] = pr >= 0 ? r->dec_last[pr] : db->tokens[i];
        r->dec_rows[i] = (runner_row){.slot = db->slots[i], .n_new = 1, .tok_off = i, .n_logits = 1, .logits_off = i};
    }
    struct cpu_pending *p = db->async ? &r->pend[(r->pend_head + r->n_pend) & 1] : NULL;
    const int tops = db->out_top_ids && db->out_top_logprobs;
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = db->n, .rows = r->dec_rows, .tokens = r->dec_fed,
                      .n_tokens = db->n, .logits = r->dec_logits, .sp = db->sp,
                      .out_tokens = p ? p->tok : db->out_tokens,
                      .out_logprobs = p ? (db->out_logprobs ? p->lp : NULL) : db->out_logprobs,
                      .out_top_ids = p ? (tops ? p->top_ids : NULL) : db->out_top_ids,
                      .out_top_logprobs = p ? (tops ? p->top_lp : NULL) : db->out_top_logprobs,
                      .prepare_sp = db->prepare_sp, .prepare_ctx = db->prepare_ctx};
    int rc = cpu_forward(base, &b);
    if (rc) return rc;
    set_last_sampled(r, b.out_tokens, db->n);
    if (p) {
        p->b = *db;
        r->n_pend++;
    }
    return 0;
}

/* The forward op: cpu_forward, plus what the engine's async scheduling asks of it
 * (runner.forward_async): tokens fed from the last sampling op's outputs (prev_tok), and
 * a queued forward's outputs handed over at wait_queued. */
static int cpu_forward_op(runner *base, const runner_batch *b) {
    cpu_runner *r = (cpu_runner *)base;
    const int MB = base->cfg.max_batch;
    if (!b) return SPECD_EINVAL;
    if (r->n_pend && !b->async) return SPECD_ESTATE;
    int n_out = 0;
    for (int i = 0; i < b->n_rows; i++)
        if (b->rows[i].n_logits && b->rows[i].logits_off + b->rows[i].n_logits > n_out)
            n_out = b->rows[i].logits_off + b->rows[i].n_logits;
    if (!b->async && !b->prev_tok) {
        int rc = cpu_forward(base, b);
        if (rc == 0 && b->sp && b->out_tokens) {   /* what a next op's prev_tok / prev_row reads */
            if (!r->dec_rows && alloc_decode_bufs(r)) return SPECD_ENOMEM;
            set_last_sampled(r, b->out_tokens, n_out < MB ? n_out : MB);
        }
        return rc;
    }
    if (!b->sp || !b->out_tokens || (b->prepare_sp && !base->async_masks) || n_out > MB || r->n_pend == 2 ||
        b->n_tokens < 0 || b->n_tokens > base->cfg.max_tokens_per_step)
        return SPECD_EINVAL;
    if (!r->dec_rows && alloc_decode_bufs(r)) return SPECD_ENOMEM;
    for (int o = 0; o < n_out && !base->async_masks; o++)
        if (b->sp[o].mask) return SPECD_EINVAL;
    for (int t = 0; t < b->n_tokens; t++) {
        const int pr = b->prev_tok ? b->prev_tok[t] : -1;
        if (pr >= MB) return SPECD_EINVAL;
        r->dec_fed[t] = pr >= 0 ? r->dec_last[pr] : b->tokens[t];
    }
    struct cpu_pending *p = b->async ? &r->pend[(r->pend_head + r->n_pend) & 1] : NULL;
    const int tops = b->out_top_ids && b->out_top_logprobs;
    runner_batch fb = *b;
    fb.tokens = r->dec_fed;
    fb.async = 0;
    fb.prev_tok = NULL;
    if (p) {
        fb.out_tokens = p->tok;
        fb.out_logprobs = b->out_logprobs ? p->lp : NULL;
        fb.out_top_ids = tops ? p->top_ids : NULL;
        fb.out_top_logprobs = tops ? p->top_lp : NULL;
    }
    int rc = cpu_forward(base, &fb);
    if (rc) return rc;
    set_last_sampled(r, fb.out_tokens, n_out);
    if (p) {
        p->b = (runner_decode_batch){.n = n_out, .out_tokens = b->out_tokens, .out_logprobs = b->out_logprobs,
                                     .out_top_ids = b->out_top_ids, .out_top_logprobs = b->out_top_logprobs};
        r->n_pend++;
    }
    return 0;
}

/* ---- speculative step (reference for the CUDA graph; see runner.h) --------------------- */

static int32_t pick_draft(cpu_runner *r, float *logits, const runner_sampling *sp, int j, float *q) {
    int V = r->base.vocab;
    if (sp->temperature <= 0) return sample_argmax(logits, V);
    sample_params p = {.temperature = sp->temperature, .top_p = sp->top_p, .top_k = sp->top_k,
                       .min_p = sp->min_p};
    memcpy(q, logits, sizeof(float) * (size_t)V);
    sample_probs(q, V, &p, r->sp_scratch);
    return sample_from_probs(q, V, sample_uniform(sp->seed ^ SPEC_SALT_DRAFT, sp->counter + (uint64_t)j));
}

/* The speculative step op (runner.h). An async one is computed at once and its outputs
 * handed over at wait_queued; prev_row reads the rows of the speculative step just before
 * (sp_last), which any other sampling op clears. */
static int cpu_spec_step(runner *base, const runner_spec_batch *sb) {
    cpu_runner *r = (cpu_runner *)base;
    const runner_config *cfg = &base->cfg;
    int n = sb->n, k = sb->k, V = base->vocab, rc;
    if (!r->sp_rows || n < 1 || n > cfg->max_batch || k < 1 || k > cfg->num_draft_tokens) return SPECD_EINVAL;
    if (sb->async && (!base->spec_async || r->n_pend == 2)) return SPECD_EINVAL;
    if (!sb->async && r->n_pend) return SPECD_ESTATE;
    for (int i = 0; i < n; i++) {
        int s = sb->slots[i], L = s >= 0 && s < cfg->max_batch ? r->len[0][s] : -1;
        const int pr = sb->prev_row ? sb->prev_row[i] : -1;
        if (pr >= r->sp_last_rows) return SPECD_EINVAL;
        if (L < 1 || L + k + 1 > cfg->max_seq_len) return SPECD_ERANGE;
        for (int j = 0; j < i; j++)
            if (sb->slots[j] == s) return SPECD_EINVAL;
        r->sp_sp[i] = sb->sp[i];
        if (pr >= 0) {
            r->sp_in[2 * i] = r->sp_last[3 * pr];
            r->sp_in[2 * i + 1] = r->sp_last[3 * pr + 1];
            r->sp_sp[i].counter += (uint64_t)r->sp_last[3 * pr + 2];
        } else {
            r->sp_in[2 * i] = sb->tokens[2 * i];
            r->sp_in[2 * i + 1] = sb->tokens[2 * i + 1];
        }
    }
    struct cpu_pending *pq = sb->async ? &r->pend[(r->pend_head + r->n_pend) & 1] : NULL;
    int32_t *outs = pq ? pq->spec_tok : sb->out_tokens;
    int *out_n = pq ? pq->spec_m : sb->out_n;
    const runner_sampling *sps = r->sp_sp;
    /* 1. draft: [second-to-last, last] at L-1, L */
    for (int i = 0; i < n; i++) {
        int s = sb->slots[i];
        r->len[1][s] = r->len[0][s] - 1;
        r->sp_rows[i] = (runner_row){.slot = s, .n_new = 2, .tok_off = 2 * i, .n_logits = 1, .logits_off = i};
        r->sp_tokens[2 * i] = r->sp_in[2 * i];
        r->sp_tokens[2 * i + 1] = r->sp_in[2 * i + 1];
    }
    runner_batch b = {.which = RUNNER_DRAFT, .n_rows = n, .rows = r->sp_rows, .tokens = r->sp_tokens,
                      .n_tokens = 2 * n, .logits = r->sp_dlogits};
    if ((rc = cpu_forward(base, &b))) return rc;
    /* 2. k-1 more draft passes */
    for (int j = 0; j < k; j++) {
        for (int i = 0; i < n; i++) {
            int32_t d = pick_draft(r, r->sp_dlogits + (size_t)i * V, &sps[i], j,
                                   r->sp_q + ((size_t)i * k + j) * V);
            r->sp_drafts[i * k + j] = d;
            r->sp_rows[i] = (runner_row){.slot = sb->slots[i], .n_new = 1, .tok_off = i, .n_logits = 1, .logits_off = i};
            r->sp_tokens[i] = d;
        }
        if (j + 1 == k) break;
        b = (runner_batch){.which = RUNNER_DRAFT, .n_rows = n, .rows = r->sp_rows, .tokens = r->sp_tokens,
                           .n_tokens = n, .logits = r->sp_dlogits};
        if ((rc = cpu_forward(base, &b))) return rc;
    }
    /* 3. target verifies [last, d1..dk] */
    for (int i = 0; i < n; i++) {
        r->sp_rows[i] = (runner_row){.slot = sb->slots[i], .n_new = k + 1, .tok_off = i * (k + 1),
                                     .n_logits = k + 1, .logits_off = i * (k + 1)};
        r->sp_tokens[i * (k + 1)] = r->sp_in[2 * i + 1];
        memcpy(r->sp_tokens + i * (k + 1) + 1, r->sp_drafts + i * k, sizeof(int32_t) * (size_t)k);
    }
    b = (runner_batch){.which = RUNNER_TARGET, .n_rows = n, .rows = r->sp_rows, .tokens = r->sp_tokens,
                       .n_tokens = n * (k + 1), .logits = r->sp_tlogits};
    if ((rc = cpu_forward(base, &b))) return rc;
    /* 4-5. acceptance, lengths */
    for (int i = 0; i < n; i++) {
        const runner_sampling *sp = &sps[i];
        float *tl = r->sp_tlogits + (size_t)i * (k + 1) * V;
        int32_t *out = outs + (size_t)i * (k + 1);
        int m;
        if (sp->temperature <= 0) {
            m = spec_accept_greedy(tl, V, r->sp_drafts + i * k, k, out);
        } else {
            sample_params p = {.temperature = sp->temperature, .top_p = sp->top_p, .top_k = sp->top_k,
                               .min_p = sp->min_p};
            double ua[16];
            for (int j = 0; j <= k; j++) {
                memcpy(r->sp_p + (size_t)j * V, tl + (size_t)j * V, sizeof(float) * (size_t)V);
                sample_probs(r->sp_p + (size_t)j * V, V, &p, r->sp_scratch);
            }
            for (int j = 0; j < k; j++) ua[j] = sample_uniform(sp->seed ^ SPEC_SALT_ACCEPT, sp->counter + (uint64_t)j);
            m = spec_accept_sample(r->sp_p, r->sp_q + (size_t)i * k * V, V, r->sp_drafts + i * k, k, ua,
                                   sample_uniform(sp->seed, 2 * sp->counter), r->sp_res, 0, out);
        }
        out_n[i] = m;
        int s = sb->slots[i], L = r->len[0][s] - (k + 1);
        r->len[0][s] = L + m;
        r->len[1][s] = L + k < L + m ? L + k : L + m;
        r->sp_last[3 * i] = m >= 2 ? out[m - 2] : r->sp_in[2 * i + 1];
        r->sp_last[3 * i + 1] = out[m - 1];
        r->sp_last[3 * i + 2] = m;
    }
    r->sp_last_rows = n;
    if (pq) {
        pq->spec_n = n;
        pq->spec_k = k;
        pq->spec_dst_tok = sb->out_tokens;
        pq->spec_dst_m = sb->out_n;
        r->n_pend++;
    }
    return 0;
}

/* The verify op (runner.h; the CUDA runner's graph has the same contract): one target pass
 * over every row's [last, drafts] with logits at every position, then point-mass acceptance
 * as the engine's host path does it. On only with runner_config.cpu_verify (tests and A/B):
 * its padding costs real work on a CPU. */
static int cpu_verify(runner *base, const runner_verify_batch *vb) {
    cpu_runner *r = (cpu_runner *)base;
    const runner_config *cfg = &base->cfg;
    int n = vb->n, k = vb->k, K1 = k + 1, V = base->vocab, rc;
    if (!r->sp_rows || n < 1 || n > base->verify_max_rows || k < 1 || k > base->verify_max_k || !vb->n_drafts)
        return SPECD_EINVAL;
    for (int i = 0; i < n; i++) {
        int s = vb->slots[i], L = s >= 0 && s < cfg->max_batch ? r->len[0][s] : -1;
        if (L < 0 || L + K1 > cfg->max_seq_len) return SPECD_ERANGE;
        if (vb->n_drafts[i] < 0 || vb->n_drafts[i] > k) return SPECD_EINVAL;
        for (int j = 0; j < i; j++)
            if (vb->slots[j] == s) return SPECD_EINVAL;
        r->sp_rows[i] = (runner_row){.slot = s, .n_new = K1, .tok_off = i * K1, .n_logits = K1, .logits_off = i * K1};
    }
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = n, .rows = r->sp_rows, .tokens = vb->tokens,
                      .n_tokens = n * K1, .logits = r->sp_tlogits};
    if ((rc = cpu_forward(base, &b))) return rc;
    for (int i = 0; i < n; i++) {
        const runner_sampling *sp = &vb->sp[i];
        const int32_t *drafts = vb->tokens + (size_t)i * K1 + 1;
        float *tl = r->sp_tlogits + (size_t)i * K1 * V;
        int32_t *out = vb->out_tokens + (size_t)i * K1;
        int nd = vb->n_drafts[i], m;
        if (sp->temperature <= 0) {
            m = spec_accept_greedy(tl, V, drafts, nd, out);
        } else {
            sample_params p = {.temperature = sp->temperature, .top_p = sp->top_p, .top_k = sp->top_k,
                               .min_p = sp->min_p};
            double u[16];   /* k <= 15 */
            for (int j = 0; j <= nd; j++) sample_probs(tl + (size_t)j * V, V, &p, r->sp_scratch);
            spec_point_uniforms(sp->seed, sp->counter, nd, u);
            m = spec_accept_point(tl, V, drafts, nd, u, out);
        }
        vb->out_n[i] = m;
        int s = vb->slots[i];
        r->len[0][s] += m - K1;   /* the pass advanced it by K1 */
    }
    return 0;
}

/* ---- slots and blocks --------------------------------------------------------------- */

/* A slot's row of table bt (of a pool of nb blocks): entries [first, first+n) = blocks. */
static int write_row(cpu_runner *r, int32_t *bt, int nb, int slot, int first, const int32_t *blocks, int n) {
    if (slot < 0 || slot > r->base.cfg.max_batch || first < 0 || n < 0 || first + n > r->max_blocks)
        return SPECD_EINVAL;
    int32_t *row = bt + (size_t)slot * r->max_blocks;
    for (int i = 0; i < n; i++) {
        if (blocks[i] < 0 || blocks[i] >= nb) return SPECD_EINVAL;
        row[first + i] = blocks[i];
    }
    if (first == 0)
        for (int i = n; i < r->max_blocks; i++) row[i] = 0;
    return 0;
}

static int cpu_slot_write_blocks(runner *base, int slot, int first, const int32_t *blocks, int n) {
    cpu_runner *r = (cpu_runner *)base;
    return write_row(r, r->bt, r->base.cfg.num_blocks, slot, first, blocks, n);
}

static int cpu_slot_write_win_blocks(runner *base, int slot, int first, const int32_t *blocks, int n) {
    cpu_runner *r = (cpu_runner *)base;
    if (!r->bt_win) return SPECD_EINVAL;
    return write_row(r, r->bt_win, r->base.cfg.win_blocks, slot, first, blocks, n);
}

static int cpu_slot_set_len(runner *base, int slot, int which, int len) {
    cpu_runner *r = (cpu_runner *)base;
    if (slot < 0 || slot > r->base.cfg.max_batch || which < 0 || which > 1 || len < 0 ||
        len > r->base.cfg.max_seq_len)
        return SPECD_EINVAL;
    r->len[which][slot] = len;
    return 0;
}

static int cpu_slot_get_len(runner *base, int slot, int which) {
    cpu_runner *r = (cpu_runner *)base;
    if (slot < 0 || slot > r->base.cfg.max_batch || which < 0 || which > 1) return SPECD_EINVAL;
    return r->len[which][slot];
}

static size_t layer_block_floats(const model_config *c, int bs) {
    return (size_t)bs * (size_t)c->n_kv_heads * (size_t)c->head_dim;
}

static int cpu_copy_block(runner *base, int dst, int src) {
    cpu_runner *r = (cpu_runner *)base;
    int nb = r->base.cfg.num_blocks;
    if (dst <= 0 || dst >= nb || src < 0 || src >= nb) return SPECD_EINVAL;
    for (int l = 0; l < r->n_pool_layers; l++) {
        if (r->in_win[l]) continue;
        const cpu_model *m = &r->m[l >= r->m[0].c.n_layers];
        size_t n = layer_block_floats(&m->c, r->base.cfg.block_size);
        if (r->kv_fp8) {
            memcpy(r->k8[l] + (size_t)dst * n, r->k8[l] + (size_t)src * n, n);
            memcpy(r->v8[l] + (size_t)dst * n, r->v8[l] + (size_t)src * n, n);
            continue;
        }
        memcpy(r->k_cache[l] + (size_t)dst * n, r->k_cache[l] + (size_t)src * n, n * sizeof(float));
        memcpy(r->v_cache[l] + (size_t)dst * n, r->v_cache[l] + (size_t)src * n, n * sizeof(float));
    }
    return 0;
}

static void cpu_destroy(runner *base) {
    cpu_runner *r = (cpu_runner *)base;
    if (!r) return;
    for (int l = 0; r->k_cache && l < r->n_pool_layers; l++) {
        free(r->k_cache[l]);
        free(r->v_cache[l]);
        if (r->k8) free(r->k8[l]);
        if (r->v8) free(r->v8[l]);
    }
    free(r->k_cache);
    free(r->v_cache);
    free(r->k8);
    free(r->v8);
    free(r->kv_scale);
    free_model(&r->m[0]);
    free_model(&r->m[1]);
    free(r->bt);
    free(r->bt_win);
    free(r->in_win);
    free(r->len[0]);
    free(r->len[1]);
    float *bufs[] = {r->x, r->xn, r->q, r->k, r->v, r->att, r->o, r->g, r->u,
                     r->moe_logits, r->moe_w, r->moe_wrow, r->moe_x, r->moe_y};
    free(r->moe_ids);
    free(r->moe_rows);
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(r->tok_pos);
    free(r->tok_slot);
    free(r->out_tok);
    free(r->sp_rows);
    free(r->sp_tokens);
    free(r->sp_drafts);
    free(r->sp_dlogits);
    free(r->sp_tlogits);
    free(r->sp_q);
    free(r->sp_p);
    free(r->sp_res);
    free(r->sp_scratch);
    free(r->sp_in);
    free(r->sp_sp);
    free(r->sp_last);
    for (int q = 0; q < 2; q++) {
        free(r->pend[q].spec_tok);
        free(r->pend[q].spec_m);
    }
    free(r->fs_scratch);
    free(r->fs_raw);
    free_decode_bufs(r);
    tp_destroy(r->pool);
    free(r);
}

static const runner_ops cpu_ops = {
    .name = "cpu",
    .forward = cpu_forward_op,
    .slot_write_blocks = cpu_slot_write_blocks,
    .slot_write_win_blocks = cpu_slot_write_win_blocks,
    .slot_set_len = cpu_slot_set_len,
    .slot_get_len = cpu_slot_get_len,
    .copy_block = cpu_copy_block,
    .decode = cpu_decode,
    .wait_queued = cpu_wait_queued,
    .spec_step = cpu_spec_step,
    .destroy = cpu_destroy,
};

size_t runner_cpu_block_bytes(const model *target, const model *draft, int block_size, int kv_fp8, int pool) {
    const model_config *d = draft ? &draft->cfg : NULL;
    const int nt = target->cfg.n_layers, np = nt + (d ? d->n_layers : 0);
    size_t n = 0;
    for (int l = 0; l < np; l++)
        if (pool == RUNNER_POOL_ALL || runner_layer_in_window_pool(&target->cfg, d, 1, l) == (pool == RUNNER_POOL_WINDOW))
            n += 2 * layer_block_floats(l < nt ? &target->cfg : d, block_size);
    return n * (kv_fp8 ? 1 : sizeof(float));
}

static int imax(int a, int b) { return a > b ? a : b; }

runner *runner_cpu_create(const model *target, const model *draft, const runner_config *cfg,
                          char *err, size_t errlen) {
    if (!target || !cfg || cfg->num_blocks < 2 || cfg->block_size < 1 || cfg->max_batch < 1 ||
        cfg->max_seq_len < 1 || cfg->max_tokens_per_step < 1 || cfg->win_blocks == 1 || cfg->win_blocks < 0) {
        specd_errf(err, errlen, SPECD_EINVAL, "cpu runner: invalid configuration");
        return NULL;
    }
    if (draft && draft->cfg.vocab != target->cfg.vocab) {
        specd_errf(err, errlen, SPECD_EINVAL, "cpu runner: draft vocabulary %d != target %d",
                   draft->cfg.vocab, target->cfg.vocab);
        return NULL;
    }
    if (cfg->weights_fp8 > 0 && cfg->tp_world > 1) {
        specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                   "cpu runner: --dtype fp8 with tensor parallelism is not supported (rows quantized per shard "
                   "would differ from one GPU's)");
        return NULL;
    }
    if (cfg->kv_fp8 && (target->cfg.head_dim > KV_ROW_MAX || (draft && draft->cfg.head_dim > KV_ROW_MAX))) {
        specd_errf(err, errlen, SPECD_EUNSUPPORTED, "cpu runner: an FP8 KV cache needs head_dim <= %d", KV_ROW_MAX);
        return NULL;
    }
    if (cfg->random_weights_seed) {
        specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                   "cpu runner: weights filled on the device (random_weights_seed) are a CUDA runner option");
        return NULL;
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    g_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    cpu_runner *r = calloc(1, sizeof *r);
    if (!r) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    r->ops = cpu_ops;
    r->base.ops = &r->ops;
    r->base.cfg = *cfg;
    r->base.target = target;
    r->base.draft = draft;
    r->base.vocab = target->cfg.vocab;
    r->base.kv_block_bytes[0] = runner_cpu_block_bytes(target, draft, cfg->block_size, cfg->kv_fp8,
                                                       cfg->win_blocks > 0 ? RUNNER_POOL_MAIN : RUNNER_POOL_ALL);
    if (cfg->win_blocks > 0)
        r->base.kv_block_bytes[1] = runner_cpu_block_bytes(target, draft, cfg->block_size, cfg->kv_fp8, RUNNER_POOL_WINDOW);
    int threads = cfg->threads > 0 ? cfg->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    r->base.cfg.threads = threads;
    if (!(r->pool = tp_create(threads))) goto oom;
    if (cfg->tp_world > 1) {
        if (!cfg->allreduce || cfg->tp_rank < 0 || cfg->tp_rank >= cfg->tp_world) {
            specd_errf(err, errlen, SPECD_EINVAL, "cpu runner: tensor parallel rank %d of %d needs an all-reduce",
                       cfg->tp_rank, cfg->tp_world);
            goto fail;
        }
        /* The fp32 copies are owned by the runner, so the shard's views can go at once. */
        model *shard = shard_model(target, cfg->tp_rank, cfg->tp_world, err, errlen);
        if (!shard) goto fail;
        int rc = load_model(&r->m[0], shard, 0, cfg->rope_bf16_freqs, 0, err, errlen);
        shard_free(shard);
        if (rc) goto fail;
    } else if (load_model(&r->m[0], target, 0, cfg->rope_bf16_freqs, cfg->weights_fp8 > 0, err, errlen)) {
        goto fail;
    }
    if (draft && load_model(&r->m[1], draft, target->cfg.n_layers, cfg->rope_bf16_freqs, cfg->weights_fp8 > 0, err, errlen))
        goto fail;

    r->n_pool_layers = target->cfg.n_layers + (draft ? draft->cfg.n_layers : 0);
    r->k_cache = calloc((size_t)r->n_pool_layers, sizeof(float *));
    r->v_cache = calloc((size_t)r->n_pool_layers, sizeof(float *));
    r->k8 = calloc((size_t)r->n_pool_layers, sizeof(uint8_t *));
    r->v8 = calloc((size_t)r->n_pool_layers, sizeof(uint8_t *));
    r->kv_scale = calloc((size_t)r->n_pool_layers * 2, sizeof(float));
    r->in_win = calloc((size_t)r->n_pool_layers, 1);
    if (!r->k_cache || !r->v_cache || !r->k8 || !r->v8 || !r->kv_scale || !r->in_win) goto oom;
    r->kv_fp8 = cfg->kv_fp8 != 0;
    for (int i = 0; i < 256; i++) r->kv_lut[i] = fp8_e4m3_to_f32((uint8_t)i);
    for (int l = 0; l < r->n_pool_layers; l++) {
        const int is_draft = l >= target->cfg.n_layers;
        const model_config *c = &r->m[is_draft].c;
        const model_layer *ly = &(is_draft ? draft : target)->layers[is_draft ? l - target->cfg.n_layers : l];
        r->kv_scale[2 * l] = ly->k_scale > 0 ? ly->k_scale : 1.0f;
        r->kv_scale[2 * l + 1] = ly->v_scale > 0 ? ly->v_scale : 1.0f;
        r->in_win[l] = (unsigned char)runner_layer_in_window_pool(&target->cfg, draft ? &draft->cfg : NULL,
                                                                  cfg->win_blocks > 0, l);
        size_t n = (size_t)(r->in_win[l] ? cfg->win_blocks : cfg->num_blocks) * layer_block_floats(c, cfg->block_size);
        if (r->kv_fp8) {
            r->k8[l] = calloc(n, 1);
            r->v8[l] = calloc(n, 1);
            if (!r->k8[l] || !r->v8[l]) goto oom;
            continue;
        }
        r->k_cache[l] = calloc(n, sizeof(float));
        r->v_cache[l] = calloc(n, sizeof(float));
        if (!r->k_cache[l] || !r->v_cache[l]) goto oom;
    }
    r->max_blocks = (cfg->max_seq_len + cfg->block_size - 1) / cfg->block_size;
    r->bt = calloc((size_t)(cfg->max_batch + 1) * r->max_blocks, sizeof(int32_t));
    if (cfg->win_blocks > 0) r->bt_win = calloc((size_t)(cfg->max_batch + 1) * r->max_blocks, sizeof(int32_t));
    r->len[0] = calloc((size_t)cfg->max_batch + 1, sizeof(int));
    r->len[1] = calloc((size_t)cfg->max_batch + 1, sizeof(int));
    if (!r->bt || (cfg->win_blocks > 0 && !r->bt_win) || !r->len[0] || !r->len[1]) goto oom;

    /* Scratch for the widest of the two models. */
    int D = target->cfg.hidden, QD = target->cfg.n_heads * target->cfg.head_dim;
    int KVD = target->cfg.n_kv_heads * target->cfg.head_dim, F = target->cfg.ffn;
    if (draft) {
        D = imax(D, draft->cfg.hidden);
        QD = imax(QD, draft->cfg.n_heads * draft->cfg.head_dim);
        KVD = imax(KVD, draft->cfg.n_kv_heads * draft->cfg.head_dim);
        F = imax(F, draft->cfg.ffn);
    }
    int E = target->cfg.n_experts, K = target->cfg.n_experts_used;
    F = imax(F, target->cfg.moe_ffn);
    if (draft) {
        E = imax(E, draft->cfg.n_experts);
        K = imax(K, draft->cfg.n_experts_used);
        F = imax(F, draft->cfg.moe_ffn);
    }
    size_t T = (size_t)cfg->max_tokens_per_step;
    if (E) {
        r->moe_logits = malloc(T * (size_t)E * sizeof(float));
        r->moe_ids = malloc(T * (size_t)K * sizeof(int));
        r->moe_w = malloc(T * (size_t)K * sizeof(float));
        r->moe_rows = malloc(T * sizeof(int));
        r->moe_wrow = malloc(T * sizeof(float));
        r->moe_x = malloc(T * (size_t)D * sizeof(float));
        r->moe_y = malloc(T * (size_t)D * sizeof(float));
        if (!r->moe_logits || !r->moe_ids || !r->moe_w || !r->moe_rows || !r->moe_wrow || !r->moe_x || !r->moe_y)
            goto oom;
    }
    r->x = malloc(T * D * sizeof(float));
    r->xn = malloc(T * D * sizeof(float));
    r->q = malloc(T * QD * sizeof(float));
    r->k = malloc(T * KVD * sizeof(float));
    r->v = malloc(T * KVD * sizeof(float));
    r->att = malloc(T * QD * sizeof(float));
    r->o = malloc(T * D * sizeof(float));
    r->g = malloc(T * F * sizeof(float));
    r->u = malloc(T * F * sizeof(float));
    r->tok_pos = malloc(T * sizeof(int));
    r->tok_slot = malloc(T * sizeof(int));
    r->out_tok = malloc(T * sizeof(int));
    r->fs_scratch = malloc((size_t)r->base.vocab * sizeof(int));
    r->fs_raw = malloc((size_t)r->base.vocab * sizeof(float));
    if (!r->x || !r->xn || !r->q || !r->k || !r->v || !r->att || !r->o || !r->g || !r->u ||
        !r->tok_pos || !r->tok_slot || !r->out_tok || !r->fs_scratch || !r->fs_raw)
        goto oom;
    r->base.forward_samples = cfg->tp_world <= 1;
    r->base.draft_samples = r->base.forward_samples;   /* (cpu_forward samples either model) */
    r->base.forward_masks = r->base.forward_samples;
    r->base.decode_masks = r->base.forward_masks;   /* the decode op is a forward */
    r->base.decode_async = 1;
    r->base.forced_tokens = r->base.forward_samples;
    /* (its sampling keeps the logits as they came for the logprobs before it masks) */
    r->base.masked_raw_logprobs = r->base.forward_masks;
    r->base.forward_async = r->base.forward_samples;
    /* runner_sampling's lists are pointers: a tensor-parallel group does not ship them */
    r->base.sample_adjusts = cfg->tp_world <= 1;
    r->base.async_stats = r->base.sample_adjusts;
    /* an async op is computed when queued: its prepare_sp runs after its pass, and a
     * wait_queued from there hands over the op before it (the ring's other slot) */
    r->base.async_masks = r->base.forward_masks;
    if (draft && cfg->num_draft_tokens > 0) {
        size_t B = (size_t)cfg->max_batch, K = (size_t)cfg->num_draft_tokens, V = (size_t)r->base.vocab;
        if (K > 15) {
            specd_errf(err, errlen, SPECD_EINVAL, "cpu runner: at most 15 draft tokens");
            goto fail;
        }
        r->sp_rows = malloc(B * sizeof *r->sp_rows);
        r->sp_tokens = malloc(B * (K + 1) * sizeof(int32_t));
        r->sp_drafts = malloc(B * K * sizeof(int32_t));
        r->sp_dlogits = malloc(B * V * sizeof(float));
        r->sp_tlogits = malloc(B * (K + 1) * V * sizeof(float));
        r->sp_q = malloc(B * K * V * sizeof(float));
        r->sp_p = malloc((K + 1) * V * sizeof(float));
        r->sp_res = malloc(V * sizeof(float));
        r->sp_scratch = malloc(V * sizeof(int));
        r->sp_in = malloc(B * 2 * sizeof(int32_t));
        r->sp_sp = malloc(B * sizeof *r->sp_sp);
        r->sp_last = malloc(B * 3 * sizeof(int32_t));
        int ok = r->sp_in && r->sp_sp && r->sp_last;
        for (int q = 0; q < 2; q++) {
            r->pend[q].spec_tok = malloc(B * (K + 1) * sizeof(int32_t));
            r->pend[q].spec_m = malloc(B * sizeof(int));
            ok = ok && r->pend[q].spec_tok && r->pend[q].spec_m;
        }
        if (!ok || !r->sp_rows || !r->sp_tokens || !r->sp_drafts || !r->sp_dlogits || !r->sp_tlogits ||
            !r->sp_q || !r->sp_p || !r->sp_res || !r->sp_scratch)
            goto oom;
        r->base.spec_async = cfg->tp_world <= 1;   /* (as the queued ops of a group: none) */
    }
    if (!draft && cfg->num_draft_tokens > 0 && cfg->cpu_verify) {
        size_t B = (size_t)(cfg->max_batch < RUNNER_VERIFY_MAX_ROWS ? cfg->max_batch : RUNNER_VERIFY_MAX_ROWS),
               K = (size_t)cfg->num_draft_tokens,
               V = (size_t)r->base.vocab;
        if (K > 15) {
            specd_errf(err, errlen, SPECD_EINVAL, "cpu runner: at most 15 draft tokens");
            goto fail;
        }
        r->sp_rows = malloc(B * sizeof *r->sp_rows);
        r->sp_tlogits = malloc(B * (K + 1) * V * sizeof(float));
        r->sp_scratch = malloc(V * sizeof(int));
        if (!r->sp_rows || !r->sp_tlogits || !r->sp_scratch) goto oom;
        r->ops.verify = cpu_verify;
        r->base.verify_max_k = (int)K;
        r->base.verify_max_rows = (int)B;
        r->base.verify_samples = 1;
    }
    return &r->base;
oom:
    specd_errf(err, errlen, SPECD_ENOMEM, "cpu runner: out of memory (KV pool of %d blocks)",
               cfg->num_blocks);
fail:
    cpu_destroy(&r->base);
    return NULL;
}
