/* Tensor-parallel sharding on the CPU with world size 2 simulated: for one layer of each
 * fixture model (llama-tiny, qwen2-tiny with q/k/v bias, qwen3-tiny with q/k norm, phi3-tiny
 * from fused views, gemma3-tiny with GELU-tanh), the concatenated column-parallel outputs
 * (QKV, gate/up) equal the unsharded outputs and the SUM of the row-parallel partial
 * outputs (O, down) equals the unsharded projection; every expert of qwen3moe-tiny and
 * mixtral-tiny splits the same way, with the router and Gemma's sandwich norms replicated;
 * the
 * simulated TP forward's logits equal runner_cpu's on the full model for a 16-token
 * prompt (Llama / Qwen layers: the simulation refuses the others); a split that is off
 * by one head or one ffn row is caught; the divisibility checks; block-aligned and unaligned column slices of quantized weights; whole-head row
 * slices of GGUF-permuted Q/K.
 *
 * Inputs are random and fresh per run: the seed (time ^ pid) is printed; set
 * SPECD_TEST_SEED to replay one. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/core/err.h"
#include "engine/model/fp8.h"
#include "engine/model/model.h"
#include "engine/core/runner.h"
#include "engine/tp/shard.h"
#include "tests/fixtures.h"

#define W 2
#define TOL 1e-5

static uint64_t g_seed;

static uint64_t rnd(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill(float *x, size_t n, uint64_t *s) {
    for (size_t i = 0; i < n; i++) x[i] = (float)((double)(rnd(s) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float *f32(const tensor_view *t) {
    if (!t->data) return NULL;
    float *p = malloc((size_t)tensor_numel(t) * sizeof(float));
    assert_non_null(p);
    assert_int_equal(tensor_to_f32(t, p), 0);
    return p;
}

/* y (T, out) = x (T, in; row stride ldx) @ W (out, in)^T + b, double accumulation. */
static void mm(float *y, const float *x, int ldx, const float *w, const float *b, int T, int in, int out) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < out; o++) {
            double s = b ? b[o] : 0;
            for (int i = 0; i < in; i++) s += (double)x[(size_t)t * ldx + i] * w[(size_t)o * in + i];
            y[(size_t)t * out + o] = (float)s;
        }
}

static model *load(const char *name) {
    char rel[256], err[1024] = "";
    snprintf(rel, sizeof rel, "models/%s", name);
    model *m = model_load(fixture_path(rel), err, sizeof err);
    if (!m) fprintf(stderr, "model_load %s: %s\n", name, err);
    assert_non_null(m);
    return m;
}

static void make_shards(const model *m, model **sh) {
    char err[512] = "";
    for (int r = 0; r < W; r++) {
        sh[r] = shard_model(m, r, W, err, sizeof err);
        if (!sh[r]) fprintf(stderr, "shard_model: %s\n", err);
        assert_non_null(sh[r]);
    }
}

/* ---- one layer ----------------------------------------------------------------------- */

typedef struct { double q, k, v, o, gate, up, down; } layer_err;

/* Column-parallel outputs of all ranks, concatenated along features, vs the full output. */
static double concat_err(const float *x, int T, int D, const tensor_view *full_w,
                         const tensor_view *full_b, model *const *sh, size_t off_w, size_t off_b) {
    float *w = f32(full_w), *b = full_b ? f32(full_b) : NULL;
    int out = (int)full_w->shape[0], per = out / W;
    float *ref = malloc(sizeof(float) * (size_t)T * out), *cat = malloc(sizeof(float) * (size_t)T * out);
    float *part = malloc(sizeof(float) * (size_t)T * per);
    mm(ref, x, D, w, b, T, D, out);
    for (int r = 0; r < W; r++) {
        const tensor_view *rw = (const tensor_view *)((const char *)sh[r]->layers + off_w);
        const tensor_view *rb = full_b ? (const tensor_view *)((const char *)sh[r]->layers + off_b) : NULL;
        if (rb) assert_int_equal(rb->data != NULL, full_b->data != NULL);
        assert_int_equal(rw->shape[0], per);
        float *wr = f32(rw), *br = full_b && full_b->data ? f32(rb) : NULL;
        mm(part, x, D, wr, br, T, D, per);
        for (int t = 0; t < T; t++)
            memcpy(cat + (size_t)t * out + (size_t)r * per, part + (size_t)t * per, sizeof(float) * per);
        free(wr);
        free(br);
    }
    double e = rel_err(cat, ref, (size_t)T * out);
    free(w); free(b); free(ref); free(cat); free(part);
    return e;
}

