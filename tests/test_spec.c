/* Speculative decoding on the CPU runner: lossless greedy output (draft model, draft ==
 * target, self-speculation by layers, prompt-lookup n-gram drafts) alone and in
 * concurrent batches, the acceptance length guard, the rejection sampler's output
 * distribution (also for point-mass n-gram proposals), and KV accounting after finished,
 * cancelled and preempted speculative requests. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/engine.h"
#include "engine/core/engine_internal.h"   /* the cost table, set by hand */
#include "engine/core/err.h"
#include "engine/core/runner.h"
#include "engine/core/sample.h"
#include "engine/core/spec.h"
#include "tests/fixtures.h"

#define MAXP 8

typedef struct {
    int32_t *ids[MAXP];
    int n[MAXP];
    int np;
} prompts;

static void load_prompts(prompts *p, const char *model) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s/golden.json", model);
    json_t *g = fixture_json(rel);
    assert_non_null(g);
    json_t *a = json_object_get(g, "prompts");
    p->np = (int)json_array_size(a);
    for (int i = 0; i < p->np; i++) p->ids[i] = json_ids(json_object_get(json_array_get(a, (size_t)i), "prompt"), &p->n[i]);
    json_decref(g);
}

static void free_prompts(prompts *p) {
    for (int i = 0; i < p->np; i++) free(p->ids[i]);
}

typedef struct {
    int32_t out[MAXP][512];
    int nout[MAXP];
    long verify, accepted, drafted;
} run_result;

static char g_path[3][4096];

/* llama-tiny with `draft` (a fixture model, or NULL) drafting k = 4; spec_always: the
 * machinery, not the cost model's choice. */
static engine *make_engine_ex(const char *draft, int draft_layers, int max_batch, size_t kv_bytes, int spec_always) {
    snprintf(g_path[0], sizeof g_path[0], "%s/models/llama-tiny", fixtures_dir());
    if (draft) snprintf(g_path[1], sizeof g_path[1], "%s/models/%s", fixtures_dir(), draft);
    engine_config c = {.model_path = g_path[0], .draft_path = draft ? g_path[1] : NULL,
                       .draft_layers = draft_layers, .num_draft_tokens = 4, .max_seq_len = 512,
                       .max_batch = max_batch, .kv_bytes = kv_bytes ? kv_bytes : 64u << 20,
                       .threads = 2, .spec_always = spec_always};
    char err[1024] = "";
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fprintf(stderr, "engine_create: %s\n", err);
    return e;
}

static engine *make_engine(const char *draft, int draft_layers, int max_batch, size_t kv_bytes) {
    return make_engine_ex(draft, draft_layers, max_batch, kv_bytes, 1);
}

/* Run prompts [0, n) with `concurrent` at a time, greedy, max_tokens[i] each. */
static void run_greedy_n(engine *e, const prompts *p, int n, int concurrent, const int *max_tokens, run_result *r) {
    memset(r, 0, sizeof *r);
    char err[256];
    int next = 0, live = 0;
    while (next < n || live > 0) {
        while (next < n && live < concurrent) {
            engine_sampling sp;
            engine_sampling_defaults(&sp);
            sp.temperature = 0;
            sp.ignore_eos = 1;
            sp.max_tokens = max_tokens[next];
            assert_int_equal(engine_add(e, (uint64_t)next, p->ids[next], p->n[next], &sp, err, sizeof err), 0);
            next++;
            live++;
        }
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int k = 0; k < o.n_events; k++) {
            engine_event *ev = &o.events[k];
            int i = (int)ev->req_id;
            for (int t = 0; t < ev->n_tokens; t++) r->out[i][r->nout[i]++] = ev->tokens[t].id;
            if (ev->finish != ENGINE_RUNNING) {
                live--;
                r->verify += ev->spec_verify_steps;
                r->accepted += ev->spec_accepted_tokens;
                r->drafted += ev->spec_draft_tokens;
            }
        }
    }
}

static void run_greedy(engine *e, const prompts *p, int n, int concurrent, int max_tokens, run_result *r) {
    int mt[MAXP];
    for (int i = 0; i < MAXP; i++) mt[i] = max_tokens;
    run_greedy_n(e, p, n, concurrent, mt, r);
}

static double al(const run_result *r) { return r->verify ? 1.0 + (double)r->accepted / r->verify : 0; }

static void assert_same_tokens(const run_result *a, const run_result *b, int n) {
    for (int i = 0; i < n; i++) {
        assert_int_equal(a->nout[i], b->nout[i]);
        assert_memory_equal(a->out[i], b->out[i], sizeof(int32_t) * (size_t)a->nout[i]);
    }
}

static run_result g_plain, g_tmp;

static void test_spec_draft_model_is_lossless_alone_and_padded(void **st) {
    (void)st;
    prompts p;
    load_prompts(&p, "llama-tiny");
    engine *e = make_engine(NULL, 0, 8, 0);
    run_greedy(e, &p, p.np, 1, 48, &g_plain);
    engine_destroy(e);
    e = make_engine("llama-draft", 0, 8, 0);
    assert_non_null(e);
    int batches[] = {1, 3, 5, 7};
    for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++) {
        run_greedy(e, &p, p.np, batches[b], 48, &g_tmp);
        print_message("  llama-draft -> llama-tiny, %d at a time: AL %.3f over %ld verify steps\n",
                      batches[b], al(&g_tmp), g_tmp.verify);
        assert_true(g_tmp.verify > 0);
        assert_same_tokens(&g_plain, &g_tmp, p.np);
    }
    engine_destroy(e);
    free_prompts(&p);
}

/* Draft == target, k = 4: every draft token must be accepted (AL 5) up to exact ties. */
static void test_spec_draft_equals_target_reaches_al_guard(void **st) {
    (void)st;
    prompts p;
    load_prompts(&p, "llama-tiny");
    engine *plain = make_engine(NULL, 0, 8, 0);
    run_greedy(plain, &p, p.np, 1, 200, &g_plain);
    engine_destroy(plain);
    engine *e = make_engine("../models/llama-tiny", 0, 8, 0);
    assert_non_null(e);
    int batches[] = {1, 3, 5, 7};
    for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++) {
        run_greedy(e, &p, p.np, batches[b], 200, &g_tmp);
        print_message("  draft == target, k=4, %d at a time: AL %.3f over %ld verify steps\n",
                      batches[b], al(&g_tmp), g_tmp.verify);
        assert_true(g_tmp.verify >= 200);
        assert_true(al(&g_tmp) >= 4.95);
        assert_same_tokens(&g_plain, &g_tmp, p.np);
    }
    engine_stats s;
    engine_get_stats(e, &s);
    assert_int_equal(s.kv_blocks_used, 0);
    assert_true(s.spec_accepted_per_pos[3] > 0);
    /* both implementations ran: the runner's whole speculative step (rows all decoding)
     * and the step composed from forward passes (prefill rows in the batch) */
    print_message("  steps: %llu runner speculative, %llu composed\n", (unsigned long long)s.steps_runner_spec,
                  (unsigned long long)s.steps_composed);
    assert_true(s.steps_runner_spec > 100);
    assert_true(s.steps_composed > 0);
    engine_destroy(e);
    free_prompts(&p);
}

