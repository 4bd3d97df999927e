/* engine_warmup (the server's start-up warm-up): it runs the ladder of prompt sizes, the
 * batches and the sampled rows it reports, and leaves nothing behind that a fresh engine
 * would not show: no cached KV blocks, no KV in use, cumulative counters as before, and
 * the same tokens for a request that follows (greedy and seeded, with prompt lookup on so
 * the drafter's state is covered too). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/engine.h"
#include "tests/fixtures.h"

#define GEN 24

static engine *make(int ngram) {
    char path[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/models/llama-tiny", fixtures_dir());
    engine_config c = {.model_path = path, .max_seq_len = 300, .max_batch = 8, .threads = 2,
                       .max_tokens_per_step = 256, .spec_ngram = ngram, .cpu_verify = ngram};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("engine_create: %s", err);
    return e;
}

/* One greedy and one seeded request with a repetitive prompt (drafts for prompt lookup);
 * their tokens into out[2][GEN]. */
static void run_pair(engine *e, int32_t out[2][GEN], int *cached) {
    int32_t prompt[40];
    for (int i = 0; i < 40; i++) prompt[i] = (int32_t)(7 * (i % 9) + 3);
    for (int k = 0; k < 2; k++) {
        engine_sampling sp;
        engine_sampling_defaults(&sp);
        sp.temperature = k ? 0.9f : 0.0f;
        sp.seed = 11;
        sp.has_seed = 1;
        sp.max_tokens = GEN;
        sp.ignore_eos = 1;
        char err[256] = "";
        if (engine_add(e, (uint64_t)k + 1, prompt, 40, &sp, err, sizeof err)) fail_msg("engine_add: %s", err);
    }
    int n[2] = {0, 0};
    *cached = 0;
    while (engine_has_work(e)) {
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int i = 0; i < o.n_events; i++) {
            const engine_event *ev = &o.events[i];
            int k = (int)ev->req_id - 1;
            assert_true(k == 0 || k == 1);
            for (int j = 0; j < ev->n_tokens && n[k] < GEN; j++) out[k][n[k]++] = ev->tokens[j].id;
            if (ev->finish != ENGINE_RUNNING) *cached += ev->n_cached_tokens;
        }
    }
    assert_int_equal(n[0], GEN);
    assert_int_equal(n[1], GEN);
}

static void same_counters(const engine_stats *a, const engine_stats *b) {
    assert_true(a->prompt_tokens == b->prompt_tokens);
    assert_true(a->generation_tokens == b->generation_tokens);
    assert_true(a->prefix_cache_hit_tokens == b->prefix_cache_hit_tokens);
    assert_true(a->preemptions == b->preemptions);
    assert_true(a->spec_drafts == b->spec_drafts);
    assert_true(a->spec_draft_tokens == b->spec_draft_tokens);
    assert_true(a->spec_accepted_tokens == b->spec_accepted_tokens);
    assert_true(a->spec_steps_decoding == b->spec_steps_decoding);
    assert_true(a->steps_runner_verify == b->steps_runner_verify);
    assert_true(a->steps_composed == b->steps_composed);
    assert_true(a->steps_device_decode == b->steps_device_decode);
    assert_true(a->run_seconds == b->run_seconds);
    assert_true(a->step_seconds == b->step_seconds);
}

static void check_warmup(int ngram) {
    int32_t fresh[2][GEN], warmed[2][GEN];
    int cached;
    engine *e = make(ngram);
    run_pair(e, fresh, &cached);
    engine_stats s;
    engine_get_stats(e, &s);
    assert_true(s.kv_blocks_cached > 0);   /* what the warm-up must not leave behind */
    engine_destroy(e);

    e = make(ngram);
    engine_stats before, after;
    engine_get_stats(e, &before);
    engine_warmup_info wi;
    char err[256] = "";
    if (engine_warmup(e, &wi, err, sizeof err)) fail_msg("engine_warmup: %s", err);
    /* 1-8, then x1.5: 12 18 27 40 60, then multiples of 64 up to the budget 256; batches
     * 2 and 8; the sampled rows */
    assert_int_equal(wi.max_prompt, 256);
    assert_int_equal(wi.max_batch, 8);
    assert_int_equal(wi.passes, 8 + 5 + 4 + 2 + 1);
    engine_get_stats(e, &after);
    same_counters(&before, &after);
    assert_int_equal(after.kv_blocks_cached, 0);
    assert_int_equal(after.kv_blocks_used, 0);
    assert_int_equal(after.kv_blocks_free, before.kv_blocks_free);
    run_pair(e, warmed, &cached);
    assert_int_equal(cached, 0);
    assert_memory_equal(fresh, warmed, sizeof fresh);
    engine_destroy(e);
}

static void test_warmup_leaves_a_fresh_engine(void **s) {
    (void)s;
    check_warmup(0);
}

static void test_warmup_with_prompt_lookup(void **s) {
    (void)s;
    check_warmup(1);
}

/* A busy engine is refused, and nothing of it is disturbed. */
static void test_warmup_needs_idle_engine(void **s) {
    (void)s;
    engine *e = make(0);
    int32_t p[4] = {5, 6, 7, 8};
    engine_sampling sp;
    engine_sampling_defaults(&sp);
    sp.max_tokens = 3;
    char err[256] = "";
    assert_int_equal(engine_add(e, 1, p, 4, &sp, err, sizeof err), 0);
    engine_warmup_info wi;
    assert_int_not_equal(engine_warmup(e, &wi, err, sizeof err), 0);
    assert_non_null(strstr(err, "idle"));
    int got = 0;
    while (engine_has_work(e)) {
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int i = 0; i < o.n_events; i++) got += o.events[i].n_tokens;
    }
    assert_int_equal(got, 3);
    engine_destroy(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_warmup_leaves_a_fresh_engine),
        cmocka_unit_test(test_warmup_with_prompt_lookup),
        cmocka_unit_test(test_warmup_needs_idle_engine),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