/* Row-parallel: rank r multiplies its slice of the input features by its weight shard;
 * the sum of the partials must equal the full projection. */
static double rowpar_err(const float *in, int T, const tensor_view *full_w, model *const *sh,
                         size_t off_w) {
    float *w = f32(full_w);
    int out = (int)full_w->shape[0], K = (int)full_w->shape[1], per = K / W;
    float *ref = malloc(sizeof(float) * (size_t)T * out), *sum = calloc((size_t)T * out, sizeof(float));
    float *part = malloc(sizeof(float) * (size_t)T * out);
    mm(ref, in, K, w, NULL, T, K, out);
    for (int r = 0; r < W; r++) {
        const tensor_view *rw = (const tensor_view *)((const char *)sh[r]->layers + off_w);
        assert_int_equal(rw->shape[1], per);
        float *wr = f32(rw);
        mm(part, in + (size_t)r * per, K, wr, NULL, T, per, out);
        for (size_t i = 0; i < (size_t)T * out; i++) sum[i] += part[i];
        free(wr);
    }
    double e = rel_err(sum, ref, (size_t)T * out);
    free(w); free(ref); free(sum); free(part);
    return e;
}

/* act(gate) * up over n values, in place into g (SiLU, or Gemma's GELU-tanh). */
static void act_mul(float *g, const float *u, size_t n, ffn_act act) {
    for (size_t i = 0; i < n; i++) {
        float a = g[i];
        a = act == ACT_GELU_TANH ? 0.5f * a * (1.0f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a)))
                                 : a / (1.0f + expf(-a));
        g[i] = a * u[i];
    }
}

/* A gated MLP end to end: each rank's act(gate_r) * up_r through its down shard (the views
 * rank r keeps: rg[r], ru[r], rd[r]); the sum of the partials equals the full MLP's output. */
static double gated_err(const float *x, int T, ffn_act act, const tensor_view *fg, const tensor_view *fu,
                        const tensor_view *fd, const tensor_view *const *rg, const tensor_view *const *ru,
                        const tensor_view *const *rd) {
    int D = (int)fg->shape[1], FF = (int)fg->shape[0], per = FF / W;
    float *g = malloc(sizeof(float) * (size_t)T * FF), *u = malloc(sizeof(float) * (size_t)T * FF);
    float *ref = malloc(sizeof(float) * (size_t)T * D), *sum = calloc((size_t)T * D, sizeof(float));
    float *part = malloc(sizeof(float) * (size_t)T * D);
    float *wg = f32(fg), *wu = f32(fu), *wd = f32(fd);
    mm(g, x, D, wg, NULL, T, D, FF);
    mm(u, x, D, wu, NULL, T, D, FF);
    act_mul(g, u, (size_t)T * FF, act);
    mm(ref, g, FF, wd, NULL, T, FF, D);
    for (int r = 0; r < W; r++) {
        assert_int_equal(rg[r]->shape[0], per);
        assert_int_equal(rd[r]->shape[1], per);
        float *pg = f32(rg[r]), *pu = f32(ru[r]), *pd = f32(rd[r]);
        mm(g, x, D, pg, NULL, T, D, per);
        mm(u, x, D, pu, NULL, T, D, per);
        act_mul(g, u, (size_t)T * per, act);
        mm(part, g, per, pd, NULL, T, per, D);
        for (size_t i = 0; i < (size_t)T * D; i++) sum[i] += part[i];
        free(pg); free(pu); free(pd);
    }
    double e = rel_err(sum, ref, (size_t)T * D);
    free(g); free(u); free(ref); free(sum); free(part); free(wg); free(wu); free(wd);
    return e;
}

