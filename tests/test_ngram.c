/* Prompt-lookup drafting and the speculation cost model, as pure logic: the n-gram index
 * (what it proposes, that the longest and then the most recent match wins, no match no
 * draft, the same answers as a brute-force scan, bounded work per appended token) and
 * spec_cost (interpolation, which drafts pay for which step times). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/ngram.h"
#include "engine/core/spec_cost.h"

static int draft_of(const int32_t *t, int n, int min_n, int max_n, int k, int32_t *out, int *match) {
    ngram_index *ix = ngram_create(min_n, max_n, 256);
    assert_non_null(ix);
    ngram_update(ix, t, n);
    int d = ngram_draft(ix, t, n, k, out, match);
    ngram_destroy(ix);
    return d;
}

static void test_ngram_proposes_what_followed_the_earlier_match(void **st) {
    (void)st;
    int32_t t[] = {10, 11, 12, 13, 14, 15, 99, 11, 12};
    int32_t out[4];
    int match;
    assert_int_equal(draft_of(t, 9, 2, 4, 4, out, &match), 4);
    assert_int_equal(match, 2);
    int32_t want[4] = {13, 14, 15, 99};
    assert_memory_equal(out, want, sizeof want);
    /* k limits the proposal */
    assert_int_equal(draft_of(t, 9, 2, 4, 2, out, &match), 2);
    assert_int_equal(out[0], 13);
    assert_int_equal(out[1], 14);
}

static void test_ngram_longest_match_wins_over_a_more_recent_shorter_one(void **st) {
    (void)st;
    /* "6 7 8" was followed by 100; the more recent "7 8" (after 5) by 200 */
    int32_t t[] = {6, 7, 8, 100, 1, 5, 7, 8, 200, 2, 6, 7, 8};
    int32_t out[2];
    int match;
    assert_int_equal(draft_of(t, 13, 2, 4, 2, out, &match), 2);
    assert_int_equal(match, 3);
    assert_int_equal(out[0], 100);
    assert_int_equal(out[1], 1);
    /* with 2-grams only, the most recent occurrence of "7 8" wins */
    assert_int_equal(draft_of(t, 13, 2, 2, 2, out, &match), 2);
    assert_int_equal(match, 2);
    assert_int_equal(out[0], 200);
}

static void test_ngram_most_recent_occurrence_wins(void **st) {
    (void)st;
    int32_t t[] = {1, 2, 30, 1, 2, 40, 1, 2};
    int32_t out[1];
    assert_int_equal(draft_of(t, 8, 2, 4, 1, out, NULL), 1);
    assert_int_equal(out[0], 40);
}

static void test_ngram_no_match_no_draft(void **st) {
    (void)st;
    int32_t t[] = {1, 2, 3, 4, 5, 6, 7, 8};
    int32_t out[4] = {-1, -1, -1, -1};
    int match = -1;
    assert_int_equal(draft_of(t, 8, 2, 4, 4, out, &match), 0);
    assert_int_equal(match, 0);
    assert_int_equal(out[0], -1);
    /* a repeated single token is shorter than min_n = 2: no draft */
    int32_t u[] = {5, 9, 3, 5};
    assert_int_equal(draft_of(u, 4, 2, 4, 4, out, &match), 0);
    /* ... but with min_n = 1 it matches */
    assert_int_equal(draft_of(u, 4, 1, 4, 1, out, &match), 1);
    assert_int_equal(out[0], 9);
    /* the suffix never matches itself: a history of one n-gram has no draft */
    int32_t v[] = {4, 5};
    assert_int_equal(draft_of(v, 2, 2, 4, 4, out, &match), 0);
}

static void test_ngram_repeating_stretch_continues_its_period(void **st) {
    (void)st;
    int32_t t[] = {9, 1, 2, 3, 1, 2, 3, 1, 2};
    int32_t out[7];
    assert_int_equal(draft_of(t, 9, 2, 4, 7, out, NULL), 7);
    int32_t want[7] = {3, 1, 2, 3, 1, 2, 3};
    assert_memory_equal(out, want, sizeof want);
}

