/* CUDA runner tests on the golden fixtures (HF transformers, fp32 compute on bf16
 * weights): last-position logits within 2e-2 relative (max abs error / max abs logit),
 * every position of the 33-token prompt, greedy continuations equal to the reference
 * until the first step whose golden margin is below the logit tolerance, batched and
 * padded decode equal to the reference, chunked prefill, and the dummy slot: a captured
 * step with padding rows over a dirtied dummy slot leaves it at length 0 and changes no
 * live block; the speculative graph: greedy output equal to plain decode, the same dummy
 * reset, and draft == target accepting nearly every draft (greedy and sampled); sampling
 * with logit adjustments and top logprobs, in the forward pass against the host sampler
 * and in the decode graph; FP8 projections (--dtype fp8): the runner's FP8 GEMM (cuBLASLt
 * and its GEMV fallback) against a double reference on the exact E4M3 values, and a
 * fixture model in FP8 against the HF reference. Fixtures come from $SPECD_FIXTURES
 * (default ../shared/fixtures). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>

#include "engine/core/err.h"
#include "engine/cuda/cuda_internal.h"
#include "engine/cuda/cuda_runner.h"
#include "engine/model/fp8.h"
#include "engine/model/model.h"
#include "engine/core/sample.h"
#include "engine/core/spec.h"
#include "kernels/specd_kernels.h"
#include "tests/gpu/gpu_util.h"

/* bf16 tolerance on logits (max abs error / max abs logit). The fixtures README says
 * "about 2e-2"; tests/gpu/hf_compare.py measured transformers' own bf16 forward against
 * these same golden logits at up to 3.0e-2 (llama-tiny, 250 tokens) and 2.9e-2
 * (qwen3-tiny, 100 tokens), so a correct bf16 runner can need 3e-2 here. */
#define REL_TOL 3e-2
/* Mixture of experts: a bf16 forward can pick another expert where two router scores
 * nearly tie, which moves that position's logits far more than rounding does. HF
 * transformers' own bf16 forward of the fixtures shows it (tests/gpu/moe_bf16_check.py, H200):
 * qwen3moe-tiny 2 of 33 positions above REL_TOL (worst 0.20), mixtral-tiny 1 (0.30). So
 * for MoE models up to MOE_FLIPS positions of the all-positions prompt may exceed REL_TOL
 * (never the last-position logits of any prompt), and greedy tokens are compared up to
 * the first step whose golden margin is below MOE_MARGIN of the largest logit (twice
 * the dense bound: a qwen3moe-tiny greedy step of margin 0.054 flipped in the batched
 * graph; bf16 rounding alone stays within REL_TOL). */
#define MOE_FLIPS 3
#define MOE_MARGIN 0.06
#define MAXB 8
#define SEQ 512
#define BS 16
#define MAXBLK (SEQ / BS)

typedef struct {
    int n_prompts;
    int len[8];
    int32_t *prompt[8];
    float *last[8];           /* [vocab] */
    float *all;               /* [33, vocab] for the prompt that has all_logits */
    int all_idx;
    int greedy[8][64], n_greedy[8];
    double margin[8][64];
} golden;

static const char *fixtures(void) {
    const char *e = getenv("SPECD_FIXTURES");
    return e && *e ? e : "../shared/fixtures";
}

static float *json_floats(json_t *a, int *n) {
    *n = (int)json_array_size(a);
    float *v = malloc(sizeof(float) * (size_t)(*n ? *n : 1));
    for (int i = 0; i < *n; i++) v[i] = (float)json_number_value(json_array_get(a, (size_t)i));
    return v;
}

/* A slot length as the device holds it, checked against the host mirror that
 * slot_get_len answers from (each op must advance both alike). */
static int dev_len(runner *r, int slot, int which) {
    int d = cuda_runner_device_len(r, slot, which);
    assert_int_equal(r->ops->slot_get_len(r, slot, which), d);
    return d;
}

static void golden_load(const char *name, golden *g) {
    char path[1024];
    snprintf(path, sizeof path, "%s/models/%s/golden.json", fixtures(), name);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) fail_msg("%s: %s", path, je.text);
    json_t *ps = json_object_get(root, "prompts");
    memset(g, 0, sizeof *g);
    g->all_idx = -1;
    g->n_prompts = (int)json_array_size(ps);
    assert_true(g->n_prompts > 0 && g->n_prompts <= 8);
    for (int i = 0; i < g->n_prompts; i++) {
        json_t *p = json_array_get(ps, (size_t)i);
        int n;
        float *pr = json_floats(json_object_get(p, "prompt"), &n);
        g->len[i] = n;
        g->prompt[i] = malloc(sizeof(int32_t) * (size_t)n);
        for (int j = 0; j < n; j++) g->prompt[i][j] = (int32_t)pr[j];
        free(pr);
        g->last[i] = json_floats(json_object_get(p, "last_logits"), &n);
        json_t *gr = json_object_get(p, "greedy"), *mg = json_object_get(p, "margins");
        g->n_greedy[i] = (int)json_array_size(gr);
        for (int j = 0; j < g->n_greedy[i] && j < 64; j++) {
            g->greedy[i][j] = (int)json_integer_value(json_array_get(gr, (size_t)j));
            g->margin[i][j] = json_number_value(json_array_get(mg, (size_t)j));
        }
        json_t *all = json_object_get(p, "all_logits");
        if (all) {
            int rows = (int)json_array_size(all), vocab = 0;
            float *first = json_floats(json_array_get(all, 0), &vocab);
            free(first);
            g->all = malloc(sizeof(float) * (size_t)rows * vocab);
            for (int r = 0; r < rows; r++) {
                float *row = json_floats(json_array_get(all, (size_t)r), &n);
                memcpy(g->all + (size_t)r * vocab, row, sizeof(float) * (size_t)vocab);
                free(row);
            }
            g->all_idx = i;
        }
    }
    json_decref(root);
}

static void golden_free(golden *g) {
    for (int i = 0; i < g->n_prompts; i++) { free(g->prompt[i]); free(g->last[i]); }
    free(g->all);
}

static double rel_err(const float *a, const float *ref, int n) {
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        double d = fabs((double)a[i] - ref[i]);
        if (d > num) num = d;
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    return num / den;
}

static double max_abs(const float *a, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) if (fabs(a[i]) > m) m = fabs(a[i]);
    return m;
}

static int argmax(const float *a, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (a[i] > a[b]) b = i;
    return b;
}

typedef struct {
    model *m;
    runner *r;
    golden g;
    int vocab;
} fixture;

static int g_max_batch = MAXB;   /* the runners' max_batch (test_odd_max_batch changes it) */

static void fixture_open(fixture *f, const char *name, int no_graphs) {
    char path[1024], err[512];
    snprintf(path, sizeof path, "%s/models/%s", fixtures(), name);
    f->m = model_load(path, err, sizeof err);
    if (!f->m) fail_msg("model_load %s: %s", path, err);
    runner_config cfg = {.num_blocks = 1 + MAXB * MAXBLK, .block_size = BS, .max_batch = g_max_batch,
                         .max_seq_len = SEQ, .max_tokens_per_step = 512, .mem_fraction = 0.9};
    cuda_runner_opts o = {.world = 1, .no_graphs = no_graphs, .quiet = 1};
    f->r = runner_cuda_create_ex(f->m, NULL, &cfg, &o, err, sizeof err);
    if (!f->r) fail_msg("runner_cuda_create %s: %s", name, err);
    f->vocab = f->m->cfg.vocab;
    golden_load(name, &f->g);
}

static void fixture_close(fixture *f) {
    runner_destroy(f->r);
    model_free(f->m);
    golden_free(&f->g);
}

/* Slot s owns blocks 1 + s*MAXBLK .. ; length reset to 0. */
static void slot_reset(runner *r, int s) {
    int32_t b[MAXBLK];
    for (int i = 0; i < MAXBLK; i++) b[i] = 1 + s * MAXBLK + i;
    assert_int_equal(r->ops->slot_write_blocks(r, s, 0, b, MAXBLK), 0);
    assert_int_equal(r->ops->slot_set_len(r, s, RUNNER_TARGET, 0), 0);
}

static void prefill(fixture *f, int s, const int32_t *tok, int n, int n_logits, float *logits) {
    runner_row row = {.slot = s, .n_new = n, .tok_off = 0, .n_logits = n_logits, .logits_off = 0};
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = tok,
                      .n_tokens = n, .logits = logits};
    int rc = runner_forward(f->r, &b);
    if (rc) fail_msg("forward: %d %s", rc, cuda_runner_error(f->r));
}

/* Greedy steps through the decode op for rows of one batch; returns compared steps. */
static int compare_greedy(const golden *g, int p, const int *got, int n, double tol_abs) {
    int cmp = 0;
    for (int j = 0; j < n && j < g->n_greedy[p]; j++) {
        if (g->margin[p][j] < tol_abs) break;
        if (got[j] != g->greedy[p][j])
            fail_msg("prompt %d (len %d): step %d token %d, reference %d (margin %.4f)", p,
                     g->len[p], j, got[j], g->greedy[p][j], g->margin[p][j]);
        cmp++;
    }
    return cmp;
}

static void run_golden(const char *name) {
    fixture f;
    fixture_open(&f, name, 0);
    golden *g = &f.g;
    float *logits = malloc(sizeof(float) * (size_t)f.vocab * 512);
    double worst = 0;
    int compared = 0, total = 0;
    for (int p = 0; p < g->n_prompts; p++) {
        slot_reset(f.r, 0);
        int all = p == g->all_idx;
        prefill(&f, 0, g->prompt[p], g->len[p], all ? g->len[p] : 1, logits);
        const float *last = logits + (all ? (size_t)(g->len[p] - 1) * f.vocab : 0);
        double e = rel_err(last, g->last[p], f.vocab);
        printf("    %-12s prompt %d (%3d tokens): last logits rel err %.3e\n", name, p, g->len[p], e);
        if (e > worst) worst = e;
        if (e > REL_TOL) fail_msg("%s prompt %d: last logits rel err %.3e", name, p, e);
        const int moe = f.m->cfg.n_experts > 0;
        if (all) {
            int flips = 0;
            for (int t = 0; t < g->len[p]; t++) {
                double ea = rel_err(logits + (size_t)t * f.vocab, g->all + (size_t)t * f.vocab, f.vocab);
                if (ea > REL_TOL && moe && ea < 0.5 && ++flips <= MOE_FLIPS) {
                    printf("    %-12s prompt %d position %d: rel err %.3e (a routing flip, %d of at most %d)\n", name,
                           p, t, ea, flips, MOE_FLIPS);
                    continue;
                }
                if (ea > worst) worst = ea;
                if (ea > REL_TOL) fail_msg("%s prompt %d position %d: rel err %.3e", name, p, t, ea);
            }
        }
        assert_int_equal(dev_len(f.r, 0, RUNNER_TARGET), g->len[p]);
        /* Greedy: first token from the prefill logits, then the captured decode step. */
        double tol_abs = (moe ? MOE_MARGIN : REL_TOL) * max_abs(g->last[p], f.vocab);
        int got[64], n = g->n_greedy[p];
        got[0] = argmax(last, f.vocab);
        for (int j = 1; j < n; j++) {
            int slot = 0;
            runner_sampling sp = {0};
            runner_decode_batch d = {.n = 1, .slots = &slot, .tokens = &got[j - 1], .sp = &sp,
                                     .out_tokens = &got[j]};
            int rc = f.r->ops->decode(f.r, &d);
            if (rc) fail_msg("decode: %d %s", rc, cuda_runner_error(f.r));
        }
        compared += compare_greedy(g, p, got, n, tol_abs);
        total += n;
    }
    printf("    %-12s max rel err %.3e over %d prompts; greedy %d/%d steps compared (rest past a "
           "low-margin step)\n", name, worst, g->n_prompts, compared, total);
    assert_true(compared > 0);   /* never vacuous */
    free(logits);
    fixture_close(&f);
}

static void test_golden_llama_tiny(void **s) { (void)s; run_golden("llama-tiny"); }
static void test_golden_qwen2_tiny(void **s) { (void)s; run_golden("qwen2-tiny"); }
static void test_golden_qwen3_tiny(void **s) { (void)s; run_golden("qwen3-tiny"); }
static void test_golden_llama_draft(void **s) { (void)s; run_golden("llama-draft"); }
static void test_golden_mistral_swa_tiny(void **s) { (void)s; run_golden("mistral-swa-tiny"); }
static void test_golden_gemma3_tiny(void **s) { (void)s; run_golden("gemma3-tiny"); }
static void test_golden_phi3_tiny(void **s) { (void)s; run_golden("phi3-tiny"); }

/* A window pool (runner_config.win_blocks): gemma3-tiny's three window layers keep their
 * KV in a second pool through the slot's window table, the full layer in the first.
 * Fed the same tokens, a runner whose window table is a ring of WIN_RING reused blocks,
 * the entries behind the window reset to the null block as the engine releases them
 * (kv_window_drop_upto), gives the logits of one pool that keeps every block: the
 * 250-token prompt in two chunks, 60 steps through forward (logits compared), then 60
 * through the captured decode graph (tokens compared). Reading an entry behind the window
 * would read a block the ring has overwritten with later positions. */
#define WIN_RING 16
static void win_table(runner *r, int c, int end, int window) {
    int32_t b[MAXBLK] = {0};
    int lo = c - window - 1 > 0 ? (c - window - 1) / BS : 0, hi = (end + BS - 1) / BS;
    assert_true(hi - lo <= WIN_RING);
    for (int i = lo; i < hi; i++) b[i] = 1 + i % WIN_RING;
    assert_int_equal(r->ops->slot_write_win_blocks(r, 0, 0, b, MAXBLK), 0);
}

static void test_window_pool_matches_one_pool(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "gemma3-tiny", 0);
    const golden *g = &f.g;
    const int W = f.m->cfg.sliding_window, V = f.vocab;
    int p = -1;
    for (int i = 0; i < g->n_prompts; i++)
        if (g->len[i] == 250) p = i;
    assert_true(p >= 0 && W > 0 && W < 200);
    char err[512];
    runner_config cfg = {.num_blocks = 1 + MAXB * MAXBLK, .block_size = BS, .max_batch = 1, .max_seq_len = SEQ,
                         .max_tokens_per_step = 512, .mem_fraction = 0.9, .win_blocks = 1 + WIN_RING};
    cuda_runner_opts o = {.world = 1, .quiet = 1};
    runner *w = runner_cuda_create_ex(f.m, NULL, &cfg, &o, err, sizeof err);
    if (!w) fail_msg("runner_cuda_create (window pool): %s", err);
    assert_non_null(w->ops->slot_write_win_blocks);
    assert_int_equal(f.r->ops->slot_write_win_blocks(f.r, 0, 0, NULL, 0), SPECD_EINVAL);   /* no window pool */
    slot_reset(f.r, 0);
    slot_reset(w, 0);
    float *la = malloc(sizeof(float) * (size_t)V), *lb = malloc(sizeof(float) * (size_t)V);
    int c = 0, tok = 0;
    double worst = 0;
    runner *both[2] = {f.r, w};
    float *outs[2] = {la, lb};
    for (int step = 0; step < 2 + 60; step++) {   /* two prompt chunks, then 60 single tokens */
        int n = step == 0 ? 128 : step == 1 ? g->len[p] - 128 : 1;
        const int32_t *in = step < 2 ? g->prompt[p] + c : &tok;
        win_table(w, c, c + n, W);
        for (int k = 0; k < 2; k++) {
            runner_row row = {.slot = 0, .n_new = n, .tok_off = 0, .n_logits = 1, .logits_off = 0};
            runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = in, .n_tokens = n,
                              .logits = outs[k]};
            int rc = runner_forward(both[k], &b);
            if (rc) fail_msg("forward: %d %s", rc, cuda_runner_error(both[k]));
        }
        c += n;
        double e = rel_err(lb, la, V);
        if (e > worst) worst = e;
        if (e > 1e-6) fail_msg("position %d: window pool logits differ from one pool by %.3e", c, e);
        tok = argmax(la, V);
    }
    int ta = tok, tb = tok;
    for (int j = 0; j < 60; j++, c++) {
        int slot = 0, na = 0, nb = 0;
        runner_sampling sp = {0};
        win_table(w, c, c + 1, W);
        runner_decode_batch da = {.n = 1, .slots = &slot, .tokens = &ta, .sp = &sp, .out_tokens = &na};
        runner_decode_batch db = {.n = 1, .slots = &slot, .tokens = &tb, .sp = &sp, .out_tokens = &nb};
        if (f.r->ops->decode(f.r, &da) || w->ops->decode(w, &db)) fail_msg("decode: %s", cuda_runner_error(w));
        if (na != nb) fail_msg("decode step %d (position %d): token %d with the window pool, %d with one", j, c, nb, na);
        ta = na;
        tb = nb;
    }
    assert_int_equal(dev_len(w, 0, RUNNER_TARGET), c);
    printf("    gemma3-tiny window pool (ring of %d blocks, window %d): %d positions, logits max rel diff %.3e, "
           "60 graph decode steps equal\n", WIN_RING, W, c, worst);
    free(la);
    free(lb);
    runner_destroy(w);
    fixture_close(&f);
}

