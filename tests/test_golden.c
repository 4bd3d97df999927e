/* Golden tests of the CPU runner and the engine against HF transformers' fp32 outputs in
 * ../shared/fixtures/models (see its README): last-position logits within 1e-4 relative,
 * all-position logits of the 33-token prompt, greedy continuations up to the first
 * low-margin step, the same results when every prompt runs concurrently in one batch,
 * and pool sizing that ignores max_position_embeddings. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/core/engine.h"
#include "engine/core/err.h"
#include "engine/core/runner.h"
#include "tests/fixtures.h"

#define LOGIT_TOL 1e-4

static const char *const models[] = {"llama-tiny",   "qwen2-tiny",    "qwen3-tiny",
                                     "llama-draft",  "mistral-swa-tiny", "gemma3-tiny",
                                     "qwen3moe-tiny", "mixtral-tiny",  "phi3-tiny",
                                     "gemma3-norms"};

/* A fixture model (../shared/fixtures/models/NAME), or one of ours made by HF transformers
 * (tests/data/models/NAME, when NAME has no fixture: gemma3-norms, see
 * tests/gpu/gemma_ref.py). */
static void model_dir(const char *name, char *path, size_t n) {
    snprintf(path, n, "%s/models/%s", fixtures_dir(), name);
    if (access(path, F_OK) != 0) snprintf(path, n, "tests/data/models/%s", name);
}

static engine *open_engine(const char *name, int max_batch) {
    char path[4096], err[1024] = "";
    model_dir(name, path, sizeof path);
    /* specd's default path: fp32 rotary frequencies, as the fixtures' reference */
    engine_config c = {.model_path = path, .max_seq_len = 512, .max_batch = max_batch,
                       .kv_bytes = 64u << 20, .threads = 2};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fprintf(stderr, "engine_create(%s): %s\n", name, err);
    return e;
}

static json_t *golden(const char *name) {
    char path[4096];
    model_dir(name, path, sizeof path);
    strncat(path, "/golden.json", sizeof path - strlen(path) - 1);
    json_error_t je;
    json_t *g = json_load_file(path, 0, &je);
    if (!g) fprintf(stderr, "%s: %s\n", path, je.text);
    return g;
}

/* Run every prompt of a golden file, either one at a time or all at once, greedy, and
 * check logits and tokens. Returns the number of prompts checked. */
static int check_model(const char *name, int concurrent) {
    json_t *g = golden(name);
    assert_non_null(g);
    json_t *prompts = json_object_get(g, "prompts");
    int np = (int)json_array_size(prompts);
    assert_true(np >= 6);
    engine *e = open_engine(name, concurrent ? np : 1);
    assert_non_null(e);
    int V = engine_model_config(e)->vocab;
    int32_t *out[16] = {0};
    int nout[16] = {0}, done = 0;
    float *logits = malloc(sizeof(float) * (size_t)V);
    char err[256];
    for (int p = 0; p < np; p++) {
        json_t *cs = json_array_get(prompts, (size_t)p);
        int n;
        int32_t *ids = json_ids(json_object_get(cs, "prompt"), &n);
        engine_sampling sp;
        engine_sampling_defaults(&sp);
        sp.temperature = 0;
        sp.ignore_eos = 1;
        sp.max_tokens = (int)json_array_size(json_object_get(cs, "greedy"));
        out[p] = calloc((size_t)sp.max_tokens, sizeof(int32_t));
        assert_int_equal(engine_add_ex(e, (uint64_t)p, ids, n, &sp, 1, err, sizeof err), 0);
        free(ids);
        if (concurrent) continue;
        while (engine_has_work(e)) {
            engine_output o;
            assert_int_equal(engine_step(e, &o), 0);
            for (int k = 0; k < o.n_events; k++)
                for (int t = 0; t < o.events[k].n_tokens; t++) out[p][nout[p]++] = o.events[k].tokens[t].id;
        }
    }
    while (concurrent && engine_has_work(e)) {
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int k = 0; k < o.n_events; k++) {
            int p = (int)o.events[k].req_id;
            for (int t = 0; t < o.events[k].n_tokens; t++) out[p][nout[p]++] = o.events[k].tokens[t].id;
            done += o.events[k].finish != ENGINE_RUNNING;
        }
    }
    for (int p = 0; p < np; p++) {
        json_t *cs = json_array_get(prompts, (size_t)p);
        json_t *greedy = json_object_get(cs, "greedy"), *margins = json_object_get(cs, "margins");
        assert_int_equal(engine_first_logits(e, (uint64_t)p, logits), 0);
        double rel = rel_err_json(logits, json_object_get(cs, "last_logits"), V);
        double maxabs = 0;
        for (int i = 0; i < V; i++) maxabs = fmax(maxabs, fabs(json_number_value(json_array_get(json_object_get(cs, "last_logits"), (size_t)i))));
        int compared = 0;
        for (int t = 0; t < (int)json_array_size(greedy); t++) {
            /* a near tie may flip legitimately: stop at the first low-margin step */
            if (json_number_value(json_array_get(margins, (size_t)t)) < 2 * LOGIT_TOL * maxabs) break;
            assert_int_equal(out[p][t], json_integer_value(json_array_get(greedy, (size_t)t)));
            compared++;
        }
        print_message("  %-11s prompt %3zu tokens: logits rel err %.2e, greedy %2d/%zu equal%s\n", name,
                      json_array_size(json_object_get(cs, "prompt")), rel, compared,
                      json_array_size(greedy), concurrent ? " (batched)" : "");
        assert_true(rel < LOGIT_TOL);
        assert_true(compared >= 1);
        free(out[p]);
    }
    free(logits);
    engine_destroy(e);
    json_decref(g);
    return np;
}

