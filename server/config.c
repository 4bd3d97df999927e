/* `specd serve` configuration: the key table and the four sources (see config.h).
 *
 * Every key appears once in `keys` with its JSON name, flag, environment variable, type,
 * bounds and help; the file loader, the env reader, the flag parser, --print-config and
 * --help all walk that one table, so they cannot disagree. */
#include "server/config.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "server/cli.h"

typedef enum { K_STR, K_INT, K_I64, K_DBL, K_BOOL, K_KEYS } key_type;

typedef struct {
    const char *name;        /* JSON key; flag is "--" + name with '_' -> '-' */
    key_type type;
    size_t off;
    size_t cap;              /* K_STR: buffer size */
    double min, max;         /* numeric bounds (inclusive) */
    const char *help;
} cfg_key;

#define OFF(f) offsetof(srv_config, f)
#define STR(f) K_STR, OFF(f), sizeof(((srv_config *)0)->f)

static const cfg_key keys[] = {
    {"model", STR(model), 0, 0, "model checkpoint: HF directory or .gguf file (required)"},
    {"shape", STR(shape), 0, 0, "instead of model: random weights of a named real shape (llama-3.1-8b, llama-3.2-1b, smollm2-135m, qwen2.5-1.5b, qwen3-1.7b, qwen3-30b-a3b, gemma3-4b) for benchmarks; token-id prompts only"},
    {"tokenizer", STR(tokenizer), 0, 0, "tokenizer.json / directory / .gguf (default: from the model)"},
    {"chat_template", STR(chat_template), 0, 0, "Jinja chat template file replacing the model's (for models that ship none, such as many GGUF files)"},
    {"draft_model", STR(draft_model), 0, 0, "draft model for speculative decoding"},
    {"num_draft_tokens", K_INT, OFF(num_draft_tokens), 0, 0, 15, "draft tokens per step k (0 = engine default)"},
    {"draft_layers", K_INT, OFF(draft_layers), 0, 0, 1e6, "self-speculation with the target's first N layers"},
    {"speculative", STR(speculative), 0, 0, "ngram: prompt-lookup drafting (drafts copied from the request's own earlier tokens; no draft model), or none"},
    {"dtype", STR(dtype), 0, 0, "weights on the GPU. A quantized GGUF: gguf keeps its Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K projections in their blocks (less memory; faster than bf16 at batch 1, slower from batch 8; on the GPU their GEMVs round the activations to int8 per 32 values, as llama.cpp does), bf16 dequantizes them at load, auto (default) keeps them when the bf16 weights would take over half the GPU. fp8 quantizes the dense projections to FP8 E4M3 at load (one scale per output row, activations per token). An FP8 checkpoint stays FP8 (bf16 dequantizes it). --quantization fp8 is the same as --dtype fp8"},
    {"kv_cache_dtype", STR(kv_cache_dtype), 0, 0, "KV cache elements: auto (default; bf16 on the GPU, fp32 in the CPU runner) or fp8 (fp8_e4m3): FP8 E4M3 with one scale per layer for K and one for V (the checkpoint's k_scale / v_scale, else 1), twice the tokens of bf16 in the same memory"},
    {"ngram_min", K_INT, OFF(ngram_min), 0, 0, 16, "shortest n-gram prompt lookup matches (0 = default 2)"},
    {"ngram_max", K_INT, OFF(ngram_max), 0, 0, 16, "longest n-gram prompt lookup matches, tried first (0 = default 4)"},
    {"spec_cost_model", K_BOOL, OFF(spec_cost_model), 0, 0, 1, "time plain and verify steps at start-up and draft only where speculation pays (false: always draft)"},
    {"tensor_parallel_size", K_INT, OFF(tensor_parallel_size), 0, 1, 256, "ranks (processes) the model is sharded over; rank 0 serves HTTP"},
    {"nnodes", K_INT, OFF(nnodes), 0, 1, 256, "hosts taking part in tensor parallelism"},
    {"node_rank", K_INT, OFF(node_rank), 0, 0, 255, "this host's index among nnodes"},
    {"master_addr", STR(master_addr), 0, 0, "rank 0's address for the tensor-parallel rendezvous"},
    {"master_port", K_INT, OFF(master_port), 0, 1, 65535, "rank 0's port for the tensor-parallel rendezvous"},
    {"host", STR(host), 0, 0, "address to listen on"},
    {"port", K_INT, OFF(port), 0, 0, 65535, "TCP port (0 = any free port)"},
    {"served_model_name", STR(served_model_name), 0, 0, "model name clients must send (default: model file/dir name)"},
    {"max_seq_len", K_INT, OFF(max_seq_len), 0, 2, 1 << 24, "context limit per sequence (prompt + output)"},
    {"max_batch", K_INT, OFF(max_batch), 0, 1, 4096, "running sequences at most"},
    {"max_num_batched_tokens", K_INT, OFF(max_num_batched_tokens), 0, 0, 1 << 20, "tokens one step feeds at most, decode rows and prompt chunks together (0 = 2048; at least max_batch): lower keeps decode steps short while prompts arrive (inter-token latency), higher fills prompts faster (time to first token)"},
    {"max_prefill_decoding", K_INT, OFF(max_prefill_decoding), 0, -1, 1 << 20, "prompt tokens a step feeds at most while sequences are decoding (0 = 512; -1 = only max_num_batched_tokens): bounds how much a burst of prompts lengthens decode steps (inter-token latency); the prompts are then admitted over more steps"},
    {"keep_window_kv", K_BOOL, OFF(keep_window_kv), 0, 0, 1, "keep KV blocks a sliding window has left behind (by default they go back to the pool: every layer's when every layer slides, as in Mistral; the window layers' own pool when full layers are mixed in, as in Gemma 3, except under CUDA tensor parallelism)"},
    {"mem_fraction", K_DBL, OFF(mem_fraction), 0, 0.01, 1.0, "share of free memory for the KV cache"},
    {"kv_cache_bytes", K_I64, OFF(kv_cache_bytes), 0, 0, 9.0e18, "explicit KV cache size in bytes (0 = from mem_fraction)"},
    {"device", STR(device), 0, 0, "cpu or cuda"},
    {"threads", K_INT, OFF(threads), 0, 0, 4096, "CPU runner threads (0 = all cores)"},
    {"api_key_file", STR(api_key_file), 0, 0, "file with bearer keys, one per line ('#' comments), added to api_keys; keeps keys out of ps and the environment"},
    {"api_keys", K_KEYS, OFF(api_keys), 0, 0, 0, "bearer keys accepted (flag --api-key, repeatable; env comma-separated); none = no auth"},
    {"max_body_bytes", K_I64, OFF(max_body_bytes), 0, 1024, 1.0e12, "largest request body accepted (413 above)"},
    {"max_queued", K_INT, OFF(max_queued), 0, 0, 1 << 24, "sequences allowed to wait beyond max_batch before 429"},
    {"request_timeout", K_DBL, OFF(request_timeout), 0, 0, 1e9, "seconds a request may run (0 = no limit)"},
    {"drain_grace", K_DBL, OFF(drain_grace), 0, 0, 3600, "seconds after SIGTERM during which /ready is 503 but requests are still served, so a load balancer can take the replica out first"},
    {"drain_timeout", K_DBL, OFF(drain_timeout), 0, 0, 1e9, "seconds in-flight requests may finish after SIGTERM"},
    {"log_level", STR(log_level), 0, 0, "debug, info, warn, error or off"},
    {"log_json", K_BOOL, OFF(log_json), 0, 0, 1, "log JSON lines instead of text"},
    {"recv_timeout", K_DBL, OFF(recv_timeout), 0, 0, 1e6, "seconds a request may take to arrive whole (headers and body; also an idle kept-alive connection's limit); 0 = none"},
    {"max_connections", K_INT, OFF(max_connections), 0, 1, 1 << 20, "open connections at most; past it new ones get 503 with Retry-After"},
    {"max_connections_per_ip", K_INT, OFF(max_connections_per_ip), 0, 0, 1 << 20, "open connections per client address (0 = no limit; raise it behind a proxy)"},
    {"http_threads", K_INT, OFF(http_threads), 0, 1, 256, "HTTP worker threads"},
    {"allowed_origins", STR(allowed_origins), 0, 0, "CORS: browser origins allowed to call the API, comma separated, or * (default: none)"},
    {"max_n", K_INT, OFF(max_n), 0, 1, 128, "largest n (choices per prompt) accepted"},
    {"async_scheduling", K_BOOL, OFF(async_scheduling), 0, 0, 1, "queue the next step (decode, prompt chunks beside decode rows, a draft model's speculative step) on the GPU before the engine commits the running one (its tokens fed on the device; an end is known a step late and the extra tokens dropped)"},
    {"overlap", K_BOOL, OFF(overlap), 0, 0, 1, "queue the next engine step before processing the last one's outputs"},
    {"stream_buffer_bytes", K_I64, OFF(stream_buffer_bytes), 0, 4096, 1.0e12, "unread bytes a stream may hold before its sequence pauses (resumes at half)"},
    {"total_buffer_bytes", K_I64, OFF(total_buffer_bytes), 0, 65536, 1.0e13, "unread bytes over all streams before streams with a backlog pause"},
    {"stall_timeout", K_DBL, OFF(stall_timeout), 0, 0, 1e9, "seconds a paused stream may stay paused before it is ended and its KV freed (0 = never)"},
    {"output_threads", K_INT, OFF(output_threads), 0, 0, 256, "threads turning tokens into text and SSE chunks (0 = half the cores, at most 8)"},
    {"tool_call_parser", STR(tool_call_parser), 0, 0, "how tool calls are read from chat output: auto (from the chat template), hermes, llama3_json, mistral or none"},
    {"reasoning_parser", STR(reasoning_parser), 0, 0, "split <think>...</think> into reasoning_content: none, deepseek_r1 or qwen3"},
    {"warmup", STR(warmup), 0, 0, "run synthetic prompts (1-8 tokens, then every multiple of 64 up to the step budget), batches up to max_batch and sampled rows before /ready turns 200, so the first real requests pay less of the GPU's first-use costs (kernel loading, GEMM heuristics): auto (default; on with cuda, off with cpu), on or off"},
};
#define N_KEYS (sizeof keys / sizeof keys[0])

