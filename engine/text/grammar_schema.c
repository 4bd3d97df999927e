/* JSON and JSON Schema front ends.
 *
 * Generic JSON (response_format json_object, schema true / {} / an object without
 * properties) is one recursive rule, "value"; everything a schema spells out is inlined,
 * and a $ref becomes a call of its own rule only where it is recursive.
 *
 * Keyword policy (a schema keyword is one of):
 *   implemented: type (a name or a list), properties, required, additionalProperties (false;
 *     true or a schema next to properties: extra properties are never produced; a schema
 *     without properties: a map of such values), items, prefixItems, minItems, maxItems,
 *     enum, const, anyOf, oneOf (as anyOf: branches that overlap are not excluded),
 *     allOf with one entry, $ref (local: #, #/$defs/.., #/definitions/.., any JSON
 *     pointer), minLength, maxLength, pattern, format date / time / date-time / uuid,
 *     minimum / exclusiveMinimum 0 or 1 on integers and numbers (no sign / nonzero);
 *   ignored (annotations, or a format the spec leaves unchecked): title, description,
 *     default, examples, $schema, $id, $comment, $anchor, deprecated, readOnly, writeOnly,
 *     discriminator, nullable, contentEncoding, contentMediaType, other formats, unknown
 *     keywords (as JSON Schema says);
 *   refused with a compile error: not, if / then / else, patternProperties, propertyNames,
 *     dependentRequired, dependentSchemas, dependencies, unevaluatedProperties /
 *     unevaluatedItems, contains, minContains, maxContains, uniqueItems true, multipleOf,
 *     minProperties > 0, maxProperties, maximum, exclusiveMaximum, other minimum values,
 *     additionalItems, $dynamicRef, $recursiveRef, allOf with several entries, anyOf /
 *     oneOf / $ref next to other validation keywords, remote $ref.
 * Properties are produced in the schema's order; optional ones may be left out. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/grammar_internal.h"

#define SC_MAX_DEPTH 64
#define SC_MAX_REFS 256
#define SC_MAX_INT_DIGITS 16
#define SC_MAX_FRAC_DIGITS 16
#define SC_MAX_INDENT 20

/* ---- JSON pieces -------------------------------------------------------------------- */

gfrag grammar_json_ws(gbuild *b) {
    gbyteset sp = {{0}};
    gbs_add(&sp, ' ');
    gbs_add(&sp, '\t');
    gfrag nl = gb_alt(b, gb_lit(b, "\n", 1), gb_lit(b, "\r\n", 2));
    gfrag f = gb_seq(b, nl, gb_repeat(b, gb_set(b, &sp), 0, SC_MAX_INDENT));
    return gb_opt(b, gb_alt(b, gb_lit(b, " ", 1), f));
}

gfrag grammar_json_char(gbuild *b) {
    static const uint32_t lo[3] = {0x20, 0x23, 0x5D}, hi[3] = {0x21, 0x5B, 0x10FFFF};
    gfrag plain = gb_codepoints(b, lo, hi, 3);
    gbyteset esc = {{0}}, hex = {{0}};
    for (const char *p = "\"\\/bfnrt"; *p; p++) gbs_add(&esc, *p);
    gbs_range(&hex, '0', '9');
    gbs_range(&hex, 'a', 'f');
    gbs_range(&hex, 'A', 'F');
    gfrag u = gb_seq(b, gb_byte(b, 'u'), gb_repeat(b, gb_set(b, &hex), 4, 4));
    gfrag e = gb_seq(b, gb_byte(b, '\\'), gb_alt(b, gb_set(b, &esc), u));
    return gb_alt(b, plain, e);
}

static gfrag js_string(gbuild *b, int min, int max) {
    gfrag f = gb_byte(b, '"');
    f = gb_seq(b, f, gb_repeat(b, grammar_json_char(b), min, max));
    return gb_seq(b, f, gb_byte(b, '"'));
}

static gfrag digits(gbuild *b, int min, int max) {
    gbyteset d = {{0}};
    gbs_range(&d, '0', '9');
    return gb_repeat(b, gb_set(b, &d), min, max);
}

