/* `specd serve` configuration (prefix srv_config_): one table of keys, each settable from
 * a JSON file, the environment and the command line.
 *
 * Precedence, highest first: command line > environment (SPECD_<KEY>, e.g. SPECD_PORT)
 * > config file (--config FILE or SPECD_CONFIG) > built-in default. A key given by a
 * higher source replaces the lower one entirely (for api_keys: the whole list). Unknown
 * keys in the file and unknown flags are errors. config/specd.json documents every key
 * with its default. The struct is plain data (fixed-size strings): copy it freely. */
#ifndef SPECD_CONFIG_H
#define SPECD_CONFIG_H

#include <stddef.h>
#include <stdio.h>

#define SRV_PATH_MAX 4096
#define SRV_NAME_MAX 256
#define SRV_MAX_API_KEYS 16

typedef struct {
    char model[SRV_PATH_MAX];
    char shape[SRV_NAME_MAX];           /* "" = none; else random weights of this shape */
    char tokenizer[SRV_PATH_MAX];       /* "" = from the model */
    char chat_template[SRV_PATH_MAX];   /* Jinja file; "" = the model's own */
    char draft_model[SRV_PATH_MAX];     /* "" = no draft */
    int num_draft_tokens;               /* 0 = engine default (4) */
    int draft_layers;                   /* 0 = off */
    char speculative[16];               /* "ngram" = prompt-lookup drafts; "" / "none" = off */
    char dtype[8];                      /* "auto" (default), "bf16", "gguf", "fp8" (cli_dtype) */
    char kv_cache_dtype[12];            /* "auto" (default), "bf16", "fp8", "fp8_e4m3" (cli_kv_dtype) */
    int ngram_min, ngram_max;           /* 0 = engine default (2, 4) */
    int spec_cost_model;                /* 1: speculate only where the start-up timing says it pays */
    int tensor_parallel_size;           /* ranks over all nodes (1 = off) */
    int nnodes;                         /* hosts taking part */
    int node_rank;                      /* this host's index */
    char master_addr[SRV_NAME_MAX];     /* rank 0's address for the rendezvous */
    int master_port;
    char host[SRV_NAME_MAX];
    int port;
    char served_model_name[SRV_NAME_MAX]; /* "" = basename of model */
    int max_seq_len;
    int max_batch;
    int max_num_batched_tokens;         /* scheduler token budget per step (0 = engine default) */
    int max_prefill_decoding;           /* prompt tokens per step while decoding (0 = 512, -1 = none) */
    int keep_window_kv;                 /* keep KV blocks behind sliding windows */
    double mem_fraction;
    long long kv_cache_bytes;           /* 0 = from mem_fraction */
    char device[16];                    /* "cpu" | "cuda" */
    int threads;                        /* 0 = all cores */
    char api_key_file[SRV_PATH_MAX];    /* "" = none */
    int n_api_keys;
    char api_keys[SRV_MAX_API_KEYS][SRV_NAME_MAX];
    long long max_body_bytes;
    int max_queued;                     /* requests waiting beyond max_batch */
    double request_timeout;             /* seconds; 0 = none */
    double drain_timeout;               /* seconds */
    double drain_grace;                 /* seconds of lame duck before the drain */
    char log_level[16];
    int log_json;
    int http_threads;
    double recv_timeout;                /* seconds for a whole request to arrive; 0 = none */
    int max_connections;                /* past it: 503 + Retry-After */
    int max_connections_per_ip;         /* 0 = none */
    int max_n;                          /* largest n accepted */
    char allowed_origins[SRV_PATH_MAX]; /* CORS: "" none, "*" any, or "a,b" */
    int async_scheduling;               /* 1: engine_config.sync_scheduling = 0 */
    int overlap;                        /* 1: host work overlaps the next step */
    int output_threads;                 /* 0 = auto */
    long long stream_buffer_bytes;      /* backpressure: per stream */
    long long total_buffer_bytes;       /* backpressure: all streams */
    double stall_timeout;               /* seconds paused before a stream is ended */
    char tool_call_parser[16];          /* auto | none | hermes | llama3_json | mistral */
    char reasoning_parser[16];          /* none | deepseek_r1 | qwen3 */
    char warmup[16];                    /* auto | on | off */
} srv_config;

void srv_config_defaults(srv_config *c);

/* Lookup function for environment variables (getenv in production, a table in tests). */
typedef const char *(*srv_getenv_fn)(const char *name);

/* What the command line asked for besides settings. */
typedef struct {
    int help;
    int print_config;
    char config_path[SRV_PATH_MAX];     /* the file actually read ("" if none) */
} srv_config_action;

/* Build the effective config from defaults, file, environment and argv (argv[0] is the
 * subcommand name and is skipped). Returns 0, or SPECD_EINVAL / SPECD_EIO /
 * SPECD_EFORMAT with a message naming the flag, variable or file key at fault. Does not
 * check that model is set (--help and --print-config work without it). */
int srv_config_load(srv_config *c, srv_config_action *act, int argc, char **argv,
                    srv_getenv_fn env, char *err, size_t errlen);

/* Apply one JSON config document (a file's contents) on top of c. */
int srv_config_apply_json(srv_config *c, const char *text, size_t len, const char *what,
                          char *err, size_t errlen);

/* Effective config as a JSON object (malloc'd string); api keys are redacted. */
char *srv_config_to_json(const srv_config *c);

/* --help text for `specd serve`. */
void srv_config_usage(FILE *f);

#endif