static void test_spec_self_speculation_by_layers_is_lossless(void **st) {
    (void)st;
    prompts p;
    load_prompts(&p, "llama-tiny");
    engine *plain = make_engine(NULL, 0, 8, 0);
    run_greedy(plain, &p, p.np, 1, 48, &g_plain);
    engine_destroy(plain);
    engine *e = make_engine(NULL, 2, 8, 0);
    assert_non_null(e);
    run_greedy(e, &p, p.np, 5, 48, &g_tmp);
    print_message("  --draft-layers 2 of 4: AL %.3f over %ld verify steps\n", al(&g_tmp), g_tmp.verify);
    assert_true(g_tmp.verify > 0);
    assert_same_tokens(&g_plain, &g_tmp, p.np);
    engine_destroy(e);
    free_prompts(&p);
}

static void test_spec_draft_model_and_draft_layers_are_exclusive(void **st) {
    (void)st;
    char t[4096], d[4096], err[1024] = "";
    snprintf(t, sizeof t, "%s/models/llama-tiny", fixtures_dir());
    snprintf(d, sizeof d, "%s/models/llama-tiny", fixtures_dir());
    engine_config c = {.model_path = t, .draft_path = d, .draft_layers = 2, .max_seq_len = 256,
                       .kv_bytes = 8u << 20};
    assert_null(engine_create(&c, err, sizeof err));          /* both kinds of draft at once */
    assert_non_null(strstr(err, "exclusive"));
}

/* Chi-square of the first emitted token over many seeded draws against the target's
 * distribution. Distributions come from the fixture models (llama-tiny as target,
 * llama-draft as draft) at temperature 1. */
static double chi2_stat(const long *counts, const float *p, int V, long n, int *df) {
    double chi = 0, pool_obs = 0, pool_exp = 0;
    int bins = 0;
    for (int v = 0; v < V; v++) {
        double e = p[v] * (double)n;
        if (e < 5) {
            pool_obs += counts[v];
            pool_exp += e;
            continue;
        }
        chi += (counts[v] - e) * (counts[v] - e) / e;
        bins++;
    }
    if (pool_exp > 0) {
        chi += (pool_obs - pool_exp) * (pool_obs - pool_exp) / pool_exp;
        bins++;
    }
    *df = bins - 1;
    return chi;
}

/* Wilson-Hilferty: chi-square critical value at p = 0.001 (z = 3.0902). */
static double chi2_crit_001(int df) {
    double a = 2.0 / (9.0 * df);
    return df * pow(1 - a + 3.0902 * sqrt(a), 3);
}

static void model_probs(const char *name, const int32_t *ids, int n, float *probs) {
    char path[4096], err[512];
    snprintf(path, sizeof path, "%s/models/%s", fixtures_dir(), name);
    model *m = model_load(path, err, sizeof err);
    assert_non_null(m);
    runner_config rc = {.num_blocks = 4, .block_size = 16, .max_batch = 1, .max_seq_len = 32,
                        .max_tokens_per_step = 32, .threads = 1};
    runner *r = runner_cpu_create(m, NULL, &rc, err, sizeof err);
    assert_non_null(r);
    int32_t blocks[2] = {1, 2};
    r->ops->slot_write_blocks(r, 0, 0, blocks, 2);
    runner_row row = {.slot = 0, .n_new = n, .n_logits = 1};
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = ids, .n_tokens = n,
                      .logits = probs};
    assert_int_equal(runner_forward(r, &b), 0);
    sample_params sp = {.temperature = 1.0f, .top_p = 1.0f};
    int *scratch = malloc(sizeof(int) * (size_t)m->cfg.vocab);
    sample_probs(probs, m->cfg.vocab, &sp, scratch);
    free(scratch);
    runner_destroy(r);
    model_free(m);
}

static void test_spec_rejection_sampling_follows_target_distribution(void **st) {
    (void)st;
    enum { V = 1024, K = 2, N = 20000 };
    int32_t prompt[7] = {17, 200, 3, 999, 45, 512, 8};
    float *p = malloc(sizeof(float) * V * (K + 1)), *q = malloc(sizeof(float) * V * K);
    float *res = malloc(sizeof(float) * V);
    model_probs("llama-tiny", prompt, 7, p);
    model_probs("llama-draft", prompt, 7, q);
    for (int j = 1; j <= K; j++) memcpy(p + (size_t)j * V, p, sizeof(float) * V);
    for (int j = 1; j < K; j++) memcpy(q + (size_t)j * V, q, sizeof(float) * V);
    /* the two models disagree, so acceptance matters */
    double tv = 0;
    for (int v = 0; v < V; v++) tv += fabs(p[v] - q[v]) / 2;
    assert_true(tv > 0.05);
    for (int skip = 0; skip <= 1; skip++) {
        long *counts = calloc(V, sizeof(long));
        for (long s = 0; s < N; s++) {
            int32_t drafts[K], out[K + 1];
            double ua[K];
            for (int j = 0; j < K; j++) {
                drafts[j] = sample_from_probs(q, V, sample_uniform((uint64_t)s, 100 + (uint64_t)j));
                ua[j] = sample_uniform((uint64_t)s, 200 + (uint64_t)j);
            }
            int m = spec_accept_sample(p, q, V, drafts, K, ua, sample_uniform((uint64_t)s, 300), res, skip, out);
            assert_true(m >= 1 && m <= K + 1);
            counts[out[0]]++;
        }
        int df;
        double chi = chi2_stat(counts, p, V, N, &df), crit = chi2_crit_001(df);
        print_message("  first token vs target softmax%s: chi2 %.1f, df %d, critical(p=0.001) %.1f, TV(p,q) %.3f\n",
                      skip ? " (acceptance skipped)" : "", chi, df, crit, tv);
        if (skip) assert_true(chi > crit);   /* without the test the output follows q */
        else assert_true(chi < crit);
        free(counts);
    }
    free(p);
    free(q);
    free(res);
}

