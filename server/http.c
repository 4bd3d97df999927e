/* HTTP front end: MHD callbacks, routing, auth, body limits and the endpoint handlers
 * (see http.h). Generation requests become loop_jobs; everything else is answered here.
 *
 * Per-connection state lives in a conn_ctx (MHD's con_cls); the reply channel (sse_chan)
 * is shared with the loop and reference counted, so whichever side finishes last frees
 * it. */
#include "server/http.h"

#include <ctype.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "engine/core/err.h"
#include "server/api.h"
#include "server/api_messages.h"
#include "server/api_responses.h"
#include "server/cli.h"
#include "server/guard.h"
#include "server/log.h"
#include "server/reasoning.h"
#include "server/sbuf.h"
#include "server/sse.h"
#include "server/toolcall.h"
#include "server/version.h"

enum route {
    R_NONE = 0, R_COMPLETIONS, R_CHAT, R_TOKENIZE, R_DETOKENIZE, R_MODELS, R_HEALTH, R_READY,
    R_VERSION, R_METRICS, R_MODEL, R_RESPONSES, R_MESSAGES, R_MSG_COUNT,
};

static const struct {
    const char *path;
    enum route r;
    const char *method;
    int auth;
} routes[] = {
    {"/v1/completions", R_COMPLETIONS, "POST", 1},
    {"/v1/chat/completions", R_CHAT, "POST", 1},
    {"/v1/responses", R_RESPONSES, "POST", 1},      /* mapped onto chat (api_responses.h) */
    {"/v1/messages", R_MESSAGES, "POST", 1},        /* Anthropic's, mapped onto chat (api_messages.h) */
    {"/v1/messages/count_tokens", R_MSG_COUNT, "POST", 1},
    {"/tokenize", R_TOKENIZE, "POST", 1},
    {"/detokenize", R_DETOKENIZE, "POST", 1},
    {"/v1/models", R_MODELS, "GET", 1},
    {"/v1/models/", R_MODEL, "GET", 1},          /* prefix: /v1/models/{id} */
    {"/health", R_HEALTH, "GET", 0},
    {"/ready", R_READY, "GET", 0},
    {"/version", R_VERSION, "GET", 0},
    {"/metrics", R_METRICS, "GET", 0},
};
#define N_ROUTES (sizeof routes / sizeof routes[0])

struct http_server {
    struct MHD_Daemon *d;
    const srv_config *cfg;
    loop *lp;
    metrics *m;
    char model_name[SRV_NAME_MAX];
    long long started;
    int port;
    /* Published once by http_set_engine (release) and read by MHD threads (acquire). */
    _Atomic(const engine *) eng;
    const tok_tokenizer *tok;
    const tmpl_template *tmpl;
    tc_format tool_format;     /* --tool-call-parser, resolved */
    rp_mode reasoning;         /* --reasoning-parser */
    int vocab;
    int max_token_bytes;       /* the vocabulary's longest token (grammar_prepare_masks) */
    _Atomic int pending;
    MHD_socket listen_fd;      /* after http_quiesce: ours to close */
    guard *guard;              /* receive deadlines, connection cap */
    _Atomic int lame_duck;     /* drain grace: /ready is 503, requests are still served */
    _Atomic int warming;       /* the start-up warm-up runs: /ready and /health say so */
};

typedef struct {
    http_server *srv;
    struct MHD_Connection *conn;
    int route, route_idx;
    char *body;
    size_t len, cap;
    int too_big, replied;
    sse_chan *chan;          /* set once the job is handed to the loop */
    uint64_t job_id;
    int stream;
    int status;              /* of a reply given here (the loop logs its own jobs) */
    double t0;
    char method[8], path[48];
    guard_conn *gc;          /* the connection's guard entry (NULL: not guarded) */
    int received;            /* the whole request is in */
    char request_id[72];     /* X-Request-Id: the client's (when well-formed) or made here */
    char url[96];            /* for /v1/models/{id} */
} conn_ctx;

/* ---- replies ------------------------------------------------------------------------------ */

/* The origin of a request when --allowed-origins admits it, else NULL. */
static const char *allowed_origin(conn_ctx *x) {
    const char *origin = MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, "Origin");
    const char *list = x->srv->cfg->allowed_origins;
    if (!origin || !*list) return NULL;
    if (!strcmp(list, "*")) return origin;
    size_t n = strlen(origin);
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && !strncmp(p, origin, n)) return origin;
        if (!e) break;
        p = e + 1;
    }
    return NULL;
}

/* Headers every reply carries: X-Request-Id, and CORS for an allowed origin. Then queue
 * it (the response is destroyed here). */