/* The dense MLP of layer l (or expert e's, e >= 0) split over the shards. */
static double mlp_err(const float *x, int T, const model *m, model *const *sh, int l, int e) {
    const model_layer *F = &m->layers[l];
    const tensor_view *rg[W], *ru[W], *rd[W];
    for (int r = 0; r < W; r++) {
        const model_layer *L = &sh[r]->layers[l];
        rg[r] = e < 0 ? &L->w_gate : &L->exp_gate[e];
        ru[r] = e < 0 ? &L->w_up : &L->exp_up[e];
        rd[r] = e < 0 ? &L->w_down : &L->exp_down[e];
    }
    return e < 0 ? gated_err(x, T, m->cfg.act, &F->w_gate, &F->w_up, &F->w_down, rg, ru, rd)
                 : gated_err(x, T, m->cfg.act, &F->exp_gate[e], &F->exp_up[e], &F->exp_down[e], rg, ru, rd);
}

#define OFF(l, f) ((size_t)(l) * sizeof(model_layer) + offsetof(model_layer, f))

static layer_err check_layer(const model *m, model *const *sh, int l, uint64_t seed) {
    const model_config *c = &m->cfg;
    const model_layer *F = &m->layers[l];
    int T = 5, D = c->hidden, qd = c->n_heads * c->head_dim;
    uint64_t s = seed;
    float *x = malloc(sizeof(float) * (size_t)T * D), *att = malloc(sizeof(float) * (size_t)T * qd);
    fill(x, (size_t)T * D, &s);
    fill(att, (size_t)T * qd, &s);
    layer_err e;
    e.q = concat_err(x, T, D, &F->wq, &F->bq, sh, OFF(l, wq), OFF(l, bq));
    e.k = concat_err(x, T, D, &F->wk, &F->bk, sh, OFF(l, wk), OFF(l, bk));
    e.v = concat_err(x, T, D, &F->wv, &F->bv, sh, OFF(l, wv), OFF(l, bv));
    e.o = rowpar_err(att, T, &F->wo, sh, OFF(l, wo));
    if (c->n_experts) {   /* experts: checked by test_shard_experts_split_like_the_mlp */
        e.gate = e.up = e.down = 0;
    } else {
        e.gate = concat_err(x, T, D, &F->w_gate, NULL, sh, OFF(l, w_gate), 0);
        e.up = concat_err(x, T, D, &F->w_up, NULL, sh, OFF(l, w_up), 0);
        e.down = mlp_err(x, T, m, sh, l, -1);
    }
    free(x);
    free(att);
    return e;
}

static void layer_ok(const char *name) {
    model *m = load(name), *sh[W];
    make_shards(m, sh);
    int l = (int)(g_seed % (uint64_t)m->cfg.n_layers);
    layer_err e = check_layer(m, sh, l, g_seed);
    fprintf(stderr, "  %s layer %d: rel err q %.2g k %.2g v %.2g o %.2g gate %.2g up %.2g mlp %.2g\n",
            name, l, e.q, e.k, e.v, e.o, e.gate, e.up, e.down);
    assert_true(e.q < TOL && e.k < TOL && e.v < TOL && e.o < TOL);
    assert_true(e.gate < TOL && e.up < TOL && e.down < TOL);
    for (int r = 0; r < W; r++) shard_free(sh[r]);
    model_free(m);
}

static void test_shard_layer_llama_concat_and_partial_sums(void **st) { (void)st; layer_ok("llama-tiny"); }
static void test_shard_layer_qwen2_bias_split(void **st) { (void)st; layer_ok("qwen2-tiny"); }
static void test_shard_layer_qwen3_qk_norm(void **st) { (void)st; layer_ok("qwen3-tiny"); }
static void test_shard_layer_phi3_fused_views(void **st) { (void)st; layer_ok("phi3-tiny"); }

/* Gemma 3: GELU-tanh in the split MLP; the sandwich norms and q/k norms are replicated
 * (the same views on every rank: they act on whole outputs, after the all-reduce). */
static void test_shard_layer_gemma3_gelu_and_replicated_norms(void **st) {
    (void)st;
    layer_ok("gemma3-tiny");
    model *m = load("gemma3-tiny"), *sh[W];
    assert_int_equal(m->cfg.act, ACT_GELU_TANH);
    make_shards(m, sh);
    for (int r = 0; r < W; r++)
        for (int l = 0; l < m->cfg.n_layers; l++) {
            assert_non_null(m->layers[l].post_attn_norm.data);
            assert_ptr_equal(sh[r]->layers[l].post_attn_norm.data, m->layers[l].post_attn_norm.data);
            assert_ptr_equal(sh[r]->layers[l].post_ffn_norm.data, m->layers[l].post_ffn_norm.data);
            assert_ptr_equal(sh[r]->layers[l].q_norm.data, m->layers[l].q_norm.data);
        }
    for (int r = 0; r < W; r++) shard_free(sh[r]);
    model_free(m);
}

