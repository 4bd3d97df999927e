/* Constrained decoding fields of a request (see api.h): OpenAI's response_format, vLLM's
 * guided_json / guided_regex / guided_choice / guided_grammar and structured_outputs, and
 * llama.cpp's json_schema / grammar. At most one may be given; it is compiled here, so a
 * bad schema, regex or grammar is a 400 naming the field and the problem. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api.h"

static json_t *given(json_t *o, const char *name) {
    json_t *v = json_object_get(o, name);
    return v && !json_is_null(v) ? v : NULL;
}

/* A schema given as an object or as JSON text (vLLM accepts both). */
static char *schema_text(json_t *v) {
    if (json_is_string(v)) return strdup(json_string_value(v));
    if (json_is_object(v) || json_is_boolean(v)) return json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    return NULL;
}

typedef struct {
    grammar_kind kind;
    char *spec;                 /* malloc'd; NULL for json_object */
    const char *param;          /* the request field it came from */
} constraint;

static int set_once(constraint *c, const char *param, grammar_kind kind, char *spec, api_error *e) {
    if (c->kind != GRAMMAR_NONE) {
        free(spec);
        return api_fail(e, 400, NULL, param, NULL, "'%s' and '%s' both constrain the output: give one", c->param, param);
    }
    c->kind = kind;
    c->spec = spec;
    c->param = param;
    return 0;
}

static int bad_type(api_error *e, const char *param, const char *what) {
    return api_fail(e, 400, NULL, param, NULL, "'%s' must be %s", param, what);
}

static int parse_response_format(json_t *v, constraint *c, api_error *e) {
    const char *P = "response_format";
    const char *t = json_string_value(json_object_get(v, "type"));
    if (!json_is_object(v) || !t) return api_fail(e, 400, NULL, P, NULL, "'response_format' must be an object with a 'type'");
    if (!strcmp(t, "text")) return 0;
    if (!strcmp(t, "json_object")) {
        json_t *s = given(v, "schema");   /* llama.cpp's extension */
        if (!s) return set_once(c, P, GRAMMAR_JSON, NULL, e);
        char *text = schema_text(s);
        if (!text) return bad_type(e, P, "an object whose 'schema' is a JSON Schema");
        return set_once(c, P, GRAMMAR_JSON_SCHEMA, text, e);
    }
    if (!strcmp(t, "json_schema")) {
        json_t *js = given(v, "json_schema");
        if (!json_is_object(js))
            return api_fail(e, 400, NULL, P, NULL, "response_format 'json_schema' needs a 'json_schema' object");
        json_t *s = given(js, "schema");
        if (!s) return set_once(c, P, GRAMMAR_JSON, NULL, e);
        char *text = schema_text(s);
        if (!text) return api_fail(e, 400, NULL, P, NULL, "response_format json_schema.schema must be a JSON Schema object");
        return set_once(c, P, GRAMMAR_JSON_SCHEMA, text, e);
    }
    return api_fail(e, 400, NULL, P, NULL, "response_format type '%s' is not supported ('text', 'json_object', "
                    "'json_schema')", t);
}

static int choice_text(json_t *v, char **out) {
    if (!json_is_array(v) || !json_array_size(v)) return -1;
    size_t i;
    json_t *x;
    json_array_foreach(v, i, x)
        if (!json_is_string(x)) return -1;
    *out = json_dumps(v, JSON_COMPACT);
    return *out ? 0 : -1;
}

