/* Regex front end: a practical subset of Python / PCRE syntax, compiled into NFA fragments.
 *
 * Supported: literal characters (UTF-8), escapes \d \D \w \W \s \S \n \r \t \f \v \0 \xHH
 * \uHHHH and escaped punctuation, . (any character but \n), [classes] with ranges,
 * negation and those escapes, groups ( ), (?: ), (?P<name> ), (?<name> ), alternation |,
 * quantifiers ? * + {m} {m,} {m,n} (a lazy ? suffix is accepted: it changes which match a
 * search finds, not what matches in full), ^ at the start and $ at the end.
 * Refused with a message: backreferences, lookaround, \b \B \A \z, inline flags,
 * possessive quantifiers, anchors elsewhere, counts above 1000.
 *
 * Matching is on the whole output (vLLM's guided_regex). For a JSON Schema "pattern"
 * (json_string set) it is a search, as JSON Schema says, unless anchored, and the regex
 * describes the string's decoded content: a literal '"' or '\' is emitted escaped, and
 * classes leave out what JSON must escape (quote, backslash, control characters). */
#include <stdlib.h>
#include <string.h>

#include "engine/text/grammar_internal.h"

#define RE_MAX_REPEAT 1000

typedef struct { uint32_t lo, hi; } cprange;

typedef struct {
    cprange *v;
    int n, cap;
} cpset;

typedef struct {
    gbuild *b;
    const unsigned char *p, *end, *start;
    int json;      /* JSON string content */
    int depth;
} re_parser;

static int cpset_add(cpset *s, uint32_t lo, uint32_t hi) {
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 8;
        cprange *v = realloc(s->v, (size_t)cap * sizeof *v);
        if (!v) return -1;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = (cprange){lo, hi};
    return 0;
}

static int cmp_range(const void *a, const void *b) {
    const cprange *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

static void cpset_normalize(cpset *s) {
    if (!s->n) return;
    qsort(s->v, (size_t)s->n, sizeof *s->v, cmp_range);
    int m = 0;
    for (int i = 1; i < s->n; i++) {
        if (s->v[i].lo <= s->v[m].hi + 1) {
            if (s->v[i].hi > s->v[m].hi) s->v[m].hi = s->v[i].hi;
        } else {
            s->v[++m] = s->v[i];
        }
    }
    s->n = m + 1;
}

/* s = complement of s over 0..0x10FFFF (s normalized). */
static int cpset_negate(cpset *s) {
    cpset o = {0};
    uint32_t next = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->v[i].lo > next && cpset_add(&o, next, s->v[i].lo - 1)) return -1;
        next = s->v[i].hi + 1;
    }
    if (next <= 0x10FFFF && cpset_add(&o, next, 0x10FFFF)) return -1;
    free(s->v);
    *s = o;
    return 0;
}

/* Remove lo..hi from a normalized set. */
static int cpset_sub(cpset *s, uint32_t lo, uint32_t hi) {
    cpset o = {0};
    for (int i = 0; i < s->n; i++) {
        cprange r = s->v[i];
        if (r.hi < lo || r.lo > hi) {
            if (cpset_add(&o, r.lo, r.hi)) return -1;
            continue;
        }
        if (r.lo < lo && cpset_add(&o, r.lo, lo - 1)) return -1;
        if (r.hi > hi && cpset_add(&o, hi + 1, r.hi)) return -1;
    }
    free(s->v);
    *s = o;
    return 0;
}

static gfrag set_frag(re_parser *ps, cpset *s) {
    gbuild *b = ps->b;
    cpset_normalize(s);
    if (ps->json && (cpset_sub(s, 0, 0x1F) || cpset_sub(s, '"', '"') || cpset_sub(s, '\\', '\\')))
        gb_fail(b, "out of memory");
    if (s->n && s->v[s->n - 1].hi < 0x80) {   /* ASCII only: one byte set */
        gbyteset bs = {{0}};
        for (int i = 0; i < s->n; i++) gbs_range(&bs, (int)s->v[i].lo, (int)s->v[i].hi);
        return gb_set(b, &bs);
    }
    uint32_t lo[256], hi[256];
    if (s->n > 256) {
        gb_fail(b, "regex: character class too complex");
        return gb_empty(b);
    }
    for (int i = 0; i < s->n; i++) lo[i] = s->v[i].lo, hi[i] = s->v[i].hi;
    return gb_codepoints(b, lo, hi, s->n);
}

