/* Tensor-parallel sharding (see shard.h): row slices are views into the source mapping,
 * column slices are owned copies kept in the shard's priv, and a CPU simulation of the
 * sharded forward that sums partial outputs where the NCCL all-reduce goes.
 *
 * The simulation is deliberately a second, independent forward (no paged KV: one
 * sequence, contiguous K/V) so that the test comparing it with runner_cpu checks the
 * sharding, not a shared helper. */
#include "engine/tp/shard.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"

#define SHARD_MAGIC 0x53484152u  /* "SHAR" */

typedef struct {
    uint32_t magic;
    int rank, world;
    void **bufs;   /* owned copies (column slices, re-gridded 1-D slices) */
    int n_bufs, cap;
} shard_priv;

/* ---- dtype geometry ------------------------------------------------------------------ */

/* Elements per block and bytes per block of each storage type. */
static void dtype_block(tensor_dtype d, int64_t *blck, size_t *bytes) {
    switch (d) {
    case TDT_F32: *blck = 1; *bytes = 4; return;
    case TDT_F16: *blck = 1; *bytes = 2; return;
    case TDT_BF16: *blck = 1; *bytes = 2; return;
    case TDT_Q8_0: *blck = 32; *bytes = 34; return;
    case TDT_Q4_0: *blck = 32; *bytes = 18; return;
    case TDT_Q4_1: *blck = 32; *bytes = 20; return;
    case TDT_Q4_K: *blck = 256; *bytes = 144; return;
    case TDT_Q6_K: *blck = 256; *bytes = 210; return;
    case TDT_Q5_0: *blck = 32; *bytes = 22; return;
    case TDT_Q5_1: *blck = 32; *bytes = 24; return;
    case TDT_Q5_K: *blck = 256; *bytes = 176; return;
    case TDT_F8_E4M3: break;   /* scaled: sliced through fp32 (fp8_slice) */
    }
    *blck = 0;
    *bytes = 0;
}

/* Bytes of n elements (n a multiple of the block); 0 if not. */
static size_t span_bytes(tensor_dtype d, int64_t n) {
    int64_t blck;
    size_t bytes;
    dtype_block(d, &blck, &bytes);
    if (!blck || n < 0 || n % blck) return 0;
    return (size_t)(n / blck) * bytes;
}

static int keep(model *owner, void *buf) {
    shard_priv *p = owner ? owner->priv : NULL;
    if (!p || p->magic != SHARD_MAGIC) return SPECD_EINVAL;
    if (p->n_bufs == p->cap) {
        int cap = p->cap ? 2 * p->cap : 32;
        void **nb = realloc(p->bufs, (size_t)cap * sizeof *nb);
        if (!nb) return SPECD_ENOMEM;
        p->bufs = nb;
        p->cap = cap;
    }
    p->bufs[p->n_bufs++] = buf;
    return 0;
}

/* ---- slices -------------------------------------------------------------------------- */

/* Rows [r0, r0 + nr) x cols [c0, c0 + nc) of an FP8 view as an owned F32 view (its scales
 * do not follow a byte slice). */
static int fp8_slice(model *owner, const tensor_view *t, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                     tensor_view *out) {
    const int64_t rows = t->shape[0], cols = t->shape[1];
    float *all = malloc((size_t)rows * (size_t)cols * sizeof(float));
    float *sl = malloc((size_t)(nr * nc > 0 ? nr * nc : 1) * sizeof(float));
    int rc = all && sl ? tensor_to_f32(t, all) : SPECD_ENOMEM;
    for (int64_t r = 0; r < nr && !rc; r++)
        memcpy(sl + r * nc, all + (r0 + r) * cols + c0, (size_t)nc * sizeof(float));
    if (!rc) rc = keep(owner, sl);
    free(all);
    if (rc) {
        free(sl);
        return rc;
    }
    memset(out, 0, sizeof *out);
    out->data = sl;
    out->dtype = TDT_F32;
    out->ndim = 2;
    out->shape[0] = nr;
    out->shape[1] = nc;
    return 0;
}