/* Experts (Qwen3-MoE, Mixtral): the router is replicated, every expert is on every rank
 * with moe_ffn / W of its rows, and for each expert the concatenated gate / up outputs
 * and the sum of the partial MLP outputs equal the whole expert's. */
static void experts_ok(const char *name) {
    model *m = load(name), *sh[W];
    make_shards(m, sh);
    const model_config *c = &m->cfg;
    assert_true(c->n_experts > 0);
    int l = (int)(g_seed % (uint64_t)c->n_layers), T = 5, D = c->hidden;
    uint64_t s = g_seed ^ 0xe7u;
    float *x = malloc(sizeof(float) * (size_t)T * D);
    fill(x, (size_t)T * D, &s);
    double worst = 0;
    for (int r = 0; r < W; r++) {
        assert_int_equal(sh[r]->cfg.moe_ffn, c->moe_ffn / W);
        assert_int_equal(sh[r]->cfg.n_experts, c->n_experts);
        assert_ptr_equal(sh[r]->layers[l].router.data, m->layers[l].router.data);
    }
    for (int e = 0; e < c->n_experts; e++) {
        double eg, eu, ed = mlp_err(x, T, m, sh, l, e);
        /* gate and up rows: concatenated over the ranks they are the whole expert's */
        const tensor_view *F = &m->layers[l].exp_gate[e];
        float *wf = f32(F), *wu = f32(&m->layers[l].exp_up[e]);
        int MF = (int)F->shape[0], per = MF / W;
        eg = eu = 0;
        for (int r = 0; r < W; r++) {
            float *pg = f32(&sh[r]->layers[l].exp_gate[e]), *pu = f32(&sh[r]->layers[l].exp_up[e]);
            double dg = rel_err(pg, wf + (size_t)r * per * D, (size_t)per * D);
            double du = rel_err(pu, wu + (size_t)r * per * D, (size_t)per * D);
            eg = dg > eg ? dg : eg;
            eu = du > eu ? du : eu;
            free(pg);
            free(pu);
        }
        free(wf);
        free(wu);
        assert_true(eg < TOL && eu < TOL && ed < TOL);
        worst = ed > worst ? ed : worst;
    }
    fprintf(stderr, "  %s layer %d: %d experts split in %d, worst expert MLP rel err %.2g\n", name, l,
            c->n_experts, W, worst);
    free(x);
    for (int r = 0; r < W; r++) shard_free(sh[r]);
    model_free(m);
}

static void test_shard_experts_split_like_the_mlp(void **st) {
    (void)st;
    experts_ok("qwen3moe-tiny");
    experts_ok("mixtral-tiny");
}

/* ---- full forward: simulated TP 2 vs the unsharded CPU runner ------------------------ */

#define NP 16

static void cpu_logits(const model *m, const int32_t *tok, float *logits) {
    runner_config rc = {.num_blocks = 4, .block_size = 16, .max_batch = 1, .max_seq_len = 32,
                        .max_tokens_per_step = NP, .threads = 1};
    char err[512] = "";
    runner *r = runner_cpu_create(m, NULL, &rc, err, sizeof err);
    if (!r) fprintf(stderr, "runner_cpu_create: %s\n", err);
    assert_non_null(r);
    int32_t blocks[2] = {1, 2};
    assert_int_equal(r->ops->slot_write_blocks(r, 0, 0, blocks, 2), 0);
    runner_row row = {.slot = 0, .n_new = NP, .tok_off = 0, .n_logits = NP, .logits_off = 0};
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = tok,
                      .n_tokens = NP, .logits = logits};
    assert_int_equal(runner_forward(r, &b), 0);
    runner_destroy(r);
}