/* The most recent earlier occurrence of the longest suffix in [min_n, max_n], by a scan. */
static int brute_draft(const int32_t *t, int n, int min_n, int max_n, int k, int32_t *out) {
    for (int len = max_n < n ? max_n : n; len >= min_n; len--)
        for (int p = n - 1; p >= len; p--) {   /* continuation start p, n-gram ends at p - 1 */
            if (memcmp(t + p - len, t + n - len, sizeof(int32_t) * (size_t)len)) continue;
            for (int j = 0; j < k; j++) out[j] = p + j < n ? t[p + j] : out[j - (n - p)];
            return k;
        }
    return 0;
}

static void test_ngram_incremental_index_agrees_with_a_scan(void **st) {
    (void)st;
    enum { N = 3000 };
    int32_t *t = malloc(sizeof(int32_t) * N);
    srand(7);
    int checked = 0, drafted = 0;
    for (int vocab = 3; vocab <= 40; vocab += 37) {
        for (int i = 0; i < N; i++) t[i] = rand() % vocab;
        ngram_index *ix = ngram_create(2, 5, N);
        assert_non_null(ix);
        for (int n = 1; n <= N; n++) {
            /* every 7th position catches up several tokens at once, as after accepted drafts */
            if (n % 7 && n < N) continue;
            ngram_update(ix, t, n);
            int32_t a[6], b[6];
            int da = ngram_draft(ix, t, n, 6, a, NULL), db = brute_draft(t, n, 2, 5, 6, b);
            assert_int_equal(da, db);
            if (da) assert_memory_equal(a, b, sizeof(int32_t) * (size_t)da);
            checked++;
            drafted += da > 0;
        }
        ngram_destroy(ix);
    }
    print_message("  %d lookups checked against a scan, %d with a draft\n", checked, drafted);
    assert_true(drafted > 100 && drafted < checked);
    free(t);
}

static void test_ngram_update_work_per_token_is_constant(void **st) {
    (void)st;
    enum { N = 20000 };
    int32_t *t = malloc(sizeof(int32_t) * N);
    srand(11);
    for (int i = 0; i < N; i++) t[i] = rand() % 50;
    ngram_index *ix = ngram_create(2, 4, N);
    uint64_t at[N / 1000 + 1];
    for (int n = 1; n <= N; n++) {
        ngram_update(ix, t, n);
        if (n % 1000 == 0) at[n / 1000] = ngram_probes(ix);
    }
    /* 3 n-gram lengths per token; a half-full table needs few probes on average */
    double first = (double)at[1] / 1000, last = (double)(at[N / 1000] - at[N / 1000 - 1]) / 1000;
    print_message("  probes per token: %.2f over the first 1000, %.2f over the last 1000\n", first, last);
    assert_true(first >= 2.9);        /* every length is entered */
    assert_true(last <= 3 * 3.0);     /* and the cost did not grow with the history */
    assert_true(last <= 2.5 * first);
    ngram_destroy(ix);
    free(t);
}

static void test_ngram_rejects_bad_arguments(void **st) {
    (void)st;
    assert_null(ngram_create(0, 3, 10));
    assert_null(ngram_create(3, 2, 10));
    assert_null(ngram_create(1, NGRAM_MAX_N + 1, 10));
    assert_null(ngram_create(1, 2, 0));
}

/* ---- the cost model ---------------------------------------------------------------- */

/* t(B, k) = base + per_row * B + per_token * B * k, measured at B 1, 4 and k 0, 4. */
static void make_cost(spec_cost *c, double base, double per_row, double per_token) {
    memset(c, 0, sizeof *c);
    c->n_b = 2;
    c->b[0] = 1;
    c->b[1] = 4;
    c->n_k = 2;
    c->k[0] = 0;
    c->k[1] = 4;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) c->t[i][j] = base + per_row * c->b[i] + per_token * c->b[i] * c->k[j];
}

static void test_spec_cost_interpolates_and_extrapolates(void **st) {
    (void)st;
    spec_cost c;
    make_cost(&c, 1.0, 0.5, 0.25);
    assert_float_equal(spec_cost_step(&c, 1, 0), 1.5, 1e-9);
    assert_float_equal(spec_cost_step(&c, 4, 16), 1.0 + 2.0 + 4.0, 1e-9);
    assert_float_equal(spec_cost_step(&c, 2, 4), 1.0 + 1.0 + 1.0, 1e-9);   /* between B and k */
    assert_float_equal(spec_cost_step(&c, 8, 8), 1.0 + 4.0 + 2.0, 1e-9);   /* past B 4 */
    assert_float_equal(spec_cost_step(&c, 1, 8), 1.0 + 0.5 + 2.0, 1e-9);   /* past k 4 */
}