/* Integer part: 0, or a nonzero digit and up to 15 more; positive: no 0. */
static gfrag int_part(gbuild *b, int positive) {
    gbyteset nz = {{0}};
    gbs_range(&nz, '1', '9');
    gfrag f = gb_seq(b, gb_set(b, &nz), digits(b, 0, SC_MAX_INT_DIGITS - 1));
    return positive ? f : gb_alt(b, gb_lit(b, "0", 1), f);
}

/* sign: 1 allows '-'. positive: the integer part is not 0 (integers only). */
static gfrag js_integer(gbuild *b, int sign, int positive) {
    gfrag f = int_part(b, positive);
    return sign ? gb_seq(b, gb_opt(b, gb_lit(b, "-", 1)), f) : f;
}

static gfrag js_number(gbuild *b, int sign) {
    gfrag f = js_integer(b, sign, 0);
    f = gb_seq(b, f, gb_opt(b, gb_seq(b, gb_lit(b, ".", 1), digits(b, 1, SC_MAX_FRAC_DIGITS))));
    gbyteset e = {{0}}, pm = {{0}};
    gbs_add(&e, 'e');
    gbs_add(&e, 'E');
    gbs_add(&pm, '+');
    gbs_add(&pm, '-');
    gfrag x = gb_seq(b, gb_set(b, &e), gb_seq(b, gb_opt(b, gb_set(b, &pm)), digits(b, 1, 3)));
    return gb_seq(b, f, gb_opt(b, x));
}

/* open ws ( close | item (ws ',' ws item)* ws close ): a JSON array of items, or an object
 * of members; item loops back into itself through "ws , ws". */
static gfrag json_list(gbuild *b, const char *open, gfrag item, const char *close) {
    gfrag more = gb_seq(b, grammar_json_ws(b), gb_lit(b, ",", 1));
    more = gb_seq(b, more, grammar_json_ws(b));
    gb_eps(b, item.out, more.in);
    gb_eps(b, more.out, item.in);
    gfrag f = gb_seq(b, gb_lit(b, open, 1), grammar_json_ws(b));
    f = gb_seq(b, f, gb_opt(b, item));
    f = gb_seq(b, f, grammar_json_ws(b));
    return gb_seq(b, f, gb_lit(b, close, 1));
}

/* key ws ':' ws value, for objects whose keys may be any string. */
static gfrag any_key_member(gbuild *b, gfrag value) {
    gfrag m = js_string(b, 0, -1);
    m = gb_seq(b, m, grammar_json_ws(b));
    m = gb_seq(b, m, gb_lit(b, ":", 1));
    m = gb_seq(b, m, grammar_json_ws(b));
    return gb_seq(b, m, value);
}

/* Objects and arrays whose values are calls of value_rule. */
static gfrag generic_object(gbuild *b, int32_t value_rule) {
    return json_list(b, "{", any_key_member(b, gb_call(b, value_rule)), "}");
}

static gfrag generic_array(gbuild *b, int32_t value_rule) {
    return json_list(b, "[", gb_call(b, value_rule), "]");
}

/* The recursive rule "any JSON value"; its body is built at once (its own range). */
static int32_t value_rule(gbuild *b, int32_t *cache) {
    if (*cache >= 0) return *cache;
    int32_t r = *cache = gb_rule(b);
    gfrag f = generic_object(b, r);
    f = gb_alt(b, f, generic_array(b, r));
    f = gb_alt(b, f, js_string(b, 0, -1));
    f = gb_alt(b, f, js_number(b, 1));
    f = gb_alt(b, f, gb_lit(b, "true", 4));
    f = gb_alt(b, f, gb_lit(b, "false", 5));
    f = gb_alt(b, f, gb_lit(b, "null", 4));
    gb_rule_set(b, r, f);
    return r;
}

int grammar_build_json(gbuild *b) {
    int32_t cache = -1;
    /* rule 0 is an object whose values call rule "value": build "value" first, so rule
     * 0's fragment is one contiguous range */
    int32_t v = value_rule(b, &cache);
    gb_rule_set(b, 0, generic_object(b, v));
    return b->failed ? -1 : 0;
}

/* ---- JSON Schema -------------------------------------------------------------------- */

typedef struct {
    gbuild *b;
    json_t *root;
    int32_t value;                 /* generic value rule, -1 until needed */
    struct { char *ref; int32_t rule; int active, built; } refs[SC_MAX_REFS];
    int n_refs;
    char path[512];                /* JSON pointer of the schema being compiled */
} sc_ctx;