void srv_config_defaults(srv_config *c) {
    memset(c, 0, sizeof *c);
    snprintf(c->host, sizeof c->host, "127.0.0.1");
    c->port = 8000;
    c->max_seq_len = 4096;
    c->max_batch = 64;
    c->mem_fraction = 0.9;
    snprintf(c->device, sizeof c->device, "cpu");
    snprintf(c->dtype, sizeof c->dtype, "auto");
    snprintf(c->kv_cache_dtype, sizeof c->kv_cache_dtype, "auto");
    c->tensor_parallel_size = 1;
    c->nnodes = 1;
    snprintf(c->master_addr, sizeof c->master_addr, "127.0.0.1");
    c->master_port = 29533;
    c->max_body_bytes = 4 << 20;
    c->max_queued = 1024;
    c->request_timeout = 600;
    c->drain_timeout = 30;
    snprintf(c->log_level, sizeof c->log_level, "info");
    c->http_threads = 4;
    c->recv_timeout = 30;
    c->max_connections = 4096;
    c->max_connections_per_ip = 1024;
    c->max_n = 16;
    c->overlap = 1;
    c->async_scheduling = 1;
    c->spec_cost_model = 1;
    c->stream_buffer_bytes = 256 << 10;
    c->total_buffer_bytes = 256LL << 20;
    c->stall_timeout = 60;
    snprintf(c->tool_call_parser, sizeof c->tool_call_parser, "auto");
    snprintf(c->reasoning_parser, sizeof c->reasoning_parser, "none");
    snprintf(c->warmup, sizeof c->warmup, "auto");
}

