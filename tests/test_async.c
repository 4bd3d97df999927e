/* Async scheduling (engine_config.sync_scheduling = 0, the default): a decode step, or a
 * step of prompt chunks beside decode rows (a forward sampling on the device), is queued
 * before the engine commits the one in flight, its decode rows fed from the runner's last
 * outputs, and a request that ends is known a step late. The same requests run with
 * it on and off must give the same tokens, logprobs and finish reasons: many at once,
 * admitted while others decode, greedy and seeded draws (the seed's counter and
 * min_tokens must count the token still in flight), eos stops at varied points, max_tokens
 * ends, top logprobs, a few rows with penalties (those steps run one at a time), aborts
 * while a step is in flight (nothing of that request may come after), readers paused and
 * resumed (engine_pause: nothing while paused but the step in flight), and a KV pool small
 * enough to preempt; and with prompt lookup configured, steps of more rows than the
 * verify op takes (they draft nothing) queued in flight; and with a draft model, its
 * speculative step ops queued one behind the other (each row fed its last two tokens on
 * the device, its 1..k+1 tokens known a step late). No token past a stop token or max_tokens may ever be reported, a
 * request reports at most once per engine_step, and the KV pool is back to empty at the
 * end. The CPU runner hands an async op's outputs over only at wait_queued, so an
 * engine that read them early would see stale values here. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/engine.h"
#include "tests/fixtures.h"

#define NREQ 24
#define MAXREQ 80   /* the prompt-lookup case: more rows than a verify op takes */
#define MAXTOK 48
#define NTOP 3
#define EOS 2   /* llama-tiny's */
#define ABORT_AT 5

typedef struct {
    int32_t out[MAXREQ][MAXTOK];
    float lp[MAXREQ][MAXTOK];
    int32_t top[MAXREQ][MAXTOK][NTOP];
    int n[MAXREQ];
    engine_finish finish[MAXREQ];
    int aborted[MAXREQ];
    int paused_events;    /* events of paused requests (the step in flight's token at most) */
    int stops, lengths;   /* requests that stopped on eos, that ended at max_tokens (run_pair) */
    int pauses;
    engine_stats st;
} run;

static const int32_t g_eos_id[] = {EOS};
static float g_eos_bias[MAXREQ];

static int g_ngram;   /* the prompt-lookup case (sampling_of's last block) */
static int g_draft;   /* the draft-model case: 1, or 2 with greedy rows only */
static const char *g_draft_model;   /* its draft (a fixture), or NULL: the target's first */
static int g_draft_layers;          /* ... this many layers */

/* (not with prompt lookup: how many tokens a request holds when it is aborted or paused
 * depends on when its drafts were verified, which async scheduling changes; with a draft
 * model that is true of aborts too, and compare takes the tokens both runs have) */
static int aborts(int i) { return !g_ngram && i % 8 == 7; }

/* A slow reader: paused (engine_pause) once it has PAUSE_AT tokens, resumed PAUSE_STEPS
 * engine_step calls later; it must come back to the same tokens. */
#define PAUSE_AT 3
#define PAUSE_STEPS 4
static int pauses(int i) { return !g_ngram && i % 8 == 3; }


static void sampling_of(int i, engine_sampling *sp) {
    engine_sampling_defaults(sp);
    sp->max_tokens = 8 + (i * 7) % 40;
    sp->logprobs = i % 3 == 0 ? NTOP : 0;
    if (i % 2 == 0) {
        sp->temperature = 0;
    } else {
        sp->temperature = 0.8f;
        sp->seed = 1000 + (uint64_t)i;
        sp->has_seed = 1;
        if (i % 4 == 1) sp->top_k = 30, sp->top_p = 0.95f;
        else sp->min_p = 0.02f;
    }
    /* eos pushed up by a different amount each: requests stop at varied points */
    g_eos_bias[i] = 0.4f * (float)(i % 7);
    sp->n_logit_bias = 1;
    sp->logit_bias_ids = g_eos_id;
    sp->logit_bias_vals = &g_eos_bias[i];
    if (g_draft) {   /* rows the speculative step op takes (no logprobs, bias or min_tokens),
                      * greedy and seeded, and a few that stop at eos, which keep the steps
                      * they are in composed (and synchronous) */
        sp->logprobs = -1;
        sp->n_logit_bias = i % 8 == 5;
        g_eos_bias[i] = 6.0f;
        if (i % 8 == 5) sp->min_tokens = 3;
        if (g_draft == 2) sp->temperature = 0;
        return;
    }
    if (g_ngram) {   /* 64 short rows, then 16 long greedy ones that speculate once alone */
        sp->max_tokens = i % 5 == 0 ? MAXTOK : 16 + i % 5;
        if (i % 5 == 0) sp->temperature = 0;
        sp->ignore_eos = i % 10 != 1;   /* the others stop where eos comes */
        g_eos_bias[i] = 3.0f;
        sp->n_logit_bias = i % 10 == 1;   /* (short rows; the long ones, which speculate,
                                           * have nothing the verify op does not take) */
        sp->logprobs = -1;
        return;
    }
    if (i % 4 == 3) sp->min_tokens = 6;
    if (i % 12 == 5) {   /* keeps the steps it is in synchronous */
        sp->presence_penalty = 0.5f;
        sp->max_tokens = 10;
    }
}

