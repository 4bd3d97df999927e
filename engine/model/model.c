/* Model loader (see model.h): HF checkpoint directories (config.json + safetensors, single
 * or sharded) and GGUF files become one model_config plus tensor views into the mapped
 * files. Also random-weight models of real shapes, and the view -> fp32 / bf16 converters
 * that dequantize GGUF blocks and undo llama.cpp's Q/K row permutation.
 *
 * Every tensor the architecture needs is looked up, its dtype checked and its shape
 * compared with what the config implies, so a runner never sees a view that disagrees
 * with the config. Error messages name the file that holds the problem. */
#include "engine/model/model.h"
#include "engine/core/err.h"
#include "engine/model/fp8.h"
#include "engine/model/gguf.h"
#include "engine/model/json_util.h"
#include "engine/model/safetensors.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_SHARDS 256

typedef struct {
    gguf *g;                       /* GGUF model */
    st_file *shards[MAX_SHARDS];   /* safetensors model */
    int n_shards;
    json_t *weight_map;            /* sharded: tensor name -> shard file name */
    char index_path[4200];
    float *arena;                  /* model_random: every tensor's fp32 storage */
} model_priv;

typedef struct {
    model *m;
    model_priv *p;
    char *err;
    size_t errlen;
} loader;

/* ---- tensor lookup -------------------------------------------------------------------- */

static int st_lookup(loader *L, const char *name, const st_tensor **out, const char **file) {
    model_priv *p = L->p;
    *out = NULL;
    *file = p->n_shards ? st_path(p->shards[0]) : "";
    if (!p->weight_map) {
        *out = st_find(p->shards[0], name);
        return 0;
    }
    *file = p->index_path;
    json_t *fn = json_object_get(p->weight_map, name);
    if (!fn) return 0;
    if (!json_is_string(fn))
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT,
                          "%s: weight_map entry for %s is not a string", p->index_path, name);
    for (int i = 0; i < p->n_shards; i++) {
        const char *sp = st_path(p->shards[i]), *slash = strrchr(sp, '/');
        if (strcmp(slash ? slash + 1 : sp, json_string_value(fn))) continue;
        *file = sp;
        *out = st_find(p->shards[i], name);
        if (!*out)
            return specd_errf(L->err, L->errlen, SPECD_ENOTFOUND,
                              "%s: missing tensor %s (listed for this shard in %s)", sp, name,
                              p->index_path);
        return 0;
    }
    return specd_errf(L->err, L->errlen, SPECD_EFORMAT, "%s: %s maps to unknown shard %s",
                      p->index_path, name, json_string_value(fn));
}

static void fmt_shape(char *buf, size_t n, int ndim, const int64_t *s) {
    if (ndim == 1) snprintf(buf, n, "[%lld]", (long long)s[0]);
    else snprintf(buf, n, "[%lld, %lld]", (long long)s[0], (long long)s[1]);
}

/* The view dtype of a GGUF tensor, or an error naming it. */
static int gguf_view_dtype(loader *L, const char *name, const gguf_tensor *t, tensor_view *out) {
    switch (t->type) {
    case GGML_F32: out->dtype = TDT_F32; return 0;
    case GGML_F16: out->dtype = TDT_F16; return 0;
    case GGML_BF16: out->dtype = TDT_BF16; return 0;
    case GGML_Q8_0: out->dtype = TDT_Q8_0; return 0;
    case GGML_Q4_0: out->dtype = TDT_Q4_0; return 0;
    case GGML_Q4_1: out->dtype = TDT_Q4_1; return 0;
    case GGML_Q4_K: out->dtype = TDT_Q4_K; return 0;
    case GGML_Q6_K: out->dtype = TDT_Q6_K; return 0;
    case GGML_Q5_0: out->dtype = TDT_Q5_0; return 0;
    case GGML_Q5_1: out->dtype = TDT_Q5_1; return 0;
    case GGML_Q5_K: out->dtype = TDT_Q5_K; return 0;
    default:
        return specd_errf(L->err, L->errlen, SPECD_EUNSUPPORTED,
                          "%s: tensor %s has type %s, which specd cannot dequantize "
                          "(F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K)",
                          L->m->path, name, ggml_type_name(t->type));
    }
}

/* The scales of FP8 weight `name` (X.weight): X.weight_scale (compressed-tensors,
 * fbgemm: one per tensor or per output row) or X.weight_scale_inv (HF "fp8": one per
 * weight_block_size block; despite the name a multiplier too), F32 or BF16. */
static int get_fp8_scale(loader *L, const char *name, const char *file, tensor_view *v) {
    char sn[200];
    const st_tensor *t = NULL;
    const char *sfile = file;
    int rc;
    if (!L->m->cfg.fp8)
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT,
                          "%s: tensor %s is F8_E4M3 but config.json has no FP8 quantization_config", file, name);
    for (int k = 0; k < 2 && !t; k++) {
        snprintf(sn, sizeof sn, "%s%s", name, k ? "_scale_inv" : "_scale");
        if ((rc = st_lookup(L, sn, &t, &sfile))) return rc;
    }
    if (!t)
        return specd_errf(L->err, L->errlen, SPECD_ENOTFOUND, "%s: FP8 tensor %s has no %s_scale or %s_scale_inv",
                          file, name, name, name);
    if (t->dtype != ST_F32 && t->dtype != ST_BF16)
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT, "%s: %s has dtype %s (F32 or BF16 expected)", sfile, sn,
                          st_dtype_name(t->dtype));
    const int64_t rows = v->shape[0], cols = v->shape[1];
    int64_t numel = 1, sr = 1, sc = 1;
    for (int i = 0; i < t->ndim; i++) numel *= t->shape[i];
    if (t->ndim >= 1) sr = t->shape[0];
    if (t->ndim >= 2) sc = t->shape[1];
    v->scale = t->data;
    v->scale_dtype = t->dtype == ST_F32 ? TDT_F32 : TDT_BF16;
    v->scale_row0 = 0;
    const int *bs = L->m->cfg.fp8_block;
    if (numel == 1 && t->ndim <= 2) {                       /* per tensor */
        v->scale_block[0] = rows;
        v->scale_block[1] = cols;
        v->scale_cols = 1;
    } else if (t->ndim <= 2 && sr == rows && sc == 1 && numel == rows) {   /* per output row */
        v->scale_block[0] = 1;
        v->scale_block[1] = cols;
        v->scale_cols = 1;
    } else if (t->ndim == 2 && bs[0] > 0 && sr == (rows + bs[0] - 1) / bs[0] && sc == (cols + bs[1] - 1) / bs[1]) {
        v->scale_block[0] = bs[0];
        v->scale_block[1] = bs[1];
        v->scale_cols = sc;
    } else {
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT,
                          "%s: %s has %lld scales for a [%lld, %lld] weight (one, one per row, or one per "
                          "weight_block_size block)", sfile, sn, (long long)numel, (long long)rows, (long long)cols);
    }
    return 0;
}

/* Find `name`, check its dtype and that its shape is [d0] (ndim 1) or [d0, d1]. A missing
 * tensor is an error when `required`, else the view is left with data == NULL. */
static int get_tensor(loader *L, const char *name, int required, int ndim, int64_t d0,
                      int64_t d1, tensor_view *out) {
    const char *file = L->m->path;
    int64_t shape[2] = {0, 0};
    int got_ndim = 0;
    memset(out, 0, sizeof *out);
    if (L->p->g) {
        const gguf_tensor *t = gguf_find_tensor(L->p->g, name);
        if (t) {
            int rc = gguf_view_dtype(L, name, t, out);
            if (rc) return rc;
            /* ggml ne[0] is the row length: ne = [in, out] is a row-major [out, in].
             * Trailing dimensions of 1 carry no shape (converters may write [n, 1] for a
             * vector); anything with ne[2] or ne[3] > 1 is reported as 3-D. */
            got_ndim = (t->n_dims >= 2 && t->ne[1] != 1) || ndim == 2 ? 2 : 1;
            if (t->ne[2] != 1 || t->ne[3] != 1) got_ndim = 3;
            if (got_ndim == 2) { shape[0] = t->ne[1]; shape[1] = t->ne[0]; }
            else { shape[0] = t->ne[0]; }
            out->data = t->data;
        }
    } else {
        const st_tensor *t;
        int rc = st_lookup(L, name, &t, &file);
        if (rc) return rc;
        if (t) {
            switch (t->dtype) {
            case ST_F32: out->dtype = TDT_F32; break;
            case ST_F16: out->dtype = TDT_F16; break;
            case ST_BF16: out->dtype = TDT_BF16; break;
            case ST_F8_E4M3:
                if (ndim != 2)
                    return specd_errf(L->err, L->errlen, SPECD_EUNSUPPORTED,
                                      "%s: tensor %s is F8_E4M3 (only 2-D weights may be)", file, name);
                out->dtype = TDT_F8_E4M3;
                break;
            default:
                return specd_errf(L->err, L->errlen, SPECD_EUNSUPPORTED,
                                  "%s: tensor %s has dtype %s (F32, F16 and BF16 are supported%s)",
                                  file, name, st_dtype_name(t->dtype),
                                  L->m->cfg.fp8 ? "; F8_E4M3 for 2-D weights" : "");
            }
            got_ndim = t->ndim;
            if (t->ndim >= 1) shape[0] = t->shape[0];
            if (t->ndim >= 2) shape[1] = t->shape[1];
            out->data = t->data;
        }
    }
    if (!out->data) {
        if (!required) return 0;
        return specd_errf(L->err, L->errlen, SPECD_ENOTFOUND, "%s: missing tensor %s", file, name);
    }
    int64_t want[2] = {d0, d1};
    if (got_ndim != ndim || shape[0] != d0 || (ndim == 2 && shape[1] != d1)) {
        char g[64], w[64];
        if (got_ndim == 1 || got_ndim == 2) fmt_shape(g, sizeof g, got_ndim, shape);
        else snprintf(g, sizeof g, "%d dimensions", got_ndim);
        fmt_shape(w, sizeof w, ndim, want);
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT,
                          "%s: tensor %s has shape %s, the config implies %s", file, name, g, w);
    }
    out->ndim = ndim;
    out->shape[0] = d0;
    out->shape[1] = ndim == 2 ? d1 : 0;
    return out->dtype == TDT_F8_E4M3 ? get_fp8_scale(L, name, file, out) : 0;
}

/* Tensor names of one format; %d is the layer (experts: layer, then expert). An empty
 * name: the format has no such tensor. */
typedef struct {
    const char *embd, *out_norm, *lm_head;
    const char *attn_norm, *wq, *wk, *wv, *bq, *bk, *bv, *q_norm, *k_norm, *wo;
    const char *ffn_norm, *gate, *up, *down;
    const char *qkv, *gate_up;                 /* fused (Phi-3) */
    const char *post_attn_norm, *post_ffn_norm; /* sandwich norms (Gemma 3) */
    const char *router, *exp_gate, *exp_up, *exp_down;    /* per-expert tensors */
    const char *exps_gate, *exps_up, *exps_down;          /* GGUF: experts stacked, 3-D */
} tensor_names;