static const cfg_key *find_key(const char *name) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (!strcmp(keys[i].name, name)) return &keys[i];
    return NULL;
}

/* Flag of a key ("--max-seq-len"), or NULL when the flag names no key. */
static const cfg_key *find_flag(const char *flag) {
    if (strncmp(flag, "--", 2)) return NULL;
    if (!strcmp(flag, "--api-key")) return find_key("api_keys");
    if (!strcmp(flag, "--quantization")) return find_key("dtype");   /* vLLM's spelling of --dtype fp8 */
    char name[64];
    size_t n = strlen(flag + 2);
    if (n >= sizeof name) return NULL;
    for (size_t i = 0; i <= n; i++) name[i] = flag[2 + i] == '-' ? '_' : flag[2 + i];
    const cfg_key *k = find_key(name);
    return k && k->type != K_KEYS ? k : NULL;
}

static void env_name(const cfg_key *k, char *buf, size_t cap) {
    size_t j = snprintf(buf, cap, "SPECD_");
    for (size_t i = 0; k->name[i] && j + 1 < cap; i++) buf[j++] = (char)toupper((unsigned char)k->name[i]);
    buf[j] = 0;
    if (k->type == K_KEYS) snprintf(buf, cap, "SPECD_API_KEY");
}

static int check_range(const cfg_key *k, double v, const char *what, char *err, size_t errlen) {
    if (v < k->min || v > k->max)
        return specd_errf(err, errlen, SPECD_EINVAL, "%s: %s must be in [%g, %g], got %g", what,
                          k->name, k->min, k->max, v);
    return 0;
}

