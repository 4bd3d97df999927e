/* Sampling in the runner (runner_step: the decode op and the forward pass of a step)
 * against the engine's host sampler: the same requests, once as they are (sampled
 * by the runner) and once with recorded first-token logits, a feature that keeps a
 * request on the host path without changing its tokens, must give identical tokens,
 * logprobs and top logprobs. The requests use every feature the runner samples with:
 * greedy and seeded draws with top-k / top-p / min-p, presence, frequency and repetition
 * penalties, logit bias, min_tokens (eos biased up, so suppressing it decides where the
 * request ends) and top logprobs; alone and batched, with prefill chunks sharing steps
 * with decode rows (requests admitted while others decode, a small token budget), so both
 * the decode op and forward sampling run; then with speculating rows (prompt lookup and a
 * draft model), against no speculation. Last, runner_step itself: which of the runner's
 * ops it picks for a batch, and its verify op and forward pass standing the same drafts. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/engine.h"
#include "engine/core/err.h"
#include "engine/core/runner.h"
#include "tests/fixtures.h"

#define NREQ 8
#define MAXTOK 40
#define NTOP 5
#define EOS 2   /* llama-tiny's */

typedef struct {
    int32_t out[NREQ][MAXTOK];
    float lp[NREQ][MAXTOK];
    int n_top[NREQ][MAXTOK];
    int32_t top_ids[NREQ][MAXTOK][NTOP];
    float top_lp[NREQ][MAXTOK][NTOP];
    int n[NREQ];
    engine_finish finish[NREQ];
    int accepted[NREQ];   /* drafts that stood, per request */
    engine_stats st;
} run;

static const int32_t g_bias_ids[] = {EOS, 17, 300, 17, 911};
static const float g_bias_vals[] = {6.0f, 2.5f, -100.0f, 1.0f, 3.0f};

/* Request i: a sampling mode (greedy, or a seeded draw through one of the filters) and a
 * combination of the adjustments; every request reports the chosen token's logprob. */
static int g_all_greedy;   /* the speculative test: every request greedy */
static int g_cool;         /* ... or the seeded draws at low temperatures (they loop as
                            * greedy requests do, so prompt lookup's drafts stand) */
static int g_all_penalized;   /* every request with a presence penalty too */

static void sampling_of(int i, engine_sampling *sp) {
    engine_sampling_defaults(sp);
    sp->max_tokens = MAXTOK;
    sp->ignore_eos = 1;
    sp->logprobs = 0;
    if (i % 3 == 0 || g_all_greedy) {
        sp->temperature = 0;                       /* greedy */
    } else {
        sp->temperature = g_cool ? 0.1f + 0.05f * (float)i : 0.7f + 0.1f * (float)i;   /* seeded draws, */
        sp->seed = 100 + (uint64_t)i;
        sp->has_seed = 1;                                /* each filter in turn */
        if (i % 3 == 1) sp->top_k = 20, sp->top_p = 0.9f;
        else sp->min_p = 0.05f;
    }
    switch (i) {
    case 0: sp->presence_penalty = 1.5f; sp->logprobs = NTOP; break;
    case 1: sp->frequency_penalty = 1.0f; break;
    case 2: sp->repetition_penalty = 1.6f; sp->logprobs = NTOP; break;
    case 3: /* min_tokens: eos biased up ends the request once it is allowed */
        sp->n_logit_bias = 1, sp->min_tokens = 12, sp->ignore_eos = 0;
        break;
    case 4: sp->n_logit_bias = 5; sp->logprobs = NTOP; break;   /* 17 listed twice */
    case 5: sp->logprobs = NTOP; break;
    case 6: /* everything at once */
        sp->presence_penalty = 0.5f, sp->frequency_penalty = 0.7f, sp->repetition_penalty = 1.3f;
        sp->n_logit_bias = 5, sp->min_tokens = 20, sp->ignore_eos = 0, sp->logprobs = NTOP;
        break;
    case 7: sp->repetition_penalty = 0.8f; sp->frequency_penalty = -0.5f; break;   /* rewards */
    }
    sp->logit_bias_ids = g_bias_ids;
    sp->logit_bias_vals = g_bias_vals;
    if (g_all_penalized && sp->presence_penalty == 0) sp->presence_penalty = 0.4f;
}