/* MoE shapes the kernels cannot run are refused by name when the runner is created (the
 * routing holds at most 512 experts per warp row, 16 per token). */
static void test_moe_shape_limits_refused_at_create(void **s) {
    (void)s;
    char path[1024], err[512];
    snprintf(path, sizeof path, "%s/models/qwen3moe-tiny", fixtures());
    model *m = model_load(path, err, sizeof err);
    if (!m) fail_msg("model_load %s: %s", path, err);
    runner_config cfg = {.num_blocks = 1 + MAXB * MAXBLK, .block_size = BS, .max_batch = MAXB,
                         .max_seq_len = SEQ, .max_tokens_per_step = 512, .mem_fraction = 0.9};
    cuda_runner_opts o = {.world = 1, .quiet = 1};
    const int experts = m->cfg.n_experts, used = m->cfg.n_experts_used;
    m->cfg.n_experts = 513;
    err[0] = 0;
    assert_null(runner_cuda_create_ex(m, NULL, &cfg, &o, err, sizeof err));
    assert_non_null(strstr(err, "at most 512 experts"));
    m->cfg.n_experts = experts;
    m->cfg.n_experts_used = 17;
    err[0] = 0;
    assert_null(runner_cuda_create_ex(m, NULL, &cfg, &o, err, sizeof err));
    assert_non_null(strstr(err, "16 per token"));
    m->cfg.n_experts_used = used;
    runner *r = runner_cuda_create_ex(m, NULL, &cfg, &o, err, sizeof err);   /* as loaded: accepted */
    if (!r) fail_msg("runner_cuda_create: %s", err);
    runner_destroy(r);
    model_free(m);
}

/* An odd max_batch puts the decode step's sampling parameters (8-byte seed and counter)
 * after 12 * max_batch bytes of token rows: they must still be aligned (--max-batch 1
 * failed with "misaligned address" in k_sample until the offset was rounded up). */
static void test_odd_max_batch_decodes_the_golden_tokens(void **s) {
    (void)s;
    for (int mb = 1; mb <= 3; mb += 2) {
        g_max_batch = mb;
        run_golden("llama-tiny");
        run_golden("qwen3moe-tiny");
    }
    g_max_batch = MAXB;
}
static void test_golden_qwen3moe_tiny(void **s) { (void)s; run_golden("qwen3moe-tiny"); }
static void test_golden_mixtral_tiny(void **s) { (void)s; run_golden("mixtral-tiny"); }

/* All prompts in one forward (6 rows), then a padded batched decode (6 rows -> graph 8).
 * async: each decode is queued while the one before is still pending, its rows in the
 * other order and fed from the pending step's outputs on the device (prev_row; the host
 * tokens it passes are invalid ids, so reading them would fail), waited one step late. */
static void run_batched(const char *name, int no_graphs, int async) {
    fixture f;
    fixture_open(&f, name, no_graphs);
    golden *g = &f.g;
    int n = g->n_prompts, tok_total = 0;
    runner_row rows[8];
    int32_t *tokens = malloc(sizeof(int32_t) * 512);
    for (int p = 0; p < n; p++) {
        slot_reset(f.r, p);
        rows[p] = (runner_row){.slot = p, .n_new = g->len[p], .tok_off = tok_total, .n_logits = 1,
                               .logits_off = p};
        memcpy(tokens + tok_total, g->prompt[p], sizeof(int32_t) * (size_t)g->len[p]);
        tok_total += g->len[p];
    }
    assert_true(tok_total <= 512);
    float *logits = malloc(sizeof(float) * (size_t)f.vocab * n);
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = n, .rows = rows, .tokens = tokens,
                      .n_tokens = tok_total, .logits = logits};
    int rc = runner_forward(f.r, &b);
    if (rc) fail_msg("batched forward: %d %s", rc, cuda_runner_error(f.r));
    int got[8][64], slots[8];
    double worst = 0;
    for (int p = 0; p < n; p++) {
        double e = rel_err(logits + (size_t)p * f.vocab, g->last[p], f.vocab);
        if (e > worst) worst = e;
        if (e > REL_TOL) fail_msg("%s batched row %d: rel err %.3e", name, p, e);
        got[p][0] = argmax(logits + (size_t)p * f.vocab, f.vocab);
        slots[p] = p;
    }
    int steps = g->n_greedy[0];
    static int32_t aout[64][8];
    static int order[64][8];
    assert_true(steps <= 64);
    for (int j = 1; j < steps; j++) {
        int32_t in[8], out[8];
        runner_sampling sp[8] = {{0}};
        if (async) {
            int prev[8], sl[8];
            for (int i = 0; i < n; i++) {
                const int p = j % 2 ? i : n - 1 - i;
                order[j][i] = sl[i] = p;
                in[i] = j == 1 ? got[p][0] : -5;
                prev[i] = -1;
                for (int k = 0; j > 1 && k < n; k++)
                    if (order[j - 1][k] == p) prev[i] = k;
            }
            runner_decode_batch d = {.n = n, .slots = sl, .tokens = in, .sp = sp, .out_tokens = aout[j],
                                     .async = 1, .prev_row = j > 1 ? prev : NULL};
            rc = f.r->ops->decode(f.r, &d);
            if (rc) fail_msg("async decode: %d %s", rc, cuda_runner_error(f.r));
            /* the mirror moves when a step is queued */
            assert_int_equal(f.r->ops->slot_get_len(f.r, 0, RUNNER_TARGET), g->len[0] + j);
            if (j == 1) continue;
            if ((rc = f.r->ops->wait_queued(f.r))) fail_msg("wait_queued: %d %s", rc, cuda_runner_error(f.r));
            for (int i = 0; i < n; i++) got[order[j - 1][i]][j - 1] = aout[j - 1][i];
            continue;
        }
        for (int p = 0; p < n; p++) in[p] = got[p][j - 1];
        runner_decode_batch d = {.n = n, .slots = slots, .tokens = in, .sp = sp, .out_tokens = out};
        rc = f.r->ops->decode(f.r, &d);
        if (rc) fail_msg("batched decode: %d %s", rc, cuda_runner_error(f.r));
        for (int p = 0; p < n; p++) got[p][j] = out[p];
    }
    if (async && steps > 1) {
        if ((rc = f.r->ops->wait_queued(f.r))) fail_msg("wait_queued: %d %s", rc, cuda_runner_error(f.r));
        for (int i = 0; i < n; i++) got[order[steps - 1][i]][steps - 1] = aout[steps - 1][i];
        assert_int_equal(f.r->ops->wait_queued(f.r), 0);   /* nothing left */
    }
    int compared = 0;
    for (int p = 0; p < n; p++) {
        compared += compare_greedy(g, p, got[p], steps,
                                   (f.m->cfg.n_experts ? MOE_MARGIN : REL_TOL) * max_abs(g->last[p], f.vocab));
        assert_int_equal(dev_len(f.r, p, RUNNER_TARGET), g->len[p] + steps - 1);
    }
    assert_int_equal(dev_len(f.r, MAXB, RUNNER_TARGET), 0);
    printf("    %-12s batched %s%s: max rel err %.3e, %d greedy steps compared\n", name,
           no_graphs ? "eager" : "graph", async ? ", async" : "", worst, compared);
    assert_true(compared > 0);
    free(tokens);
    free(logits);
    fixture_close(&f);
}

static void test_batched_padded_decode_matches_reference(void **s) {
    (void)s;
    run_batched("llama-tiny", 0, 0);
    run_batched("qwen3-tiny", 0, 0);
    run_batched("qwen2-tiny", 1, 0);
    run_batched("gemma3-tiny", 0, 0);
    run_batched("mistral-swa-tiny", 1, 0);
    run_batched("qwen3moe-tiny", 0, 0);   /* routing inside the captured graph, dummy rows included */
    run_batched("mixtral-tiny", 1, 0);
    run_batched("llama-tiny", 0, 1);      /* async decodes, graphs and eager */
    run_batched("qwen3-tiny", 1, 1);
}

/* Async ops chained on the device (async scheduling): a decode of two rows, then a forward
 * of those rows' next tokens (fed from the pending decode's outputs) beside a third row's
 * whole prompt, then a decode of all three fed from the forward's sampled rows, each
 * queued before the one before is waited for. Greedy; the same steps run one at a time
 * with the tokens through the host must give the same tokens and lengths. */
static void run_chain(const char *name, int async, int32_t out[3][3], int lens[3]) {
    fixture f;
    fixture_open(&f, name, 0);
    golden *g = &f.g;
    float *logits = malloc(sizeof(float) * (size_t)f.vocab);
    int32_t first[2];
    for (int s = 0; s < 3; s++) slot_reset(f.r, s);
    for (int s = 0; s < 2; s++) {
        prefill(&f, s, g->prompt[4 + s], g->len[4 + s], 1, logits);
        first[s] = argmax(logits, f.vocab);
    }
    runner_sampling sp[MAXB] = {{0}};
    int slots2[2] = {0, 1}, slots3[3] = {0, 1, 2}, prev2[2] = {0, 1};
    static int32_t a_out[2], b_out[3], c_out[3];
    runner_decode_batch a = {.n = 2, .slots = slots2, .tokens = first, .sp = sp, .out_tokens = a_out,
                             .async = async};
    assert_int_equal(f.r->ops->decode(f.r, &a), 0);
    /* b: rows 0 and 1 decode (their token from a), row 2 its whole prompt (3 logits rows) */
    const int p2 = g->len[3];
    int32_t *tok = calloc((size_t)p2 + 2, sizeof(int32_t));
    int prev_tok[64];
    assert_true(p2 + 2 <= 64);
    if (!async) {
        assert_int_equal(f.r->ops->wait_queued(f.r), 0);
        tok[0] = a_out[0];
        tok[1] = a_out[1];
    }
    memcpy(tok + 2, g->prompt[3], (size_t)p2 * sizeof(int32_t));
    for (int t = 0; t < p2 + 2; t++) prev_tok[t] = async && t < 2 ? prev2[t] : -1;
    runner_row rows[3] = {{.slot = 0, .n_new = 1, .tok_off = 0, .n_logits = 1, .logits_off = 0},
                          {.slot = 1, .n_new = 1, .tok_off = 1, .n_logits = 1, .logits_off = 1},
                          {.slot = 2, .n_new = p2, .tok_off = 2, .n_logits = 1, .logits_off = 2}};
    float *scratch = malloc(sizeof(float) * 3 * (size_t)f.vocab);   /* (the runner's logits rows) */
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = 3, .rows = rows, .tokens = tok, .n_tokens = p2 + 2,
                      .logits = scratch, .sp = sp, .out_tokens = b_out, .async = async,
                      .prev_tok = async ? prev_tok : NULL};
    int rc = runner_forward(f.r, &b);
    if (rc) fail_msg("forward (async %d): %d %s", async, rc, cuda_runner_error(f.r));
    if (async) assert_int_equal(f.r->ops->wait_queued(f.r), 0);   /* a's outputs */
    int32_t c_in[3] = {0, 0, 0};
    int prev3[3] = {0, 1, 2};
    if (!async) memcpy(c_in, b_out, sizeof c_in);
    runner_decode_batch c = {.n = 3, .slots = slots3, .tokens = c_in, .sp = sp, .out_tokens = c_out, .async = async,
                             .prev_row = async ? prev3 : NULL};
    if ((rc = f.r->ops->decode(f.r, &c))) fail_msg("decode (async %d): %d %s", async, rc, cuda_runner_error(f.r));
    if (async) {
        assert_int_equal(f.r->ops->wait_queued(f.r), 0);   /* b's */
        assert_int_equal(f.r->ops->wait_queued(f.r), 0);   /* c's */
    }
    for (int i = 0; i < 3; i++) {
        out[0][i] = i < 2 ? a_out[i] : -1;
        out[1][i] = b_out[i];
        out[2][i] = c_out[i];
        lens[i] = dev_len(f.r, i, RUNNER_TARGET);
    }
    free(tok);
    free(scratch);
    free(logits);
    fixture_close(&f);
}

static void test_async_ops_chain_on_the_device(void **s) {
    (void)s;
    const char *names[] = {"llama-tiny", "qwen3-tiny"};
    for (int m = 0; m < 2; m++) {
        int32_t sync_out[3][3], async_out[3][3];
        int sync_len[3], async_len[3];
        run_chain(names[m], 0, sync_out, sync_len);
        run_chain(names[m], 1, async_out, async_len);
        assert_memory_equal(sync_out, async_out, sizeof sync_out);
        assert_memory_equal(sync_len, async_len, sizeof sync_len);
        printf("    %-10s decode -> forward (2 decode rows fed on the device + a prompt) -> decode, queued: "
               "tokens %d %d / %d %d %d / %d %d %d as one at a time; lengths %d %d %d\n", names[m],
               async_out[0][0], async_out[0][1], async_out[1][0], async_out[1][1], async_out[1][2], async_out[2][0],
               async_out[2][1], async_out[2][2], async_len[0], async_len[1], async_len[2]);
    }
}

/* Sampling inside the forward pass (runner_batch.sp): all golden prompts in one eager
 * forward, greedy, must give the argmax of the logits the same forward returns without it
 * (same slots refilled), and a temperature draw must be a token the logits allow
 * (top_k 1 makes it the argmax too). */
static void test_forward_sampling_matches_returned_logits(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "llama-tiny", 0);
    assert_int_equal(f.r->forward_samples, 1);
    golden *g = &f.g;
    int n = g->n_prompts, tok_total = 0;
    runner_row rows[8];
    int32_t *tokens = malloc(sizeof(int32_t) * 512), out[8];
    float lp[8];
    float *logits = malloc(sizeof(float) * (size_t)f.vocab * n);
    for (int p = 0; p < n; p++) {
        rows[p] = (runner_row){.slot = p, .n_new = g->len[p], .tok_off = tok_total, .n_logits = 1, .logits_off = p};
        memcpy(tokens + tok_total, g->prompt[p], sizeof(int32_t) * (size_t)g->len[p]);
        tok_total += g->len[p];
    }
    for (int pass = 0; pass < 3; pass++) {
        for (int p = 0; p < n; p++) slot_reset(f.r, p);
        runner_sampling sp[8];
        for (int p = 0; p < n; p++)   /* pass 1: greedy; pass 2: T = 0.8 but top_k 1 */
            sp[p] = (runner_sampling){.temperature = pass == 2 ? 0.8f : 0.f, .top_p = 1.f, .top_k = pass == 2 ? 1 : 0,
                                      .seed = 7 + (uint64_t)p, .counter = 3};
        for (int p = 0; p < n; p++) out[p] = -1;
        runner_batch b = {.which = RUNNER_TARGET, .n_rows = n, .rows = rows, .tokens = tokens, .n_tokens = tok_total,
                          .logits = logits, .sp = pass ? sp : NULL, .out_tokens = pass ? out : NULL,
                          .out_logprobs = pass ? lp : NULL};
        int rc = runner_forward(f.r, &b);
        if (rc) fail_msg("forward (pass %d): %d %s", pass, rc, cuda_runner_error(f.r));
        for (int p = 0; pass && p < n; p++) {
            int want = argmax(logits + (size_t)p * f.vocab, f.vocab);   /* from pass 0 */
            if (out[p] != want) fail_msg("pass %d row %d: sampled %d, argmax %d", pass, p, out[p], want);
            /* the chosen token's log softmax, from the logits pass 0 returned */
            const float *lg = logits + (size_t)p * f.vocab;
            double mx = lg[0], z = 0;
            for (int v = 1; v < f.vocab; v++) mx = lg[v] > mx ? lg[v] : mx;
            for (int v = 0; v < f.vocab; v++) z += exp(lg[v] - mx);
            double ref = lg[want] - mx - log(z);
            if (fabs(lp[p] - ref) > 1e-4) fail_msg("pass %d row %d: logprob %.6f, host %.6f", pass, p, lp[p], ref);
        }
        for (int p = 0; p < n; p++) assert_int_equal(dev_len(f.r, p, RUNNER_TARGET), g->len[p]);
    }
    printf("    forward sampling: %d rows, greedy and top_k 1 equal the logits' argmax, logprobs within 1e-4\n", n);
    free(tokens);
    free(logits);
    fixture_close(&f);
}

