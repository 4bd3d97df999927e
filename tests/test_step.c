/* Sampling inside the runner's forward pass (runner_batch.sp, engine_step's composed
 * steps) against the engine's host sampler: the same requests, once plain (sampled in the
 * forward pass) and once with a feature that only the host path has and that does not
 * change the tokens (top logprobs), must give identical tokens - greedy and seeded
 * sampling with top-k / top-p / min-p, alone and batched with prefill chunks and decode
 * rows in the same steps (requests admitted while others decode, a small token budget).
 * The chosen token's logprob, which the forward pass also returns, must equal the host's. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/engine.h"
#include "tests/fixtures.h"

#define NREQ 6
#define MAXTOK 40

typedef struct {
    int32_t out[NREQ][MAXTOK];
    float lp[NREQ][MAXTOK];
    int n[NREQ];
    engine_stats st;
} run;

/* mode 0: plain; 1: the chosen token's logprob (still sampled in the forward pass);
 * 2: top logprobs (host sampling) */
static void sampling_of(int i, int mode, engine_sampling *sp) {
    engine_sampling_defaults(sp);
    sp->max_tokens = MAXTOK;
    sp->ignore_eos = 1;
    if (i % 3 == 0) {
        sp->temperature = 0;                       /* greedy */
    } else {
        sp->temperature = 0.7f + 0.1f * (float)i;  /* seeded draws, each filter in turn */
        sp->seed = 100 + (uint64_t)i;
        sp->has_seed = 1;
        if (i % 3 == 1) sp->top_k = 20, sp->top_p = 0.9f;
        else sp->min_p = 0.05f;
    }
    if (mode) sp->logprobs = mode - 1;
}

/* Requests enter every other step, so prefill chunks share steps with decode rows. */
static void run_all(int mode, int max_batch, run *r) {
    char path[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/models/llama-tiny", fixtures_dir());
    engine_config c = {.model_path = path, .max_seq_len = 256, .max_batch = max_batch, .kv_bytes = 16u << 20,
                       .threads = 2, .max_tokens_per_step = 24};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("engine_create: %s", err);
    memset(r, 0, sizeof *r);
    int added = 0, step = 0;
    while (added < NREQ || engine_has_work(e)) {
        if (added < NREQ && step++ % 2 == 0) {
            int32_t prompt[40];
            int np = 5 + 7 * added;   /* 5 .. 40 tokens: several need more than one chunk */
            for (int t = 0; t < np; t++) prompt[t] = (int32_t)((31 * added + 7 * t) % 1000 + 1);
            engine_sampling sp;
            sampling_of(added, mode, &sp);
            assert_int_equal(engine_add(e, (uint64_t)added, prompt, np, &sp, err, sizeof err), 0);
            added++;
        }
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int k = 0; k < o.n_events; k++) {
            const engine_event *ev = &o.events[k];
            for (int t = 0; t < ev->n_tokens; t++) {
                r->lp[ev->req_id][r->n[ev->req_id]] = ev->tokens[t].logprob;
                r->out[ev->req_id][r->n[ev->req_id]++] = ev->tokens[t].id;
            }
        }
    }
    engine_get_stats(e, &r->st);
    engine_destroy(e);
}

static void test_forward_sampling_equals_host_sampling(void **s) {
    (void)s;
    for (int mb = 1; mb <= NREQ; mb += NREQ - 1) {   /* one at a time, then all batched */
        static run dev, devlp, host;
        run_all(0, mb, &dev);
        run_all(1, mb, &devlp);
        run_all(2, mb, &host);
        assert_true(dev.st.steps_forward_sampled > 0);
        assert_int_equal(devlp.st.steps_forward_sampled, dev.st.steps_forward_sampled);
        assert_int_equal(host.st.steps_forward_sampled, 0);
        double worst = 0;
        for (int i = 0; i < NREQ; i++) {
            assert_int_equal(dev.n[i], MAXTOK);
            assert_int_equal(host.n[i], MAXTOK);
            assert_memory_equal(dev.out[i], host.out[i], sizeof(int32_t) * MAXTOK);
            assert_memory_equal(devlp.out[i], host.out[i], sizeof(int32_t) * MAXTOK);
            for (int t = 0; t < MAXTOK; t++) {
                assert_true(host.lp[i][t] < 0);
                double d = fabs((double)devlp.lp[i][t] - host.lp[i][t]);
                if (d > worst) worst = d;
            }
        }
        assert_true(worst <= 1e-6);
        printf("  max_batch %d: %d requests x %d tokens equal, chosen-token logprobs within %.1e; %llu of %llu "
               "composed steps sampled in the forward pass\n", mb, NREQ, MAXTOK, worst,
               (unsigned long long)dev.st.steps_forward_sampled, (unsigned long long)dev.st.steps_composed);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward_sampling_equals_host_sampling),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