static const tensor_names hf_names = {
    .embd = "model.embed_tokens.weight", .out_norm = "model.norm.weight", .lm_head = "lm_head.weight",
    .attn_norm = "model.layers.%d.input_layernorm.weight",
    .wq = "model.layers.%d.self_attn.q_proj.weight", .wk = "model.layers.%d.self_attn.k_proj.weight",
    .wv = "model.layers.%d.self_attn.v_proj.weight", .bq = "model.layers.%d.self_attn.q_proj.bias",
    .bk = "model.layers.%d.self_attn.k_proj.bias", .bv = "model.layers.%d.self_attn.v_proj.bias",
    .q_norm = "model.layers.%d.self_attn.q_norm.weight", .k_norm = "model.layers.%d.self_attn.k_norm.weight",
    .wo = "model.layers.%d.self_attn.o_proj.weight",
    .ffn_norm = "model.layers.%d.post_attention_layernorm.weight",
    .gate = "model.layers.%d.mlp.gate_proj.weight", .up = "model.layers.%d.mlp.up_proj.weight",
    .down = "model.layers.%d.mlp.down_proj.weight",
    .qkv = "model.layers.%d.self_attn.qkv_proj.weight", .gate_up = "model.layers.%d.mlp.gate_up_proj.weight",
    /* Gemma 3's and Mixtral's differences: load_hf */
    .post_attn_norm = "model.layers.%d.post_attention_layernorm.weight",
    .post_ffn_norm = "model.layers.%d.post_feedforward_layernorm.weight",
    .router = "model.layers.%d.mlp.gate.weight",
    .exp_gate = "model.layers.%d.mlp.experts.%d.gate_proj.weight",
    .exp_up = "model.layers.%d.mlp.experts.%d.up_proj.weight",
    .exp_down = "model.layers.%d.mlp.experts.%d.down_proj.weight",
};

static const tensor_names gguf_names = {
    .embd = "token_embd.weight", .out_norm = "output_norm.weight", .lm_head = "output.weight",
    .attn_norm = "blk.%d.attn_norm.weight", .wq = "blk.%d.attn_q.weight", .wk = "blk.%d.attn_k.weight",
    .wv = "blk.%d.attn_v.weight", .bq = "blk.%d.attn_q.bias", .bk = "blk.%d.attn_k.bias",
    .bv = "blk.%d.attn_v.bias", .q_norm = "blk.%d.attn_q_norm.weight", .k_norm = "blk.%d.attn_k_norm.weight",
    .wo = "blk.%d.attn_output.weight", .ffn_norm = "blk.%d.ffn_norm.weight",
    .gate = "blk.%d.ffn_gate.weight", .up = "blk.%d.ffn_up.weight", .down = "blk.%d.ffn_down.weight",
    .qkv = "blk.%d.attn_qkv.weight", .gate_up = "blk.%d.ffn_up.weight",
    .post_attn_norm = "blk.%d.post_attention_norm.weight", .post_ffn_norm = "blk.%d.post_ffw_norm.weight",
    .router = "blk.%d.ffn_gate_inp.weight",
    /* older Mixtral files: one tensor per expert */
    .exp_gate = "blk.%d.ffn_gate.%d.weight", .exp_up = "blk.%d.ffn_up.%d.weight",
    .exp_down = "blk.%d.ffn_down.%d.weight",
    .exps_gate = "blk.%d.ffn_gate_exps.weight", .exps_up = "blk.%d.ffn_up_exps.weight",
    .exps_down = "blk.%d.ffn_down_exps.weight",
};

static int get_layer_tensor(loader *L, const char *fmt, int layer, int required, int ndim,
                            int64_t d0, int64_t d1, tensor_view *out) {
    char name[128];
    snprintf(name, sizeof name, fmt, layer);
    return get_tensor(L, name, required, ndim, d0, d1, out);
}

static size_t view_row_bytes(const tensor_view *t);

/* Rows [r0, r0 + n) of a 2-D view, as a view of its own (fused tensors). */
static tensor_view view_rows(const tensor_view *t, int64_t r0, int64_t n) {
    tensor_view v = *t;
    v.data = (const uint8_t *)t->data + (size_t)r0 * view_row_bytes(t);
    v.shape[0] = n;
    if (t->dtype == TDT_F8_E4M3) v.scale_row0 += r0;   /* the scales stay the whole tensor's */
    return v;
}

/* Expert e's [d0, d1] matrix of layer `layer`: a GGUF 3-D tensor of all experts (ggml ne
 * [d1, d0, E]) when `stacked` names one in the file, else one tensor per expert. */
static int get_experts(loader *L, const char *stacked, const char *per_expert, int layer, int64_t d0,
                       int64_t d1, tensor_view *out) {
    int E = L->m->cfg.n_experts, rc;
    char name[160];
    if (L->p->g && stacked) {
        snprintf(name, sizeof name, stacked, layer);
        const gguf_tensor *t = gguf_find_tensor(L->p->g, name);
        if (t) {
            tensor_view v;
            if ((rc = gguf_view_dtype(L, name, t, &v))) return rc;
            if (t->ne[0] != d1 || t->ne[1] != d0 || t->ne[2] != E || t->ne[3] != 1)
                return specd_errf(L->err, L->errlen, SPECD_EFORMAT,
                                  "%s: tensor %s has ggml shape [%lld, %lld, %lld, %lld], the config implies "
                                  "[%lld, %lld, %d]", L->m->path, name, (long long)t->ne[0], (long long)t->ne[1],
                                  (long long)t->ne[2], (long long)t->ne[3], (long long)d1, (long long)d0, E);
            v.ndim = 2;
            v.shape[0] = d0;
            v.shape[1] = d1;
            v.unpermute_heads = 0;
            size_t bytes = (size_t)d0 * view_row_bytes(&v);
            for (int e = 0; e < E; e++) {
                out[e] = v;
                out[e].data = (const uint8_t *)t->data + (size_t)e * bytes;
            }
            return 0;
        }
    }
    for (int e = 0; e < E; e++) {
        snprintf(name, sizeof name, per_expert, layer, e);
        if ((rc = get_tensor(L, name, 1, 2, d0, d1, &out[e]))) return rc;
    }
    return 0;
}

static int load_moe(loader *L, const tensor_names *nm, int i) {
    const model_config *c = &L->m->cfg;
    model_layer *ly = &L->m->layers[i];
    int64_t H = c->hidden, F = c->moe_ffn;
    size_t E = (size_t)c->n_experts;
    ly->exp_gate = calloc(3 * E, sizeof(tensor_view));
    if (!ly->exp_gate) return specd_errf(L->err, L->errlen, SPECD_ENOMEM, "%s: out of memory", L->m->path);
    ly->exp_up = ly->exp_gate + E;
    ly->exp_down = ly->exp_gate + 2 * E;
    int rc;
    if ((rc = get_layer_tensor(L, nm->router, i, 1, 2, c->n_experts, H, &ly->router)) ||
        (rc = get_experts(L, nm->exps_gate, nm->exp_gate, i, F, H, ly->exp_gate)) ||
        (rc = get_experts(L, nm->exps_up, nm->exp_up, i, F, H, ly->exp_up)) ||
        (rc = get_experts(L, nm->exps_down, nm->exp_down, i, H, F, ly->exp_down)))
        return rc;
    return 0;
}

/* An FP8 KV cache scale of layer `layer` (fmt names it), when the checkpoint has one: a
 * single F32 / BF16 / F16 element (shape [] or [1]), positive and finite. */
static int get_kv_scale(loader *L, const char *fmt, int layer, float *out) {
    char name[128];
    const st_tensor *t;
    const char *file;
    if (L->p->g) return 0;   /* GGUF files carry no KV cache scales */
    snprintf(name, sizeof name, fmt, layer);
    int rc = st_lookup(L, name, &t, &file);
    if (rc || !t) return rc;
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    float v = NAN;
    tensor_view tv = {.data = t->data, .ndim = 1, .shape = {1, 0}};
    tv.dtype = t->dtype == ST_F32 ? TDT_F32 : t->dtype == ST_BF16 ? TDT_BF16 : TDT_F16;
    if (n == 1 && (t->dtype == ST_F32 || t->dtype == ST_BF16 || t->dtype == ST_F16)) tensor_to_f32(&tv, &v);
    if (!(v > 0) || !isfinite(v))
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT,
                          "%s: %s must be one positive F32, BF16 or F16 value (a KV cache scale)", file, name);
    *out = v;
    return 0;
}

static int load_tensors(loader *L, const tensor_names *nm) {
    model *m = L->m;
    const model_config *c = &m->cfg;
    int64_t H = c->hidden, Q = (int64_t)c->n_heads * c->head_dim;
    int64_t KV = (int64_t)c->n_kv_heads * c->head_dim, F = c->ffn;
    int rc;
    if ((rc = get_tensor(L, nm->embd, 1, 2, c->vocab, H, &m->tok_embd)) ||
        (rc = get_tensor(L, nm->out_norm, 1, 1, H, 0, &m->out_norm)))
        return rc;
    if (c->tied_embeddings) {
        m->lm_head = m->tok_embd;
    } else if ((rc = get_tensor(L, nm->lm_head, 1, 2, c->vocab, H, &m->lm_head))) {
        return rc;
    }
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return specd_errf(L->err, L->errlen, SPECD_ENOMEM, "%s: out of memory", m->path);
    for (int i = 0; i < c->n_layers; i++) {
        model_layer *ly = &m->layers[i];
        if ((rc = get_layer_tensor(L, nm->attn_norm, i, 1, 1, H, 0, &ly->attn_norm)) ||
            (rc = get_layer_tensor(L, nm->wo, i, 1, 2, H, Q, &ly->wo)) ||
            (rc = get_layer_tensor(L, nm->ffn_norm, i, 1, 1, H, 0, &ly->ffn_norm)))
            return rc;
        if (c->arch == MODEL_ARCH_PHI3) {   /* fused: [q; k; v] and [gate; up] */
            tensor_view qkv, gu;
            if ((rc = get_layer_tensor(L, nm->qkv, i, 1, 2, Q + 2 * KV, H, &qkv)) ||
                (rc = get_layer_tensor(L, nm->gate_up, i, 1, 2, 2 * F, H, &gu)))
                return rc;
            ly->wq = view_rows(&qkv, 0, Q);
            ly->wk = view_rows(&qkv, Q, KV);
            ly->wv = view_rows(&qkv, Q + KV, KV);
            ly->w_gate = view_rows(&gu, 0, F);
            ly->w_up = view_rows(&gu, F, F);
        } else if ((rc = get_layer_tensor(L, nm->wq, i, 1, 2, Q, H, &ly->wq)) ||
                   (rc = get_layer_tensor(L, nm->wk, i, 1, 2, KV, H, &ly->wk)) ||
                   (rc = get_layer_tensor(L, nm->wv, i, 1, 2, KV, H, &ly->wv))) {
            return rc;
        }
        if (c->n_experts) {
            if ((rc = load_moe(L, nm, i))) return rc;
        } else {
            if (c->arch != MODEL_ARCH_PHI3 &&
                ((rc = get_layer_tensor(L, nm->gate, i, 1, 2, F, H, &ly->w_gate)) ||
                 (rc = get_layer_tensor(L, nm->up, i, 1, 2, F, H, &ly->w_up))))
                return rc;
            if ((rc = get_layer_tensor(L, nm->down, i, 1, 2, H, F, &ly->w_down))) return rc;
        }
        if (c->sandwich_norms &&
            ((rc = get_layer_tensor(L, nm->post_attn_norm, i, 1, 1, H, 0, &ly->post_attn_norm)) ||
             (rc = get_layer_tensor(L, nm->post_ffn_norm, i, 1, 1, H, 0, &ly->post_ffn_norm))))
            return rc;
        if (c->qkv_bias &&
            ((rc = get_layer_tensor(L, nm->bq, i, 1, 1, Q, 0, &ly->bq)) ||
             (rc = get_layer_tensor(L, nm->bk, i, 1, 1, KV, 0, &ly->bk)) ||
             (rc = get_layer_tensor(L, nm->bv, i, 1, 1, KV, 0, &ly->bv))))
            return rc;
        if (c->qk_norm &&
            ((rc = get_layer_tensor(L, nm->q_norm, i, 1, 1, c->head_dim, 0, &ly->q_norm)) ||
             (rc = get_layer_tensor(L, nm->k_norm, i, 1, 1, c->head_dim, 0, &ly->k_norm))))
            return rc;
        if ((rc = get_kv_scale(L, "model.layers.%d.self_attn.kv_scale", i, &ly->k_scale)) ||
            (rc = get_kv_scale(L, "model.layers.%d.self_attn.k_scale", i, &ly->k_scale)))
            return rc;
        ly->v_scale = ly->k_scale;
        if ((rc = get_kv_scale(L, "model.layers.%d.self_attn.v_scale", i, &ly->v_scale))) return rc;
        /* llama.cpp's converter interleaves the rotary halves of Q and K rows for llama
         * (Mixtral's GGUF architecture is llama too). */
        if (m->is_gguf && (c->arch == MODEL_ARCH_LLAMA || c->arch == MODEL_ARCH_MIXTRAL)) {
            ly->wq.unpermute_heads = c->n_heads;
            ly->wk.unpermute_heads = c->n_kv_heads;
        }
    }
    return 0;
}