/* Requests enter every other step, so prefill chunks share steps with decode rows. spec 1:
 * prompt lookup drafts (the prompts repeat themselves), 2: the model drafts for itself;
 * either verifies whenever a row has drafts (no cost model). */
static void run_all(int host, int max_batch, int spec, run *r) {
    char path[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/models/llama-tiny", fixtures_dir());
    engine_config c = {.model_path = path, .max_seq_len = 256, .max_batch = max_batch, .kv_bytes = 16u << 20,
                       .threads = 2, .max_tokens_per_step = 24, .spec_ngram = spec == 1, .spec_always = spec != 0,
                       .num_draft_tokens = spec ? 4 : 0, .draft_path = spec == 2 ? path : NULL};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("engine_create: %s", err);
    memset(r, 0, sizeof *r);
    int added = 0, step = 0;
    while (added < NREQ || engine_has_work(e)) {
        if (added < NREQ && step++ % 2 == 0) {
            int32_t prompt[60];
            int np = 5 + 7 * added;   /* 5 .. 54 tokens: several need more than one chunk */
            for (int t = 0; t < np; t++) prompt[t] = (int32_t)((31 * added + 7 * t) % 40 + 3);   /* repeats */
            engine_sampling sp;
            sampling_of(added, &sp);
            assert_int_equal(engine_add_ex(e, (uint64_t)added, prompt, np, &sp, host, err, sizeof err), 0);
            added++;
        }
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int k = 0; k < o.n_events; k++) {
            const engine_event *ev = &o.events[k];
            int id = (int)ev->req_id;
            for (int t = 0; t < ev->n_tokens; t++) {
                const engine_token *et = &ev->tokens[t];
                int j = r->n[id]++;
                assert_true(j < MAXTOK);
                r->out[id][j] = et->id;
                r->lp[id][j] = et->logprob;
                r->n_top[id][j] = et->n_top;
                for (int q = 0; q < et->n_top && q < NTOP; q++) {
                    r->top_ids[id][j][q] = et->top_ids[q];
                    r->top_lp[id][j][q] = et->top_logprobs[q];
                }
            }
            if (ev->finish != ENGINE_RUNNING) r->finish[id] = ev->finish;
            r->accepted[id] = ev->spec_accepted_tokens;
        }
    }
    engine_get_stats(e, &r->st);
    engine_destroy(e);
}

/* Both runs of every request: the runner's (dev) equals the host sampler's (host). */
static void check_runs(int mb) {
        static run dev, host;
        run_all(0, mb, 0, &dev);
        run_all(1, mb, 0, &host);
        /* with a penalty on every request, the steps queued in flight all carry penalised
         * rows: the runner counted the token in flight into their statistics */
        if (g_all_penalized) assert_true(dev.st.steps_async > 0);
        /* the runner sampled in both of its ways; the recorded requests never */
        assert_true(dev.st.steps_forward_sampled > 0);
        assert_true(dev.st.steps_device_decode > 0);
        assert_int_equal(host.st.steps_forward_sampled, 0);
        assert_int_equal(host.st.steps_device_decode, 0);
        double worst = 0;
        int tops = 0;
        for (int i = 0; i < NREQ; i++) {
            engine_sampling sp;
            sampling_of(i, &sp);
            assert_int_equal(dev.n[i], host.n[i]);
            assert_int_equal(dev.finish[i], host.finish[i]);
            if (sp.ignore_eos) assert_int_equal(dev.n[i], MAXTOK);
            else assert_true(dev.n[i] > sp.min_tokens);   /* eos suppressed until min_tokens */
            assert_memory_equal(dev.out[i], host.out[i], sizeof(int32_t) * (size_t)dev.n[i]);
            for (int t = 0; t < dev.n[i]; t++) {
                assert_true(host.lp[i][t] < 0);
                double d = fabs((double)dev.lp[i][t] - host.lp[i][t]);
                worst = d > worst ? d : worst;
                assert_int_equal(dev.n_top[i][t], sp.logprobs > 0 ? NTOP : 0);
                assert_int_equal(host.n_top[i][t], dev.n_top[i][t]);
                for (int q = 0; q < dev.n_top[i][t]; q++, tops++) {
                    assert_int_equal(dev.top_ids[i][t][q], host.top_ids[i][t][q]);
                    d = fabs((double)dev.top_lp[i][t][q] - host.top_lp[i][t][q]);
                    worst = d > worst ? d : worst;
                }
            }
        }
        assert_true(worst <= 1e-6);
        printf("  max_batch %d%s: %d requests equal (two end on eos after %d, %d tokens), %d top logprobs, logprobs "
               "within %.1e; %llu decode-op steps, %llu of %llu composed steps sampled in the forward pass, %llu "
               "queued in flight\n", mb, g_all_penalized ? ", every request penalised" : "", NREQ, dev.n[3], dev.n[6],
               tops, worst, (unsigned long long)dev.st.steps_device_decode,
               (unsigned long long)dev.st.steps_forward_sampled, (unsigned long long)dev.st.steps_composed,
               (unsigned long long)dev.st.steps_async);
}