static void test_golden_llama_tiny(void **st) { (void)st; check_model("llama-tiny", 0); }
static void test_golden_qwen2_tiny(void **st) { (void)st; check_model("qwen2-tiny", 0); }
static void test_golden_qwen3_tiny(void **st) { (void)st; check_model("qwen3-tiny", 0); }
static void test_golden_llama_draft(void **st) { (void)st; check_model("llama-draft", 0); }
static void test_golden_mistral_swa_tiny(void **st) { (void)st; check_model("mistral-swa-tiny", 0); }
static void test_golden_gemma3_tiny(void **st) { (void)st; check_model("gemma3-tiny", 0); }
static void test_golden_qwen3moe_tiny(void **st) { (void)st; check_model("qwen3moe-tiny", 0); }
static void test_golden_mixtral_tiny(void **st) { (void)st; check_model("mixtral-tiny", 0); }
static void test_golden_phi3_tiny(void **st) { (void)st; check_model("phi3-tiny", 0); }
/* gemma3-tiny's norms are all 0 (HF's initialisation), so its four norms per layer are
 * interchangeable; gemma3-norms (ours, by HF) has every norm perturbed and a window of 16. */
static void test_golden_gemma3_norms(void **st) { (void)st; check_model("gemma3-norms", 0); }

/* Blocks behind a sliding window go back to the pool while a long generation runs, the
 * output is the same as with them kept, and a second request for the same prompt (whose
 * first blocks come back from the prefix cache: in a window pool only the last window's)
 * gives the same tokens again. Mistral's window of 64 is on every layer, so its one pool
 * releases; gemma3-tiny has three window layers and one full layer, so the window layers
 * get a pool of their own that releases while the full layer keeps every block. */
typedef struct {
    int used, win_used, win_total, hit;   /* blocks held at most, prefix-hit tokens */
    int layers, win_layers;               /* layers in each pool */
    double bytes;                         /* KV bytes in use at most */
    uint64_t drafted, accepted;           /* draft tokens verified, and accepted */
} window_run;

/* The engine these tests run: two slots of 512 tokens, 64 MiB of KV, the given step
 * budget; the callers change the rest. */
static engine_config window_cfg(int keep, int budget) {
    return (engine_config){.max_seq_len = 512, .max_batch = 2, .kv_bytes = 64u << 20, .threads = 2,
                           .max_tokens_per_step = budget, .keep_window_kv = keep};
}

