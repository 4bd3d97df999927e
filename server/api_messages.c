/* The Messages API over chat (see api_messages.h): the request mapping, the error shape,
 * and the content blocks and streaming events built from chat output. */
#include "server/api_messages.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/sbuf.h"

/* ---- request ---------------------------------------------------------------------------- */

/* A text block {type: text, text} as a chat text part (new reference), else NULL. */
static json_t *text_part(json_t *b) {
    const char *type = json_string_value(json_object_get(b, "type"));
    json_t *text = json_object_get(b, "text");
    return type && !strcmp(type, "text") && json_is_string(text) ? json_pack("{s:s, s:O}", "type", "text", "text", text)
                                                                  : NULL;
}

/* The text blocks of a content array as chat text parts (other block types: a 400 naming
 * `where`); a string stays a string. */
static json_t *text_parts(json_t *c, const char *where, size_t i, api_error *e) {
    if (json_is_string(c)) return json_incref(c);
    if (!json_is_array(c)) {
        api_fail(e, 400, NULL, where, NULL, "%s[%zu].content must be a string or an array of blocks", where, i);
        return NULL;
    }
    json_t *parts = json_array(), *b;
    size_t j;
    json_array_foreach(c, j, b) {
        json_t *p = text_part(b);
        if (!p) {
            const char *type = json_string_value(json_object_get(b, "type"));
            api_fail(e, 400, NULL, where, NULL, "%s[%zu].content[%zu]: only text blocks with a 'text' string are "
                     "supported here (got '%s')", where, i, j, type ? type : "no type");
            json_decref(parts);
            return NULL;
        }
        json_array_append_new(parts, p);
    }
    return parts;
}

static int map_system(json_t *o, json_t *msgs, api_error *e) {
    json_t *sys = api_field(o, "system");
    if (!sys) return 0;
    if (!json_is_string(sys) && !json_is_array(sys))
        return api_fail(e, 400, NULL, "system", NULL, "'system' must be a string or an array of text blocks");
    json_t *c = text_parts(sys, "system", 0, e);
    if (!c) return -1;
    json_array_append_new(msgs, json_pack("{s:s, s:o}", "role", "system", "content", c));
    return 0;
}

/* An assistant turn's blocks: text parts, and tool_use blocks as its tool_calls. */
static int map_assistant(json_t *blocks, size_t i, json_t *msgs, api_error *e) {
    json_t *parts = json_array(), *calls = json_array(), *b;
    size_t j;
    json_array_foreach(blocks, j, b) {
        const char *type = json_string_value(json_object_get(b, "type"));
        json_t *p = text_part(b);
        if (p) {
            json_array_append_new(parts, p);
        } else if (type && !strcmp(type, "tool_use")) {
            json_t *id = json_object_get(b, "id"), *name = json_object_get(b, "name"), *input = json_object_get(b, "input");
            if (!json_is_string(id) || !json_is_string(name) || !json_is_object(input)) {
                json_decref(parts);
                json_decref(calls);
                return api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].content[%zu]: a tool_use block needs "
                                "an 'id' and a 'name' string and an 'input' object", i, j);
            }
            char *args = json_dumps(input, JSON_COMPACT);
            json_array_append_new(calls, json_pack("{s:O, s:s, s:{s:O, s:s}}", "id", id, "type", "function", "function",
                                                   "name", name, "arguments", args ? args : "{}"));
            free(args);
        } else if (!type || (strcmp(type, "thinking") && strcmp(type, "redacted_thinking"))) {
            json_decref(parts);
            json_decref(calls);
            return api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].content[%zu]: block type '%s' is not "
                            "supported in an assistant turn", i, j, type ? type : "no type");
        }   /* earlier thinking is not shown to the model again */
    }
    json_t *m = json_pack("{s:s}", "role", "assistant");
    json_object_set_new(m, "content", json_array_size(parts) ? parts : json_array_size(calls) ? json_null() : json_string(""));
    if (json_array_size(parts) == 0) json_decref(parts);
    if (json_array_size(calls)) json_object_set_new(m, "tool_calls", calls);
    else json_decref(calls);
    json_array_append_new(msgs, m);
    return 0;
}