static void test_runner_sampling_equals_host_sampling(void **s) {
    (void)s;
    for (int mb = 1; mb <= NREQ; mb += NREQ - 1) check_runs(mb);   /* one at a time, then all batched */
}

/* Penalised rows are queued in flight like any other (async scheduling): the token the
 * step in flight samples is counted by the runner, so the tokens equal the host's. */
static void test_penalised_rows_queue_in_flight(void **s) {
    (void)s;
    g_all_penalized = 1;
    for (int mb = 1; mb <= NREQ; mb += NREQ - 1) check_runs(mb);
    g_all_penalized = 0;
}

/* Speculative rows keep every sampling feature: penalties, bias and eos suppression apply
 * at every verified position with the drafts before it in the history, and each position
 * draws with the uniform of its output position, so the emitted tokens are the ones plain
 * decoding emits. With prompt lookup (point-mass drafts) that holds for seeded draws too:
 * every request, as it is (its verified positions sampled in the runner's forward pass)
 * and recorded (sampled and accepted on the host), emits exactly the tokens of no
 * speculation. The model drafting for itself runs greedy requests (its sampled drafts are
 * accepted by rejection sampling, which is lossless in distribution only); it proposes
 * what the target would pick (its picks sampled in the runner too), so every draft stands,
 * and a feature applied at the wrong position makes a draft fail or the emitted tokens
 * differ. Prompt lookup's drafts stand where a
 * request loops (the rewarded and unpenalised ones). */
static void check_same(const run *a, const run *b, double *worst) {
    for (int i = 0; i < NREQ; i++) {
        engine_sampling sp;
        sampling_of(i, &sp);
        if (sp.ignore_eos) assert_int_equal(a->n[i], MAXTOK);
        else assert_true(a->n[i] > sp.min_tokens);
        assert_int_equal(a->n[i], b->n[i]);
        assert_int_equal(a->finish[i], b->finish[i]);
        assert_memory_equal(a->out[i], b->out[i], sizeof(int32_t) * (size_t)b->n[i]);
        for (int t = 0; t < b->n[i]; t++) {
            double d = fabs((double)a->lp[i][t] - b->lp[i][t]);
            *worst = d > *worst ? d : *worst;
            assert_int_equal(a->n_top[i][t], b->n_top[i][t]);
            for (int q = 0; q < b->n_top[i][t]; q++) {
                assert_int_equal(a->top_ids[i][t][q], b->top_ids[i][t][q]);
                d = fabs((double)a->top_lp[i][t][q] - b->top_lp[i][t][q]);
                *worst = d > *worst ? d : *worst;
            }
        }
    }
}