/* ---- config checks shared by both formats --------------------------------------------- */

static int check_config(const model_config *c, const char *file, char *err, size_t errlen) {
    struct { const char *name; int64_t v; } pos[] = {
        {"num_hidden_layers", c->n_layers}, {"hidden_size", c->hidden},
        {"num_attention_heads", c->n_heads}, {"num_key_value_heads", c->n_kv_heads},
        {"head_dim", c->head_dim}, {"intermediate_size", c->ffn}, {"vocab_size", c->vocab},
    };
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v <= 0 || pos[i].v > (1 << 24))
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: %s = %lld is out of range", file,
                              pos[i].name, (long long)pos[i].v);
    if (c->n_layers > MODEL_MAX_LAYERS)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: %d layers (at most %d)", file, c->n_layers,
                          MODEL_MAX_LAYERS);
    if (c->n_heads % c->n_kv_heads)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                          file, c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: head_dim %d is odd (rotary needs pairs)",
                          file, c->head_dim);
    if (!(c->rms_eps > 0) || !(c->rope_theta > 0))
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: rms_norm_eps and rope_theta must be positive", file);
    if (c->n_experts && (c->n_experts > MODEL_MAX_EXPERTS || c->n_experts_used < 1 ||
                         c->n_experts_used > c->n_experts || c->moe_ffn < 1 || c->moe_ffn > (1 << 24)))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: expert counts out of range", file);
    if (c->rope_type == ROPE_LLAMA3 &&
        (!(c->rope_factor > 0) || !(c->rope_high_freq_factor > c->rope_low_freq_factor) ||
         c->rope_orig_max_pos <= 0))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: invalid llama3 rope parameters", file);
    return 0;
}

/* ---- HF checkpoint directory ---------------------------------------------------------- */

#define JU(call)                              \
    do {                                      \
        int ju_rc_ = (call);                  \
        if (ju_rc_ < 0) return ju_rc_;        \
    } while (0)

static int hf_int(const json_t *j, const char *key, int required, int64_t dflt, int *out,
                  const char *file, char *err, size_t errlen) {
    int64_t v = dflt;
    int rc = ju_int(j, key, &v, file, err, errlen);
    if (rc < 0) return rc;
    if (rc == JU_ABSENT && required)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: missing \"%s\"", file, key);
    if (v < INT32_MIN || v > INT32_MAX)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: \"%s\" out of range", file, key);
    *out = (int)v;
    return 0;
}

/* rope: transformers 5 writes "rope_parameters" {rope_type, rope_theta, factor, ...};
 * older configs write "rope_theta" plus "rope_scaling" (null or {rope_type|type, ...}). */
static int hf_rope(const json_t *j, model_config *c, const char *file, char *err, size_t errlen) {
    const json_t *rp = json_object_get(j, "rope_parameters");
    const json_t *sc;
    double theta = 10000.0, v;
    const char *type = "default";
    if (json_is_object(rp)) {
        sc = rp;
        JU(ju_num(j, "rope_theta", &theta, file, err, errlen));
        JU(ju_num(rp, "rope_theta", &theta, file, err, errlen));
    } else {
        JU(ju_num(j, "rope_theta", &theta, file, err, errlen));
        sc = json_object_get(j, "rope_scaling");
        if (sc && !json_is_null(sc) && !json_is_object(sc))
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: \"rope_scaling\" must be an object",
                              file);
    }
    if (json_is_object(sc)) {
        int rc = ju_str(sc, "rope_type", &type, file, err, errlen);
        if (rc < 0) return rc;
        if (rc == JU_ABSENT) JU(ju_str(sc, "type", &type, file, err, errlen));
    }
    c->rope_theta = (float)theta;
    if (!strcmp(type, "default")) {
        c->rope_type = ROPE_DEFAULT;
        return 0;
    }
    if (!strcmp(type, "linear")) {
        if (ju_num(sc, "factor", &v, file, err, errlen) || !(v > 0))
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: linear rope needs a positive \"factor\"", file);
        c->rope_type = ROPE_LINEAR;
        c->rope_factor = (float)v;
        return 0;
    }
    if (strcmp(type, "llama3"))
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "%s: rope type \"%s\" is not supported (default, linear, llama3)", file, type);
    c->rope_type = ROPE_LLAMA3;
    if (ju_num(sc, "factor", &v, file, err, errlen))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: llama3 rope needs a numeric \"factor\"",
                          file);
    c->rope_factor = (float)v;
    v = 1.0;
    JU(ju_num(sc, "low_freq_factor", &v, file, err, errlen));
    c->rope_low_freq_factor = (float)v;
    v = 4.0;
    JU(ju_num(sc, "high_freq_factor", &v, file, err, errlen));
    c->rope_high_freq_factor = (float)v;
    return hf_int(sc, "original_max_position_embeddings", 0, 8192, &c->rope_orig_max_pos, file,
                  err, errlen);
}

/* bos_token_id / eos_token_id (int or list of ints) from one JSON file; keys absent there
 * leave c unchanged, so reading generation_config.json after config.json lets it win. */
static int hf_special_tokens(const json_t *j, model_config *c, const char *file, char *err,
                             size_t errlen) {
    int64_t v;
    int rc = ju_int(j, "bos_token_id", &v, file, err, errlen);
    if (rc < 0) return rc;
    if (rc == 0) c->bos_id = (int)v;
    const json_t *e = json_object_get(j, "eos_token_id");
    if (!e || json_is_null(e)) return 0;
    if (json_is_integer(e)) {
        c->eos_ids[0] = (int)json_integer_value(e);
        c->n_eos = 1;
        return 0;
    }
    if (!json_is_array(e) || json_array_size(e) > MODEL_MAX_EOS)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: \"eos_token_id\" must be an integer or a list of at most %d", file,
                          MODEL_MAX_EOS);
    for (size_t i = 0; i < json_array_size(e); i++) {
        const json_t *x = json_array_get(e, i);
        if (!json_is_integer(x))
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: \"eos_token_id\"[%zu] is not an integer",
                              file, i);
        c->eos_ids[i] = (int)json_integer_value(x);
    }
    c->n_eos = (int)json_array_size(e);
    return 0;
}

/* Qwen2/Qwen3 (and MoE): a window applies only with use_sliding_window, above
 * max_window_layers, which specd refuses. */
static int qwen_window_rules(model_arch a) {
    return a == MODEL_ARCH_QWEN2 || a == MODEL_ARCH_QWEN3 || a == MODEL_ARCH_QWEN3MOE;
}

/* Sliding-window attention changes the math, so it is applied or refused, never ignored.
 * Mistral, Mixtral, Phi-3: "sliding_window" W (null: none) on every layer. Qwen2/Qwen3
 * (and MoE): the window applies only with "use_sliding_window" true, and then only above
 * "max_window_layers": refused. Gemma 3: on the layers its layer_types mark (hf_family). */
static int hf_sliding_window(const json_t *j, model_config *c, const char *file, char *err, size_t errlen) {
    int64_t w = 0;
    int use = 1, rc;
    if ((rc = ju_int(j, "sliding_window", &w, file, err, errlen)) < 0) return rc;
    if (rc == JU_ABSENT || w <= 0) return 0;
    if (qwen_window_rules(c->arch)) {
        if ((rc = ju_bool(j, "use_sliding_window", &use, file, err, errlen)) < 0) return rc;
        if (rc == JU_ABSENT || !use) return 0;
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "%s: use_sliding_window (windowed layers above max_window_layers) is not supported", file);
    }
    if (w > (1 << 24)) return specd_errf(err, errlen, SPECD_EFORMAT, "%s: sliding_window %lld is out of range",
                                         file, (long long)w);
    c->sliding_window = (int)w;
    if (c->arch != MODEL_ARCH_GEMMA3) memset(c->layer_swa, 1, sizeof c->layer_swa);
    return 0;
}

/* A key that must be absent or null (a feature that would change the output). */
static int hf_absent(const json_t *j, const char *key, const char *file, char *err, size_t errlen) {
    const json_t *v = json_object_get(j, key);
    if (!v || json_is_null(v) || json_is_false(v)) return 0;
    return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: \"%s\" is not supported", file, key);
}

