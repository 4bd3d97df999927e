/* OpenAI API JSON: request validation and response building (see api.h for the policy).
 *
 * Validators return 0 (field absent or null: keep the default), 1 (value set) or -1 (an
 * api_error was filled); callers propagate -1 with `if (rc < 0) goto fail`. */
#include "server/api.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <time.h>
#include <utf8proc.h>

#define BAD_REQ "invalid_request_error"

int api_fail(api_error *e, int status, const char *type, const char *param, const char *code,
             const char *fmt, ...) {
    e->status = status;
    e->type = type ? type : BAD_REQ;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    /* Messages echo client input and may be cut at sizeof message, possibly inside a
     * UTF-8 character; JSON strings must be valid UTF-8, so bad bytes become '?'. */
    size_t len = strlen(e->message);
    for (size_t i = 0; i < len;) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)e->message + i,
                                              (utf8proc_ssize_t)(len - i), &cp);
        if (n <= 0) {
            e->message[i++] = '?';
        } else {
            i += (size_t)n;
        }
    }
    return -1;
}

json_t *api_error_json(const api_error *e) {
    json_t *err = json_object();
    json_object_set_new(err, "message", json_string(e->message));
    json_object_set_new(err, "type", json_string(e->type ? e->type : BAD_REQ));
    json_object_set_new(err, "param", e->param[0] ? json_string(e->param) : json_null());
    json_object_set_new(err, "code", e->code ? json_string(e->code) : json_null());
    return json_pack("{s:o}", "error", err);
}

/* ---- field readers -------------------------------------------------------------------- */

json_t *api_field(json_t *o, const char *name) {
    json_t *v = json_object_get(o, name);
    return v && !json_is_null(v) ? v : NULL;
}

static int as_integer(json_t *v, long long *out) {
    if (json_is_integer(v)) { *out = json_integer_value(v); return 1; }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d == floor(d) && fabs(d) < 9.0e15) { *out = (long long)d; return 1; }
    }
    return 0;
}

static int get_int(json_t *o, const char *name, long long lo, long long hi, long long *out,
                   api_error *e) {
    json_t *v = api_field(o, name);
    if (!v) return 0;
    long long x;
    if (!as_integer(v, &x)) return api_fail(e, 400, NULL, name, NULL, "'%s' must be an integer", name);
    if (x < lo || x > hi)
        return api_fail(e, 400, NULL, name, NULL, "'%s' must be in [%lld, %lld], got %lld", name,
                        lo, hi, x);
    *out = x;
    return 1;
}

/* lo_open: the lower bound is exclusive. */
static int get_num(json_t *o, const char *name, double lo, int lo_open, double hi, double *out,
                   api_error *e) {
    json_t *v = api_field(o, name);
    if (!v) return 0;
    if (!json_is_number(v)) return api_fail(e, 400, NULL, name, NULL, "'%s' must be a number", name);
    double x = json_number_value(v);
    if (!(lo_open ? x > lo : x >= lo) || !(x <= hi))
        return api_fail(e, 400, NULL, name, NULL, "'%s' must be in %c%g, %g], got %g", name,
                        lo_open ? '(' : '[', lo, hi, x);
    *out = x;
    return 1;
}

static int get_bool(json_t *o, const char *name, int *out, api_error *e) {
    json_t *v = api_field(o, name);
    if (!v) return 0;
    if (!json_is_boolean(v)) return api_fail(e, 400, NULL, name, NULL, "'%s' must be a boolean", name);
    *out = json_is_true(v);
    return 1;
}

json_t *api_parse_body(const char *body, size_t len, api_error *e) {
    json_error_t je;
    json_t *root = json_loadb(body, len, 0, &je);
    if (!root) {
        api_fail(e, 400, NULL, NULL, NULL, "request body is not valid JSON: %s (line %d, column %d)",
                 je.text, je.line, je.column);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        api_fail(e, 400, NULL, NULL, NULL, "request body must be a JSON object");
        return NULL;
    }
    return root;
}

/* ---- prompts and messages --------------------------------------------------------------- */

static int parse_ids(json_t *arr, int vocab, const char *param, api_prompt *p, api_error *e) {
    size_t n = json_array_size(arr), i;
    json_t *v;
    if (!n) return api_fail(e, 400, NULL, param, NULL, "'%s' must not be empty", param);
    p->ids = malloc(n * sizeof *p->ids);
    if (!p->ids) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    json_array_foreach(arr, i, v) {
        long long x;
        if (!json_is_integer(v) || (x = json_integer_value(v)) < 0 || x >= vocab)
            return api_fail(e, 400, NULL, param, NULL,
                            "'%s' token ids must be integers in [0, %d); element %zu is not", param,
                            vocab, i);
        p->ids[i] = (int32_t)x;
    }
    p->n_ids = (int)n;
    return 0;
}