static const char *const annotations[] = {
    "title", "description", "default", "examples", "example", "$schema", "$id", "$comment", "$anchor",
    "deprecated", "readOnly", "writeOnly", "discriminator", "nullable", "contentEncoding",
    "contentMediaType", "$defs", "definitions", "strict", NULL};
static const char *const implemented[] = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength",
    "pattern", "format", "minimum", "exclusiveMinimum", "uniqueItems", "minProperties", NULL};
static const char *const refused[] = {
    "not", "if", "then", "else", "patternProperties", "propertyNames", "dependentRequired",
    "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems", "contains",
    "minContains", "maxContains", "multipleOf", "maxProperties", "maximum", "exclusiveMaximum",
    "additionalItems", "$dynamicRef", "$recursiveRef", NULL};

static int in_list(const char *const *l, const char *k) {
    for (; *l; l++)
        if (!strcmp(*l, k)) return 1;
    return 0;
}

static int sc_fail(sc_ctx *c, const char *what) {
    return gb_fail(c->b, "schema %s: %s", c->path[0] ? c->path : "/", what);
}

/* Whether s has a validation keyword besides those in allow (NULL-terminated). */
static const char *other_keyword(json_t *s, const char *const *allow) {
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v) {
        if (in_list(annotations, k) || in_list(allow, k)) continue;
        if (in_list(implemented, k) || in_list(refused, k)) return k;
    }
    return NULL;
}

static gfrag sc_node(sc_ctx *c, json_t *s, int depth);

/* Compile child schema s under path suffix "/a/b". */
static gfrag sc_child(sc_ctx *c, json_t *s, int depth, const char *seg1, const char *seg2) {
    size_t n = strlen(c->path);
    snprintf(c->path + n, sizeof c->path - n, "/%s%s%s", seg1, seg2 ? "/" : "", seg2 ? seg2 : "");
    gfrag f = sc_node(c, s, depth + 1);
    c->path[n] = 0;
    return f;
}

static gfrag literal_json(gbuild *b, json_t *v) {
    char *t = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!t) {
        gb_fail(b, "out of memory");
        return gb_empty(b);
    }
    gfrag f = gb_lit(b, t, strlen(t));
    free(t);
    return f;
}

static json_t *resolve_ref(sc_ctx *c, const char *ref) {
    if (ref[0] != '#') return NULL;
    json_t *cur = c->root;
    const char *p = ref + 1;
    while (*p == '/' && cur) {
        p++;
        char seg[256];
        size_t n = 0;
        while (*p && *p != '/' && n + 1 < sizeof seg) {
            if (p[0] == '~' && p[1] == '0') seg[n++] = '~', p += 2;
            else if (p[0] == '~' && p[1] == '1') seg[n++] = '/', p += 2;
            else seg[n++] = *p++;
        }
        seg[n] = 0;
        if (json_is_object(cur)) {
            cur = json_object_get(cur, seg);
        } else if (json_is_array(cur)) {
            char *end;
            long i = strtol(seg, &end, 10);
            cur = *end || i < 0 ? NULL : json_array_get(cur, (size_t)i);
        } else {
            cur = NULL;
        }
    }
    return *p ? NULL : cur;
}

static gfrag sc_ref(sc_ctx *c, json_t *s, int depth) {
    const char *ref = json_string_value(json_object_get(s, "$ref"));
    if (!ref) return sc_fail(c, "'$ref' must be a string"), gb_empty(c->b);
    static const char *const only_ref[] = {"$ref", NULL};
    const char *k = other_keyword(s, only_ref);
    if (k) {
        char m[160];
        snprintf(m, sizeof m, "'%s' next to '$ref' is not supported", k);
        return sc_fail(c, m), gb_empty(c->b);
    }
    json_t *t = resolve_ref(c, ref);
    if (!t) {
        char m[400];
        snprintf(m, sizeof m, "$ref '%.300s' does not resolve (only local refs, #/...)", ref);
        return sc_fail(c, m), gb_empty(c->b);
    }
    int i = 0;
    while (i < c->n_refs && strcmp(c->refs[i].ref, ref)) i++;
    if (i == c->n_refs) {
        if (c->n_refs == SC_MAX_REFS) return sc_fail(c, "too many distinct $ref targets"), gb_empty(c->b);
        c->refs[i].ref = strdup(ref);
        c->refs[i].rule = -1;
        c->refs[i].active = c->refs[i].built = 0;
        if (!c->refs[i].ref) return gb_fail(c->b, "out of memory"), gb_empty(c->b);
        c->n_refs++;
    }
    if (c->refs[i].active) {   /* recursive: a call of the ref's own rule (built later) */
        if (c->refs[i].rule < 0) c->refs[i].rule = gb_rule(c->b);
        return gb_call(c->b, c->refs[i].rule);
    }
    c->refs[i].active = 1;
    gfrag f = sc_child(c, t, depth, "$ref", NULL);
    c->refs[i].active = 0;
    return f;
}