/* A predicted gain under SPEC_COST_MIN_GAIN drafts nothing; one above it drafts. Plain: one
 * token per 1.0 s; a draft token costs 0.1 s and stands with rate a: (1 + a) / 1.1 tokens
 * per second, which is 1.03 at a = 0.133. */
static void test_spec_cost_needs_a_margin_to_speculate(void **st) {
    (void)st;
    spec_cost c;
    spec_cost_cand cand[4];
    make_cost(&c, 1.0, 0.0, 0.1);
    int avail[1] = {1}, k[1];
    float alpha[1] = {0.12f};   /* 1.018x: a gain inside the noise */
    assert_int_equal(spec_cost_choose(&c, 1, 0, avail, alpha, k, cand), 0);
    assert_int_equal(k[0], 0);
    alpha[0] = 0.15f;           /* 1.045x */
    assert_int_equal(spec_cost_choose(&c, 1, 0, avail, alpha, k, cand), 1);
    assert_int_equal(k[0], 1);
}

/* The same margin for the two drafters whose decision is one depth for the whole step:
 * prompt lookup through the verify op (spec_cost_uniform_k) and a draft model
 * (spec_cost_draft_pays), on the same table: 1.018x drafts nothing, 1.045x drafts. */
static void test_uniform_depth_and_draft_model_need_the_margin(void **st) {
    (void)st;
    spec_cost c;
    make_cost(&c, 1.0, 0.0, 0.1);
    int avail[1] = {1};
    float alpha[1] = {0.12f};
    assert_int_equal(spec_cost_uniform_k(&c, 1, avail, alpha), 0);
    assert_false(spec_cost_draft_pays(&c, 1, 0, 1, 0.12));
    alpha[0] = 0.15f;
    assert_int_equal(spec_cost_uniform_k(&c, 1, avail, alpha), 1);
    assert_true(spec_cost_draft_pays(&c, 1, 0, 1, 0.15));
    /* two rows, one able to draft 4 at 0.9 and one 2 at 0.9, tokens cheap: the deepest cap
     * pays most (every row padded to it) */
    make_cost(&c, 1.0, 0.0, 0.01);
    int av2[2] = {4, 2};
    float al2[2] = {0.9f, 0.9f};
    assert_int_equal(spec_cost_uniform_k(&c, 2, av2, al2), 4);
    /* tokens as dear as a step: no depth pays, and no draft model either */
    make_cost(&c, 0.0, 1.0, 1.0);
    assert_int_equal(spec_cost_uniform_k(&c, 2, av2, al2), 0);
    assert_false(spec_cost_draft_pays(&c, 2, 0, 4, 0.9));
    assert_float_equal(spec_cost_expected(0.5, 3), 0.5 + 0.25 + 0.125, 1e-12);
}

static void test_spec_cost_free_verify_takes_every_draft(void **st) {
    (void)st;
    spec_cost c;
    spec_cost_cand cand[16];
    make_cost(&c, 1.0, 0.0, 0.0);   /* verify tokens cost nothing (a memory-bound GPU) */
    int avail[3] = {4, 2, 0}, k[3];
    float alpha[3] = {0.3f, 0.9f, 0.9f};
    assert_int_equal(spec_cost_choose(&c, 3, 0, avail, alpha, k, cand), 6);
    assert_int_equal(k[0], 4);
    assert_int_equal(k[1], 2);
    assert_int_equal(k[2], 0);
}