static int set_text_prompt(api_prompt *p, json_t *s, api_error *e) {
    p->text_len = json_string_length(s);
    p->text = malloc(p->text_len + 1);
    if (!p->text) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    memcpy(p->text, json_string_value(s), p->text_len + 1);
    return 0;
}

static int parse_prompt(json_t *o, const api_limits *lim, api_request *r, api_error *e) {
    json_t *pr = json_object_get(o, "prompt");
    if (!pr || json_is_null(pr)) return api_fail(e, 400, NULL, "prompt", NULL, "'prompt' is required");
    if (json_is_string(pr)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        r->n_prompts = 1;
        return set_text_prompt(&r->prompts[0], pr, e);
    }
    if (!json_is_array(pr) || !json_array_size(pr))
        return api_fail(e, 400, NULL, "prompt", NULL,
                        "'prompt' must be a string, an array of strings, an array of token ids "
                        "or an array of token-id arrays (non-empty)");
    json_t *first = json_array_get(pr, 0);
    if (json_is_integer(first)) {  /* one prompt of token ids */
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        r->n_prompts = 1;
        return parse_ids(pr, lim->vocab, "prompt", &r->prompts[0], e);
    }
    size_t n = json_array_size(pr), i;
    if (n > API_MAX_CHOICES)
        return api_fail(e, 400, NULL, "prompt", NULL, "at most %d prompts per request", API_MAX_CHOICES);
    r->prompts = calloc(n, sizeof *r->prompts);
    if (!r->prompts) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    r->n_prompts = (int)n;
    json_t *v;
    json_array_foreach(pr, i, v) {
        if (json_is_string(v) && json_is_string(first)) {
            if (set_text_prompt(&r->prompts[i], v, e)) return -1;
        } else if (json_is_array(v) && json_is_array(first)) {
            if (parse_ids(v, lim->vocab, "prompt", &r->prompts[i], e)) return -1;
        } else {
            return api_fail(e, 400, NULL, "prompt", NULL,
                            "'prompt' array elements must all be strings or all be token-id arrays "
                            "(element %zu is not)", i);
        }
    }
    return 0;
}

static int valid_role(const char *r) {
    static const char *roles[] = {"system", "user", "assistant", "tool", "developer"};
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
        if (!strcmp(r, roles[i])) return 1;
    return 0;
}

/* Text parts joined with "\n" (what vLLM does for string-content templates). */
static json_t *join_parts(json_t *parts, size_t mi, api_error *e) {
    size_t total = 0, i;
    json_t *p;
    json_array_foreach(parts, i, p) {
        json_t *type = json_object_get(p, "type"), *text = json_object_get(p, "text");
        if (!json_is_object(p) || !json_is_string(type)) {
            api_fail(e, 400, NULL, "messages", NULL,
                     "messages[%zu].content[%zu] must be an object with a 'type'", mi, i);
            return NULL;
        }
        if (strcmp(json_string_value(type), "text")) {
            api_fail(e, 400, NULL, "messages", NULL,
                     "messages[%zu].content[%zu]: content part type '%s' is not supported (only 'text')",
                     mi, i, json_string_value(type));
            return NULL;
        }
        if (!json_is_string(text)) {
            api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].content[%zu].text must be a string", mi, i);
            return NULL;
        }
        total += json_string_length(text) + 1;
    }
    char *buf = malloc(total + 1);
    if (!buf) { api_fail(e, 500, "server_error", NULL, NULL, "out of memory"); return NULL; }
    size_t n = 0;
    json_array_foreach(parts, i, p) {
        json_t *text = json_object_get(p, "text");
        if (i) buf[n++] = '\n';
        memcpy(buf + n, json_string_value(text), json_string_length(text));
        n += json_string_length(text);
    }
    json_t *s = json_stringn(buf, n);
    free(buf);
    return s;
}

/* An assistant message's tool_calls as templates expect them: function.arguments, a JSON
 * string from OpenAI clients, becomes the value it encodes (as HF and vLLM pass it); a
 * string that is not JSON stays a string. null or [] tool_calls are dropped, so a
 * template's `'tool_calls' in message` sees none. */
static int normalize_tool_calls(json_t *m, size_t mi, api_error *e) {
    json_t *calls = json_object_get(m, "tool_calls");
    if (!calls) return 0;
    if (json_is_null(calls) || (json_is_array(calls) && !json_array_size(calls))) {
        json_object_del(m, "tool_calls");
        return 0;
    }
    if (!json_is_array(calls))
        return api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].tool_calls must be an array", mi);
    size_t i;
    json_t *tc;
    json_array_foreach(calls, i, tc) {
        json_t *fn = json_object_get(tc, "function");
        if (!json_is_object(tc) || !json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
            return api_fail(e, 400, NULL, "messages", NULL,
                            "messages[%zu].tool_calls[%zu] must be an object with function.name", mi, i);
        json_t *args = json_object_get(fn, "arguments");
        if (!json_is_string(args)) continue;
        json_t *v = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, NULL);
        if (v) json_object_set_new(fn, "arguments", v);
    }
    return 0;
}

