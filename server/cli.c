/* Argument parsing helpers for the subcommands; see cli.h. */
#include "server/cli.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/core/ngram.h"

int cli_parse_ids(const char *s, int32_t **out) {
    size_t cap = 16, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return -1;
    const char *p = s;
    while (*p) {
        while (*p == ' ' || *p == ',' || *p == '[' || *p == ']' || *p == '\n') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            free(ids);
            return -1;
        }
        if (n == cap) {
            int32_t *nn = realloc(ids, (cap *= 2) * sizeof *ids);
            if (!nn) {
                free(ids);
                return -1;
            }
            ids = nn;
        }
        ids[n++] = (int32_t)v;
        p = end;
        if (*p && *p != ',' && *p != ' ' && *p != ']' && *p != '\n') {
            free(ids);
            return -1;
        }
    }
    *out = ids;
    return (int)n;
}

int cli_int(const char *s, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

int cli_float(const char *s, double lo, double hi, float *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !(v >= lo && v <= hi)) return -1;
    *out = (float)v;
    return 0;
}

int cli_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (!*s || *end || errno || *s == '-') return -1;
    *out = v;
    return 0;
}

double cli_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

char *cli_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        if (n == cap) {
            char *nb = realloc(buf, (cap *= 2) + 1);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

int cli_speculative(const char *v, int *ngram) {
    if (!strcmp(v, "ngram")) *ngram = 1;
    else if (!strcmp(v, "none") || !*v) *ngram = 0;
    else return -1;
    return 0;
}

int cli_dtype(const char *v, int *dtype) {
    if (!strcmp(v, "auto") || !*v) *dtype = ENGINE_WEIGHTS_AUTO;
    else if (!strcmp(v, "bf16")) *dtype = ENGINE_WEIGHTS_BF16;
    else if (!strcmp(v, "gguf")) *dtype = ENGINE_WEIGHTS_GGUF;
    else if (!strcmp(v, "fp8")) *dtype = ENGINE_WEIGHTS_FP8;
    else return -1;
    return 0;
}

int cli_kv_dtype(const char *v, int *kv) {
    if (!strcmp(v, "auto") || !strcmp(v, "bf16") || !*v) *kv = ENGINE_KV_AUTO;
    else if (!strcmp(v, "fp8") || !strcmp(v, "fp8_e4m3")) *kv = ENGINE_KV_FP8;
    else return -1;
    return 0;
}

int cli_engine_opt(engine_config *c, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    if (!strcmp(a, "--no-prefix-cache")) {
        c->disable_prefix_cache = 1;
        return 1;
    }
    if (!strcmp(a, "--keep-window-kv")) {
        c->keep_window_kv = 1;
        return 1;
    }
    if (!strcmp(a, "--rope-bf16-freqs")) {
        c->rope_bf16_freqs = 1;
        return 1;
    }
    if (!strcmp(a, "--spec-always")) {
        c->spec_always = 1;
        return 1;
    }
    static const char *const with_value[] = {"--model", "--tokenizer", "--chat-template", "--draft-model",
        "--draft-layers", "--num-draft-tokens", "--device", "--max-seq-len", "--max-batch", "--max-num-batched-tokens",
        "--max-prefill-decoding", "--async-scheduling",
        "--kv-cache-bytes", "--threads", "--block-size", "--tensor-parallel-size", "--nnodes",
        "--node-rank", "--master-addr", "--master-port", "--shape", "--draft-shape", "--speculative",
        "--ngram-min", "--ngram-max", "--dtype", "--quantization", "--kv-cache-dtype"};
    int known = 0;
    for (size_t k = 0; k < sizeof with_value / sizeof with_value[0]; k++) known |= !strcmp(a, with_value[k]);
    if (!known) return 0;
    if (*i + 1 >= argc) {
        fprintf(stderr, "specd: %s needs a value\n", a);
        return -1;
    }
    const char *v = argv[++*i];
    int bad = 0;
    uint64_t u;
    if (!strcmp(a, "--model")) c->model_path = v;
    else if (!strcmp(a, "--shape")) c->random_shape = v;
    else if (!strcmp(a, "--draft-shape")) c->draft_random_shape = v;
    else if (!strcmp(a, "--tokenizer")) c->tokenizer_path = v;
    else if (!strcmp(a, "--chat-template")) c->chat_template_path = v;
    else if (!strcmp(a, "--draft-model")) c->draft_path = v;
    else if (!strcmp(a, "--draft-layers")) bad = cli_int(v, 1, 1000, &c->draft_layers);
    else if (!strcmp(a, "--num-draft-tokens")) bad = cli_int(v, 1, ENGINE_MAX_STEP_TOKENS - 1, &c->num_draft_tokens);
    else if (!strcmp(a, "--speculative")) bad = cli_speculative(v, &c->spec_ngram);
    else if (!strcmp(a, "--dtype")) bad = cli_dtype(v, &c->weights_dtype);
    else if (!strcmp(a, "--quantization")) bad = strcmp(v, "fp8") ? -1 : (c->weights_dtype = ENGINE_WEIGHTS_FP8, 0);
    else if (!strcmp(a, "--kv-cache-dtype")) bad = cli_kv_dtype(v, &c->kv_dtype);
    else if (!strcmp(a, "--ngram-min")) bad = cli_int(v, 1, NGRAM_MAX_N, &c->ngram_min);
    else if (!strcmp(a, "--ngram-max")) bad = cli_int(v, 1, NGRAM_MAX_N, &c->ngram_max);
    else if (!strcmp(a, "--max-seq-len")) bad = cli_int(v, 2, 1 << 24, &c->max_seq_len);
    else if (!strcmp(a, "--max-batch")) bad = cli_int(v, 1, 4096, &c->max_batch);
    else if (!strcmp(a, "--max-num-batched-tokens")) bad = cli_int(v, 1, 1 << 20, &c->max_tokens_per_step);
    else if (!strcmp(a, "--max-prefill-decoding")) bad = cli_int(v, -1, 1 << 20, &c->max_prefill_decoding);
    else if (!strcmp(a, "--async-scheduling")) {
        int on = 1;
        bad = cli_int(v, 0, 1, &on);
        c->sync_scheduling = !on;
    }
    else if (!strcmp(a, "--threads")) bad = cli_int(v, 1, 1024, &c->threads);
    else if (!strcmp(a, "--block-size")) bad = cli_int(v, 1, 1024, &c->block_size);
    else if (!strcmp(a, "--tensor-parallel-size")) bad = cli_int(v, 1, TP_MAX_WORLD, &c->tp.world_size);
    else if (!strcmp(a, "--nnodes")) bad = cli_int(v, 1, TP_MAX_WORLD, &c->tp.nnodes);
    else if (!strcmp(a, "--node-rank")) bad = cli_int(v, 0, TP_MAX_WORLD - 1, &c->tp.node_rank);
    else if (!strcmp(a, "--master-port")) bad = cli_int(v, 1, 65535, &c->tp.master_port);
    else if (!strcmp(a, "--master-addr")) {
        if (!*v || strlen(v) >= sizeof c->tp.master_addr) bad = -1;
        else snprintf(c->tp.master_addr, sizeof c->tp.master_addr, "%s", v);
    }
    else if (!strcmp(a, "--kv-cache-bytes")) {
        bad = cli_u64(v, &u);
        c->kv_bytes = (size_t)u;
    } else if (!strcmp(a, "--device")) {
        if (!strcmp(v, "cpu")) c->device = ENGINE_DEVICE_CPU;
        else if (!strcmp(v, "cuda")) c->device = ENGINE_DEVICE_CUDA;
        else bad = -1;
    }
    if (bad) {
        fprintf(stderr, "specd: bad value for %s: '%s'\n", a, v);
        return -1;
    }
    return 1;
}

int cli_engine_tp(engine_config *c, char **main_argv) {
    char err[512] = "";
    int worker = tp_config_from_env(&c->tp, err, sizeof err);
    if (worker < 0) {
        fprintf(stderr, "specd: %s\n", err);
        return -1;
    }
    tp_config_defaults(&c->tp);
    if (c->tp.world_size <= 1) return 0;
    if (tp_config_check(&c->tp, err, sizeof err)) {
        fprintf(stderr, "specd: %s\n", err);
        return -1;
    }
    /* A process started by hand (not spawned) starts its node's other ranks. */
    if (!worker) c->tp_spawn_argv = main_argv;
    return c->tp.rank != 0;
}

/* Rank 0's watchdog saw a rank die. The engine has already been told to abort the
 * group's collectives, so a step stuck in one fails and the requests get their errors;
 * give that two seconds to reach the clients, then leave non-zero whatever is still
 * blocked (a thread, because the watchdog's own call may block in the NCCL abort). */
static void *exit_later(void *arg) {
    (void)arg;
    sleep(2);
    _exit(1);
    return NULL;
}

static void on_tp_fail(void *ctx, const char *why) {
    (void)ctx;
    fprintf(stderr, "specd: tensor parallel: %s\n", why);
    pthread_t t;
    if (pthread_create(&t, NULL, exit_later, NULL) != 0) _exit(1);
    pthread_detach(t);
}

int cli_tp_enter(engine_config *c, char **main_argv, int *exit_code) {
    int worker = cli_engine_tp(c, main_argv);
    if (worker < 0) {
        *exit_code = 2;
        return 1;
    }
    if (worker) {
        char err[1024] = "";
        int rc = engine_tp_worker_run(c, err, sizeof err);
        if (rc) fprintf(stderr, "specd: tensor-parallel rank %d: %s\n", c->tp.rank, err);
        *exit_code = rc ? 1 : 0;
        return 1;
    }
    c->tp_fail = on_tp_fail;
    return 0;
}