/* Prompt logprobs in the runner (runner.forced_tokens; switched on here for the test):
 * every position of every golden prompt a logits row, all but the last forced to the next
 * prompt token with 5 top logprobs, the last sampled greedily; against a pass that returns
 * the logits: forced tokens as given, ranks equal to sample_rank, logprobs and top
 * logprobs those of the logits (ids equal, within 1e-4), the last rows the argmax. */
static void test_prompt_logprobs_forced_match_host(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "llama-tiny", 0);
    f.r->forced_tokens = 1;
    golden *g = &f.g;
    const int n = g->n_prompts, V = f.vocab;
    int tok_total = 0;
    for (int p = 0; p < n; p++) tok_total += g->len[p];
    runner_row rows[8];
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)tok_total), *out = malloc(sizeof(int32_t) * (size_t)tok_total);
    int32_t *rank = malloc(sizeof(int32_t) * (size_t)tok_total), *top = malloc(sizeof(int32_t) * (size_t)tok_total * RUNNER_MAX_TOP);
    float *lp = malloc(sizeof(float) * (size_t)tok_total), *tlp = malloc(sizeof(float) * (size_t)tok_total * RUNNER_MAX_TOP);
    float *logits = malloc(sizeof(float) * (size_t)V * tok_total);
    runner_sampling *sp = calloc((size_t)tok_total, sizeof *sp);
    for (int p = 0, t = 0; p < n; p++) {
        rows[p] = (runner_row){.slot = p, .n_new = g->len[p], .tok_off = t, .n_logits = g->len[p], .logits_off = t};
        memcpy(tokens + t, g->prompt[p], sizeof(int32_t) * (size_t)g->len[p]);
        for (int j = 0; j + 1 < g->len[p]; j++)
            sp[t + j] = (runner_sampling){.force = 1, .force_token = g->prompt[p][j + 1], .n_top = 5};
        t += g->len[p];
    }
    for (int pass = 0; pass < 2; pass++) {   /* 0: the logits; 1: sampled, forced rows */
        for (int p = 0; p < n; p++) slot_reset(f.r, p);
        runner_batch b = {.which = RUNNER_TARGET, .n_rows = n, .rows = rows, .tokens = tokens, .n_tokens = tok_total,
                          .logits = logits};
        if (pass)
            b.sp = sp, b.out_tokens = out, b.out_logprobs = lp, b.out_top_ids = top, b.out_top_logprobs = tlp,
            b.out_ranks = rank;
        int rc = runner_forward(f.r, &b);
        if (rc) fail_msg("forward (pass %d): %d %s", pass, rc, cuda_runner_error(f.r));
    }
    double err = 0;
    int forced = 0;
    for (int i = 0; i < tok_total; i++) {
        const float *lg = logits + (size_t)i * V;
        if (!sp[i].force) {
            assert_int_equal(out[i], argmax(lg, V));
            continue;
        }
        forced++;
        assert_int_equal(out[i], sp[i].force_token);
        assert_int_equal(rank[i], sample_rank(lg, V, sp[i].force_token));
        err = fmax(err, fabs(lp[i] - sample_logprob(lg, V, sp[i].force_token)));
        int32_t ids[RUNNER_MAX_TOP];
        float lps[RUNNER_MAX_TOP];
        sample_top_logprobs(lg, V, 5, ids, lps);
        for (int j = 0; j < 5; j++) {
            assert_int_equal(top[(size_t)i * RUNNER_MAX_TOP + j], ids[j]);
            err = fmax(err, fabs(tlp[(size_t)i * RUNNER_MAX_TOP + j] - lps[j]));
        }
    }
    printf("    prompt logprobs as forced rows: %d positions, ranks and top ids equal, max logprob abs err %.2e\n",
           forced, err);
    assert_true(err < 1e-4);
    free(tokens), free(out), free(rank), free(top), free(lp), free(tlp), free(logits), free(sp);
    fixture_close(&f);
}

/* ---- logit adjustments and top logprobs in the runner's sampling -------------------------- */

/* Forward sampling with adjustments (eager; an identical pass without sp returns the
 * reference logits): greedy rows with logit bias (an id repeated), a suppressed argmax and
 * penalties over statistics lists long enough to grow the runner's adjustment buffers
 * pick the token engine/core/sample.c picks from those logits; the logprob and the top
 * logprobs are the raw logits' (ids equal, logprobs within 1e-4). */
static void test_forward_sampling_adjustments_match_host(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "llama-tiny", 0);
    assert_int_equal(f.r->sample_adjusts, 1);
    golden *g = &f.g;
    const int n = g->n_prompts, V = f.vocab, NST = 600;
    int tok_total = 0;
    runner_row rows[8];
    int32_t *tokens = malloc(sizeof(int32_t) * 512), out[8], top[8 * RUNNER_MAX_TOP];
    float lp[8], tlp[8 * RUNNER_MAX_TOP], *logits = malloc(sizeof(float) * (size_t)V * n), *adj = malloc(sizeof(float) * V);
    for (int p = 0; p < n; p++) {
        rows[p] = (runner_row){.slot = p, .n_new = g->len[p], .tok_off = tok_total, .n_logits = 1, .logits_off = p};
        memcpy(tokens + tok_total, g->prompt[p], sizeof(int32_t) * (size_t)g->len[p]);
        tok_total += g->len[p];
    }
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = n, .rows = rows, .tokens = tokens, .n_tokens = tok_total,
                      .logits = logits};
    for (int p = 0; p < n; p++) slot_reset(f.r, p);
    if (runner_forward(f.r, &b)) fail_msg("forward: %s", cuda_runner_error(f.r));
    static int32_t bias_ids[8][3], sup[8][1], st_ids[8][600], st_cnt[8][600];
    static float bias_vals[8][3];
    runner_sampling sp[8];
    for (int p = 0; p < n; p++) {
        const float *lg = logits + (size_t)p * V;
        int am = argmax(lg, V);
        bias_ids[p][0] = am, bias_ids[p][1] = (am + 5) % V, bias_ids[p][2] = am;
        bias_vals[p][0] = -0.75f, bias_vals[p][1] = 0.5f + 0.25f * (float)p, bias_vals[p][2] = -0.5f;
        sup[p][0] = (am + 1 + p) % V;
        for (int j = 0; j < NST; j++) st_ids[p][j] = (int32_t)((p + 3 * j) % V), st_cnt[p][j] = j % 3;
        sp[p] = (runner_sampling){.top_p = 1.f, .n_logit_bias = 3, .logit_bias_ids = bias_ids[p],
                                  .logit_bias_vals = bias_vals[p], .n_suppress = p % 2, .suppress_ids = sup[p],
                                  .presence_penalty = 0.4f, .frequency_penalty = 0.3f,
                                  .repetition_penalty = p % 2 ? 1.25f : 0.9f, .n_stats = NST, .stat_ids = st_ids[p],
                                  .stat_counts = st_cnt[p], .n_top = p % 2 ? 5 : RUNNER_MAX_TOP};
    }
    for (int p = 0; p < n; p++) slot_reset(f.r, p);
    b.sp = sp;
    b.out_tokens = out;
    b.out_logprobs = lp;
    b.out_top_ids = top;
    b.out_top_logprobs = tlp;
    if (runner_forward(f.r, &b)) fail_msg("forward with sampling: %s", cuda_runner_error(f.r));
    double worst = 0;
    int moved = 0;
    for (int p = 0; p < n; p++) {
        const float *lg = logits + (size_t)p * V;
        memcpy(adj, lg, sizeof(float) * V);
        sample_params hp = {.presence_penalty = sp[p].presence_penalty, .frequency_penalty = sp[p].frequency_penalty,
                            .repetition_penalty = sp[p].repetition_penalty, .n_logit_bias = 3,
                            .logit_bias_ids = bias_ids[p], .logit_bias_vals = bias_vals[p],
                            .suppress_eos = sp[p].n_suppress, .eos_ids = sup[p], .n_eos = sp[p].n_suppress};
        sample_apply_penalties_sparse(adj, V, &hp, st_ids[p], st_cnt[p], NST);
        int want = sample_argmax(adj, V);
        if (out[p] != want) fail_msg("row %d: sampled %d, host %d", p, out[p], want);
        moved += want != argmax(lg, V);
        worst = fmax(worst, fabs(lp[p] - sample_logprob(lg, V, out[p])));
        int32_t ids[RUNNER_MAX_TOP];
        float lps[RUNNER_MAX_TOP];
        int k = sample_top_logprobs(lg, V, sp[p].n_top, ids, lps);
        for (int j = 0; j < k; j++) {
            if (top[p * RUNNER_MAX_TOP + j] != ids[j])
                fail_msg("row %d top %d: %d, host %d", p, j, top[p * RUNNER_MAX_TOP + j], ids[j]);
            worst = fmax(worst, fabs(tlp[p * RUNNER_MAX_TOP + j] - lps[j]));
        }
    }
    printf("    forward sampling with adjustments: %d rows equal the host sampler (%d moved off the argmax), "
           "raw logprobs and top logprobs within %.1e\n", n, moved, worst);
    assert_true(moved > 0);
    assert_true(worst < 1e-4);
    free(tokens);
    free(logits);
    free(adj);
    fixture_close(&f);
}

/* The decode graph with adjustments: eight twin rows (one prompt in every slot) replay a
 * step twice (lengths rolled back). The first replay, plain, gives the raw top tokens T;
 * in the second each row's adjustments decide its token among T whatever rounding
 * separates the twins: a large bias, a repeated bias id, suppression after a bias,
 * frequency and presence penalties (count 0 spared), a repetition penalty, and
 * statistics over the whole vocabulary (which grow the adjustment buffers) on greedy and
 * sampled rows. Row 0 replays exactly; every row reports raw logprobs. */
static void test_decode_graph_adjustments_decide_tokens(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "llama-tiny", 0);
    runner *r = f.r;
    golden *g = &f.g;
    const int V = f.vocab, N = MAXB, L = g->len[0];
    float *logits = malloc(sizeof(float) * V);
    int slots[MAXB];
    int32_t in[MAXB], out[MAXB], top[MAXB * RUNNER_MAX_TOP], T[RUNNER_MAX_TOP];
    float lp[MAXB], tlp[MAXB * RUNNER_MAX_TOP], TL[RUNNER_MAX_TOP];
    for (int i = 0; i < N; i++) {
        slots[i] = i;
        slot_reset(r, i);
        prefill(&f, i, g->prompt[0], L, 1, logits);
        in[i] = argmax(logits, V);
    }
    runner_sampling sp[MAXB];
    for (int i = 0; i < N; i++) sp[i] = (runner_sampling){.top_p = 1.f, .n_top = RUNNER_MAX_TOP};
    runner_decode_batch d = {.n = N, .slots = slots, .tokens = in, .sp = sp, .out_tokens = out, .out_logprobs = lp,
                             .out_top_ids = top, .out_top_logprobs = tlp};
    if (r->ops->decode(r, &d)) fail_msg("decode: %s", cuda_runner_error(r));
    memcpy(T, top, sizeof T);
    memcpy(TL, tlp, sizeof TL);
    assert_int_equal(out[0], T[0]);
    for (int j = 1; j < RUNNER_MAX_TOP; j++) assert_true(TL[j] <= TL[j - 1]);
    /* the adjustments of replay 2, in terms of T */
    static int32_t b_ids[MAXB][3], sup[2], st_ids[MAXB][1024], st_cnt[MAXB][1024];
    static float b_vals[MAXB][3];
    /* a repeated bias id: T3 twice (+1000 each) beats T4 (+1500) only if both apply */
    sp[1].n_logit_bias = 3, b_ids[1][0] = T[3], b_ids[1][1] = T[4], b_ids[1][2] = T[3];
    b_vals[1][0] = 1000.f, b_vals[1][1] = 1500.f, b_vals[1][2] = 1000.f;                      /* -> T3 */
    sp[2].n_logit_bias = 2, b_ids[2][0] = T[0], b_ids[2][1] = T[5], b_vals[2][0] = b_vals[2][1] = 1000.f;
    sp[2].n_suppress = 2, sup[0] = sup[1] = T[0];                                              /* -> T5 */
    sp[3].n_logit_bias = 3, b_ids[3][0] = T[0], b_ids[3][1] = T[1], b_ids[3][2] = T[4];
    b_vals[3][0] = b_vals[3][1] = b_vals[3][2] = 1000.f;
    sp[3].frequency_penalty = 1000.f, sp[3].n_stats = 2;
    st_ids[3][0] = T[0], st_cnt[3][0] = 1, st_ids[3][1] = T[1], st_cnt[3][1] = 2;              /* -> T4 */
    sp[4].n_logit_bias = 2, b_ids[4][0] = T[0], b_ids[4][1] = T[1], b_vals[4][0] = b_vals[4][1] = 1000.f;
    sp[4].presence_penalty = 1000.f, sp[4].n_stats = 2;
    st_ids[4][0] = T[0], st_cnt[4][0] = 1, st_ids[4][1] = T[1], st_cnt[4][1] = 0;              /* -> T1 */
    const int spare[MAXB] = {0, 0, 0, 0, 0, 6, 7, 2};
    for (int i = 5; i < N; i++) {   /* statistics over every id but one */
        int m = 0;
        for (int v = 0; v < V; v++)
            if (v != T[spare[i]]) st_ids[i][m] = v, st_cnt[i][m++] = i == 6 ? 0 : 1;
        sp[i].n_stats = m;
        if (i == 6) sp[i].repetition_penalty = 1e4f;
        else sp[i].frequency_penalty = 1000.f;
    }
    sp[6].n_logit_bias = 2, b_ids[6][0] = T[0], b_ids[6][1] = T[7], b_vals[6][0] = b_vals[6][1] = 50.f;
    sp[7].temperature = 0.8f, sp[7].top_p = 0.9f, sp[7].seed = 99, sp[7].counter = 4;
    /* -> T6 (frequency), T7 (repetition: T0's +50 shrinks to 0.005), T2 (sampled) */
    sp[0].n_logit_bias = 0;
    for (int i = 1; i < N; i++) {
        sp[i].logit_bias_ids = b_ids[i];
        sp[i].logit_bias_vals = b_vals[i];
        sp[i].suppress_ids = sup;
        sp[i].stat_ids = st_ids[i];
        sp[i].stat_counts = st_cnt[i];
    }
    for (int i = 0; i < N; i++) assert_int_equal(r->ops->slot_set_len(r, i, RUNNER_TARGET, L), 0);
    if (r->ops->decode(r, &d)) fail_msg("decode with adjustments: %s", cuda_runner_error(r));
    const int want[MAXB] = {0, 3, 5, 4, 1, 6, 7, 2};
    double worst = 0;
    assert_memory_equal(top, T, sizeof T);   /* row 0: the same replay, bit for bit */
    assert_memory_equal(tlp, TL, sizeof TL);
    for (int i = 0; i < N; i++) {
        if (out[i] != T[want[i]]) fail_msg("row %d: token %d, want T%d = %d", i, out[i], want[i], T[want[i]]);
        worst = fmax(worst, fabs(lp[i] - TL[want[i]]));   /* raw, not adjusted by ~1000 */
        worst = fmax(worst, fabs(tlp[i * RUNNER_MAX_TOP] - TL[0]));
        assert_int_equal(dev_len(r, i, RUNNER_TARGET), L + 1);
    }
    printf("    decode graph with adjustments: 8 twin rows pick T0,T3,T5,T4,T1,T6,T7,T2 as adjusted; raw logprobs "
           "within %.1e of row 0's\n", worst);
    assert_true(worst < 2e-2);
    free(logits);
    fixture_close(&f);
}