static int check_enums(const srv_config *c, const char *what, char *err, size_t errlen) {
    if (strcmp(c->device, "cpu") && strcmp(c->device, "cuda"))
        return specd_errf(err, errlen, SPECD_EINVAL, "%s: device must be cpu or cuda, got '%s'",
                          what, c->device);
    int ngram;
    if (cli_speculative(c->speculative, &ngram))
        return specd_errf(err, errlen, SPECD_EINVAL, "%s: speculative must be ngram or none, got '%s'", what,
                          c->speculative);
    int dt;
    if (cli_dtype(c->dtype, &dt))
        return specd_errf(err, errlen, SPECD_EINVAL, "%s: dtype must be auto, bf16, gguf or fp8, got '%s'", what, c->dtype);
    if (cli_kv_dtype(c->kv_cache_dtype, &dt))
        return specd_errf(err, errlen, SPECD_EINVAL, "%s: kv_cache_dtype must be auto, bf16, fp8 or fp8_e4m3, got '%s'",
                          what, c->kv_cache_dtype);
    if (strcmp(c->log_level, "debug") && strcmp(c->log_level, "info") &&
        strcmp(c->log_level, "warn") && strcmp(c->log_level, "error") && strcmp(c->log_level, "off"))
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "%s: log_level must be debug, info, warn, error or off, got '%s'", what,
                          c->log_level);
    static const char *const parsers[] = {"auto", "none", "hermes", "llama3_json", "mistral"};
    int ok = 0;
    for (size_t i = 0; i < sizeof parsers / sizeof parsers[0]; i++) ok |= !strcmp(c->tool_call_parser, parsers[i]);
    if (!ok)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "%s: tool_call_parser must be auto, none, hermes, llama3_json or mistral, got '%s'", what,
                          c->tool_call_parser);
    if (strcmp(c->warmup, "auto") && strcmp(c->warmup, "on") && strcmp(c->warmup, "off"))
        return specd_errf(err, errlen, SPECD_EINVAL, "%s: warmup must be auto, on or off, got '%s'", what, c->warmup);
    if (strcmp(c->reasoning_parser, "none") && strcmp(c->reasoning_parser, "deepseek_r1") &&
        strcmp(c->reasoning_parser, "qwen3"))
        return specd_errf(err, errlen, SPECD_EINVAL, "%s: reasoning_parser must be none, deepseek_r1 or qwen3, got '%s'",
                          what, c->reasoning_parser);
    return 0;
}