/* Gemma 3's config: layer pattern, rotary per layer type, scales, soft-capping. */
static int hf_gemma3(const json_t *j, model_config *c, const char *file, char *err, size_t errlen) {
    int rc;
    double v;
    if ((rc = hf_absent(j, "attn_logit_softcapping", file, err, errlen)) ||
        (rc = hf_absent(j, "final_logit_softcapping", file, err, errlen)) ||
        (rc = hf_absent(j, "use_bidirectional_attention", file, err, errlen)))
        return rc;
    c->norm_plus_one = 1;
    c->sandwich_norms = 1;
    c->embed_scale = sqrtf((float)c->hidden);
    v = c->head_dim;
    JU(ju_num(j, "query_pre_attn_scalar", &v, file, err, errlen));
    if (!(v > 0)) return specd_errf(err, errlen, SPECD_EFORMAT, "%s: query_pre_attn_scalar must be positive", file);
    c->attn_scale = (float)(1.0 / sqrt(v));
    /* rotary: transformers 5 nests {full_attention: {...}, sliding_attention: {...}};
     * older configs give rope_theta (+ rope_scaling) and rope_local_base_freq */
    const json_t *rp = json_object_get(j, "rope_parameters");
    const json_t *full = json_is_object(rp) ? json_object_get(rp, "full_attention") : NULL;
    double local = 10000.0;
    if (json_is_object(full)) {
        json_t *tmp = json_pack("{sO}", "rope_parameters", full);
        rc = tmp ? hf_rope(tmp, c, file, err, errlen) : SPECD_ENOMEM;
        json_decref(tmp);
        if (rc) return rc;
        const json_t *sl = json_object_get(rp, "sliding_attention");
        const char *type = "default";
        if (json_is_object(sl)) {
            JU(ju_num(sl, "rope_theta", &local, file, err, errlen));
            JU(ju_str(sl, "rope_type", &type, file, err, errlen));
        }
        if (strcmp(type, "default"))
            return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                              "%s: rope type \"%s\" on sliding layers is not supported (default)", file, type);
    } else {
        if ((rc = hf_rope(j, c, file, err, errlen))) return rc;
        JU(ju_num(j, "rope_local_base_freq", &local, file, err, errlen));
    }
    if (!(local > 0)) return specd_errf(err, errlen, SPECD_EFORMAT, "%s: local rope base must be positive", file);
    c->rope_local_theta = (float)local;
    /* which layers slide: layer_types, else every sliding_window_pattern-th layer is full */
    const json_t *lt = json_object_get(j, "layer_types");
    if (json_is_array(lt)) {
        if ((int)json_array_size(lt) != c->n_layers)
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: layer_types has %zu entries for %d layers", file,
                              json_array_size(lt), c->n_layers);
        for (int l = 0; l < c->n_layers; l++) {
            const char *t = json_string_value(json_array_get(lt, (size_t)l));
            if (!t || (strcmp(t, "sliding_attention") && strcmp(t, "full_attention")))
                return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: layer_types[%d] \"%s\" is not supported "
                                  "(sliding_attention, full_attention)", file, l, t ? t : "?");
            c->layer_swa[l] = !strcmp(t, "sliding_attention");
        }
    } else {
        int pat = 6;
        if ((rc = hf_int(j, "sliding_window_pattern", 0, 6, &pat, file, err, errlen)) ||
            (rc = hf_int(j, "_sliding_window_pattern", 0, pat, &pat, file, err, errlen)))
            return rc;
        if (pat < 1) return specd_errf(err, errlen, SPECD_EFORMAT, "%s: sliding_window_pattern must be >= 1", file);
        for (int l = 0; l < c->n_layers; l++) c->layer_swa[l] = (l + 1) % pat != 0;
    }
    return 0;
}

/* What each family adds to the llama config: experts, fused weights' rotary, Gemma 3. */
static int hf_family(const json_t *j, model_config *c, const char *file, char *err, size_t errlen) {
    int rc;
    if (c->n_layers > MODEL_MAX_LAYERS)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: %d layers (at most %d)", file, c->n_layers,
                          MODEL_MAX_LAYERS);
    if (c->arch == MODEL_ARCH_PHI3) {
        double prf = 1.0;
        const json_t *rp = json_object_get(j, "rope_parameters");
        JU(ju_num(j, "partial_rotary_factor", &prf, file, err, errlen));
        if (json_is_object(rp)) JU(ju_num(rp, "partial_rotary_factor", &prf, file, err, errlen));
        if (prf != 1.0)
            return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: partial_rotary_factor %g is not supported (1.0)",
                              file, prf);
    }
    if (c->arch == MODEL_ARCH_MIXTRAL) {
        c->moe_ffn = c->ffn;
        c->moe_norm_topk = 1;
        if ((rc = hf_int(j, "num_local_experts", 1, 0, &c->n_experts, file, err, errlen)) ||
            (rc = hf_int(j, "num_experts_per_tok", 1, 0, &c->n_experts_used, file, err, errlen)))
            return rc;
    }
    if (c->arch == MODEL_ARCH_QWEN3MOE) {
        int step = 1;
        int64_t n = 0;
        if ((rc = ju_int(j, "num_experts", &n, file, err, errlen)) < 0) return rc;
        if (rc == JU_ABSENT && (rc = ju_int(j, "num_local_experts", &n, file, err, errlen)) < 0) return rc;
        if (rc == JU_ABSENT) return specd_errf(err, errlen, SPECD_EFORMAT, "%s: missing \"num_experts\"", file);
        c->n_experts = n > 0 && n <= MODEL_MAX_EXPERTS ? (int)n : -1;
        if ((rc = hf_int(j, "num_experts_per_tok", 1, 0, &c->n_experts_used, file, err, errlen)) ||
            (rc = hf_int(j, "moe_intermediate_size", 1, 0, &c->moe_ffn, file, err, errlen)) ||
            (rc = hf_int(j, "decoder_sparse_step", 0, 1, &step, file, err, errlen)))
            return rc;
        JU(ju_bool(j, "norm_topk_prob", &c->moe_norm_topk, file, err, errlen));
        const json_t *dense = json_object_get(j, "mlp_only_layers");
        if (step != 1 || (json_is_array(dense) && json_array_size(dense)))
            return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                              "%s: dense MLP layers between the MoE layers (decoder_sparse_step %d, mlp_only_layers) "
                              "are not supported", file, step);
        if ((rc = hf_absent(j, "shared_expert_intermediate_size", file, err, errlen))) return rc;
    }
    if (c->n_experts &&
        (c->n_experts < 1 || c->n_experts > MODEL_MAX_EXPERTS || c->n_experts_used < 1 ||
         c->n_experts_used > c->n_experts || c->moe_ffn < 1 || c->moe_ffn > (1 << 24)))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: expert counts out of range (%d experts, %d per token, "
                          "%d wide)", file, c->n_experts, c->n_experts_used, c->moe_ffn);
    if (c->arch == MODEL_ARCH_GEMMA3) return hf_gemma3(j, c, file, err, errlen);
    return 0;
}

/* quantization_config: FP8 checkpoints load (their projections become TDT_F8_E4M3 views
 * with their scales, see get_tensor); every other method is refused by name, since its
 * tensors (packed int4, zero points, ...) are not what the loader would look for. */
static int hf_quantization(const json_t *j, model_config *c, const char *file, char *err, size_t errlen) {
    const json_t *q = json_object_get(j, "quantization_config");
    if (!q || json_is_null(q)) return 0;
    const char *method = json_string_value(json_object_get(q, "quant_method"));
    if (!json_is_object(q) || !method)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: quantization_config needs a quant_method", file);
    int ok = !strcmp(method, "fp8") || !strcmp(method, "fbgemm_fp8");
    if (!strcmp(method, "compressed-tensors")) {
        const char *fmt = json_string_value(json_object_get(q, "format"));
        ok = fmt && !strcmp(fmt, "float-quantized");
        if (!ok)
            return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                              "%s: compressed-tensors format \"%s\" is not supported (float-quantized FP8 is)", file,
                              fmt ? fmt : "(none)");
    }
    if (!ok)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "%s: quantization method \"%s\" is not supported (FP8 checkpoints are: fp8, fbgemm_fp8, "
                          "compressed-tensors float-quantized; GGUF files for the integer formats)", file, method);
    const char *fmt = json_string_value(json_object_get(q, "fmt"));
    if (fmt && strcmp(fmt, "e4m3"))
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: FP8 format \"%s\" is not supported (e4m3 is)", file, fmt);
    c->fp8 = 1;
    const json_t *bs = json_object_get(q, "weight_block_size");
    if (bs && !json_is_null(bs)) {
        if (!json_is_array(bs) || json_array_size(bs) != 2 || !json_is_integer(json_array_get(bs, 0)) ||
            !json_is_integer(json_array_get(bs, 1)) || json_integer_value(json_array_get(bs, 0)) < 1 ||
            json_integer_value(json_array_get(bs, 1)) < 1 || json_integer_value(json_array_get(bs, 0)) > 1 << 20 ||
            json_integer_value(json_array_get(bs, 1)) > 1 << 20)
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: weight_block_size must be two positive integers", file);
        c->fp8_block[0] = (int)json_integer_value(json_array_get(bs, 0));
        c->fp8_block[1] = (int)json_integer_value(json_array_get(bs, 1));
    }
    return 0;
}