/* Grammar masks in the decode op (runner.decode_masks): twin rows, masks given by the
 * prepare_sp callback once the pass is enqueued (the engine's way), pick the best allowed
 * token of the unmasked replay's top list; a row without a mask is unchanged; padding rows
 * (5 live rows in the graph of 8, then 3 in the graph of 4, then eager beyond the graphs
 * is not reachable with MAXB) leave the dummy slot at length 0. */
typedef struct {
    runner_sampling *sp;
    uint32_t *masks;
    size_t mw;
    int calls;
} mask_cb;

static int set_masks(void *ctx) {
    mask_cb *c = ctx;
    c->calls++;
    for (int i = 1; i < 5; i++) c->sp[i].mask = c->masks + (size_t)i * c->mw;
    return 0;
}

static void test_decode_graph_masks_decide_tokens(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "llama-tiny", 0);
    runner *r = f.r;
    golden *g = &f.g;
    const int V = f.vocab, L = g->len[0];
    const size_t mw = ((size_t)V + 31) / 32;
    assert_true(r->decode_masks);
    float *logits = malloc(sizeof(float) * V);
    uint32_t *masks = calloc((size_t)MAXB * mw, 4);
    int slots[MAXB];
    int32_t in[MAXB], out[MAXB], top[MAXB * RUNNER_MAX_TOP], T[RUNNER_MAX_TOP];
    float tlp[MAXB * RUNNER_MAX_TOP];
    for (int i = 0; i < MAXB; i++) {
        slots[i] = i;
        slot_reset(r, i);
        prefill(&f, i, g->prompt[0], L, 1, logits);
        in[i] = argmax(logits, V);
    }
    runner_sampling sp[MAXB];
    for (int i = 0; i < MAXB; i++) sp[i] = (runner_sampling){.top_p = 1.f, .n_top = i == 0 ? RUNNER_MAX_TOP : 0};
    runner_decode_batch d = {.n = 5, .slots = slots, .tokens = in, .sp = sp, .out_tokens = out,
                             .out_top_ids = top, .out_top_logprobs = tlp};
    if (r->ops->decode(r, &d)) fail_msg("decode: %s", cuda_runner_error(r));
    memcpy(T, top, sizeof T);
    assert_int_equal(out[0], T[0]);
#define ALLOW(row, tok) (masks[(size_t)(row) * mw + (size_t)(tok) / 32] |= 1u << ((tok) % 32))
    ALLOW(1, T[3]);                                        /* -> T3 */
    ALLOW(2, T[5]), ALLOW(2, T[2]);                        /* -> T2, the better of the two */
    for (int v = 0; v < V; v++)
        if (v != T[0]) ALLOW(3, v);                        /* -> T1 */
    ALLOW(4, T[6]);                                        /* sampled, one token allowed -> T6 */
#undef ALLOW
    sp[4].temperature = 1.5f, sp[4].seed = 7, sp[4].counter = 3;
    mask_cb cb = {sp, masks, mw, 0};
    d.prepare_sp = set_masks, d.prepare_ctx = &cb;
    for (int round = 0; round < 2; round++) {   /* the second replays the captured halves */
        for (int i = 0; i < MAXB; i++) assert_int_equal(r->ops->slot_set_len(r, i, RUNNER_TARGET, L), 0);
        for (int i = 1; i < 5; i++) sp[i].mask = NULL;
        if (r->ops->decode(r, &d)) fail_msg("masked decode: %s", cuda_runner_error(r));
        assert_int_equal(cb.calls, round + 1);
        const int want[5] = {0, 3, 2, 1, 6};
        for (int i = 0; i < 5; i++) {
            if (out[i] != T[want[i]]) fail_msg("round %d row %d: token %d, want T%d = %d", round, i, out[i], want[i], T[want[i]]);
            assert_int_equal(dev_len(r, i, RUNNER_TARGET), L + 1);
        }
        assert_memory_equal(top, T, sizeof T);   /* the unmasked row: the same replay */
        assert_int_equal(dev_len(r, MAXB, RUNNER_TARGET), 0);
    }
    /* three rows (graph of 4), masks already in sp, no callback */
    for (int i = 0; i < MAXB; i++) assert_int_equal(r->ops->slot_set_len(r, i, RUNNER_TARGET, L), 0);
    d.n = 3, d.prepare_sp = NULL;
    if (r->ops->decode(r, &d)) fail_msg("masked decode of 3: %s", cuda_runner_error(r));
    assert_int_equal(out[0], T[0]);
    assert_int_equal(out[1], T[3]);
    assert_int_equal(out[2], T[2]);
    assert_int_equal(dev_len(r, MAXB, RUNNER_TARGET), 0);
    /* and the plain graph after them: unmasked rows back to the argmax */
    for (int i = 0; i < MAXB; i++) {
        assert_int_equal(r->ops->slot_set_len(r, i, RUNNER_TARGET, L), 0);
        sp[i] = (runner_sampling){.top_p = 1.f};
    }
    d.n = MAXB, d.out_top_ids = NULL, d.out_top_logprobs = NULL;
    if (r->ops->decode(r, &d)) fail_msg("plain decode: %s", cuda_runner_error(r));
    for (int i = 0; i < MAXB; i++) assert_int_equal(out[i], T[0]);
    printf("    decode graph with grammar masks: rows pick T0,T3,T2,T1,T6 (graph of 8, twice; of 4), "
           "dummy slot at 0, plain graph unchanged after\n");
    free(masks);
    free(logits);
    fixture_close(&f);
}

/* Constrained rows queued in flight (runner.async_masks, which the engine turns on once
 * this test has passed): a chain of three ops, each fed on the device by the one before
 * (prev_row / prev_tok), the second a decode and the third a forward, both with a mask
 * callback that first calls wait_queued for the op before it (as the engine's
 * prepare_masks_async does, to advance each row's grammar past that op's token) and then
 * sets the masks. The masks keep ids = row (mod 7) (row 0 unmasked), so each masked
 * greedy row takes the best such id. Tokens, the callbacks' view of the op before, and
 * the lengths must equal the same chain run one op at a time. */
typedef struct {
    runner *r;
    runner_sampling *sp;
    uint32_t *masks;
    const int32_t *prev_out;   /* the op before's outputs: in after the callback's wait */
    int32_t seen[MAXB];        /* what the callback saw there */
    int async, calls;
} chain_cb;

static int chain_masks(void *ctx) {
    chain_cb *c = ctx;
    c->calls++;
    if (c->async && c->r->ops->wait_queued(c->r)) return -1;
    memcpy(c->seen, c->prev_out, sizeof c->seen);
    const size_t mw = ((size_t)c->r->vocab + 31) / 32;
    for (int i = 1; i < 5; i++) c->sp[i].mask = c->masks + (size_t)i * mw;
    return 0;
}

/* The start of the async chains below: slots 0..4 (also each row's prev_row / prev_tok
 * index) prefilled with the golden prompts in turn, in[i] the greedy token after slot i's. */
static void chain_start(fixture *f, int slots[5], int prev[5], int32_t in[5], float *logits) {
    const golden *g = &f->g;
    for (int i = 0; i < 5; i++) {
        slots[i] = i;
        prev[i] = i;
        slot_reset(f->r, i);
        prefill(f, i, g->prompt[i % g->n_prompts], g->len[i % g->n_prompts], 1, logits);
        in[i] = argmax(logits, f->vocab);
    }
}

static void masked_chain(fixture *f, int async, int32_t out[3][MAXB], int32_t seen[2][MAXB], int lens[MAXB]) {
    runner *r = f->r;
    const int V = f->vocab;
    const size_t mw = ((size_t)V + 31) / 32;
    float *logits = malloc(sizeof(float) * (size_t)V * MAXB);
    uint32_t *masks = calloc((size_t)MAXB * mw, 4);
    for (int i = 1; i < 5; i++)
        for (int v = i; v < V; v += 7) masks[(size_t)i * mw + (size_t)v / 32] |= 1u << (v % 32);
    int slots[5], prev[5];
    int32_t in[5], zero[5] = {0};
    chain_start(f, slots, prev, in, logits);
    runner_sampling sp[5];
    for (int i = 0; i < 5; i++) sp[i] = (runner_sampling){.top_p = 1.f};
    memset(out, 0, sizeof(int32_t) * 3 * MAXB);
    /* A: a plain decode */
    runner_decode_batch a = {.n = 5, .slots = slots, .tokens = in, .sp = sp, .out_tokens = out[0], .async = async};
    if (r->ops->decode(r, &a)) fail_msg("A (async %d): %s", async, cuda_runner_error(r));
    if (!async) assert_int_equal(r->ops->wait_queued(r), 0);
    /* B: a decode fed A's tokens, masked through the callback */
    chain_cb cb = {.r = r, .sp = sp, .masks = masks, .prev_out = out[0], .async = async};
    runner_decode_batch b = {.n = 5, .slots = slots, .tokens = async ? zero : out[0], .sp = sp, .out_tokens = out[1],
                             .async = async, .prev_row = async ? prev : NULL, .prepare_sp = chain_masks,
                             .prepare_ctx = &cb};
    if (r->ops->decode(r, &b)) fail_msg("B (async %d): %s", async, cuda_runner_error(r));
    memcpy(seen[0], cb.seen, sizeof cb.seen);
    /* C: a forward of five one-token rows fed B's tokens, masked the same way */
    for (int i = 0; i < 5; i++) sp[i].mask = NULL;
    cb.prev_out = out[1];
    runner_row rows[5];
    for (int i = 0; i < 5; i++) rows[i] = (runner_row){.slot = i, .n_new = 1, .tok_off = i, .n_logits = 1, .logits_off = i};
    runner_batch c = {.which = RUNNER_TARGET, .n_rows = 5, .rows = rows, .tokens = async ? zero : out[1], .n_tokens = 5,
                      .logits = logits, .sp = sp, .out_tokens = out[2], .async = async,
                      .prev_tok = async ? prev : NULL, .prepare_sp = chain_masks, .prepare_ctx = &cb};
    if (runner_forward(r, &c)) fail_msg("C (async %d): %s", async, cuda_runner_error(r));
    memcpy(seen[1], cb.seen, sizeof cb.seen);
    if (async) assert_int_equal(r->ops->wait_queued(r), 0);   /* C's (A's and B's were taken in the callbacks) */
    assert_int_equal(r->ops->wait_queued(r), 0);               /* nothing left */
    assert_int_equal(cb.calls, 2);
    for (int i = 0; i < 5; i++) lens[i] = dev_len(r, i, RUNNER_TARGET);
    free(masks);
    free(logits);
}

static void test_async_masked_decode_waits_in_callback(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "llama-tiny", 0);
    runner *r = f.r;
    const int was = r->async_masks;
    r->async_masks = 1;   /* the path under test, whatever the default */
    int32_t so[3][MAXB], ao[3][MAXB], ss[2][MAXB], as[2][MAXB];
    int sl[MAXB], al[MAXB];
    masked_chain(&f, 0, so, ss, sl);
    masked_chain(&f, 1, ao, as, al);
    r->async_masks = was;
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 5; i++) {
            if (ao[k][i] != so[k][i]) fail_msg("op %c row %d: async %d, one at a time %d", 'A' + k, i, ao[k][i], so[k][i]);
            if (k > 0 && i > 0) assert_int_equal(ao[k][i] % 7, i % 7);   /* the mask decided */
        }
    for (int k = 0; k < 2; k++) assert_memory_equal(as[k], ao[k], 5 * sizeof(int32_t));   /* the callback saw them */
    assert_memory_equal(al, sl, 5 * sizeof(int));
    printf("    async decode / forward with mask callbacks that wait for the op before: tokens "
           "%d %d %d / %d %d %d / %d %d %d ... as one at a time; lengths %d\n", ao[0][0], ao[0][1], ao[0][2],
           ao[1][0], ao[1][1], ao[1][2], ao[2][0], ao[2][1], ao[2][2], al[0]);
    fixture_close(&f);
}

/* runner_sampling.stats_fed through the runner's plumbing (the fed token's device address
 * per row: the decode op's input tokens, the forward's token rows, both fed on the device
 * by the op before): a presence penalty of -100 on nothing but the fed token makes every
 * greedy row repeat the token it was fed, so a decode queued behind a decode, and a
 * forward queued behind that, must each give the tokens of the op before. A wrong address
 * rewards some other token. */
static void test_async_rows_count_the_fed_token(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "llama-tiny", 0);
    runner *r = f.r;
    golden *g = &f.g;
    const int V = f.vocab;
    float *logits = malloc(sizeof(float) * (size_t)V * MAXB);
    int slots[5], prev[5];
    int32_t in[5], zero[5] = {0}, a[5], b[5], c[5];
    chain_start(&f, slots, prev, in, logits);
    runner_sampling plain[5], fed[5];
    for (int i = 0; i < 5; i++) {
        plain[i] = (runner_sampling){.top_p = 1.f};
        fed[i] = (runner_sampling){.top_p = 1.f, .presence_penalty = -100.f, .stats_fed = 1};
    }
    runner_decode_batch da = {.n = 5, .slots = slots, .tokens = in, .sp = plain, .out_tokens = a, .async = 1};
    runner_decode_batch db = {.n = 5, .slots = slots, .tokens = zero, .sp = fed, .out_tokens = b, .async = 1,
                              .prev_row = prev};
    if (r->ops->decode(r, &da) || r->ops->decode(r, &db)) fail_msg("decode: %s", cuda_runner_error(r));
    assert_int_equal(r->ops->wait_queued(r), 0);
    runner_row rows[5];
    for (int i = 0; i < 5; i++) rows[i] = (runner_row){.slot = i, .n_new = 1, .tok_off = i, .n_logits = 1, .logits_off = i};
    runner_batch fc = {.which = RUNNER_TARGET, .n_rows = 5, .rows = rows, .tokens = zero, .n_tokens = 5,
                       .logits = logits, .sp = fed, .out_tokens = c, .async = 1, .prev_tok = prev};
    if (runner_forward(r, &fc)) fail_msg("forward: %s", cuda_runner_error(r));
    assert_int_equal(r->ops->wait_queued(r), 0);
    assert_int_equal(r->ops->wait_queued(r), 0);
    for (int i = 0; i < 5; i++) {
        if (b[i] != a[i] || c[i] != b[i]) fail_msg("row %d: fed %d -> %d (decode), %d -> %d (forward)", i, a[i], b[i], b[i], c[i]);
        assert_int_equal(dev_len(r, i, RUNNER_TARGET), g->len[i % g->n_prompts] + 3);
    }
    printf("    queued decode and forward rows rewarded only for their fed token repeat it: %d %d %d %d %d\n", c[0], c[1],
           c[2], c[3], c[4]);
    free(logits);
    fixture_close(&f);
}

static void test_chunked_prefill_matches_whole_prompt(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "qwen2-tiny", 0);
    golden *g = &f.g;
    int p = g->n_prompts - 1;   /* the longest prompt (250) */
    float *logits = malloc(sizeof(float) * (size_t)f.vocab);
    slot_reset(f.r, 3);
    for (int off = 0; off < g->len[p]; off += 37) {
        int n = g->len[p] - off < 37 ? g->len[p] - off : 37;
        prefill(&f, 3, g->prompt[p] + off, n, off + n == g->len[p], logits);
    }
    double e = rel_err(logits, g->last[p], f.vocab);
    printf("    chunked prefill (37-token chunks of %d): rel err %.3e\n", g->len[p], e);
    assert_true(e < REL_TOL);
    free(logits);
    fixture_close(&f);
}