/* A literal code point: as itself, or JSON-escaped inside a JSON string. */
static gfrag lit_frag(re_parser *ps, uint32_t cp) {
    if (ps->json && (cp == '"' || cp == '\\')) {
        char esc[2] = {'\\', (char)cp};
        return gb_lit(ps->b, esc, 2);
    }
    if (ps->json && cp < 0x20) {
        static const char *named[32] = {['\b'] = "\\b", ['\f'] = "\\f", ['\n'] = "\\n", ['\r'] = "\\r", ['\t'] = "\\t"};
        char u[8];
        const char *e = named[cp];
        if (!e) {
            static const char hex[] = "0123456789abcdef";
            u[0] = '\\', u[1] = 'u', u[2] = '0', u[3] = '0', u[4] = hex[cp >> 4], u[5] = hex[cp & 15], u[6] = 0;
            e = u;
        }
        return gb_lit(ps->b, e, strlen(e));
    }
    cpset s = {0};
    cpset_add(&s, cp, cp);
    gfrag f = set_frag(ps, &s);
    free(s.v);
    return f;
}

static int hexdig(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* One UTF-8 code point from the pattern. */
static int next_cp(re_parser *ps, uint32_t *cp) {
    const unsigned char *p = ps->p;
    if (p >= ps->end) return -1;
    uint32_t c = *p;
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!n || p + n > ps->end) return gb_fail(ps->b, "regex: invalid UTF-8");
    if (n > 1) c &= 0x3Fu >> (n - 1);
    for (int i = 1; i < n; i++) {
        if ((p[i] & 0xC0) != 0x80) return gb_fail(ps->b, "regex: invalid UTF-8");
        c = (c << 6) | (p[i] & 0x3F);
    }
    ps->p += n;
    *cp = c;
    return 0;
}

static int add_class_escape(cpset *s, int c) {
    switch (c) {
    case 'd': return cpset_add(s, '0', '9');
    case 'w': return cpset_add(s, '0', '9') || cpset_add(s, 'A', 'Z') || cpset_add(s, '_', '_') || cpset_add(s, 'a', 'z');
    case 's': return cpset_add(s, '\t', '\r') || cpset_add(s, ' ', ' ');
    }
    return -1;
}

/* After a backslash: a shorthand class (D/W/S negated) into s and returns 1, or a single
 * code point into *cp and returns 0; -1 on error. */
static int parse_escape(re_parser *ps, cpset *s, uint32_t *cp) {
    if (ps->p >= ps->end) return gb_fail(ps->b, "regex: trailing backslash");
    int c = *ps->p++;
    switch (c) {
    case 'd': case 'w': case 's':
        return add_class_escape(s, c) ? gb_fail(ps->b, "out of memory") : 1;
    case 'D': case 'W': case 'S': {
        cpset t = {0};
        if (add_class_escape(&t, c + 32)) return gb_fail(ps->b, "out of memory");
        cpset_normalize(&t);
        cpset_negate(&t);
        for (int i = 0; i < t.n; i++) cpset_add(s, t.v[i].lo, t.v[i].hi);
        free(t.v);
        return 1;
    }
    case 'n': *cp = '\n'; return 0;
    case 'r': *cp = '\r'; return 0;
    case 't': *cp = '\t'; return 0;
    case 'f': *cp = '\f'; return 0;
    case 'v': *cp = '\v'; return 0;
    case '0': *cp = 0; return 0;
    case 'x': case 'u': case 'U': {
        int n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        uint32_t v = 0;
        for (int i = 0; i < n; i++) {
            int h = ps->p < ps->end ? hexdig(*ps->p) : -1;
            if (h < 0) return gb_fail(ps->b, "regex: \\%c needs %d hex digits", c, n);
            v = v * 16 + (uint32_t)h;
            ps->p++;
        }
        *cp = v;
        return 0;
    }
    case 'b': case 'B': case 'A': case 'z': case 'Z': case 'G':
        return gb_fail(ps->b, "regex: \\%c (an assertion) is not supported", c);
    default:
        if (c >= '1' && c <= '9') return gb_fail(ps->b, "regex: backreferences are not supported");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
            return gb_fail(ps->b, "regex: unknown escape \\%c", c);
        *cp = (uint32_t)c;
        return 0;
    }
}

