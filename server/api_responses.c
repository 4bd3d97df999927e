/* The Responses API over chat (see api_responses.h): the request mapping, and the output
 * items and streaming events built from chat output. */
#include "server/api_responses.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/sbuf.h"

#define BAD_REQ "invalid_request_error"

/* ---- request ---------------------------------------------------------------------------- */

/* Content of a message item as chat content: a string, or text parts (input_text,
 * output_text, text) as chat's {"type": "text"} parts. */
static json_t *content_of(json_t *c, size_t i, api_error *e) {
    if (json_is_string(c)) return json_incref(c);
    if (!json_is_array(c)) {
        api_fail(e, 400, NULL, "input", NULL, "input[%zu].content must be a string or an array of text parts", i);
        return NULL;
    }
    json_t *parts = json_array(), *p;
    size_t j;
    json_array_foreach(c, j, p) {
        const char *type = json_string_value(json_object_get(p, "type"));
        json_t *text = json_object_get(p, "text");
        if (!type || (strcmp(type, "input_text") && strcmp(type, "output_text") && strcmp(type, "text")) ||
            !json_is_string(text)) {
            api_fail(e, 400, NULL, "input", NULL,
                     "input[%zu].content[%zu]: only input_text / output_text parts with a 'text' string are "
                     "supported (got '%s')", i, j, type ? type : "no type");
            json_decref(parts);
            return NULL;
        }
        json_array_append_new(parts, json_pack("{s:s, s:O}", "type", "text", "text", text));
    }
    return parts;
}

static int need_string(json_t *item, const char *key, size_t i, api_error *e) {
    if (json_is_string(json_object_get(item, key))) return 0;
    return api_fail(e, 400, NULL, "input", NULL, "input[%zu].%s must be a string", i, key);
}

/* One input item appended to the chat messages. */
static int add_item(json_t *msgs, json_t *item, size_t i, int *calls_open, api_error *e) {
    if (!json_is_object(item)) return api_fail(e, 400, NULL, "input", NULL, "input[%zu] must be an object", i);
    const char *type = json_string_value(json_object_get(item, "type"));
    if (!type || !strcmp(type, "message")) {
        *calls_open = 0;
        const char *role = json_string_value(json_object_get(item, "role"));
        if (!role || (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system") &&
                      strcmp(role, "developer")))
            return api_fail(e, 400, NULL, "input", NULL,
                            "input[%zu].role must be one of user, assistant, system, developer", i);
        json_t *content = content_of(json_object_get(item, "content"), i, e);
        if (!content) return -1;
        json_array_append_new(msgs, json_pack("{s:s, s:o}", "role", role, "content", content));
        return 0;
    }
    if (!strcmp(type, "function_call")) {
        if (need_string(item, "call_id", i, e) || need_string(item, "name", i, e) ||
            need_string(item, "arguments", i, e))
            return -1;
        json_t *call = json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", json_object_get(item, "call_id"), "type",
                                 "function", "function", "name", json_object_get(item, "name"), "arguments",
                                 json_object_get(item, "arguments"));
        /* consecutive calls are one assistant turn (parallel calls) */
        json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
        if (*calls_open && last) {
            json_array_append_new(json_object_get(last, "tool_calls"), call);
        } else {
            json_array_append_new(msgs, json_pack("{s:s, s:n, s:[o]}", "role", "assistant", "content", "tool_calls",
                                                  call));
            *calls_open = 1;
        }
        return 0;
    }
    *calls_open = 0;
    if (!strcmp(type, "function_call_output")) {
        if (need_string(item, "call_id", i, e)) return -1;
        json_t *out = json_object_get(item, "output");
        json_t *content = json_is_string(out) ? json_incref(out) : content_of(out, i, e);
        if (!content) return -1;
        json_array_append_new(msgs, json_pack("{s:s, s:O, s:o}", "role", "tool", "tool_call_id",
                                              json_object_get(item, "call_id"), "content", content));
        return 0;
    }
    if (!strcmp(type, "reasoning")) return 0;   /* earlier reasoning is not shown to the model */
    return api_fail(e, 400, NULL, "input", NULL, "input[%zu]: item type '%s' is not supported", i, type);
}