int shard_slice_rows(model *owner, const tensor_view *t, int64_t r0, int64_t n, tensor_view *out) {
    if (!t || !out || !t->data || r0 < 0 || n < 0) return SPECD_EINVAL;
    int64_t rows = t->shape[0];
    if (r0 + n > rows) return SPECD_ERANGE;
    if (t->dtype == TDT_F8_E4M3) return t->ndim == 2 ? fp8_slice(owner, t, r0, n, 0, t->shape[1], out) : SPECD_EINVAL;
    *out = *t;
    if (t->ndim == 2) {
        size_t rb = span_bytes(t->dtype, t->shape[1]);
        if (!rb) return SPECD_EINVAL;
        if (t->unpermute_heads > 0) {
            /* Stored rows are permuted inside each head only, so whole heads stay put. */
            if (rows % t->unpermute_heads) return SPECD_EINVAL;
            int64_t hr = rows / t->unpermute_heads;
            if (r0 % hr || n % hr) return SPECD_EINVAL;
            out->unpermute_heads = (int)(n / hr);
        }
        out->data = (const uint8_t *)t->data + (size_t)r0 * rb;
        out->shape[0] = n;
        return 0;
    }
    if (t->ndim != 1) return SPECD_EINVAL;
    size_t off = span_bytes(t->dtype, r0);
    if ((off || r0 == 0) && span_bytes(t->dtype, n)) {
        out->data = (const uint8_t *)t->data + off;
        out->shape[0] = n;
        return 0;
    }
    /* A quantized 1-D tensor cut off its block grid: dequantize, keep the slice. */
    float *all = malloc((size_t)rows * sizeof(float)), *sl = malloc((size_t)(n ? n : 1) * sizeof(float));
    int rc = all && sl ? tensor_to_f32(t, all) : SPECD_ENOMEM;
    if (!rc) {
        memcpy(sl, all + r0, (size_t)n * sizeof(float));
        rc = keep(owner, sl);
    }
    free(all);
    if (rc) {
        free(sl);
        return rc;
    }
    out->data = sl;
    out->dtype = TDT_F32;
    out->shape[0] = n;
    out->unpermute_heads = 0;
    return 0;
}

int shard_slice_cols(model *owner, const tensor_view *t, int64_t c0, int64_t n, tensor_view *out) {
    if (!t || !out || !t->data || t->ndim != 2 || c0 < 0 || n < 0) return SPECD_EINVAL;
    int64_t rows = t->shape[0], cols = t->shape[1];
    if (c0 + n > cols) return SPECD_ERANGE;
    if (t->dtype == TDT_F8_E4M3) return fp8_slice(owner, t, 0, rows, c0, n, out);
    size_t rb = span_bytes(t->dtype, cols), off = span_bytes(t->dtype, c0);
    size_t nb = span_bytes(t->dtype, n);
    if (!rb) return SPECD_EINVAL;
    *out = *t;
    out->shape[1] = n;
    if (!t->unpermute_heads && nb && (off || c0 == 0)) {
        /* Block-aligned: copy each row's run of blocks, dtype unchanged. */
        uint8_t *buf = malloc((size_t)rows * nb + 1);
        if (!buf) return SPECD_ENOMEM;
        for (int64_t r = 0; r < rows; r++)
            memcpy(buf + (size_t)r * nb, (const uint8_t *)t->data + (size_t)r * rb + off, nb);
        int rc = keep(owner, buf);
        if (rc) {
            free(buf);
            return rc;
        }
        out->data = buf;
        return 0;
    }
    /* Off the block grid (or permuted rows): dequantize row by row into an F32 copy. */
    float *buf = malloc((size_t)rows * (size_t)n * sizeof(float) + 1);
    float *row = malloc((size_t)cols * sizeof(float));
    float *all = NULL;
    int rc = buf && row ? 0 : SPECD_ENOMEM;
    if (!rc && t->unpermute_heads) {
        if (!(all = malloc((size_t)rows * (size_t)cols * sizeof(float)))) rc = SPECD_ENOMEM;
        else rc = tensor_to_f32(t, all);
    }
    for (int64_t r = 0; r < rows && !rc; r++) {
        const float *src = all ? all + (size_t)r * cols : row;
        if (!all) {
            tensor_view rv = {.data = (const uint8_t *)t->data + (size_t)r * rb, .dtype = t->dtype, .ndim = 1,
                              .shape = {cols, 0}};
            if ((rc = tensor_to_f32(&rv, row))) break;
        }
        memcpy(buf + (size_t)r * n, src + c0, (size_t)n * sizeof(float));
    }
    free(row);
    free(all);
    if (!rc) rc = keep(owner, buf);
    if (rc) {
        free(buf);
        return rc;
    }
    out->data = buf;
    out->dtype = TDT_F32;
    out->unpermute_heads = 0;
    return 0;
}