/* The same property through the whole engine: a prompt whose first full block is in the
 * prefix cache starts with one token left to compute, so its first output token comes out
 * of a speculative step (draft proposal, target verify, rejection sampling). Over 20,000
 * seeded requests that token must follow the target's softmax, and must not follow the
 * draft's (the test can tell the two apart). */
static void test_spec_engine_first_token_follows_target(void **st) {
    (void)st;
    enum { V = 1024, N = 20000, WAVE = 64 };
    int32_t prompt[17];
    for (int i = 0; i < 17; i++) prompt[i] = (int32_t)((i * 131 + 7) % V);
    float *p = malloc(sizeof(float) * V), *q = malloc(sizeof(float) * V);
    model_probs("llama-tiny", prompt, 17, p);
    model_probs("llama-draft", prompt, 17, q);
    engine *e = make_engine("llama-draft", 0, WAVE, 0);
    assert_non_null(e);
    char err[256];
    engine_sampling sp;
    engine_sampling_defaults(&sp);
    sp.temperature = 1.0f;
    sp.max_tokens = 2;
    sp.ignore_eos = 1;
    sp.has_seed = 1;
    /* warm the prefix cache with the first 16 tokens */
    assert_int_equal(engine_add(e, 1u << 30, prompt, 17, &sp, err, sizeof err), 0);
    while (engine_has_work(e)) {
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
    }
    engine_stats s0;
    engine_get_stats(e, &s0);
    long *counts = calloc(V, sizeof(long));
    for (int base = 0; base < N; base += WAVE) {
        for (int i = base; i < base + WAVE && i < N; i++) {
            sp.seed = 1000003u * (uint64_t)i + 17;
            assert_int_equal(engine_add(e, (uint64_t)i, prompt, 17, &sp, err, sizeof err), 0);
        }
        while (engine_has_work(e)) {
            engine_output o;
            assert_int_equal(engine_step(e, &o), 0);
            for (int k = 0; k < o.n_events; k++)
                if (o.events[k].n_tokens > 0 && o.events[k].n_output_tokens == o.events[k].n_tokens)
                    counts[o.events[k].tokens[0].id]++;   /* the request's first token */
        }
    }
    engine_stats s1;
    engine_get_stats(e, &s1);
    /* every request's first token came from a speculative step after a prefix hit */
    assert_true(s1.prefix_cache_hit_tokens - s0.prefix_cache_hit_tokens >= (uint64_t)N * 16);
    assert_true(s1.spec_drafts - s0.spec_drafts >= (uint64_t)N);
    long total = 0;
    for (int v = 0; v < V; v++) total += counts[v];
    assert_int_equal(total, N);
    int df_p, df_q;
    double chi_p = chi2_stat(counts, p, V, N, &df_p), chi_q = chi2_stat(counts, q, V, N, &df_q);
    print_message("  engine, first token after a prefix hit: chi2 vs target %.1f (df %d, critical %.1f), "
                  "vs draft %.1f (df %d, critical %.1f)\n",
                  chi_p, df_p, chi2_crit_001(df_p), chi_q, df_q, chi2_crit_001(df_q));
    assert_true(chi_p < chi2_crit_001(df_p));
    assert_true(chi_q > chi2_crit_001(df_q));
    free(counts);
    free(p);
    free(q);
    engine_destroy(e);
}

/* Seeded sampling through the whole speculative engine is reproducible. */
static void test_spec_seeded_sampling_is_reproducible(void **st) {
    (void)st;
    int32_t prompt[5] = {5, 6, 7, 8, 9};
    int32_t outs[2][64];
    int n[2] = {0, 0};
    for (int run = 0; run < 2; run++) {
        engine *e = make_engine("llama-draft", 0, 4, 0);
        engine_sampling sp;
        engine_sampling_defaults(&sp);
        sp.temperature = 0.8f;
        sp.seed = 1234;
        sp.has_seed = 1;
        sp.max_tokens = 40;
        sp.ignore_eos = 1;
        char err[256];
        assert_int_equal(engine_add(e, 1, prompt, 5, &sp, err, sizeof err), 0);
        while (engine_has_work(e)) {
            engine_output o;
            assert_int_equal(engine_step(e, &o), 0);
            for (int k = 0; k < o.n_events; k++)
                for (int t = 0; t < o.events[k].n_tokens; t++) outs[run][n[run]++] = o.events[k].tokens[t].id;
        }
        engine_destroy(e);
    }
    assert_int_equal(n[0], 40);
    assert_int_equal(n[1], 40);
    assert_memory_equal(outs[0], outs[1], sizeof(int32_t) * 40);
}

/* Three rounds of every prompt (greedy and sampled in turn, 60 + 20 i tokens each, eos
 * ignored), one request cancelled mid-flight in each, run until the engine is idle. */
static void run_rounds_with_cancel(engine *e, const prompts *p) {
    char err[256];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < p->np; i++) {
            engine_sampling sp;
            engine_sampling_defaults(&sp);
            sp.temperature = i % 2 ? 0.7f : 0;
            sp.max_tokens = 60 + 20 * i;
            sp.ignore_eos = 1;
            assert_int_equal(engine_add(e, (uint64_t)(round * 100 + i), p->ids[i], p->n[i], &sp, err, sizeof err), 0);
        }
        int steps = 0;
        while (engine_has_work(e)) {
            engine_output o;
            assert_int_equal(engine_step(e, &o), 0);
            if (++steps == 5) engine_abort(e, (uint64_t)(round * 100 + 1));   /* cancel one mid-flight */
        }
    }
}

/* Finished, cancelled and preempted speculative requests all give their blocks back. */
static void test_spec_kv_returns_to_baseline(void **st) {
    (void)st;
    prompts p;
    load_prompts(&p, "llama-tiny");
    /* a pool just big enough for one max-length sequence forces preemption */
    engine *e = make_engine("llama-draft", 0, 8, 0);
    engine_stats s0;
    engine_get_stats(e, &s0);
    engine_destroy(e);
    size_t per_block = (64u << 20) / (size_t)s0.kv_blocks_total;
    e = make_engine("llama-draft", 0, 8, per_block * (512 / 16 + 4));
    assert_non_null(e);
    run_rounds_with_cancel(e, &p);
    engine_stats s;
    engine_get_stats(e, &s);
    print_message("  pool %d blocks, preemptions %llu, blocks in use at the end %d\n", s.kv_blocks_total,
                  (unsigned long long)s.preemptions, s.kv_blocks_used);
    assert_true(s.preemptions > 0);
    assert_int_equal(s.kv_blocks_used, 0);
    assert_int_equal(s.running + s.waiting, 0);
    engine_destroy(e);
    free_prompts(&p);
}

/* ---- prompt-lookup (n-gram) drafts ------------------------------------------------- */