static gfrag sc_object(sc_ctx *c, json_t *s, int depth) {
    gbuild *b = c->b;
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return sc_fail(c, "'properties' must be an object"), gb_empty(b);
    if (req && !json_is_array(req)) return sc_fail(c, "'required' must be an array"), gb_empty(b);
    json_t *mp = json_object_get(s, "minProperties");
    if (mp && !(json_is_integer(mp) && json_integer_value(mp) == 0) && !(props && req))
        return sc_fail(c, "'minProperties' is not supported"), gb_empty(b);
    size_t ri;
    json_t *rv;
    json_array_foreach(req, ri, rv) {
        if (!json_is_string(rv)) return sc_fail(c, "'required' must hold strings"), gb_empty(b);
        if (!props || !json_object_get(props, json_string_value(rv))) {
            char m[200];
            snprintf(m, sizeof m, "required property '%.100s' is not in 'properties'", json_string_value(rv));
            return sc_fail(c, m), gb_empty(b);
        }
    }
    if (!props || !json_object_size(props)) {
        if (json_is_false(addl)) return gb_lit(b, "{}", 2);
        if (!addl || json_is_true(addl)) return generic_object(b, value_rule(b, &c->value));
        /* a map: string keys, values of the additionalProperties schema */
        return json_list(b, "{", any_key_member(b, sc_child(c, addl, depth, "additionalProperties", NULL)), "}");
    }
    /* at[i][e]: before property i, e = 1 when nothing was written yet */
    int32_t s0 = b->n_states, e0 = b->n_edges;
    size_t n = json_object_size(props);
    int32_t (*at)[2] = malloc((n + 1) * sizeof *at);
    if (!at) return gb_fail(b, "out of memory"), gb_empty(b);
    for (size_t i = 0; i <= n; i++) at[i][0] = gb_state(b), at[i][1] = gb_state(b);
    size_t i = 0;
    const char *key;
    json_t *ps;
    json_object_foreach(props, key, ps) {
        int required = 0;
        json_array_foreach(req, ri, rv) required |= !strcmp(json_string_value(rv), key);
        json_t *ks = json_string(key);
        gfrag m = literal_json(b, ks);
        json_decref(ks);
        m = gb_seq(b, m, grammar_json_ws(b));
        m = gb_seq(b, m, gb_lit(b, ":", 1));
        m = gb_seq(b, m, grammar_json_ws(b));
        m = gb_seq(b, m, sc_child(c, ps, depth, "properties", key));
        gfrag sep = gb_seq(b, grammar_json_ws(b), gb_lit(b, ",", 1));
        sep = gb_seq(b, sep, grammar_json_ws(b));
        gb_eps(b, at[i][0], sep.in);
        gb_eps(b, sep.out, m.in);
        gb_eps(b, at[i][1], m.in);
        gb_eps(b, m.out, at[i + 1][0]);
        if (!required) {
            gb_eps(b, at[i][0], at[i + 1][0]);
            gb_eps(b, at[i][1], at[i + 1][1]);
        }
        i++;
    }
    gfrag open = gb_seq(b, gb_lit(b, "{", 1), grammar_json_ws(b));
    gfrag close = gb_seq(b, grammar_json_ws(b), gb_lit(b, "}", 1));
    gb_eps(b, open.out, at[0][1]);
    gb_eps(b, at[n][0], close.in);
    gb_eps(b, at[n][1], close.in);
    gfrag f = {.in = open.in, .out = close.out, .s0 = s0, .e0 = e0};
    free(at);
    return f;
}