static int hf_config(const char *dir, model_config *c, char *err, size_t errlen) {
    char file[4200];
    json_t *j = NULL;
    int rc, b;
    const char *s;
    snprintf(file, sizeof file, "%s/config.json", dir);
    if ((rc = ju_load_file(file, &j, err, errlen))) return rc;
    memset(c, 0, sizeof *c);
    c->bos_id = -1;
    const json_t *archs = json_object_get(j, "architectures");
    const char *a = json_is_array(archs) ? json_string_value(json_array_get(archs, 0)) : NULL;
    if (!a) {
        rc = specd_errf(err, errlen, SPECD_EFORMAT, "%s: missing \"architectures\"", file);
        goto out;
    }
    snprintf(c->arch_name, sizeof c->arch_name, "%s", a);
    static const struct { const char *name; model_arch arch; } known[] = {
        {"LlamaForCausalLM", MODEL_ARCH_LLAMA},     {"MistralForCausalLM", MODEL_ARCH_LLAMA},
        {"Qwen2ForCausalLM", MODEL_ARCH_QWEN2},     {"Qwen3ForCausalLM", MODEL_ARCH_QWEN3},
        {"Phi3ForCausalLM", MODEL_ARCH_PHI3},       {"MixtralForCausalLM", MODEL_ARCH_MIXTRAL},
        {"Qwen3MoeForCausalLM", MODEL_ARCH_QWEN3MOE}, {"Gemma3ForCausalLM", MODEL_ARCH_GEMMA3},
    };
    size_t ai = 0;
    while (ai < sizeof known / sizeof known[0] && strcmp(a, known[ai].name)) ai++;
    if (ai == sizeof known / sizeof known[0]) {
        rc = specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                        "%s: unknown architecture \"%s\" (supported: LlamaForCausalLM, MistralForCausalLM, "
                        "Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, MixtralForCausalLM, "
                        "Qwen3MoeForCausalLM, Gemma3ForCausalLM%s)", file, a,
                        strcmp(a, "Gemma3ForConditionalGeneration") ? "" :
                        "; this is the multimodal Gemma 3 checkpoint: its text model alone is not supported yet");
        goto out;
    }
    c->arch = known[ai].arch;
    if ((rc = hf_int(j, "num_hidden_layers", 1, 0, &c->n_layers, file, err, errlen)) ||
        (rc = hf_int(j, "hidden_size", 1, 0, &c->hidden, file, err, errlen)) ||
        (rc = hf_int(j, "num_attention_heads", 1, 0, &c->n_heads, file, err, errlen)) ||
        (rc = hf_int(j, "num_key_value_heads", 0, c->n_heads, &c->n_kv_heads, file, err, errlen)) ||
        (rc = hf_int(j, "intermediate_size", 1, 0, &c->ffn, file, err, errlen)) ||
        (rc = hf_int(j, "vocab_size", 1, 0, &c->vocab, file, err, errlen)))
        goto out;
    if (c->n_heads <= 0 || c->hidden % c->n_heads) {
        rc = specd_errf(err, errlen, SPECD_EFORMAT,
                        "%s: hidden_size %d is not a multiple of num_attention_heads %d", file,
                        c->hidden, c->n_heads);
        goto out;
    }
    if ((rc = hf_int(j, "head_dim", 0, c->hidden / c->n_heads, &c->head_dim, file, err, errlen)))
        goto out;
    double eps = 1e-6;
    int64_t mp = 0;
    if ((rc = ju_num(j, "rms_norm_eps", &eps, file, err, errlen)) < 0 ||
        (rc = ju_int(j, "max_position_embeddings", &mp, file, err, errlen)) < 0)
        goto out;
    c->rms_eps = (float)eps;
    c->max_pos = mp;
    if ((rc = hf_rope(j, c, file, err, errlen))) goto out;
    c->tied_embeddings = c->arch == MODEL_ARCH_GEMMA3;   /* HF's default per family */
    if ((rc = ju_bool(j, "tie_word_embeddings", &c->tied_embeddings, file, err, errlen)) < 0) goto out;
    c->qkv_bias = c->arch == MODEL_ARCH_QWEN2;
    c->qk_norm = c->arch == MODEL_ARCH_QWEN3 || c->arch == MODEL_ARCH_QWEN3MOE || c->arch == MODEL_ARCH_GEMMA3;
    if ((rc = hf_sliding_window(j, c, file, err, errlen))) goto out;
    if ((rc = hf_family(j, c, file, err, errlen))) goto out;
    /* Options of these architectures that add tensors or ops specd does not have. */
    b = 0;
    if ((rc = ju_bool(j, "attention_bias", &b, file, err, errlen)) < 0) goto out;
    if (b && c->arch != MODEL_ARCH_QWEN2) {
        rc = specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: attention_bias true is not supported", file);
        goto out;
    }
    b = 0;
    if ((rc = ju_bool(j, "mlp_bias", &b, file, err, errlen)) < 0) goto out;
    if (b) {
        rc = specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: mlp_bias true is not supported", file);
        goto out;
    }
    /* Gemma names the activation hidden_activation; the others hidden_act */
    const char *act_key = c->arch == MODEL_ARCH_GEMMA3 ? "hidden_activation" : "hidden_act";
    if ((rc = ju_str(j, act_key, &s, file, err, errlen)) < 0) goto out;
    if (rc == JU_ABSENT && c->arch == MODEL_ARCH_GEMMA3 &&
        (rc = ju_str(j, "hidden_act", &s, file, err, errlen)) < 0)
        goto out;
    c->act = c->arch == MODEL_ARCH_GEMMA3 ? ACT_GELU_TANH : ACT_SILU;
    if (rc == 0 && strcmp(s, c->act == ACT_SILU ? "silu" : "gelu_pytorch_tanh")) {
        rc = specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: %s \"%s\" is not supported (%s)", file, act_key, s,
                        c->act == ACT_SILU ? "silu" : "gelu_pytorch_tanh");
        goto out;
    }
    if ((rc = hf_quantization(j, c, file, err, errlen))) goto out;
    if ((rc = hf_special_tokens(j, c, file, err, errlen))) goto out;
    json_decref(j);
    j = NULL;

    /* generation_config.json is optional; when present its tokens win. */
    struct stat st;
    snprintf(file, sizeof file, "%s/generation_config.json", dir);
    if (stat(file, &st) == 0) {
        if ((rc = ju_load_file(file, &j, err, errlen)) ||
            (rc = hf_special_tokens(j, c, file, err, errlen)))
            goto out;
    }
    snprintf(file, sizeof file, "%s/config.json", dir);
    rc = check_config(c, file, err, errlen);
out:
    json_decref(j);
    return rc;
}

/* Open model.safetensors, or every shard named by model.safetensors.index.json. */
static int hf_open_weights(loader *L, const char *dir) {
    model_priv *p = L->p;
    char file[4200];
    struct stat st;
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    if (stat(file, &st) == 0) {
        p->shards[0] = st_open(file, L->err, L->errlen);
        if (!p->shards[0]) return SPECD_EFORMAT;
        p->n_shards = 1;
        return 0;
    }
    snprintf(p->index_path, sizeof p->index_path, "%s/model.safetensors.index.json", dir);
    if (stat(p->index_path, &st) != 0)
        return specd_errf(L->err, L->errlen, SPECD_ENOTFOUND,
                          "%s: no model.safetensors or model.safetensors.index.json", dir);
    json_t *idx;
    int rc = ju_load_file(p->index_path, &idx, L->err, L->errlen);
    if (rc) return rc;
    json_t *wm = json_object_get(idx, "weight_map");
    if (!json_is_object(wm)) {
        json_decref(idx);
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT, "%s: missing \"weight_map\" object",
                          p->index_path);
    }
    p->weight_map = json_incref(wm);
    json_decref(idx);
    const char *name;
    json_t *fn;
    json_object_foreach(p->weight_map, name, fn) {
        const char *f = json_string_value(fn);
        if (!f || !*f || strchr(f, '/') || !strcmp(f, "..") || !strcmp(f, "."))
            return specd_errf(L->err, L->errlen, SPECD_EFORMAT,
                              "%s: weight_map[%s] is not a file name in this directory",
                              p->index_path, name);
        int seen = 0;
        for (int i = 0; i < p->n_shards && !seen; i++) {
            const char *sp = st_path(p->shards[i]);
            seen = !strcmp(strrchr(sp, '/') + 1, f);
        }
        if (seen) continue;
        if (p->n_shards == MAX_SHARDS)
            return specd_errf(L->err, L->errlen, SPECD_EUNSUPPORTED, "%s: more than %d shards",
                              p->index_path, MAX_SHARDS);
        snprintf(file, sizeof file, "%s/%s", dir, f);
        p->shards[p->n_shards] = st_open(file, L->err, L->errlen);
        if (!p->shards[p->n_shards]) return SPECD_EFORMAT;
        p->n_shards++;
    }
    if (!p->n_shards)
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT, "%s: empty weight_map", p->index_path);
    return 0;
}

static int load_hf(loader *L, const char *dir) {
    int rc = hf_config(dir, &L->m->cfg, L->err, L->errlen);
    if (rc) return rc;
    if ((rc = hf_open_weights(L, dir))) return rc;
    tensor_names nm = hf_names;
    if (L->m->cfg.arch == MODEL_ARCH_GEMMA3) {   /* four norms per layer */
        nm.ffn_norm = "model.layers.%d.pre_feedforward_layernorm.weight";
        nm.post_attn_norm = "model.layers.%d.post_attention_layernorm.weight";
    }
    if (L->m->cfg.arch == MODEL_ARCH_MIXTRAL) {  /* w1 gate, w3 up, w2 down */
        nm.router = "model.layers.%d.block_sparse_moe.gate.weight";
        nm.exp_gate = "model.layers.%d.block_sparse_moe.experts.%d.w1.weight";
        nm.exp_up = "model.layers.%d.block_sparse_moe.experts.%d.w3.weight";
        nm.exp_down = "model.layers.%d.block_sparse_moe.experts.%d.w2.weight";
    }
    return load_tensors(L, &nm);
}

/* ---- GGUF ----------------------------------------------------------------------------- */

static int gguf_int(gguf *g, const char *arch, const char *suffix, int required, int64_t dflt,
                    int *out, const char *file, char *err, size_t errlen) {
    char key[160];
    int64_t v = dflt;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = gguf_get_i64(g, key, &v);
    if (rc == SPECD_ENOTFOUND && !required) rc = 0;
    if (rc == SPECD_ENOTFOUND)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: missing metadata %s", file, key);
    if (rc)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: metadata %s must be an integer", file, key);
    if (v < INT32_MIN || v > INT32_MAX)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: metadata %s out of range", file, key);
    *out = (int)v;
    return 0;
}

static int gguf_num(gguf *g, const char *arch, const char *suffix, double *out, const char *file,
                    char *err, size_t errlen) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = gguf_get_f64(g, key, out);
    if (rc == SPECD_ENOTFOUND) return 0;
    if (rc) return specd_errf(err, errlen, SPECD_EFORMAT, "%s: metadata %s must be a number", file, key);
    return 0;
}

/* llama.cpp stores llama3 rope scaling as a rope_freqs.weight tensor of per-frequency
 * divisors instead of metadata. Recover the parameters (factor = the largest divisor;
 * Llama 3's low 1 / high 4 / original 8192 unless metadata says otherwise) and accept
 * them only if they reproduce every stored divisor. */
static int gguf_rope_freqs(loader *L, const char *arch, model_config *c) {
    const char *file = L->m->path;
    const gguf_tensor *t = gguf_find_tensor(L->p->g, "rope_freqs.weight");
    int half = c->head_dim / 2;
    if (!t) return 0;
    if (t->type != GGML_F32 || t->ne[0] != half || t->ne[1] != 1 || t->ne[2] != 1 || t->ne[3] != 1)
        return specd_errf(L->err, L->errlen, SPECD_EFORMAT,
                          "%s: rope_freqs.weight must be F32 [%d]", file, half);
    const float *f = t->data;
    double factor = 0, orig = 8192;
    for (int i = 0; i < half; i++) factor = f[i] > factor ? f[i] : factor;
    int rc;
    if ((rc = gguf_num(L->p->g, arch, "rope.scaling.factor", &factor, file, L->err, L->errlen)) ||
        (rc = gguf_num(L->p->g, arch, "rope.scaling.original_context_length", &orig, file, L->err,
                       L->errlen)))
        return rc;
    c->rope_type = ROPE_LLAMA3;
    c->rope_factor = (float)factor;
    c->rope_low_freq_factor = 1.0f;
    c->rope_high_freq_factor = 4.0f;
    c->rope_orig_max_pos = (int)orig;
    for (int i = 0; i < half; i++) {
        double freq = 1.0 / pow(c->rope_theta, 2.0 * i / c->head_dim);
        double wavelen = 2 * M_PI / freq, want;
        if (wavelen < orig / 4.0) want = 1.0;
        else if (wavelen > orig / 1.0) want = factor;
        else {
            double s = (orig / wavelen - 1.0) / (4.0 - 1.0);
            want = 1.0 / ((1 - s) / factor + s);
        }
        if (fabs(f[i] - want) > 1e-3 * want)
            return specd_errf(L->err, L->errlen, SPECD_EUNSUPPORTED,
                              "%s: rope_freqs.weight[%d] = %g is not llama3 scaling (expected %g)",
                              file, i, f[i], want);
    }
    return 0;
}