/* An engine on llama-tiny drafting by prompt lookup; always_spec skips the cost model;
 * verify: the runner's verify op checks the drafts (the CUDA runner's path) instead of
 * the engine's composed forward and host acceptance. */
static engine *make_ngram_engine(int max_batch, size_t kv_bytes, int always_spec, int verify) {
    snprintf(g_path[0], sizeof g_path[0], "%s/models/llama-tiny", fixtures_dir());
    engine_config c = {.model_path = g_path[0], .spec_ngram = 1, .num_draft_tokens = 5, .max_seq_len = 512,
                       .max_batch = max_batch, .kv_bytes = kv_bytes ? kv_bytes : 64u << 20, .threads = 2,
                       .spec_always = always_spec, .cpu_verify = verify};
    char err[1024] = "";
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fprintf(stderr, "engine_create: %s\n", err);
    return e;
}

/* The golden prompts (random text, rarely matched) plus two that end in 160 tokens of
 * the model's own greedy output: a random model falls into loops (prompt 5's output ends
 * in one token repeated), which prompt lookup proposes and the target confirms. */
static void load_ngram_prompts(prompts *p) {
    load_prompts(p, "llama-tiny");
    assert_true(p->np <= MAXP - 2);
    engine *e = make_engine(NULL, 0, 8, 0);
    assert_non_null(e);
    run_greedy(e, p, p->np, 2, 160, &g_tmp);
    engine_destroy(e);
    int src[2] = {5, 0};
    for (int j = 0; j < 2; j++) {
        int n = p->n[src[j]], i = p->np++;
        p->n[i] = n + g_tmp.nout[src[j]];
        p->ids[i] = malloc(sizeof(int32_t) * (size_t)p->n[i]);
        memcpy(p->ids[i], p->ids[src[j]], sizeof(int32_t) * (size_t)n);
        memcpy(p->ids[i] + n, g_tmp.out[src[j]], sizeof(int32_t) * (size_t)g_tmp.nout[src[j]]);
    }
}

static void test_spec_ngram_greedy_is_lossless_and_drafts_are_accepted(void **st) {
    (void)st;
    prompts p;
    load_ngram_prompts(&p);
    engine *e = make_engine(NULL, 0, 8, 0);
    run_greedy(e, &p, p.np, 1, 64, &g_plain);
    engine_destroy(e);
    for (int mode = 0; mode < 4; mode++) {
        int always = mode < 2, verify = mode & 1;
        e = make_ngram_engine(8, 0, always, verify);
        assert_non_null(e);
        int batches[] = {1, 3, 8};
        for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++) {
            run_greedy(e, &p, p.np, batches[b], 64, &g_tmp);
            print_message("  ngram%s%s, %d at a time: AL %.3f over %ld verify steps, %ld of %ld drafts accepted\n",
                          always ? " (always)" : " (cost model)", verify ? " runner verify" : "", batches[b],
                          al(&g_tmp), g_tmp.verify, g_tmp.accepted, g_tmp.drafted);
            assert_same_tokens(&g_plain, &g_tmp, p.np);
            if (always) {
                /* a random model copies little, but what its loops repeat is accepted: AL
                 * > 1.25 (drafts misplaced by a position would be accepted by chance only) */
                /* (steps queued in flight look up on the tokens they know: a random model's
                 * short loops are caught a step later than a synchronous plan would) */
                assert_true(g_tmp.verify > 12);
                assert_true(4 * g_tmp.accepted > g_tmp.verify);
            }
        }
        engine_stats s;
        engine_get_stats(e, &s);
        assert_string_equal(s.spec_drafter, "ngram");
        assert_int_equal(s.num_draft_tokens, 5);
        assert_true(s.spec_steps_speculated <= s.spec_steps_decoding);
        assert_true(s.spec_rows_decoding >= s.spec_drafts);
        if (always) assert_true(s.spec_steps_speculated > 0);
        /* the runner's verify took the speculating steps, except those it does not take
         * (prompt chunks beside the rows while requests arrive), which went through the
         * composed path; without the op it never ran */
        if (always && verify) {
            assert_int_equal(s.steps_runner_verify + s.spec_steps_fwd, s.spec_steps_speculated);
            assert_true(s.steps_runner_verify > s.spec_steps_fwd);
        }
        if (!verify) assert_int_equal(s.steps_runner_verify + s.spec_steps_fwd, 0);
        assert_int_equal(s.kv_blocks_used, 0);
        /* a draft model's path never ran: no runner speculative step, no draft passes */
        assert_int_equal(s.steps_runner_spec, 0);
        engine_destroy(e);
    }
    free_prompts(&p);
}

/* Prompt lookup where nothing matches: a step no row drafts in goes in flight as a plain
 * one (engine_spec_ngram_idle), so steps that could speculate but do not cost what plain
 * decoding costs. The golden prompts (random text) with outputs short enough that the
 * random model does not loop yet: the same tokens as without speculation and about as
 * many steps in flight (before, every step of prompt lookup ran synchronously). */
static void test_spec_ngram_steps_without_drafts_go_in_flight(void **st) {
    (void)st;
    prompts p;
    load_prompts(&p, "llama-tiny");
    engine_stats plain, s;
    engine *e = make_engine(NULL, 0, 8, 0);
    run_greedy(e, &p, p.np, 4, 12, &g_plain);
    engine_get_stats(e, &plain);
    engine_destroy(e);
    for (int verify = 0; verify < 2; verify++) {
        e = make_ngram_engine(8, 0, 1, verify);
        assert_non_null(e);
        run_greedy(e, &p, p.np, 4, 12, &g_tmp);
        engine_get_stats(e, &s);
        engine_destroy(e);
        print_message("  ngram%s, short random outputs: %llu of %llu decoding steps in flight (without speculation %llu "
                      "of %llu), %ld verify steps\n", verify ? " runner verify" : "", (unsigned long long)s.steps_async,
                      (unsigned long long)s.spec_steps_decoding, (unsigned long long)plain.steps_async,
                      (unsigned long long)plain.spec_steps_decoding, g_tmp.verify);
        assert_same_tokens(&g_plain, &g_tmp, p.np);
        assert_true(plain.steps_async > 10);
        assert_true(s.steps_async + 3 >= plain.steps_async);
    }
    free_prompts(&p);
}