/* vLLM's structured_outputs {json | regex | choice | grammar | json_object}. */
static int parse_structured(json_t *so, constraint *c, api_error *e) {
    const char *P = "structured_outputs";
    if (!json_is_object(so)) return bad_type(e, P, "an object");
    const char *k;
    json_t *v;
    json_object_foreach(so, k, v) {
        if (json_is_null(v)) continue;
        char *text = NULL;
        if (!strcmp(k, "json")) {
            if (!(text = schema_text(v))) return bad_type(e, P, "an object whose 'json' is a JSON Schema");
            if (set_once(c, P, GRAMMAR_JSON_SCHEMA, text, e)) return -1;
        } else if (!strcmp(k, "regex") || !strcmp(k, "grammar")) {
            if (!json_is_string(v)) return api_fail(e, 400, NULL, P, NULL, "structured_outputs.%s must be a string", k);
            if (set_once(c, P, k[0] == 'r' ? GRAMMAR_REGEX : GRAMMAR_GBNF, strdup(json_string_value(v)), e)) return -1;
        } else if (!strcmp(k, "choice")) {
            if (choice_text(v, &text)) return bad_type(e, P, "an object whose 'choice' is a non-empty array of strings");
            if (set_once(c, P, GRAMMAR_CHOICE, text, e)) return -1;
        } else if (!strcmp(k, "json_object")) {
            if (!json_is_boolean(v)) return api_fail(e, 400, NULL, P, NULL, "structured_outputs.json_object must be a boolean");
            if (json_is_true(v) && set_once(c, P, GRAMMAR_JSON, NULL, e)) return -1;
        } else if (!strcmp(k, "disable_any_whitespace") || !strcmp(k, "disable_additional_properties") ||
                   !strcmp(k, "whitespace_pattern") || !strcmp(k, "structural_tag")) {
            return api_fail(e, 400, NULL, P, NULL, "structured_outputs.%s is not supported", k);
        }
    }
    return 0;
}

int api_parse_constraint(json_t *o, const api_limits *lim, api_request *r, api_error *e) {
    constraint c = {0};
    json_t *v;
    if ((v = given(o, "response_format")) && parse_response_format(v, &c, e)) goto fail;
    if ((v = given(o, "guided_json"))) {
        char *text = schema_text(v);
        if (!text) {
            bad_type(e, "guided_json", "a JSON Schema (an object or its JSON text)");
            goto fail;
        }
        if (set_once(&c, "guided_json", GRAMMAR_JSON_SCHEMA, text, e)) goto fail;
    }
    if ((v = given(o, "json_schema"))) {   /* llama.cpp */
        char *text = json_is_object(v) ? schema_text(v) : NULL;
        if (!text) {
            bad_type(e, "json_schema", "a JSON Schema object");
            goto fail;
        }
        if (set_once(&c, "json_schema", GRAMMAR_JSON_SCHEMA, text, e)) goto fail;
    }
    static const struct { const char *name; grammar_kind kind; } text_fields[] = {
        {"guided_regex", GRAMMAR_REGEX}, {"guided_grammar", GRAMMAR_GBNF}, {"grammar", GRAMMAR_GBNF}};
    for (size_t i = 0; i < sizeof text_fields / sizeof text_fields[0]; i++) {
        if (!(v = given(o, text_fields[i].name))) continue;
        if (!json_is_string(v)) {
            bad_type(e, text_fields[i].name, "a string");
            goto fail;
        }
        if (set_once(&c, text_fields[i].name, text_fields[i].kind, strdup(json_string_value(v)), e)) goto fail;
    }
    if ((v = given(o, "guided_choice"))) {
        char *text;
        if (choice_text(v, &text)) {
            bad_type(e, "guided_choice", "a non-empty array of strings");
            goto fail;
        }
        if (set_once(&c, "guided_choice", GRAMMAR_CHOICE, text, e)) goto fail;
    }
    if ((v = given(o, "structured_outputs")) && parse_structured(v, &c, e)) goto fail;
    if (c.kind == GRAMMAR_NONE) return 0;
    if (c.kind != GRAMMAR_JSON && !c.spec) {
        api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    char err[400];
    r->sp.grammar = grammar_compile(c.kind, c.spec, c.spec ? strlen(c.spec) : 0, err, sizeof err);
    if (!r->sp.grammar) {
        api_fail(e, 400, NULL, c.param, NULL, "%s: %s", c.param, err);
        goto fail;
    }
    free(c.spec);
    /* its mask classes here, not on the engine thread (out of memory: the engine retries) */
    if (lim->max_token_bytes > 0) grammar_prepare_masks(r->sp.grammar, lim->max_token_bytes);
    return 1;
fail:
    free(c.spec);
    return -1;
}