/* What each family adds in GGUF metadata: window, rope scaling, experts, Gemma 3. */
static int gguf_family(loader *L, const char *arch, model_config *c) {
    gguf *g = L->p->g;
    const char *file = L->m->path, *s;
    char *err = L->err, key[160];
    size_t errlen = L->errlen, len;
    int rc, win = 0;
    /* <arch>.attention.sliding_window: every layer (Mistral, Phi-3), Gemma 3's pattern */
    if ((rc = gguf_int(g, arch, "attention.sliding_window", 0, 0, &win, file, err, errlen))) return rc;
    if (win > 0 && qwen_window_rules(c->arch))
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: %s.attention.sliding_window is not supported",
                          file, arch);
    c->sliding_window = win > 0 ? win : 0;
    if (c->n_layers > MODEL_MAX_LAYERS)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: %d layers (at most %d)", file, c->n_layers,
                          MODEL_MAX_LAYERS);
    if (c->sliding_window && c->arch != MODEL_ARCH_GEMMA3) memset(c->layer_swa, 1, sizeof c->layer_swa);
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    if (gguf_get_str(g, key, &s, &len) == 0 && !(len == 4 && !memcmp(s, "none", 4))) {
        double f = 0;
        if (!(len == 6 && !memcmp(s, "linear", 6)))
            return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: rope scaling \"%.*s\" is not supported (linear)",
                              file, (int)(len < 32 ? len : 32), s);
        if ((rc = gguf_num(g, arch, "rope.scaling.factor", &f, file, err, errlen))) return rc;
        if (!(f > 0)) return specd_errf(err, errlen, SPECD_EFORMAT, "%s: linear rope scaling needs a factor", file);
        c->rope_type = ROPE_LINEAR;
        c->rope_factor = (float)f;
    }
    int ne = 0;
    if ((rc = gguf_int(g, arch, "expert_count", 0, 0, &ne, file, err, errlen))) return rc;
    if (ne > 0) {
        if (c->arch == MODEL_ARCH_LLAMA) {           /* Mixtral is llama with experts */
            c->arch = MODEL_ARCH_MIXTRAL;
            c->moe_ffn = c->ffn;
            c->moe_norm_topk = 1;
        } else if (c->arch == MODEL_ARCH_QWEN3MOE) {
            int norm = 1;   /* the released Qwen3-MoE models all renormalise (norm_topk_prob) */
            if ((rc = gguf_int(g, arch, "expert_feed_forward_length", 1, 0, &c->moe_ffn, file, err, errlen)))
                return rc;
            snprintf(key, sizeof key, "%s.expert_weights_norm", arch);
            if (gguf_get_bool(g, key, &norm) < 0 && gguf_find_key(g, key) >= 0)
                return specd_errf(err, errlen, SPECD_EFORMAT, "%s: %s must be a bool", file, key);
            c->moe_norm_topk = norm;
        } else {
            return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: %s.expert_count on %s is not supported", file,
                              arch, arch);
        }
        c->n_experts = ne;
        if ((rc = gguf_int(g, arch, "expert_used_count", 1, 0, &c->n_experts_used, file, err, errlen))) return rc;
        if (ne > MODEL_MAX_EXPERTS || c->n_experts_used < 1 || c->n_experts_used > ne)
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: %d experts, %d used per token: out of range", file,
                              ne, c->n_experts_used);
    } else if (c->arch == MODEL_ARCH_QWEN3MOE) {
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: missing metadata %s.expert_count", file, arch);
    }
    if (c->arch == MODEL_ARCH_GEMMA3) {
        /* llama.cpp's converter stores Gemma's norms as 1 + w, so no offset here; the
         * sliding layers' rotary base is not in the metadata (10k, as Gemma 3 defines it),
         * nor is query_pre_attn_scalar: head_dim for every size but the 27B's, whose
         * scalar is hidden / heads (168 with head_dim 128). */
        int pat = 6;
        c->sandwich_norms = 1;
        c->act = ACT_GELU_TANH;
        c->embed_scale = sqrtf((float)c->hidden);
        c->rope_local_theta = 10000.0f;
        c->attn_scale = 1.0f / sqrtf((float)(c->n_layers == 62 ? c->hidden / c->n_heads : c->head_dim));
        if ((rc = gguf_int(g, arch, "attention.sliding_window_pattern", 0, 6, &pat, file, err, errlen))) return rc;
        if (pat < 1) return specd_errf(err, errlen, SPECD_EFORMAT, "%s: sliding_window_pattern must be >= 1", file);
        for (int l = 0; l < c->n_layers; l++) c->layer_swa[l] = (l + 1) % pat != 0;
    }
    if (c->ffn == 0 && c->n_experts) c->ffn = c->moe_ffn;   /* informational for MoE */
    if (c->ffn == 0)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: missing metadata %s.feed_forward_length", file, arch);
    return 0;
}

static int gguf_config(loader *L) {
    gguf *g = L->p->g;
    model_config *c = &L->m->cfg;
    const char *file = L->m->path, *s;
    char *err = L->err, arch[32];
    size_t errlen = L->errlen, len;
    int rc;
    memset(c, 0, sizeof *c);
    c->bos_id = -1;
    if (gguf_get_str(g, "general.architecture", &s, &len))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: missing general.architecture", file);
    snprintf(arch, sizeof arch, "%.*s", (int)(len < 31 ? len : 31), s);
    snprintf(c->arch_name, sizeof c->arch_name, "%s", arch);
    static const struct { const char *name; model_arch arch; } known[] = {
        {"llama", MODEL_ARCH_LLAMA}, {"qwen2", MODEL_ARCH_QWEN2}, {"qwen3", MODEL_ARCH_QWEN3},
        {"phi3", MODEL_ARCH_PHI3}, {"qwen3moe", MODEL_ARCH_QWEN3MOE}, {"gemma3", MODEL_ARCH_GEMMA3},
    };
    size_t ai = 0;
    while (ai < sizeof known / sizeof known[0] && (strlen(known[ai].name) != len || memcmp(s, known[ai].name, len)))
        ai++;
    if (ai == sizeof known / sizeof known[0])
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "%s: unknown architecture \"%.*s\" (supported: llama (and Mixtral), qwen2, qwen3, "
                          "phi3, qwen3moe, gemma3)", file, (int)(len < 64 ? len : 64), s);
    c->arch = known[ai].arch;
    if ((rc = gguf_int(g, arch, "block_count", 1, 0, &c->n_layers, file, err, errlen)) ||
        (rc = gguf_int(g, arch, "embedding_length", 1, 0, &c->hidden, file, err, errlen)) ||
        (rc = gguf_int(g, arch, "attention.head_count", 1, 0, &c->n_heads, file, err, errlen)) ||
        (rc = gguf_int(g, arch, "attention.head_count_kv", 0, c->n_heads, &c->n_kv_heads, file, err,
                       errlen)) ||
        (rc = gguf_int(g, arch, "feed_forward_length", 0, 0, &c->ffn, file, err, errlen)))
        return rc;
    if (c->n_heads <= 0)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: %s.attention.head_count must be positive",
                          file, arch);
    if ((rc = gguf_int(g, arch, "attention.key_length", 0, c->hidden / c->n_heads, &c->head_dim,
                       file, err, errlen)))
        return rc;
    double eps = 1e-5, theta = 10000.0;
    int mp = 0;
    if ((rc = gguf_num(g, arch, "attention.layer_norm_rms_epsilon", &eps, file, err, errlen)) ||
        (rc = gguf_num(g, arch, "rope.freq_base", &theta, file, err, errlen)) ||
        (rc = gguf_int(g, arch, "context_length", 0, 0, &mp, file, err, errlen)))
        return rc;
    c->rms_eps = (float)eps;
    c->rope_theta = (float)theta;
    c->max_pos = mp;
    if ((rc = gguf_family(L, arch, c))) return rc;
    if ((rc = gguf_rope_freqs(L, arch, c))) return rc;

    const gguf_tensor *te = gguf_find_tensor(g, "token_embd.weight");
    if (!te) return specd_errf(err, errlen, SPECD_ENOTFOUND, "%s: missing tensor token_embd.weight", file);
    if (te->ne[1] <= 0 || te->ne[1] > INT32_MAX)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: token_embd.weight has a bad shape", file);
    c->vocab = (int)te->ne[1];
    /* Metadata that must agree with what we derive, when a converter wrote it. */
    int vs = c->vocab, rot = c->head_dim;
    if ((rc = gguf_int(g, arch, "vocab_size", 0, c->vocab, &vs, file, err, errlen)) ||
        (rc = gguf_int(g, arch, "rope.dimension_count", 0, c->head_dim, &rot, file, err, errlen)))
        return rc;
    if (vs != c->vocab)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: %s.vocab_size %d disagrees with token_embd.weight rows %d", file,
                          arch, vs, c->vocab);
    if (rot != c->head_dim)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "%s: partial rotary (%s.rope.dimension_count %d < head_dim %d) is not "
                          "supported", file, arch, rot, c->head_dim);
    c->tied_embeddings = gguf_find_tensor(g, "output.weight") == NULL;
    c->qkv_bias = gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL;
    c->qk_norm = c->arch == MODEL_ARCH_QWEN3 || c->arch == MODEL_ARCH_QWEN3MOE || c->arch == MODEL_ARCH_GEMMA3;
    if (c->arch == MODEL_ARCH_PHI3 && gguf_find_tensor(g, "rope_factors_long.weight"))
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s: Phi-3 longrope scaling (rope_factors_long.weight) "
                          "is not supported", file);

    uint64_t id;
    if (gguf_get_u64(g, "tokenizer.ggml.bos_token_id", &id) == 0) c->bos_id = (int)id;
    if (gguf_get_u64(g, "tokenizer.ggml.eos_token_id", &id) == 0) c->eos_ids[c->n_eos++] = (int)id;
    /* End-of-turn ends generation too (chat models stop on it, not on eos). */
    if (gguf_get_u64(g, "tokenizer.ggml.eot_token_id", &id) == 0 &&
        !(c->n_eos && c->eos_ids[0] == (int)id))
        c->eos_ids[c->n_eos++] = (int)id;
    return check_config(c, file, err, errlen);
}

static int load_gguf(loader *L, const char *path) {
    L->p->g = gguf_open(path, L->err, L->errlen);
    if (!L->p->g) return SPECD_EFORMAT;
    L->m->is_gguf = 1;
    int rc = gguf_config(L);
    if (rc) return rc;
    return load_tensors(L, &gguf_names);
}

/* ---- load / free ---------------------------------------------------------------------- */

model *model_load(const char *path, char *err, size_t errlen) {
    struct stat st;
    model *m = calloc(1, sizeof *m);
    model_priv *p = calloc(1, sizeof *p);
    if (!m || !p) {
        free(m);
        free(p);
        specd_errf(err, errlen, SPECD_ENOMEM, "%s: out of memory", path);
        return NULL;
    }
    m->priv = p;
    snprintf(m->path, sizeof m->path, "%s", path);
    loader L = { m, p, err, errlen };
    if (stat(path, &st) != 0) {
        specd_errf(err, errlen, SPECD_ENOTFOUND, "%s: no such file or directory", path);
        goto fail;
    }
    if (S_ISDIR(st.st_mode) ? load_hf(&L, path) : load_gguf(&L, path)) goto fail;
    return m;
fail:
    model_free(m);
    return NULL;
}