/* A step in flight hides its last token, so prompt lookup peeks on the tokens before it
 * (engine_spec_ngram_idle) and a match there must also predict that token: its drafts are
 * priced at the square of the row's acceptance. Prompts that repeat a pair of tokens
 * (a b a b ...) match on every peek before the first output token is in, and a random
 * model's output does not go on with them. With a hand-set table where one draft a row
 * pays from an acceptance of 0.44 (1 ms plain, 1.4 ms with one draft), a new row (1 of 2)
 * beside a step in flight stays in flight (0.25 does not pay) rather than going
 * synchronous to find, once the token is in, that nothing matches any more (one request
 * at a time: priced at 1 of 2, 12 of 53 steps went synchronous without a draft). Output
 * is plain decoding's. */
static void test_spec_ngram_peek_prices_the_token_in_flight(void **st) {
    (void)st;
    prompts p = {.np = MAXP};
    for (int i = 0; i < p.np; i++) {
        p.n[i] = 24;
        p.ids[i] = malloc(sizeof(int32_t) * 24);
        for (int t = 0; t < 24; t++) p.ids[i][t] = (int32_t)(t % 2 ? 40 + 3 * i : 7 + 5 * i);
    }
    engine *e = make_engine(NULL, 0, 8, 0);
    run_greedy(e, &p, p.np, 1, 8, &g_plain);
    engine_destroy(e);
    e = make_ngram_engine(8, 0, 0, 1);
    assert_non_null(e);
    e->cost = (spec_cost){.n_b = 2, .n_k = 2, .b = {1, 8}, .k = {0, 4}, .t = {{1e-3, 2.6e-3}, {1e-3, 2.6e-3}}};
    run_greedy(e, &p, p.np, 1, 8, &g_tmp);
    engine_stats s;
    engine_get_stats(e, &s);
    engine_destroy(e);
    const unsigned long long idle = s.spec_steps_decoding - s.steps_async - s.spec_steps_speculated;
    print_message("  ngram under the cost model: %llu decoding steps, %llu in flight, %llu speculated, %llu synchronous "
                  "without drafts\n", (unsigned long long)s.spec_steps_decoding, (unsigned long long)s.steps_async,
                  (unsigned long long)s.spec_steps_speculated, idle);
    assert_same_tokens(&g_plain, &g_tmp, p.np);
    assert_true(s.steps_async > 40);
    assert_true(idle <= 1);
    free_prompts(&p);
}

/* The cost model's host time (spec_cost.host): learned from every step only where a queued
 * step runs on a device while the host goes on (runner.async_device; the CPU runner
 * computes when queued, so it learns nothing), and charged to speculating steps: with a
 * hand-set table of 1 ms steps, the engine's own few microseconds a step leave prompt
 * lookup drafting on prompts that loop; with the same table in microseconds, the host
 * time outweighs what drafts save and speculation stops after the first steps. Output is
 * the same in every case. */
static void test_spec_ngram_host_time_is_charged_to_speculating_steps(void **st) {
    (void)st;
    prompts all, p = {.np = 4};
    load_ngram_prompts(&all);
    for (int i = 0; i < 4; i++) {   /* the two prompts that loop, twice each */
        p.ids[i] = all.ids[all.np - 1 - i % 2];
        p.n[i] = all.n[all.np - 1 - i % 2];
    }
    engine *e = make_engine(NULL, 0, 8, 0);
    run_greedy(e, &p, p.np, 2, 64, &g_plain);
    engine_destroy(e);
    uint64_t speculated[3];
    for (int mode = 0; mode < 3; mode++) {
        e = make_ngram_engine(8, 0, 0, 1);
        assert_non_null(e);
        const double t = mode == 2 ? 1e-6 : 1e-3;
        e->cost = (spec_cost){.n_b = 2, .n_k = 2, .b = {1, 8}, .k = {0, 4}, .t = {{t, 1.1 * t}, {t, 1.1 * t}}};
        if (mode > 0) e->run->async_device = 1;
        run_greedy(e, &p, p.np, 2, 64, &g_tmp);
        engine_stats s;
        engine_get_stats(e, &s);
        const double h1 = e->cost.host[0], h8 = e->cost.host[1];
        engine_destroy(e);
        speculated[mode] = s.spec_steps_speculated;
        print_message("  ngram%s: host %.1f / %.1f us a step at 1 / 8 rows, %llu of %llu steps speculated, AL %.2f\n",
                      mode == 0   ? " (CPU runner)"
                      : mode == 1 ? " (as if on a device), 1 ms steps"
                                  : " (as if on a device), 1 us steps",
                      1e6 * h1, 1e6 * h8, (unsigned long long)s.spec_steps_speculated,
                      (unsigned long long)s.spec_steps_decoding, al(&g_tmp));
        assert_same_tokens(&g_plain, &g_tmp, p.np);
        if (mode == 0) {
            assert_true(h1 == 0 && h8 == 0 && s.spec_host_seconds == 0);
        } else {
            assert_true(h1 + h8 > 0 && s.spec_host_seconds > 0);
            assert_true(s.spec_host_seconds == h1 || s.spec_host_seconds == h8);
        }
        if (mode < 2) assert_true(g_tmp.verify > 0);
    }
    assert_true(speculated[2] * 4 < speculated[1]);
    free_prompts(&all);
}

/* Rows the runner's verify op does not take -- logprobs with top logprobs, a frequency
 * penalty, logit bias, min_tokens -- still speculate with prompt lookup: their steps go
 * through the composed path (a forward pass sampling every position, spec_steps_fwd), with
 * the cost model off and under it (hand-set tables where drafts pay), and their tokens and
 * logprobs equal plain decoding's with the same sampling. Without the composed path's
 * table (the cost model on, cost_fwd not measured) such steps draft nothing. */