static double forward_err(const model *m, model *const *sh, int world, const int32_t *tok, const float *ref) {
    float *lg = malloc(sizeof(float) * NP * (size_t)m->cfg.vocab);
    char err[512] = "";
    int rc = shard_simulate_forward(sh, world, tok, NP, lg, err, sizeof err);
    if (rc) fprintf(stderr, "shard_simulate_forward: %s\n", err);
    assert_int_equal(rc, 0);
    double e = rel_err(lg, ref, NP * (size_t)m->cfg.vocab);
    free(lg);
    return e;
}

static void forward_ok(const char *name) {
    model *m = load(name), *sh[W], *one;
    uint64_t s = g_seed ^ 0x51u;
    int32_t tok[NP];
    for (int i = 0; i < NP; i++) tok[i] = (int32_t)(rnd(&s) % (uint64_t)m->cfg.vocab);
    float *ref = malloc(sizeof(float) * NP * (size_t)m->cfg.vocab);
    cpu_logits(m, tok, ref);
    make_shards(m, sh);
    char err[256];
    assert_non_null(one = shard_model(m, 0, 1, err, sizeof err));
    double e1 = forward_err(m, &one, 1, tok, ref), e2 = forward_err(m, sh, W, tok, ref);
    fprintf(stderr, "  %s: 16-token logits rel err vs runner_cpu: TP1 %.2g TP2 %.2g\n", name, e1, e2);
    assert_true(e1 < TOL);
    assert_true(e2 < TOL);
    shard_free(one);
    for (int r = 0; r < W; r++) shard_free(sh[r]);
    free(ref);
    model_free(m);
}

static void test_shard_forward_llama_tp2_equals_cpu_runner(void **st) { (void)st; forward_ok("llama-tiny"); }
static void test_shard_forward_qwen2_tp2_equals_cpu_runner(void **st) { (void)st; forward_ok("qwen2-tiny"); }
static void test_shard_forward_qwen3_tp2_equals_cpu_runner(void **st) { (void)st; forward_ok("qwen3-tiny"); }

/* ---- the checks can fail ------------------------------------------------------------- */

/* Rank 1's Q (and its O columns) start one head early, or its gate rows one row early:
 * the layer checks and the forward must all notice. */
static void test_shard_off_by_one_split_is_caught(void **st) {
    (void)st;
    model *m = load("qwen2-tiny"), *sh[W];
    make_shards(m, sh);
    const model_config *c = &sh[1]->cfg;
    int l = (int)(g_seed % (uint64_t)m->cfg.n_layers), hd = c->head_dim;
    model_layer good = sh[1]->layers[l];
    int64_t q0 = (int64_t)c->n_heads * hd - hd, qn = (int64_t)c->n_heads * hd;  /* head 1, not 2 */
    assert_int_equal(shard_slice_rows(sh[1], &m->layers[l].wq, q0, qn, &sh[1]->layers[l].wq), 0);
    assert_int_equal(shard_slice_rows(sh[1], &m->layers[l].bq, q0, qn, &sh[1]->layers[l].bq), 0);
    assert_int_equal(shard_slice_cols(sh[1], &m->layers[l].wo, q0, qn, &sh[1]->layers[l].wo), 0);
    layer_err e = check_layer(m, sh, l, g_seed);
    fprintf(stderr, "  off-by-one head: rel err q %.2g o %.2g\n", e.q, e.o);
    assert_true(e.q > 1e-2);
    assert_true(e.o > 1e-2);
    assert_true(e.k < TOL && e.v < TOL);   /* the untouched parts still agree */

    uint64_t s = g_seed;
    int32_t tok[NP];
    for (int i = 0; i < NP; i++) tok[i] = (int32_t)(rnd(&s) % (uint64_t)m->cfg.vocab);
    float *ref = malloc(sizeof(float) * NP * (size_t)m->cfg.vocab);
    cpu_logits(m, tok, ref);
    double ef = forward_err(m, sh, W, tok, ref);
    fprintf(stderr, "  off-by-one head: forward rel err %.2g\n", ef);
    assert_true(ef > 1e-3);

    sh[1]->layers[l] = good;   /* ffn off by one row */
    int64_t f0 = c->ffn - 1;
    assert_int_equal(shard_slice_rows(sh[1], &m->layers[l].w_gate, f0, c->ffn, &sh[1]->layers[l].w_gate), 0);
    e = check_layer(m, sh, l, g_seed);
    fprintf(stderr, "  off-by-one ffn row: rel err gate %.2g mlp %.2g\n", e.gate, e.down);
    assert_true(e.gate > 1e-2);
    assert_true(e.down > 1e-3);
    assert_true(e.up < TOL && e.q < TOL);
    free(ref);
    for (int r = 0; r < W; r++) shard_free(sh[r]);
    model_free(m);
}