static void run_window(const char *name, engine_config c, int rounds, int32_t *out, float *lp, int n_out,
                       window_run *w) {
    char path[4096], err[1024] = "";
    model_dir(name, path, sizeof path);
    c.model_path = path;
    engine *e = engine_create(&c, err, sizeof err);
    assert_non_null(e);
    json_t *g = golden(name), *cs = NULL, *p;
    size_t i;
    json_array_foreach(json_object_get(g, "prompts"), i, p)
        if (json_array_size(json_object_get(p, "prompt")) == 100) cs = p;
    assert_non_null(cs);
    int n;
    int32_t *ids = json_ids(json_object_get(cs, "prompt"), &n);
    memset(w, 0, sizeof *w);
    for (int round = 0; round < rounds; round++) {
        engine_sampling sp;
        engine_sampling_defaults(&sp);
        sp.temperature = 0;
        sp.ignore_eos = 1;
        sp.max_tokens = n_out;
        sp.logprobs = 0;
        assert_int_equal(engine_add_ex(e, (uint64_t)round, ids, n, &sp, 1, err, sizeof err), 0);
        int got = 0;
        while (engine_has_work(e)) {
            engine_output o;
            assert_int_equal(engine_step(e, &o), 0);
            for (int k = 0; k < o.n_events; k++)
                for (int t = 0; t < o.events[k].n_tokens; t++) {
                    int32_t id = o.events[k].tokens[t].id;
                    if (round == 0) out[got] = id;
                    else assert_int_equal(id, out[got]);
                    /* the chosen token's logprob: a key read from the wrong block moves it */
                    if (round == 0) lp[got] = o.events[k].tokens[t].logprob;
                    else assert_float_equal(o.events[k].tokens[t].logprob, lp[got], 1e-5);
                    got++;
                }
            engine_stats s;
            engine_get_stats(e, &s);
            if (s.kv_blocks_used > w->used) w->used = s.kv_blocks_used;
            if (s.kv_win_blocks_used > w->win_used) w->win_used = s.kv_win_blocks_used;
            w->win_total = s.kv_win_blocks_total;
            w->layers = s.kv_layers;
            w->win_layers = s.kv_win_layers;
            if (s.kv_bytes_used > w->bytes) w->bytes = s.kv_bytes_used;
            w->drafted = s.spec_draft_tokens;
            w->accepted = s.spec_accepted_tokens;
            w->hit = (int)s.prefix_cache_hit_tokens;
        }
        assert_int_equal(got, n_out);
    }
    free(ids);
    json_decref(g);
    engine_destroy(e);
}

static void test_sliding_window_blocks_are_released(void **st) {
    (void)st;
    enum { N = 300 };
    int32_t kept[N], released[N];
    float lk[N], lr[N];
    window_run k, r;
    run_window("mistral-swa-tiny", window_cfg(1, 2048), 1, kept, lk, N, &k);
    run_window("mistral-swa-tiny", window_cfg(0, 2048), 2, released, lr, N, &r);
    assert_memory_equal(kept, released, sizeof kept);
    for (int i = 0; i < N; i++) assert_float_equal(lk[i], lr[i], 1e-5);
    /* 400 tokens: 25 blocks kept; released: the window (64) plus margin and the block
     * being filled, at most 7 */
    print_message("  mistral-swa-tiny, 100 + 300 tokens: KV blocks held at most %d kept, %d released; "
                  "second request's prefix hit %d tokens\n", k.used, r.used, r.hit);
    assert_true(k.used >= 25);
    assert_true(r.used <= 7);
    assert_int_equal(r.win_total, 0);
    assert_true(r.hit >= 16);
}