json_t *api_normalize_messages(json_t *messages, api_error *e) {
    if (!messages || json_is_null(messages)) {
        api_fail(e, 400, NULL, "messages", NULL, "'messages' is required");
        return NULL;
    }
    if (!json_is_array(messages) || !json_array_size(messages)) {
        api_fail(e, 400, NULL, "messages", NULL, "'messages' must be a non-empty array");
        return NULL;
    }
    json_t *out = json_array(), *m;
    size_t i;
    json_array_foreach(messages, i, m) {
        if (!json_is_object(m)) {
            api_fail(e, 400, NULL, "messages", NULL, "messages[%zu] must be an object", i);
            goto fail;
        }
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role) || !valid_role(json_string_value(role))) {
            api_fail(e, 400, NULL, "messages", NULL,
                     "messages[%zu].role must be one of system, user, assistant, tool, developer", i);
            goto fail;
        }
        json_t *c = json_object_get(m, "content"), *content;
        if (json_is_string(c)) content = json_incref(c);
        else if (json_is_array(c)) {
            if (!(content = join_parts(c, i, e))) goto fail;
        } else if ((!c || json_is_null(c)) && !strcmp(json_string_value(role), "assistant")) {
            /* An assistant turn that only carries tool_calls: templates concatenate
             * content, so it renders as "" (what vLLM passes for a null content). */
            content = json_string("");
        } else {
            api_fail(e, 400, NULL, "messages", NULL,
                     "messages[%zu].content must be a string or an array of text parts", i);
            goto fail;
        }
        json_t *name = json_object_get(m, "name");
        if (name && !json_is_string(name) && !json_is_null(name)) {
            json_decref(content);
            api_fail(e, 400, NULL, "messages", NULL, "messages[%zu].name must be a string", i);
            goto fail;
        }
        json_t *copy = json_deep_copy(m);
        json_object_set_new(copy, "content", content);
        if (normalize_tool_calls(copy, i, e)) {
            json_decref(copy);
            goto fail;
        }
        json_array_append_new(out, copy);
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* ---- the common sampling fields ----------------------------------------------------------- */

static int parse_stop(json_t *o, api_request *r, api_error *e) {
    json_t *v = api_field(o, "stop");
    if (!v) return 0;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > API_MAX_STOP)
            return api_fail(e, 400, NULL, "stop", NULL, "'stop' may hold at most %d strings", API_MAX_STOP);
        items = NULL;
    } else if (!json_is_string(v)) {
        return api_fail(e, 400, NULL, "stop", NULL, "'stop' must be a string or an array of strings");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = items ? items[i] : json_array_get(v, i);
        if (!json_is_string(s))
            return api_fail(e, 400, NULL, "stop", NULL, "'stop' must be a string or an array of strings");
        size_t len = json_string_length(s);
        if (!len) continue;  /* OpenAI ignores empty stop strings */
        if (len > API_MAX_STOP_LEN || memchr(json_string_value(s), 0, len))
            return api_fail(e, 400, NULL, "stop", NULL, "stop strings must be at most %d bytes", API_MAX_STOP_LEN);
        r->stop[r->n_stop] = strdup(json_string_value(s));
        if (!r->stop[r->n_stop]) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        r->n_stop++;
    }
    return 1;
}

static int parse_logit_bias(json_t *o, const api_limits *lim, api_request *r, api_error *e) {
    json_t *v = api_field(o, "logit_bias");
    if (!v) return 0;
    if (!json_is_object(v))
        return api_fail(e, 400, NULL, "logit_bias", NULL, "'logit_bias' must be an object of token id -> bias");
    if (json_object_size(v) > API_MAX_LOGIT_BIAS)
        return api_fail(e, 400, NULL, "logit_bias", NULL, "'logit_bias' may hold at most %d entries", API_MAX_LOGIT_BIAS);
    const char *k;
    json_t *b;
    json_object_foreach(v, k, b) {
        char *end;
        long id = strtol(k, &end, 10);
        if (!*k || *end || id < 0 || id >= lim->vocab)
            return api_fail(e, 400, NULL, "logit_bias", NULL,
                            "logit_bias key '%s' is not a token id in [0, %d)", k, lim->vocab);
        if (!json_is_number(b) || json_number_value(b) < -100 || json_number_value(b) > 100)
            return api_fail(e, 400, NULL, "logit_bias", NULL,
                            "logit_bias['%s'] must be a number in [-100, 100]", k);
        r->bias_ids[r->sp.n_logit_bias] = (int32_t)id;
        r->bias_vals[r->sp.n_logit_bias] = (float)json_number_value(b);
        r->sp.n_logit_bias++;
    }
    r->sp.logit_bias_ids = r->bias_ids;
    r->sp.logit_bias_vals = r->bias_vals;
    return 1;
}