static enum MHD_Result queue(conn_ctx *x, int status, struct MHD_Response *r) {
    MHD_add_response_header(r, "X-Request-Id", x->request_id);
    const char *origin = allowed_origin(x);
    if (origin) {
        MHD_add_response_header(r, "Access-Control-Allow-Origin", strcmp(x->srv->cfg->allowed_origins, "*") ? origin : "*");
        MHD_add_response_header(r, "Access-Control-Expose-Headers", "X-Request-Id");
        MHD_add_response_header(r, "Vary", "Origin");
    }
    enum MHD_Result ret = MHD_queue_response(x->conn, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result reply_bytes(conn_ctx *x, int status, const char *type, const char *data, size_t len,
                                   int must_copy) {
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, (void *)data, must_copy ? MHD_RESPMEM_MUST_COPY : MHD_RESPMEM_MUST_FREE);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    return queue(x, status, r);
}

static enum MHD_Result reply_json(conn_ctx *x, int status, json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    x->replied = 1;
    x->status = status;
    if (!s) return MHD_NO;
    return reply_bytes(x, status, "application/json", s, strlen(s), 0);
}

static enum MHD_Result reply_error(conn_ctx *x, const api_error *e) {
    if (x->srv->m) metrics_http_error(x->srv->m, e->status);
    const int anthropic = x->route == R_MESSAGES || x->route == R_MSG_COUNT;
    return reply_json(x, e->status, anthropic ? api_msg_error_json(e) : api_error_json(e));
}

static enum MHD_Result fail(conn_ctx *x, int status, const char *type, const char *param,
                            const char *code, const char *msg) {
    api_error e;
    api_fail(&e, status, type, param, code, "%s", msg);
    return reply_error(x, &e);
}

/* ---- auth ----------------------------------------------------------------------------------- */

static int key_ok(const srv_config *cfg, const char *header) {
    const char *keys[SRV_MAX_API_KEYS];
    for (int k = 0; k < cfg->n_api_keys; k++) keys[k] = cfg->api_keys[k];
    return api_auth_ok(header, keys, cfg->n_api_keys);
}

/* The request's key: Authorization: Bearer, or on Anthropic's routes x-api-key too (what
 * its clients send). */
static int authorized(conn_ctx *x, int route) {
    const srv_config *cfg = x->srv->cfg;
    if (key_ok(cfg, MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, "Authorization"))) return 1;
    const char *xkey = route == R_MESSAGES || route == R_MSG_COUNT
                           ? MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, "x-api-key")
                           : NULL;
    if (!xkey) return 0;
    char *b = malloc(strlen(xkey) + 8);
    if (!b) return 0;
    sprintf(b, "Bearer %s", xkey);
    const int ok = key_ok(cfg, b);
    free(b);
    return ok;
}

/* ---- endpoint handlers ---------------------------------------------------------------------- */

/* GET /v1/models: OpenAI's list; for Anthropic's clients (an anthropic-version header) each
 * entry also has its type, display_name and created_at, and the list its page fields. */
static json_t *models_json(conn_ctx *x) {
    http_server *s = x->srv;
    json_t *list = api_models_json(s->model_name, s->started, s->cfg->max_seq_len);
    if (!MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, "anthropic-version")) return list;
    char when[32];
    const time_t t = (time_t)s->started;
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&t, &tm));
    json_t *m = json_array_get(json_object_get(list, "data"), 0);
    json_object_set_new(m, "type", json_string("model"));
    json_object_set_new(m, "display_name", json_string(s->model_name));
    json_object_set_new(m, "created_at", json_string(when));
    json_object_set_new(list, "has_more", json_false());
    json_object_set_new(list, "first_id", json_string(s->model_name));
    json_object_set_new(list, "last_id", json_string(s->model_name));
    return list;
}

static const engine *eng_of(http_server *s) { return atomic_load_explicit(&s->eng, memory_order_acquire); }

static enum MHD_Result handle_health(conn_ctx *x) {
    http_server *s = x->srv;
    if (loop_engine_failed(s->lp))
        return reply_json(x, 503, json_pack("{s:s}", "status", "engine failed"));
    const char *st = eng_of(s) ? "ok" : atomic_load(&s->warming) ? "warming up" : "loading";
    return reply_json(x, 200, json_pack("{s:s}", "status", st));
}

static enum MHD_Result handle_ready(conn_ctx *x) {
    loop_state st = loop_get_state(x->srv->lp);
    int lame = atomic_load(&x->srv->lame_duck);
    if (st == LOOP_READY && !lame && !loop_engine_failed(x->srv->lp))
        return reply_json(x, 200, json_pack("{s:s}", "status", "ready"));
    const char *why = st == LOOP_LOADING ? (atomic_load(&x->srv->warming) ? "warming up" : "loading")
                      : lame || st != LOOP_READY ? "draining" : "engine failed";
    return reply_json(x, 503, json_pack("{s:s}", "status", why));
}

static enum MHD_Result handle_metrics(conn_ctx *x) {
    char *t = metrics_render(x->srv->m);
    if (!t) return MHD_NO;
    x->replied = 1;
    x->status = 200;
    return reply_bytes(x, 200, "text/plain; version=0.0.4; charset=utf-8", t, strlen(t), 0);
}

