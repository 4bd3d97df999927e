/* Prompt logprobs (engine_sampling.prompt_logprobs) and max_tokens 0 through the engine on
 * the fixture models: each prompt token's logprob equals log_softmax(all_logits[i-1])
 * [prompt[i]] of HF transformers' fp32 reference, whole, in chunked prefill, and with the
 * prompt already in the prefix cache; they come with the event that ends the prompt;
 * max_tokens 0 ends ("length") after the prompt with no token. The runner's own prompt
 * logprobs (forced rows of its sampling forward) equal the host's, bit for bit. */
#include <math.h>
#include <stdlib.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/engine.h"
#include "tests/fixtures.h"

#define LP_TOL 1e-4

typedef struct {
    json_t *g;                   /* golden.json */
    json_t *all;                 /* all_logits of the 33-token prompt */
    int32_t *ids;
    int n, V;
    double *ref;                 /* [n, V] log_softmax of all_logits */
} golden_prompt;

static void load_golden(const char *name, golden_prompt *gp) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s/golden.json", name);
    gp->g = fixture_json(rel);
    assert_non_null(gp->g);
    json_t *prompts = json_object_get(gp->g, "prompts"), *cs = NULL;
    for (size_t i = 0; i < json_array_size(prompts); i++)
        if (json_object_get(json_array_get(prompts, i), "all_logits")) cs = json_array_get(prompts, i);
    assert_non_null(cs);
    gp->all = json_object_get(cs, "all_logits");
    gp->ids = json_ids(json_object_get(cs, "prompt"), &gp->n);
    gp->V = (int)json_array_size(json_array_get(gp->all, 0));
    gp->ref = malloc(sizeof *gp->ref * (size_t)gp->n * gp->V);
    for (int p = 0; p < gp->n; p++) {
        json_t *row = json_array_get(gp->all, (size_t)p);
        double *o = gp->ref + (size_t)p * gp->V, mx = -INFINITY, sum = 0;
        for (int i = 0; i < gp->V; i++) mx = fmax(mx, o[i] = json_number_value(json_array_get(row, (size_t)i)));
        for (int i = 0; i < gp->V; i++) sum += exp(o[i] - mx);
        for (int i = 0; i < gp->V; i++) o[i] -= mx + log(sum);
    }
}

/* log_softmax(all_logits[pos])[tok] in double precision (gp->ref, filled once). */
static double ref_logprob(const golden_prompt *gp, int pos, int tok) { return gp->ref[(size_t)pos * gp->V + tok]; }

static engine *open_engine(const char *name, int max_tokens_per_step, int max_batch) {
    char path[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/models/%s", fixtures_dir(), name);
    engine_config c = {.model_path = path, .max_seq_len = 512, .max_batch = max_batch,
                       .max_tokens_per_step = max_tokens_per_step, .kv_bytes = 32u << 20, .threads = 2};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fprintf(stderr, "engine_create(%s): %s\n", name, err);
    assert_non_null(e);
    return e;
}

typedef struct {
    engine_token *prompt;        /* copy of the delivered prompt entries, or NULL */
    int n_prompt;
    int32_t out[64];
    int n_out;
    engine_finish finish;
    int events_before_prompt;    /* events of this request before the prompt entries came */
} run_result;

/* Run requests (ids 0..n-1, all added first) to the end. */
static void run_all(engine *e, int n, run_result *res) {
    memset(res, 0, sizeof *res * (size_t)n);
    while (engine_has_work(e)) {
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int k = 0; k < o.n_events; k++) {
            const engine_event *ev = &o.events[k];
            run_result *r = &res[ev->req_id];
            if (ev->prompt_tokens) {
                assert_null(r->prompt);   /* delivered once */
                r->n_prompt = ev->n_prompt_tokens;
                r->prompt = malloc(sizeof *r->prompt * (size_t)r->n_prompt);
                memcpy(r->prompt, ev->prompt_tokens, sizeof *r->prompt * (size_t)r->n_prompt);
            } else if (!r->prompt) {
                r->events_before_prompt++;
            }
            for (int t = 0; t < ev->n_tokens; t++) r->out[r->n_out++] = ev->tokens[t].id;
            if (ev->finish != ENGINE_RUNNING) r->finish = ev->finish;
        }
    }
}