/* Fields we know but do not implement: refuse rather than silently ignore. */
static int parse_unsupported(json_t *o, const api_request *r, api_error *e) {
    json_t *v = api_field(o, "suffix");
    if (v && (!json_is_string(v) || json_string_length(v)))
        return api_fail(e, 400, NULL, "suffix", NULL, "'suffix' is not supported");
    long long best_of = 0;
    if (get_int(o, "best_of", 1, 128, &best_of, e) < 0) return -1;
    if (best_of > 1 && best_of != r->n)   /* ranking candidates by logprob is not done */
        return api_fail(e, 400, NULL, "best_of", NULL, "'best_of' other than 1 or n is not supported");
    int b = 0;
    if (get_bool(o, "continue_final_message", &b, e) < 0) return -1;
    if (b) return api_fail(e, 400, NULL, "continue_final_message", NULL, "'continue_final_message' is not supported");
    return 0;
}

static int parse_common(json_t *o, const api_limits *lim, api_request *r, api_error *e) {
    json_t *m = json_object_get(o, "model");
    if (m && !json_is_null(m)) {
        if (!json_is_string(m)) return api_fail(e, 400, NULL, "model", NULL, "'model' must be a string");
        if (strcmp(json_string_value(m), lim->served_model))
            return api_fail(e, 404, BAD_REQ, "model", "model_not_found",
                            "The model '%s' does not exist (this server serves '%s')",
                            json_string_value(m), lim->served_model);
    }
    long long x;
    double d;
    int rc, b;
    /* completions' max_tokens may be 0: the prompt only (its logprobs with echo) */
    int min_out = r->kind == API_COMPLETION ? 0 : 1;
    if ((rc = get_int(o, "max_tokens", min_out, 1 << 24, &x, e)) < 0) return -1;
    if (rc) r->max_tokens = (int)x;
    if ((rc = get_int(o, "max_completion_tokens", 1, 1 << 24, &x, e)) < 0) return -1;
    if (rc) r->max_tokens = (int)x;
    if ((rc = get_num(o, "temperature", 0, 0, 2, &d, e)) < 0) return -1;
    if (rc) r->sp.temperature = (float)d;
    if ((rc = get_num(o, "top_p", 0, 1, 1, &d, e)) < 0) return -1;
    if (rc) r->sp.top_p = (float)d;
    if ((rc = get_int(o, "top_k", -1, 1 << 30, &x, e)) < 0) return -1;
    if (rc) r->sp.top_k = x < 0 ? 0 : (int)x;
    if ((rc = get_num(o, "min_p", 0, 0, 1, &d, e)) < 0) return -1;
    if (rc) r->sp.min_p = (float)d;
    if ((rc = get_int(o, "seed", INT64_MIN, INT64_MAX, &x, e)) < 0) return -1;
    if (rc) r->sp.seed = (uint64_t)x, r->sp.has_seed = 1;
    if ((rc = get_int(o, "n", 1, lim->max_n, &x, e)) < 0) return -1;
    if (rc) r->n = (int)x;
    if ((rc = get_num(o, "presence_penalty", -2, 0, 2, &d, e)) < 0) return -1;
    if (rc) r->sp.presence_penalty = (float)d;
    if ((rc = get_num(o, "frequency_penalty", -2, 0, 2, &d, e)) < 0) return -1;
    if (rc) r->sp.frequency_penalty = (float)d;
    if ((rc = get_num(o, "repetition_penalty", 0, 1, 1e3, &d, e)) < 0) return -1;
    if (rc) r->sp.repetition_penalty = (float)d;
    if ((rc = get_int(o, "min_tokens", 0, 1 << 24, &x, e)) < 0) return -1;
    if (rc) r->sp.min_tokens = (int)x;
    if ((rc = get_bool(o, "ignore_eos", &b, e)) < 0) return -1;
    if (rc) r->sp.ignore_eos = b;
    if ((rc = get_bool(o, "skip_special_tokens", &b, e)) < 0) return -1;
    if (rc) r->skip_special = b;
    if (get_bool(o, "stream", &r->stream, e) < 0) return -1;
    json_t *so = api_field(o, "stream_options");
    if (so) {
        if (!json_is_object(so))
            return api_fail(e, 400, NULL, "stream_options", NULL, "'stream_options' must be an object");
        if (!r->stream)
            return api_fail(e, 400, NULL, "stream_options", NULL, "'stream_options' is only allowed when 'stream' is true");
        if (get_bool(so, "include_usage", &r->include_usage, e) < 0) {
            snprintf(e->param, sizeof e->param, "stream_options");
            return -1;
        }
    }
    json_t *u = api_field(o, "user");
    if (u && !json_is_string(u)) return api_fail(e, 400, NULL, "user", NULL, "'user' must be a string");
    if ((rc = get_int(o, "prompt_logprobs", 0, API_MAX_TOP_LOGPROBS, &x, e)) < 0) return -1;
    if (rc) r->prompt_logprobs = (int)x;
    if (r->prompt_logprobs >= 0 && r->stream)
        return api_fail(e, 400, NULL, "prompt_logprobs", NULL, "'prompt_logprobs' is not supported with 'stream'");
    if (parse_stop(o, r, e) < 0 || parse_logit_bias(o, lim, r, e) < 0) return -1;
    if (r->sp.min_tokens && r->max_tokens >= 0 && r->sp.min_tokens > r->max_tokens)
        return api_fail(e, 400, NULL, "min_tokens", NULL, "'min_tokens' must not exceed 'max_tokens'");
    if ((long long)r->n * (r->n_prompts ? r->n_prompts : 1) > API_MAX_CHOICES)
        return api_fail(e, 400, NULL, "n", NULL, "prompts x n must be at most %d", API_MAX_CHOICES);
    if (api_parse_constraint(o, lim, r, e) < 0) return -1;
    return parse_unsupported(o, r, e);
}