/* ---- the shard ----------------------------------------------------------------------- */

int shard_check(const model_config *c, int world, char *err, size_t errlen) {
    if (world < 1) return specd_errf(err, errlen, SPECD_EINVAL, "tensor parallel size %d < 1", world);
    if (c->n_heads % world)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "--tensor-parallel-size %d does not divide the %d attention heads",
                          world, c->n_heads);
    if (c->n_kv_heads % world)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "--tensor-parallel-size %d does not divide the %d KV heads (GQA: "
                          "each rank must own whole KV heads; KV heads are not replicated)",
                          world, c->n_kv_heads);
    if (c->n_experts && c->moe_ffn % world)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "--tensor-parallel-size %d does not divide the experts' intermediate size %d",
                          world, c->moe_ffn);
    if (!c->n_experts && c->ffn % world)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "--tensor-parallel-size %d does not divide the intermediate size %d",
                          world, c->ffn);
    return 0;
}

void shard_free(model *m) {
    if (!m) return;
    shard_priv *p = m->priv;
    if (p && p->magic == SHARD_MAGIC) {
        for (int i = 0; i < p->n_bufs; i++) free(p->bufs[i]);
        free(p->bufs);
        free(p);
    }
    free(m->layers);
    free(m);
}

/* A gated MLP's share: rows [f0, f0 + fn) of gate and up, the same input columns of down. */
static int shard_mlp(model *s, const tensor_view *gate, const tensor_view *up, const tensor_view *down, int64_t f0,
                     int64_t fn, tensor_view *g, tensor_view *u, tensor_view *d) {
    int rc;
    if ((rc = shard_slice_rows(s, gate, f0, fn, g)) || (rc = shard_slice_rows(s, up, f0, fn, u)) ||
        (rc = shard_slice_cols(s, down, f0, fn, d)))
        return rc;
    return 0;
}

static int shard_layer(model *s, const model_layer *F, model_layer *L, int rank) {
    const model_config *c = &s->cfg;  /* already the shard's config */
    int64_t hd = c->head_dim, q0 = (int64_t)rank * c->n_heads * hd, qn = (int64_t)c->n_heads * hd;
    int64_t k0 = (int64_t)rank * c->n_kv_heads * hd, kn = (int64_t)c->n_kv_heads * hd;
    int rc;
    *L = *F;  /* norms (sandwich norms too) and the router replicated */
    L->exp_gate = L->exp_up = L->exp_down = NULL;
    if ((rc = shard_slice_rows(s, &F->wq, q0, qn, &L->wq)) ||
        (rc = shard_slice_rows(s, &F->wk, k0, kn, &L->wk)) ||
        (rc = shard_slice_rows(s, &F->wv, k0, kn, &L->wv)) ||
        (rc = shard_slice_cols(s, &F->wo, q0, qn, &L->wo)))
        return rc;
    if (c->n_experts) {
        /* every expert split like the dense MLP: its rows [rank * mf, (rank + 1) * mf) */
        const int E = c->n_experts;
        const int64_t mf = c->moe_ffn, f0 = (int64_t)rank * mf;
        tensor_view *ev = calloc(3 * (size_t)E, sizeof *ev);
        if (!ev) return SPECD_ENOMEM;
        if ((rc = keep(s, ev))) {
            free(ev);
            return rc;
        }
        L->exp_gate = ev;
        L->exp_up = ev + E;
        L->exp_down = ev + 2 * E;
        for (int e = 0; e < E; e++)
            if ((rc = shard_mlp(s, &F->exp_gate[e], &F->exp_up[e], &F->exp_down[e], f0, mf, &L->exp_gate[e],
                                &L->exp_up[e], &L->exp_down[e])))
                return rc;
    } else if ((rc = shard_mlp(s, &F->w_gate, &F->w_up, &F->w_down, (int64_t)rank * c->ffn, c->ffn, &L->w_gate,
                               &L->w_up, &L->w_down))) {
        return rc;
    }
    if (F->bq.data && (rc = shard_slice_rows(s, &F->bq, q0, qn, &L->bq))) return rc;
    if (F->bk.data && (rc = shard_slice_rows(s, &F->bk, k0, kn, &L->bk))) return rc;
    if (F->bv.data && (rc = shard_slice_rows(s, &F->bv, k0, kn, &L->bv))) return rc;
    return 0;
}