/* record: the request's first-token logits kept (engine_add_ex), which keeps its sampling
 * on the host: the reference path for the runner's own prompt logprobs. */
static void add_ex(engine *e, uint64_t id, const int32_t *ids, int n, int prompt_logprobs, int max_tokens,
                   int record) {
    engine_sampling sp;
    engine_sampling_defaults(&sp);
    sp.temperature = 0;
    sp.ignore_eos = 1;
    sp.max_tokens = max_tokens;
    sp.prompt_logprobs = prompt_logprobs;
    char err[256] = "";
    assert_int_equal(engine_add_ex(e, id, ids, n, &sp, record, err, sizeof err), 0);
}

static void add(engine *e, uint64_t id, const int32_t *ids, int n, int prompt_logprobs, int max_tokens) {
    add_ex(e, id, ids, n, prompt_logprobs, max_tokens, 0);
}

/* Entry 0 has no logprob; entry i matches the reference, its top-N too (sorted, the top
 * one being the reference's argmax). Returns the worst absolute error. */
static double check_against_golden(const golden_prompt *gp, const run_result *r, int top_n) {
    assert_non_null(r->prompt);
    assert_int_equal(r->n_prompt, gp->n);
    assert_true(isnan(r->prompt[0].logprob));
    assert_int_equal(r->prompt[0].n_top, 0);
    double worst = 0;
    for (int i = 1; i < gp->n; i++) {
        const engine_token *t = &r->prompt[i];
        assert_int_equal(t->id, gp->ids[i]);
        assert_false(isnan(t->logprob));   /* fmax below would hide a NAN */
        worst = fmax(worst, fabs(t->logprob - ref_logprob(gp, i - 1, gp->ids[i])));
        assert_int_equal(t->n_top, top_n);
        for (int j = 0; j < top_n; j++) {
            worst = fmax(worst, fabs(t->top_logprobs[j] - ref_logprob(gp, i - 1, t->top_ids[j])));
            if (j) assert_true(t->top_logprobs[j] <= t->top_logprobs[j - 1]);
        }
        if (top_n) assert_true(t->top_logprobs[0] >= t->logprob - 1e-6);
        int rank = 1;   /* under the reference */
        for (int v = 0; v < gp->V; v++) rank += ref_logprob(gp, i - 1, v) > ref_logprob(gp, i - 1, gp->ids[i]) + 1e-5;
        assert_true(abs(t->rank - rank) <= 1);   /* a near tie may order either way */
        if (top_n && t->top_ids[0] == t->id) assert_int_equal(t->rank, 1);
    }
    return worst;
}

