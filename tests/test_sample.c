/* Host sampling against plain references written out in the test: temperature / top-k /
 * top-p / min-p filtering (the fast partial selection must keep exactly the set a full
 * sort keeps, ties included), penalties and logit bias (also from token statistics, as
 * the runners take them), top logprobs, and the counter-based uniforms. Inputs are
 * random, seeded per run (the seed is printed). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "engine/core/sample.h"

static uint64_t g_seed;

static double urand(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*s >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- reference: softmax, full sort (prob desc, id asc), top-k, top-p, min-p ---- */

static const double *g_ref_p;
static int ref_cmp(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    if (g_ref_p[x] != g_ref_p[y]) return g_ref_p[x] > g_ref_p[y] ? -1 : 1;
    return x - y;
}

static void ref_probs(const float *logits, int V, const sample_params *sp, double *out) {
    double mx = -INFINITY, sum = 0;
    double *p = malloc(sizeof(double) * V);
    float *t = malloc(sizeof(float) * V);
    for (int i = 0; i < V; i++) t[i] = logits[i] * (1.0f / sp->temperature);
    for (int i = 0; i < V; i++) mx = t[i] > mx ? t[i] : mx;
    for (int i = 0; i < V; i++) sum += (p[i] = expf(t[i] - (float)mx));
    for (int i = 0; i < V; i++) p[i] = (float)(p[i] / sum);   /* as float, like the code under test */
    int *idx = malloc(sizeof(int) * V);
    for (int i = 0; i < V; i++) idx[i] = i;
    g_ref_p = p;
    qsort(idx, (size_t)V, sizeof(int), ref_cmp);
    int keep = sp->top_k > 0 && sp->top_k < V ? sp->top_k : V;
    if (sp->top_p > 0 && sp->top_p < 1) {
        double tot = 0, cum = 0;
        for (int i = 0; i < keep; i++) tot += p[idx[i]];
        int j = 0;
        while (j < keep && cum < sp->top_p) cum += p[idx[j++]] / tot;
        keep = j < 1 ? 1 : j;
    }
    for (int i = 0; i < V; i++) out[i] = 0;
    for (int i = 0; i < keep; i++) out[idx[i]] = p[idx[i]];
    if (sp->min_p > 0) {
        double th = sp->min_p * p[idx[0]];
        for (int i = 0; i < V; i++)
            if (out[i] < th) out[i] = 0;
    }
    double s = 0;
    for (int i = 0; i < V; i++) s += out[i];
    for (int i = 0; i < V; i++) out[i] /= s;
    free(p);
    free(t);
    free(idx);
}

static void check_filter(int V, int n_levels, const sample_params *sp, uint64_t *rs) {
    float *lg = malloc(sizeof(float) * V), *got = malloc(sizeof(float) * V);
    double *want = malloc(sizeof(double) * V);
    int *scratch = malloc(sizeof(int) * V);
    for (int i = 0; i < V; i++)  /* n_levels > 0: few distinct values, so many exact ties */
        lg[i] = n_levels ? (float)(int)(urand(rs) * n_levels) : (float)(urand(rs) * 12.0 - 6.0);
    memcpy(got, lg, sizeof(float) * V);
    sample_probs(got, V, sp, scratch);
    ref_probs(lg, V, sp, want);
    int kept = 0;
    for (int i = 0; i < V; i++) {
        if ((got[i] > 0) != (want[i] > 0))
            fail_msg("token %d kept=%d, reference kept=%d (V %d, top_k %d, top_p %.3f, min_p %.3f, levels %d, "
                     "seed %llu)", i, got[i] > 0, want[i] > 0, V, sp->top_k, sp->top_p, sp->min_p, n_levels,
                     (unsigned long long)g_seed);
        assert_true(fabs(got[i] - want[i]) <= 1e-5 * (want[i] > 1e-3 ? want[i] : 1e-3));
        kept += got[i] > 0;
    }
    if (sp->top_k > 0 && sp->top_k < V && !sp->min_p && !(sp->top_p > 0 && sp->top_p < 1)) assert_int_equal(kept, sp->top_k);
    free(lg);
    free(got);
    free(want);
    free(scratch);
}