static void test_spec_ngram_rows_the_verify_op_skips_go_composed(void **st) {
    (void)st;
    prompts p;
    load_ngram_prompts(&p);
    static float lp[3][MAXP][64], top[3][MAXP][64];
    static int32_t tok[3][MAXP][64];
    int nout[3][MAXP];
    const int32_t bias_ids[2] = {5, 17};
    const float bias_vals[2] = {1.5f, -2.0f};
    for (int mode = 0; mode < 4; mode++) {
        engine *e = mode == 0 ? make_engine(NULL, 0, 8, 0) : make_ngram_engine(8, 0, mode == 1, 1);
        assert_non_null(e);
        const spec_cost t = {.n_b = 2, .n_k = 2, .b = {1, 8}, .k = {0, 4}, .t = {{1e-3, 1.1e-3}, {1e-3, 1.1e-3}}};
        if (mode >= 2) e->cost = t;                 /* verify steps: drafts pay */
        if (mode == 2) e->cost_fwd = t;             /* composed steps: drafts pay */
        if (mode == 3) memset(&e->cost_fwd, 0, sizeof e->cost_fwd);   /* not measured */
        const int m = mode < 3 ? mode : 2;
        char err[256];
        for (int i = 0; i < p.np; i++) {
            engine_sampling sp;
            engine_sampling_defaults(&sp);
            sp.temperature = 0;
            sp.ignore_eos = 1;
            sp.max_tokens = 48;
            sp.logprobs = 2;
            sp.frequency_penalty = 0.05f;
            sp.n_logit_bias = 2;
            sp.logit_bias_ids = bias_ids;
            sp.logit_bias_vals = bias_vals;
            sp.min_tokens = 4;
            assert_int_equal(engine_add(e, (uint64_t)i, p.ids[i], p.n[i], &sp, err, sizeof err), 0);
            nout[m][i] = 0;
        }
        while (engine_has_work(e)) {
            engine_output o;
            assert_int_equal(engine_step(e, &o), 0);
            for (int k = 0; k < o.n_events; k++) {
                const engine_event *ev = &o.events[k];
                const int i = (int)ev->req_id;
                for (int j = 0; j < ev->n_tokens; j++) {
                    assert_true(nout[m][i] < 64);
                    tok[m][i][nout[m][i]] = ev->tokens[j].id;
                    lp[m][i][nout[m][i]] = ev->tokens[j].logprob;
                    top[m][i][nout[m][i]++] = ev->tokens[j].n_top > 1 ? ev->tokens[j].top_logprobs[1] : NAN;
                }
            }
        }
        engine_stats s;
        engine_get_stats(e, &s);
        print_message("  mode %d: %llu of %llu steps speculated, %llu through the composed path, %llu verify steps\n",
                      mode, (unsigned long long)s.spec_steps_speculated, (unsigned long long)s.spec_steps_decoding,
                      (unsigned long long)s.spec_steps_fwd, (unsigned long long)s.steps_runner_verify);
        assert_int_equal(s.steps_runner_verify, 0);   /* the op takes none of these rows */
        assert_int_equal(s.spec_steps_fwd, s.spec_steps_speculated);
        if (mode == 1 || mode == 2) assert_true(s.spec_steps_fwd > 0);
        if (mode == 3) assert_int_equal(s.spec_steps_speculated, 0);
        assert_int_equal(s.kv_blocks_used, 0);
        engine_destroy(e);
        for (int i = 0; i < p.np && mode > 0; i++) {
            assert_int_equal(nout[m][i], 48);
            assert_memory_equal(tok[m][i], tok[0][i], 48 * sizeof(int32_t));
            for (int j = 0; j < 48; j++) {
                assert_float_equal(lp[m][i][j], lp[0][i][j], 1e-4);
                assert_float_equal(top[m][i][j], top[0][i][j], 1e-4);
            }
        }
    }
    free_prompts(&p);
}

/* Seeded sampling with prompt lookup: the same tokens run after run, on the composed path
 * and through the runner's verify op, and equal to those of the same requests without
 * speculation; verify steps and accepted drafts are counted. */
static void test_spec_ngram_sampled_output_is_seeded_and_counted(void **st) {
    (void)st;
    prompts p;
    load_ngram_prompts(&p);
    int32_t out[5][6][48];
    long verify = 0, accepted = 0, runner_verify = 0;
    /* twice composed, twice through the runner's verify, then without speculation */
    for (int run = 0; run < 5; run++) {
        engine *e = run < 4 ? make_ngram_engine(8, 0, 1, run >= 2) : make_engine(NULL, 0, 8, 0);
        assert_non_null(e);
        char err[256];
        for (int i = 0; i < 6; i++) {
            engine_sampling sp;
            engine_sampling_defaults(&sp);
            sp.temperature = 0.1f;   /* a random model is flat: sharpen it so drafts can stand */
            sp.top_p = 0.95f;
            sp.seed = 1000 + (uint64_t)i;
            sp.has_seed = 1;
            sp.ignore_eos = 1;
            sp.max_tokens = 48;
            assert_int_equal(engine_add(e, (uint64_t)i, p.ids[p.np - 1 - i % 2], p.n[p.np - 1 - i % 2], &sp, err,
                                        sizeof err), 0);
        }
        int nout[6] = {0};
        while (engine_has_work(e)) {
            engine_output o;
            assert_int_equal(engine_step(e, &o), 0);
            for (int k = 0; k < o.n_events; k++) {
                engine_event *ev = &o.events[k];
                for (int t = 0; t < ev->n_tokens; t++) {
                    assert_true(ev->tokens[t].id >= 0 && ev->tokens[t].id < 1024);
                    out[run][ev->req_id][nout[ev->req_id]++] = ev->tokens[t].id;
                }
                if (ev->finish != ENGINE_RUNNING && run % 2 == 0) {
                    verify += ev->spec_verify_steps;
                    accepted += ev->spec_accepted_tokens;
                    assert_true(ev->spec_decode_steps >= ev->spec_verify_steps);
                }
            }
        }
        for (int i = 0; i < 6; i++) assert_int_equal(nout[i], 48);
        engine_stats s;
        engine_get_stats(e, &s);
        runner_verify += (long)s.steps_runner_verify;
        engine_destroy(e);
    }
    print_message("  sampled, temperature 0.1: %ld verify steps, %ld drafts accepted (both paths); "
                  "%ld runner verify steps\n", verify, accepted, runner_verify);
    assert_memory_equal(out[0], out[1], sizeof out[0]);
    assert_memory_equal(out[2], out[3], sizeof out[2]);
    /* every position draws with its own output position's uniform (spec_accept_point), on
     * either path: the tokens of no speculation */
    assert_memory_equal(out[0], out[2], sizeof out[0]);
    assert_memory_equal(out[0], out[4], sizeof out[0]);
    assert_true(runner_verify > 0);
    assert_true(verify > 0);
    assert_true(accepted > 0);
    free_prompts(&p);
}

/* A deterministic proposal is a point mass: accepting d with probability p(d) and on
 * rejection drawing from p without d makes the emitted token follow p exactly;
 * spec_accept_point does it by drawing the target's own token and comparing. A rule that
 * accepts d with probability p(d) but then draws from p itself (d not removed) must fail
 * the check: the test can tell a wrong rule. */