static void test_shard_check_rejects_indivisible_sizes(void **st) {
    (void)st;
    model *m = load("llama-tiny");  /* 4 heads, 2 KV heads, ffn 344 */
    char err[512] = "";
    assert_int_equal(shard_check(&m->cfg, 2, err, sizeof err), 0);
    assert_int_equal(shard_check(&m->cfg, 3, err, sizeof err), SPECD_EINVAL);
    assert_non_null(strstr(err, "4 attention heads"));
    assert_int_equal(shard_check(&m->cfg, 4, err, sizeof err), SPECD_EINVAL);
    assert_non_null(strstr(err, "2 KV heads"));
    assert_null(shard_model(m, 0, 4, err, sizeof err));
    assert_null(shard_model(m, 2, 2, err, sizeof err));   /* rank out of range */
    model_config c = m->cfg;
    c.ffn = 345;
    assert_int_equal(shard_check(&c, 2, err, sizeof err), SPECD_EINVAL);
    assert_non_null(strstr(err, "intermediate size 345"));
    model_free(m);
    m = load("qwen3moe-tiny");   /* experts of 96 rows */
    assert_int_equal(shard_check(&m->cfg, 2, err, sizeof err), 0);
    c = m->cfg;
    c.moe_ffn = 97;
    assert_int_equal(shard_check(&c, 2, err, sizeof err), SPECD_EINVAL);
    assert_non_null(strstr(err, "experts' intermediate size 97"));
    model_free(m);
}

/* The simulation models Llama / Qwen layers only: any other layer kind is refused rather
 * than simulated wrongly. */
static void test_shard_simulation_refuses_what_it_does_not_model(void **st) {
    (void)st;
    const char *names[] = {"gemma3-tiny", "qwen3moe-tiny", "mistral-swa-tiny"};
    for (int k = 0; k < 3; k++) {
        model *m = load(names[k]), *sh[W];
        make_shards(m, sh);
        int32_t tok[NP] = {0};
        float *lg = malloc(sizeof(float) * NP * (size_t)m->cfg.vocab);
        char err[256] = "";
        assert_int_equal(shard_simulate_forward(sh, W, tok, NP, lg, err, sizeof err), SPECD_EUNSUPPORTED);
        assert_non_null(strstr(err, "Llama / Qwen layers only"));
        free(lg);
        for (int r = 0; r < W; r++) shard_free(sh[r]);
        model_free(m);
    }
}

static void test_shard_config_divides_heads_and_ffn(void **st) {
    (void)st;
    model *m = load("qwen3-tiny"), *sh[W];
    make_shards(m, sh);
    for (int r = 0; r < W; r++) {
        const model_config *c = &sh[r]->cfg;
        assert_int_equal(c->n_heads, m->cfg.n_heads / W);
        assert_int_equal(c->n_kv_heads, m->cfg.n_kv_heads / W);
        assert_int_equal(c->ffn, m->cfg.ffn / W);
        assert_int_equal(c->hidden, m->cfg.hidden);
        assert_int_equal(c->head_dim, m->cfg.head_dim);
        assert_int_equal(c->vocab, m->cfg.vocab);
        /* row slices point into the mapping; replicated tensors are the same views */
        const model_layer *L = &sh[r]->layers[0], *F = &m->layers[0];
        size_t rb = (size_t)(F->wq.dtype == TDT_F32 ? 4 : 2) * (size_t)F->wq.shape[1];
        assert_ptr_equal(L->wq.data, (const char *)F->wq.data + (size_t)r * L->wq.shape[0] * rb);
        assert_ptr_equal(L->q_norm.data, F->q_norm.data);
        assert_ptr_equal(sh[r]->lm_head.data, m->lm_head.data);
        /* KV bytes per token per rank: the pool holds only this rank's heads */
        assert_int_equal(model_kv_bytes_per_token(c, 2) * W, model_kv_bytes_per_token(&m->cfg, 2));
    }
    for (int r = 0; r < W; r++) shard_free(sh[r]);
    model_free(m);
}