static void test_filters_keep_exactly_the_reference_set(void **st) {
    (void)st;
    uint64_t rs = g_seed;
    const int ks[] = {0, 1, 2, 7, 50, 5000};
    const float ps[] = {1.0f, 0.95f, 0.6f, 0.2f, 0.001f};
    const float mps[] = {0, 0.05f, 0.5f};
    const int levels[] = {0, 3, 40};
    int cases = 0;
    for (size_t a = 0; a < sizeof ks / sizeof ks[0]; a++)
        for (size_t b = 0; b < sizeof ps / sizeof ps[0]; b++)
            for (size_t c = 0; c < sizeof mps / sizeof mps[0]; c++)
                for (size_t d = 0; d < sizeof levels / sizeof levels[0]; d++) {
                    sample_params sp = {.temperature = d == 1 ? 0.7f : 1.3f, .top_k = ks[a], .top_p = ps[b],
                                        .min_p = mps[c]};
                    check_filter(d == 2 ? 49152 : 1024, levels[d], &sp, &rs);
                    cases++;
                }
    print_message("  %d filter cases equal to the full-sort reference\n", cases);
}

static void test_penalties_and_bias(void **st) {
    (void)st;
    enum { V = 50 };
    float lg[V], want[V];
    uint64_t rs = g_seed ^ 0x1234;
    for (int i = 0; i < V; i++) want[i] = lg[i] = (float)(urand(&rs) * 4 - 2);
    int32_t hist[] = {3, 4, 4, /* prompt | generated */ 4, 9, 9, 9, 11};
    int n_prompt = 3, n_hist = 8;
    int32_t bias_ids[] = {7, 9};
    float bias_vals[] = {5.0f, -1.0f};
    int32_t eos[] = {2};
    sample_params sp = {.temperature = 1, .repetition_penalty = 1.3f, .presence_penalty = 0.5f,
                        .frequency_penalty = 0.25f, .n_logit_bias = 2, .logit_bias_ids = bias_ids,
                        .logit_bias_vals = bias_vals, .suppress_eos = 1, .eos_ids = eos, .n_eos = 1};
    int scratch[V];
    sample_apply_penalties(lg, V, &sp, hist, n_hist, n_prompt, scratch);
    /* reference, written out: bias, EOS, repetition over every seen id once, then
     * presence + frequency x count over generated tokens */
    want[7] += 5.0f;
    want[9] += -1.0f;
    want[2] = -INFINITY;
    int seen[] = {3, 4, 9, 11};
    for (int i = 0; i < 4; i++) {
        float l = want[seen[i]];
        want[seen[i]] = l > 0 ? l / 1.3f : l * 1.3f;
    }
    want[4] -= 0.25f * 1 + 0.5f;   /* generated once (the prompt's 4s do not count) */
    want[9] -= 0.25f * 3 + 0.5f;
    want[11] -= 0.25f * 1 + 0.5f;
    for (int i = 0; i < V; i++) {
        if (isinf(want[i])) assert_true(isinf(lg[i]) && lg[i] < 0);
        else assert_true(fabsf(lg[i] - want[i]) < 1e-6f);
    }
}

/* The runners' form of the penalties: a request's token statistics, kept token by token,
 * give bit-identical logits to the history form, with and without a repetition penalty
 * (without one, only generated tokens are listed, as the engine does); so do the
 * statistics plus one fed token the list lacks (sample_apply_penalties_fed). */