static void test_spec_cost_drafts_only_where_they_pay(void **st) {
    (void)st;
    spec_cost c;
    spec_cost_cand cand[16];
    /* a token costs a tenth of a row's share: a draft pays when its chance beats ~0.1 x
     * the value per second the step already has */
    make_cost(&c, 0.0, 1.0, 0.1);
    int avail[2] = {4, 4}, k[2];
    float alpha[2] = {0.9f, 0.05f};
    int total = spec_cost_choose(&c, 2, 0, avail, alpha, k, cand);
    assert_int_equal(k[1], 0);        /* a failing row drafts nothing */
    assert_int_equal(k[0], 4);        /* 0.9^4 = 0.66 still pays */
    assert_int_equal(total, 4);
    /* verify tokens as dear as rows (a compute-bound CPU at large batch): nothing pays */
    make_cost(&c, 0.0, 1.0, 1.0);
    alpha[1] = 0.9f;
    assert_int_equal(spec_cost_choose(&c, 2, 0, avail, alpha, k, cand), 0);
    assert_int_equal(k[0] + k[1], 0);
    int av[4];
    float al[4];
    int kk[4];
    assert_true(spec_cost_break_even(&c, 4, 4, cand, kk, av, al) > 1.0);
    make_cost(&c, 0.0, 1.0, 0.1);
    double be = spec_cost_break_even(&c, 4, 4, cand, kk, av, al);
    assert_true(be > 0.05 && be < 0.2);
}

/* Start-up timing said verify tokens are cheap; speculating steps then took ten times
 * what it predicted (host acceptance over full logits on a GPU): the learned scale makes
 * the model stop drafting at that batch size, leaves the plain step alone, and the other
 * batch size keeps its own scale. */
static void test_spec_cost_learns_what_speculating_steps_cost(void **st) {
    (void)st;
    spec_cost c;
    spec_cost_cand cand[16];
    make_cost(&c, 0.0, 1.0, 0.1);
    int avail[2] = {4, 4}, k[2];
    float alpha[2] = {0.8f, 0.8f};
    assert_true(spec_cost_choose(&c, 2, 0, avail, alpha, k, cand) > 0);
    double plain = spec_cost_step(&c, 2, 0), pred = spec_cost_step(&c, 1, 4);
    for (int i = 0; i < 20; i++) {
        double predicted = spec_cost_step(&c, 1, 4);   /* nearest measured B: 1 */
        spec_cost_observe(&c, 1, 4, 1.0 + 10 * (predicted - 1.0) / (c.scale[0] > 0 ? c.scale[0] : 1));
    }
    assert_true(c.scale[0] > 8 && c.scale[0] <= 10.01);
    assert_float_equal(spec_cost_step(&c, 2, 0), plain, 1e-12);     /* plain steps unchanged */
    assert_true(spec_cost_step(&c, 1, 4) > 3 * pred);   /* 1 + 0.4 x 10 against 1.4 */
    assert_int_equal(spec_cost_choose(&c, 1, 0, avail, alpha, k, cand), 0);
    assert_true(c.scale[1] == 0);                                     /* B 4 learned nothing */
    assert_true(spec_cost_choose(&c, 4, 0, (int[]){4, 4, 4, 4}, (float[]){0.8f, 0.8f, 0.8f, 0.8f},
                                 (int[4]){0}, cand) > 0);
    /* nonsense observations are ignored or clamped */
    spec_cost_observe(&c, 4, 0, 5.0);
    spec_cost_observe(&c, 4, 4, -1.0);
    assert_true(c.scale[1] == 0);
    /* one absurd step moves the scale by 1.3x, not to the clamp: a single slow pass (the
     * first of its shape) must not stop speculation, and with it the probes, for good */
    spec_cost_observe(&c, 4, 4, 1e9);
    assert_float_equal(c.scale[1], 1.3, 1e-9);
    for (int i = 0; i < 40; i++) spec_cost_observe(&c, 4, 4, 1e9);
    assert_float_equal(c.scale[1], 50, 1e-2);   /* what keeps coming is believed */
}

/* Plain steps hide the engine's host work under the step in flight; a speculating step,
 * synchronous, exposes it. With the host time learned per batch size and added to
 * speculating steps only, a row whose drafts paid on device time alone (1.0 s plain,
 * 1.225 s with 3 drafts at 0.5: 1.875 tokens) stops drafting once a host part of
 * 0.7 s a step (1.4 s exposed) eats the gain (the table in tenths of those times, as an
 * observation counts at most 0.1 s), drafts that nearly all stand still pay, the plain step's time is
 * unchanged, and the other batch size keeps its own estimate. */