/* A user turn's blocks: each tool_result as a tool message, then the text as the user's. */
static int map_user(json_t *blocks, size_t i, json_t *msgs, api_error *e) {
    json_t *parts = json_array(), *b;
    size_t j;
    json_array_foreach(blocks, j, b) {
        const char *type = json_string_value(json_object_get(b, "type"));
        json_t *p = text_part(b);
        if (p) {
            json_array_append_new(parts, p);
            continue;
        }
        if (!type || strcmp(type, "tool_result")) {
            json_decref(parts);
            return api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].content[%zu]: block type '%s' is not "
                            "supported (text and tool_result only)", i, j, type ? type : "no type");
        }
        json_t *id = json_object_get(b, "tool_use_id"), *c = api_field(b, "content");
        if (!json_is_string(id)) {
            json_decref(parts);
            return api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].content[%zu]: a tool_result block needs "
                            "a 'tool_use_id' string", i, j);
        }
        json_t *content = c ? text_parts(c, "messages", i, e) : json_string("");
        if (!content) {
            json_decref(parts);
            return -1;
        }
        json_array_append_new(msgs, json_pack("{s:s, s:O, s:o}", "role", "tool", "tool_call_id", id, "content", content));
    }
    if (json_array_size(parts)) json_array_append_new(msgs, json_pack("{s:s, s:o}", "role", "user", "content", parts));
    else json_decref(parts);
    return 0;
}

static int map_messages(json_t *o, json_t *msgs, api_error *e) {
    json_t *ms = api_field(o, "messages"), *m;
    if (!json_is_array(ms) || !json_array_size(ms))
        return api_fail(e, 400, NULL, "messages", NULL, "'messages' must be a non-empty array");
    size_t i;
    json_array_foreach(ms, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        json_t *c = json_object_get(m, "content");
        if (!json_is_object(m) || !role || (strcmp(role, "user") && strcmp(role, "assistant")))
            return api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].role must be 'user' or 'assistant'", i);
        if (json_is_string(c)) {
            json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", role, "content", c));
            continue;
        }
        if (!json_is_array(c))
            return api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].content must be a string or an array of "
                            "blocks", i);
        if (!strcmp(role, "assistant") ? map_assistant(c, i, msgs, e) : map_user(c, i, msgs, e)) return -1;
    }
    return 0;
}