/* tool_choice and parallel_tool_calls (after tools). A named function must be one of the
 * tools; "required" and a named function need tools. */
static int parse_tool_choice(json_t *o, api_request *r, api_error *e) {
    if (get_bool(o, "parallel_tool_calls", &r->parallel_tool_calls, e) < 0) return -1;
    json_t *tc = api_field(o, "tool_choice");
    if (!tc) return 0;
    const char *v = json_string_value(tc);
    if (v) {
        if (!strcmp(v, "auto")) r->tool_choice = API_TOOL_AUTO;
        else if (!strcmp(v, "none")) r->tool_choice = API_TOOL_NONE;
        else if (!strcmp(v, "required")) r->tool_choice = API_TOOL_REQUIRED;
        else
            return api_fail(e, 400, NULL, "tool_choice", NULL, "tool_choice must be 'auto', 'none', 'required' or "
                            "an object naming a function, got '%s'", v);
    } else {
        json_t *fn = json_object_get(tc, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!json_is_object(tc) || !name)
            return api_fail(e, 400, NULL, "tool_choice", NULL, "'tool_choice' must be a string or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}");
        if (strlen(name) >= sizeof r->tool_name)
            return api_fail(e, 400, NULL, "tool_choice", NULL, "tool_choice function name is too long");
        r->tool_choice = API_TOOL_NAMED;
        snprintf(r->tool_name, sizeof r->tool_name, "%s", name);
        size_t i;
        json_t *t;
        int found = 0;
        json_array_foreach(r->tools, i, t) {
            const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
            found |= n && !strcmp(n, name);
        }
        if (!found)
            return api_fail(e, 400, NULL, "tool_choice", NULL, "tool_choice names function '%s', which is not in 'tools'",
                            name);
    }
    if ((r->tool_choice == API_TOOL_REQUIRED || r->tool_choice == API_TOOL_NAMED) && !r->tools)
        return api_fail(e, 400, NULL, "tool_choice", NULL, "tool_choice '%s' needs 'tools'", v ? v : r->tool_name);
    return 0;
}

static int parse_chat(json_t *o, api_request *r, api_error *e) {
    if (!(r->messages = api_normalize_messages(json_object_get(o, "messages"), e))) return -1;
    json_t *t = api_field(o, "tools");
    if (t) {
        if (!json_is_array(t)) return api_fail(e, 400, NULL, "tools", NULL, "'tools' must be an array");
        size_t i;
        json_t *tool;
        json_array_foreach(t, i, tool)
            if (!json_is_object(tool))
                return api_fail(e, 400, NULL, "tools", NULL, "tools[%zu] must be an object", i);
        if (json_array_size(t)) r->tools = json_incref(t);
    }
    if (parse_tool_choice(o, r, e) < 0) return -1;
    json_t *k = api_field(o, "chat_template_kwargs");
    if (k) {
        if (!json_is_object(k))
            return api_fail(e, 400, NULL, "chat_template_kwargs", NULL, "'chat_template_kwargs' must be an object");
        r->chat_template_kwargs = json_incref(k);
    }
    if (get_bool(o, "add_generation_prompt", &r->add_generation_prompt, e) < 0) return -1;
    int lp = 0;
    long long top = -1;
    if (get_bool(o, "logprobs", &lp, e) < 0) return -1;
    if (get_int(o, "top_logprobs", 0, API_MAX_TOP_LOGPROBS, &top, e) < 0) return -1;
    if (top >= 0 && !lp)
        return api_fail(e, 400, NULL, "top_logprobs", NULL, "'top_logprobs' requires 'logprobs': true");
    r->logprobs = lp ? (top > 0 ? (int)top : 0) : -1;
    return 0;
}

static int parse_completion(json_t *o, const api_limits *lim, api_request *r, api_error *e) {
    if (parse_prompt(o, lim, r, e)) return -1;
    long long lp;
    int rc = get_int(o, "logprobs", 0, API_MAX_TOP_LOGPROBS, &lp, e);
    if (rc < 0) return -1;
    if (rc) r->logprobs = (int)lp;
    if (get_bool(o, "echo", &r->echo, e) < 0) return -1;
    return 0;
}