/* SPECD_CUDA_GEMM_BAND (engine/cuda/cuda_gemm.c): bf16 GEMMs past the band run on
 * cuBLASLt with one plan per shape and band, whatever the token count within it. The
 * 250-token prompt gives the golden logits; prompts of 200 and 230 tokens (the same band
 * of 64, 193-256) make no new plan. Forced on unless the environment sets it. */
static void test_gemm_band_one_plan_per_band(void **s) {
    (void)s;
    const int force = getenv("SPECD_CUDA_GEMM_BAND") == NULL;   /* (read at runner creation) */
    if (force) setenv("SPECD_CUDA_GEMM_BAND", "64", 1);
    fixture f;
    fixture_open(&f, "qwen2-tiny", 0);
    if (force) unsetenv("SPECD_CUDA_GEMM_BAND");
    const cuda_runner *cr = (const cuda_runner *)f.r;
    golden *g = &f.g;
    const int p = g->n_prompts - 1;   /* the longest prompt (250) */
    assert_int_equal(g->len[p], 250);
    float *logits = malloc(sizeof(float) * (size_t)f.vocab);
    slot_reset(f.r, 3);
    prefill(&f, 3, g->prompt[p], g->len[p], 1, logits);
    const double e = rel_err(logits, g->last[p], f.vocab);
    const long plans = cr->gemm_lt_plans, calls = cr->gemm_lt_calls;
    for (int len = 200; len <= 230; len += 30) {
        slot_reset(f.r, 3);
        prefill(&f, 3, g->prompt[p], len, 1, logits);
    }
    printf("    band 64: rel err %.3e at 250 tokens; %ld plans, %ld cuBLASLt GEMMs, then %ld plans, %ld GEMMs "
           "after 200 and 230 tokens\n", e, plans, calls, cr->gemm_lt_plans, cr->gemm_lt_calls);
    assert_true(e < REL_TOL);
    assert_true(plans > 0 && calls >= plans);
    assert_int_equal(cr->gemm_lt_plans, plans);
    assert_true(cr->gemm_lt_calls >= 3 * calls);
    free(logits);
    fixture_close(&f);
}

static uint64_t fnv(const void *p, size_t n) {
    const unsigned char *c = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

static void test_dummy_slot_reset_in_graph_and_live_blocks_untouched(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "llama-tiny", 0);
    runner *r = f.r;
    int sizes[64], ng = cuda_runner_graph_sizes(r, sizes, 64), has4 = 0;
    for (int i = 0; i < ng; i++) has4 |= sizes[i] == 4;
    assert_true(has4);
    golden *g = &f.g;
    float *logits = malloc(sizeof(float) * (size_t)f.vocab);
    int live[3] = {0, 2, 3}, lens[3] = {40, 33, 17};
    for (int i = 0; i < 4; i++) {
        slot_reset(r, i);
        prefill(&f, i, g->prompt[5], i == 1 ? 30 : lens[i == 0 ? 0 : i - 1], 1, logits);
    }
    /* Dirty the dummy slot: the captured reset must bring it back to 0. */
    assert_int_equal(r->ops->slot_set_len(r, MAXB, RUNNER_TARGET, 200), 0);
    assert_int_equal(r->ops->slot_set_len(r, MAXB, RUNNER_DRAFT, 77), 0);
    size_t bb = cuda_runner_block_bytes(r);
    unsigned char *buf = malloc(bb);
    /* Checksums of every block of slot 1 (idle) and of the full blocks of the live slots. */
    uint64_t before[4][MAXBLK];
    for (int sl = 0; sl < 4; sl++)
        for (int b = 0; b < MAXBLK; b++) {
            assert_int_equal(cuda_runner_read_block(r, 1 + sl * MAXBLK + b, buf), 0);
            before[sl][b] = fnv(buf, bb);
        }
    int32_t in[3] = {5, 6, 7}, out[3];
    runner_sampling sp[3] = {{0}};
    runner_decode_batch d = {.n = 3, .slots = live, .tokens = in, .sp = sp, .out_tokens = out};
    assert_int_equal(r->ops->decode(r, &d), 0);
    assert_int_equal(dev_len(r, MAXB, RUNNER_TARGET), 0);
    assert_int_equal(dev_len(r, MAXB, RUNNER_DRAFT), 0);
    int changed_live = 0;
    for (int sl = 0; sl < 4; sl++) {
        int len = dev_len(r, sl, RUNNER_TARGET);
        int written_blk = sl == 1 ? -1 : (len - 1) / BS;
        for (int b = 0; b < MAXBLK; b++) {
            assert_int_equal(cuda_runner_read_block(r, 1 + sl * MAXBLK + b, buf), 0);
            uint64_t h = fnv(buf, bb);
            if (b == written_blk) changed_live += h != before[sl][b];
            else if (h != before[sl][b])
                fail_msg("slot %d block %d changed by a step that wrote only position %d", sl, b, len - 1);
        }
    }
    assert_int_equal(changed_live, 3);   /* each live row wrote its own new token */
    assert_int_equal(dev_len(r, 0, RUNNER_TARGET), 41);
    assert_int_equal(dev_len(r, 1, RUNNER_TARGET), 30);
    /* Replays keep resetting it. */
    assert_int_equal(r->ops->slot_set_len(r, MAXB, RUNNER_TARGET, 3), 0);
    assert_int_equal(r->ops->decode(r, &d), 0);
    assert_int_equal(dev_len(r, MAXB, RUNNER_TARGET), 0);
    printf("    dummy slot: reset to 0 after padded graph replays; idle and full live blocks unchanged\n");
    free(buf);
    free(logits);
    fixture_close(&f);
}

static void test_seeded_sampling_repeats_after_rollback(void **s) {
    (void)s;
    fixture f;
    fixture_open(&f, "qwen3-tiny", 0);
    runner *r = f.r;
    float *logits = malloc(sizeof(float) * (size_t)f.vocab);
    slot_reset(r, 0);
    prefill(&f, 0, f.g.prompt[4], f.g.len[4], 1, logits);
    int len = f.g.len[4], slot = 0, first[16], again[16];
    int32_t t = 11;
    for (int pass = 0; pass < 2; pass++) {
        assert_int_equal(r->ops->slot_set_len(r, 0, RUNNER_TARGET, len), 0);
        int32_t cur = t;
        for (int j = 0; j < 16; j++) {
            runner_sampling sp = {.temperature = 1.0f, .top_p = 0.9f, .top_k = 50, .seed = 99,
                                  .counter = (uint64_t)j};
            int32_t o;
            runner_decode_batch d = {.n = 1, .slots = &slot, .tokens = &cur, .sp = &sp, .out_tokens = &o};
            assert_int_equal(r->ops->decode(r, &d), 0);
            (pass ? again : first)[j] = o;
            cur = o;
        }
    }
    int distinct = 0;
    for (int j = 0; j < 16; j++) {
        assert_int_equal(first[j], again[j]);
        distinct += first[j] != first[0];
    }
    assert_true(distinct > 0);
    free(logits);
    fixture_close(&f);
}

/* ---- speculative step (engine/cuda/cuda_spec.c) ------------------------------------------ */

#define SPK 4
#define SPN 24   /* tokens compared per row */

typedef struct {
    model *t, *d;
    runner *r;
    golden g;
} spec_fixture;

static void spec_open(spec_fixture *f, const char *tname, const char *dname) {
    char tp[1024], dp[1024], err[512];
    snprintf(tp, sizeof tp, "%s/models/%s", fixtures(), tname);
    snprintf(dp, sizeof dp, "%s/models/%s", fixtures(), dname);
    f->t = model_load(tp, err, sizeof err);
    if (!f->t) fail_msg("model_load %s: %s", tp, err);
    f->d = model_load(dp, err, sizeof err);
    if (!f->d) fail_msg("model_load %s: %s", dp, err);
    runner_config cfg = {.num_blocks = 1 + MAXB * MAXBLK, .block_size = BS, .max_batch = MAXB,
                         .max_seq_len = SEQ, .max_tokens_per_step = 512, .mem_fraction = 0.9,
                         .num_draft_tokens = SPK};
    cuda_runner_opts o = {.world = 1, .quiet = 1};
    f->r = runner_cuda_create_ex(f->t, f->d, &cfg, &o, err, sizeof err);
    if (!f->r) fail_msg("runner_cuda_create %s+%s: %s", tname, dname, err);
    assert_non_null(f->r->ops->spec_step);
    golden_load(tname, &f->g);
}

static void spec_close(spec_fixture *f) {
    runner_destroy(f->r);
    model_free(f->t);
    model_free(f->d);
    golden_free(&f->g);
}

/* Slot s gets its blocks and n prompt tokens in the target (and the draft when asked). */
static void spec_prefill(runner *r, int s, const int32_t *tok, int n, int draft_too) {
    slot_reset(r, s);
    assert_int_equal(r->ops->slot_set_len(r, s, RUNNER_DRAFT, 0), 0);
    runner_row row = {.slot = s, .n_new = n};
    for (int w = 0; w <= draft_too; w++) {
        runner_batch b = {.which = w ? RUNNER_DRAFT : RUNNER_TARGET, .n_rows = 1, .rows = &row,
                          .tokens = tok, .n_tokens = n};
        int rc = runner_forward(r, &b);
        if (rc) fail_msg("forward: %d %s", rc, cuda_runner_error(r));
    }
}

/* n rows speculate until each emitted >= SPN tokens; hist[i] holds prompt + output. */
static int spec_run(runner *r, const int *slots, int n, int32_t hist[][600], int *hl,
                    const runner_sampling *sp, int *steps) {
    int32_t tok[2 * MAXB], out[MAXB * (SPK + 1)];
    int cnt[MAXB], emitted = 0, base[MAXB];
    for (int i = 0; i < n; i++) base[i] = hl[i];
    for (;;) {
        int done = 1;
        for (int i = 0; i < n; i++) done &= hl[i] - base[i] >= SPN;
        if (done) break;
        for (int i = 0; i < n; i++) {
            tok[2 * i] = hist[i][hl[i] - 2];
            tok[2 * i + 1] = hist[i][hl[i] - 1];
        }
        runner_spec_batch b = {.n = n, .k = SPK, .slots = slots, .tokens = tok, .sp = sp,
                               .out_tokens = out, .out_n = cnt};
        int rc = r->ops->spec_step(r, &b);
        if (rc) fail_msg("spec_step: %d %s", rc, cuda_runner_error(r));
        for (int i = 0; i < n; i++) {
            assert_true(cnt[i] >= 1 && cnt[i] <= SPK + 1);
            int L = hl[i] - 1;
            assert_int_equal(dev_len(r, slots[i], RUNNER_TARGET), L + cnt[i]);
            assert_int_equal(dev_len(r, slots[i], RUNNER_DRAFT),
                             L + SPK < L + cnt[i] ? L + SPK : L + cnt[i]);
            for (int j = 0; j < cnt[i]; j++) hist[i][hl[i]++] = out[i * (SPK + 1) + j];
            emitted += cnt[i];
        }
        (*steps)++;
    }
    return emitted;
}

/* The draft model's passes sampling in the runner (runner.draft_samples, off until this
 * has run): every golden prompt fed to the draft with one logits row, greedy, with a logit
 * bias and a presence penalty over a few ids, must give the argmax of the logits the same
 * pass returns without sampling, adjusted on the host the same way. */
static void test_forward_sampling_of_the_draft_matches_its_logits(void **s) {
    (void)s;
    spec_fixture f;
    spec_open(&f, "llama-tiny", "llama-draft");
    golden *g = &f.g;
    const int V = f.t->cfg.vocab, n = g->n_prompts;
    runner_row rows[8];
    int32_t *tokens = malloc(sizeof(int32_t) * 512), out[8];
    float *logits = malloc(sizeof(float) * (size_t)V * n);
    int tok_total = 0;
    for (int p = 0; p < n; p++) {
        rows[p] = (runner_row){.slot = p, .n_new = g->len[p], .tok_off = tok_total, .n_logits = 1, .logits_off = p};
        memcpy(tokens + tok_total, g->prompt[p], sizeof(int32_t) * (size_t)g->len[p]);
        tok_total += g->len[p];
    }
    static const int32_t bias_ids[2] = {17, 300};
    static const float bias_vals[2] = {4.0f, 2.5f};
    static const int32_t stat_ids[3] = {17, 5, 300}, stat_counts[3] = {2, 1, 0};
    runner_sampling sp[8];
    for (int p = 0; p < n; p++)
        sp[p] = (runner_sampling){.counter = 3, .n_logit_bias = 2, .logit_bias_ids = bias_ids,
                                  .logit_bias_vals = bias_vals, .presence_penalty = 1.5f, .frequency_penalty = 0.5f,
                                  .repetition_penalty = 1.0f, .n_stats = 3, .stat_ids = stat_ids,
                                  .stat_counts = stat_counts};
    for (int pass = 0; pass < 2; pass++) {
        for (int p = 0; p < n; p++) {
            slot_reset(f.r, p);
            assert_int_equal(f.r->ops->slot_set_len(f.r, p, RUNNER_DRAFT, 0), 0);
            out[p] = -1;
        }
        runner_batch b = {.which = RUNNER_DRAFT, .n_rows = n, .rows = rows, .tokens = tokens, .n_tokens = tok_total,
                          .logits = logits, .sp = pass ? sp : NULL, .out_tokens = pass ? out : NULL};
        int rc = runner_forward(f.r, &b);
        if (rc) fail_msg("draft forward (pass %d): %d %s", pass, rc, cuda_runner_error(f.r));
        for (int p = 0; p < n; p++) assert_int_equal(f.r->ops->slot_get_len(f.r, p, RUNNER_DRAFT), g->len[p]);
    }
    int moved = 0;
    for (int p = 0; p < n; p++) {
        float *lg = logits + (size_t)p * V;   /* pass 0's, adjusted as sp says */
        const int raw = argmax(lg, V);
        for (int j = 0; j < 2; j++) lg[bias_ids[j]] += bias_vals[j];
        for (int j = 0; j < 3; j++)
            if (stat_counts[j] > 0) lg[stat_ids[j]] -= 0.5f * (float)stat_counts[j] + 1.5f;
        const int want = argmax(lg, V);
        moved += want != raw;
        if (out[p] != want) fail_msg("row %d: the draft sampled %d, adjusted argmax %d", p, out[p], want);
    }
    printf("    the draft's forward sampling: %d rows equal the adjusted argmax of its logits (%d moved by the "
           "adjustments)\n", n, moved);
    free(tokens);
    free(logits);
    spec_close(&f);
}