static int add_keys_csv(srv_config *c, const char *s, const char *what, char *err, size_t errlen) {
    while (*s) {
        const char *e = strchr(s, ',');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if (n) {
            if (c->n_api_keys >= SRV_MAX_API_KEYS || n >= SRV_NAME_MAX)
                return specd_errf(err, errlen, SPECD_EINVAL,
                                  "%s: at most %d api keys of under %d bytes", what,
                                  SRV_MAX_API_KEYS, SRV_NAME_MAX);
            memcpy(c->api_keys[c->n_api_keys], s, n);
            c->api_keys[c->n_api_keys++][n] = 0;
        }
        if (!e) break;
        s = e + 1;
    }
    return 0;
}

/* Set a key from text (flag or environment). */
static int set_text(srv_config *c, const cfg_key *k, const char *v, const char *what, char *err,
                    size_t errlen) {
    char *p = (char *)c + k->off, *end;
    errno = 0;
    switch (k->type) {
    case K_STR:
        if (strlen(v) >= k->cap)
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: value too long", what);
        snprintf(p, k->cap, "%s", v);
        return 0;
    case K_INT: case K_I64: {
        long long x = strtoll(v, &end, 10);
        if (!*v || *end || errno)
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: expected an integer, got '%s'", what, v);
        int rc = check_range(k, (double)x, what, err, errlen);
        if (rc) return rc;
        if (k->type == K_INT) *(int *)p = (int)x;
        else *(long long *)p = x;
        return 0;
    }
    case K_DBL: {
        double x = strtod(v, &end);
        if (!*v || *end || errno)
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: expected a number, got '%s'", what, v);
        int rc = check_range(k, x, what, err, errlen);
        if (rc) return rc;
        *(double *)p = x;
        return 0;
    }
    case K_BOOL:
        if (!strcmp(v, "1") || !strcmp(v, "true")) *(int *)p = 1;
        else if (!strcmp(v, "0") || !strcmp(v, "false")) *(int *)p = 0;
        else return specd_errf(err, errlen, SPECD_EINVAL, "%s: expected true/false/1/0, got '%s'", what, v);
        return 0;
    case K_KEYS:
        return add_keys_csv(c, v, what, err, errlen);
    }
    return SPECD_EINVAL;
}

static int set_json(srv_config *c, const cfg_key *k, json_t *v, const char *what, char *err,
                    size_t errlen) {
    char *p = (char *)c + k->off;
    switch (k->type) {
    case K_STR:
        if (!json_is_string(v))
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: %s must be a string", what, k->name);
        if (json_string_length(v) >= k->cap)
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: %s is too long", what, k->name);
        snprintf(p, k->cap, "%s", json_string_value(v));
        return 0;
    case K_INT: case K_I64: {
        if (!json_is_integer(v))
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: %s must be an integer", what, k->name);
        long long x = json_integer_value(v);
        int rc = check_range(k, (double)x, what, err, errlen);
        if (rc) return rc;
        if (k->type == K_INT) *(int *)p = (int)x;
        else *(long long *)p = x;
        return 0;
    }
    case K_DBL: {
        if (!json_is_number(v))
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: %s must be a number", what, k->name);
        double x = json_number_value(v);
        int rc = check_range(k, x, what, err, errlen);
        if (rc) return rc;
        *(double *)p = x;
        return 0;
    }
    case K_BOOL:
        if (!json_is_boolean(v))
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: %s must be true or false", what, k->name);
        *(int *)p = json_is_true(v);
        return 0;
    case K_KEYS: {
        if (!json_is_array(v))
            return specd_errf(err, errlen, SPECD_EINVAL, "%s: api_keys must be an array of strings", what);
        c->n_api_keys = 0;
        size_t i;
        json_t *s;
        json_array_foreach(v, i, s) {
            if (!json_is_string(s) || !json_string_length(s) || strchr(json_string_value(s), ','))
                return specd_errf(err, errlen, SPECD_EINVAL,
                                  "%s: api_keys[%zu] must be a non-empty string without ','", what, i);
            int rc = add_keys_csv(c, json_string_value(s), what, err, errlen);
            if (rc) return rc;
        }
        return 0;
    }
    }
    return SPECD_EINVAL;
}