static void test_speculative_rows_keep_every_sampling_feature(void **s) {
    (void)s;
    for (int mode = 0; mode < 4; mode++) {
        int mb = mode % 2 ? NREQ : 1, drafter = 1 + mode / 2;
        g_all_greedy = drafter == 2;
        g_cool = drafter == 1;
        static run plain, spec, spec_host;
        run_all(0, mb, 0, &plain);
        run_all(0, mb, drafter, &spec);
        assert_true(spec.st.spec_drafts > 0);
        assert_true(spec.st.spec_accepted_tokens > 0);
        /* the speculating rows with these features sampled in the runner */
        assert_true(spec.st.spec_rows_runner_sampled > 0);
        if (drafter == 2) {
            /* the draft's picks too, adjusted as the target's at each position: the model
             * drafting for itself proposes exactly what the target picks */
            assert_true(spec.st.draft_passes_sampled > 0);
            assert_int_equal(spec.st.spec_accepted_tokens, spec.st.spec_draft_tokens);
        }
        /* drafts stood in seeded requests too: their verified positions past the first drew
         * with their own output positions' uniforms */
        int seeded_acc = 0;
        for (int i = 0; i < NREQ; i++) {
            engine_sampling sp;
            sampling_of(i, &sp);
            if (sp.temperature > 0) seeded_acc += spec.accepted[i];
        }
        assert_true(drafter == 2 || seeded_acc > 0);
        double worst = 0;
        check_same(&spec, &plain, &worst);
        if (drafter == 1) {   /* the host's acceptance of the same drafts */
            run_all(1, mb, drafter, &spec_host);
            assert_true(spec_host.st.spec_accepted_tokens > 0);
            assert_int_equal(spec_host.st.spec_rows_runner_sampled, 0);
            check_same(&spec_host, &plain, &worst);
        }
        assert_true(worst <= 1e-4);
        int tokens = 0;
        for (int i = 0; i < NREQ; i++) tokens += plain.n[i];
        printf("  max_batch %d, %s: %llu verify rows (%llu sampled in the runner), %llu of %llu drafts accepted "
               "(%d in seeded requests); the %s requests' %d tokens equal to no speculation%s, logprobs within "
               "%.1e\n", mb, drafter == 1 ? "prompt lookup" : "the model as its own draft",
               (unsigned long long)spec.st.spec_drafts, (unsigned long long)spec.st.spec_rows_runner_sampled,
               (unsigned long long)spec.st.spec_accepted_tokens, (unsigned long long)spec.st.spec_draft_tokens, seeded_acc,
               drafter == 1 ? "greedy and seeded" : "greedy", tokens,
               drafter == 1 ? " (and with acceptance on the host)" : "", worst);
    }
    g_all_greedy = g_cool = 0;
}

/* A draft model's sampled drafts stand by rejection sampling against the draft's own
 * distributions, not by comparing with the target's draw: with the model drafting for
 * itself (the same distributions at every position, features included) every draft
 * stands, where drawing the target's token and comparing would reject many. */
static void test_sampled_model_drafts_stand_by_rejection_sampling(void **s) {
    (void)s;
    g_cool = 0;
    static run spec;
    run_all(0, NREQ, 2, &spec);
    int sampled = 0;
    for (int i = 0; i < NREQ; i++) {
        engine_sampling sp;
        sampling_of(i, &sp);
        if (sp.temperature > 0) sampled += spec.accepted[i];
    }
    print_message("  the model as its own draft, greedy and seeded requests: %llu of %llu drafts accepted (%d in seeded "
                  "requests)\n", (unsigned long long)spec.st.spec_accepted_tokens,
                  (unsigned long long)spec.st.spec_draft_tokens, sampled);
    assert_true(sampled > 0);
    assert_int_equal(spec.st.spec_accepted_tokens, spec.st.spec_draft_tokens);
}

/* ---- runner_step: the op it picks, and the verify op against the forward pass ---- */

enum { RS_SLOTS = 3, RS_PROMPT = 12, RS_K = 4 };

static runner *rs_runner(model *m) {
    char err[512];
    runner_config rc = {.num_blocks = 16, .block_size = 16, .max_batch = 4, .max_seq_len = 64,
                        .max_tokens_per_step = 64, .threads = 2, .num_draft_tokens = RS_K, .cpu_verify = 1};
    runner *r = runner_cpu_create(m, NULL, &rc, err, sizeof err);
    if (!r) fail_msg("runner_cpu_create: %s", err);
    static float lg[64 * 1024];
    for (int s = 0; s < RS_SLOTS; s++) {   /* each slot: its prompt but the last token */
        int32_t blocks[2] = {1 + 2 * s, 2 + 2 * s}, p[RS_PROMPT];
        for (int t = 0; t < RS_PROMPT; t++) p[t] = (int32_t)(3 + (17 * s + 5 * t) % 50);
        assert_int_equal(r->ops->slot_write_blocks(r, s, 0, blocks, 2), 0);
        runner_row row = {.slot = s, .n_new = RS_PROMPT - 1};
        runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = p, .n_tokens = RS_PROMPT - 1,
                          .logits = lg};
        assert_int_equal(runner_forward(r, &b), 0);
    }
    return r;
}