static int map_input(json_t *o, json_t *cb, api_error *e) {
    json_t *msgs = json_array();
    json_object_set_new(cb, "messages", msgs);
    json_t *ins = api_field(o, "instructions");
    if (ins) {
        if (!json_is_string(ins))
            return api_fail(e, 400, NULL, "instructions", NULL, "'instructions' must be a string");
        json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", "system", "content", ins));
    }
    json_t *in = api_field(o, "input");
    if (!in) return api_fail(e, 400, NULL, "input", NULL, "'input' is required");
    if (json_is_string(in)) {
        json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", "user", "content", in));
        return 0;
    }
    if (!json_is_array(in) || !json_array_size(in))
        return api_fail(e, 400, NULL, "input", NULL, "'input' must be a string or a non-empty array of items");
    size_t i;
    json_t *item;
    int calls_open = 0;
    json_array_foreach(in, i, item) if (add_item(msgs, item, i, &calls_open, e)) return -1;
    return 0;
}

/* Function tools {type, name, description, parameters} as chat tools. */
static int map_tools(json_t *o, json_t *cb, api_error *e) {
    json_t *tools = api_field(o, "tools");
    if (tools) {
        if (!json_is_array(tools)) return api_fail(e, 400, NULL, "tools", NULL, "'tools' must be an array");
        json_t *out = json_array(), *t;
        size_t i;
        json_object_set_new(cb, "tools", out);
        json_array_foreach(tools, i, t) {
            const char *type = json_string_value(json_object_get(t, "type"));
            if (!type || strcmp(type, "function"))
                return api_fail(e, 400, NULL, "tools", NULL, "tools[%zu]: only function tools are supported (got '%s')",
                                i, type ? type : "no type");
            if (!json_is_string(json_object_get(t, "name")))
                return api_fail(e, 400, NULL, "tools", NULL, "tools[%zu].name must be a string", i);
            json_t *fn = json_pack("{s:O}", "name", json_object_get(t, "name"));
            if (api_field(t, "description")) json_object_set(fn, "description", json_object_get(t, "description"));
            if (api_field(t, "parameters")) json_object_set(fn, "parameters", json_object_get(t, "parameters"));
            json_array_append_new(out, json_pack("{s:s, s:o}", "type", "function", "function", fn));
        }
    }
    json_t *tc = api_field(o, "tool_choice");
    if (tc && json_is_string(tc)) {
        json_object_set(cb, "tool_choice", tc);
    } else if (tc) {
        const char *type = json_string_value(json_object_get(tc, "type"));
        json_t *name = json_object_get(tc, "name");
        if (!type || strcmp(type, "function") || !json_is_string(name))
            return api_fail(e, 400, NULL, "tool_choice", NULL,
                            "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}");
        json_object_set_new(cb, "tool_choice", json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", name));
    }
    return 0;
}

/* text.format: json_object / json_schema become chat's response_format. */
static int map_text_format(json_t *o, json_t *cb, api_error *e) {
    json_t *text = api_field(o, "text");
    if (!text) return 0;
    json_t *f = api_field(text, "format");
    if (!json_is_object(text) || (f && !json_is_object(f)))
        return api_fail(e, 400, NULL, "text", NULL, "'text' must be an object with an object 'format'");
    const char *type = f ? json_string_value(json_object_get(f, "type")) : NULL;
    if (!f || (type && !strcmp(type, "text"))) return 0;
    if (type && !strcmp(type, "json_object")) {
        json_object_set_new(cb, "response_format", json_pack("{s:s}", "type", "json_object"));
    } else if (type && !strcmp(type, "json_schema")) {
        json_t *js = json_object();
        const char *keys[] = {"name", "schema", "strict"};
        for (int k = 0; k < 3; k++)
            if (api_field(f, keys[k])) json_object_set(js, keys[k], json_object_get(f, keys[k]));
        json_object_set_new(cb, "response_format", json_pack("{s:s, s:o}", "type", "json_schema", "json_schema", js));
    } else {
        return api_fail(e, 400, NULL, "text", NULL, "text.format.type must be 'text', 'json_object' or 'json_schema'");
    }
    return 0;
}

/* Fields that need state the server does not keep, or features it lacks. */
static int refuse_fields(json_t *o, api_error *e) {
    static const char *const stateful[] = {"previous_response_id", "conversation", "prompt", "reasoning"};
    for (size_t i = 0; i < sizeof stateful / sizeof stateful[0]; i++)
        if (api_field(o, stateful[i]))
            return api_fail(e, 400, NULL, stateful[i], NULL,
                            "'%s' is not supported: specd keeps no responses, conversations or prompts, and "
                            "has no reasoning controls; send the whole input each time", stateful[i]);
    if (json_is_true(json_object_get(o, "store")))
        return api_fail(e, 400, NULL, "store", NULL, "'store': true is not supported (specd keeps no responses); "
                        "send 'store': false");
    if (json_is_true(json_object_get(o, "background")))
        return api_fail(e, 400, NULL, "background", NULL, "'background': true is not supported");
    json_t *tr = api_field(o, "truncation");
    if (tr && (!json_is_string(tr) || strcmp(json_string_value(tr), "disabled")))
        return api_fail(e, 400, NULL, "truncation", NULL, "only 'truncation': 'disabled' is supported");
    if (api_field(o, "top_logprobs"))
        return api_fail(e, 400, NULL, "top_logprobs", NULL, "'top_logprobs' is not supported on /v1/responses");
    return 0;
}

/* A chat-field name in an error from the chat parser, as the Responses field it came from. */
static void rename_param(api_error *e) {
    static const char *const map[][2] = {{"messages", "input"}, {"max_tokens", "max_output_tokens"},
                                         {"response_format", "text"}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(e->param, map[i][0])) snprintf(e->param, sizeof e->param, "%s", map[i][1]);
}

api_request *api_resp_parse(const char *body, size_t len, const api_limits *lim, api_error *e) {
    json_t *o = api_parse_body(body, len, e);
    if (!o) return NULL;
    json_t *cb = json_object();
    api_request *r = NULL;
    if (refuse_fields(o, e) || map_input(o, cb, e) || map_tools(o, cb, e) || map_text_format(o, cb, e)) goto done;
    json_t *mo = api_field(o, "max_output_tokens");
    if (mo && (!json_is_integer(mo) || json_integer_value(mo) < 1)) {
        api_fail(e, 400, NULL, "max_output_tokens", NULL, "'max_output_tokens' must be an integer >= 1");
        goto done;
    }
    if (mo) json_object_set(cb, "max_tokens", mo);
    static const char *const same[] = {"model", "temperature", "top_p", "stream", "parallel_tool_calls", "user"};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
        if (json_object_get(o, same[i])) json_object_set(cb, same[i], json_object_get(o, same[i]));
    char *chat = json_dumps(cb, JSON_COMPACT);
    r = chat ? api_parse_request(API_CHAT, chat, strlen(chat), lim, e) : NULL;
    free(chat);
    if (!r) {
        rename_param(e);
        goto done;
    }
    /* what the response object echoes */
    json_t *echo = json_object();
    static const char *const echoed[] = {"instructions", "max_output_tokens", "temperature", "top_p", "tools",
                                         "tool_choice", "parallel_tool_calls", "metadata", "text", "user"};
    for (size_t i = 0; i < sizeof echoed / sizeof echoed[0]; i++)
        json_object_set(echo, echoed[i], json_object_get(o, echoed[i]) ? json_object_get(o, echoed[i]) : json_null());
    if (!api_field(o, "tools")) json_object_set_new(echo, "tools", json_array());
    if (!api_field(o, "tool_choice")) json_object_set_new(echo, "tool_choice", json_string("auto"));
    if (!api_field(o, "parallel_tool_calls")) json_object_set_new(echo, "parallel_tool_calls", json_true());
    if (!api_field(o, "temperature")) json_object_set_new(echo, "temperature", json_real(1.0));
    if (!api_field(o, "top_p")) json_object_set_new(echo, "top_p", json_real(1.0));
    if (!api_field(o, "metadata")) json_object_set_new(echo, "metadata", json_object());
    if (!api_field(o, "text")) json_object_set_new(echo, "text", json_pack("{s:{s:s}}", "format", "type", "text"));
    r->responses = echo;
done:
    json_decref(cb);
    json_decref(o);
    return r;
}

/* ---- output ------------------------------------------------------------------------------ */

enum { ITEM_MESSAGE = 0, ITEM_REASONING };

struct api_rstream {
    char id[64], model[256];
    long long created;
    json_t *echo;
    int seq;
    json_t *output;              /* items so far; open ones are completed at close */
    int text_at, text_kind;      /* the open message / reasoning item (-1: none) */
    char *text;
    size_t tlen, tcap;
    int call_at;                 /* the open function call item (-1: none) */
    int call_of[256];            /* chat tool-call index -> output index (-1: none yet) */
    int n_whole;                 /* whole calls fed (no index) */
};

api_rstream *api_rstream_new(const char *resp_id, long long created, const char *model, json_t *echo) {
    api_rstream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    snprintf(s->id, sizeof s->id, "%s", resp_id);
    snprintf(s->model, sizeof s->model, "%s", model);
    s->created = created;
    s->echo = json_incref(echo);
    s->output = json_array();
    s->text_at = s->call_at = -1;
    for (size_t i = 0; i < sizeof s->call_of / sizeof s->call_of[0]; i++) s->call_of[i] = -1;
    return s;
}

void api_rstream_free(api_rstream *s) {
    if (!s) return;
    json_decref(s->echo);
    json_decref(s->output);
    free(s->text);
    free(s);
}

static void push_ev(api_rstream *s, json_t *ev, json_t *e) {
    json_object_set_new(e, "sequence_number", json_integer(s->seq++));
    if (ev) json_array_append_new(ev, e);
    else json_decref(e);
}

static json_t *response_obj(api_rstream *s, const char *status) {
    json_t *o = json_deep_copy(s->echo ? s->echo : json_object());
    json_object_set_new(o, "id", json_string(s->id));
    json_object_set_new(o, "object", json_string("response"));
    json_object_set_new(o, "created_at", json_integer(s->created));
    json_object_set_new(o, "status", json_string(status));
    json_object_set_new(o, "model", json_string(s->model));
    json_object_set_new(o, "output", json_deep_copy(s->output));
    json_object_set_new(o, "error", json_null());
    json_object_set_new(o, "incomplete_details", json_null());
    json_object_set_new(o, "previous_response_id", json_null());
    json_object_set_new(o, "reasoning", json_null());
    json_object_set_new(o, "store", json_false());
    json_object_set_new(o, "background", json_false());
    json_object_set_new(o, "truncation", json_string("disabled"));
    json_object_set_new(o, "usage", json_null());
    return o;
}

void api_rstream_open(api_rstream *s, json_t *ev) {
    push_ev(s, ev, json_pack("{s:s, s:o}", "type", "response.created", "response", response_obj(s, "in_progress")));
    push_ev(s, ev, json_pack("{s:s, s:o}", "type", "response.in_progress", "response", response_obj(s, "in_progress")));
}

static void make_id(char *buf, size_t cap, const char *prefix) { api_make_id(buf, cap, prefix); }

static const char *part_type(int kind) { return kind == ITEM_MESSAGE ? "output_text" : "reasoning_text"; }

static json_t *text_part(int kind, const char *text, size_t n) {
    json_t *p = json_pack("{s:s, s:s%}", "type", part_type(kind), "text", text ? text : "", text ? n : 0);
    if (kind == ITEM_MESSAGE) {
        json_object_set_new(p, "annotations", json_array());
        json_object_set_new(p, "logprobs", json_array());
    }
    return p;
}

/* Close the open text item; status "incomplete" for the item that max_output_tokens cut
 * (as OpenAI marks it), else "completed". */
static void close_text(api_rstream *s, json_t *ev, const char *status) {
    if (s->text_at < 0) return;
    json_t *item = json_array_get(s->output, (size_t)s->text_at);
    const char *iid = json_string_value(json_object_get(item, "id"));
    int kind = s->text_kind;
    push_ev(s, ev, json_pack("{s:s, s:s, s:i, s:i, s:s%}", "type",
                             kind == ITEM_MESSAGE ? "response.output_text.done" : "response.reasoning_text.done",
                             "item_id", iid, "output_index", s->text_at, "content_index", 0, "text",
                             s->text ? s->text : "", s->tlen));
    push_ev(s, ev, json_pack("{s:s, s:s, s:i, s:i, s:o}", "type", "response.content_part.done", "item_id", iid,
                             "output_index", s->text_at, "content_index", 0, "part", text_part(kind, s->text, s->tlen)));
    json_object_set_new(item, "content", json_pack("[o]", text_part(kind, s->text, s->tlen)));
    json_object_set_new(item, "status", json_string(status));
    push_ev(s, ev, json_pack("{s:s, s:i, s:O}", "type", "response.output_item.done", "output_index", s->text_at,
                             "item", item));
    s->text_at = -1;
    s->tlen = 0;
}

static void close_call(api_rstream *s, json_t *ev, const char *status) {
    if (s->call_at < 0) return;
    json_t *item = json_array_get(s->output, (size_t)s->call_at);
    push_ev(s, ev, json_pack("{s:s, s:O, s:i, s:O, s:O}", "type", "response.function_call_arguments.done", "item_id",
                             json_object_get(item, "id"), "output_index", s->call_at, "arguments",
                             json_object_get(item, "arguments"), "name", json_object_get(item, "name")));
    json_object_set_new(item, "status", json_string(status));
    push_ev(s, ev, json_pack("{s:s, s:i, s:O}", "type", "response.output_item.done", "output_index", s->call_at,
                             "item", item));
    s->call_at = -1;
}

static void add_text(api_rstream *s, int kind, const char *t, size_t n, json_t *ev) {
    if (!n) return;
    if (s->text_at >= 0 && s->text_kind != kind) close_text(s, ev, "completed");
    close_call(s, ev, "completed");
    if (s->text_at < 0) {
        char iid[64];
        make_id(iid, sizeof iid, kind == ITEM_MESSAGE ? "msg_" : "rs_");
        json_t *item = kind == ITEM_MESSAGE
                           ? json_pack("{s:s, s:s, s:s, s:s, s:[]}", "id", iid, "type", "message", "status",
                                       "in_progress", "role", "assistant", "content")
                           : json_pack("{s:s, s:s, s:[], s:[]}", "id", iid, "type", "reasoning", "summary", "content");
        s->text_at = (int)json_array_size(s->output);
        s->text_kind = kind;
        json_array_append_new(s->output, item);
        push_ev(s, ev, json_pack("{s:s, s:i, s:O}", "type", "response.output_item.added", "output_index", s->text_at,
                                 "item", item));
        push_ev(s, ev, json_pack("{s:s, s:s, s:i, s:i, s:o}", "type", "response.content_part.added", "item_id", iid,
                                 "output_index", s->text_at, "content_index", 0, "part", text_part(kind, "", 0)));
    }
    if (sbuf_append(&s->text, &s->tlen, &s->tcap, t, n)) return;
    json_t *item = json_array_get(s->output, (size_t)s->text_at);
    json_t *d = json_pack("{s:s, s:O, s:i, s:i, s:s%}", "type",
                          kind == ITEM_MESSAGE ? "response.output_text.delta" : "response.reasoning_text.delta",
                          "item_id", json_object_get(item, "id"), "output_index", s->text_at, "content_index", 0,
                          "delta", t, n);
    if (kind == ITEM_MESSAGE) json_object_set_new(d, "logprobs", json_array());
    push_ev(s, ev, d);
}

/* One tool-call entry of a chat delta (streamed: index, then id / name / argument
 * fragments; whole: no index). */
static void add_call(api_rstream *s, json_t *tc, json_t *ev) {
    json_t *ix = json_object_get(tc, "index"), *fn = json_object_get(tc, "function");
    int idx = json_is_integer(ix) ? (int)json_integer_value(ix) : 0;
    int whole = !ix;
    if (idx < 0 || idx >= (int)(sizeof s->call_of / sizeof s->call_of[0])) return;
    int *at = whole ? NULL : &s->call_of[idx];
    if (whole || *at < 0) {
        close_text(s, ev, "completed");
        close_call(s, ev, "completed");
        char iid[64], cid[64];
        make_id(iid, sizeof iid, "fc_");
        const char *id = json_string_value(json_object_get(tc, "id"));
        if (!id) make_id(cid, sizeof cid, "call_");
        const char *name = json_string_value(json_object_get(fn, "name"));
        json_t *item = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "id", iid, "type", "function_call", "status",
                                 "in_progress", "call_id", id ? id : cid, "name", name ? name : "", "arguments", "");
        s->call_at = (int)json_array_size(s->output);
        if (at) *at = s->call_at;
        else s->n_whole++;
        json_array_append_new(s->output, item);
        push_ev(s, ev, json_pack("{s:s, s:i, s:O}", "type", "response.output_item.added", "output_index", s->call_at,
                                 "item", item));
    }
    json_t *args = json_object_get(fn, "arguments");
    const char *frag = json_string_value(args);
    if (!frag || !*frag || s->call_at < 0) return;
    json_t *item = json_array_get(s->output, (size_t)s->call_at);
    const char *old = json_string_value(json_object_get(item, "arguments"));
    size_t on = strlen(old), fnn = strlen(frag);
    char *joined = malloc(on + fnn + 1);
    if (!joined) return;
    memcpy(joined, old, on);
    memcpy(joined + on, frag, fnn + 1);
    json_object_set_new(item, "arguments", json_stringn(joined, on + fnn));
    free(joined);
    push_ev(s, ev, json_pack("{s:s, s:O, s:i, s:s}", "type", "response.function_call_arguments.delta", "item_id",
                             json_object_get(item, "id"), "output_index", s->call_at, "delta", frag));
}