int srv_config_apply_json(srv_config *c, const char *text, size_t len, const char *what,
                          char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s:%d:%d: %s", what, je.line, je.column,
                          je.text);
    int rc = 0;
    if (!json_is_object(root)) {
        rc = specd_errf(err, errlen, SPECD_EFORMAT, "%s: top level must be an object", what);
        goto done;
    }
    const char *name;
    json_t *v;
    json_object_foreach(root, name, v) {
        /* Keys starting with '_' are comments (config/specd.json documents keys that way). */
        if (name[0] == '_') continue;
        const cfg_key *k = find_key(name);
        if (!k) {
            rc = specd_errf(err, errlen, SPECD_EINVAL, "%s: unknown key '%s'", what, name);
            goto done;
        }
        char w[SRV_PATH_MAX + 80];
        snprintf(w, sizeof w, "%s: key '%s'", what, name);
        if ((rc = set_json(c, k, v, w, err, errlen))) goto done;
    }
    rc = check_enums(c, what, err, errlen);
done:
    json_decref(root);
    return rc;
}

static int read_file(const char *path, char **out, size_t *len, char *err, size_t errlen) {
    errno = 0;
    if (!(*out = cli_read_file(path, len)))
        return specd_errf(err, errlen, SPECD_EIO, "%s: %s", path, errno ? strerror(errno) : "read error");
    return 0;
}

/* api_key_file: one key per line; blank lines and lines starting with '#' are skipped,
 * surrounding white space is not part of a key. */
static int read_key_file(srv_config *c, char *err, size_t errlen) {
    char *text;
    size_t len;
    int rc = read_file(c->api_key_file, &text, &len, err, errlen);
    if (rc) return rc;
    char what[SRV_PATH_MAX + 16];
    snprintf(what, sizeof what, "%s", c->api_key_file);
    for (char *line = text, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        while (*line && isspace((unsigned char)*line)) line++;
        size_t n = strlen(line);
        while (n && isspace((unsigned char)line[n - 1])) line[--n] = 0;
        if (!n || line[0] == '#') continue;
        if (strchr(line, ',')) {
            rc = specd_errf(err, errlen, SPECD_EINVAL, "%s: a key must not contain ','", what);
            break;
        }
        if ((rc = add_keys_csv(c, line, what, err, errlen))) break;
    }
    free(text);
    return rc;
}

/* Flags that take no value. */
static int is_switch(const char *a) {
    return !strcmp(a, "--help") || !strcmp(a, "-h") || !strcmp(a, "--print-config") ||
           !strcmp(a, "--log-json");
}

int srv_config_load(srv_config *c, srv_config_action *act, int argc, char **argv,
                    srv_getenv_fn env, char *err, size_t errlen) {
    srv_config_defaults(c);
    memset(act, 0, sizeof *act);
    const char *cfg_path = env ? env("SPECD_CONFIG") : NULL;
    /* Pass 1: validate the shape of argv, find --config and the actions. */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { act->help = 1; continue; }
        if (!strcmp(a, "--print-config")) { act->print_config = 1; continue; }
        if (is_switch(a)) continue;
        if (strcmp(a, "--config") && !find_flag(a))
            return specd_errf(err, errlen, SPECD_EINVAL, "unknown option '%s' (see specd serve --help)", a);
        if (i + 1 >= argc)
            return specd_errf(err, errlen, SPECD_EINVAL, "option %s needs a value", a);
        if (!strcmp(a, "--config")) cfg_path = argv[i + 1];
        i++;
    }
    if (act->help) return 0;
    int rc;
    if (cfg_path && *cfg_path) {
        char *text = NULL;
        size_t len = 0;
        if ((rc = read_file(cfg_path, &text, &len, err, errlen))) return rc;
        rc = srv_config_apply_json(c, text, len, cfg_path, err, errlen);
        free(text);
        if (rc) return rc;
        snprintf(act->config_path, sizeof act->config_path, "%s", cfg_path);
    }
    /* Environment. */
    for (size_t k = 0; env && k < N_KEYS; k++) {
        char name[80], what[120];
        env_name(&keys[k], name, sizeof name);
        const char *v = env(name);
        if (!v) continue;
        snprintf(what, sizeof what, "environment %s", name);
        if (keys[k].type == K_KEYS) c->n_api_keys = 0;
        if ((rc = set_text(c, &keys[k], v, what, err, errlen))) return rc;
    }
    if ((rc = check_enums(c, "environment", err, errlen))) return rc;
    /* Command line, last so it wins. The first --api-key replaces keys from lower sources. */
    int cli_keys = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--log-json")) { c->log_json = 1; continue; }
        if (is_switch(a)) continue;
        if (!strcmp(a, "--config")) { i++; continue; }
        const cfg_key *k = find_flag(a);
        if (k->type == K_KEYS) {
            if (!cli_keys++) c->n_api_keys = 0;
            if (strchr(argv[i + 1], ',') || !*argv[i + 1])
                return specd_errf(err, errlen, SPECD_EINVAL, "--api-key: key must be non-empty and contain no ','");
        }
        if ((rc = set_text(c, k, argv[i + 1], a, err, errlen))) return rc;
        i++;
    }
    if ((rc = check_enums(c, "command line", err, errlen))) return rc;
    return c->api_key_file[0] ? read_key_file(c, err, errlen) : 0;
}