/* Render a chat request's messages with the model's template. */
static int render_chat(http_server *s, json_t *messages, json_t *tools, json_t *kwargs, int add_gen,
                       char **text, size_t *len, api_error *e) {
    if (!s->tmpl || !s->tok)
        return api_fail(e, 400, NULL, "messages", NULL,
                        "this model has no chat template; use /v1/completions");
    char err[512] = "";
    /* A tokenizer without BOS/EOS leaves those variables undefined, as HF does, so a
     * template's `bos_token is defined` stays false. */
    const char *bos = tok_bos_token(s->tok), *eos = tok_eos_token(s->tok);
    int rc = tmpl_render_chat(s->tmpl, messages, tools, add_gen, *bos ? bos : NULL, *eos ? eos : NULL,
                              kwargs, text, len, err, sizeof err);
    if (rc) return api_fail(e, 400, NULL, "messages", NULL, "chat template error: %s", err);
    return 0;
}

/* check_vocab: reject ids the model cannot take (a --tokenizer larger than the model's
 * vocabulary); /tokenize skips it and reports what the tokenizer says. */
static int encode(http_server *s, const char *text, size_t len, int add_special, int check_vocab,
                  int32_t **ids, const char *param, api_error *e) {
    if (!s->tok)
        return api_fail(e, 400, NULL, param, NULL,
                        "this model has no tokenizer: send token ids, or start the server with --tokenizer");
    char err[256] = "";
    int n = tok_encode(s->tok, text, len, add_special, ids, err, sizeof err);
    if (n < 0) return api_fail(e, 400, NULL, param, NULL, "cannot tokenize: %s", err);
    for (int i = 0; check_vocab && i < n; i++)
        if ((*ids)[i] >= s->vocab) {
            int bad = (*ids)[i];
            free(*ids);
            *ids = NULL;
            return api_fail(e, 400, NULL, param, NULL,
                            "the text encodes to token id %d, outside the model's vocabulary of %d "
                            "(is --tokenizer the model's own?)", bad, s->vocab);
        }
    return n;
}

static enum MHD_Result handle_tokenize(conn_ctx *x) {
    http_server *s = x->srv;
    api_error e;
    json_t *o = api_parse_tokenize(x->body ? x->body : "", x->len, &e);
    if (!o) return reply_error(x, &e);
    int32_t *ids = NULL;
    int n;
    json_t *msgs = json_object_get(o, "messages");
    if (msgs) {
        json_t *agp = json_object_get(o, "add_generation_prompt");
        char *text = NULL;
        size_t len = 0;
        if (render_chat(s, msgs, NULL, NULL, agp ? json_is_true(agp) : 1, &text, &len, &e)) {
            json_decref(o);
            return reply_error(x, &e);
        }
        n = encode(s, text, len, 0, 0, &ids, "messages", &e);
        free(text);
    } else {
        json_t *p = json_object_get(o, "prompt"), *as = json_object_get(o, "add_special_tokens");
        n = encode(s, json_string_value(p), json_string_length(p), as ? json_is_true(as) : 1, 0, &ids, "prompt", &e);
    }
    json_decref(o);
    if (n < 0) return reply_error(x, &e);
    json_t *arr = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    free(ids);
    return reply_json(x, 200, json_pack("{s:o, s:i, s:i}", "tokens", arr, "count", n, "max_model_len",
                                        s->cfg->max_seq_len));
}

/* POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would render it. */
static enum MHD_Result handle_count_tokens(conn_ctx *x) {
    http_server *s = x->srv;
    api_limits lim = {s->model_name, s->vocab, s->cfg->max_n, s->max_token_bytes};
    api_error e;
    api_request *r = api_msg_parse_count(x->body ? x->body : "", x->len, &lim, &e);
    if (!r) return reply_error(x, &e);
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL;
    const int tools_on = r->tools && r->tool_choice != API_TOOL_NONE;   /* as prepare_job renders it */
    int n = render_chat(s, r->messages, tools_on ? r->tools : NULL, r->chat_template_kwargs, r->add_generation_prompt,
                        &text, &len, &e)
                ? -1
                : encode(s, text, len, 0, 1, &ids, "messages", &e);
    free(text);
    free(ids);
    api_request_free(r);
    if (n < 0) return reply_error(x, &e);
    return reply_json(x, 200, json_pack("{s:i}", "input_tokens", n));
}

static enum MHD_Result handle_detokenize(conn_ctx *x) {
    http_server *s = x->srv;
    api_error e;
    json_t *o = api_parse_detokenize(x->body ? x->body : "", x->len, s->vocab, &e);
    if (!o) return reply_error(x, &e);
    if (!s->tok) {
        json_decref(o);
        return fail(x, 400, NULL, "tokens", NULL, "this model has no tokenizer");
    }
    json_t *t = json_object_get(o, "tokens");
    size_t n = json_array_size(t);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; ids && i < n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(t, i));
    json_decref(o);
    char *text = NULL;
    size_t len = 0;
    int rc = ids ? tok_decode(s->tok, ids, n, 0, &text, &len) : SPECD_ENOMEM;
    free(ids);
    if (rc) return fail(x, 500, "server_error", NULL, NULL, "detokenization failed");
    json_t *v = json_pack("{s:s%}", "prompt", text, len);
    free(text);
    return reply_json(x, 200, v);
}

/* Suspend / resume hooks bound to the reply channel (called under its lock). */
static void park_conn(void *arg) { MHD_suspend_connection(arg); }
static void wake_conn(void *arg) { MHD_resume_connection(arg); }

