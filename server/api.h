/* OpenAI API JSON (prefix api_): request validation and response / chunk building.
 *
 * Pure functions over jansson values: no I/O, no engine calls, no locks, so the unit
 * tests drive them directly. The HTTP layer parses a body with api_parse_*, then renders
 * / tokenizes / submits; the loop builds responses with the api_*_json builders.
 *
 * Field policy (documented in the README): unknown fields are ignored, as OpenAI-compatible
 * servers do; a known field with the wrong type or out of range is a 400 naming the field
 * in error.param; null means "not given". Integer fields accept integral JSON reals
 * (5.0) but not 5.5. */
#ifndef SPECD_API_H
#define SPECD_API_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/engine.h"

#define API_MAX_STOP 4
#define API_MAX_STOP_LEN 256
#define API_MAX_TOP_LOGPROBS 20
#define API_MAX_CHOICES 256      /* prompts x n per request */
#define API_MAX_LOGIT_BIAS 1024

typedef enum { API_COMPLETION = 0, API_CHAT = 1 } api_kind;
typedef enum { API_TOOL_AUTO = 0, API_TOOL_NONE, API_TOOL_REQUIRED, API_TOOL_NAMED } api_tool_choice;

/* An OpenAI error: {"error": {"message", "type", "param", "code"}} with an HTTP status. */
typedef struct {
    int status;
    char message[512];
    const char *type;        /* "invalid_request_error", "authentication_error", ... */
    char param[64];          /* "" = null */
    const char *code;        /* NULL = null */
} api_error;