static void test_spec_point_mass_rejection_follows_target(void **st) {
    (void)st;
    enum { V = 1024, K = 2, N = 20000 };
    int32_t prompt[7] = {17, 200, 3, 999, 45, 512, 8};
    float *base = malloc(sizeof(float) * V), *p = malloc(sizeof(float) * V * (K + 1));
    model_probs("llama-tiny", prompt, 7, base);
    /* sharpen (temperature 0.5) so that the draft token carries real mass */
    double z = 0;
    for (int v = 0; v < V; v++) z += (double)base[v] * base[v];
    for (int v = 0; v < V; v++) base[v] = (float)((double)base[v] * base[v] / z);
    int top = 0;
    for (int v = 1; v < V; v++)
        if (base[v] > base[top]) top = v;
    assert_true(base[top] > 0.05);
    int32_t cases[2] = {top, (top + 1) % V};
    for (int c = 0; c < 2; c++) {
        for (int wrong = 0; wrong <= 1; wrong++) {
            long *counts = calloc(V, sizeof(long));
            for (long s = 0; s < N; s++) {
                for (int j = 0; j <= K; j++) memcpy(p + (size_t)j * V, base, sizeof(float) * V);
                int32_t drafts[K] = {cases[c], cases[c]}, out[K + 1];
                double u[K + 1];
                spec_point_uniforms((uint64_t)s, 100, K, u);
                if (!wrong) {
                    int m = spec_accept_point(p, V, drafts, K, u, out);
                    assert_true(m >= 1 && m <= K + 1);
                    /* the emitted tokens are the target's own draws at those uniforms */
                    for (int j = 0; j < m; j++) assert_int_equal(out[j], sample_from_probs(base, V, u[j]));
                } else {
                    const double ua = sample_uniform((uint64_t)s, 300);
                    out[0] = ua < base[cases[c]] ? cases[c] : sample_from_probs(base, V, u[0]);
                }
                counts[out[0]]++;
            }
            int df;
            double chi = chi2_stat(counts, base, V, N, &df), crit = chi2_crit_001(df);
            print_message("  point-mass draft %d (p %.3f)%s: chi2 %.1f, df %d, critical %.1f\n", cases[c],
                          base[cases[c]], wrong ? " with the residual left as p" : "", chi, df, crit);
            if (wrong && c == 0) assert_true(chi > crit);
            if (!wrong) assert_true(chi < crit);
            free(counts);
        }
    }
    free(base);
    free(p);
}

/* With the cost model on, a draft model that is never right (llama-draft's AL is 1.00 on
 * llama-tiny) and costs a pass per draft token is turned off: output unchanged, and only
 * the occasional probe step (1 in 16 declined steps) verifies drafts. */
static void test_spec_cost_model_turns_a_failing_draft_model_off(void **st) {
    (void)st;
    prompts p;
    load_prompts(&p, "llama-tiny");
    engine *e = make_engine(NULL, 0, 8, 0);
    run_greedy(e, &p, p.np, 2, 64, &g_plain);
    engine_destroy(e);
    e = make_engine_ex("llama-draft", 0, 8, 0, 0);   /* under the cost model */
    assert_non_null(e);
    /* a hand-set table (the CPU's measured one is noise): k = 4 drafts cost 1.3 plain
     * steps, so they pay at the starting estimate (1 of 2) and probes come 60 declines apart */
    e->cost = (spec_cost){.n_b = 2, .n_k = 2, .b = {1, 8}, .k = {0, 4}, .t = {{1e-3, 1.3e-3}, {1e-3, 1.3e-3}}};
    run_greedy(e, &p, p.np, 2, 64, &g_tmp);
    assert_same_tokens(&g_plain, &g_tmp, p.np);
    engine_stats s;
    engine_get_stats(e, &s);
    print_message("  draft model under the cost model: %llu of %llu decoding rows verified drafts in %llu of %llu "
                  "steps (%llu queued in flight), AL %.3f\n",
                  (unsigned long long)s.spec_drafts, (unsigned long long)s.spec_rows_decoding,
                  (unsigned long long)s.spec_steps_speculated, (unsigned long long)s.spec_steps_decoding,
                  (unsigned long long)s.steps_async, al(&g_tmp));
    assert_string_equal(s.spec_drafter, "draft_model");
    assert_true(s.spec_drafts > 0);                          /* at the start, then probes */
    assert_true(4 * s.spec_drafts < s.spec_rows_decoding);   /* mostly plain decode */
    /* a probe takes the rows whose draft is least behind while their catch-up stays within
     * 64 tokens: one row, or two whose drafts lag 32 or less, never all eight */
    assert_true(s.spec_drafts <= 2 * s.spec_steps_speculated);
    assert_true(s.steps_async > 0);   /* declined steps go in flight (engine_spec_skip) */
    engine_destroy(e);
    free_prompts(&p);
}

/* A probe of a draft model that never pays takes one draft for the rows whose draft has
 * least to catch up on, within 64 tokens of catch-up, not for every row: eight requests
 * decode together and the hand-set table spaces the probes 60 declined steps apart, so
 * every row's draft is far behind at a probe and a probe verifies a row or two. The
 * declined steps go in flight, and the output is plain decoding's. */
static void test_spec_draft_probe_takes_rows_least_behind(void **st) {
    (void)st;
    prompts p, q = {0};
    load_prompts(&p, "llama-tiny");
    q.np = MAXP;
    for (int i = 0; i < MAXP; i++) q.ids[i] = p.ids[i % p.np], q.n[i] = p.n[i % p.np];
    engine *e = make_engine(NULL, 0, 8, 0);
    run_greedy(e, &q, MAXP, MAXP, 160, &g_plain);
    engine_destroy(e);
    e = make_engine_ex("llama-draft", 0, 8, 0, 0);   /* under the cost model */
    assert_non_null(e);
    /* drafts never pay at acceptance 0 and cost 1.3 plain steps: probes 60 declines apart */
    e->cost = (spec_cost){.n_b = 2, .n_k = 2, .b = {1, 8}, .k = {0, 4}, .t = {{1e-3, 1.3e-3}, {1e-3, 1.3e-3}}};
    e->acc_s = 0;
    e->acc_t = 1;
    run_greedy(e, &q, MAXP, MAXP, 160, &g_tmp);
    assert_same_tokens(&g_plain, &g_tmp, MAXP);
    engine_stats s;
    engine_get_stats(e, &s);
    print_message("  probes of a failing draft model, 8 rows: %llu rows verified drafts in %llu steps (of %llu; "
                  "%llu queued in flight)\n", (unsigned long long)s.spec_drafts,
                  (unsigned long long)s.spec_steps_speculated, (unsigned long long)s.spec_steps_decoding,
                  (unsigned long long)s.steps_async);
    assert_true(s.spec_steps_speculated >= 1);
    assert_true(s.spec_drafts <= 2 * s.spec_steps_speculated);   /* a row or two a probe, not eight */
    assert_true(s.steps_async > 100);
    engine_destroy(e);
    free_prompts(&p);
}