static void check_model(const char *name) {
    golden_prompt gp;
    load_golden(name, &gp);
    run_result r[3];

    /* whole prompt in one step, max_tokens 0: the prompt only */
    engine *e = open_engine(name, 2048, 4);
    add(e, 0, gp.ids, gp.n, 3, 0);
    run_all(e, 1, r);
    assert_int_equal(r[0].finish, ENGINE_FINISH_LENGTH);
    assert_int_equal(r[0].n_out, 0);
    assert_int_equal(r[0].events_before_prompt, 0);
    double whole = check_against_golden(&gp, &r[0], 3);
    assert_true(whole < LP_TOL);
    free(r[0].prompt);

    /* the prompt is now cached: a request with prompt logprobs still computes it all... */
    engine_stats st0, st1, st2;
    engine_get_stats(e, &st0);
    add(e, 1, gp.ids, gp.n, 0, 2);
    run_all(e, 2, r);
    engine_get_stats(e, &st1);
    assert_int_equal(st1.prefix_cache_hit_tokens, st0.prefix_cache_hit_tokens);
    double cached = check_against_golden(&gp, &r[1], 0);
    assert_true(cached < LP_TOL);
    /* ...with the first token in the same event; greedy = argmax of the last position */
    assert_int_equal(r[1].finish, ENGINE_FINISH_LENGTH);
    assert_int_equal(r[1].n_out, 2);
    int best = 0;
    for (int v = 1; v < gp.V; v++)
        if (ref_logprob(&gp, gp.n - 1, v) > ref_logprob(&gp, gp.n - 1, best)) best = v;
    assert_int_equal(r[1].out[0], best);
    free(r[1].prompt);
    /* (the cache was warm: a plain request hits it) */
    add(e, 0, gp.ids, gp.n, -1, 1);
    run_all(e, 1, r);
    engine_get_stats(e, &st2);
    assert_true(st2.prefix_cache_hit_tokens > st1.prefix_cache_hit_tokens);
    assert_null(r[0].prompt);
    engine_destroy(e);

    /* chunked prefill: 5 tokens a step, so 7 chunks each give their logits */
    e = open_engine(name, 5, 4);
    add(e, 0, gp.ids, gp.n, 2, 1);
    run_all(e, 1, r);
    double chunked = check_against_golden(&gp, &r[0], 2);
    assert_true(chunked < LP_TOL);
    assert_int_equal(r[0].events_before_prompt, 0);
    assert_int_equal(r[0].n_out, 1);
    assert_int_equal(r[0].out[0], best);
    free(r[0].prompt);

    /* max_tokens 0 without prompt logprobs: no token, no entries */
    add(e, 0, gp.ids, gp.n, -1, 0);
    run_all(e, 1, r);
    assert_int_equal(r[0].finish, ENGINE_FINISH_LENGTH);
    assert_int_equal(r[0].n_out, 0);
    assert_null(r[0].prompt);
    engine_destroy(e);
    print_message("  %-11s prompt logprobs, worst abs err: whole %.2e, cached %.2e, chunked %.2e\n", name, whole,
                  cached, chunked);
    free(gp.ids);
    free(gp.ref);
    json_decref(gp.g);
}

static void test_prompt_logprobs_match_hf_reference(void **st) {
    (void)st;
    check_model("llama-tiny");
    check_model("qwen3-tiny");
}

/* Prompts longer than the step's prompt-logits budget (256 positions), two at once: they
 * share the budget over several steps and give the same numbers as a run fed 9 tokens a
 * step, and their first 33 positions match the reference. */
static void test_long_prompts_share_the_logits_budget(void **st) {
    (void)st;
    golden_prompt gp;
    load_golden("llama-tiny", &gp);
    int n = 9 * gp.n;
    int32_t *ids = malloc(sizeof *ids * (size_t)n);
    for (int i = 0; i < n; i++) ids[i] = gp.ids[i % gp.n];
    run_result a[2], b[1];
    engine *e = open_engine("llama-tiny", 2048, 4);
    add(e, 0, ids, n, 1, 1);
    add(e, 1, ids, n, 1, 1);
    int steps = 0;
    memset(a, 0, sizeof a);
    while (engine_has_work(e)) {   /* run_all, counting steps and tokens per step */
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        assert_true(o.n_scheduled_tokens <= 256 + 2);
        steps++;
        for (int k = 0; k < o.n_events; k++) {
            const engine_event *ev = &o.events[k];
            if (!ev->prompt_tokens) continue;
            run_result *r = &a[ev->req_id];
            r->n_prompt = ev->n_prompt_tokens;
            r->prompt = malloc(sizeof *r->prompt * (size_t)n);
            memcpy(r->prompt, ev->prompt_tokens, sizeof *r->prompt * (size_t)n);
        }
    }
    assert_true(steps >= 3);   /* 2 x 297 positions over a 256 budget */
    engine_destroy(e);
    e = open_engine("llama-tiny", 9, 4);
    add(e, 0, ids, n, 1, 1);
    run_all(e, 1, b);
    engine_destroy(e);
    double worst = 0;
    for (int r = 0; r < 2; r++) {
        assert_non_null(a[r].prompt);
        assert_int_equal(a[r].n_prompt, n);
        for (int i = 1; i < n; i++) {
            assert_int_equal(a[r].prompt[i].top_ids[0], b[0].prompt[i].top_ids[0]);
            assert_false(isnan(a[r].prompt[i].logprob) || isnan(b[0].prompt[i].logprob));
            worst = fmax(worst, fabs(a[r].prompt[i].logprob - b[0].prompt[i].logprob));
            if (i < gp.n) worst = fmax(worst, fabs(a[r].prompt[i].logprob - ref_logprob(&gp, i - 1, ids[i])));
        }
        free(a[r].prompt);
    }
    print_message("  llama-tiny 2 x %d-token prompts in %d steps: worst abs err %.2e\n", n, steps, worst);
    assert_true(worst < LP_TOL);
    free(b[0].prompt);
    free(ids);
    free(gp.ids);
    free(gp.ref);
    json_decref(gp.g);
}