void model_free(model *m) {
    if (!m) return;
    model_priv *p = m->priv;
    if (p) {
        gguf_close(p->g);
        for (int i = 0; i < p->n_shards; i++) st_close(p->shards[i]);
        json_decref(p->weight_map);
        free(p->arena);
        free(p);
    }
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++) free(m->layers[l].exp_gate);
    free(m->layers);
    free(m);
}

/* ---- view conversion ------------------------------------------------------------------ */

int64_t tensor_numel(const tensor_view *t) {
    return t->ndim == 2 ? t->shape[0] * t->shape[1] : t->shape[0];
}

static ggml_type view_ggml_type(tensor_dtype d) {
    static const ggml_type map[] = {
        [TDT_F32] = GGML_F32, [TDT_F16] = GGML_F16, [TDT_BF16] = GGML_BF16,
        [TDT_Q8_0] = GGML_Q8_0, [TDT_Q4_0] = GGML_Q4_0, [TDT_Q4_1] = GGML_Q4_1,
        [TDT_Q4_K] = GGML_Q4_K, [TDT_Q6_K] = GGML_Q6_K, [TDT_Q5_0] = GGML_Q5_0,
        [TDT_Q5_1] = GGML_Q5_1, [TDT_Q5_K] = GGML_Q5_K,
    };
    return map[d];
}

static size_t view_row_bytes(const tensor_view *t) {
    const int64_t cols = t->ndim == 2 ? t->shape[1] : t->shape[0];
    return t->dtype == TDT_F8_E4M3 ? (size_t)cols : ggml_row_size(view_ggml_type(t->dtype), cols);
}

/* Stored row of logical row r. llama.cpp's converter reshapes each head's rows as
 * (2, head_dim/2) and swaps the axes, so logical row j*half + i of a head (j: which rotary
 * half, i: pair index) is stored at 2*i + j. */
static int64_t stored_row(int64_t r, int64_t head_dim) {
    int64_t h = r / head_dim, k = r % head_dim, half = head_dim / 2;
    return h * head_dim + 2 * (k % half) + k / half;
}

/* Shared walk for both converters: calls emit(row, dst_row) with each logical row
 * dequantized into tmp as fp32. */
typedef struct {
    int64_t rows, cols, head_dim;
    size_t row_bytes;
    ggml_type gt;
} view_geom;

static int view_geometry(const tensor_view *t, view_geom *v) {
    if (!t || !t->data || (t->ndim != 1 && t->ndim != 2) || (unsigned)t->dtype > TDT_F8_E4M3)
        return SPECD_EINVAL;
    v->rows = t->ndim == 2 ? t->shape[0] : 1;
    v->cols = t->ndim == 2 ? t->shape[1] : t->shape[0];
    if (v->rows < 0 || v->cols < 0) return SPECD_EINVAL;
    if (t->dtype == TDT_F8_E4M3 &&
        (t->ndim != 2 || !t->scale || t->scale_block[0] < 1 || t->scale_block[1] < 1 || t->scale_cols < 1 ||
         t->scale_row0 < 0 || (t->scale_dtype != TDT_F32 && t->scale_dtype != TDT_BF16)))
        return SPECD_EINVAL;
    v->gt = t->dtype == TDT_F8_E4M3 ? GGML_F32 : view_ggml_type(t->dtype);   /* gt unused for FP8 */
    v->row_bytes = view_row_bytes(t);
    if (!v->row_bytes && v->cols) return SPECD_EINVAL;
    v->head_dim = 0;
    if (t->unpermute_heads > 0) {
        if (t->ndim != 2 || v->rows % t->unpermute_heads) return SPECD_EINVAL;
        v->head_dim = v->rows / t->unpermute_heads;
        if (v->head_dim % 2) return SPECD_EINVAL;
    }
    return 0;
}

static const uint8_t *row_src(const tensor_view *t, const view_geom *v, int64_t r) {
    int64_t s = v->head_dim ? stored_row(r, v->head_dim) : r;
    return (const uint8_t *)t->data + (size_t)s * v->row_bytes;
}

/* Scale i of an FP8 view (safetensors does not align tensors: read bytes, not typed loads). */
static float scale_at(const tensor_view *t, int64_t i) {
    float f;
    if (t->scale_dtype == TDT_F32) {
        memcpy(&f, (const uint8_t *)t->scale + (size_t)i * 4, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, (const uint8_t *)t->scale + (size_t)i * 2, 2);
    uint32_t b = (uint32_t)h << 16;
    memcpy(&f, &b, 4);
    return f;
}

/* Logical row r of an FP8 view as fp32: bytes times their blocks' scales. */
static void fp8_row(const tensor_view *t, const view_geom *v, int64_t r, float *dst) {
    const uint8_t *src = row_src(t, v, r);
    const int64_t srow = (r + t->scale_row0) / t->scale_block[0] * t->scale_cols, bc = t->scale_block[1];
    for (int64_t c0 = 0; c0 < v->cols; c0 += bc) {
        const float s = scale_at(t, srow + c0 / bc);
        const int64_t end = c0 + bc < v->cols ? c0 + bc : v->cols;
        for (int64_t c = c0; c < end; c++) dst[c] = fp8_e4m3_to_f32(src[c]) * s;
    }
}

int tensor_to_f32(const tensor_view *t, float *dst) {
    view_geom v;
    int rc = view_geometry(t, &v);
    if (rc) return rc;
    for (int64_t r = 0; r < v.rows; r++) {
        if (t->dtype == TDT_F8_E4M3) fp8_row(t, &v, r, dst + r * v.cols);
        else if ((rc = ggml_dequantize(v.gt, row_src(t, &v, r), dst + r * v.cols, v.cols))) return rc;
    }
    return 0;
}

int tensor_fp8_row_scales(const tensor_view *t, float *scale) {
    view_geom v;
    if (!t || t->dtype != TDT_F8_E4M3 || view_geometry(t, &v) || t->scale_block[1] < v.cols || t->scale_cols != 1 ||
        (t->scale_block[0] != 1 && t->scale_row0 + v.rows > t->scale_block[0]))
        return SPECD_EINVAL;
    for (int64_t r = 0; r < v.rows; r++) scale[r] = scale_at(t, (r + t->scale_row0) / t->scale_block[0]);
    return 0;
}

int tensor_ggml_type(const tensor_view *t) {
    return t && (unsigned)t->dtype <= TDT_Q5_K ? (int)view_ggml_type(t->dtype) : -1;
}

int tensor_rows_raw(const tensor_view *t, int64_t row0, int64_t nrows, void *dst, size_t *row_bytes) {
    view_geom v;
    int rc = view_geometry(t, &v);
    if (rc) return rc;
    if (t->ndim != 2 || row0 < 0 || nrows < 0 || row0 + nrows > v.rows) return SPECD_EINVAL;
    for (int64_t r = 0; r < nrows; r++)
        memcpy((uint8_t *)dst + (size_t)r * v.row_bytes, row_src(t, &v, row0 + r), v.row_bytes);
    if (row_bytes) *row_bytes = v.row_bytes;
    return 0;
}

static uint16_t f32_to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40); /* quiet NaN */
    b += 0x7fffu + ((b >> 16) & 1);                                            /* nearest even */
    return (uint16_t)(b >> 16);
}

int tensor_to_bf16(const tensor_view *t, uint16_t *dst) {
    view_geom v;
    int rc = view_geometry(t, &v);
    if (rc) return rc;
    float *tmp = NULL;
    if (v.gt != GGML_BF16 && !(tmp = malloc((size_t)(v.cols ? v.cols : 1) * sizeof *tmp)))
        return SPECD_ENOMEM;
    for (int64_t r = 0; r < v.rows && !rc; r++) {
        uint16_t *d = dst + r * v.cols;
        if (v.gt == GGML_BF16) {   /* exact: copy the bits */
            memcpy(d, row_src(t, &v, r), (size_t)v.cols * 2);
            continue;
        }
        if (t->dtype == TDT_F8_E4M3) fp8_row(t, &v, r, tmp);
        else if ((rc = ggml_dequantize(v.gt, row_src(t, &v, r), tmp, v.cols))) break;
        for (int64_t i = 0; i < v.cols; i++) d[i] = f32_to_bf16(tmp[i]);
    }
    free(tmp);
    return rc;
}

/* ---- random models -------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Fill with mean + uniform noise of standard deviation `std` (uniform on [-a, a] has
 * std a/sqrt(3)); uniform rather than normal because an 8B model has 8e9 of these. */
static void fill(float *x, int64_t n, uint64_t seed, float mean, float std) {
    uint64_t s = seed;
    float a = std * 1.7320508f;
    for (int64_t i = 0; i < n; i++) {
        double u = (double)(splitmix64(&s) >> 11) * (1.0 / 9007199254740992.0);
        x[i] = mean + a * (float)(2.0 * u - 1.0);
    }
}

typedef struct {
    model *m;
    float *next;
    uint64_t seed, count;
} rand_ctx;

/* Carve the next tensor from the arena (or only count it when arena is NULL) and fill it
 * from its own stream, so one tensor's values do not depend on the others' sizes. */
static void rand_view(rand_ctx *r, tensor_view *t, int ndim, int64_t d0, int64_t d1, float mean,
                      float std) {
    int64_t n = ndim == 2 ? d0 * d1 : d0;
    r->count++;
    if (r->next) {
        fill(r->next, n, r->seed ^ (r->count * 0xd1b54a32d192ed03ull), mean, std);
        t->data = r->next;
        t->dtype = TDT_F32;
        t->ndim = ndim;
        t->shape[0] = d0;
        t->shape[1] = ndim == 2 ? d1 : 0;
        t->unpermute_heads = 0;
        r->next += n;
    }
}

/* Visit every tensor of the config in a fixed order. With r->next == NULL this only
 * counts; returns the number of floats needed. */
static uint64_t rand_all(rand_ctx *r, const model_config *c) {
    model *m = r->m;
    int64_t H = c->hidden, Q = (int64_t)c->n_heads * c->head_dim;
    int64_t KV = (int64_t)c->n_kv_heads * c->head_dim, F = c->ffn, V = c->vocab;
    const float w = 0.02f;
    uint64_t total = (uint64_t)(V * H + H) + (c->tied_embeddings ? 0 : (uint64_t)(V * H));
    tensor_view dummy;
    model_layer dl;
    rand_view(r, r->next ? &m->tok_embd : &dummy, 2, V, H, 0, w);
    rand_view(r, r->next ? &m->out_norm : &dummy, 1, H, 0, 1.0f, w);
    if (!c->tied_embeddings) rand_view(r, r->next ? &m->lm_head : &dummy, 2, V, H, 0, w);
    else if (r->next) m->lm_head = m->tok_embd;
    for (int i = 0; i < c->n_layers; i++) {
        model_layer *ly = r->next ? &m->layers[i] : &dl;
        rand_view(r, &ly->attn_norm, 1, H, 0, 1.0f, w);
        rand_view(r, &ly->wq, 2, Q, H, 0, w);
        rand_view(r, &ly->wk, 2, KV, H, 0, w);
        rand_view(r, &ly->wv, 2, KV, H, 0, w);
        rand_view(r, &ly->wo, 2, H, Q, 0, w);
        rand_view(r, &ly->ffn_norm, 1, H, 0, 1.0f, w);
        rand_view(r, &ly->w_gate, 2, F, H, 0, w);
        rand_view(r, &ly->w_up, 2, F, H, 0, w);
        rand_view(r, &ly->w_down, 2, H, F, 0, w);
        total += (uint64_t)(2 * H + Q * H * 2 + KV * H * 2 + 3 * F * H);
        if (c->qkv_bias) {
            rand_view(r, &ly->bq, 1, Q, 0, 0, w);
            rand_view(r, &ly->bk, 1, KV, 0, 0, w);
            rand_view(r, &ly->bv, 1, KV, 0, 0, w);
            total += (uint64_t)(Q + 2 * KV);
        }
        if (c->qk_norm) {
            rand_view(r, &ly->q_norm, 1, c->head_dim, 0, 1.0f, w);
            rand_view(r, &ly->k_norm, 1, c->head_dim, 0, 1.0f, w);
            total += (uint64_t)(2 * c->head_dim);
        }
    }
    return total;
}