static int32_t rs_last(int s) { return (int32_t)(3 + (17 * s + 5 * (RS_PROMPT - 1)) % 50); }

/* A batch of RS_SLOTS rows, row s feeding its last token and nd[s] drafts, greedy, every
 * position sampled; want_lp: the rows want the chosen tokens' logprobs (which the verify
 * op does not report, so the forward pass runs it). */
typedef struct {
    runner_row rows[RS_SLOTS];
    int32_t tokens[RS_SLOTS * (RS_K + 1)], out[RS_SLOTS * (RS_K + 1)];
    float lp[RS_SLOTS * (RS_K + 1)];
    float logits[RS_SLOTS * (RS_K + 1) * 1024];   /* (the CPU runner's scratch; llama-tiny's vocabulary) */
    runner_sampling sp[RS_SLOTS * (RS_K + 1)];
    int nd[RS_SLOTS], out_n[RS_SLOTS];
    runner_step_batch sb;
} rs_batch;

static void rs_build(rs_batch *x, const int32_t drafts[RS_SLOTS][RS_K], const int nd[RS_SLOTS], int want_lp) {
    int nt = 0;
    memset(x, 0, sizeof *x);
    for (int s = 0; s < RS_SLOTS; s++) {
        x->nd[s] = nd[s];
        x->rows[s] = (runner_row){.slot = s, .n_new = nd[s] + 1, .tok_off = nt, .n_logits = nd[s] + 1, .logits_off = nt};
        x->tokens[nt] = rs_last(s);
        memcpy(x->tokens + nt + 1, drafts[s], (size_t)nd[s] * sizeof(int32_t));
        for (int j = 0; j <= nd[s]; j++) x->sp[nt + j] = (runner_sampling){.counter = (uint64_t)j, .logprob = want_lp};
        nt += nd[s] + 1;
    }
    x->sb = (runner_step_batch){.b = {.which = RUNNER_TARGET, .n_rows = RS_SLOTS, .rows = x->rows, .tokens = x->tokens,
                                      .n_tokens = nt, .logits = x->logits, .sp = x->sp, .out_tokens = x->out,
                                      .out_logprobs = x->lp},
                                .n_drafts = x->nd, .out_n = x->out_n};
}