static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    ssize_t n = sse_chan_pull(cls, buf, max);
    return n < 0 ? MHD_CONTENT_READER_END_OF_STREAM : n;
}

static void sse_reader_free(void *cls) { sse_chan_unref(cls); }

/* Non-streaming: reply if the loop is done, else the connection is parked until it is. */
static enum MHD_Result poll_reply(conn_ctx *x) {
    char *data = NULL;
    size_t len = 0;
    int status = 0;
    if (!sse_chan_take_if_closed(x->chan, &data, &len, &status)) return MHD_YES;
    x->replied = 1;
    if (status != 200 && x->srv->m) metrics_http_error(x->srv->m, status);
    if (!data) return reply_bytes(x, status, "application/json", "", 0, 1);
    return reply_bytes(x, status, "application/json", data, len, 0);
}

/* tool_choice required or a named function: the output is held by constrained decoding
 * to JSON the tool-call parser reads as calls (toolcall.h, tc_forced_schema): the named
 * function's arguments, or an array of {"name", "parameters"}. */
static int force_tool_call(const http_server *s, api_request *r, loop_job *job, api_error *e) {
    if (r->sp.grammar)
        return api_fail(e, 400, NULL, "tool_choice", NULL,
                        "tool_choice '%s' cannot be combined with another output constraint",
                        r->tool_choice == API_TOOL_NAMED ? r->tool_name : "required");
    int named = r->tool_choice == API_TOOL_NAMED;
    char *schema = tc_forced_schema(r->tools, named ? r->tool_name : NULL, r->parallel_tool_calls ? 0 : 1);
    if (!schema) return api_fail(e, 400, NULL, "tools", NULL, "'tools' names no function to call");
    char err[256] = "";
    job->tool_grammar = grammar_compile(GRAMMAR_JSON_SCHEMA, schema, strlen(schema), err, sizeof err);
    free(schema);
    if (!job->tool_grammar)
        return api_fail(e, 400, NULL, "tools", NULL, "cannot force a call of %s%s: its parameters schema: %s",
                        named ? "function " : "these tools", named ? r->tool_name : "", err);
    if (s->max_token_bytes > 0) grammar_prepare_masks(job->tool_grammar, s->max_token_bytes);
    return 0;
}