static void test_spec_graph_greedy_equals_decode_and_dummy_reset(void **s) {
    (void)s;
    spec_fixture f;
    spec_open(&f, "llama-tiny", "llama-draft");
    runner *r = f.r;
    const int32_t *p = f.g.prompt[5];
    int live[3] = {0, 2, 3}, twin[3] = {4, 5, 6}, plen[3] = {40, 33, 17};
    static int32_t hist[3][600];
    int hl[3];
    assert_true(f.g.len[5] >= 40);
    for (int i = 0; i < 3; i++) {
        spec_prefill(r, live[i], p, plen[i] - 1, 1);
        spec_prefill(r, twin[i], p, plen[i] - 1, 0);
        memcpy(hist[i], p, sizeof(int32_t) * (size_t)plen[i]);
        hl[i] = plen[i];
    }
    slot_reset(r, 1);
    /* Reference: plain greedy decode of the twins (padded graph of 4). */
    int32_t exp[3][SPN], cur[3], o[3];
    runner_sampling sp[3] = {{0}};
    for (int i = 0; i < 3; i++) cur[i] = p[plen[i] - 1];
    for (int j = 0; j < SPN; j++) {
        runner_decode_batch d = {.n = 3, .slots = twin, .tokens = cur, .sp = sp, .out_tokens = o};
        assert_int_equal(r->ops->decode(r, &d), 0);
        for (int i = 0; i < 3; i++) exp[i][j] = cur[i] = o[i];
    }
    /* Dirty the dummy slot, checksum slots 0..3, then one padded speculative step. */
    assert_int_equal(r->ops->slot_set_len(r, MAXB, RUNNER_TARGET, 200), 0);
    assert_int_equal(r->ops->slot_set_len(r, MAXB, RUNNER_DRAFT, 77), 0);
    size_t bb = cuda_runner_block_bytes(r);
    unsigned char *buf = malloc(bb);
    uint64_t before[4][MAXBLK];
    for (int sl = 0; sl < 4; sl++)
        for (int b = 0; b < MAXBLK; b++) {
            assert_int_equal(cuda_runner_read_block(r, 1 + sl * MAXBLK + b, buf), 0);
            before[sl][b] = fnv(buf, bb);
        }
    int32_t tok[6], out[3 * (SPK + 1)];
    int cnt[3];
    for (int i = 0; i < 3; i++) {
        tok[2 * i] = p[plen[i] - 2];
        tok[2 * i + 1] = p[plen[i] - 1];
    }
    runner_spec_batch b = {.n = 3, .k = SPK, .slots = live, .tokens = tok, .sp = sp,
                           .out_tokens = out, .out_n = cnt};
    assert_int_equal(r->ops->spec_step(r, &b), 0);
    assert_int_equal(dev_len(r, MAXB, RUNNER_TARGET), 0);
    assert_int_equal(dev_len(r, MAXB, RUNNER_DRAFT), 0);
    for (int sl = 0; sl < 4; sl++) {
        int li = sl == 0 ? 0 : sl - 1, L = plen[li] - 1;
        /* a live row writes positions L-1 (draft) .. L+k (target) */
        int lo = sl == 1 ? -1 : (L - 1) / BS, hi = sl == 1 ? -1 : (L + SPK) / BS;
        for (int bl = 0; bl < MAXBLK; bl++) {
            assert_int_equal(cuda_runner_read_block(r, 1 + sl * MAXBLK + bl, buf), 0);
            if ((bl < lo || bl > hi) && fnv(buf, bb) != before[sl][bl])
                fail_msg("slot %d block %d changed by a speculative step at L=%d", sl, bl, L);
        }
    }
    for (int i = 0; i < 3; i++) {
        int L = plen[i] - 1;
        assert_int_equal(dev_len(r, live[i], RUNNER_TARGET), L + cnt[i]);
        for (int j = 0; j < cnt[i]; j++) hist[i][hl[i]++] = out[i * (SPK + 1) + j];
    }
    /* Replays keep resetting it. */
    assert_int_equal(r->ops->slot_set_len(r, MAXB, RUNNER_TARGET, 3), 0);
    int steps = 1, emitted = cnt[0] + cnt[1] + cnt[2];
    emitted += spec_run(r, live, 3, hist, hl, sp, &steps);
    assert_int_equal(dev_len(r, MAXB, RUNNER_TARGET), 0);
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < SPN; j++)
            if (hist[i][plen[i] + j] != exp[i][j])
                fail_msg("row %d token %d: speculative %d, plain decode %d", i, j,
                         hist[i][plen[i] + j], exp[i][j]);
    printf("    llama-tiny + llama-draft k=%d, 3 rows in a graph of 4: %d tokens = plain decode; "
           "AL %.3f over %d steps; dummy slot reset, idle blocks unchanged\n", SPK, 3 * SPN,
           (double)emitted / (3.0 * steps), steps);
    free(buf);
    spec_close(&f);
}

static void test_spec_graph_self_draft_accepts_nearly_all(void **s) {
    (void)s;
    spec_fixture f;
    spec_open(&f, "llama-tiny", "llama-tiny");
    runner *r = f.r;
    const int32_t *p = f.g.prompt[5];
    int live[5] = {0, 1, 2, 3, 4};
    static int32_t hist[5][600];
    int hl[5];
    runner_sampling sp[5] = {{0}};
    for (int pass = 0; pass < 2; pass++) {
        /* pass 0 greedy, pass 1 sampled (T 0.8, top_p 0.95): with q == p every draft stands. */
        for (int i = 0; i < 5; i++) {
            spec_prefill(r, live[i], p, 20 + i, 1);
            memcpy(hist[i], p, sizeof(int32_t) * 21);
            hl[i] = 21 + i;
            memcpy(hist[i], p, sizeof(int32_t) * (size_t)hl[i]);
            if (pass) sp[i] = (runner_sampling){.temperature = 0.8f, .top_p = 0.95f, .seed = 7 + i};
        }
        int steps = 0, emitted = 0;
        for (int rep = 0; rep < 4; rep++) emitted += spec_run(r, live, 5, hist, hl, sp, &steps);
        double al = (double)emitted / (5.0 * steps);
        printf("    llama-tiny as its own draft, k=%d, 5 rows (graph of 8), %s: AL %.3f over %d steps\n",
               SPK, pass ? "sampled" : "greedy", al, steps);
        assert_true(al >= 0.9 * (SPK + 1));
    }
    spec_close(&f);
}

/* Speculative steps queued one behind the other (runner.spec_async, SPECD_CUDA_SPEC_ASYNC=1;
 * the engine's async scheduling): each step after the first continues the rows of the one
 * before on the device (prev_row: its last two tokens from that step's outputs, the
 * sampling counter advanced by its m) while that one is still pending. The tokens, counts
 * and lengths must be those of the same steps run one at a time with the tokens and
 * counters passed from the host: llama-draft (mostly one token a step) and llama-tiny as
 * its own draft (k + 1), greedy and seeded. */
static void test_spec_graph_chained_equals_one_at_a_time(void **s) {
    (void)s;
    const char *drafts[2] = {"llama-draft", "llama-tiny"};
    setenv("SPECD_CUDA_SPEC_ASYNC", "1", 1);
    for (int di = 0; di < 2; di++)
        for (int pass = 0; pass < 2; pass++) {
            spec_fixture f;
            spec_open(&f, "llama-tiny", drafts[di]);
            runner *r = f.r;
            assert_true(r->spec_async);
            const int32_t *p = f.g.prompt[5];
            int live[3] = {0, 1, 2}, twin[3] = {4, 5, 6}, plen[3] = {30, 23, 17};
            static int32_t hist[2][3][600];
            int hl[2][3], steps[2] = {0, 0};
            runner_sampling sp[2][3];
            for (int i = 0; i < 3; i++) {
                spec_prefill(r, live[i], p, plen[i] - 1, 1);
                spec_prefill(r, twin[i], p, plen[i] - 1, 1);
                for (int w = 0; w < 2; w++) {
                    memcpy(hist[w][i], p, sizeof(int32_t) * (size_t)plen[i]);
                    hl[w][i] = plen[i];
                    sp[w][i] = pass ? (runner_sampling){.temperature = 0.8f, .top_p = 0.95f, .seed = 11 + (uint64_t)i}
                                    : (runner_sampling){0};
                }
            }
            /* one at a time on the twins: tokens and counters from the host */
            int32_t tok[6], out[2][3 * (SPK + 1)];
            int cnt[2][3];
            while (hl[1][0] - plen[0] < SPN || hl[1][1] - plen[1] < SPN || hl[1][2] - plen[2] < SPN) {
                for (int i = 0; i < 3; i++) {
                    tok[2 * i] = hist[1][i][hl[1][i] - 2];
                    tok[2 * i + 1] = hist[1][i][hl[1][i] - 1];
                    sp[1][i].counter = (uint64_t)(hl[1][i] - plen[i]);
                }
                runner_spec_batch b = {.n = 3, .k = SPK, .slots = twin, .tokens = tok, .sp = sp[1],
                                       .out_tokens = out[0], .out_n = cnt[0]};
                if (r->ops->spec_step(r, &b)) fail_msg("spec_step: %s", cuda_runner_error(r));
                for (int i = 0; i < 3; i++)
                    for (int j = 0; j < cnt[0][i]; j++) hist[1][i][hl[1][i]++] = out[0][i * (SPK + 1) + j];
                steps[1]++;
            }
            /* chained on the live slots: the first step from the host, each next one queued
             * behind it and fed on the device, the one before waited for after */
            const int prev[3] = {0, 1, 2};
            for (int i = 0; i < 3; i++) {
                tok[2 * i] = hist[0][i][hl[0][i] - 2];
                tok[2 * i + 1] = hist[0][i][hl[0][i] - 1];
            }
            int q = 0, pending = 0;
            for (;;) {
                /* the counter as the host knows it, through the steps waited for; the
                 * runner adds the pending step's m (as the engine passes n_out) */
                for (int i = 0; i < 3; i++) sp[0][i].counter = (uint64_t)(hl[0][i] - plen[i]);
                runner_spec_batch b = {.n = 3, .k = SPK, .slots = live, .tokens = tok, .sp = sp[0],
                                       .out_tokens = out[q], .out_n = cnt[q], .async = 1,
                                       .prev_row = pending ? prev : NULL};
                if (r->ops->spec_step(r, &b)) fail_msg("spec_step (queued): %s", cuda_runner_error(r));
                if (pending) {   /* the step before: its outputs now */
                    if (r->ops->wait_queued(r)) fail_msg("wait_queued: %s", cuda_runner_error(r));
                    for (int i = 0; i < 3; i++)
                        for (int j = 0; j < cnt[q ^ 1][i]; j++) hist[0][i][hl[0][i]++] = out[q ^ 1][i * (SPK + 1) + j];
                    steps[0]++;
                }
                pending = 1;
                q ^= 1;
                if (steps[0] == steps[1]) break;
            }
            if (r->ops->wait_queued(r)) fail_msg("wait_queued: %s", cuda_runner_error(r));   /* (one more, unused) */
            for (int i = 0; i < 3; i++) {
                for (int j = 0; j < SPN; j++)
                    if (hist[0][i][plen[i] + j] != hist[1][i][plen[i] + j])
                        fail_msg("draft %s, %s, row %d token %d: chained %d, one at a time %d", drafts[di],
                                 pass ? "seeded" : "greedy", i, j, hist[0][i][plen[i] + j], hist[1][i][plen[i] + j]);
                assert_int_equal(r->ops->slot_get_len(r, live[i], RUNNER_TARGET), dev_len(r, live[i], RUNNER_TARGET));
                assert_int_equal(r->ops->slot_get_len(r, live[i], RUNNER_DRAFT), dev_len(r, live[i], RUNNER_DRAFT));
            }
            assert_int_equal(dev_len(r, MAXB, RUNNER_TARGET), 0);
            printf("    draft %s, %s: %d steps chained = one at a time, %d tokens a row compared\n", drafts[di],
                   pass ? "seeded (T 0.8, top_p 0.95)" : "greedy", steps[0], SPN);
            spec_close(&f);
        }
    unsetenv("SPECD_CUDA_SPEC_ASYNC");
}

/* ---- verify of outside drafts (cuda_spec.c's verify graphs) ------------------------------ */

static runner *verify_open(const char *name, model **t, golden *g) {
    char tp[1024], err[512];
    snprintf(tp, sizeof tp, "%s/models/%s", fixtures(), name);
    *t = model_load(tp, err, sizeof err);
    if (!*t) fail_msg("model_load %s: %s", tp, err);
    runner_config cfg = {.num_blocks = 1 + MAXB * MAXBLK, .block_size = BS, .max_batch = MAXB,
                         .max_seq_len = SEQ, .max_tokens_per_step = 512, .mem_fraction = 0.9,
                         .num_draft_tokens = SPK};
    cuda_runner_opts o = {.world = 1, .quiet = 1};
    runner *r = runner_cuda_create_ex(*t, NULL, &cfg, &o, err, sizeof err);
    if (!r) fail_msg("runner_cuda_create: %s", err);
    assert_non_null(r->ops->verify);
    assert_null(r->ops->spec_step);
    assert_int_equal(r->verify_max_k, SPK);
    golden_load(name, g);
    return r;
}

/* Greedy: rows with 0..k drafts, some of them the plain decode's own tokens and some with
 * a wrong one, emit exactly the plain decode's tokens, as many as the drafts that match
 * plus one; padding rows leave the dummy slot at length 0. llama-tiny (head dim 32)
 * attends over a row's tokens as one item on the tiled kernel; qwen3-tiny (head dim 64,
 * 2 query heads per KV head) as one item per token on the decode kernel (cuda_spec.c's
 * attn_qt). */
static void run_verify_greedy(const char *name) {
    model *t;
    golden g;
    runner *r = verify_open(name, &t, &g);
    const int32_t *p = g.prompt[5];
    int live[3] = {0, 2, 3}, twin[3] = {4, 5, 6}, plen[3] = {40, 33, 17};
    assert_true(g.len[5] >= 40);
    for (int i = 0; i < 3; i++) {
        spec_prefill(r, live[i], p, plen[i] - 1, 0);
        spec_prefill(r, twin[i], p, plen[i] - 1, 0);
    }
    enum { N = 3 * SPN };
    int32_t exp[3][N + SPK + 1], cur[3], o[3];
    runner_sampling sp[3] = {{0}};
    for (int i = 0; i < 3; i++) cur[i] = p[plen[i] - 1];
    for (int j = 0; j < N + SPK + 1; j++) {
        runner_decode_batch d = {.n = 3, .slots = twin, .tokens = cur, .sp = sp, .out_tokens = o};
        assert_int_equal(r->ops->decode(r, &d), 0);
        for (int i = 0; i < 3; i++) exp[i][j] = cur[i] = o[i];
    }
    int done[3] = {0}, steps = 0, emitted = 0, drafted = 0, accepted = 0;
    int32_t last[3];
    for (int i = 0; i < 3; i++) last[i] = p[plen[i] - 1];
    while (done[0] < N && done[1] < N && done[2] < N) {
        int k = 1 + steps % SPK, nd[3], cnt[3], want[3];
        int32_t tok[3 * (SPK + 1)], out[3 * (SPK + 1)];
        for (int i = 0; i < 3; i++) {
            nd[i] = (steps + i) % (k + 1);
            int bad = (steps + 2 * i) % 3 == 0 && nd[i] > 0 ? (steps + i) % nd[i] : -1;
            tok[i * (k + 1)] = last[i];
            want[i] = nd[i] + 1;
            for (int j = 0; j < k; j++) {
                int32_t d = j < nd[i] ? exp[i][done[i] + j] : (int32_t)((steps * 7 + j) % 1000);
                if (j == bad) {
                    d = (d + 1) % 1000;
                    want[i] = j + 1;
                }
                tok[i * (k + 1) + 1 + j] = d;
            }
            drafted += nd[i];
        }
        assert_int_equal(r->ops->slot_set_len(r, MAXB, RUNNER_TARGET, 100 + steps), 0);   /* dirty the dummy */
        int L[3];
        for (int i = 0; i < 3; i++) L[i] = dev_len(r, live[i], RUNNER_TARGET);
        runner_verify_batch b = {.n = 3, .k = k, .slots = live, .tokens = tok, .n_drafts = nd, .sp = sp,
                                 .out_tokens = out, .out_n = cnt};
        int rc = r->ops->verify(r, &b);
        if (rc) fail_msg("verify: %d %s", rc, cuda_runner_error(r));
        assert_int_equal(dev_len(r, MAXB, RUNNER_TARGET), 0);
        for (int i = 0; i < 3; i++) {
            if (cnt[i] != want[i])
                fail_msg("step %d row %d (%d drafts, k %d): %d tokens emitted, %d expected", steps, i, nd[i], k,
                         cnt[i], want[i]);
            assert_int_equal(dev_len(r, live[i], RUNNER_TARGET), L[i] + cnt[i]);
            for (int j = 0; j < cnt[i]; j++)
                if (out[i * (k + 1) + j] != exp[i][done[i] + j])
                    fail_msg("step %d row %d token %d: verify %d, plain decode %d", steps, i, done[i] + j,
                             out[i * (k + 1) + j], exp[i][done[i] + j]);
            accepted += cnt[i] - 1;
            emitted += cnt[i];
            done[i] += cnt[i];
            last[i] = out[i * (k + 1) + cnt[i] - 1];
        }
        steps++;
    }
    printf("    %s, verify k=1..%d, 3 rows in a graph of 4: %d tokens = plain decode over %d steps "
           "(%d of %d drafts accepted, as planted); dummy slot reset\n", name, SPK, emitted, steps, accepted, drafted);
    runner_destroy(r);
    model_free(t);
    golden_free(&g);
}

