/* GBNF front end (llama.cpp's grammar format):
 *
 *   root   ::= "{" ws pair ("," ws pair)* "}"     # comments run to the end of the line
 *   pair   ::= [a-z]+ ":" ws value
 *
 * Items: "literals" (escapes \n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH), [classes] and
 * [^negated], . (any character), rule names, ( groups ), | alternation, and the
 * quantifiers * + ? {m} {m,} {m,n}. A rule runs until the next "name ::=" or the end.
 * Every rule is a rule of the grammar (rule references are calls), root is rule 0; an
 * undefined rule, a rule defined twice and left recursion are compile errors. */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/grammar_internal.h"

#define GBNF_MAX_RULES 1024

typedef struct {
    gbuild *b;
    const char *p, *end;
    struct { char *name; int32_t id; int defined; } rules[GBNF_MAX_RULES];
    int n_rules;
    int depth;
} gp;

static int is_name(int c) { return isalnum(c) || c == '-' || c == '_'; }

/* Skips spaces, newlines and comments. */
static void skip_ws(gp *g) {
    while (g->p < g->end) {
        if (*g->p == '#') {
            while (g->p < g->end && *g->p != '\n') g->p++;
        } else if (isspace((unsigned char)*g->p)) {
            g->p++;
        } else {
            break;
        }
    }
}

static int32_t rule_id(gp *g, const char *name, size_t n) {
    for (int i = 0; i < g->n_rules; i++)
        if (strlen(g->rules[i].name) == n && !memcmp(g->rules[i].name, name, n)) return g->rules[i].id;
    if (g->n_rules == GBNF_MAX_RULES) return gb_fail(g->b, "grammar: more than %d rules", GBNF_MAX_RULES);
    char *s = strndup(name, n);
    if (!s) return gb_fail(g->b, "out of memory");
    int root = n == 4 && !memcmp(name, "root", 4);
    g->rules[g->n_rules].name = s;
    g->rules[g->n_rules].id = root ? 0 : gb_rule(g->b);
    g->rules[g->n_rules].defined = 0;
    return g->rules[g->n_rules++].id;
}

/* At "name ::=" (after spaces)? */
static int at_rule_start(const gp *g) {
    const char *q = g->p;
    if (q >= g->end || !is_name((unsigned char)*q)) return 0;
    while (q < g->end && is_name((unsigned char)*q)) q++;
    while (q < g->end && (*q == ' ' || *q == '\t' || *q == '\r' || *q == '\n')) q++;
    return g->end - q >= 3 && !memcmp(q, "::=", 3);
}

static int hex_value(gp *g, int n, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < n; i++) {
        int c = g->p < g->end ? (unsigned char)*g->p : -1;
        int h = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (h < 0) return gb_fail(g->b, "grammar: bad hex escape");
        v = v * 16 + (uint32_t)h;
        g->p++;
    }
    *out = v;
    return 0;
}

static size_t put_utf8(uint32_t cp, char *o) {
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | (cp >> 6)), o[1] = (char)(0x80 | (cp & 0x3F)), 2;
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)), o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)), o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)), o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static gfrag parse_literal(gp *g) {
    char *buf = malloc((size_t)(g->end - g->p) * 4 + 4);
    size_t n = 0;
    if (!buf) return gb_fail(g->b, "out of memory"), gb_empty(g->b);
    g->p++;   /* opening quote */
    while (g->p < g->end && *g->p != '"') {
        if (*g->p != '\\') {
            buf[n++] = *g->p++;
            continue;
        }
        g->p++;
        char c = g->p < g->end ? *g->p++ : 0;
        uint32_t cp = 0;
        switch (c) {
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case '\\': case '"': case '[': case ']': buf[n++] = c; break;
        case 'x': if (!hex_value(g, 2, &cp)) n += put_utf8(cp, buf + n); break;
        case 'u': if (!hex_value(g, 4, &cp)) n += put_utf8(cp, buf + n); break;
        case 'U': if (!hex_value(g, 8, &cp)) n += put_utf8(cp, buf + n); break;
        default: gb_fail(g->b, "grammar: unknown escape \\%c in a literal", c); break;
        }
    }
    if (g->p >= g->end) gb_fail(g->b, "grammar: unterminated string literal");
    else g->p++;
    gfrag f = gb_lit(g->b, buf, n);
    free(buf);
    return f;
}

static gfrag parse_alts(gp *g);

