/* `specd bench`: engine throughput without HTTP. For each batch size, B sequences of
 * random prompt ids (seeded) are prefilled together and decoded for --gen tokens with
 * EOS ignored; prints prefill tokens/s, decode tokens/s, ms per decode step and, with a
 * draft, the acceptance length. Numbers are wall-clock on this machine. Every run has
 * prompts of its own (no run finds an earlier one's in the prefix cache), and each batch
 * size is first run untimed (--warmup), so a shape's first-use costs (kernels loaded on
 * first launch, GEMM heuristics) stay out of the figures. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/core/engine.h"
#include "engine/core/sample.h"
#include "server/cli.h"
#include "server/cmd.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: specd bench (--model PATH | --shape NAME) [options]\n\n"
            "options:\n" CLI_ENGINE_HELP
            "  --batch LIST            batch sizes, comma separated (default 1,16)\n"
            "  --prompt-len N          prompt tokens per sequence (default 64)\n"
            "  --gen N                 tokens generated per sequence (default 64, at least 3: the\n"
            "                          second token's step runs while the prompts finish)\n"
            "  --seed S                prompt ids seed (default 0; also the sampling seed)\n"
            "  --warmup N              untimed runs of each batch size before its timed one, on\n"
            "                          prompts of their own, --gen at most 4 (default 1; 0: none)\n"
            "  --temperature T         sample at temperature T (default 0: greedy)\n"
            "  --top-p P, --top-k K    sampling filters (default 1, 0: none)\n"
            "  --top-logprobs N        every token's logprob and its N most likely alternatives\n"
            "                          (default: none; 0: the chosen token's logprob only)\n"
            "  --json                  one JSON object per batch size\n\n"
            "Here --max-prefill-decoding defaults to -1: the batch's prompts prefill as one burst\n"
            "under the step budget even after the first ones decode, as peers' batched benchmarks\n"
            "measure it (serve's default of 512 trades that for shorter decode steps).\n");
}

typedef struct {
    int batch;
    double prefill_s, decode_s;
    long prefill_tokens, decode_tokens, decode_steps, verify, accepted;
    double host_us_step;   /* decode phase: engine_step time outside its run phase, per step */
    double kv_peak;        /* most KV bytes in use after any step (both pools) */
    uint64_t prefix_hits;  /* prompt tokens the prefix cache served (0: the run's prompts are its own) */
} bench_row;

/* tmpl: the sampling every sequence of a run uses (greedy unless --temperature); each
 * sequence adds its seed, ignore_eos and max_tokens. */