/* Build the loop job: tokenized prompts (+ echo text) for one request. */
static int prepare_job(http_server *s, api_request *r, loop_job *job, api_error *e) {
    int np = r->kind == API_CHAT ? 1 : r->n_prompts;
    job->n_prompts = np;
    job->prompt_ids = calloc((size_t)np, sizeof *job->prompt_ids);
    job->n_prompt_ids = calloc((size_t)np, sizeof *job->n_prompt_ids);
    if (r->echo) {
        job->echo_text = calloc((size_t)np, sizeof *job->echo_text);
        job->echo_len = calloc((size_t)np, sizeof *job->echo_len);
        if (!job->echo_text || !job->echo_len) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    if (!job->prompt_ids || !job->n_prompt_ids) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    if (r->kind == API_CHAT) {
        char *text = NULL;
        size_t len = 0;
        /* tool_choice none: the tools are not offered to the model at all (what vLLM does
         * with --exclude-tools-when-tool-choice-none), so it has no reason to call one. */
        int tools_on = r->tools && r->tool_choice != API_TOOL_NONE;
        if (render_chat(s, r->messages, tools_on ? r->tools : NULL, r->chat_template_kwargs, r->add_generation_prompt,
                        &text, &len, e))
            return -1;
        job->reasoning = s->reasoning;
        job->think_prompt = rp_prompt_state(text, len);
        int forced = r->tool_choice == API_TOOL_REQUIRED || r->tool_choice == API_TOOL_NAMED;
        if (tools_on && (s->tool_format != TC_NONE || forced)) {
            job->tool_format = s->tool_format != TC_NONE ? s->tool_format : TC_HERMES;
            job->max_tool_calls = r->parallel_tool_calls ? 0 : 1;
            /* A marker the tokenizer has as a special token (Mistral's [TOOL_CALLS] and
             * [ARGS], Hermes-3's <tool_call>) must survive decoding: keep special tokens,
             * all but the final stop token (as vLLM's parsers do). */
            const char *mk = tc_marker(job->tool_format);
            int id = forced || !mk ? -1 : tok_token_id(s->tok, mk, strlen(mk));
            if (r->skip_special && id >= 0 && tok_is_special(s->tok, id)) {
                r->skip_special = 0;
                job->drop_stop_text = 1;
            }
        }
        if (forced && force_tool_call(s, r, job, e)) return -1;
        int n = encode(s, text, len, 0, 1, &job->prompt_ids[0], "messages", e);
        free(text);
        if (n < 0) return -1;
        job->n_prompt_ids[0] = n;
    } else {
        for (int p = 0; p < np; p++) {
            api_prompt *pr = &r->prompts[p];
            if (pr->ids) {
                job->prompt_ids[p] = pr->ids;  /* move */
                job->n_prompt_ids[p] = pr->n_ids;
                pr->ids = NULL;
            } else {
                int n = encode(s, pr->text, pr->text_len, 1, 1, &job->prompt_ids[p], "prompt", e);
                if (n < 0) return -1;
                job->n_prompt_ids[p] = n;
            }
            if (r->echo) {
                if (pr->text) {
                    job->echo_text[p] = strdup(pr->text);
                    job->echo_len[p] = pr->text_len;
                } else if (s->tok) {
                    tok_decode(s->tok, job->prompt_ids[p], (size_t)job->n_prompt_ids[p], 0,
                               &job->echo_text[p], &job->echo_len[p]);
                }
            }
        }
    }
    for (int p = 0; p < np; p++)
        if (api_check_length(job->n_prompt_ids[p], r->max_tokens, s->cfg->max_seq_len, p, e)) return -1;
    return 0;
}

static enum MHD_Result handle_generate(conn_ctx *x) {
    http_server *s = x->srv;
    loop_state st = loop_get_state(s->lp);
    if (st == LOOP_LOADING) return fail(x, 503, "server_error", NULL, NULL, "the model is still loading");
    if (st != LOOP_READY) return fail(x, 503, "server_error", NULL, NULL, "the server is shutting down");
    if (loop_engine_failed(s->lp))
        return fail(x, 503, "server_error", NULL, NULL, "the engine has failed; the server needs a restart");
    api_kind kind = x->route == R_CHAT || x->route == R_RESPONSES || x->route == R_MESSAGES ? API_CHAT : API_COMPLETION;
    api_limits lim = {s->model_name, s->vocab, s->cfg->max_n, s->max_token_bytes};
    api_error e;
    const char *body = x->body ? x->body : "";
    api_request *r = x->route == R_RESPONSES ? api_resp_parse(body, x->len, &lim, &e)
                     : x->route == R_MESSAGES ? api_msg_parse(body, x->len, &lim, &e)
                                              : api_parse_request(kind, body, x->len, &lim, &e);
    if (!r) return reply_error(x, &e);
    loop_job *job = calloc(1, sizeof *job);
    if (!job) {
        api_request_free(r);
        return fail(x, 500, "server_error", NULL, NULL, "out of memory");
    }
    job->req = r;
    job->t_arrival = loop_now();
    job->created = (long long)time(NULL);
    api_make_id(job->rid, sizeof job->rid,
                r->responses ? "resp_" : r->messages_api ? "msg_" : kind == API_CHAT ? "chatcmpl-" : "cmpl-");
    snprintf(job->path, sizeof job->path, "%s", routes[x->route_idx].path);
    snprintf(job->request_id, sizeof job->request_id, "%s", x->request_id);
    if (prepare_job(s, r, job, &e)) {
        loop_job_free(job);
        return reply_error(x, &e);
    }
    x->stream = r->stream;
    x->chan = sse_chan_new();
    if (!x->chan) {
        loop_job_free(job);
        return fail(x, 500, "server_error", NULL, NULL, "out of memory");
    }
    sse_chan_bind(x->chan, park_conn, wake_conn, x->conn);
    sse_chan_ref(x->chan);
    job->chan = x->chan;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(x->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    job->fd = ci ? (int)ci->connect_fd : -1;
    int job_seqs = job->n_prompts * r->n;
    int rc = loop_submit(s->lp, job, &x->job_id);  /* consumes job */
    if (rc) {  /* not in the loop: this is a plain reply again */
        sse_chan_unref(x->chan);
        x->chan = NULL;
    }
    if (rc == SPECD_ENOSPACE)
        return fail(x, 429, "rate_limit_error", NULL, NULL, "too many requests in the queue; retry later");
    if (rc == SPECD_ERANGE) {
        char msg[160];
        snprintf(msg, sizeof msg, "the request needs %d sequences (prompts x n); this server holds at most %d "
                 "(max_batch + max_queued)", job_seqs, s->cfg->max_batch + s->cfg->max_queued);
        return fail(x, 400, "invalid_request_error", "n", NULL, msg);
    }
    if (rc) return fail(x, 503, "server_error", NULL, NULL, "the server is not accepting requests");
    atomic_fetch_add(&s->pending, 1);
    if (!x->stream) return poll_reply(x);
    sse_chan_ref(x->chan);  /* the response's reference, dropped by sse_reader_free */
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_reader, x->chan, sse_reader_free);
    if (!resp) {
        sse_chan_unref(x->chan);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    x->replied = 1;
    return queue(x, 200, resp);
}

/* ---- MHD callbacks -------------------------------------------------------------------------- */

/* Route of a path (0: none; -1: the path exists but not for this method). A path ending
 * in '/' is a prefix that needs something after it; HEAD goes wherever GET does. */
static int find_route(const char *url, const char *method, int *idx) {
    for (size_t i = 0; i < N_ROUTES; i++) {
        size_t n = strlen(routes[i].path);
        int prefix = routes[i].path[n - 1] == '/';
        if (prefix ? strncmp(url, routes[i].path, n) || !url[n] : strcmp(url, routes[i].path)) continue;
        *idx = (int)i;
        int ok = !strcmp(method, routes[i].method) || (!strcmp(method, "HEAD") && !strcmp(routes[i].method, "GET"));
        return ok ? (int)routes[i].r : -1;
    }
    return 0;
}

static const char *allow_of(int idx) { return !strcmp(routes[idx].method, "GET") ? "GET, HEAD" : routes[idx].method; }

/* CORS preflight: 204 naming what the route allows; the Access-Control-Allow-* headers
 * only for an allowed origin (the browser refuses the request otherwise). Needs no key. */
static enum MHD_Result preflight(conn_ctx *x, int idx) {
    struct MHD_Response *r = MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    char methods[32];
    snprintf(methods, sizeof methods, "%s, OPTIONS", allow_of(idx));
    MHD_add_response_header(r, "Allow", methods);
    if (allowed_origin(x)) {
        const char *want = MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, "Access-Control-Request-Headers");
        MHD_add_response_header(r, "Access-Control-Allow-Methods", methods);
        MHD_add_response_header(r, "Access-Control-Allow-Headers",
                                want && *want ? want : "Authorization, Content-Type, X-Request-Id, X-Api-Key, Anthropic-Version");
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    }
    x->replied = 1;
    x->status = 204;
    return queue(x, 204, r);
}

/* Counts of the framing headers of a request (MHD keeps repeated headers apart). */
typedef struct {
    int n_cl, n_te, cl_differ, te_not_chunked;
    const char *cl;
} framing;

static enum MHD_Result count_framing(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    framing *f = cls;
    if (!strcasecmp(key, "Content-Length")) {
        if (f->n_cl++ && strcmp(f->cl, value ? value : "")) f->cl_differ = 1;
        f->cl = value ? value : "";
    } else if (!strcasecmp(key, "Transfer-Encoding")) {
        f->n_te++;
        if (!value || strcasecmp(value, "chunked")) f->te_not_chunked = 1;
    }
    return MHD_YES;
}

/* A reply that also closes the connection (the rest of the stream cannot be trusted, or
 * the server has too many); retry_after > 0 adds that header. */
static enum MHD_Result close_with(conn_ctx *x, int status, const char *msg, int retry_after) {
    api_error e;
    api_fail(&e, status, NULL, NULL, NULL, "%s", msg);
    json_t *v = api_error_json(&e);
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    metrics_http_error(x->srv->m, status);
    x->replied = 1;
    x->status = status;
    struct MHD_Response *resp = s ? MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE) : NULL;
    if (!resp) {
        free(s);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "application/json");
    MHD_add_response_header(resp, "Connection", "close");
    if (retry_after > 0) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d", retry_after);
        MHD_add_response_header(resp, "Retry-After", ra);
    }
    return queue(x, status, resp);
}

