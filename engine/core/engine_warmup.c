/* Start-up warm-up (engine_warmup): synthetic requests run through the engine before the
 * server takes traffic, so the first real prompt of each size does not pay the runner's
 * first-use costs.
 *
 * On the CUDA runner those costs are one-off: a kernel's module is loaded on its first
 * launch (CUDA's lazy loading), each template instance a token count selects (the
 * 1-8-token GEMVs, the tensor-core GEMVs and GEMMs, the attention row variants) is first
 * launched by the first pass of that size, and cuBLAS settles its heuristics for a shape
 * at first use. A 1B model's first 8-prompt prefill measured about 20 ms more than the
 * same prefill run again. The decode graphs are captured at creation already; what a
 * prompt, a batch of prompts or a sampled row selects is not.
 *
 * The passes: one prompt at a time of every length of a ladder (warmup_next_len, up to
 * the step's token budget), batches of short prompts decoding together
 * (2, 8, 32, ... up to max_batch), and a batch of sampled rows with top-k / top-p,
 * penalties and logprobs. Afterwards nothing of them remains: their KV blocks leave the
 * prefix cache and the cumulative counters and the drafter's acceptance state are put
 * back, so /metrics and the first requests see a fresh engine. */
#include <stdlib.h>
#include <string.h>

#include "engine/core/engine_internal.h"
#include "engine/core/err.h"

/* Request ids above any a caller gives (the server counts up from 1). */
#define WARMUP_ID0 (UINT64_MAX - 4096)

/* Step until the engine is idle; a request that ends in error fails the warm-up. */
static int drain(engine *e) {
    while (engine_has_work(e)) {
        engine_output o;
        int rc = engine_step(e, &o);
        if (rc) return rc;
        for (int i = 0; i < o.n_events; i++)
            if (o.events[i].finish == ENGINE_FINISH_ERROR) return SPECD_ESTATE;
    }
    return 0;
}

/* One pass: n prompts of len tokens (sampled as sp) added, then run until the engine is
 * idle. */
static int run_pass(engine *e, uint64_t *next_id, int n, int len, const engine_sampling *sp, int32_t *ids,
                    char *err, size_t errlen) {
    for (int b = 0; b < n; b++) {
        /* token ids spread over the vocabulary, distinct per prompt (no prefix-cache hits
         * between the passes) */
        uint64_t h = *next_id * 0x9e3779b97f4a7c15ULL;
        for (int i = 0; i < len; i++) {
            h ^= h >> 29;
            h *= 0xbf58476d1ce4e5b9ULL;
            h += (uint64_t)i + 1;
            ids[i] = (int32_t)(h % (uint64_t)e->vocab);
        }
        int rc = engine_add(e, (*next_id)++, ids, len, sp, err, errlen);
        if (rc) return rc;
    }
    return drain(e);
}

/* The ladder of prompt lengths: 1-8, 1.5x steps up to 64, then every multiple of 64. A
 * first prompt of a length the warm-up did not run still costs more than the next one of
 * that length, less the nearer the ladder comes: H100, 1B shape, first prompts of 1,100 -
 * 1,900 tokens took 14-19 ms after this ladder against 21-25 ms after 1.5x steps all the
 * way (7-11 ms once that length had run); the warm-up took 0.44 s against 0.22-0.26 s. */
static int warmup_next_len(int len) {
    if (len < 8) return len + 1;
    if (len < 64) return len * 3 / 2 < 64 ? len * 3 / 2 : 64;
    return len + 64;
}

int engine_warmup(engine *e, engine_warmup_info *info, char *err, size_t errlen) {
    memset(info, 0, sizeof *info);
    if (e->failed || engine_has_work(e)) {
        snprintf(err, errlen, "warm-up needs an idle engine");
        return SPECD_ESTATE;
    }
    /* at most the step budget, the context and half the KV pool (a small pool must not
     * turn the warm-up into a wait) */
    const long pool_half = (long)(kv_num_blocks(e->kv) - 1) * kv_block_size(e->kv) / 2;
    int max_len = e->cfg.max_tokens_per_step < e->cfg.max_seq_len - 4 ? e->cfg.max_tokens_per_step
                                                                       : e->cfg.max_seq_len - 4;
    if (max_len > pool_half) max_len = (int)pool_half;
    const int short_len = max_len < 16 ? max_len : 16;
    if (max_len < 1) return 0;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)max_len);
    if (!ids) {
        snprintf(err, errlen, "out of memory");
        return SPECD_ENOMEM;
    }
    /* what the passes change and a fresh engine would not show */
    const engine_stats st0 = e->st;
    const float acc_s = e->acc_s, acc_t = e->acc_t;
    const int declined = e->declined, probe_every = e->probe_every;

    engine_sampling greedy;
    engine_sampling_defaults(&greedy);
    greedy.temperature = 0;
    greedy.ignore_eos = 1;
    greedy.max_tokens = 2;
    uint64_t id = WARMUP_ID0;
    int rc = 0;
    /* one prompt at a time: each length selects its own kernels */
    for (int len = 1; len <= max_len && !rc; len = warmup_next_len(len)) {
        if ((rc = run_pass(e, &id, 1, len, &greedy, ids, err, errlen))) break;
        info->passes++;
        info->max_prompt = len;
    }
    if (!rc && info->max_prompt < max_len) {   /* the budget itself (a full prefill chunk) */
        if (!(rc = run_pass(e, &id, 1, max_len, &greedy, ids, err, errlen))) {
            info->passes++;
            info->max_prompt = max_len;
        }
    }
    /* batches of prompts that then decode together for a few steps */
    greedy.max_tokens = 4;
    const int batch_cap = (long)e->cfg.max_batch * (short_len + 8) > pool_half ? (int)(pool_half / (short_len + 8))
                                                                                : e->cfg.max_batch;
    for (int n = 2; n <= batch_cap && !rc; n = n * 4 > batch_cap && n < batch_cap ? batch_cap : n * 4) {
        if ((rc = run_pass(e, &id, n, short_len, &greedy, ids, err, errlen))) break;
        info->passes++;
        info->max_batch = n;
    }
    /* sampled rows: top-k / top-p, penalties, logprobs */
    if (!rc && batch_cap >= 1) {
        engine_sampling s;
        engine_sampling_defaults(&s);
        s.temperature = 0.8f;
        s.top_k = 40;
        s.top_p = 0.9f;
        s.presence_penalty = 0.5f;
        s.logprobs = 2;
        s.seed = 1;
        s.has_seed = 1;
        s.ignore_eos = 1;
        s.max_tokens = 4;
        const int n = batch_cap < 4 ? batch_cap : 4;
        if (!(rc = run_pass(e, &id, n, short_len, &s, ids, err, errlen))) info->passes++;
    }
    free(ids);
    if (rc) {
        if (!err[0]) snprintf(err, errlen, "%s", e->failed ? "the runner failed" : "a warm-up pass failed");
        return rc;
    }
    kv_prefix_forget(e->kv);
    if (e->win_kv) kv_prefix_forget(e->win_kv);
    /* counters back to where they were; what describes the engine (drafter, k, the cost
     * model's host time) stays */
    const engine_stats now = e->st;
    e->st = st0;
    e->st.spec_host_seconds = now.spec_host_seconds;
    e->acc_s = acc_s;
    e->acc_t = acc_t;
    e->declined = declined;
    e->probe_every = probe_every;
    return 0;
}