char *srv_config_to_json(const srv_config *c) {
    json_t *o = json_object();
    for (size_t k = 0; k < N_KEYS; k++) {
        const char *p = (const char *)c + keys[k].off;
        json_t *v = NULL;
        switch (keys[k].type) {
        case K_STR: v = json_string(p); break;
        case K_INT: v = json_integer(*(const int *)p); break;
        case K_I64: v = json_integer(*(const long long *)p); break;
        case K_DBL: v = json_real(*(const double *)p); break;
        case K_BOOL: v = json_boolean(*(const int *)p); break;
        case K_KEYS:
            v = json_array();
            for (int i = 0; i < c->n_api_keys; i++) json_array_append_new(v, json_string("<redacted>"));
            break;
        }
        json_object_set_new(o, keys[k].name, v);
    }
    char *s = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    return s;
}

void srv_config_usage(FILE *f) {
    srv_config d;
    srv_config_defaults(&d);
    fprintf(f, "usage: specd serve --model PATH [options]\n\n"
               "Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/responses,\n"
               "/v1/models), Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens)\n"
               "plus /tokenize /detokenize /health /ready /metrics /version.\n\n"
               "Every option can also be set by an environment variable (shown) or a key of a\n"
               "JSON file given with --config FILE (or SPECD_CONFIG); precedence is command\n"
               "line > environment > file > default.\n\noptions:\n");
    for (size_t k = 0; k < N_KEYS; k++) {
        char flag[64], env[80], def[96];
        if (keys[k].type == K_KEYS) snprintf(flag, sizeof flag, "--api-key KEY");
        else {
            size_t j = snprintf(flag, sizeof flag, "--");
            for (size_t i = 0; keys[k].name[i]; i++) flag[j++] = keys[k].name[i] == '_' ? '-' : keys[k].name[i];
            flag[j] = 0;
            if (keys[k].type != K_BOOL) snprintf(flag + j, sizeof flag - j, " V");
            else if (!is_switch(flag)) snprintf(flag + j, sizeof flag - j, " 0|1");
        }
        env_name(&keys[k], env, sizeof env);
        const char *p = (const char *)&d + keys[k].off;
        switch (keys[k].type) {
        case K_STR: snprintf(def, sizeof def, "\"%s\"", p); break;
        case K_INT: case K_BOOL: snprintf(def, sizeof def, "%d", *(const int *)p); break;
        case K_I64: snprintf(def, sizeof def, "%lld", *(const long long *)p); break;
        case K_DBL: snprintf(def, sizeof def, "%g", *(const double *)p); break;
        case K_KEYS: snprintf(def, sizeof def, "none"); break;
        }
        fprintf(f, "  %-26s %s\n  %-26s [%s, default %s]\n", flag, keys[k].help, "", env, def);
    }
    fprintf(f, "  %-26s %s\n  %-26s %s\n  %-26s %s\n", "--config FILE", "JSON config file",
            "--print-config", "print the effective configuration as JSON and exit", "--help",
            "this text");
}