static void test_window_pool_of_mixed_layers_is_released(void **st) {
    (void)st;
    enum { N = 300 };
    int32_t kept[N], released[N], again[N], spec[N], spec_kept[N], small[N];
    float lk[N], lr[N], la[N], ls[N], lsk[N], lm[N];
    window_run k, r, a, sp, spk, sm;
    run_window("gemma3-tiny", window_cfg(1, 2048), 1, kept, lk, N, &k);
    /* a step budget of 64 tokens makes the window pool 20 blocks, so released blocks are
     * taken again (and overwritten) within the 400 tokens */
    run_window("gemma3-tiny", window_cfg(0, 64), 1, released, lr, N, &r);
    /* the default budget's pool (144 blocks) still caches the last window of the prompt
     * when the same prompt comes again */
    run_window("gemma3-tiny", window_cfg(0, 2048), 2, again, la, N, &a);
    /* speculation (a draft of the first 2 layers, both window layers, whose KV joins the
     * window pool; verify steps writing k positions ahead into both pools): greedy output
     * unchanged, and the draft proposes exactly what it proposes with every layer in one
     * pool (a draft key read from the wrong pool would change its drafts) */
    engine_config cs = window_cfg(0, 64);
    cs.draft_layers = 2;
    cs.spec_always = 1;
    run_window("gemma3-tiny", cs, 1, spec, ls, N, &sp);
    cs.keep_window_kv = 1;
    run_window("gemma3-tiny", cs, 1, spec_kept, lsk, N, &spk);
    /* a KV budget of 600,000 bytes: the 20 blocks asked for (24,576 bytes each here) would
     * take 82% of it and leave the full layer too little for one sequence. Half the budget
     * holds 12.2 blocks, under the fewest the engine runs with (13 with the null block: one
     * slot's window and one step's chunk), so the window pool gets 13 and the full layer
     * the rest */
    engine_config cm = window_cfg(0, 64);
    cm.kv_bytes = 600000;
    run_window("gemma3-tiny", cm, 2, small, lm, N, &sm);
    assert_memory_equal(kept, released, sizeof kept);
    assert_memory_equal(kept, again, sizeof kept);
    assert_memory_equal(kept, spec, sizeof kept);
    assert_memory_equal(kept, small, sizeof kept);
    assert_int_equal(sm.win_total, 12);
    assert_true(sp.drafted > 100);
    assert_memory_equal(spec, spec_kept, sizeof spec);
    assert_true(sp.drafted == spk.drafted && sp.accepted == spk.accepted);
    assert_int_equal(sp.win_layers, 5);   /* 3 of the target's, 2 of the draft's */
    assert_int_equal(sp.layers, 1);
    assert_int_equal(spk.win_layers, 0);
    print_message("  with a draft of the first 2 layers: %d layers in the window pool, %llu of %llu drafts "
                  "accepted, as with one pool\n", sp.win_layers, (unsigned long long)sp.accepted,
                  (unsigned long long)sp.drafted);
    for (int i = 0; i < N; i++) {
        assert_float_equal(lk[i], lr[i], 1e-5);
        assert_float_equal(lk[i], la[i], 1e-5);
    }
    print_message("  gemma3-tiny, 100 + 300 tokens: kept: %d blocks of 4 layers; released: %d blocks of the full "
                  "layer + at most %d of the 3 window layers' pool (%d blocks); second request's prefix hit %d "
                  "tokens\n", k.used, r.used, r.win_used, r.win_total, a.hit);
    assert_int_equal(k.win_total, 0);    /* kept: one pool, as before */
    assert_int_equal(k.layers, 4);
    assert_int_equal(k.win_layers, 0);
    assert_int_equal(r.layers, 1);
    assert_int_equal(r.win_layers, 3);
    /* 400 tokens of 4 layers against 400 of 1 and at most 7 blocks of 3 */
    print_message("  most KV in use: %.0f bytes kept, %.0f released\n", k.bytes, r.bytes);
    assert_true(r.bytes < 0.5 * k.bytes);
    assert_true(k.used >= 25);
    assert_int_equal(r.win_total, 19);   /* 2 slots x 7 + 64 / 16 + 2, less the null block */
    assert_true(r.used >= 25);           /* the full layer keeps the whole context */
    assert_true(r.win_used >= 5 && r.win_used <= 7);
    assert_true(a.win_used <= 7);
    /* the second request found its prompt's blocks: the full layer's all of them, the
     * window pool's the last window (the first blocks were released) */
    assert_true(a.hit >= 64);
}

/* --max-prefill-decoding: a 1,200-token prompt arriving while another request decodes
 * is fed at most 512 tokens a step (the engine's default) next to the decode row, then
 * the whole budget once nothing decodes; with the bound off its first step takes the
 * budget (2048). Its tokens are the same either way. */