/* An empty model of cfg's shape (views all empty, layers allocated), path
 * "<prefix>:<arch>"; NULL when out of memory. */
static model *model_blank(const model_config *cfg, const char *prefix) {
    model *m = calloc(1, sizeof *m);
    model_priv *p = calloc(1, sizeof *p);
    if (m) m->layers = calloc((size_t)cfg->n_layers, sizeof *m->layers);
    if (!m || !p || !m->layers) {
        if (m) free(m->layers);
        free(m);
        free(p);
        return NULL;
    }
    m->priv = p;
    m->cfg = *cfg;
    snprintf(m->path, sizeof m->path, "%s:%s", prefix, cfg->arch_name);
    return m;
}

model *model_shape(const model_config *cfg, char *err, size_t errlen) {
    if (!cfg) {
        specd_errf(err, errlen, SPECD_EINVAL, "model_shape: no config");
        return NULL;
    }
    if (check_config(cfg, "model shape", err, errlen)) return NULL;
    model *m = model_blank(cfg, "shape");
    if (!m) specd_errf(err, errlen, SPECD_ENOMEM, "model_shape: out of memory");
    return m;
}

model *model_random(const model_config *cfg, uint64_t seed, char *err, size_t errlen) {
    if (!cfg) {
        specd_errf(err, errlen, SPECD_EINVAL, "model_random: no config");
        return NULL;
    }
    if (check_config(cfg, "random model config", err, errlen)) return NULL;
    if (cfg->n_experts || cfg->sandwich_norms) {
        specd_errf(err, errlen, SPECD_EUNSUPPORTED, "model_random: %s (experts, sandwich norms) has no random form yet",
                   cfg->arch_name);
        return NULL;
    }
    /* check_config bounds every dimension by 2^24, so the count cannot overflow 64 bits. */
    rand_ctx r = { NULL, NULL, seed, 0 };
    uint64_t n = rand_all(&r, cfg);
    model *m = n > SIZE_MAX / sizeof(float) ? NULL : model_blank(cfg, "random");
    model_priv *p = m ? m->priv : NULL;
    if (!p || !(p->arena = malloc((size_t)n * sizeof(float)))) {
        specd_errf(err, errlen, SPECD_ENOMEM, "model_random: out of memory for %s", cfg->arch_name);
        model_free(m);
        return NULL;
    }
    r.m = m;
    r.next = p->arena;
    r.count = 0;
    rand_all(&r, cfg);
    return m;
}

size_t model_kv_bytes_per_token(const model_config *c, size_t elem_size) {
    return 2 * (size_t)c->n_layers * (size_t)c->n_kv_heads * (size_t)c->head_dim * elem_size;
}

/* ---- named shapes --------------------------------------------------------------------- */

int model_shape_preset(const char *name, model_config *c) {
    memset(c, 0, sizeof *c);
    c->rope_type = ROPE_DEFAULT;
    c->bos_id = -1;
    if (!strcmp(name, "llama-3.1-8b") || !strcmp(name, "llama-3.2-1b")) {
        int big = name[8] == '1';
        c->arch = MODEL_ARCH_LLAMA;
        snprintf(c->arch_name, sizeof c->arch_name, "LlamaForCausalLM");
        c->n_layers = big ? 32 : 16;
        c->hidden = big ? 4096 : 2048;
        c->n_heads = 32;
        c->n_kv_heads = 8;
        c->head_dim = big ? 128 : 64;
        c->ffn = big ? 14336 : 8192;
        c->vocab = 128256;
        c->rms_eps = 1e-5f;
        c->rope_theta = 500000.0f;
        c->rope_type = ROPE_LLAMA3;
        c->rope_factor = big ? 8.0f : 32.0f;
        c->rope_low_freq_factor = 1.0f;
        c->rope_high_freq_factor = 4.0f;
        c->rope_orig_max_pos = 8192;
        c->tied_embeddings = !big;
        c->max_pos = 131072;
        c->bos_id = 128000;
        c->eos_ids[0] = 128001; c->eos_ids[1] = 128008; c->eos_ids[2] = 128009;
        c->n_eos = 3;
        return 0;
    }
    if (!strcmp(name, "smollm2-135m")) {   /* SmolLM2-135M(-Instruct): the default model's shape */
        *c = (model_config){
            .arch = MODEL_ARCH_LLAMA, .arch_name = "LlamaForCausalLM", .n_layers = 30, .hidden = 576,
            .n_heads = 9, .n_kv_heads = 3, .head_dim = 64, .ffn = 1536, .vocab = 49152, .rms_eps = 1e-5f,
            .rope_theta = 100000.0f, .rope_type = ROPE_DEFAULT, .tied_embeddings = 1, .max_pos = 8192,
            .bos_id = 1, .eos_ids = {2}, .n_eos = 1,
        };
        return 0;
    }
    if (!strcmp(name, "qwen2.5-1.5b") || !strcmp(name, "qwen3-1.7b")) {
        int q3 = name[4] == '3';
        c->arch = q3 ? MODEL_ARCH_QWEN3 : MODEL_ARCH_QWEN2;
        snprintf(c->arch_name, sizeof c->arch_name, q3 ? "Qwen3ForCausalLM" : "Qwen2ForCausalLM");
        c->n_layers = 28;
        c->hidden = q3 ? 2048 : 1536;
        c->n_heads = q3 ? 16 : 12;
        c->n_kv_heads = q3 ? 8 : 2;
        c->head_dim = 128;
        c->ffn = q3 ? 6144 : 8960;
        c->vocab = 151936;
        c->rms_eps = 1e-6f;
        c->rope_theta = 1000000.0f;
        c->tied_embeddings = 1;
        c->qkv_bias = !q3;
        c->qk_norm = q3;
        c->max_pos = q3 ? 40960 : 32768;
        c->bos_id = 151643;
        c->eos_ids[0] = 151645; c->eos_ids[1] = 151643;
        c->n_eos = 2;
        return 0;
    }
    if (!strcmp(name, "gemma3-4b")) {   /* Gemma 3 4B's text model: 5 window layers per full one */
        *c = (model_config){
            .arch = MODEL_ARCH_GEMMA3, .arch_name = "Gemma3ForCausalLM", .n_layers = 34, .hidden = 2560,
            .n_heads = 8, .n_kv_heads = 4, .head_dim = 256, .ffn = 10240, .vocab = 262208, .rms_eps = 1e-6f,
            .act = ACT_GELU_TANH, .norm_plus_one = 1, .sandwich_norms = 1, .qk_norm = 1,
            .embed_scale = sqrtf(2560.0f), .attn_scale = 1.0f / 16.0f,   /* query_pre_attn_scalar 256 */
            .rope_theta = 1e6f, .rope_type = ROPE_LINEAR, .rope_factor = 8.0f, .rope_local_theta = 1e4f,
            .sliding_window = 1024, .tied_embeddings = 1, .max_pos = 131072,
            .bos_id = 2, .eos_ids = {1, 106}, .n_eos = 2,
        };
        for (int l = 0; l < c->n_layers; l++) c->layer_swa[l] = (l + 1) % 6 != 0;
        return 0;
    }
    if (!strcmp(name, "qwen3-30b-a3b")) {   /* Qwen3-30B-A3B: 128 experts, 8 per token */
        c->arch = MODEL_ARCH_QWEN3MOE;
        snprintf(c->arch_name, sizeof c->arch_name, "Qwen3MoeForCausalLM");
        c->n_layers = 48;
        c->hidden = 2048;
        c->n_heads = 32;
        c->n_kv_heads = 4;
        c->head_dim = 128;
        c->ffn = 6144;
        c->moe_ffn = 768;
        c->n_experts = 128;
        c->n_experts_used = 8;
        c->moe_norm_topk = 1;
        c->vocab = 151936;
        c->rms_eps = 1e-6f;
        c->rope_theta = 1000000.0f;
        c->qk_norm = 1;
        c->max_pos = 40960;
        c->bos_id = 151643;
        c->eos_ids[0] = 151645; c->eos_ids[1] = 151643;
        c->n_eos = 2;
        return 0;
    }
    return SPECD_ENOTFOUND;
}

/* ---- rotary frequencies (shared by every runner) ---- */

void model_rope_inv_freq(const model_config *c, int round_to_bf16, float *inv) {
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++)
        inv[i] = 1.0f / powf(c->rope_theta, (float)(2 * i) / (float)c->head_dim);
    if (c->rope_type == ROPE_LLAMA3) {
        float factor = c->rope_factor, lo = c->rope_low_freq_factor, hi = c->rope_high_freq_factor;
        float old_ctx = (float)c->rope_orig_max_pos;
        float low_wl = old_ctx / lo, high_wl = old_ctx / hi;
        for (int i = 0; i < half; i++) {
            float wl = 2.0f * (float)M_PI / inv[i];
            float f = wl > low_wl ? inv[i] / factor : inv[i];
            if (!(wl < high_wl) && !(wl > low_wl)) {
                float smooth = (old_ctx / wl - lo) / (hi - lo);
                f = (1.0f - smooth) * f / factor + smooth * f;
            }
            inv[i] = f;
        }
    }
    if (c->rope_type == ROPE_LINEAR)
        for (int i = 0; i < half; i++) inv[i] /= c->rope_factor;
    if (round_to_bf16)
        for (int i = 0; i < half; i++) {
            uint32_t u;
            memcpy(&u, &inv[i], 4);
            u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
            memcpy(&inv[i], &u, 4);
        }
}

void model_rope_inv_freq_layer(const model_config *c, int layer, int round_to_bf16, float *inv) {
    if (!(c->rope_local_theta > 0) || !model_layer_window(c, layer)) {
        model_rope_inv_freq(c, round_to_bf16, inv);
        return;
    }
    model_config local = *c;
    local.rope_theta = c->rope_local_theta;
    local.rope_type = ROPE_DEFAULT;
    model_rope_inv_freq(&local, round_to_bf16, inv);
}