static int get_count(sc_ctx *c, json_t *s, const char *k, int def, int *out) {
    json_t *v = json_object_get(s, k);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        char m[120];
        snprintf(m, sizeof m, "'%s' must be a non-negative integer", k);
        return sc_fail(c, m);
    }
    *out = json_integer_value(v) > 100000 ? 100000 : (int)json_integer_value(v);
    return 0;
}

static gfrag sc_array(sc_ctx *c, json_t *s, int depth) {
    gbuild *b = c->b;
    int min, max;
    if (get_count(c, s, "minItems", 0, &min) || get_count(c, s, "maxItems", -1, &max)) return gb_empty(b);
    if (max >= 0 && max < min) return sc_fail(c, "'maxItems' is below 'minItems'"), gb_empty(b);
    if (json_is_true(json_object_get(s, "uniqueItems"))) return sc_fail(c, "'uniqueItems' is not supported"), gb_empty(b);
    json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    gfrag open = gb_seq(b, gb_lit(b, "[", 1), grammar_json_ws(b));
    gfrag body;
    if (prefix) {   /* a tuple: exactly the prefix items (items after them are never produced) */
        if (!json_is_array(prefix) || !json_array_size(prefix)) return sc_fail(c, "'prefixItems' must be a non-empty array"), gb_empty(b);
        if (json_array_size(prefix) < (size_t)min) return sc_fail(c, "'minItems' above the 'prefixItems' count is not supported"), gb_empty(b);
        if (max >= 0 && (size_t)max < json_array_size(prefix)) return sc_fail(c, "'maxItems' below the 'prefixItems' count is not supported"), gb_empty(b);
        size_t i;
        json_t *it;
        char idx[24];
        body = gb_empty(b);
        json_array_foreach(prefix, i, it) {
            if (i) {
                gfrag sep = gb_seq(b, grammar_json_ws(b), gb_lit(b, ",", 1));
                body = gb_seq(b, body, gb_seq(b, sep, grammar_json_ws(b)));
            }
            snprintf(idx, sizeof idx, "%zu", i);
            body = gb_seq(b, body, sc_child(c, it, depth, "prefixItems", idx));
        }
    } else if (max == 0) {
        body = gb_empty(b);
    } else {
        /* item (ws ',' ws item){min-1, max-1}, optional when min is 0 */
        gfrag first = items ? sc_child(c, items, depth, "items", NULL) : gb_call(b, value_rule(b, &c->value));
        int32_t s_end = b->n_states;
        (void)s_end;
        gfrag rest = gb_seq(b, grammar_json_ws(b), gb_lit(b, ",", 1));
        rest = gb_seq(b, rest, grammar_json_ws(b));
        rest = gb_seq(b, rest, items ? sc_child(c, items, depth, "items", NULL) : gb_call(b, value_rule(b, &c->value)));
        rest = gb_repeat(b, rest, min > 0 ? min - 1 : 0, max < 0 ? -1 : max - 1);
        body = gb_seq(b, first, rest);
        if (min == 0) body = gb_opt(b, body);
    }
    gfrag f = gb_seq(b, open, body);
    f = gb_seq(b, f, grammar_json_ws(b));
    return gb_seq(b, f, gb_lit(b, "]", 1));
}

/* minimum / exclusiveMinimum: 0 or 1 only. Returns 0 (none), 1 (>= 0), 2 (> 0, integers:
 * >= 1); -1 refused. */
static int lower_bound(sc_ctx *c, json_t *s, int integer) {
    json_t *mn = json_object_get(s, "minimum"), *ex = json_object_get(s, "exclusiveMinimum");
    int r = 0;
    if (mn) {
        if (!json_is_number(mn)) return sc_fail(c, "'minimum' must be a number");
        double v = json_number_value(mn);
        if (v == 0) r = 1;
        else if (v == 1 && integer) r = 2;
        else return sc_fail(c, "'minimum' other than 0 (or 1 for integers) is not supported");
    }
    if (ex) {
        if (json_is_boolean(ex)) return sc_fail(c, "boolean 'exclusiveMinimum' (draft 4) is not supported");
        if (!json_is_number(ex) || json_number_value(ex) != 0 || !integer)
            return sc_fail(c, "'exclusiveMinimum' other than 0 on an integer is not supported");
        r = 2;
    }
    return r;
}