static int bench_one(engine *e, int B, int plen, int gen, uint64_t seed, int run, const engine_sampling *tmpl,
                     bench_row *r) {
    int V = engine_model_config(e)->vocab;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)plen);
    int *have_first = calloc((size_t)B, sizeof(int));
    char err[512];
    if (!ids || !have_first) return -1;
    memset(r, 0, sizeof *r);
    r->batch = B;
    engine_stats sb;
    engine_get_stats(e, &sb);
    for (int b = 0; b < B; b++) {
        for (int i = 0; i < plen; i++)
            ids[i] = (int32_t)(sample_uniform(seed + (uint64_t)b + ((uint64_t)run << 32), (uint64_t)i) * V);
        engine_sampling sp = *tmpl;
        sp.seed = seed + (uint64_t)b;
        sp.has_seed = 1;
        sp.ignore_eos = 1;
        sp.max_tokens = gen;
        if (engine_add(e, (uint64_t)b, ids, plen, &sp, err, sizeof err)) {
            fprintf(stderr, "specd bench: %s\n", err);
            free(ids);
            free(have_first);
            return -1;
        }
    }
    int firsts = 0, rc = 0;
    double t0 = cli_now_s(), t1 = t0;
    engine_stats s0, s1;
    while (engine_has_work(e)) {
        engine_output o;
        if ((rc = engine_step(e, &o))) break;
        for (int k = 0; k < o.n_events; k++) {
            engine_event *ev = &o.events[k];
            int b = (int)ev->req_id;
            int nt = ev->n_tokens;
            if (!have_first[b] && nt > 0) {
                have_first[b] = 1;
                firsts++;
                nt--;
            }
            r->decode_tokens += nt;
            if (ev->finish != ENGINE_RUNNING) {
                r->verify += ev->spec_verify_steps;
                r->accepted += ev->spec_accepted_tokens;
            }
        }
        engine_stats st;
        engine_get_stats(e, &st);
        if (st.kv_bytes_used > r->kv_peak) r->kv_peak = st.kv_bytes_used;
        if (firsts == B && t1 == t0) {
            t1 = cli_now_s();   /* every sequence has its first token: prefill is over */
            r->decode_tokens = 0;
            engine_get_stats(e, &s0);
        } else if (t1 != t0) {
            r->decode_steps++;
        }
    }
    double t2 = cli_now_s();
    engine_get_stats(e, &s1);
    r->prefix_hits = s1.prefix_cache_hit_tokens - sb.prefix_cache_hit_tokens;
    if (t1 != t0 && r->decode_steps)
        r->host_us_step = 1e6 * ((s1.step_seconds - s0.step_seconds) - (s1.run_seconds - s0.run_seconds)) /
                          (double)r->decode_steps;
    r->prefill_s = t1 - t0;
    r->decode_s = t2 - t1;
    r->prefill_tokens = (long)B * plen;
    free(ids);
    free(have_first);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    engine_config ec = {0};
    const char *batches = "1,16";
    int plen = 64, gen = 64, json = 0;
    uint64_t seed = 0;
    int warmup = 1;
    engine_sampling bsp;
    engine_sampling_defaults(&bsp);
    bsp.temperature = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int m = cli_engine_opt(&ec, argc, argv, &i);
        if (m < 0) return 2;
        if (m > 0) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        }
        if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) {
            ec.verbose = 1;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "specd bench: unknown option or missing value: %s\n", a);
            return 2;
        }
        const char *v = argv[++i];
        int bad = 0;
        if (!strcmp(a, "--batch")) batches = v;
        else if (!strcmp(a, "--prompt-len")) bad = cli_int(v, 1, 1 << 20, &plen);
        else if (!strcmp(a, "--gen")) bad = cli_int(v, 3, 1 << 20, &gen);
        else if (!strcmp(a, "--seed")) bad = cli_u64(v, &seed);
        else if (!strcmp(a, "--warmup")) bad = cli_int(v, 0, 100, &warmup);
        else if (!strcmp(a, "--temperature")) bad = cli_float(v, 0, 100, &bsp.temperature);
        else if (!strcmp(a, "--top-p")) bad = cli_float(v, 1e-6, 1, &bsp.top_p);
        else if (!strcmp(a, "--top-k")) bad = cli_int(v, 0, 1 << 30, &bsp.top_k);
        else if (!strcmp(a, "--top-logprobs")) bad = cli_int(v, 0, ENGINE_MAX_TOP_LOGPROBS, &bsp.logprobs);
        else {
            fprintf(stderr, "specd bench: unknown option %s\n", a);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "specd bench: bad value for %s: '%s'\n", a, v);
            return 2;
        }
    }
    int32_t *bs = NULL;
    int nb = cli_parse_ids(batches, &bs);
    if ((!ec.model_path && !ec.random_shape) || nb <= 0) {
        usage(stderr);
        free(bs);
        return 2;
    }
    int maxb = 0;
    for (int i = 0; i < nb; i++) maxb = bs[i] > maxb ? bs[i] : maxb;
    if (!ec.max_batch) ec.max_batch = maxb;
    if (!ec.max_seq_len) ec.max_seq_len = plen + gen + 16;
    if (!ec.max_prefill_decoding) ec.max_prefill_decoding = -1;   /* see usage() */
    int tp_exit;   /* argv - 1 is main()'s argv, which spawned worker ranks re-execute */
    if (cli_tp_enter(&ec, argv - 1, &tp_exit)) {
        free(bs);
        return tp_exit;
    }
    char err[1024];
    engine *e = engine_create(&ec, err, sizeof err);
    if (!e) {
        fprintf(stderr, "specd bench: %s\n", err);
        free(bs);
        return 1;
    }
    if (!json)
        printf("device %s, prompt %d, gen %d (host us/step: engine_step's own work per decode step; "
               "KV MiB: most KV in use after a step)\n"
               "%6s %14s %14s %12s %8s %14s %10s\n", engine_device_name(e), plen, gen,
               "batch", "prefill tok/s", "decode tok/s", "ms/step", "AL", "host us/step", "KV MiB");
    int rc = 0, run = 0;
    for (int i = 0; i < nb && !rc; i++) {
        bench_row r;
        for (int w = 0; w < warmup && !rc; w++) rc = bench_one(e, bs[i], plen, gen < 4 ? gen : 4, seed, ++run, &bsp, &r);
        if (rc || bench_one(e, bs[i], plen, gen, seed, ++run, &bsp, &r)) {
            rc = 1;
            break;
        }
        double pf = r.prefill_tokens / r.prefill_s, dt = r.decode_tokens / r.decode_s;
        double ms = r.decode_steps ? 1e3 * r.decode_s / r.decode_steps : 0;
        double al = r.verify ? 1.0 + (double)r.accepted / r.verify : 0;
        if (json)
            printf("{\"device\":\"%s\",\"batch\":%d,\"prompt_len\":%d,\"gen\":%d,\"temperature\":%g,\"top_p\":%g,"
                   "\"top_k\":%d,\"top_logprobs\":%d,\"prefill_tok_s\":%.2f,"
                   "\"decode_tok_s\":%.2f,\"ms_per_step\":%.3f,\"acceptance_length\":%.3f,\"host_us_per_step\":%.1f,"
                   "\"kv_peak_bytes\":%.0f,\"prefix_cache_hit_tokens\":%llu}\n",
                   engine_device_name(e), r.batch, plen, gen, bsp.temperature, bsp.top_p, bsp.top_k, bsp.logprobs, pf,
                   dt, ms, al, r.host_us_step, r.kv_peak, (unsigned long long)r.prefix_hits);
        else
            printf("%6d %14.1f %14.1f %12.2f %8.2f %14.1f %10.1f\n", r.batch, pf, dt, ms, al, r.host_us_step,
                   r.kv_peak / (1 << 20));
        fflush(stdout);
    }
    engine_destroy(e);
    free(bs);
    return rc;
}