static gfrag parse_class(re_parser *ps) {
    cpset s = {0};
    int neg = 0, first = 1;
    if (ps->p < ps->end && *ps->p == '^') neg = 1, ps->p++;
    for (;;) {
        if (ps->p >= ps->end) {
            gb_fail(ps->b, "regex: unterminated [class]");
            break;
        }
        if (*ps->p == ']' && !first) {
            ps->p++;
            break;
        }
        first = 0;
        uint32_t lo, hi;
        if (*ps->p == '\\') {
            ps->p++;
            int r = parse_escape(ps, &s, &lo);
            if (r < 0) break;
            if (r == 1) continue;
        } else if (*ps->p == '[' && ps->p + 1 < ps->end && ps->p[1] == ':') {
            gb_fail(ps->b, "regex: POSIX classes [:name:] are not supported");
            break;
        } else if (next_cp(ps, &lo)) {
            break;
        }
        hi = lo;
        if (ps->p + 1 < ps->end && *ps->p == '-' && ps->p[1] != ']') {
            ps->p++;
            if (*ps->p == '\\') {
                ps->p++;
                cpset junk = {0};
                int r = parse_escape(ps, &junk, &hi);
                free(junk.v);
                if (r != 0) {
                    if (r > 0) gb_fail(ps->b, "regex: a class shorthand cannot end a range");
                    break;
                }
            } else if (next_cp(ps, &hi)) {
                break;
            }
            if (hi < lo) {
                gb_fail(ps->b, "regex: bad range in class");
                break;
            }
        }
        if (cpset_add(&s, lo, hi)) {
            gb_fail(ps->b, "out of memory");
            break;
        }
    }
    cpset_normalize(&s);
    if (neg) cpset_negate(&s);
    gfrag f = ps->b->failed ? gb_empty(ps->b) : set_frag(ps, &s);
    free(s.v);
    return f;
}

static gfrag parse_alt(re_parser *ps);

static int read_int(re_parser *ps, int *out) {
    int n = 0, any = 0;
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
        if (n > 100000) n = 100000;
        n = n * 10 + (*ps->p++ - '0');
        any = 1;
    }
    *out = n;
    return any;
}

/* {m}, {m,}, {m,n} at ps->p (after '{'); 0 and p unchanged when it is not one (then '{'
 * is a literal, as in Python). */
static int parse_braces(re_parser *ps, int *min, int *max) {
    const unsigned char *save = ps->p;
    if (!read_int(ps, min)) goto no;
    *max = *min;
    if (ps->p < ps->end && *ps->p == ',') {
        ps->p++;
        if (!read_int(ps, max)) *max = -1;
    }
    if (ps->p >= ps->end || *ps->p != '}') goto no;
    ps->p++;
    return 1;
no:
    ps->p = save;
    return 0;
}

static gfrag parse_atom(re_parser *ps) {
    gbuild *b = ps->b;
    unsigned char c = *ps->p;
    if (c == '(') {
        ps->p++;
        if (ps->p < ps->end && *ps->p == '?') {
            ps->p++;
            if (ps->p < ps->end && *ps->p == ':') {
                ps->p++;
            } else if (ps->p + 1 < ps->end && (*ps->p == 'P' || *ps->p == '<') &&
                       (*ps->p == 'P' ? ps->p[1] == '<' : ps->p[1] != '=' && ps->p[1] != '!')) {
                while (ps->p < ps->end && *ps->p != '>') ps->p++;
                if (ps->p < ps->end) ps->p++;
            } else {
                gb_fail(b, "regex: (?%c...) (lookaround or flags) is not supported", ps->p < ps->end ? *ps->p : '?');
                return gb_empty(b);
            }
        }
        if (++ps->depth > 200) {
            gb_fail(b, "regex: groups nested too deep");
            return gb_empty(b);
        }
        gfrag f = parse_alt(ps);
        ps->depth--;
        if (ps->p >= ps->end || *ps->p != ')') gb_fail(b, "regex: missing ')'");
        else ps->p++;
        return f;
    }
    if (c == '[') {
        ps->p++;
        return parse_class(ps);
    }
    if (c == '.') {
        ps->p++;
        cpset s = {0};
        cpset_add(&s, 0, '\n' - 1);
        cpset_add(&s, '\n' + 1, 0x10FFFF);
        gfrag f = set_frag(ps, &s);
        free(s.v);
        return f;
    }
    if (c == '\\') {
        ps->p++;
        cpset s = {0};
        uint32_t cp;
        int r = parse_escape(ps, &s, &cp);
        gfrag f = r < 0 ? gb_empty(b) : r == 1 ? set_frag(ps, &s) : lit_frag(ps, cp);
        free(s.v);
        return f;
    }
    if (c == '^' || c == '$') {
        gb_fail(b, "regex: anchors are supported only at the start (^) and end ($)");
        return gb_empty(b);
    }
    if (c == '*' || c == '+' || c == '?') {
        gb_fail(b, "regex: nothing to repeat before '%c'", c);
        return gb_empty(b);
    }
    uint32_t cp;
    if (next_cp(ps, &cp)) return gb_empty(b);
    return lit_frag(ps, cp);
}