/* Fill e and return -1 (so validators can `return api_fail(...)`). */
int api_fail(api_error *e, int status, const char *type, const char *param, const char *code,
             const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* A request body as a JSON object (NULL + a 400 naming what is wrong), and the value of one
 * of its fields (NULL when absent or null): the readers the request mappings share. */
json_t *api_parse_body(const char *body, size_t len, api_error *e);
json_t *api_field(json_t *o, const char *name);

/* The error object as a JSON value ({"error": {...}}), new reference. */
json_t *api_error_json(const api_error *e);

/* One completions prompt: text or token ids (exactly one of the two). */
typedef struct {
    char *text;              /* NUL-terminated; NULL for token prompts */
    size_t text_len;
    int32_t *ids;            /* NULL for text prompts */
    int n_ids;
} api_prompt;

typedef struct {
    const char *served_model; /* the name "model" must equal */
    int vocab;                /* token ids must be < vocab (the model's) */
    int max_n;                /* largest n */
    int max_token_bytes;      /* the vocabulary's longest token (grammar_prepare_masks) */
} api_limits;

typedef struct {
    api_kind kind;
    /* completions */
    api_prompt *prompts;
    int n_prompts;
    int echo;
    /* chat: normalised messages (content parts joined into a string), tools; own refs */
    json_t *messages;
    json_t *tools;
    json_t *chat_template_kwargs; /* object merged into the template context, or NULL */
    int add_generation_prompt;
    api_tool_choice tool_choice;
    char tool_name[256];     /* API_TOOL_NAMED: the function (one of tools) */
    int parallel_tool_calls; /* default 1; 0: at most one call is returned */
    /* both */
    int n;
    int stream, include_usage;
    int max_tokens;          /* -1 = not given */
    int logprobs;            /* -1 none; else top N (completions: logprobs; chat: top_logprobs) */
    int prompt_logprobs;     /* vLLM's prompt_logprobs: -1 none; else top N per prompt token.
                              * sp.prompt_logprobs is the larger of it and, for completions
                              * with echo, logprobs (the echoed prompt carries its logprobs) */
    int n_stop;
    char *stop[API_MAX_STOP];
    engine_sampling sp;      /* logit bias points into the arrays below; sp.grammar is owned */
    int32_t bias_ids[API_MAX_LOGIT_BIAS];
    float bias_vals[API_MAX_LOGIT_BIAS];
    int skip_special;        /* decode: drop special tokens (default 1) */
    json_t *responses;       /* POST /v1/responses (api_responses.h): the fields its response
                              * echoes; NULL for chat and completions */
    int messages_api;        /* POST /v1/messages (api_messages.h) */
} api_request;

/* Constrained decoding fields (api_constraint.c): response_format (json_object,
 * json_schema), vLLM's guided_json / guided_regex / guided_choice / guided_grammar /
 * structured_outputs, llama.cpp's json_schema / grammar. At most one; it is compiled into
 * r->sp.grammar, which the request owns (api_request_free drops it). Other code that
 * constrains a request (a forced tool call) sets r->sp.grammar the same way, from
 * grammar_compile, after unreffing any previous one. Returns 0 (none), 1 (set) or -1
 * (400 naming the field and the problem). */
int api_parse_constraint(json_t *o, const api_limits *lim, api_request *r, api_error *e);

/* Parse and validate a request body. Returns a new request (free with api_request_free),
 * or NULL with *e filled (status 400 / 404). */
api_request *api_parse_request(api_kind kind, const char *body, size_t len,
                               const api_limits *lim, api_error *e);
void api_request_free(api_request *r);

/* Prompt length check after tokenization: 400 when the prompt leaves no room for one
 * token, or when an explicit max_tokens does not fit. Returns 0 or -1 with *e filled. */
int api_check_length(int n_prompt, int max_tokens, int max_seq_len, int prompt_index,
                     api_error *e);

/* Default max_tokens when the client gave none: 16 for completions (OpenAI's legacy
 * default), the rest of the context for chat. */
int api_default_max_tokens(api_kind kind, int n_prompt, int max_seq_len);

/* /tokenize {"prompt": str, "add_special_tokens"?} or {"messages": [...]};
 * /detokenize {"tokens": [int...]}. Return a parsed body (new ref) or NULL with *e. */
json_t *api_parse_tokenize(const char *body, size_t len, api_error *e);
json_t *api_parse_detokenize(const char *body, size_t len, int vocab, api_error *e);

/* Normalise chat messages (validates roles, joins text parts). New ref or NULL + *e. */
json_t *api_normalize_messages(json_t *messages, api_error *e);

/* ---- stop strings ------------------------------------------------------------------ */

/* Scan pending (not yet emitted) text for stop strings. If one occurs, returns 1 and sets
 * *emit to the offset of the earliest match (text before it is output, the rest dropped).
 * Otherwise returns 0 and sets *emit to how much may be output now: everything except the
 * longest suffix that is a proper prefix of some stop string (held back until later text
 * decides). Stop strings are non-empty. */
int api_stop_scan(const char *text, size_t len, char *const *stops, int n_stops, size_t *emit);

/* ---- responses --------------------------------------------------------------------- */

typedef struct {
    int prompt_tokens, completion_tokens;
    int spec;                /* include the spec_decode extension */
    long long draft_tokens, accepted_tokens, verify_steps;
    const char *drafter;     /* "draft_model", "ngram" (NULL: not reported) */
    long long decode_steps;  /* steps that decoded (a verify step is one of them) */
} api_usage;

json_t *api_usage_json(const api_usage *u);

/* "stop" / "length" / "abort" / NULL (running) */
const char *api_finish_reason(engine_finish f);

/* A whole non-streaming response. choices: array built with api_*_choice (stolen). */
json_t *api_response_json(api_kind kind, const char *id, long long created, const char *model,
                          json_t *choices, const api_usage *usage);
/* {"index", "text", "logprobs", "finish_reason"}; logprobs stolen (NULL -> null). */
json_t *api_completion_choice(int index, const char *text, size_t len, const char *finish,
                              json_t *logprobs);
/* {"index", "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"} */
json_t *api_chat_choice(int index, const char *text, size_t len, const char *finish,
                        json_t *logprobs);

/* A chat choice around a message built by the caller (content, reasoning_content,
 * tool_calls); message and logprobs stolen. */
json_t *api_chat_message_choice(int index, json_t *message, const char *finish, json_t *logprobs);
/* A chat chunk with one choice whose delta the caller built (stolen, as are logprobs). */
json_t *api_chat_delta_chunk(const char *id, long long created, const char *model, int index, json_t *delta,
                             const char *finish, json_t *logprobs, int include_usage);

/* A streaming chunk with one choice. Chat: delta {"role"?, "content"?}; role is put in
 * when first is set; content when text is non-NULL; finish NULL -> null. include_usage
 * adds "usage": null as OpenAI does on every chunk but the last. logprobs stolen. */
json_t *api_chunk_json(api_kind kind, const char *id, long long created, const char *model,
                       int index, int first, const char *text, size_t len, const char *finish,
                       json_t *logprobs, int include_usage);
/* The final usage chunk: "choices": [] and usage. */
json_t *api_usage_chunk_json(api_kind kind, const char *id, long long created,
                             const char *model, const api_usage *u);

/* Logprobs accumulators. Completions: {tokens, token_logprobs, top_logprobs, text_offset};
 * chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
 * tok_text(id) gives a token's text; top may be empty (n_top 0). */
json_t *api_logprobs_new(api_kind kind);
/* A NAN logprob (the first prompt token's, which has none) is null, as are its top
 * logprobs (completions). */
void api_logprobs_add(json_t *lp, api_kind kind, const char *tok, size_t tok_len, float logprob,
                      int n_top, const char *const *top_tok, const size_t *top_len,
                      const float *top_lp, long long text_offset);

/* {"object": "list", "data": [{"id", "object": "model", "created", "owned_by",
 * "max_model_len"}]} */
json_t *api_models_json(const char *model, long long created, int max_model_len);

/* Authorization header check: "Bearer <key>" against n keys (n == 0: no auth, always
 * ok). Time does not depend on where a key differs: every key is compared in full. */
int api_auth_ok(const char *header, const char *const *keys, int n_keys);

/* Random id with a prefix ("cmpl-" + 24 hex digits). */
void api_make_id(char *buf, size_t cap, const char *prefix);

/* SSE framing: "data: <compact json>\n\n" (malloc'd, *len set). */
char *api_sse_event(json_t *v, size_t *len);
#define API_SSE_DONE "data: [DONE]\n\n"

#endif
