/* `specd generate`: run one prompt (or N concurrent copies) through the engine without
 * HTTP, for shells and tests. With --json prints
 * {"prompt_ids":[...],"output_ids":[...],"text":...,"last_logits":[...],"finish_reason":...}
 * (+ "top_logprobs": [[[id, logprob], ...] per output token] with --top-logprobs N). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/core/engine.h"
#include "engine/core/err.h"
#include "server/api.h"
#include "server/cli.h"
#include "server/cmd.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: specd generate (--model PATH | --shape NAME) (--prompt TEXT | --prompt-ids 1,2,3) [options]\n\n"
            "Generates a continuation and prints it. No BOS is added to --prompt-ids; --prompt\n"
            "is tokenized as the model's tokenizer says (BOS included if it adds one).\n\n"
            "options:\n" CLI_ENGINE_HELP
            "  --prompt TEXT           prompt text (needs a tokenizer)\n"
            "  --prompt-ids LIST       prompt as token ids, comma separated\n"
            "  --max-tokens N          new tokens at most (default 32)\n"
            "  --temperature T         0 = greedy (default 0)\n"
            "  --top-p P, --top-k K, --min-p P, --seed S\n"
            "  --ignore-eos            do not stop at EOS\n"
            "  --n-seqs N              run N copies of the prompt concurrently (default 1)\n"
            "  --logits                include the logits that chose the first output token\n"
            "  --top-logprobs N        with --json: the N most likely tokens and their logprobs at\n"
            "                          every output position (first sequence)\n"
            "  --json                  print JSON\n"
            "  -v, --verbose           print start-up decisions and speed to stderr\n");
}


typedef struct {
    int32_t *ids;
    int n, cap;
    json_t *top;             /* --top-logprobs: one [[id, logprob], ...] per token */
    const char *finish;
    int verify_steps, draft_tokens, accepted;
} seq_out;