model *shard_model(const model *full, int rank, int world, char *err, size_t errlen) {
    if (!full || world < 1 || rank < 0 || rank >= world) {
        specd_errf(err, errlen, SPECD_EINVAL, "shard: rank %d of world %d is invalid", rank, world);
        return NULL;
    }
    if (shard_check(&full->cfg, world, err, errlen)) return NULL;
    model *s = calloc(1, sizeof *s);
    shard_priv *p = calloc(1, sizeof *p);
    if (!s || !p) {
        free(s);
        free(p);
        specd_errf(err, errlen, SPECD_ENOMEM, "shard: out of memory");
        return NULL;
    }
    *p = (shard_priv){.magic = SHARD_MAGIC, .rank = rank, .world = world};
    s->priv = p;
    s->cfg = full->cfg;
    s->cfg.n_heads /= world;
    s->cfg.n_kv_heads /= world;
    s->cfg.ffn /= world;
    s->cfg.moe_ffn /= world;
    memcpy(s->path, full->path, sizeof s->path);
    s->is_gguf = full->is_gguf;
    s->tok_embd = full->tok_embd;   /* replicated: see shard.h */
    s->out_norm = full->out_norm;
    s->lm_head = full->lm_head;
    s->layers = calloc((size_t)full->cfg.n_layers, sizeof *s->layers);
    if (!s->layers) {
        specd_errf(err, errlen, SPECD_ENOMEM, "shard: out of memory");
        goto fail;
    }
    for (int l = 0; l < full->cfg.n_layers; l++) {
        int rc = shard_layer(s, &full->layers[l], &s->layers[l], rank);
        if (rc) {
            specd_errf(err, errlen, rc, "shard: layer %d of %s for rank %d/%d: %s", l,
                       full->path, rank, world, specd_strerror(rc));
            goto fail;
        }
    }
    return s;
fail:
    shard_free(s);
    return NULL;
}

/* ---- CPU simulation of the sharded forward ------------------------------------------- */

/* Weights of one rank's layer in fp32 (NULL where absent). */
typedef struct {
    float *wq, *wk, *wv, *bq, *bk, *bv, *qn, *kn, *wo, *an, *fnorm, *wg, *wu, *wd;
} sim_layer;

static void sim_layer_free(sim_layer *w) {
    float *ps[] = {w->wq, w->wk, w->wv, w->bq, w->bk, w->bv, w->qn, w->kn, w->wo, w->an,
                   w->fnorm, w->wg, w->wu, w->wd};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) free(ps[i]);
    memset(w, 0, sizeof *w);
}

static int to_f32(const tensor_view *t, float **out) {
    *out = NULL;
    if (!t->data) return 0;
    if (!(*out = malloc((size_t)tensor_numel(t) * sizeof(float)))) return SPECD_ENOMEM;
    return tensor_to_f32(t, *out);
}

static int sim_layer_load(const model_layer *L, sim_layer *w) {
    struct { float **dst; const tensor_view *t; } ts[] = {
        {&w->wq, &L->wq}, {&w->wk, &L->wk}, {&w->wv, &L->wv}, {&w->bq, &L->bq},
        {&w->bk, &L->bk}, {&w->bv, &L->bv}, {&w->qn, &L->q_norm}, {&w->kn, &L->k_norm},
        {&w->wo, &L->wo}, {&w->an, &L->attn_norm}, {&w->fnorm, &L->ffn_norm},
        {&w->wg, &L->w_gate}, {&w->wu, &L->w_up}, {&w->wd, &L->w_down},
    };
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
        int rc = to_f32(ts[i].t, ts[i].dst);
        if (rc) return rc;
    }
    return 0;
}

/* y (T, out) = x (T, in) @ W (out, in)^T + b, double accumulation. */
static void sim_mm(float *y, const float *x, const float *w, const float *b, int T, int in, int out) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < out; o++) {
            double s = b ? b[o] : 0.0;
            const float *xr = x + (size_t)t * in, *wr = w + (size_t)o * in;
            for (int i = 0; i < in; i++) s += (double)xr[i] * wr[i];
            y[(size_t)t * out + o] = (float)s;
        }
}