static void test_runner_step_picks_the_op_and_verifies_alike(void **st) {
    (void)st;
    char path[4096], err[512];
    snprintf(path, sizeof path, "%s/models/llama-tiny", fixtures_dir());
    model *m = model_load(path, err, sizeof err);
    if (!m) fail_msg("model_load: %s", err);
    assert_int_equal(m->cfg.vocab, 1024);
    runner *a = rs_runner(m), *b = rs_runner(m);
    /* slot 0's greedy continuation, by the decode op, one token at a time (then undone) */
    int32_t g[RS_K], drafts[RS_SLOTS][RS_K] = {{0}, {7, 7, 7, 7}, {0}};
    const int nd[RS_SLOTS] = {RS_K - 1, 2, 0}, none[RS_SLOTS] = {0, 0, 0};
    static rs_batch x;
    for (int j = 0; j < RS_K; j++) {
        rs_build(&x, drafts, none, 0);
        if (j) x.tokens[0] = g[j - 1];
        assert_int_equal(runner_step_plan(a, &x.sb), RUNNER_OP_DECODE);
        assert_int_equal(runner_step(a, &x.sb), 0);
        assert_int_equal(x.sb.op, RUNNER_OP_DECODE);
        g[j] = x.out[0];
        for (int s = 0; s < RS_SLOTS; s++) assert_int_equal(x.out_n[s], 1);
    }
    for (int s = 0; s < RS_SLOTS; s++) assert_int_equal(a->ops->slot_set_len(a, s, RUNNER_TARGET, RS_PROMPT - 1), 0);
    memcpy(drafts[0], g, sizeof(int32_t) * (RS_K - 1));
    /* the same verify rows through the verify op (a) and the forward pass (b) */
    static rs_batch va, vb;
    rs_build(&va, drafts, nd, 0);
    rs_build(&vb, drafts, nd, 1);
    assert_int_equal(runner_step_plan(a, &va.sb), RUNNER_OP_VERIFY);
    assert_int_equal(runner_step_plan(b, &vb.sb), RUNNER_OP_FORWARD);
    assert_int_equal(runner_step(a, &va.sb), 0);
    assert_int_equal(runner_step(b, &vb.sb), 0);
    assert_int_equal(va.sb.op, RUNNER_OP_VERIFY);
    assert_int_equal(vb.sb.op, RUNNER_OP_FORWARD);
    assert_int_equal(va.out_n[0], RS_K);   /* the greedy continuation stands, then g[K-1] */
    assert_memory_equal(va.out, g, sizeof g);
    for (int s = 0; s < RS_SLOTS; s++) {
        assert_int_equal(va.out_n[s], vb.out_n[s]);
        assert_memory_equal(va.out + va.rows[s].logits_off, vb.out + vb.rows[s].logits_off,
                            sizeof(int32_t) * (size_t)va.out_n[s]);
        assert_true(vb.lp[vb.rows[s].logits_off] < 0);
        /* KV holds the fed token and what stood; the last emitted token is fed next */
        assert_int_equal(a->ops->slot_get_len(a, s, RUNNER_TARGET), RS_PROMPT - 1 + va.out_n[s]);
        assert_int_equal(b->ops->slot_get_len(b, s, RUNNER_TARGET), RS_PROMPT - 1 + va.out_n[s]);
    }
    assert_int_equal(va.out_n[2], 1);
    /* which op a batch goes to */
    rs_build(&x, drafts, nd, 0);
    x.sb.b.async = 1;   /* drafts are never queued in flight */
    assert_int_equal(runner_step_plan(a, &x.sb), RUNNER_OP_NONE);
    assert_int_equal(runner_step(a, &x.sb), SPECD_EINVAL);
    rs_build(&x, drafts, nd, 0);
    x.sp[0].presence_penalty = 0.5f;   /* the verify op applies no adjustments */
    assert_int_equal(runner_step_plan(a, &x.sb), RUNNER_OP_FORWARD);
    x.sp[0] = (runner_sampling){.temperature = 0.8f, .seed = 1};   /* it does take sampled rows */
    assert_int_equal(runner_step_plan(a, &x.sb), RUNNER_OP_VERIFY);
    rs_build(&x, drafts, none, 0);
    x.sp[1].presence_penalty = 0.5f;   /* the decode op does */
    assert_int_equal(runner_step_plan(a, &x.sb), RUNNER_OP_DECODE);
    x.sp[1] = (runner_sampling){.force = 1, .force_token = 5};   /* a prompt position */
    assert_int_equal(runner_step_plan(a, &x.sb), RUNNER_OP_FORWARD);
    x.sb.b.async = 1;
    assert_int_equal(runner_step_plan(a, &x.sb), RUNNER_OP_NONE);
    x.sb.b.sp = NULL;   /* logits to the host */
    assert_int_equal(runner_step_plan(a, &x.sb), RUNNER_OP_FORWARD);
    print_message("  slot 0's %d greedy drafts stood (verify op and forward pass alike); rows of 2 junk drafts and "
                  "of none emitted %d and %d\n", RS_K - 1, va.out_n[1], va.out_n[2]);
    runner_destroy(a);
    runner_destroy(b);
    model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_runner_sampling_equals_host_sampling),
        cmocka_unit_test(test_penalised_rows_queue_in_flight),
        cmocka_unit_test(test_speculative_rows_keep_every_sampling_feature),
        cmocka_unit_test(test_sampled_model_drafts_stand_by_rejection_sampling),
        cmocka_unit_test(test_runner_step_picks_the_op_and_verifies_alike),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