static void test_sparse_penalties_equal_history_penalties(void **st) {
    (void)st;
    enum { V = 300, NP = 40, NH = 160 };
    uint64_t rs = g_seed ^ 0x5eed;
    int32_t hist[NH], bias_ids[6] = {5, 17, 5, 299, 300, -1}, eos[3] = {2, 7, 2};
    float bias_vals[6] = {1.5f, -2.25f, 0.75f, 3.0f, 9.0f, 9.0f};   /* 5 twice; 300, -1 skipped */
    for (int i = 0; i < NH; i++) hist[i] = (int32_t)(urand(&rs) * 60);   /* many repeats */
    int scratch[V];
    for (int c = 0; c < 4; c++) {
        sample_params sp = {.temperature = 1, .presence_penalty = c & 1 ? 0.5f : 0.f,
                            .frequency_penalty = c & 1 ? 0.3f : 0.f, .repetition_penalty = c & 2 ? 1.7f : 1.f,
                            .n_logit_bias = 6, .logit_bias_ids = bias_ids, .logit_bias_vals = bias_vals,
                            .suppress_eos = c == 3, .eos_ids = eos, .n_eos = 3};
        if (c == 0) sp.presence_penalty = -0.4f;   /* presence alone, negative */
        int rep = c & 2;
        sample_stats ts;
        assert_int_equal(sample_stats_init(&ts, NH), 0);
        for (int i = 0; i < NP && rep; i++) assert_int_equal(sample_stats_add(&ts, hist[i], 0), 0);
        for (int n = NP; n <= NH; n += 20) {
            for (int i = n - 20 < NP ? NP : n - 20; i < n; i++) assert_int_equal(sample_stats_add(&ts, hist[i], 1), 0);
            float a[V], b[V];
            for (int i = 0; i < V; i++) a[i] = b[i] = (float)(urand(&rs) * 8 - 4);
            sample_apply_penalties(a, V, &sp, hist, n, NP, scratch);
            sample_apply_penalties_sparse(b, V, &sp, ts.ids, ts.counts, ts.n);
            assert_memory_equal(a, b, sizeof a);
            /* one more generated token the statistics lack (runner_sampling.stats_fed): the
             * next one of the history (listed or not), and an id never seen */
            int32_t h2[NH + 1];
            memcpy(h2, hist, sizeof(int32_t) * (size_t)n);
            for (int k = 0; k < 2; k++) {
                h2[n] = k == 0 && n < NH ? hist[n] : (int32_t)(250 + n % 40);
                for (int i = 0; i < V; i++) a[i] = b[i] = (float)(urand(&rs) * 8 - 4);
                sample_apply_penalties(a, V, &sp, h2, n + 1, NP, scratch);
                sample_apply_penalties_fed(b, V, &sp, ts.ids, ts.counts, ts.n, h2[n]);
                assert_memory_equal(a, b, sizeof a);
            }
        }
        /* every distinct id once, with its generated count */
        for (int j = 0; j < ts.n; j++) {
            int cnt = 0, seen = 0;
            for (int i = 0; i < NH; i++) {
                cnt += i >= NP && hist[i] == ts.ids[j];
                seen |= hist[i] == ts.ids[j];
            }
            assert_true(seen);
            assert_int_equal(ts.counts[j], cnt);
            for (int k = 0; k < j; k++) assert_true(ts.ids[k] != ts.ids[j]);
        }
        sample_stats_free(&ts);
    }
    sample_stats ts;
    assert_int_equal(sample_stats_init(&ts, 2), 0);
    assert_int_equal(sample_stats_add(&ts, 4, 1), 0);
    assert_int_equal(sample_stats_add(&ts, 9, 0), 0);
    assert_int_equal(sample_stats_add(&ts, 4, 1), 0);
    assert_int_equal(sample_stats_add(&ts, 5, 1), -1);   /* full */
    assert_int_equal(ts.n, 2);
    assert_int_equal(ts.counts[0], 2);
    assert_int_equal(ts.counts[1], 0);
    sample_stats_free(&ts);
}

static void test_top_logprobs_sorted_and_exact(void **st) {
    (void)st;
    enum { V = 3000 };
    float lg[V];
    uint64_t rs = g_seed ^ 0x99;
    for (int i = 0; i < V; i++) lg[i] = (float)(urand(&rs) * 10 - 5);
    int32_t ids[20];
    float lps[20];
    assert_int_equal(sample_top_logprobs(lg, V, 20, ids, lps), 20);
    double mx = -INFINITY, s = 0;
    for (int i = 0; i < V; i++) mx = lg[i] > mx ? lg[i] : mx;
    for (int i = 0; i < V; i++) s += exp(lg[i] - mx);
    for (int r = 0; r < 20; r++) {
        int better = 0;   /* exactly r tokens beat the r-th */
        for (int i = 0; i < V; i++) better += lg[i] > lg[ids[r]];
        assert_int_equal(better, r);
        assert_true(fabs(lps[r] - (lg[ids[r]] - mx - log(s))) < 1e-4);
        assert_true(fabs(sample_logprob(lg, V, ids[r]) - lps[r]) < 1e-5);
    }
}

static void test_uniforms_are_reproducible_and_uniform(void **st) {
    (void)st;
    int bins[10] = {0};
    for (uint64_t c = 0; c < 100000; c++) {
        double u = sample_uniform(42, c);
        assert_true(u >= 0 && u < 1);
        assert_true(u == sample_uniform(42, c));
        bins[(int)(u * 10)]++;
    }
    for (int b = 0; b < 10; b++) assert_true(bins[b] > 9500 && bins[b] < 10500);
    assert_true(sample_uniform(42, 7) != sample_uniform(43, 7));
}

int main(void) {
    const char *s = getenv("SPECD_TEST_SEED");
    g_seed = s ? strtoull(s, NULL, 10) : (uint64_t)time(NULL);
    printf("test_sample: seed %llu (SPECD_TEST_SEED=%llu replays it)\n", (unsigned long long)g_seed,
           (unsigned long long)g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_filters_keep_exactly_the_reference_set),
        cmocka_unit_test(test_penalties_and_bias),
        cmocka_unit_test(test_sparse_penalties_equal_history_penalties),
        cmocka_unit_test(test_top_logprobs_sorted_and_exact),
        cmocka_unit_test(test_uniforms_are_reproducible_and_uniform),
    };
    return cmocka_run_group_tests_name("sample", tests, NULL, NULL);
}