/* nreq requests; ngram: prompt lookup verified through the CPU runner's verify op, which
 * like the CUDA runner's takes at most RUNNER_VERIFY_MAX_ROWS rows (above that a step
 * drafts nothing and may be queued in flight). */
static void run_all(int sync, int max_batch, size_t kv_bytes, int nreq, int ngram, run *r) {
    char path[4096], dpath[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/models/llama-tiny", fixtures_dir());
    snprintf(dpath, sizeof dpath, "%s/models/%s", fixtures_dir(), g_draft_model ? g_draft_model : "");
    engine_config c = {.model_path = path, .max_seq_len = 256, .max_batch = max_batch, .kv_bytes = kv_bytes,
                       .threads = 2, .max_tokens_per_step = ngram ? 512 : 24, .sync_scheduling = sync,
                       .spec_ngram = ngram, .cpu_verify = ngram, .spec_always = ngram || g_draft,
                       .draft_path = g_draft && g_draft_model ? dpath : NULL,
                       .draft_layers = g_draft ? g_draft_layers : 0, .num_draft_tokens = g_draft ? 4 : 0};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("engine_create: %s", err);
    memset(r, 0, sizeof *r);
    int added = 0, step = 0, n_paused = 0;
    int paused_at[MAXREQ];   /* the step it was paused at, or -1 */
    for (int i = 0; i < MAXREQ; i++) paused_at[i] = -1;
    while (added < nreq || engine_has_work(e) || n_paused > 0) {
        for (int i = 0; i < nreq; i++)
            if (paused_at[i] >= 0 && step - paused_at[i] >= PAUSE_STEPS) {
                assert_int_equal(engine_pause(e, (uint64_t)i, 0), 0);
                paused_at[i] = -1;
                n_paused--;
            }
        /* three requests every other step at first, then the rest as the batch drains */
        for (int k = 0; k < (ngram ? nreq : 3) && added < nreq && (step % 2 == 0 || added >= 12); k++) {
            int32_t prompt[40];
            int np = 3 + (5 * added) % 30;
            /* (with prompt lookup, prompts that repeat themselves: drafts to verify) */
            for (int t = 0; t < np; t++)
                prompt[t] = (int32_t)(ngram ? (31 * added + 7 * t) % 40 + 3 : (17 * added + 11 * t) % 200 + 3);
            engine_sampling sp;
            sampling_of(added, &sp);
            assert_int_equal(engine_add(e, (uint64_t)added, prompt, np, &sp, err, sizeof err), 0);
            added++;
        }
        step++;
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        int seen[MAXREQ] = {0};
        for (int k = 0; k < o.n_events; k++) {
            const engine_event *ev = &o.events[k];
            int id = (int)ev->req_id;
            assert_true(id >= 0 && id < nreq);
            assert_int_equal(seen[id]++, 0);   /* one event per request per step */
            assert_false(r->aborted[id]);       /* nothing after an abort */
            assert_int_equal(r->finish[id], ENGINE_RUNNING);   /* nothing after the end */
            if (paused_at[id] >= 0) r->paused_events++;
            for (int t = 0; t < ev->n_tokens; t++) {
                const engine_token *et = &ev->tokens[t];
                int j = r->n[id]++;
                assert_true(j < MAXTOK);
                r->out[id][j] = et->id;
                r->lp[id][j] = et->logprob;
                for (int q = 0; q < et->n_top && q < NTOP; q++) r->top[id][j][q] = et->top_ids[q];
            }
            if (ev->finish != ENGINE_RUNNING) r->finish[id] = ev->finish;
            /* a client that goes away: aborted as soon as it has ABORT_AT tokens, with the
             * next step (async) already queued for it */
            if (pauses(id) && ev->finish == ENGINE_RUNNING && r->n[id] >= PAUSE_AT && paused_at[id] < 0 &&
                r->n[id] - ev->n_tokens < PAUSE_AT) {
                assert_int_equal(engine_pause(e, (uint64_t)id, 1), 0);
                paused_at[id] = step;
                n_paused++;
                r->pauses++;
            }
            if (aborts(id) && ev->finish == ENGINE_RUNNING && r->n[id] >= ABORT_AT) {
                assert_int_equal(engine_abort(e, (uint64_t)id), 0);
                r->aborted[id] = 1;
            }
        }
    }
    engine_get_stats(e, &r->st);
    engine_destroy(e);
}

static void compare(const run *a, const run *s, int nreq, int *stops, int *lengths) {
    for (int i = 0; i < nreq; i++) {
        engine_sampling sp;
        sampling_of(i, &sp);
        assert_int_equal(a->aborted[i], s->aborted[i]);
        /* (with a draft model an event brings up to k + 1 tokens, or two steps' worth
         * where a step is committed before the next runs; an aborted request keeps what
         * its events brought up to the one that reached ABORT_AT) */
        const int part = a->aborted[i] && g_draft, n = part && s->n[i] < a->n[i] ? s->n[i] : a->n[i];
        if (!part) assert_int_equal(a->n[i], s->n[i]);
        assert_int_equal(a->finish[i], s->finish[i]);
        assert_memory_equal(a->out[i], s->out[i], sizeof(int32_t) * (size_t)n);
        assert_memory_equal(a->lp[i], s->lp[i], sizeof(float) * (size_t)n);
        assert_memory_equal(a->top[i], s->top[i], sizeof a->top[i]);
        if (a->aborted[i]) {
            if (part) {
                assert_true(s->n[i] >= ABORT_AT && s->n[i] < ABORT_AT + 10);
                assert_true(a->n[i] >= ABORT_AT && a->n[i] < ABORT_AT + 10);
            } else {
                assert_int_equal(a->n[i], ABORT_AT);
            }
            continue;
        }
        assert_true(a->n[i] <= sp.max_tokens);
        if (a->finish[i] == ENGINE_FINISH_LENGTH) {
            assert_int_equal(a->n[i], sp.max_tokens);
            (*lengths)++;
        } else {
            assert_int_equal(a->finish[i], ENGINE_FINISH_STOP);
            assert_int_equal(a->out[i][a->n[i] - 1], EOS);   /* nothing past the stop token */
            assert_true(a->n[i] > sp.min_tokens);
            for (int t = 0; t < a->n[i] - 1; t++) assert_int_not_equal(a->out[i][t], EOS);
            (*stops)++;
        }
    }
}

/* The same requests with async scheduling off (sy) and on (as), compared; both runs stop
 * on eos and end at max_tokens somewhere, paused readers (not with prompt lookup) get
 * nothing while paused but the step already in flight, a pool under 1 MiB preempts, and
 * the async run leaves the pool empty. */
static void run_pair(int max_batch, size_t kv, int nreq, int ngram, run *as, run *sy) {
    run_all(1, max_batch, kv, nreq, ngram, sy);
    run_all(0, max_batch, kv, nreq, ngram, as);
    assert_int_equal(sy->st.steps_async, 0);
    assert_true(as->st.steps_async > 0);
    compare(as, sy, nreq, &as->stops, &as->lengths);
    assert_true(as->stops > 0 && as->lengths > 0);
    if (!ngram) {
        assert_true(sy->pauses > 0 && as->pauses == sy->pauses);
        assert_int_equal(sy->paused_events, 0);
        assert_true(as->paused_events <= as->pauses);
    }
    if (kv < (1u << 20)) assert_true(as->st.preemptions > 0);
    assert_int_equal(as->st.kv_blocks_used, 0);
    assert_int_equal(as->st.running + as->st.waiting, 0);
}

static void test_async_equals_sync(void **s) {
    (void)s;
    const struct { int max_batch; size_t kv; } cases[] = {{4, 16u << 20}, {16, 16u << 20}, {16, 640u << 10}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        static run as, sy;
        run_pair(cases[c].max_batch, cases[c].kv, NREQ, 0, &as, &sy);
        assert_true(as.st.steps_async > as.st.steps_async_composed);   /* decode steps */
        assert_true(as.st.steps_async_composed > 0);   /* and prompt chunks beside decode rows */
        printf("  max_batch %d, KV %zu KiB: %d stops on eos, %d at max_tokens, %d aborted, %d paused (%d events while "
               "paused), equal; %llu steps queued "
               "in flight (%llu of them with prompt chunks) of %llu decode and %llu composed (sync run: %llu and "
               "%llu), %llu preemptions\n",
               cases[c].max_batch, cases[c].kv >> 10, as.stops, as.lengths, NREQ / 8, as.pauses, as.paused_events,
               (unsigned long long)as.st.steps_async, (unsigned long long)as.st.steps_async_composed,
               (unsigned long long)as.st.steps_device_decode, (unsigned long long)as.st.steps_composed,
               (unsigned long long)sy.st.steps_device_decode, (unsigned long long)sy.st.steps_composed,
               (unsigned long long)as.st.preemptions);
    }
}

/* Prompt lookup configured: steps of more rows than the verify op takes draft nothing and
 * are queued in flight; as the batch drains below that, rows speculate again (the prompts
 * repeat themselves, so drafts stand), from tokens the async steps left behind. */
static void test_async_with_prompt_lookup(void **s) {
    (void)s;
    static run as, sy;
    g_ngram = 1;
    run_pair(MAXREQ, 32u << 20, MAXREQ, 1, &as, &sy);
    assert_true(as.st.spec_accepted_tokens > 0);
    printf("  %d requests at once, prompt lookup: equal; async %llu steps; %llu of %llu drafts accepted "
           "(sync run: %llu of %llu)\n", MAXREQ, (unsigned long long)as.st.steps_async,
           (unsigned long long)as.st.spec_accepted_tokens, (unsigned long long)as.st.spec_draft_tokens,
           (unsigned long long)sy.st.spec_accepted_tokens, (unsigned long long)sy.st.spec_draft_tokens);
    g_ngram = 0;
}

/* A draft model (k = 4, always speculating: llama-draft, which is rarely right; llama-tiny
 * itself, always right, so every row emits k + 1; its first 2 layers, sometimes right):
 * the speculative step op goes in
 * flight and the next one is queued behind it, fed each row's last two tokens and advanced
 * by its m on the runner's side, while the engine schedules on the most each row could
 * have emitted and corrects that at the commit. Greedy and seeded rows must come out as
 * the synchronous engine gives them, eos stops and max_tokens ends included (no token
 * past either), aborts and paused readers among them; KV back to empty. In a pool small
 * enough to preempt, greedy rows only: the engine schedules on more KV than it will hold,
 * so it preempts at other points than the synchronous run, and a preempted row's KV
 * recomputed as a prompt differs from the decoded one in the last bits, enough to move a
 * seeded draw (two synchronous runs with pools of 640 and 700 KiB, 13 preemptions each,
 * gave a seeded row different tokens from its 4th on). */
static void test_async_with_draft_model(void **s) {
    (void)s;
    const struct { int max_batch; size_t kv; const char *draft; int layers; } cases[] = {
        {4, 16u << 20, "llama-draft", 0}, {16, 16u << 20, "llama-draft", 0}, {16, 640u << 10, "llama-draft", 0},
        {8, 16u << 20, "llama-tiny", 0}, {8, 16u << 20, NULL, 2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        static run as, sy;
        g_draft = cases[c].kv < (1u << 20) ? 2 : 1;
        g_draft_model = cases[c].draft;
        g_draft_layers = cases[c].layers;
        run_pair(cases[c].max_batch, cases[c].kv, NREQ, 0, &as, &sy);
        assert_true(as.st.steps_async_spec > 0);
        assert_true(as.st.spec_accepted_tokens > 0);
        printf("  draft %s (%d layers), max_batch %d, KV %zu KiB: %d stops on eos, %d at max_tokens, equal; %llu of "
               "%llu speculative steps queued behind the one in flight (%llu steps in flight in all), %llu of %llu "
               "drafts accepted; %llu preemptions\n",
               cases[c].draft ? cases[c].draft : "llama-tiny", cases[c].layers, cases[c].max_batch,
               cases[c].kv >> 10, as.stops, as.lengths, (unsigned long long)as.st.steps_async_spec,
               (unsigned long long)as.st.steps_runner_spec, (unsigned long long)as.st.steps_async,
               (unsigned long long)as.st.spec_accepted_tokens, (unsigned long long)as.st.spec_draft_tokens,
               (unsigned long long)as.st.preemptions);
    }
    g_draft = 0;
    g_draft_model = NULL;
    g_draft_layers = 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_async_equals_sync),
        cmocka_unit_test(test_async_with_prompt_lookup),
        cmocka_unit_test(test_async_with_draft_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