static void test_verify_graph_greedy_equals_decode(void **s) {
    (void)s;
    run_verify_greedy("llama-tiny");
    run_verify_greedy("qwen3-tiny");
}

/* A verify pass that runs as a decode step (cuda_spec.c verify_as_decode: the GEMV on its
 * FMA form at every token count, one attention item per token, the decode step's key
 * splits) gives each of its tokens the decode step's logits bit for bit: a greedy verify
 * then emits exactly what plain decoding would, and so does speculation. SmolLM2's shape
 * (random weights: hidden 576, 9 query heads on 3 KV heads, head dim 64) after a
 * 3,000-token prompt, where the decode step splits the keys 32 ways and a split per item of
 * the verify pass would have split them otherwise. The form is forced here
 * (SPECD_CUDA_VERIFY_GEMV=2; by default it is taken where it times no slower); with
 * SPECD_CUDA_VERIFY_ITEM_SPLITS=1 or SPECD_CUDA_VERIFY_GEMV=0 set before the test (the
 * forms before) it fails. */
static void test_verify_logits_equal_decode_bits(void **s) {
    (void)s;
    const int force = getenv("SPECD_CUDA_VERIFY_GEMV") == NULL;   /* (read at runner creation) */
    if (force) setenv("SPECD_CUDA_VERIFY_GEMV", "2", 1);
    model_config mc;
    char err[512];
    assert_int_equal(model_shape_preset("smollm2-135m", &mc), 0);
    model *t = model_random(&mc, 7, err, sizeof err);
    if (!t) fail_msg("model_random: %s", err);
    enum { L = 3000, SEQL = 4096, K = 4, K1 = K + 1 };
    runner_config cfg = {.num_blocks = 1 + 2 * (SEQL / BS), .block_size = BS, .max_batch = 2, .max_seq_len = SEQL,
                         .max_tokens_per_step = 1024, .mem_fraction = 0.9, .num_draft_tokens = K};
    cuda_runner_opts o = {.world = 1, .quiet = 1};
    runner *r = runner_cuda_create_ex(t, NULL, &cfg, &o, err, sizeof err);
    if (force) unsetenv("SPECD_CUDA_VERIFY_GEMV");
    if (!r) fail_msg("runner_cuda_create: %s", err);
    assert_non_null(r->ops->verify);
    const cuda_runner *cr = (const cuda_runner *)r;
    const int V = mc.vocab;
    int32_t *prompt = malloc(sizeof(int32_t) * L);
    for (int i = 0; i < L; i++) prompt[i] = (int32_t)((i * 7919u + 13u) % (unsigned)V);
    for (int sl = 0; sl < 2; sl++) {   /* both slots hold the prompt but its last token */
        int32_t b[SEQL / BS];
        for (int i = 0; i < SEQL / BS; i++) b[i] = 1 + sl * (SEQL / BS) + i;
        assert_int_equal(r->ops->slot_write_blocks(r, sl, 0, b, SEQL / BS), 0);
        assert_int_equal(r->ops->slot_set_len(r, sl, RUNNER_TARGET, 0), 0);
        for (int o0 = 0; o0 < L - 1; o0 += 1000) {
            const int n = L - 1 - o0 < 1000 ? L - 1 - o0 : 1000;
            runner_row row = {.slot = sl, .n_new = n};
            runner_batch bt = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = prompt + o0, .n_tokens = n};
            if (runner_forward(r, &bt)) fail_msg("forward: %s", cuda_runner_error(r));
        }
    }
    float *dec = malloc(sizeof(float) * (size_t)V * K1), *ver = malloc(sizeof(float) * (size_t)V * K1);
    int32_t seq[K1 + 1];
    seq[0] = prompt[L - 1];
    runner_sampling sp = {0};
    for (int j = 0; j < K1; j++) {   /* slot 0: five plain decode steps, their logits */
        int slot = 0;
        int32_t out;
        runner_decode_batch d = {.n = 1, .slots = &slot, .tokens = &seq[j], .sp = &sp, .out_tokens = &out};
        assert_int_equal(r->ops->decode(r, &d), 0);
        assert_int_equal(cudaMemcpy(dec + (size_t)j * V, cr->d_logits, sizeof(float) * (size_t)V,
                                    cudaMemcpyDeviceToHost), cudaSuccess);
        seq[j + 1] = out;
    }
    /* slot 1: one verify pass over the same tokens (the decode's own picks as drafts) */
    int slot = 1, nd = K, cnt = 0;
    int32_t out[K1];
    runner_verify_batch vb = {.n = 1, .k = K, .slots = &slot, .tokens = seq, .n_drafts = &nd, .sp = &sp,
                              .out_tokens = out, .out_n = &cnt};
    if (r->ops->verify(r, &vb)) fail_msg("verify: %s", cuda_runner_error(r));
    assert_int_equal(cudaMemcpy(ver, cr->d_vf_tl, sizeof(float) * (size_t)V * K1, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    int differ = 0;
    float worst = 0.f;
    for (size_t i = 0; i < (size_t)V * K1; i++)
        if (memcmp(&dec[i], &ver[i], sizeof(float))) {
            differ++;
            if (fabsf(dec[i] - ver[i]) > worst) worst = fabsf(dec[i] - ver[i]);
        }
    printf("    smollm2-135m shape, context %d, verify of %d drafts against %d decode steps: %d of %d logits "
           "differ (largest %.3g); %d tokens emitted\n", L, K, K1, differ, V * K1, (double)worst, cnt);
    assert_int_equal(differ, 0);
    assert_int_equal(cnt, K1);
    for (int j = 0; j < K1; j++) assert_int_equal(out[j], seq[j + 1]);
    free(dec);
    free(ver);
    free(prompt);
    runner_destroy(r);
    model_free(t);
}

/* Sampled: one verify step from fresh prefixes against the host's point-mass acceptance
 * (engine/core/spec.c, given the device's uniforms) over the same runner's logits of the
 * same tokens on a twin slot: the same tokens in all but rounding cases (at most 1 in 48). */
static void test_verify_graph_sampled_matches_host_acceptance(void **s) {
    (void)s;
    model *t;
    golden g;
    runner *r = verify_open("llama-tiny", &t, &g);
    const int V = t->cfg.vocab, K1 = SPK + 1;
    const int32_t *p = g.prompt[5];
    int live[3] = {0, 1, 2}, twin[3] = {4, 5, 6}, same = 0, total = 0, acc = 0;
    float *lg = malloc(sizeof(float) * (size_t)V * K1);
    int *scratch = malloc(sizeof(int) * (size_t)V);
    for (int trial = 0; trial < 16; trial++) {
        runner_sampling sp[3];
        int nd[3], cnt[3];
        int32_t tok[3 * K1], out[3 * K1];
        for (int i = 0; i < 3; i++) {
            int n = 8 + trial + 3 * i;
            spec_prefill(r, live[i], p, n, 0);
            spec_prefill(r, twin[i], p, n, 0);
            /* sharp rows accept their (greedy-looking) drafts often, flat ones reject */
            sp[i] = (runner_sampling){.temperature = i == 0 ? 0.05f : i == 1 ? 0.3f : 1.0f, .top_p = i == 2 ? 0.9f : 1.0f,
                                      .top_k = i == 1 ? 40 : 0, .seed = 1000 + (uint64_t)trial * 3 + (uint64_t)i,
                                      .counter = (uint64_t)trial};
            nd[i] = 1 + (trial + i) % SPK;
            tok[i * K1] = p[n];
            if (i < 2) {   /* the greedy continuation (slot 7): sharp rows accept it often */
                spec_prefill(r, 7, p, n, 0);
                int32_t cur = p[n], o1;
                runner_sampling g0 = {0};
                for (int j = 1; j < K1; j++) {
                    int sl = 7;
                    runner_decode_batch d = {.n = 1, .slots = &sl, .tokens = &cur, .sp = &g0, .out_tokens = &o1};
                    assert_int_equal(r->ops->decode(r, &d), 0);
                    tok[i * K1 + j] = cur = o1;
                }
            } else {
                for (int j = 1; j < K1; j++) tok[i * K1 + j] = p[n + j];   /* the prompt's own continuation */
            }
        }
        runner_verify_batch b = {.n = 3, .k = SPK, .slots = live, .tokens = tok, .n_drafts = nd, .sp = sp,
                                 .out_tokens = out, .out_n = cnt};
        int rc = r->ops->verify(r, &b);
        if (rc) fail_msg("verify: %d %s", rc, cuda_runner_error(r));
        for (int i = 0; i < 3; i++) {
            runner_row row = {.slot = twin[i], .n_new = K1, .n_logits = K1};
            runner_batch fb = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = tok + i * K1,
                               .n_tokens = K1, .logits = lg};
            if ((rc = runner_forward(r, &fb))) fail_msg("forward: %d %s", rc, cuda_runner_error(r));
            sample_params q = {.temperature = sp[i].temperature, .top_p = sp[i].top_p, .top_k = sp[i].top_k};
            for (int j = 0; j <= nd[i]; j++) sample_probs(lg + (size_t)j * V, V, &q, scratch);
            /* the device's uniforms, the decode sampler's for each output position (Philox;
             * the host sampler's own stream is another) */
            double u[SPK + 1];
            for (int j = 0; j <= nd[i]; j++) u[j] = k_philox_uniform_host(sp[i].seed, sp[i].counter + (uint64_t)j);
            int32_t ho[SPK + 1];
            int m = spec_accept_point(lg, V, tok + i * K1 + 1, nd[i], u, ho);
            int eq = m == cnt[i] && !memcmp(ho, out + i * K1, sizeof(int32_t) * (size_t)m);
            if (!eq)
                printf("    trial %d row %d: verify %d tokens (last %d), host %d (last %d)\n", trial, i, cnt[i],
                       out[i * K1 + cnt[i] - 1], m, ho[m - 1]);
            same += eq;
            total++;
            acc += cnt[i] - 1;
        }
    }
    printf("    llama-tiny, sampled verify k=%d: %d of %d rows equal to the host's acceptance (%d drafts accepted)\n",
           SPK, same, total, acc);
    assert_true(same >= total - 1);
    assert_true(acc > 0 && acc < total * SPK);   /* both accepting and rejecting ran */
    free(lg);
    free(scratch);
    runner_destroy(r);
    model_free(t);
    golden_free(&g);
}

/* ---- FP8 projections --------------------------------------------------------------------- */

static runner *fp8_open(const char *name, model **m, int fp8, int kv_fp8) {
    char path[1024], err[512];
    snprintf(path, sizeof path, "%s/models/%s", fixtures(), name);
    *m = model_load(path, err, sizeof err);
    if (!*m) fail_msg("model_load %s: %s", path, err);
    runner_config cfg = {.num_blocks = 1 + MAXB * MAXBLK, .block_size = BS, .max_batch = MAXB,
                         .max_seq_len = SEQ, .max_tokens_per_step = 512, .mem_fraction = 0.9, .weights_fp8 = fp8,
                         .kv_fp8 = kv_fp8};
    cuda_runner_opts o = {.world = 1, .quiet = 1};
    runner *r = runner_cuda_create_ex(*m, NULL, &cfg, &o, err, sizeof err);
    if (!r) fail_msg("runner_cuda_create %s: %s", name, err);
    return r;
}

/* cuda_fp8_gemm on one shape: cuBLASLt (widths multiples of 16: activations quantized per
 * token, reference = scales x the exact E4M3 dot) or the GEMV fallback (bf16 activations). */
static void check_fp8_gemm(cuda_runner *cr, int out, int in, int n, int accumulate) {
    const int lt = in % 16 == 0 && out % 16 == 0;
    uint8_t *qw = malloc((size_t)out * in), *qx = malloc((size_t)n * in);
    float *sw = malloc(sizeof(float) * out), *sx = malloc(sizeof(float) * n), *row = malloc(sizeof(float) * in);
    uint16_t *X = malloc((size_t)n * in * 2);
    float *Y = malloc(sizeof(float) * (size_t)n * out), *y0 = malloc(sizeof(float) * (size_t)n * out);
    uint64_t seed = 0x5eed0f8ull + (uint64_t)out * 7 + (uint64_t)in * 13 + (uint64_t)n;
    for (int o = 0; o < out; o++) {
        for (int c = 0; c < in; c++) row[c] = gu_uniform(&seed, -0.05f, 0.05f);
        fp8_quantize_row(row, in, qw + (size_t)o * in, &sw[o]);
    }
    for (int t = 0; t < n; t++) {
        for (int c = 0; c < in; c++) {
            X[(size_t)t * in + c] = gu_f2bf(gu_uniform(&seed, -2.f, 2.f) * (t % 3 ? 1.f : 0.01f));
            row[c] = gu_bf2f(X[(size_t)t * in + c]);
        }
        fp8_quantize_row(row, in, qx + (size_t)t * in, &sx[t]);
    }
    for (size_t i = 0; i < (size_t)n * out; i++) y0[i] = accumulate ? gu_uniform(&seed, -1.f, 1.f) : 0.f;
    void *dW = gu_upload(qw, (size_t)out * in), *dS = gu_upload(sw, sizeof(float) * out);
    void *dX = gu_upload(X, (size_t)n * in * 2), *dY = gu_upload(y0, sizeof(float) * (size_t)n * out);
    assert_int_equal(cuda_fp8_gemm(cr, dW, dS, out, in, dX, n, dY, accumulate ? 1.f : 0.f), 0);
    GPU_CHECK(cudaStreamSynchronize(cr->stream));
    gu_download(Y, dY, sizeof(float) * (size_t)n * out);
    double me = 0, mr = 0;
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            double d = 0;
            for (int c = 0; c < in; c++)
                d += (double)fp8_e4m3_to_f32(qw[(size_t)o * in + c]) *
                     (lt ? (double)fp8_e4m3_to_f32(qx[(size_t)t * in + c]) : (double)gu_bf2f(X[(size_t)t * in + c]));
            const double ref = d * sw[o] * (lt ? sx[t] : 1.0) + y0[(size_t)t * out + o];
            const double got = Y[(size_t)t * out + o];
            assert_false(isnan(got));
            me = fmax(me, fabs(got - ref));
            mr = fmax(mr, fabs(ref));
        }
    printf("    fp8 gemm %s out %d in %d n %d%s: rel err %.2e\n", lt ? (cr->lt_outer ? "cuBLASLt" : "cuBLASLt+rescale") : "gemv",
           out, in, n, accumulate ? " +=" : "", me / mr);
    /* Hopper's FP8 mma accumulates with fewer bits than fp32 (cuBLASLt without fast
     * accumulation promotes partial sums periodically): 1.8e-4 and 3.5e-4 measured on an
     * H200 at in 128; one wrong byte or scale costs ~1e-2 and more. With
     * SPECD_CUDA_FP8_FAST_ACCUM=1 (no promotion) the error grows with in: this bound is
     * the default's. */
    assert_true(me / mr < (lt ? 1e-3 : 2e-4));
    cudaFree(dW), cudaFree(dS), cudaFree(dX), cudaFree(dY);
    free(qw), free(qx), free(sw), free(sx), free(row), free(X), free(Y), free(y0);
}

/* gate|up through cuda_fp8_gemm_unscaled and k_gated_mul_fp8 (the scales applied in the
 * gated kernel) against silu(gate) * up from the exact E4M3 values and scales. */