static void sim_rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}


static void sim_rope(float *v, int hd, int pos, const float *inv) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float ang = (float)pos * inv[i], c = cosf(ang), s = sinf(ang);
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}

/* Scratch for one rank's share of one layer over T tokens. */
typedef struct {
    float *q, *k, *v, *att, *part, *g, *u;
} sim_scratch;

/* One rank's attention block: xn (T, D) replicated in, partial O output (T, D) out. */
static void sim_attention(const model_config *c, const sim_layer *w, const float *inv,
                          const float *xn, int T, sim_scratch *s) {
    int D = c->hidden, hd = c->head_dim, H = c->n_heads, KV = c->n_kv_heads;
    int qd = H * hd, kvd = KV * hd, G = H / KV;
    sim_mm(s->q, xn, w->wq, w->bq, T, D, qd);
    sim_mm(s->k, xn, w->wk, w->bk, T, D, kvd);
    sim_mm(s->v, xn, w->wv, w->bv, T, D, kvd);
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            float *q = s->q + (size_t)t * qd + (size_t)h * hd;
            if (w->qn) sim_rmsnorm(q, q, w->qn, hd, c->rms_eps);
            sim_rope(q, hd, t, inv);
        }
        for (int h = 0; h < KV; h++) {
            float *k = s->k + (size_t)t * kvd + (size_t)h * hd;
            if (w->kn) sim_rmsnorm(k, k, w->kn, hd, c->rms_eps);
            sim_rope(k, hd, t, inv);
        }
    }
    double *sc = malloc((size_t)T * sizeof(double));
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const float *q = s->q + (size_t)t * qd + (size_t)h * hd;
            int kh = h / G;  /* local Q head -> local KV head: the GQA rule of shard.h */
            double mx = -INFINITY, sum = 0;
            for (int p = 0; p <= t; p++) {
                const float *k = s->k + (size_t)p * kvd + (size_t)kh * hd;
                double d = 0;
                for (int i = 0; i < hd; i++) d += (double)q[i] * k[i];
                sc[p] = d / sqrt((double)hd);
                if (sc[p] > mx) mx = sc[p];
            }
            for (int p = 0; p <= t; p++) sum += (sc[p] = exp(sc[p] - mx));
            float *o = s->att + (size_t)t * qd + (size_t)h * hd;
            for (int i = 0; i < hd; i++) {
                double a = 0;
                for (int p = 0; p <= t; p++) a += sc[p] * s->v[(size_t)p * kvd + (size_t)kh * hd + i];
                o[i] = (float)(a / sum);
            }
        }
    free(sc);
    sim_mm(s->part, s->att, w->wo, NULL, T, qd, D);  /* row-parallel: a partial sum */
}

/* One rank's MLP block: partial down output (T, D). */
static void sim_mlp(const model_config *c, const sim_layer *w, const float *xn, int T, sim_scratch *s) {
    int D = c->hidden, F = c->ffn;
    sim_mm(s->g, xn, w->wg, NULL, T, D, F);
    sim_mm(s->u, xn, w->wu, NULL, T, D, F);
    for (size_t i = 0; i < (size_t)T * F; i++) s->g[i] = s->g[i] / (1.0f + expf(-s->g[i])) * s->u[i];
    sim_mm(s->part, s->g, w->wd, NULL, T, F, D);
}