static gfrag parse_seq(re_parser *ps) {
    gbuild *b = ps->b;
    gfrag f = gb_empty(b);
    while (ps->p < ps->end && *ps->p != '|' && *ps->p != ')' && !b->failed) {
        if (*ps->p == '$' && ps->p + 1 == ps->end && ps->depth == 0) {   /* end anchor */
            ps->p++;
            break;
        }
        gfrag a = parse_atom(ps);
        for (;;) {
            int min, max;
            if (ps->p >= ps->end) break;
            unsigned char q = *ps->p;
            if (q == '*') min = 0, max = -1, ps->p++;
            else if (q == '+') min = 1, max = -1, ps->p++;
            else if (q == '?') min = 0, max = 1, ps->p++;
            else if (q == '{') {
                ps->p++;
                if (!parse_braces(ps, &min, &max)) {
                    ps->p--;
                    break;
                }
                if (min > RE_MAX_REPEAT || max > RE_MAX_REPEAT || (max >= 0 && max < min)) {
                    gb_fail(b, "regex: repetition {%d,%d} out of range (at most %d)", min, max, RE_MAX_REPEAT);
                    break;
                }
            } else {
                break;
            }
            if (ps->p < ps->end && *ps->p == '?') ps->p++;   /* lazy: same language */
            else if (ps->p < ps->end && *ps->p == '+') {
                gb_fail(b, "regex: possessive quantifiers are not supported");
                break;
            }
            a = gb_repeat(b, a, min, max);
        }
        f = gb_seq(b, f, a);
    }
    return f;
}

static gfrag parse_alt(re_parser *ps) {
    gfrag f = parse_seq(ps);
    while (ps->p < ps->end && *ps->p == '|' && !ps->b->failed) {
        ps->p++;
        f = gb_alt(ps->b, f, parse_seq(ps));
    }
    return f;
}

int grammar_class_frag(gbuild *b, const char *s, size_t len, size_t *used, gfrag *out) {
    re_parser ps = {.b = b, .p = (const unsigned char *)s, .end = (const unsigned char *)s + len,
                    .start = (const unsigned char *)s};
    *out = parse_class(&ps);
    *used = (size_t)(ps.p - ps.start);
    return b->failed ? -1 : 0;
}

int grammar_regex_frag(gbuild *b, const char *re, size_t len, int json_string, gfrag *out) {
    re_parser ps = {.b = b, .p = (const unsigned char *)re, .end = (const unsigned char *)re + len,
                    .start = (const unsigned char *)re, .json = json_string};
    int head = ps.p < ps.end && *ps.p == '^';
    if (head) ps.p++;
    int tail = len > 0 && re[len - 1] == '$' && !(len > 1 && re[len - 2] == '\\');
    gfrag f = parse_alt(&ps);
    if (!b->failed && ps.p < ps.end) gb_fail(b, "regex: unexpected '%c' at offset %d", *ps.p, (int)(ps.p - ps.start));
    if (b->failed) return -1;
    if (json_string && !head) f = gb_seq(b, gb_star(b, grammar_json_char(b)), f);
    if (json_string && !tail) f = gb_seq(b, f, gb_star(b, grammar_json_char(b)));
    *out = f;
    return b->failed ? -1 : 0;
}

int grammar_build_regex(gbuild *b, const char *spec, size_t len) {
    gfrag f;
    if (grammar_regex_frag(b, spec, len, 0, &f)) return -1;
    gb_rule_set(b, 0, f);
    return 0;
}