static int run_burst(int cap, int32_t *out, int n_out, int *max_mixed) {
    char path[4096], err[1024] = "";
    model_dir("llama-tiny", path, sizeof path);
    engine_config c = {.model_path = path, .max_seq_len = 2048, .max_batch = 4, .kv_bytes = 64u << 20, .threads = 2,
                       .max_prefill_decoding = cap};
    engine *e = engine_create(&c, err, sizeof err);
    assert_non_null(e);
    enum { LONG = 1200 };
    int32_t ids[LONG];
    for (int i = 0; i < LONG; i++) ids[i] = 1 + (i * 37) % 500;
    engine_sampling sp;
    engine_sampling_defaults(&sp);
    sp.temperature = 0;
    sp.ignore_eos = 1;
    sp.max_tokens = 40;
    assert_int_equal(engine_add_ex(e, 0, ids, 20, &sp, 1, err, sizeof err), 0);
    engine_output o;
    for (int i = 0; i < 3; i++) assert_int_equal(engine_step(e, &o), 0);   /* request 0 is decoding */
    sp.max_tokens = n_out;
    assert_int_equal(engine_add_ex(e, 1, ids, LONG, &sp, 1, err, sizeof err), 0);
    int got = 0, first = -1, decoding = 1;
    *max_mixed = 0;
    while (engine_has_work(e)) {
        assert_int_equal(engine_step(e, &o), 0);
        if (first < 0) first = o.n_scheduled_tokens;
        if (decoding && o.n_scheduled_tokens > *max_mixed) *max_mixed = o.n_scheduled_tokens;
        for (int k = 0; k < o.n_events; k++) {
            if (o.events[k].req_id == 0 && o.events[k].finish != ENGINE_RUNNING) decoding = 0;
            for (int t = 0; o.events[k].req_id == 1 && t < o.events[k].n_tokens; t++) out[got++] = o.events[k].tokens[t].id;
        }
    }
    assert_int_equal(got, n_out);
    engine_destroy(e);
    return first;
}

static void test_prefill_bounded_while_decoding(void **st) {
    (void)st;
    int32_t a[8], b[8];
    int mixed_a, mixed_b;
    int first_a = run_burst(0, a, 8, &mixed_a), first_b = run_burst(-1, b, 8, &mixed_b);
    print_message("  1,200-token prompt beside a decode: first step %d tokens, at most %d while decoding (default); "
                  "%d unbounded\n", first_a, mixed_a, first_b);
    assert_true(first_a >= 1 + 512 - 1 && first_a <= 1 + 512 + 1);   /* the decode row (+1 in flight) and 512 */
    assert_true(mixed_a <= 512 + 2);
    assert_true(first_b > 1000);
    assert_memory_equal(a, b, sizeof a);
}

static void test_golden_concurrent_batch_matches_single(void **st) {
    (void)st;
    for (size_t m = 0; m < sizeof models / sizeof models[0]; m++) check_model(models[m], 1);
}

/* all_logits of the 33-token prompt: every position through the runner at once, and the
 * same prompt fed in uneven chunks (chunked prefill) gives the same numbers. */
static void check_all_logits(const char *name, int chunk) {
    json_t *g = golden(name);
    json_t *prompts = json_object_get(g, "prompts"), *cs = NULL;
    for (size_t i = 0; i < json_array_size(prompts); i++)
        if (json_object_get(json_array_get(prompts, i), "all_logits")) cs = json_array_get(prompts, i);
    assert_non_null(cs);
    char path[4096], err[512];
    model_dir(name, path, sizeof path);
    model *m = model_load(path, err, sizeof err);
    assert_non_null(m);
    runner_config rc = {.num_blocks = 8, .block_size = 16, .max_batch = 1, .max_seq_len = 64,
                        .max_tokens_per_step = 64, .threads = 2};
    runner *r = runner_cpu_create(m, NULL, &rc, err, sizeof err);
    assert_non_null(r);
    int32_t blocks[3] = {5, 2, 7};  /* scattered on purpose: the block table must be used */
    assert_int_equal(r->ops->slot_write_blocks(r, 0, 0, blocks, 3), 0);
    int n, V = m->cfg.vocab;
    int32_t *ids = json_ids(json_object_get(cs, "prompt"), &n);
    float *lg = malloc(sizeof(float) * (size_t)n * V);
    for (int i = 0; i < n * V; i++) lg[i] = NAN;  /* poison: every element must be written */
    for (int pos = 0; pos < n; pos += chunk) {
        int len = pos + chunk <= n ? chunk : n - pos;
        runner_row row = {.slot = 0, .n_new = len, .tok_off = 0, .n_logits = len, .logits_off = 0};
        runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = ids + pos,
                          .n_tokens = len, .logits = lg + (size_t)pos * V};
        assert_int_equal(runner_forward(r, &b), 0);
    }
    assert_int_equal(r->ops->slot_get_len(r, 0, RUNNER_TARGET), n);
    json_t *all = json_object_get(cs, "all_logits");
    double worst = 0;
    for (int p = 0; p < n; p++) {
        double e = rel_err_json(lg + (size_t)p * V, json_array_get(all, (size_t)p), V);
        worst = e > worst ? e : worst;
    }
    print_message("  %-11s all %d positions (chunks of %d): worst rel err %.2e\n", name, n, chunk, worst);
    assert_true(worst < LOGIT_TOL);
    free(lg);
    free(ids);
    runner_destroy(r);
    model_free(m);
    json_decref(g);
}

