/* The Anthropic Messages API (POST /v1/messages) mapped onto chat (prefix api_msg_ and
 * api_mstream_), as api_responses.h maps the Responses API. Pure JSON work: no I/O, no
 * engine.
 *
 * Request: api_msg_parse turns a Messages body into a chat request: `system` (a string or
 * text blocks: a system message first), `messages` (roles user / assistant; content a
 * string or blocks: text; tool_use in an assistant turn as its tool_calls, the input
 * object as the arguments' JSON; tool_result in a user turn as a tool message, before the
 * turn's text), `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`,
 * `top_k` (no longer in Anthropic's own client: send them as extra body fields), `stream`,
 * `tools` ({name, description, input_schema} as function tools), `tool_choice` (auto /
 * any / tool {name} / none; disable_parallel_tool_use), `output_config.format`
 * ({type: json_schema, schema}: constrained decoding, as chat's response_format). Blocks
 * the server cannot read (image, document, server tools, MCP servers, containers) are a
 * 400 naming them; other fields (`thinking`, `output_config.effort`, `cache_control`,
 * `metadata`, `service_tier`, ...) are accepted and change nothing (reasoning models think
 * by their chat template; earlier thinking blocks are dropped; prefix caching is
 * automatic).
 *
 * count_tokens: api_msg_parse_count reads the same body without max_tokens.
 *
 * Response: an api_mstream turns the chat output (the chat parsers' deltas, or one whole
 * message) into content blocks (thinking, text, tool_use with its input parsed) and,
 * streamed, the Messages events (message_start, content_block_start / _delta / _stop,
 * message_delta with the stop reason and usage, message_stop). The same object builds the
 * non-streamed message, so both carry the same blocks. Errors have the Messages shape:
 * {"type": "error", "error": {"type", "message"}}. */
#ifndef SPECD_API_MESSAGES_H
#define SPECD_API_MESSAGES_H

#include "server/api.h"

/* Parse and validate; a chat request with `messages_api` set. NULL with *e filled on error. */
api_request *api_msg_parse(const char *body, size_t len, const api_limits *lim, api_error *e);
/* The same for POST /v1/messages/count_tokens (its body has no max_tokens). */
api_request *api_msg_parse_count(const char *body, size_t len, const api_limits *lim, api_error *e);

/* An error as the Messages API writes it (its type from the status). New reference. */
json_t *api_msg_error_json(const api_error *e);

typedef struct api_mstream api_mstream;

api_mstream *api_mstream_new(const char *msg_id, const char *model);
void api_mstream_free(api_mstream *s);
/* message_start (with the prompt's tokens) appended to ev. */
void api_mstream_open(api_mstream *s, int input_tokens, json_t *ev);
/* A chat delta {"content"?, "reasoning_content"?, "tool_calls"?} (tool_calls as streamed
 * deltas with "index", or whole calls without); events appended to ev (NULL: none kept). */
void api_mstream_feed(api_mstream *s, json_t *delta, json_t *ev);
/* Close the open block; the stop reason from the chat finish ("length": max_tokens,
 * "tool_calls": tool_use, "stop" with stop_seq: stop_sequence, else end_turn). Appends
 * message_delta and message_stop to ev when given; returns the message object (new ref). */
json_t *api_mstream_close(api_mstream *s, const char *finish, const char *stop_seq, int input_tokens,
                          int output_tokens, json_t *ev);
/* (events go out as SSE through api_rstream_sse: "event: <type>\ndata: <json>\n\n") */

#endif