static enum MHD_Result reply_busy(conn_ctx *x) {
    return close_with(x, 503, "too many open connections; retry later", 1);
}

/* First call for a request: framing, route, method, auth and declared size are checked
 * before any body byte is read. Returns 1 when a reply has been queued. */
static int precheck(conn_ctx *x, const char *url, const char *method, enum MHD_Result *ret) {
    /* Framing a proxy in front may read differently (request smuggling): refuse and close. */
    framing f = {0};
    MHD_get_connection_values(x->conn, MHD_HEADER_KIND, count_framing, &f);
    if ((f.n_cl && f.n_te) || f.cl_differ || f.n_te > 1 || f.te_not_chunked) {
        *ret = close_with(x, 400, f.n_cl && f.n_te ? "both Content-Length and Transfer-Encoding: ambiguous framing"
                                  : f.cl_differ  ? "conflicting Content-Length headers"
                                                 : "unsupported Transfer-Encoding", 0);
        return 1;
    }
    int idx = -1;
    int r = find_route(url, method, &idx);
    if (r < 0 && !strcmp(method, "OPTIONS")) {
        *ret = preflight(x, idx);
        return 1;
    }
    if (r == 0) {
        *ret = fail(x, 404, NULL, NULL, "not_found", "no such route");
        return 1;
    }
    if (r < 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "method %s not allowed on %s (use %s)", method, url, allow_of(idx));
        api_error e;
        api_fail(&e, 405, NULL, NULL, "method_not_allowed", "%s", msg);
        json_t *v = api_error_json(&e);
        char *s = json_dumps(v, JSON_COMPACT);
        json_decref(v);
        metrics_http_error(x->srv->m, 405);
        x->replied = 1;
        x->status = 405;
        struct MHD_Response *resp = s ? MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE) : NULL;
        if (!resp) {
            free(s);
            *ret = MHD_NO;
            return 1;
        }
        MHD_add_response_header(resp, "Content-Type", "application/json");
        MHD_add_response_header(resp, "Allow", allow_of(idx));
        *ret = queue(x, 405, resp);
        return 1;
    }
    x->route = r;
    x->route_idx = idx;
    if (routes[idx].auth && !authorized(x, r)) {
        *ret = fail(x, 401, "authentication_error", NULL, "invalid_api_key", "invalid or missing API key");
        return 1;
    }
    const char *cl = MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, "Content-Length");
    if (cl && strtoll(cl, NULL, 10) > x->srv->cfg->max_body_bytes) {
        char msg[128];
        snprintf(msg, sizeof msg, "request body larger than max_body_bytes (%lld)", x->srv->cfg->max_body_bytes);
        *ret = fail(x, 413, NULL, NULL, "request_too_large", msg);
        return 1;
    }
    return 0;
}