int shard_simulate_forward(model *const *shards, int world, const int32_t *tokens, int n,
                           float *logits, char *err, size_t errlen) {
    if (!shards || world < 1 || !tokens || n < 1 || !logits)
        return specd_errf(err, errlen, SPECD_EINVAL, "shard_simulate_forward: bad arguments");
    const model_config *c = &shards[0]->cfg;  /* a shard's config: heads and ffn per rank */
    int D = c->hidden, V = c->vocab, hd = c->head_dim, rc = 0;
    int windows = 0;
    for (int l = 0; l < c->n_layers; l++) windows |= model_layer_window(c, l) > 0;
    if (c->n_experts || c->sandwich_norms || c->act != ACT_SILU || c->norm_plus_one || c->embed_scale > 0 ||
        c->attn_scale > 0 || c->rope_local_theta > 0 || windows)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "shard_simulate_forward: %s: the simulation covers Llama / Qwen layers only (no "
                          "experts, windows or Gemma 3 layers)", c->arch_name);
    for (int t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= V)
            return specd_errf(err, errlen, SPECD_EINVAL, "token %d out of vocabulary", tokens[t]);
    size_t TD = (size_t)n * D, TQ = (size_t)n * c->n_heads * hd, TK = (size_t)n * c->n_kv_heads * hd;
    float *x = malloc(TD * sizeof(float)), *xn = malloc(TD * sizeof(float));
    float *acc = malloc(TD * sizeof(float)), *inv = malloc((size_t)(hd / 2 + 1) * sizeof(float));
    float *emb = malloc((size_t)V * D * sizeof(float)), *head = NULL, *onorm = NULL;
    sim_scratch s = {malloc(TQ * 4), malloc(TK * 4), malloc(TK * 4), malloc(TQ * 4),
                     malloc(TD * 4), malloc((size_t)n * c->ffn * 4), malloc((size_t)n * c->ffn * 4)};
    sim_layer w = {0};
    if (!x || !xn || !acc || !inv || !emb || !s.q || !s.k || !s.v || !s.att || !s.part || !s.g || !s.u) {
        rc = specd_errf(err, errlen, SPECD_ENOMEM, "shard_simulate_forward: out of memory");
        goto done;
    }
    model_rope_inv_freq(c, 0, inv);  /* fp32 frequencies, as runner_cpu's default */
    /* Embedding and lm_head are replicated: rank 0's copy stands for every rank's. */
    if ((rc = tensor_to_f32(&shards[0]->tok_embd, emb))) goto conv;
    for (int t = 0; t < n; t++) memcpy(x + (size_t)t * D, emb + (size_t)tokens[t] * D, D * sizeof(float));

    for (int l = 0; l < c->n_layers; l++) {
        /* Attention: every rank normalizes the replicated x, runs its heads, and the
         * all-reduce sums the partial O projections. */
        memset(acc, 0, TD * sizeof(float));
        for (int r = 0; r < world; r++) {
            if ((rc = sim_layer_load(&shards[r]->layers[l], &w))) goto conv;
            for (int t = 0; t < n; t++)
                sim_rmsnorm(xn + (size_t)t * D, x + (size_t)t * D, w.an, D, c->rms_eps);
            sim_attention(&shards[r]->cfg, &w, inv, xn, n, &s);
            for (size_t i = 0; i < TD; i++) acc[i] += s.part[i];   /* <- all-reduce #1 */
            sim_layer_free(&w);
        }
        for (size_t i = 0; i < TD; i++) x[i] += acc[i];
        /* MLP: the same shape, all-reduce after down. */
        memset(acc, 0, TD * sizeof(float));
        for (int r = 0; r < world; r++) {
            if ((rc = sim_layer_load(&shards[r]->layers[l], &w))) goto conv;
            for (int t = 0; t < n; t++)
                sim_rmsnorm(xn + (size_t)t * D, x + (size_t)t * D, w.fnorm, D, c->rms_eps);
            sim_mlp(&shards[r]->cfg, &w, xn, n, &s);
            for (size_t i = 0; i < TD; i++) acc[i] += s.part[i];   /* <- all-reduce #2 */
            sim_layer_free(&w);
        }
        for (size_t i = 0; i < TD; i++) x[i] += acc[i];
    }
    if ((rc = to_f32(&shards[0]->out_norm, &onorm)) || (rc = to_f32(&shards[0]->lm_head, &head)))
        goto conv;
    for (int t = 0; t < n; t++) sim_rmsnorm(xn + (size_t)t * D, x + (size_t)t * D, onorm, D, c->rms_eps);
    sim_mm(logits, xn, head ? head : emb, NULL, n, D, V);  /* tied: lm_head may be absent */
    goto done;
conv:
    specd_errf(err, errlen, rc, "shard_simulate_forward: cannot convert weights: %s", specd_strerror(rc));
done:
    sim_layer_free(&w);
    free(x); free(xn); free(acc); free(inv); free(emb); free(head); free(onorm);
    free(s.q); free(s.k); free(s.v); free(s.att); free(s.part); free(s.g); free(s.u);
    return rc;
}