api_request *api_parse_request(api_kind kind, const char *body, size_t len,
                               const api_limits *lim, api_error *e) {
    json_t *o = api_parse_body(body, len, e);
    if (!o) return NULL;
    api_request *r = calloc(1, sizeof *r);
    if (!r) {
        api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        json_decref(o);
        return NULL;
    }
    r->kind = kind;
    r->n = 1;
    r->max_tokens = -1;
    r->logprobs = -1;
    r->prompt_logprobs = -1;
    r->add_generation_prompt = 1;
    r->parallel_tool_calls = 1;
    r->skip_special = 1;
    engine_sampling_defaults(&r->sp);
    r->sp.temperature = 1.0f;  /* OpenAI's default */
    r->sp.logprobs = -1;
    int rc = kind == API_CHAT ? parse_chat(o, r, e) : parse_completion(o, lim, r, e);
    if (!rc) rc = parse_common(o, lim, r, e);
    json_decref(o);
    if (rc) {
        api_request_free(r);
        return NULL;
    }
    r->sp.logprobs = r->logprobs;
    r->sp.prompt_logprobs = r->echo && r->logprobs > r->prompt_logprobs ? r->logprobs : r->prompt_logprobs;
    return r;
}

void api_request_free(api_request *r) {
    if (!r) return;
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    json_decref(r->messages);
    json_decref(r->tools);
    json_decref(r->chat_template_kwargs);
    json_decref(r->responses);
    grammar_unref(r->sp.grammar);
    free(r);
}

int api_check_length(int n_prompt, int max_tokens, int max_seq_len, int prompt_index, api_error *e) {
    if (n_prompt <= 0)
        return api_fail(e, 400, NULL, "prompt", NULL, "the prompt is empty (prompt %d)", prompt_index);
    if (n_prompt + 1 > max_seq_len)
        return api_fail(e, 400, NULL, "prompt", "context_length_exceeded",
                        "This model's maximum context length is %d tokens; the prompt has %d tokens "
                        "(prompt %d), leaving no room for output", max_seq_len, n_prompt, prompt_index);
    if (max_tokens > 0 && (long long)n_prompt + max_tokens > max_seq_len)
        return api_fail(e, 400, NULL, "max_tokens", "context_length_exceeded",
                        "This model's maximum context length is %d tokens; you requested %d tokens "
                        "(%d in the prompt, %d for the completion)", max_seq_len,
                        n_prompt + max_tokens, n_prompt, max_tokens);
    return 0;
}

int api_default_max_tokens(api_kind kind, int n_prompt, int max_seq_len) {
    int room = max_seq_len - n_prompt;
    if (kind == API_COMPLETION) return room < 16 ? room : 16;
    return room;
}

json_t *api_parse_tokenize(const char *body, size_t len, api_error *e) {
    json_t *o = api_parse_body(body, len, e);
    if (!o) return NULL;
    json_t *p = api_field(o, "prompt"), *m = api_field(o, "messages");
    int b;
    if ((!p) == (!m)) {
        api_fail(e, 400, NULL, "prompt", NULL, "give exactly one of 'prompt' (string) or 'messages'");
        goto fail;
    }
    if (p && !json_is_string(p)) {
        api_fail(e, 400, NULL, "prompt", NULL, "'prompt' must be a string");
        goto fail;
    }
    if (m) {
        json_t *norm = api_normalize_messages(m, e);
        if (!norm) goto fail;
        json_object_set_new(o, "messages", norm);
    }
    if (get_bool(o, "add_special_tokens", &b, e) < 0 || get_bool(o, "add_generation_prompt", &b, e) < 0)
        goto fail;
    return o;
fail:
    json_decref(o);
    return NULL;
}

json_t *api_parse_detokenize(const char *body, size_t len, int vocab, api_error *e) {
    json_t *o = api_parse_body(body, len, e);
    if (!o) return NULL;
    json_t *t = json_object_get(o, "tokens");
    api_prompt p = {0};
    if (!json_is_array(t)) {
        api_fail(e, 400, NULL, "tokens", NULL, "'tokens' must be an array of token ids");
        goto fail;
    }
    if (json_array_size(t) && parse_ids(t, vocab, "tokens", &p, e)) goto fail;
    free(p.ids);
    return o;
fail:
    free(p.ids);
    json_decref(o);
    return NULL;
}

/* ---- stop strings ------------------------------------------------------------------------- */

int api_stop_scan(const char *text, size_t len, char *const *stops, int n_stops, size_t *emit) {
    *emit = 0;
    if (!len) return 0;  /* text may be NULL then */
    size_t best = (size_t)-1;
    for (int i = 0; i < n_stops; i++) {
        const char *hit = memmem(text, len, stops[i], strlen(stops[i]));
        if (hit && (size_t)(hit - text) < best) best = (size_t)(hit - text);
    }
    if (best != (size_t)-1) {
        *emit = best;
        return 1;
    }
    size_t hold = 0;
    for (int i = 0; i < n_stops; i++) {
        size_t sl = strlen(stops[i]);
        /* Longest k < sl with text's last k bytes == the stop's first k bytes. */
        for (size_t k = (sl - 1 < len ? sl - 1 : len); k > hold; k--)
            if (!memcmp(text + len - k, stops[i], k)) {
                hold = k;
                break;
            }
    }
    *emit = len - hold;
    return 0;
}