static enum MHD_Result dispatch(conn_ctx *x) {
    if ((x->route == R_TOKENIZE || x->route == R_DETOKENIZE || x->route == R_MSG_COUNT) && !eng_of(x->srv))
        return fail(x, 503, "server_error", NULL, NULL, "the model is still loading");
    switch (x->route) {
    case R_COMPLETIONS: case R_CHAT: case R_RESPONSES: case R_MESSAGES: return handle_generate(x);
    case R_MSG_COUNT: return handle_count_tokens(x);
    case R_TOKENIZE: return handle_tokenize(x);
    case R_DETOKENIZE: return handle_detokenize(x);
    case R_MODELS: return reply_json(x, 200, models_json(x));
    case R_MODEL: {
        const char *id = x->url + strlen("/v1/models/");
        if (strcmp(id, x->srv->model_name)) {
            char msg[256];
            snprintf(msg, sizeof msg, "The model '%.80s' does not exist (this server serves '%.80s')", id,
                     x->srv->model_name);
            return fail(x, 404, "invalid_request_error", "model", "model_not_found", msg);
        }
        json_t *list = models_json(x);
        json_t *one = json_incref(json_array_get(json_object_get(list, "data"), 0));
        json_decref(list);
        return reply_json(x, 200, one);
    }
    case R_HEALTH: return handle_health(x);
    case R_READY: return handle_ready(x);
    case R_VERSION: return reply_json(x, 200, json_pack("{s:s}", "version", SPECD_VERSION));
    case R_METRICS: return handle_metrics(x);
    default: return MHD_NO;
    }
}

/* X-Request-Id: the client's when it is 1-64 characters of [A-Za-z0-9._:-] (so it can go
 * into logs and headers as it is), else a new one. */
static void set_request_id(conn_ctx *x) {
    const char *id = MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, "X-Request-Id");
    size_t n = id ? strlen(id) : 0;
    int ok = n >= 1 && n <= 64;
    for (size_t i = 0; ok && i < n; i++)
        ok = isalnum((unsigned char)id[i]) || strchr("._:-", id[i]);
    if (ok) snprintf(x->request_id, sizeof x->request_id, "%s", id);
    else api_make_id(x->request_id, sizeof x->request_id, "req-");
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
    (void)version;
    http_server *s = cls;
    conn_ctx *x = *con_cls;
    if (!x) {
        if (!(x = calloc(1, sizeof *x))) return MHD_NO;
        x->srv = s;
        x->conn = conn;
        x->t0 = loop_now();
        snprintf(x->method, sizeof x->method, "%s", method);
        snprintf(x->path, sizeof x->path, "%s", url);
        snprintf(x->url, sizeof x->url, "%s", url);
        set_request_id(x);
        *con_cls = x;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        x->gc = ci ? ci->socket_context : NULL;
        if (guard_over_cap(s->guard)) return reply_busy(x);
        enum MHD_Result ret;
        if (precheck(x, url, method, &ret)) return ret;
        return MHD_YES;
    }
    if (!*upload_size && !x->received) {   /* the whole request is in: no deadline until replied */
        x->received = 1;
        guard_received(s->guard, x->gc);
    }
    if (x->replied && !x->chan) {  /* replied early: discard the rest of the body */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (x->too_big) return MHD_YES;
        if (x->len + n > (size_t)s->cfg->max_body_bytes) {
            x->too_big = 1;
            free(x->body);
            x->body = NULL;
            x->len = x->cap = 0;
            return MHD_YES;
        }
        return sbuf_append(&x->body, &x->len, &x->cap, upload, n) ? MHD_NO : MHD_YES;
    }
    /* The whole body is in. */
    if (x->chan) return x->stream ? MHD_YES : poll_reply(x);  /* resumed by the loop */
    if (x->too_big) {
        char msg[128];
        snprintf(msg, sizeof msg, "request body larger than max_body_bytes (%lld)", s->cfg->max_body_bytes);
        return fail(x, 413, NULL, NULL, "request_too_large", msg);
    }
    return dispatch(x);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)conn;
    http_server *s = cls;
    conn_ctx *x = *con_cls;
    if (!x) return;
    *con_cls = NULL;
    guard_replied(s->guard, x->gc);   /* a kept-alive connection's next request is due */
    if (x->chan) {
        sse_chan_detach(x->chan);
        /* Anything but a delivered reply means the client is gone: free its KV now. */
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK || !sse_chan_closed(x->chan))
            loop_cancel(s->lp, x->job_id);
        sse_chan_unref(x->chan);
        atomic_fetch_sub(&s->pending, 1);
    } else if (x->status && (log_enabled(LOG_DEBUG) || (x->route != R_HEALTH && x->route != R_READY &&
                                                        x->route != R_METRICS))) {
        /* Replies given here (errors, /tokenize, /v1/models ...); probes only at debug. */
        log_request_line line = {"-", x->method, x->path, x->status, 0, 0, -1.0, loop_now() - x->t0, NULL,
                                 x->request_id};
        log_request(&line);
    }
    free(x->body);
    free(x);
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