/* A draft model under the cost model runs only when its rows speculate: plain steps (the
 * runner's decode op) leave it behind and a speculating step catches it up first. Draft ==
 * target, so once caught up the draft proposes exactly the target's tokens and every
 * draft stands, which it cannot if the catch-up skipped or repeated a token; the output
 * must equal plain decoding. The cost tables are set by hand (white box: measured CPU
 * timings are noise):
 *   1. k = 4 drafts cost 1.1 plain steps and the acceptance estimate starts at 0: steps
 *      decline (queued in flight) until a probe (one draft for the rows least behind)
 *      catches their draft up, then its acceptance turns speculation on, through the
 *      runner's speculative step once every row's draft has caught up;
 *   2. drafts never pay at 6 rows but do at 1 (acceptance 1/2 as at start): the one long
 *      request left after five short ones speculates at once, k = 4, with a draft that is
 *      ~24 tokens behind, so that step must catch it up rather than take the runner's
 *      speculative step (which only re-feeds two tokens). */
/* Either way declined steps are queued in flight (async scheduling) while the draft falls
 * behind. */
static void lagging_draft_case(const prompts *p, const int *max_tokens, const spec_cost *cost, float acc_s,
                               float acc_t) {
    engine *e = make_engine(NULL, 0, 8, 0);
    run_greedy_n(e, p, p->np, 8, max_tokens, &g_plain);
    engine_destroy(e);
    e = make_engine_ex("llama-tiny", 0, 8, 0, 0);   /* draft == target, under the cost model */
    assert_non_null(e);
    e->cost = *cost;
    e->acc_s = acc_s;
    e->acc_t = acc_t;
    run_greedy_n(e, p, p->np, 8, max_tokens, &g_tmp);
    assert_same_tokens(&g_plain, &g_tmp, p->np);
    engine_stats s;
    engine_get_stats(e, &s);
    print_message("  draft == target under the cost model: %llu plain decode steps (%llu queued in flight), %llu "
                  "composed, %llu speculative; %llu of %llu decoding rows verified drafts, %ld of %ld drafts "
                  "accepted\n", (unsigned long long)s.steps_device_decode, (unsigned long long)s.steps_async,
                  (unsigned long long)s.steps_composed,
                  (unsigned long long)s.steps_runner_spec, (unsigned long long)s.spec_drafts,
                  (unsigned long long)s.spec_rows_decoding, g_tmp.accepted, g_tmp.drafted);
    assert_true(s.steps_device_decode >= 8);   /* the draft fell behind */
    assert_true(s.steps_runner_spec > 0);      /* and was caught up */
    assert_true(g_tmp.drafted >= 16);
    assert_int_equal(g_tmp.accepted, g_tmp.drafted);   /* every draft stands */
    assert_true(s.steps_async > 0);
    engine_destroy(e);
}

static void test_spec_lagging_draft_catches_up(void **st) {
    (void)st;
    prompts p;
    load_prompts(&p, "llama-tiny");
    assert_true(p.np >= 2);
    int mt[MAXP];
    for (int i = 0; i < MAXP; i++) mt[i] = 64;
    spec_cost probe = {.n_b = 2, .n_k = 2, .b = {1, 8}, .k = {0, 4}, .t = {{1e-3, 1.1e-3}, {1e-3, 1.1e-3}}};
    lagging_draft_case(&p, mt, &probe, 0, 1);
    for (int i = 0; i < p.np - 1; i++) mt[i] = 24;
    mt[p.np - 1] = 96;
    spec_cost alone = {.n_b = 2, .n_k = 2, .b = {1, 8}, .k = {0, 4}, .t = {{1e-3, 1.2e-3}, {1e-3, 10e-3}}};
    lagging_draft_case(&p, mt, &alone, 1, 2);
    free_prompts(&p);
}

/* Finished, cancelled and preempted requests with n-gram drafts all give their blocks back. */
static void test_spec_ngram_kv_returns_to_baseline(void **st) {
    (void)st;
    prompts p;
    load_ngram_prompts(&p);
    engine *e = make_ngram_engine(8, 0, 1, 0);
    engine_stats s0;
    engine_get_stats(e, &s0);
    engine_destroy(e);
    size_t per_block = (64u << 20) / (size_t)s0.kv_blocks_total;
    for (int verify = 0; verify < 2; verify++) {   /* composed, then through the runner's verify */
        e = make_ngram_engine(8, per_block * (512 / 16 + 4), 1, verify);
        assert_non_null(e);
        run_rounds_with_cancel(e, &p);
        engine_stats s;
        engine_get_stats(e, &s);
        print_message("  pool %d blocks, preemptions %llu, verify steps %llu, blocks in use at the end %d\n",
                      s.kv_blocks_total, (unsigned long long)s.preemptions, (unsigned long long)s.spec_drafts,
                      s.kv_blocks_used);
        assert_true(s.preemptions > 0);
        assert_true(s.spec_drafts > 0);
        if (verify) assert_true(s.steps_runner_verify > 0);
        assert_int_equal(s.kv_blocks_used, 0);
        assert_int_equal(s.running + s.waiting, 0);
        engine_destroy(e);
    }
    free_prompts(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spec_draft_model_is_lossless_alone_and_padded),
        cmocka_unit_test(test_spec_draft_equals_target_reaches_al_guard),
        cmocka_unit_test(test_spec_self_speculation_by_layers_is_lossless),
        cmocka_unit_test(test_spec_draft_model_and_draft_layers_are_exclusive),
        cmocka_unit_test(test_spec_rejection_sampling_follows_target_distribution),
        cmocka_unit_test(test_spec_engine_first_token_follows_target),
        cmocka_unit_test(test_spec_seeded_sampling_is_reproducible),
        cmocka_unit_test(test_spec_kv_returns_to_baseline),
        cmocka_unit_test(test_spec_ngram_greedy_is_lossless_and_drafts_are_accepted),
        cmocka_unit_test(test_spec_ngram_steps_without_drafts_go_in_flight),
        cmocka_unit_test(test_spec_ngram_peek_prices_the_token_in_flight),
        cmocka_unit_test(test_spec_ngram_host_time_is_charged_to_speculating_steps),
        cmocka_unit_test(test_spec_ngram_rows_the_verify_op_skips_go_composed),
        cmocka_unit_test(test_spec_ngram_sampled_output_is_seeded_and_counted),
        cmocka_unit_test(test_spec_point_mass_rejection_follows_target),
        cmocka_unit_test(test_spec_ngram_kv_returns_to_baseline),
        cmocka_unit_test(test_spec_cost_model_turns_a_failing_draft_model_off),
        cmocka_unit_test(test_spec_draft_probe_takes_rows_least_behind),
        cmocka_unit_test(test_spec_lagging_draft_catches_up),
    };
    return cmocka_run_group_tests_name("spec", tests, NULL, NULL);
}