/* ---- responses ------------------------------------------------------------------------------ */

json_t *api_usage_json(const api_usage *u) {
    json_t *o = json_pack("{s:i, s:i, s:i}", "prompt_tokens", u->prompt_tokens, "completion_tokens",
                          u->completion_tokens, "total_tokens", u->prompt_tokens + u->completion_tokens);
    if (u->spec) {
        double al = u->verify_steps ? 1.0 + (double)u->accepted_tokens / (double)u->verify_steps : 0.0;
        json_object_set_new(o, "spec_decode",
                            json_pack("{s:I, s:I, s:I, s:f}", "draft_tokens", (json_int_t)u->draft_tokens,
                                      "accepted_tokens", (json_int_t)u->accepted_tokens, "verify_steps",
                                      (json_int_t)u->verify_steps, "acceptance_length", al));
        json_t *sd = json_object_get(o, "spec_decode");
        if (u->drafter) json_object_set_new(sd, "drafter", json_string(u->drafter));
        if (u->decode_steps > 0) {   /* the share of decoding steps that verified drafts */
            json_object_set_new(sd, "decode_steps", json_integer((json_int_t)u->decode_steps));
            json_object_set_new(sd, "speculated_share", json_real((double)u->verify_steps / (double)u->decode_steps));
        }
    }
    return o;
}

const char *api_finish_reason(engine_finish f) {
    switch (f) {
    case ENGINE_FINISH_STOP: return "stop";
    case ENGINE_FINISH_LENGTH: return "length";
    case ENGINE_FINISH_ABORT: return "abort";
    case ENGINE_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

static json_t *str_or_null(const char *s) { return s ? json_string(s) : json_null(); }

json_t *api_response_json(api_kind kind, const char *id, long long created, const char *model,
                          json_t *choices, const api_usage *usage) {
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "object", json_string(kind == API_CHAT ? "chat.completion" : "text_completion"));
    json_object_set_new(o, "created", json_integer(created));
    json_object_set_new(o, "model", json_string(model));
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", api_usage_json(usage));
    if (kind == API_CHAT) json_object_set_new(o, "system_fingerprint", json_null());
    return o;
}

json_t *api_completion_choice(int index, const char *text, size_t len, const char *finish,
                              json_t *logprobs) {
    return json_pack("{s:i, s:s%, s:o, s:o}", "index", index, "text", text ? text : "", text ? len : 0,
                     "logprobs", logprobs ? logprobs : json_null(), "finish_reason", str_or_null(finish));
}

json_t *api_chat_choice(int index, const char *text, size_t len, const char *finish,
                        json_t *logprobs) {
    json_t *msg = json_pack("{s:s, s:s%}", "role", "assistant", "content", text ? text : "", text ? len : 0);
    return json_pack("{s:i, s:o, s:o, s:o}", "index", index, "message", msg, "logprobs",
                     logprobs ? logprobs : json_null(), "finish_reason", str_or_null(finish));
}

json_t *api_chat_message_choice(int index, json_t *message, const char *finish, json_t *logprobs) {
    return json_pack("{s:i, s:o, s:o, s:o}", "index", index, "message", message, "logprobs",
                     logprobs ? logprobs : json_null(), "finish_reason", str_or_null(finish));
}

static json_t *chunk_head(api_kind kind, const char *id, long long created, const char *model) {
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "object", json_string(kind == API_CHAT ? "chat.completion.chunk" : "text_completion"));
    json_object_set_new(o, "created", json_integer(created));
    json_object_set_new(o, "model", json_string(model));
    return o;
}