int cmd_generate(int argc, char **argv) {
    engine_config ec = {0};
    engine_sampling sp;
    engine_sampling_defaults(&sp);
    sp.temperature = 0;
    sp.max_tokens = 32;
    const char *prompt = NULL, *prompt_ids = NULL;
    int want_logits = 0, json = 0, n_seqs = 1, rc = 1, top_lp = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int m = cli_engine_opt(&ec, argc, argv, &i);
        if (m < 0) return 2;
        if (m > 0) continue;
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--logits")) want_logits = 1;
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--ignore-eos")) sp.ignore_eos = 1;
        else if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) ec.verbose = 1;
        else if (!v) {
            fprintf(stderr, "specd generate: unknown option or missing value: %s\n", a);
            return 2;
        } else {
            i++;
            if (!strcmp(a, "--prompt")) prompt = v;
            else if (!strcmp(a, "--prompt-ids")) prompt_ids = v;
            else if (!strcmp(a, "--max-tokens")) bad = cli_int(v, 0, 1 << 24, &sp.max_tokens);
            else if (!strcmp(a, "--temperature")) bad = cli_float(v, 0, 100, &sp.temperature);
            else if (!strcmp(a, "--top-p")) bad = cli_float(v, 1e-6, 1, &sp.top_p);
            else if (!strcmp(a, "--top-k")) bad = cli_int(v, 0, 1 << 24, &sp.top_k);
            else if (!strcmp(a, "--min-p")) bad = cli_float(v, 0, 1, &sp.min_p);
            else if (!strcmp(a, "--n-seqs")) bad = cli_int(v, 1, 4096, &n_seqs);
            else if (!strcmp(a, "--top-logprobs")) bad = cli_int(v, 1, ENGINE_MAX_TOP_LOGPROBS, &top_lp);
            else if (!strcmp(a, "--seed")) {
                bad = cli_u64(v, &sp.seed);
                sp.has_seed = 1;
            } else {
                fprintf(stderr, "specd generate: unknown option %s\n", a);
                return 2;
            }
            if (bad) {
                fprintf(stderr, "specd generate: bad value for %s: '%s'\n", a, v);
                return 2;
            }
        }
    }
    if ((!ec.model_path && !ec.random_shape) || (!prompt == !prompt_ids)) {
        fprintf(stderr, "specd generate: need --model (or --shape) and exactly one of --prompt / --prompt-ids\n");
        usage(stderr);
        return 2;
    }
    if (!ec.max_batch && n_seqs > 64) ec.max_batch = n_seqs;
    if (top_lp) sp.logprobs = top_lp;

    char err[1024] = "";
    /* main() hands us argv + 1: argv - 1 is main's argv, which the workers re-execute. */
    int tp_exit;
    if (cli_tp_enter(&ec, argv - 1, &tp_exit)) return tp_exit;
    int32_t *ids = NULL;
    float *logits = NULL;
    seq_out *outs = NULL;
    int n_ids = 0;
    engine *e = engine_create(&ec, err, sizeof err);
    if (!e) {
        fprintf(stderr, "specd generate: %s\n", err);
        return 1;
    }
    const tok_tokenizer *tok = engine_tokenizer(e);
    if (prompt_ids) {
        n_ids = cli_parse_ids(prompt_ids, &ids);
        if (n_ids < 0) {
            fprintf(stderr, "specd generate: --prompt-ids must be a comma-separated list of ids\n");
            rc = 2;
            goto out;
        }
    } else {
        if (!tok) {
            fprintf(stderr, "specd generate: %s has no tokenizer; use --prompt-ids or --tokenizer\n",
                    ec.model_path);
            goto out;
        }
        n_ids = tok_encode(tok, prompt, strlen(prompt), 1, &ids, err, sizeof err);
        if (n_ids < 0) {
            fprintf(stderr, "specd generate: cannot tokenize the prompt: %s\n", err);
            goto out;
        }
    }
    outs = calloc((size_t)n_seqs, sizeof *outs);
    if (!outs) goto out;
    for (int s = 0; s < n_seqs; s++) {
        engine_sampling spi = sp;
        if (sp.has_seed) spi.seed = sp.seed + (uint64_t)s;
        if (engine_add_ex(e, (uint64_t)s, ids, n_ids, &spi, want_logits && s == 0, err, sizeof err)) {
            fprintf(stderr, "specd generate: %s\n", err);
            goto out;
        }
    }
    int done = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (done < n_seqs) {
        engine_output o;
        if (engine_step(e, &o)) {
            fprintf(stderr, "specd generate: engine step failed\n");
            goto out;
        }
        for (int k = 0; k < o.n_events; k++) {
            engine_event *ev = &o.events[k];
            seq_out *so = &outs[ev->req_id];
            if (so->n + ev->n_tokens > so->cap) {
                so->cap = (so->n + ev->n_tokens) * 2 + 16;
                so->ids = realloc(so->ids, (size_t)so->cap * sizeof(int32_t));
                if (!so->ids) goto out;
            }
            for (int t = 0; t < ev->n_tokens; t++) {
                const engine_token *et = &ev->tokens[t];
                so->ids[so->n++] = et->id;
                if (top_lp && ev->req_id == 0) {
                    if (!so->top) so->top = json_array();
                    json_t *row = json_array();
                    for (int j = 0; j < et->n_top; j++)
                        json_array_append_new(row, json_pack("[if]", (int)et->top_ids[j], (double)et->top_logprobs[j]));
                    json_array_append_new(so->top, row);
                }
            }
            if (ev->finish != ENGINE_RUNNING) {
                so->finish = api_finish_reason(ev->finish);
                so->verify_steps = ev->spec_verify_steps;
                so->draft_tokens = ev->spec_draft_tokens;
                so->accepted = ev->spec_accepted_tokens;
                done++;
            }
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double elapsed = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    long total_out = 0;
    for (int s = 0; s < n_seqs; s++) total_out += outs[s].n;
    if (ec.verbose)
        fprintf(stderr, "specd generate: %ld tokens in %.3f s (%.1f tokens/s, prefill included)\n",
                total_out, elapsed, total_out / elapsed);
    if (want_logits) {
        logits = malloc(sizeof(float) * (size_t)engine_model_config(e)->vocab);
        if (!logits || engine_first_logits(e, 0, logits)) {
            free(logits);
            logits = NULL;
        }
    }
    char *text = NULL;
    size_t tlen = 0;
    if (tok && tok_decode(tok, outs[0].ids, (size_t)outs[0].n, 1, &text, &tlen) != 0) text = NULL;
    if (json) {
        json_t *o = json_object(), *pa = json_array(), *oa = json_array();
        for (int i = 0; i < n_ids; i++) json_array_append_new(pa, json_integer(ids[i]));
        for (int i = 0; i < outs[0].n; i++) json_array_append_new(oa, json_integer(outs[0].ids[i]));
        json_object_set_new(o, "prompt_ids", pa);
        json_object_set_new(o, "output_ids", oa);
        json_object_set_new(o, "text", text ? json_stringn(text, tlen) : json_null());
        json_object_set_new(o, "finish_reason", json_string(outs[0].finish ? outs[0].finish : "error"));
        json_object_set_new(o, "elapsed_s", json_real(elapsed));
        json_object_set_new(o, "tokens_per_s", json_real(total_out / elapsed));
        if (outs[0].verify_steps) {
            json_t *spj = json_object();
            json_object_set_new(spj, "verify_steps", json_integer(outs[0].verify_steps));
            json_object_set_new(spj, "draft_tokens", json_integer(outs[0].draft_tokens));
            json_object_set_new(spj, "accepted_tokens", json_integer(outs[0].accepted));
            json_object_set_new(spj, "acceptance_length",
                                json_real(1.0 + (double)outs[0].accepted / outs[0].verify_steps));
            json_object_set_new(o, "spec_decode", spj);
        }
        if (logits) {
            json_t *la = json_array();
            for (int i = 0; i < engine_model_config(e)->vocab; i++)
                json_array_append_new(la, json_real(logits[i]));
            json_object_set_new(o, "last_logits", la);
        }
        if (outs[0].top) json_object_set(o, "top_logprobs", outs[0].top);
        if (n_seqs > 1) {
            json_t *all = json_array();
            for (int s = 0; s < n_seqs; s++) {
                json_t *a = json_array();
                for (int i = 0; i < outs[s].n; i++) json_array_append_new(a, json_integer(outs[s].ids[i]));
                json_array_append_new(all, a);
            }
            json_object_set_new(o, "all_output_ids", all);
        }
        char *s = json_dumps(o, JSON_COMPACT);
        if (s) puts(s);
        free(s);
        json_decref(o);
    } else if (text) {
        fwrite(text, 1, tlen, stdout);
        putchar('\n');
    } else {
        for (int i = 0; i < outs[0].n; i++) printf(i ? ",%d" : "%d", outs[0].ids[i]);
        putchar('\n');
    }
    free(text);
    rc = 0;
out:
    if (outs)
        for (int s = 0; s < n_seqs; s++) {
            free(outs[s].ids);
            json_decref(outs[s].top);
        }
    free(outs);
    free(logits);
    free(ids);
    engine_destroy(e);
    return rc;
}
