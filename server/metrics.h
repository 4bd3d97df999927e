/* Prometheus metrics (prefix metrics_), named as vLLM users chart them with the prefix
 * "specd:" (num_requests_running, kv_cache_usage_perc, time_to_first_token_seconds, ...).
 *
 * The loop records request events and engine stats snapshots; MHD threads render the text
 * for GET /metrics. A mutex guards the whole struct (updates are a few adds per event, far
 * off the per-token engine path). */
#ifndef SPECD_METRICS_H
#define SPECD_METRICS_H

#include <stddef.h>

#include "engine/core/engine.h"

typedef struct metrics metrics;

metrics *metrics_create(const char *model_name);
void metrics_destroy(metrics *m);

/* Latest engine counters / gauges (called by the loop after steps, adds and aborts). */
void metrics_set_engine(metrics *m, const engine_stats *st);
void metrics_observe_ttft(metrics *m, double seconds);
/* n tokens that arrived together, each `seconds` after the one before */
void metrics_observe_itl_n(metrics *m, double seconds, int n);
/* Output processing so far: wall seconds and tokens (host cost per token = s / tokens). */
void metrics_set_host_output(metrics *m, double seconds, unsigned long long tokens);
/* Seconds the engine thread, with work queued, waited for the loop to take its outputs. */
void metrics_set_engine_wait(metrics *m, double seconds);
void metrics_observe_e2e(metrics *m, double seconds);
/* reason: "stop", "length", "abort", "error" */
void metrics_request_finished(metrics *m, const char *reason);
/* HTTP-level rejections by status (429, 503, 4xx...). */
void metrics_http_error(metrics *m, int status);

/* Exposition text (malloc'd, NUL-terminated). */
char *metrics_render(metrics *m);

#endif