static void check_fp8_gated(cuda_runner *cr, int F, int in, int n, int gelu) {
    const int rows = 2 * F;
    uint8_t *qw = malloc((size_t)rows * in), *qx = malloc((size_t)n * in);
    float *sw = malloc(sizeof(float) * rows), *sx = malloc(sizeof(float) * n), *row = malloc(sizeof(float) * in);
    uint16_t *X = malloc((size_t)n * in * 2), *A = malloc((size_t)n * F * 2);
    uint64_t seed = 0x6a7ed + (uint64_t)F + (uint64_t)n;
    for (int o = 0; o < rows; o++) {
        for (int c = 0; c < in; c++) row[c] = gu_uniform(&seed, -0.2f, 0.2f);
        fp8_quantize_row(row, in, qw + (size_t)o * in, &sw[o]);
    }
    for (int t = 0; t < n; t++) {
        for (int c = 0; c < in; c++) {
            X[(size_t)t * in + c] = gu_f2bf(gu_uniform(&seed, -1.f, 1.f));
            row[c] = gu_bf2f(X[(size_t)t * in + c]);
        }
        fp8_quantize_row(row, in, qx + (size_t)t * in, &sx[t]);
    }
    void *dW = gu_upload(qw, (size_t)rows * in), *dS = gu_upload(sw, sizeof(float) * rows);
    void *dX = gu_upload(X, (size_t)n * in * 2);
    float *dG = gu_dev(sizeof(float) * (size_t)n * rows);
    uint16_t *dA = gu_dev((size_t)n * F * 2);
    assert_int_equal(cuda_fp8_gemm_unscaled(cr, dW, rows, in, dX, n, dG), cr->lt_outer ? 1 : 0);
    if (cr->lt_outer) goto done;   /* cuBLASLt scales by itself: this form is not used */
    assert_int_equal(k_gated_mul_fp8(dG, dS, cr->d_xs, dA, n, F, gelu, cr->stream), 0);
    GPU_CHECK(cudaStreamSynchronize(cr->stream));
    gu_download(A, dA, (size_t)n * F * 2);
    double me = 0, mr = 0;
    for (int t = 0; t < n; t++)
        for (int j = 0; j < F; j++) {
            double d[2] = {0, 0};
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < in; c++)
                    d[h] += (double)fp8_e4m3_to_f32(qw[(size_t)(h * F + j) * in + c]) *
                            fp8_e4m3_to_f32(qx[(size_t)t * in + c]);
            const double g = d[0] * sw[j] * sx[t], u = d[1] * sw[F + j] * sx[t];
            const double act = gelu ? 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
                                    : g / (1.0 + exp(-g));
            const double ref = act * u, got = gu_bf2f(A[(size_t)t * F + j]);
            assert_false(isnan(got));
            me = fmax(me, fabs(got - ref));
            mr = fmax(mr, fabs(ref));
        }
    printf("    fp8 gated %s F %d in %d n %d: rel err %.2e\n", gelu ? "gelu" : "silu", F, in, n, me / mr);
    assert_true(me / mr < 8e-3);   /* bf16 output */
done:
    cudaFree(dW), cudaFree(dS), cudaFree(dX), cudaFree(dG), cudaFree(dA);
    free(qw), free(qx), free(sw), free(sx), free(row), free(X), free(A);
}

static void test_fp8_gemm_matches_exact_values(void **s) {
    (void)s;
    model *m;
    runner *r = fp8_open("llama-tiny", &m, 1, 0);
    cuda_runner *cr = (cuda_runner *)r;
    assert_true(cr->m[0].fp8);
    assert_non_null(cr->lt);
    check_fp8_gemm(cr, 688, 128, 9, 0);    /* llama-tiny gate|up */
    check_fp8_gemm(cr, 688, 128, 300, 1);
    check_fp8_gemm(cr, 256, 336, 64, 1);
    check_fp8_gemm(cr, 128, 344, 40, 1);   /* down: 344 no multiple of 16, the GEMV fallback */
    check_fp8_gemm(cr, 256, 4096, 64, 0);  /* a real model's width: where accumulation shows */
    check_fp8_gemm(cr, 128, 14336, 16, 0);
    check_fp8_gated(cr, 344, 128, 64, 0);
    check_fp8_gated(cr, 344, 128, 200, 1);
    assert_int_equal(cuda_fp8_gemm_unscaled(cr, NULL, 688, 128, NULL, 8, NULL), 1);   /* decode sizes: the GEMV */
    runner_destroy(r);
    model_free(m);
}

/* llama-tiny's golden prompts through r (FP8 somewhere) and r16 (its bf16 twin): the
 * prompt's last logits within 0.25 of HF's, greedy decode from there compared with HF's
 * tokens (compare_greedy); prints and returns the worst error vs HF, the largest distance
 * from r16 (the FP8 path really ran) and the greedy steps compared. */
static void fp8_vs_reference(const char *what, runner *r, model *m, runner *r16, model *m16, double *worst,
                             double *apart, int *compared) {
    golden g;
    golden_load("llama-tiny", &g);
    const int V = m->cfg.vocab;
    float *lg = malloc(sizeof(float) * V), *lg16 = malloc(sizeof(float) * V);
    *worst = *apart = 0;
    *compared = 0;
    for (int p = 0; p < g.n_prompts; p++) {
        fixture f8 = {.m = m, .r = r, .vocab = V}, f16 = {.m = m16, .r = r16, .vocab = V};
        slot_reset(r, 0);
        slot_reset(r16, 0);
        prefill(&f8, 0, g.prompt[p], g.len[p], 1, lg);
        prefill(&f16, 0, g.prompt[p], g.len[p], 1, lg16);
        const double e = rel_err(lg, g.last[p], V), d = rel_err(lg, lg16, V);
        printf("    %s llama-tiny prompt %d (%3d tokens): rel err %.3e vs HF, %.3e vs bf16\n", what, p, g.len[p], e, d);
        *worst = fmax(*worst, e);
        *apart = fmax(*apart, d);
        assert_true(e < 0.25);
        int got[64], n = g.n_greedy[p];
        got[0] = argmax(lg, V);
        for (int j = 1; j < n; j++) {
            int slot = 0;
            runner_sampling sp = {0};
            runner_decode_batch d = {.n = 1, .slots = &slot, .tokens = &got[j - 1], .sp = &sp, .out_tokens = &got[j]};
            int rc = r->ops->decode(r, &d);
            if (rc) fail_msg("decode: %d %s", rc, cuda_runner_error(r));
        }
        *compared += compare_greedy(&g, p, got, n, 0.25 * max_abs(g.last[p], V));
    }
    printf("    %s llama-tiny: worst rel err %.3e, %.3e from bf16, %d greedy steps compared\n", what, *worst, *apart,
           *compared);
    free(lg), free(lg16);
    golden_free(&g);
}

/* llama-tiny with FP8 projections: prompts through the FP8 GEMMs, greedy steps through the
 * FP8 GEMVs of the decode graph, against the HF bf16 reference, and visibly not the bf16
 * runner. The bound is loose: this random model's logits are flat (|logit| < 4), and FP8
 * weights alone move them by up to 0.19 relative on the CPU runner (tests/test_fp8.c);
 * 0.054 .. 0.153 measured here on an H200. Wrong bytes or scales give errors near 1. */
static void test_fp8_model_close_to_reference(void **s) {
    (void)s;
    model *m, *m16;
    runner *r = fp8_open("llama-tiny", &m, 1, 0), *r16 = fp8_open("llama-tiny", &m16, -1, 0);
    assert_true(((cuda_runner *)r)->m[0].fp8);
    assert_false(((cuda_runner *)r16)->m[0].fp8);
    double worst, apart;
    int compared;
    fp8_vs_reference("fp8", r, m, r16, m16, &worst, &apart, &compared);
    assert_true(apart > 1e-3);   /* the FP8 path really ran */
    assert_true(compared > 0);
    runner_destroy(r), runner_destroy(r16);
    model_free(m), model_free(m16);
}

/* --kv-cache-dtype fp8 on the CUDA runner: half the bytes per block; the prompt's logits
 * (prefill on tensor cores, the KV written by the rotary kernel) and greedy decode (graphs,
 * the fused QKV GEMV writing codes, the decode attention reading them) stay close to HF,
 * and differ from the bf16 cache's (the path ran). Prompts of several lengths (fixtures). */
static void test_kv_fp8_model_close_to_reference(void **s) {
    (void)s;
    model *m, *m16;
    runner *r = fp8_open("llama-tiny", &m, 0, 1), *r16 = fp8_open("llama-tiny", &m16, 0, 0);
    assert_int_equal(cuda_runner_block_bytes(r) * 2, cuda_runner_block_bytes(r16));
    double worst, apart;
    int compared;
    fp8_vs_reference("kv fp8", r, m, r16, m16, &worst, &apart, &compared);
    assert_true(apart > 1e-3);
    assert_true(compared > 0);
    runner_destroy(r), runner_destroy(r16);
    model_free(m), model_free(m16);
}

/* Where an FP8 GEMM's time goes on the Llama-3.1-8B projections (weights: layer 0 of a
 * random 8B model quantized at load), next to cuBLAS bf16 on the same shapes: printed,
 * not asserted (tests/gpu/BENCH.md). */
static float time_ms(cudaStream_t st, int iters, int (*fn)(void *), void *ctx) {
    cudaEvent_t a, b;
    GPU_CHECK(cudaEventCreate(&a));
    GPU_CHECK(cudaEventCreate(&b));
    assert_int_equal(fn(ctx), 0);   /* warm-up (plans, heuristics) */
    GPU_CHECK(cudaEventRecord(a, st));
    for (int i = 0; i < iters; i++) assert_int_equal(fn(ctx), 0);
    GPU_CHECK(cudaEventRecord(b, st));
    GPU_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    GPU_CHECK(cudaEventElapsedTime(&ms, a, b));
    cudaEventDestroy(a), cudaEventDestroy(b);
    return ms / iters;
}

typedef struct {
    cuda_runner *cr;
    const uint8_t *w8;
    const uint16_t *w16, *x;
    const float *sw;
    float *y;
    int out, in, n;
} gemm_ctx;

static int run_fp8(void *p) {
    gemm_ctx *c = p;
    return cuda_fp8_gemm(c->cr, c->w8, c->sw, c->out, c->in, c->x, c->n, c->y, 0.f);
}
static int run_quant(void *p) {
    gemm_ctx *c = p;
    return k_quant_fp8_rows(c->x, c->n, c->in, c->cr->d_xq, c->cr->d_xs, c->cr->stream);
}
static int run_rescale(void *p) {
    gemm_ctx *c = p;
    return c->cr->d_f8tmp ? k_fp8_scale_rows(c->cr->d_f8tmp, c->sw, c->cr->d_xs, c->y, c->n, c->out, 0, c->cr->stream)
                          : 0;
}
static int run_bf16(void *p) {
    gemm_ctx *c = p;
    const float alpha = 1.f, beta = 0.f;
    return cublasGemmEx(c->cr->blas, CUBLAS_OP_T, CUBLAS_OP_N, c->out, c->n, c->in, &alpha, c->w16, CUDA_R_16BF,
                        c->in, c->x, CUDA_R_16BF, c->in, &beta, c->y, CUDA_R_32F, c->out, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS;
}

static void test_fp8_gemm_timing_report(void **s) {
    (void)s;
    model_config c;
    char err[512];
    assert_int_equal(model_shape_preset("llama-3.1-8b", &c), 0);
    c.n_layers = 1;
    model *m = model_shape(&c, err, sizeof err);
    assert_non_null(m);
    runner_config cfg = {.num_blocks = 64, .block_size = BS, .max_batch = 8, .max_seq_len = 256,
                         .max_tokens_per_step = 1024, .mem_fraction = 0.5, .weights_fp8 = 1, .random_weights_seed = 7};
    cuda_runner_opts o = {.world = 1, .quiet = 1, .no_graphs = 1};
    runner *r = runner_cuda_create_ex(m, NULL, &cfg, &o, err, sizeof err);
    if (!r) fail_msg("runner_cuda_create: %s", err);
    cuda_runner *cr = (cuda_runner *)r;
    const cuda_layer *L = &cr->m[0].layers[0];
    struct { const char *name; const void *w; const float *sw; int out, in; } sh[] = {
        {"qkv", L->wqkv, L->sqkv, 6144, 4096}, {"o", L->wo, L->so, 4096, 4096},
        {"gate|up", L->wgu, L->sgu, 28672, 4096}, {"down", L->wdown, L->sdown, 4096, 14336}};
    uint16_t *x = gu_dev((size_t)1024 * 14336 * 2), *w16 = gu_dev((size_t)28672 * 4096 * 2);
    float *y = gu_dev(sizeof(float) * (size_t)1024 * 28672);
    GPU_CHECK(cudaMemset(x, 0x3c, (size_t)1024 * 14336 * 2));
    GPU_CHECK(cudaMemset(w16, 0x3c, (size_t)28672 * 4096 * 2));
    printf("    8B projection, tokens: fp8 total (quantize + cuBLASLt + rescale) us vs bf16 cuBLAS us\n");
    const int ns[] = {64, 256, 1024};
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++)
        for (size_t j = 0; j < 3; j++) {
            gemm_ctx g = {cr, sh[i].w, w16, x, sh[i].sw, y, sh[i].out, sh[i].in, ns[j]};
            const float t8 = time_ms(cr->stream, 20, run_fp8, &g), tq = time_ms(cr->stream, 20, run_quant, &g);
            const float ts = time_ms(cr->stream, 20, run_rescale, &g), t16 = time_ms(cr->stream, 20, run_bf16, &g);
            printf("    %-7s %5d: fp8 %7.1f (%6.1f + %7.1f + %6.1f)  bf16 %7.1f  x%.2f\n", sh[i].name, ns[j], t8 * 1e3,
                   tq * 1e3, (t8 - tq - ts) * 1e3, ts * 1e3, t16 * 1e3, t16 / t8);
        }
    cudaFree(x), cudaFree(w16), cudaFree(y);
    runner_destroy(r);
    model_free(m);
}

/* argv[1], when given: run only the tests whose names match this cmocka filter pattern. */
int main(int argc, char **argv) {
    if (argc > 1) cmocka_set_test_filter(argv[1]);
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("gpu runner tests: skipped (no GPU)\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_llama_tiny),
        cmocka_unit_test(test_golden_qwen2_tiny),
        cmocka_unit_test(test_golden_qwen3_tiny),
        cmocka_unit_test(test_golden_mistral_swa_tiny),
        cmocka_unit_test(test_golden_gemma3_tiny),
        cmocka_unit_test(test_golden_phi3_tiny),
        cmocka_unit_test(test_golden_qwen3moe_tiny),
        cmocka_unit_test(test_odd_max_batch_decodes_the_golden_tokens),
        cmocka_unit_test(test_moe_shape_limits_refused_at_create),
        cmocka_unit_test(test_window_pool_matches_one_pool),
        cmocka_unit_test(test_golden_mixtral_tiny),
        cmocka_unit_test(test_golden_llama_draft),
        cmocka_unit_test(test_batched_padded_decode_matches_reference),
        cmocka_unit_test(test_forward_sampling_matches_returned_logits),
        cmocka_unit_test(test_prompt_logprobs_forced_match_host),
        cmocka_unit_test(test_async_ops_chain_on_the_device),
        cmocka_unit_test(test_forward_sampling_adjustments_match_host),
        cmocka_unit_test(test_decode_graph_adjustments_decide_tokens),
        cmocka_unit_test(test_decode_graph_masks_decide_tokens),
        cmocka_unit_test(test_async_masked_decode_waits_in_callback),
        cmocka_unit_test(test_async_rows_count_the_fed_token),
        cmocka_unit_test(test_chunked_prefill_matches_whole_prompt),
        cmocka_unit_test(test_gemm_band_one_plan_per_band),
        cmocka_unit_test(test_dummy_slot_reset_in_graph_and_live_blocks_untouched),
        cmocka_unit_test(test_seeded_sampling_repeats_after_rollback),
        cmocka_unit_test(test_forward_sampling_of_the_draft_matches_its_logits),
        cmocka_unit_test(test_spec_graph_greedy_equals_decode_and_dummy_reset),
        cmocka_unit_test(test_spec_graph_self_draft_accepts_nearly_all),
        cmocka_unit_test(test_spec_graph_chained_equals_one_at_a_time),
        cmocka_unit_test(test_verify_graph_greedy_equals_decode),
        cmocka_unit_test(test_verify_logits_equal_decode_bits),
        cmocka_unit_test(test_verify_graph_sampled_matches_host_acceptance),
        cmocka_unit_test(test_fp8_gemm_matches_exact_values),
        cmocka_unit_test(test_fp8_model_close_to_reference),
        cmocka_unit_test(test_kv_fp8_model_close_to_reference),
        cmocka_unit_test(test_fp8_gemm_timing_report),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
