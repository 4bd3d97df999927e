/* The OpenAI Responses API (POST /v1/responses) mapped onto chat (prefix api_resp_ and
 * api_rstream_). Pure JSON work, like api.h: no I/O, no engine.
 *
 * Request: api_resp_parse turns a Responses body into a chat request: `input` (a string,
 * or items: messages with roles user / assistant / system / developer and string or
 * input_text / output_text parts, `function_call` items as an assistant turn's
 * tool_calls, `function_call_output` items as tool messages), `instructions` (a system
 * message first), `max_output_tokens`, `temperature`, `top_p`, `tools` (function tools
 * {type, name, description, parameters}), `tool_choice` ("auto", "none", "required",
 * {type: function, name}), `parallel_tool_calls`, `text.format` (json_object /
 * json_schema: constrained decoding), `stream`. State kept by the server does not exist
 * here: `previous_response_id`, `conversation`, `store: true` and `background: true` are a
 * 400 naming the field, as are input items, content parts and tools of other types.
 *
 * Response: an api_rstream turns the chat output (the deltas the chat parsers produce,
 * or one whole message) into Responses output items (message with output_text, function
 * calls, reasoning) and, streamed, the Responses events (response.created,
 * response.output_item.added, response.content_part.added, response.output_text.delta,
 * ... response.completed) with sequence numbers. The same object builds the non-streamed
 * response, so both carry the same items. */
#ifndef SPECD_API_RESPONSES_H
#define SPECD_API_RESPONSES_H

#include "server/api.h"

/* Parse and validate; a chat request whose `responses` field holds what the response
 * echoes back. NULL with *e filled on error. */
api_request *api_resp_parse(const char *body, size_t len, const api_limits *lim, api_error *e);

typedef struct api_rstream api_rstream;

/* echo: the request's echoed fields (borrowed; copied into every response object). */
api_rstream *api_rstream_new(const char *resp_id, long long created, const char *model, json_t *echo);
void api_rstream_free(api_rstream *s);
/* The opening events (response.created, response.in_progress) appended to ev. */
void api_rstream_open(api_rstream *s, json_t *ev);
/* A chat delta {"content"?, "reasoning_content"?, "tool_calls"?} (tool_calls as streamed
 * deltas with "index", or whole calls without); events appended to ev (NULL: none kept). */
void api_rstream_feed(api_rstream *s, json_t *delta, json_t *ev);
/* Close the open items; finish "length" makes the response incomplete
 * (max_output_tokens). Appends the closing events and response.completed (or
 * response.incomplete) to ev when given; returns the final response object (new ref). */
json_t *api_rstream_close(api_rstream *s, const char *finish, int input_tokens, int output_tokens, json_t *ev);
/* One event as SSE: "event: <type>\ndata: <json>\n\n" (malloc'd, *len set). */
char *api_rstream_sse(json_t *event, size_t *len);

#endif