/* ---- slices of quantized and permuted views ------------------------------------------ */

static uint16_t to_f16(float f) {   /* small normal values only */
    uint32_t b;
    memcpy(&b, &f, 4);
    uint32_t sign = (b >> 16) & 0x8000u;
    int e = (int)((b >> 23) & 0xff) - 127 + 15;
    uint32_t mant = (b >> 13) & 0x3ffu;
    return (uint16_t)(sign | ((uint32_t)e << 10) | mant);
}

/* A Q8_0 [rows, 128] tensor: column slices at 32 (block aligned -> stays Q8_0) and at 16
 * (off the grid -> F32) must equal the same columns of the dequantized whole. */
static void test_shard_quantized_column_slices(void **st) {
    (void)st;
    enum { R = 3, C = 128 };
    uint8_t q[R * (C / 32) * 34];
    uint64_t s = g_seed;
    for (int b = 0; b < R * C / 32; b++) {
        uint16_t d = to_f16(0.01f * (float)(1 + rnd(&s) % 7));
        memcpy(q + b * 34, &d, 2);
        for (int i = 0; i < 32; i++) q[b * 34 + 2 + i] = (uint8_t)(rnd(&s) & 0xff);
    }
    tensor_view t = {.data = q, .dtype = TDT_Q8_0, .ndim = 2, .shape = {R, C}};
    float *all = f32(&t);
    char err[128];
    model *m = load("llama-tiny");
    model *owner = shard_model(m, 0, 1, err, sizeof err);
    assert_non_null(owner);
    struct { int c0, n; tensor_dtype want; } cases[] = {{32, 64, TDT_Q8_0}, {0, 32, TDT_Q8_0},
                                                        {16, 64, TDT_F32}, {64, 40, TDT_F32}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        tensor_view o;
        assert_int_equal(shard_slice_cols(owner, &t, cases[k].c0, cases[k].n, &o), 0);
        assert_int_equal(o.dtype, cases[k].want);
        assert_int_equal(o.shape[0], R);
        assert_int_equal(o.shape[1], cases[k].n);
        float *got = f32(&o);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < cases[k].n; i++)
                assert_true(got[r * cases[k].n + i] == all[r * C + cases[k].c0 + i]);
        free(got);
    }
    tensor_view o;
    assert_int_equal(shard_slice_cols(owner, &t, 100, 40, &o), SPECD_ERANGE);
    assert_int_equal(shard_slice_cols(NULL, &t, 0, 32, &o), SPECD_EINVAL);  /* no owner for the copy */
    free(all);
    shard_free(owner);
    model_free(m);
}

/* FP8 views (checkpoints with per-row or block scales) slice through fp32: rows and
 * columns of a slice equal those of the whole view's dequantization, whatever the scale
 * layout, including a view that starts inside a scale block (scale_row0). */