static int resolve(const char *host, int port, struct sockaddr_storage *ss, int *family, char *err,
                   size_t errlen) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc || !res)
        return specd_errf(err, errlen, SPECD_EINVAL, "host '%s': %s", host, rc ? gai_strerror(rc) : "no address");
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *family = res->ai_family;
    freeaddrinfo(res);
    return 0;
}

/* MHD's default unescaper turns %00 into a NUL, and the route would then end there
 * ("/v1/models%00.json" served as "/v1/models"). This one decodes %HH except %00, which
 * stays as written, so such a path matches no route. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    http_server *s = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        *socket_context = guard_open(s->guard, ci ? (int)ci->connect_fd : -1);
    } else {
        guard_close(s->guard, *socket_context);
        *socket_context = NULL;
    }
}

static size_t unescape(void *cls, struct MHD_Connection *c, char *s) {
    (void)cls;
    (void)c;
    char *w = s;
    for (const char *r = s; *r;) {
        int hi, lo;
        if (r[0] == '%' && (hi = hexval(r[1])) >= 0 && (lo = hexval(r[2])) >= 0 && (hi | lo)) {
            *w++ = (char)(hi << 4 | lo);
            r += 3;
        } else {
            *w++ = *r++;
        }
    }
    *w = 0;
    return (size_t)(w - s);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    log_vmsg(LOG_DEBUG, fmt, ap);
}

http_server *http_start(const srv_config *cfg, const char *model_name, loop *l, metrics *m,
                        char *err, size_t errlen) {
    http_server *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->cfg = cfg;
    s->lp = l;
    s->m = m;
    s->started = (long long)time(NULL);
    s->listen_fd = MHD_INVALID_SOCKET;
    if (!(s->guard = guard_create(cfg->recv_timeout, cfg->max_connections))) {
        specd_errf(err, errlen, SPECD_ENOMEM, "cannot start the connection guard");
        goto fail;
    }
    snprintf(s->model_name, sizeof s->model_name, "%s", model_name);
    struct sockaddr_storage ss;
    int family = AF_INET;
    if (resolve(cfg->host, cfg->port, &ss, &family, err, errlen)) goto fail;
    /* MHD's own messages (mostly clients that went away mid-response, which the loop
     * already handles) go to our log at debug level, not raw to stderr. */
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | MHD_USE_ITC;
    if (family == AF_INET6) flags |= MHD_USE_IPv6;
    s->d = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, on_request, s,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                            MHD_OPTION_THREAD_POOL_SIZE, (unsigned)cfg->http_threads,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                            MHD_OPTION_UNESCAPE_CALLBACK, unescape, NULL,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120,
                            /* above the guard's cap, so clients past it get a 503 */
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)cfg->max_connections + 64,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)cfg->max_connections_per_ip,
                            MHD_OPTION_END);
    if (!s->d) {
        specd_errf(err, errlen, SPECD_EIO, "cannot listen on %s:%d (in use? not permitted?)", cfg->host, cfg->port);
        goto fail;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = info ? info->port : cfg->port;
    return s;
fail:
    guard_destroy(s->guard);
    free(s);
    return NULL;
}

void http_set_warming(http_server *h, int on) { atomic_store(&h->warming, on); }

void http_set_engine(http_server *h, const engine *e) {
    h->tok = engine_tokenizer(e);
    h->tmpl = engine_template(e);
    h->vocab = engine_model_config(e)->vocab;
    h->max_token_bytes = engine_max_token_bytes(e);
    /* The tool-call format: the flag's, or what the chat template teaches the model. */
    int f = TC_NONE;
    tc_format_parse(h->cfg->tool_call_parser, &f);   /* validated by the config */
    if (f < 0) {   /* the engine parsed --chat-template; its text is read again here */
        char *own = h->cfg->chat_template[0] ? cli_read_file(h->cfg->chat_template, NULL) : NULL;
        f = tc_detect(own ? own : h->tok ? tok_chat_template(h->tok) : NULL);
        free(own);
    }
    h->tool_format = (tc_format)f;
    rp_mode_parse(h->cfg->reasoning_parser, &h->reasoning);
    if (h->tmpl)
        log_msg(LOG_INFO, "chat: tool-call parser %s%s, reasoning parser %s", tc_format_name(h->tool_format),
                strcmp(h->cfg->tool_call_parser, "auto") ? "" : " (auto)", rp_mode_name(h->reasoning));
    atomic_store_explicit(&h->eng, e, memory_order_release);
}

int http_port(const http_server *h) { return h->port; }
int http_pending(const http_server *h) { return atomic_load(&((http_server *)h)->pending); }

void http_set_lame_duck(http_server *h) { atomic_store(&h->lame_duck, 1); }

void http_quiesce(http_server *h) {
    if (!h || !h->d || h->listen_fd != MHD_INVALID_SOCKET) return;
    h->listen_fd = MHD_quiesce_daemon(h->d);
}

void http_stop(http_server *h) {
    if (!h) return;
    if (h->d) MHD_stop_daemon(h->d);
    if (h->listen_fd != MHD_INVALID_SOCKET) close(h->listen_fd);   /* only after the stop */
    guard_destroy(h->guard);
    free(h);
}