void api_rstream_feed(api_rstream *s, json_t *delta, json_t *ev) {
    json_t *r = json_object_get(delta, "reasoning_content"), *c = json_object_get(delta, "content");
    if (json_is_string(r)) add_text(s, ITEM_REASONING, json_string_value(r), json_string_length(r), ev);
    if (json_is_string(c)) add_text(s, ITEM_MESSAGE, json_string_value(c), json_string_length(c), ev);
    json_t *calls = json_object_get(delta, "tool_calls"), *tc;
    size_t i;
    json_array_foreach(calls, i, tc) add_call(s, tc, ev);
}

json_t *api_rstream_close(api_rstream *s, const char *finish, int input_tokens, int output_tokens, json_t *ev) {
    if (!json_array_size(s->output)) {   /* no output at all: an empty message, as OpenAI */
        char iid[64];
        make_id(iid, sizeof iid, "msg_");
        json_array_append_new(s->output, json_pack("{s:s, s:s, s:s, s:s, s:[]}", "id", iid, "type", "message",
                                                   "status", "in_progress", "role", "assistant", "content"));
        s->text_at = 0;
        s->text_kind = ITEM_MESSAGE;
        push_ev(s, ev, json_pack("{s:s, s:i, s:O}", "type", "response.output_item.added", "output_index", 0, "item",
                                 json_array_get(s->output, 0)));
        push_ev(s, ev, json_pack("{s:s, s:s, s:i, s:i, s:o}", "type", "response.content_part.added", "item_id", iid,
                                 "output_index", 0, "content_index", 0, "part", text_part(ITEM_MESSAGE, "", 0)));
    }
    int incomplete = finish && !strcmp(finish, "length");
    const char *last = incomplete ? "incomplete" : "completed";   /* only an open item was cut */
    close_text(s, ev, last);
    close_call(s, ev, last);
    json_t *o = response_obj(s, incomplete ? "incomplete" : "completed");
    if (incomplete)
        json_object_set_new(o, "incomplete_details", json_pack("{s:s}", "reason", "max_output_tokens"));
    json_object_set_new(o, "usage", json_pack("{s:i, s:{s:i}, s:i, s:{s:i}, s:i}", "input_tokens", input_tokens,
                                              "input_tokens_details", "cached_tokens", 0, "output_tokens",
                                              output_tokens, "output_tokens_details", "reasoning_tokens", 0,
                                              "total_tokens", input_tokens + output_tokens));
    push_ev(s, ev, json_pack("{s:s, s:O}", "type", incomplete ? "response.incomplete" : "response.completed",
                             "response", o));
    return o;
}

char *api_rstream_sse(json_t *event, size_t *len) {
    char *body = json_dumps(event, JSON_COMPACT);
    if (!body) return NULL;
    const char *type = json_string_value(json_object_get(event, "type"));
    size_t n = strlen(body), tn = type ? strlen(type) : 0;
    char *out = malloc(n + tn + 20);
    if (out) *len = (size_t)sprintf(out, "event: %s\ndata: %s\n\n", type ? type : "message", body);
    free(body);
    return out;
}