static void test_shard_fp8_slices(void **st) {
    (void)st;
    enum { R = 6, C = 40 };
    uint8_t q[R * C];
    float row_sc[R], blk_sc[2 * 3];   /* per row; per [4, 16] block: 2 x 3 blocks */
    uint64_t s = g_seed ^ 0xf8u;
    for (int i = 0; i < R * C; i++) q[i] = (uint8_t)(rnd(&s) % 0x7e) | (uint8_t)(rnd(&s) & 0x80);   /* no NaN */
    for (int r = 0; r < R; r++) row_sc[r] = 0.01f * (float)(1 + r);
    for (int i = 0; i < 6; i++) blk_sc[i] = 0.5f + 0.25f * (float)i;
    tensor_view per_row = {.data = q, .dtype = TDT_F8_E4M3, .ndim = 2, .shape = {R, C}, .scale = row_sc,
                           .scale_dtype = TDT_F32, .scale_block = {1, C}, .scale_cols = 1};
    tensor_view blocks = per_row;
    blocks.scale = blk_sc;
    blocks.scale_block[0] = 4;
    blocks.scale_block[1] = 16;
    blocks.scale_cols = 3;
    tensor_view inner = blocks;   /* rows 2.. of an 8-row tensor: its first block row is shared */
    inner.scale_row0 = 2;
    char err[128];
    model *m = load("llama-tiny");
    model *owner = shard_model(m, 0, 1, err, sizeof err);
    assert_non_null(owner);
    const tensor_view *views[] = {&per_row, &blocks, &inner};
    for (size_t v = 0; v < 3; v++) {
        float *all = f32(views[v]);
        /* the dequantization itself: byte times its block's scale */
        const tensor_view *t = views[v];
        const float *sc = t->scale;
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c += 7) {
                float sv = sc[(r + t->scale_row0) / t->scale_block[0] * t->scale_cols + c / t->scale_block[1]];
                assert_true(all[r * C + c] == fp8_e4m3_to_f32(q[r * C + c]) * sv);
            }
        tensor_view o;
        assert_int_equal(shard_slice_rows(owner, t, 1, 4, &o), 0);
        assert_int_equal(o.dtype, TDT_F32);
        assert_int_equal(o.shape[0], 4);
        assert_int_equal(o.shape[1], C);
        float *got = f32(&o);
        for (int i = 0; i < 4 * C; i++) assert_true(got[i] == all[C + i]);
        free(got);
        assert_int_equal(shard_slice_cols(owner, t, 10, 20, &o), 0);
        assert_int_equal(o.dtype, TDT_F32);
        got = f32(&o);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 20; i++) assert_true(got[r * 20 + i] == all[r * C + 10 + i]);
        free(got);
        free(all);
    }
    shard_free(owner);
    model_free(m);
}

/* GGUF stores Q/K rows permuted inside each head: a slice of whole heads keeps the
 * permutation valid (unpermute_heads becomes the heads in the slice); a slice that cuts a
 * head is refused. */
static void test_shard_row_slice_of_permuted_heads(void **st) {
    (void)st;
    enum { H = 4, HD = 8, C = 16 };
    float w[H * HD * C];
    uint64_t s = g_seed;
    fill(w, H * HD * C, &s);
    tensor_view t = {.data = w, .dtype = TDT_F32, .ndim = 2, .shape = {H * HD, C}, .unpermute_heads = H};
    float *all = f32(&t);
    tensor_view o;
    assert_int_equal(shard_slice_rows(NULL, &t, 2 * HD, 2 * HD, &o), 0);
    assert_int_equal(o.unpermute_heads, 2);
    float *got = f32(&o);
    assert_memory_equal(got, all + 2 * HD * C, sizeof(float) * 2 * HD * C);
    assert_int_equal(shard_slice_rows(NULL, &t, HD / 2, 2 * HD, &o), SPECD_EINVAL);
    assert_int_equal(shard_slice_rows(NULL, &t, 3 * HD, 2 * HD, &o), SPECD_ERANGE);
    free(got);
    free(all);
}

int main(void) {
    const char *env = getenv("SPECD_TEST_SEED");
    g_seed = env && *env ? strtoull(env, NULL, 0) : ((uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20));
    fprintf(stderr, "test_shard: seed %llu (SPECD_TEST_SEED=%llu replays it)\n",
            (unsigned long long)g_seed, (unsigned long long)g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard_check_rejects_indivisible_sizes),
        cmocka_unit_test(test_shard_config_divides_heads_and_ffn),
        cmocka_unit_test(test_shard_layer_llama_concat_and_partial_sums),
        cmocka_unit_test(test_shard_layer_qwen2_bias_split),
        cmocka_unit_test(test_shard_layer_qwen3_qk_norm),
        cmocka_unit_test(test_shard_layer_phi3_fused_views),
        cmocka_unit_test(test_shard_layer_gemma3_gelu_and_replicated_norms),
        cmocka_unit_test(test_shard_experts_split_like_the_mlp),
        cmocka_unit_test(test_shard_simulation_refuses_what_it_does_not_model),
        cmocka_unit_test(test_shard_forward_llama_tp2_equals_cpu_runner),
        cmocka_unit_test(test_shard_forward_qwen2_tp2_equals_cpu_runner),
        cmocka_unit_test(test_shard_forward_qwen3_tp2_equals_cpu_runner),
        cmocka_unit_test(test_shard_off_by_one_split_is_caught),
        cmocka_unit_test(test_shard_quantized_column_slices),
        cmocka_unit_test(test_shard_fp8_slices),
        cmocka_unit_test(test_shard_row_slice_of_permuted_heads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
