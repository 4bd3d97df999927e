/* HTTP front end (prefix http_): libmicrohttpd glue for the OpenAI API and the operational
 * endpoints.
 *
 * MHD runs its own polling threads (a pool of cfg->http_threads) with suspend/resume: a
 * request is read without blocking anyone, then validated, templated and tokenized on the
 * MHD thread, and handed to the loop. Waiting replies (streamed or not) suspend their
 * connection and are resumed by the loop through the request's sse_chan; no thread ever
 * blocks on a request. A connection that ends before its reply is complete cancels the
 * request in the loop at once.
 *
 * Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize;
 * GET /v1/models, /health, /ready, /version, /metrics. API keys (if any) guard the /v1
 * routes, /tokenize and /detokenize. */
#ifndef SPECD_HTTP_H
#define SPECD_HTTP_H

#include <stddef.h>

#include "engine/core/engine.h"
#include "server/config.h"
#include "server/loop.h"
#include "server/metrics.h"

typedef struct http_server http_server;

/* Listen on cfg->host:cfg->port. cfg, l and m must outlive the server. model_name is
 * copied. Until http_set_engine, generation endpoints answer 503 (loading). */
http_server *http_start(const srv_config *cfg, const char *model_name, loop *l, metrics *m,
                        char *err, size_t errlen);
/* Publish the loaded engine's immutable parts (tokenizer, template, model config) to the
 * MHD threads. The engine itself is only touched by the loop. */
void http_set_engine(http_server *h, const engine *e);
/* The start-up warm-up runs (1) or is over (0): meanwhile /ready (503) and /health (200)
 * say "warming up" instead of "loading". */
void http_set_warming(http_server *h, int on);
/* The port actually bound (useful with port 0). */
int http_port(const http_server *h);
/* Replies still being written (requests handed to the loop whose connection has not
 * completed). */
int http_pending(const http_server *h);
/* Stop accepting connections (the listening socket is closed); the ones open are served
 * until http_stop. */
void http_quiesce(http_server *h);
/* /ready answers 503 from now on; everything else is served as before (drain grace). */
void http_set_lame_duck(http_server *h);
void http_stop(http_server *h);

#endif