static gfrag parse_item(gp *g) {
    gbuild *b = g->b;
    char c = *g->p;
    if (c == '"') return parse_literal(g);
    if (c == '[') {
        gfrag f;
        size_t used;
        g->p++;
        if (grammar_class_frag(b, g->p, (size_t)(g->end - g->p), &used, &f)) return gb_empty(b);
        g->p += used;
        return f;
    }
    if (c == '.') {
        g->p++;
        static const uint32_t lo[1] = {0}, hi[1] = {0x10FFFF};
        return gb_codepoints(b, lo, hi, 1);
    }
    if (c == '(') {
        g->p++;
        if (++g->depth > 100) return gb_fail(b, "grammar: groups nested too deep"), gb_empty(b);
        gfrag f = parse_alts(g);
        g->depth--;
        skip_ws(g);
        if (g->p >= g->end || *g->p != ')') return gb_fail(b, "grammar: missing ')'"), gb_empty(b);
        g->p++;
        return f;
    }
    if (is_name((unsigned char)c)) {
        const char *s = g->p;
        while (g->p < g->end && is_name((unsigned char)*g->p)) g->p++;
        int32_t id = rule_id(g, s, (size_t)(g->p - s));
        return id < 0 ? gb_empty(b) : gb_call(b, id);
    }
    gb_fail(b, "grammar: unexpected '%c'", c);
    return gb_empty(b);
}

static int read_num(gp *g, int *out) {
    int n = 0, any = 0;
    while (g->p < g->end && isdigit((unsigned char)*g->p)) {
        n = n * 10 + (*g->p++ - '0');
        if (n > 100000) n = 100000;
        any = 1;
    }
    *out = n;
    return any;
}

static gfrag parse_seq(gp *g) {
    gbuild *b = g->b;
    gfrag f = gb_empty(b);
    for (;;) {
        skip_ws(g);
        if (g->p >= g->end || *g->p == '|' || *g->p == ')' || at_rule_start(g) || b->failed) break;
        gfrag a = parse_item(g);
        while (g->p < g->end && !b->failed) {
            int min, max;
            char q = *g->p;
            if (q == '*') min = 0, max = -1, g->p++;
            else if (q == '+') min = 1, max = -1, g->p++;
            else if (q == '?') min = 0, max = 1, g->p++;
            else if (q == '{') {
                g->p++;
                skip_ws(g);
                if (!read_num(g, &min)) return gb_fail(b, "grammar: bad {m,n}"), f;
                max = min;
                skip_ws(g);
                if (g->p < g->end && *g->p == ',') {
                    g->p++;
                    skip_ws(g);
                    if (!read_num(g, &max)) max = -1;
                }
                skip_ws(g);
                if (g->p >= g->end || *g->p != '}') return gb_fail(b, "grammar: bad {m,n}"), f;
                g->p++;
                if (min > 1000 || max > 1000 || (max >= 0 && max < min))
                    return gb_fail(b, "grammar: repetition {%d,%d} out of range (at most 1000)", min, max), f;
            } else {
                break;
            }
            a = gb_repeat(b, a, min, max);
        }
        f = gb_seq(b, f, a);
    }
    return f;
}

static gfrag parse_alts(gp *g) {
    gfrag f = parse_seq(g);
    skip_ws(g);
    while (g->p < g->end && *g->p == '|' && !g->b->failed) {
        g->p++;
        f = gb_alt(g->b, f, parse_seq(g));
        skip_ws(g);
    }
    return f;
}

int grammar_build_gbnf(gbuild *b, const char *spec, size_t len) {
    gp *g = calloc(1, sizeof *g);
    if (!g) return gb_fail(b, "out of memory");
    g->b = b;
    g->p = spec;
    g->end = spec + len;
    for (;;) {
        skip_ws(g);
        if (g->p >= g->end || b->failed) break;
        const char *s = g->p;
        while (g->p < g->end && is_name((unsigned char)*g->p)) g->p++;
        size_t n = (size_t)(g->p - s);
        skip_ws(g);
        if (!n || g->end - g->p < 3 || memcmp(g->p, "::=", 3)) {
            gb_fail(b, "grammar: expected 'name ::=' at offset %d", (int)(s - spec));
            break;
        }
        g->p += 3;
        int32_t id = rule_id(g, s, n);
        if (id < 0) break;
        for (int i = 0; i < g->n_rules; i++)
            if (g->rules[i].id == id) {
                if (g->rules[i].defined) gb_fail(b, "grammar: rule '%s' is defined twice", g->rules[i].name);
                g->rules[i].defined = 1;
            }
        gfrag f = parse_alts(g);
        if (!b->failed && g->p < g->end && !at_rule_start(g))
            gb_fail(b, "grammar: unexpected '%c' at offset %d", *g->p, (int)(g->p - spec));
        gb_rule_set(b, id, f);
    }
    int has_root = 0;
    for (int i = 0; i < g->n_rules && !b->failed; i++) {
        if (!g->rules[i].defined) gb_fail(b, "grammar: rule '%s' is used but not defined", g->rules[i].name);
        has_root |= g->rules[i].id == 0;
    }
    if (!b->failed && !has_root) gb_fail(b, "grammar: no 'root' rule");
    for (int i = 0; i < g->n_rules; i++) free(g->rules[i].name);
    free(g);
    return b->failed ? -1 : 0;
}