/* Client tools {name, description, input_schema} as chat function tools; tool_choice. */
static int map_tools(json_t *o, json_t *cb, api_error *e) {
    json_t *tools = api_field(o, "tools"), *t;
    if (tools) {
        if (!json_is_array(tools)) return api_fail(e, 400, NULL, "tools", NULL, "'tools' must be an array");
        json_t *out = json_array();
        json_object_set_new(cb, "tools", out);
        size_t i;
        json_array_foreach(tools, i, t) {
            const char *type = json_string_value(json_object_get(t, "type"));
            if (type && strcmp(type, "custom"))
                return api_fail(e, 400, NULL, "tools", NULL, "tools[%zu]: server tool '%s' is not supported (client "
                                "tools only: name, description, input_schema)", i, type);
            if (!json_is_string(json_object_get(t, "name")) || !json_is_object(json_object_get(t, "input_schema")))
                return api_fail(e, 400, NULL, "tools", NULL, "tools[%zu] needs a 'name' string and an 'input_schema' "
                                "object", i);
            json_t *fn = json_pack("{s:O, s:O}", "name", json_object_get(t, "name"), "parameters",
                                   json_object_get(t, "input_schema"));
            if (api_field(t, "description")) json_object_set(fn, "description", json_object_get(t, "description"));
            json_array_append_new(out, json_pack("{s:s, s:o}", "type", "function", "function", fn));
        }
    }
    json_t *tc = api_field(o, "tool_choice");
    if (!tc) return 0;
    const char *type = json_string_value(json_object_get(tc, "type"));
    json_t *name = json_object_get(tc, "name");
    if (!json_is_object(tc) || !type)
        return api_fail(e, 400, NULL, "tool_choice", NULL, "'tool_choice' must be an object with a 'type'");
    if (!strcmp(type, "auto")) json_object_set_new(cb, "tool_choice", json_string("auto"));
    else if (!strcmp(type, "any")) json_object_set_new(cb, "tool_choice", json_string("required"));
    else if (!strcmp(type, "none")) json_object_set_new(cb, "tool_choice", json_string("none"));
    else if (!strcmp(type, "tool") && json_is_string(name))
        json_object_set_new(cb, "tool_choice", json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", name));
    else
        return api_fail(e, 400, NULL, "tool_choice", NULL,
                        "tool_choice.type must be 'auto', 'any', 'none' or 'tool' (with a 'name')");
    if (json_is_true(json_object_get(tc, "disable_parallel_tool_use")))
        json_object_set_new(cb, "parallel_tool_calls", json_false());
    return 0;
}

static api_request *parse_body(const char *body, size_t len, const api_limits *lim, int count, api_error *e);

api_request *api_msg_parse(const char *body, size_t len, const api_limits *lim, api_error *e) {
    return parse_body(body, len, lim, 0, e);
}

api_request *api_msg_parse_count(const char *body, size_t len, const api_limits *lim, api_error *e) {
    return parse_body(body, len, lim, 1, e);
}

/* count: /v1/messages/count_tokens's body (no max_tokens: the prompt is all it counts). */
static api_request *parse_body(const char *body, size_t len, const api_limits *lim, int count, api_error *e) {
    json_t *o = api_parse_body(body, len, e);
    if (!o) return NULL;
    json_t *cb = json_object(), *msgs = json_array();
    json_object_set_new(cb, "messages", msgs);
    api_request *r = NULL;
    static const char *const refused[] = {"mcp_servers", "container"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        if (api_field(o, refused[i])) {
            api_fail(e, 400, NULL, refused[i], NULL, "'%s' is not supported", refused[i]);
            goto done;
        }
    json_t *mt = count ? json_integer(1) : json_incref(api_field(o, "max_tokens"));
    json_object_set_new(cb, "max_tokens", mt);
    if (!json_is_integer(mt) || json_integer_value(mt) < 1) {
        api_fail(e, 400, NULL, "max_tokens", NULL, "'max_tokens' is required: an integer >= 1");
        goto done;
    }
    if (map_system(o, msgs, e) || map_messages(o, msgs, e) || map_tools(o, cb, e)) goto done;
    /* output_config.format {type: json_schema, schema}: constrained decoding (chat's
     * response_format); its effort changes nothing here */
    json_t *oc = api_field(o, "output_config"), *fmt = oc ? api_field(oc, "format") : NULL;
    if (oc && !json_is_object(oc)) {
        api_fail(e, 400, NULL, "output_config", NULL, "'output_config' must be an object");
        goto done;
    }
    if (fmt) {
        const char *ft = json_string_value(json_object_get(fmt, "type"));
        if (!ft || strcmp(ft, "json_schema") || !json_is_object(json_object_get(fmt, "schema"))) {
            api_fail(e, 400, NULL, "output_config", NULL, "output_config.format must be {\"type\": \"json_schema\", "
                     "\"schema\": {...}}");
            goto done;
        }
        json_object_set_new(cb, "response_format", json_pack("{s:s, s:{s:s, s:O}}", "type", "json_schema", "json_schema",
                                                             "name", "output", "schema", json_object_get(fmt, "schema")));
    }
    json_t *ss = api_field(o, "stop_sequences");
    if (ss && !json_is_array(ss)) {
        api_fail(e, 400, NULL, "stop_sequences", NULL, "'stop_sequences' must be an array of strings");
        goto done;
    }
    if (ss) json_object_set(cb, "stop", ss);
    static const char *const same[] = {"model", "temperature", "top_p", "top_k", "stream"};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
        if (json_object_get(o, same[i])) json_object_set(cb, same[i], json_object_get(o, same[i]));
    char *chat = json_dumps(cb, JSON_COMPACT);
    r = chat ? api_parse_request(API_CHAT, chat, strlen(chat), lim, e) : NULL;
    free(chat);
    if (r) r->messages_api = 1;
    else if (!strcmp(e->param, "stop")) snprintf(e->param, sizeof e->param, "stop_sequences");
done:
    json_decref(cb);
    json_decref(o);
    return r;
}

json_t *api_msg_error_json(const api_error *e) {
    const char *t = e->status == 401   ? "authentication_error"
                    : e->status == 403 ? "permission_error"
                    : e->status == 404 ? "not_found_error"
                    : e->status == 413 ? "request_too_large"
                    : e->status == 429 ? "rate_limit_error"
                    : e->status == 503 ? "overloaded_error"
                    : e->status >= 500 ? "api_error"
                                       : "invalid_request_error";
    return json_pack("{s:s, s:{s:s, s:s}}", "type", "error", "error", "type", t, "message", e->message);
}

/* ---- output ------------------------------------------------------------------------------ */

enum { B_NONE = 0, B_TEXT, B_THINKING, B_TOOL };

struct api_mstream {
    char id[64], model[256];
    json_t *content;      /* blocks so far */
    int open, open_kind;  /* the open block's index and kind (B_NONE: none) */
    int call_of[256];     /* chat tool-call index -> block index (-1: none yet) */
    char *buf;            /* the open block's text or the open call's arguments */
    size_t blen, bcap;
};

api_mstream *api_mstream_new(const char *msg_id, const char *model) {
    api_mstream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    snprintf(s->id, sizeof s->id, "%s", msg_id);
    snprintf(s->model, sizeof s->model, "%s", model);
    s->content = json_array();
    for (size_t i = 0; i < sizeof s->call_of / sizeof s->call_of[0]; i++) s->call_of[i] = -1;
    return s;
}

void api_mstream_free(api_mstream *s) {
    if (!s) return;
    json_decref(s->content);
    free(s->buf);
    free(s);
}

static void push(json_t *ev, json_t *e) {
    if (ev) json_array_append_new(ev, e);
    else json_decref(e);
}

static json_t *message_obj(api_mstream *s, json_t *content, const char *stop, const char *stop_seq, int in, int out) {
    return json_pack("{s:s, s:s, s:s, s:o, s:s, s:o, s:o, s:{s:i, s:i}}", "id", s->id, "type", "message", "role",
                     "assistant", "content", content, "model", s->model, "stop_reason",
                     stop ? json_string(stop) : json_null(), "stop_sequence",
                     stop_seq ? json_string(stop_seq) : json_null(), "usage", "input_tokens", in, "output_tokens", out);
}

void api_mstream_open(api_mstream *s, int input_tokens, json_t *ev) {
    push(ev, json_pack("{s:s, s:o}", "type", "message_start", "message",
                       message_obj(s, json_array(), NULL, NULL, input_tokens, 0)));
}

/* The open block's final form into content, and content_block_stop. */
static void close_block(api_mstream *s, json_t *ev) {
    if (s->open_kind == B_NONE) return;
    json_t *b = json_array_get(s->content, (size_t)s->open);
    if (s->open_kind == B_TEXT) {
        json_object_set_new(b, "text", json_stringn(s->buf ? s->buf : "", s->blen));
    } else if (s->open_kind == B_THINKING) {
        json_object_set_new(b, "thinking", json_stringn(s->buf ? s->buf : "", s->blen));
    } else {   /* the arguments as the input object (a call cut short: {}) */
        json_t *in = s->blen ? json_loadb(s->buf, s->blen, 0, NULL) : NULL;
        json_object_set_new(b, "input", json_is_object(in) ? in : json_object());
        if (in && !json_is_object(in)) json_decref(in);
    }
    push(ev, json_pack("{s:s, s:i}", "type", "content_block_stop", "index", s->open));
    s->open_kind = B_NONE;
    s->blen = 0;
}

/* A new block of kind k (its first form in content), content_block_start. */
static void open_block(api_mstream *s, int k, json_t *block, json_t *ev) {
    close_block(s, ev);
    s->open = (int)json_array_size(s->content);
    s->open_kind = k;
    s->blen = 0;
    json_array_append_new(s->content, block);
    push(ev, json_pack("{s:s, s:i, s:O}", "type", "content_block_start", "index", s->open, "content_block", block));
}

static void add_text(api_mstream *s, int k, const char *t, size_t n, json_t *ev) {
    if (!n) return;
    if (s->open_kind != k)
        open_block(s, k, k == B_TEXT ? json_pack("{s:s, s:s}", "type", "text", "text", "")
                                     : json_pack("{s:s, s:s, s:s}", "type", "thinking", "thinking", "", "signature", ""),
                   ev);
    if (sbuf_append(&s->buf, &s->blen, &s->bcap, t, n)) return;
    push(ev, json_pack("{s:s, s:i, s:{s:s, s:s%}}", "type", "content_block_delta", "index", s->open, "delta", "type",
                       k == B_TEXT ? "text_delta" : "thinking_delta", k == B_TEXT ? "text" : "thinking", t, n));
}

/* One tool-call entry of a chat delta (streamed: index, then id / name / argument
 * fragments; whole: no index). */
static void add_call(api_mstream *s, json_t *tc, json_t *ev) {
    json_t *ix = json_object_get(tc, "index"), *fn = json_object_get(tc, "function");
    const int whole = !ix, idx = json_is_integer(ix) ? (int)json_integer_value(ix) : 0;
    if (idx < 0 || idx >= (int)(sizeof s->call_of / sizeof s->call_of[0])) return;
    if (whole || s->call_of[idx] < 0) {
        char cid[64];
        const char *id = json_string_value(json_object_get(tc, "id"));
        if (!id) api_make_id(cid, sizeof cid, "toolu_");
        const char *name = json_string_value(json_object_get(fn, "name"));
        open_block(s, B_TOOL, json_pack("{s:s, s:s, s:s, s:{}}", "type", "tool_use", "id", id ? id : cid, "name",
                                        name ? name : "", "input"), ev);
        if (!whole) s->call_of[idx] = s->open;
    }
    const char *frag = json_string_value(json_object_get(fn, "arguments"));
    if (!frag || !*frag || s->open_kind != B_TOOL) return;
    size_t n = strlen(frag);
    if (sbuf_append(&s->buf, &s->blen, &s->bcap, frag, n)) return;
    push(ev, json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_delta", "index", s->open, "delta", "type",
                       "input_json_delta", "partial_json", frag));
}

void api_mstream_feed(api_mstream *s, json_t *delta, json_t *ev) {
    json_t *r = json_object_get(delta, "reasoning_content"), *c = json_object_get(delta, "content");
    if (json_is_string(r)) add_text(s, B_THINKING, json_string_value(r), json_string_length(r), ev);
    if (json_is_string(c)) add_text(s, B_TEXT, json_string_value(c), json_string_length(c), ev);
    json_t *calls = json_object_get(delta, "tool_calls"), *tc;
    size_t i;
    json_array_foreach(calls, i, tc) add_call(s, tc, ev);
}

json_t *api_mstream_close(api_mstream *s, const char *finish, const char *stop_seq, int input_tokens,
                          int output_tokens, json_t *ev) {
    close_block(s, ev);
    int calls = 0;   /* a turn with tool_use blocks ends for them (a forced tool too) */
    json_t *b;
    size_t i;
    json_array_foreach(s->content, i, b) calls |= !strcmp(json_string_value(json_object_get(b, "type")), "tool_use");
    const char *stop = finish && !strcmp(finish, "length")              ? "max_tokens"
                       : calls || (finish && !strcmp(finish, "tool_calls")) ? "tool_use"
                       : stop_seq                                        ? "stop_sequence"
                                                                         : "end_turn";
    if (strcmp(stop, "stop_sequence")) stop_seq = NULL;
    push(ev, json_pack("{s:s, s:{s:s, s:o}, s:{s:i}}", "type", "message_delta", "delta", "stop_reason", stop,
                       "stop_sequence", stop_seq ? json_string(stop_seq) : json_null(), "usage", "output_tokens",
                       output_tokens));
    push(ev, json_pack("{s:s}", "type", "message_stop"));
    return message_obj(s, json_deep_copy(s->content), stop, stop_seq, input_tokens, output_tokens);
}