static gfrag sc_string(sc_ctx *c, json_t *s) {
    gbuild *b = c->b;
    int min, max;
    if (get_count(c, s, "minLength", 0, &min) || get_count(c, s, "maxLength", -1, &max)) return gb_empty(b);
    if (max >= 0 && max < min) return sc_fail(c, "'maxLength' is below 'minLength'"), gb_empty(b);
    json_t *pat = json_object_get(s, "pattern");
    const char *fmt = json_string_value(json_object_get(s, "format"));
    static const struct { const char *name, *re; } formats[] = {
        {"date", "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
        {"time", "^([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-][01][0-9]:[0-5][0-9])?$"},
        {"date-time", "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
                      "(\\.[0-9]{1,6})?(Z|[+-][01][0-9]:[0-5][0-9])$"},
        {"uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"},
    };
    const char *re = NULL;
    for (size_t i = 0; fmt && i < sizeof formats / sizeof formats[0]; i++)
        if (!strcmp(fmt, formats[i].name)) re = formats[i].re;
    if (pat) {
        if (!json_is_string(pat)) return sc_fail(c, "'pattern' must be a string"), gb_empty(b);
        if (re) return sc_fail(c, "'pattern' together with 'format' is not supported"), gb_empty(b);
        re = json_string_value(pat);
    }
    if (re && (min > 0 || max >= 0)) return sc_fail(c, "'minLength'/'maxLength' with 'pattern' or 'format' is not supported"), gb_empty(b);
    if (!re) return js_string(b, min, max);
    gfrag body;
    if (grammar_regex_frag(b, re, strlen(re), 1, &body)) {
        char m[300];
        snprintf(m, sizeof m, "'pattern' %.200s: %s", re, b->err ? b->err : "");
        b->failed = 0;   /* replace the regex message with one that says where */
        return sc_fail(c, m), gb_empty(b);
    }
    gfrag f = gb_seq(b, gb_byte(b, '"'), body);
    return gb_seq(b, f, gb_byte(b, '"'));
}

/* One type name applied to schema s. */
static gfrag sc_type(sc_ctx *c, json_t *s, const char *t, int depth) {
    gbuild *b = c->b;
    if (!strcmp(t, "string")) return sc_string(c, s);
    if (!strcmp(t, "integer") || !strcmp(t, "number")) {
        int integer = t[0] == 'i';
        int lb = lower_bound(c, s, integer);
        if (lb < 0) return gb_empty(b);
        return integer ? js_integer(b, lb == 0, lb == 2) : js_number(b, lb == 0);
    }
    if (!strcmp(t, "boolean")) return gb_alt(b, gb_lit(b, "true", 4), gb_lit(b, "false", 5));
    if (!strcmp(t, "null")) return gb_lit(b, "null", 4);
    if (!strcmp(t, "object")) return sc_object(c, s, depth);
    if (!strcmp(t, "array")) return sc_array(c, s, depth);
    char m[120];
    snprintf(m, sizeof m, "unknown type '%.60s'", t);
    return sc_fail(c, m), gb_empty(b);
}

static gfrag sc_alternatives(sc_ctx *c, json_t *s, const char *k, int depth) {
    json_t *a = json_object_get(s, k);
    if (!json_is_array(a) || !json_array_size(a)) {
        char m[80];
        snprintf(m, sizeof m, "'%s' must be a non-empty array", k);
        return sc_fail(c, m), gb_empty(c->b);
    }
    static const char *const only_alt[] = {"anyOf", "oneOf", NULL};
    const char *o = other_keyword(s, only_alt);
    if (o) {
        char m[160];
        snprintf(m, sizeof m, "'%s' next to '%s' is not supported", o, k);
        return sc_fail(c, m), gb_empty(c->b);
    }
    gfrag f = {0};
    size_t i;
    json_t *br;
    char idx[24];
    json_array_foreach(a, i, br) {
        snprintf(idx, sizeof idx, "%zu", i);
        gfrag x = sc_child(c, br, depth, k, idx);
        f = i ? gb_alt(c->b, f, x) : x;
    }
    return f;
}

static gfrag sc_node(sc_ctx *c, json_t *s, int depth) {
    gbuild *b = c->b;
    if (depth > SC_MAX_DEPTH) return sc_fail(c, "schema nested too deep"), gb_empty(b);
    if (json_is_true(s)) return gb_call(b, value_rule(b, &c->value));
    if (json_is_false(s)) return sc_fail(c, "schema 'false' matches nothing"), gb_empty(b);
    if (!json_is_object(s)) return sc_fail(c, "a schema must be an object or a boolean"), gb_empty(b);
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v) {
        if (in_list(refused, k) ||
            (!strcmp(k, "allOf") && (!json_is_array(v) || json_array_size(v) != 1))) {
            char m[160];
            snprintf(m, sizeof m, "'%s' is not supported%s", k, !strcmp(k, "allOf") ? " (except with one entry)" : "");
            return sc_fail(c, m), gb_empty(b);
        }
    }
    if (json_object_get(s, "$ref")) return sc_ref(c, s, depth);
    json_t *all = json_object_get(s, "allOf");
    if (all) {
        static const char *const only_all[] = {"allOf", NULL};
        if (other_keyword(s, only_all)) return sc_fail(c, "'allOf' next to other keywords is not supported"), gb_empty(b);
        return sc_child(c, json_array_get(all, 0), depth, "allOf", "0");
    }
    if (json_object_get(s, "const")) return literal_json(b, json_object_get(s, "const"));
    json_t *en = json_object_get(s, "enum");
    if (en) {
        if (!json_is_array(en) || !json_array_size(en)) return sc_fail(c, "'enum' must be a non-empty array"), gb_empty(b);
        gfrag f = {0};
        size_t i;
        json_array_foreach(en, i, v) f = i ? gb_alt(b, f, literal_json(b, v)) : literal_json(b, v);
        return f;
    }
    if (json_object_get(s, "anyOf")) return sc_alternatives(c, s, "anyOf", depth);
    if (json_object_get(s, "oneOf")) return sc_alternatives(c, s, "oneOf", depth);
    json_t *t = json_object_get(s, "type");
    if (json_is_string(t)) return sc_type(c, s, json_string_value(t), depth);
    if (json_is_array(t) && json_array_size(t)) {
        gfrag f = {0};
        size_t i;
        json_array_foreach(t, i, v) {
            if (!json_is_string(v)) return sc_fail(c, "'type' must hold strings"), gb_empty(b);
            gfrag x = sc_type(c, s, json_string_value(v), depth);
            f = i ? gb_alt(b, f, x) : x;
        }
        return f;
    }
    if (t) return sc_fail(c, "'type' must be a string or an array of strings"), gb_empty(b);
    if (json_object_get(s, "properties") || json_object_get(s, "required") ||
        json_object_get(s, "additionalProperties"))
        return sc_object(c, s, depth);
    if (json_object_get(s, "items") || json_object_get(s, "prefixItems")) return sc_array(c, s, depth);
    return gb_call(b, value_rule(b, &c->value));
}

int grammar_build_schema(gbuild *b, const char *spec, size_t len) {
    json_error_t je;
    json_t *root = json_loadb(spec, len, JSON_DECODE_ANY, &je);
    if (!root) return gb_fail(b, "schema is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    sc_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        json_decref(root);
        return gb_fail(b, "out of memory");
    }
    c->b = b;
    c->root = root;
    c->value = -1;
    gb_rule_set(b, 0, sc_node(c, root, 0));
    /* recursive refs: build each one's rule (which may find more) */
    for (int again = 1; again && !b->failed;) {
        again = 0;
        for (int i = 0; i < c->n_refs && !b->failed; i++) {
            if (c->refs[i].rule < 0 || c->refs[i].built) continue;
            c->refs[i].built = again = 1;
            c->refs[i].active = 1;
            snprintf(c->path, sizeof c->path, "%s", c->refs[i].ref + 1);
            gb_rule_set(b, c->refs[i].rule, sc_node(c, resolve_ref(c, c->refs[i].ref), 0));
            c->refs[i].active = 0;
        }
    }
    for (int i = 0; i < c->n_refs; i++) free(c->refs[i].ref);
    free(c);
    json_decref(root);
    return b->failed ? -1 : 0;
}