static void test_spec_cost_counts_exposed_host_time_against_drafts(void **st) {
    (void)st;
    spec_cost c;
    spec_cost_cand cand[16];
    make_cost(&c, 1.0, 0.0, 0.075);   /* 4 drafts on one row: 1.3 s */
    int avail[1] = {4}, k[1];
    float alpha[1] = {0.5f};
    assert_true(spec_cost_choose(&c, 1, 0, avail, alpha, k, cand) > 0);
    assert_int_equal(spec_cost_uniform_k(&c, 1, avail, alpha), 3);   /* 1.875 in 1.225 s */
    assert_true(spec_cost_draft_pays(&c, 1, 0, 4, 0.5));
    /* host seconds over 0.1 count as 0.1 (a stall is not a step's work), so the same
     * table in tenths of those times */
    make_cost(&c, 0.1, 0.0, 0.0075);
    for (int i = 0; i < 200; i++) spec_cost_observe_host(&c, 1, 0.07);
    assert_float_equal(c.host[0], 0.07, 1e-6);
    assert_true(c.host[1] == 0);   /* B 4 learned nothing */
    const double h0 = c.host[0];
    assert_float_equal(spec_cost_observe_host(&c, 1, 5.0), 0.9 * h0 + 0.1 * 0.1, 1e-12);
    c.host[0] = h0;
    assert_float_equal(spec_cost_step(&c, 1, 0), 0.1, 1e-12);   /* plain steps: as measured */
    assert_float_equal(spec_cost_spec_step(&c, 1, 4), 0.13 + SPEC_COST_HOST_STEPS * c.host[0], 1e-12);
    assert_int_equal(spec_cost_choose(&c, 1, 0, avail, alpha, k, cand), 0);
    assert_int_equal(spec_cost_uniform_k(&c, 1, avail, alpha), 0);
    assert_false(spec_cost_draft_pays(&c, 1, 0, 4, 0.5));
    /* drafts that nearly all stand still pay it: 1 + 3.52 tokens in 0.27 s */
    alpha[0] = 0.95f;
    assert_int_equal(spec_cost_uniform_k(&c, 1, avail, alpha), 4);
    /* B 2 takes B 1's estimate (nearest), B 4 has none */
    assert_float_equal(spec_cost_spec_step(&c, 2, 8), spec_cost_step(&c, 2, 8) + SPEC_COST_HOST_STEPS * c.host[0],
                       1e-12);
    assert_float_equal(spec_cost_spec_step(&c, 4, 16), spec_cost_step(&c, 4, 16), 1e-12);
    /* nonsense is ignored; the estimate follows what steps cost now */
    const double h = c.host[0];
    spec_cost_observe_host(&c, 1, -1.0);
    spec_cost_observe_host(&c, 1, 0.0 / 0.0);
    spec_cost_observe_host(&c, 0, 1.0);
    assert_true(c.host[0] == h && c.host[1] == 0);
    for (int i = 0; i < 200; i++) spec_cost_observe_host(&c, 1, 0.0);
    assert_true(c.host[0] < 1e-9);
    alpha[0] = 0.5f;
    assert_int_equal(spec_cost_uniform_k(&c, 1, avail, alpha), 3);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ngram_proposes_what_followed_the_earlier_match),
        cmocka_unit_test(test_ngram_longest_match_wins_over_a_more_recent_shorter_one),
        cmocka_unit_test(test_ngram_most_recent_occurrence_wins),
        cmocka_unit_test(test_ngram_no_match_no_draft),
        cmocka_unit_test(test_ngram_repeating_stretch_continues_its_period),
        cmocka_unit_test(test_ngram_incremental_index_agrees_with_a_scan),
        cmocka_unit_test(test_ngram_update_work_per_token_is_constant),
        cmocka_unit_test(test_ngram_rejects_bad_arguments),
        cmocka_unit_test(test_spec_cost_interpolates_and_extrapolates),
        cmocka_unit_test(test_uniform_depth_and_draft_model_need_the_margin),
        cmocka_unit_test(test_spec_cost_free_verify_takes_every_draft),
        cmocka_unit_test(test_spec_cost_needs_a_margin_to_speculate),
        cmocka_unit_test(test_spec_cost_drafts_only_where_they_pay),
        cmocka_unit_test(test_spec_cost_learns_what_speculating_steps_cost),
        cmocka_unit_test(test_spec_cost_counts_exposed_host_time_against_drafts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