static void test_golden_all_positions(void **st) {
    (void)st;
    for (size_t m = 0; m < sizeof models / sizeof models[0]; m++) {
        check_all_logits(models[m], 64);
        check_all_logits(models[m], 7);
    }
}

/* qwen2-tiny advertises max_position_embeddings 1,048,576: the pool and the per-request
 * limits come from max_seq_len and the budget, never from that. */
static void test_pool_ignores_max_position_embeddings(void **st) {
    (void)st;
    char path[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/models/qwen2-tiny", fixtures_dir());
    engine_config c = {.model_path = path, .threads = 1};
    engine *e = engine_create(&c, err, sizeof err);
    assert_non_null(e);
    assert_int_equal(engine_model_config(e)->max_pos, 1048576);
    engine_stats s;
    engine_get_stats(e, &s);
    assert_int_equal(s.max_seq_len, 4096);
    /* capped at every slot full at max_seq_len: 64 slots x (4096/16 + 1) blocks */
    assert_true(s.kv_blocks_total <= 64 * (4096 / 16 + 1));
    assert_true(s.kv_blocks_total >= 4096 / 16);
    engine_destroy(e);
}

static void test_budget_too_small_names_the_knobs(void **st) {
    (void)st;
    char path[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/models/llama-tiny", fixtures_dir());
    engine_config c = {.model_path = path, .max_seq_len = 4096, .kv_bytes = 1 << 20, .threads = 1};
    engine *e = engine_create(&c, err, sizeof err);
    assert_null(e);
    assert_non_null(strstr(err, "--max-seq-len"));
    assert_non_null(strstr(err, "--kv-cache-bytes"));
}

static void test_prompt_over_context_is_rejected(void **st) {
    (void)st;
    engine *e = open_engine("llama-tiny", 4);
    assert_non_null(e);
    int32_t *ids = calloc(600, sizeof(int32_t));
    engine_sampling sp;
    engine_sampling_defaults(&sp);
    char err[256] = "";
    assert_int_equal(engine_add(e, 1, ids, 600, &sp, err, sizeof err), SPECD_ERANGE);
    assert_non_null(strstr(err, "max_seq_len"));
    ids[3] = 5000;  /* outside the 1024-token vocabulary */
    assert_int_equal(engine_add(e, 2, ids, 10, &sp, err, sizeof err), SPECD_EINVAL);
    assert_int_equal(engine_add(e, 3, ids, 0, &sp, err, sizeof err), SPECD_ERANGE);
    assert_false(engine_has_work(e));
    free(ids);
    engine_destroy(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_llama_tiny),
        cmocka_unit_test(test_golden_qwen2_tiny),
        cmocka_unit_test(test_golden_qwen3_tiny),
        cmocka_unit_test(test_golden_llama_draft),
        cmocka_unit_test(test_golden_mistral_swa_tiny),
        cmocka_unit_test(test_golden_gemma3_tiny),
        cmocka_unit_test(test_golden_qwen3moe_tiny),
        cmocka_unit_test(test_golden_mixtral_tiny),
        cmocka_unit_test(test_golden_phi3_tiny),
        cmocka_unit_test(test_golden_gemma3_norms),
        cmocka_unit_test(test_golden_concurrent_batch_matches_single),
        cmocka_unit_test(test_sliding_window_blocks_are_released),
        cmocka_unit_test(test_window_pool_of_mixed_layers_is_released),
        cmocka_unit_test(test_prefill_bounded_while_decoding),
        cmocka_unit_test(test_golden_all_positions),
        cmocka_unit_test(test_pool_ignores_max_position_embeddings),
        cmocka_unit_test(test_budget_too_small_names_the_knobs),
        cmocka_unit_test(test_prompt_over_context_is_rejected),
    };
    return cmocka_run_group_tests_name("golden", tests, NULL, NULL);
}