/* Prompt logprobs computed by the runner where the logits are (forced rows of a sampling
 * forward, runner.forced_tokens) equal the host's from the logits, bit for bit: logprob,
 * rank, top ids and logprobs, and the tokens that follow; whole prompts and 5-token
 * chunks, two requests at once. The host path is taken by the same requests with recorded
 * first-token logits; the stats show which path ran. */
static void test_prompt_logprobs_in_the_runner_equal_the_host_path(void **st) {
    (void)st;
    golden_prompt gp;
    load_golden("llama-tiny", &gp);
    const int chunks[2] = {2048, 5};
    for (int c = 0; c < 2; c++) {
        run_result a[2], b[2];
        engine_stats sa, sb;
        for (int host = 0; host < 2; host++) {
            engine *e = open_engine("llama-tiny", chunks[c], 4);
            add_ex(e, 0, gp.ids, gp.n, 5, 3, host);
            add_ex(e, 1, gp.ids + 3, gp.n - 3, 0, 2, host);
            run_all(e, 2, host ? b : a);
            engine_get_stats(e, host ? &sb : &sa);
            engine_destroy(e);
        }
        assert_true(sa.steps_forward_sampled > 0);    /* the runner took the prompt rows */
        assert_int_equal(sb.steps_forward_sampled, 0);   /* the reference did not */
        for (int q = 0; q < 2; q++) {
            assert_non_null(a[q].prompt);
            assert_non_null(b[q].prompt);
            assert_int_equal(a[q].n_prompt, b[q].n_prompt);
            assert_int_equal(a[q].n_out, b[q].n_out);
            assert_memory_equal(a[q].out, b[q].out, sizeof(int32_t) * (size_t)a[q].n_out);
            for (int i = 1; i < a[q].n_prompt; i++) {
                const engine_token *x = &a[q].prompt[i], *y = &b[q].prompt[i];
                assert_false(isnan(x->logprob));
                assert_memory_equal(&x->logprob, &y->logprob, sizeof x->logprob);
                assert_int_equal(x->rank, y->rank);
                assert_int_equal(x->n_top, y->n_top);
                assert_int_equal(x->n_top, q == 0 ? 5 : 0);
                assert_memory_equal(x->top_ids, y->top_ids, sizeof(int32_t) * (size_t)x->n_top);
                assert_memory_equal(x->top_logprobs, y->top_logprobs, sizeof(float) * (size_t)x->n_top);
            }
            free(a[q].prompt), free(b[q].prompt);
        }
        print_message("  llama-tiny, %d tokens a step: runner and host prompt logprobs equal (%llu steps sampled "
                      "in the forward pass)\n", chunks[c], (unsigned long long)sa.steps_forward_sampled);
    }
    free(gp.ids);
    free(gp.ref);
    json_decref(gp.g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prompt_logprobs_match_hf_reference),
        cmocka_unit_test(test_long_prompts_share_the_logits_budget),
        cmocka_unit_test(test_prompt_logprobs_in_the_runner_equal_the_host_path),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