json_t *api_chunk_json(api_kind kind, const char *id, long long created, const char *model,
                       int index, int first, const char *text, size_t len, const char *finish,
                       json_t *logprobs, int include_usage) {
    json_t *o = chunk_head(kind, id, created, model), *c;
    if (kind == API_CHAT) {
        json_t *delta = json_object();
        if (first) json_object_set_new(delta, "role", json_string("assistant"));
        if (text) json_object_set_new(delta, "content", json_stringn(text, len));
        c = json_pack("{s:i, s:o, s:o, s:o}", "index", index, "delta", delta, "logprobs",
                      logprobs ? logprobs : json_null(), "finish_reason", str_or_null(finish));
    } else {
        c = api_completion_choice(index, text, len, finish, logprobs);
    }
    json_object_set_new(o, "choices", json_pack("[o]", c));
    if (include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

json_t *api_chat_delta_chunk(const char *id, long long created, const char *model, int index, json_t *delta,
                             const char *finish, json_t *logprobs, int include_usage) {
    json_t *o = chunk_head(API_CHAT, id, created, model);
    json_t *c = json_pack("{s:i, s:o, s:o, s:o}", "index", index, "delta", delta, "logprobs",
                          logprobs ? logprobs : json_null(), "finish_reason", str_or_null(finish));
    json_object_set_new(o, "choices", json_pack("[o]", c));
    if (include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

json_t *api_usage_chunk_json(api_kind kind, const char *id, long long created,
                             const char *model, const api_usage *u) {
    json_t *o = chunk_head(kind, id, created, model);
    json_object_set_new(o, "choices", json_array());
    json_object_set_new(o, "usage", api_usage_json(u));
    return o;
}

json_t *api_logprobs_new(api_kind kind) {
    if (kind == API_CHAT) return json_pack("{s:[], s:n}", "content", "refusal");
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

static json_t *bytes_of(const char *s, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer((unsigned char)s[i]));
    return a;
}

void api_logprobs_add(json_t *lp, api_kind kind, const char *tok, size_t tok_len, float logprob,
                      int n_top, const char *const *top_tok, const size_t *top_len,
                      const float *top_lp, long long text_offset) {
    if (kind == API_CHAT) {
        json_t *top = json_array();
        for (int i = 0; i < n_top; i++)
            json_array_append_new(top, json_pack("{s:s%, s:f, s:o}", "token", top_tok[i], top_len[i],
                                                 "logprob", (double)top_lp[i], "bytes",
                                                 bytes_of(top_tok[i], top_len[i])));
        json_array_append_new(json_object_get(lp, "content"),
                              json_pack("{s:s%, s:f, s:o, s:o}", "token", tok, tok_len, "logprob",
                                        (double)logprob, "bytes", bytes_of(tok, tok_len), "top_logprobs", top));
        return;
    }
    json_array_append_new(json_object_get(lp, "tokens"), json_stringn(tok, tok_len));
    if (isnan(logprob)) {   /* the first prompt token: nothing before it to predict it */
        json_array_append_new(json_object_get(lp, "token_logprobs"), json_null());
        json_array_append_new(json_object_get(lp, "top_logprobs"), json_null());
        json_array_append_new(json_object_get(lp, "text_offset"), json_integer(text_offset));
        return;
    }
    json_array_append_new(json_object_get(lp, "token_logprobs"), json_real(logprob));
    json_t *top = json_object();
    for (int i = 0; i < n_top; i++) {
        char key[1024];
        size_t n = top_len[i] < sizeof key - 1 ? top_len[i] : sizeof key - 1;
        memcpy(key, top_tok[i], n);
        key[n] = 0;
        json_object_set_new(top, key, json_real(top_lp[i]));
    }
    json_array_append_new(json_object_get(lp, "top_logprobs"), top);
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer(text_offset));
}

json_t *api_models_json(const char *model, long long created, int max_model_len) {
    return json_pack("{s:s, s:[{s:s, s:s, s:I, s:s, s:s, s:i}]}", "object", "list", "data", "id", model,
                     "object", "model", "created", (json_int_t)created, "owned_by", "specd", "root",
                     model, "max_model_len", max_model_len);
}

int api_auth_ok(const char *header, const char *const *keys, int n_keys) {
    if (n_keys <= 0) return 1;
    if (!header || strncasecmp(header, "Bearer ", 7)) return 0;   /* the scheme is case-insensitive */
    const char *got = header + 7;
    size_t glen = strlen(got);
    int ok = 0;
    for (int k = 0; k < n_keys; k++) {
        size_t klen = strlen(keys[k]);
        unsigned diff = (unsigned)(glen != klen);
        /* Walk the whole key whatever the input; wrap the input so its length only shows
         * through the length check. */
        for (size_t i = 0; i < klen; i++)
            diff |= (unsigned)((unsigned char)keys[k][i] ^ (unsigned char)(glen ? got[i % glen] : 0));
        ok |= diff == 0;
    }
    return ok;
}

void api_make_id(char *buf, size_t cap, const char *prefix) {
    unsigned char r[12];
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r) {
        /* getrandom cannot fail for 12 bytes once the pool is initialised; fall back to a
         * clock-derived id rather than leave it uninitialised. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        for (size_t i = 0; i < sizeof r; i++) r[i] = (unsigned char)((ts.tv_nsec >> (i % 4 * 8)) ^ (ts.tv_sec >> i));
    }
    size_t n = (size_t)snprintf(buf, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof r && n + 2 < cap; i++) n += (size_t)snprintf(buf + n, cap - n, "%02x", r[i]);
}

char *api_sse_event(json_t *v, size_t *len) {
    char *body = json_dumps(v, JSON_COMPACT);
    if (!body) return NULL;
    size_t n = strlen(body);
    char *out = malloc(n + 9);
    if (out) {
        memcpy(out, "data: ", 6);
        memcpy(out + 6, body, n);
        memcpy(out + 6 + n, "\n\n", 3);
        *len = n + 8;
    }
    free(body);
    return out;
}
