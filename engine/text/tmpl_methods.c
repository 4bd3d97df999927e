/* Chat-template methods: Python's str / list / dict methods that templates call
 * ("x".startswith(...), d.items(), ...), the for-loop's `loop` attributes, and Python
 * string formatting (str.format and printf-style %). Indices and lengths count code
 * points, as Python strings do. Methods that mutate (list.append, dict.update, ...) are
 * reported unsafe, because HF's ImmutableSandboxedEnvironment refuses them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "engine/text/tmpl_internal.h"

tv *tmpl_arg(const tv_args *a, size_t i, const char *name) {
    if (i < a->npos) return a->pos[i];
    for (size_t k = 0; name && k < a->nkw; k++)
        if (!strcmp(a->kwn[k], name)) return a->kwv[k];
    return NULL;
}

size_t tmpl_utf8_next(const char *s, size_t len, uint32_t *cp) {
    utf8proc_int32_t c;
    utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &c);
    if (n <= 0) {
        *cp = (unsigned char)s[0];
        return 1;
    }
    *cp = (uint32_t)c;
    return (size_t)n;
}

int tmpl_is_space(uint32_t c) {
    return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

static void put_cp(tv_buf *b, uint32_t cp) {
    utf8proc_uint8_t tmp[8];
    utf8proc_ssize_t n = utf8proc_encode_char((utf8proc_int32_t)cp, tmp);
    tv_buf_put(b, (const char *)tmp, (size_t)n);
}

static tv *buf_result(tmpl_rt *rt, tv_buf *b) {
    if (b->oom) {
        tv_buf_free(b);
        return tmpl_oom(rt);
    }
    size_t n;
    char *s = tv_buf_take(b, &n);
    return s ? tv_str_take(s, n) : tmpl_oom(rt);
}

static int is_cased(uint32_t c) {
    utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

static int is_alnum(uint32_t c) {
    if (c == '_') return 0;
    utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
    return (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) ||
           (k >= UTF8PROC_CATEGORY_ND && k <= UTF8PROC_CATEGORY_NO);
}

tv *tmpl_str_case(tmpl_rt *rt, const tv *s, int mode) {
    tv_buf b = {0};
    int prev_cased = 0, first = 1, word_start = 1;
    for (size_t i = 0; i < s->u.str.len;) {
        uint32_t c;
        i += tmpl_utf8_next(s->u.str.s + i, s->u.str.len - i, &c);
        uint32_t o = c;
        switch (mode) {
        case TMPL_UPPER: o = (uint32_t)utf8proc_toupper((utf8proc_int32_t)c); break;
        case TMPL_LOWER: o = (uint32_t)utf8proc_tolower((utf8proc_int32_t)c); break;
        case TMPL_CAPITALIZE:
            o = (uint32_t)(first ? utf8proc_totitle((utf8proc_int32_t)c)
                                 : utf8proc_tolower((utf8proc_int32_t)c));
            break;
        case TMPL_PYTITLE:
            o = (uint32_t)(prev_cased ? utf8proc_tolower((utf8proc_int32_t)c)
                                      : utf8proc_totitle((utf8proc_int32_t)c));
            prev_cased = is_cased(c);
            break;
        case TMPL_JTITLE: {   /* jinja2's title: words begin after - space ( { [ < */
            int sep = tmpl_is_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
            o = sep ? c : (uint32_t)(word_start ? utf8proc_toupper((utf8proc_int32_t)c)
                                                : utf8proc_tolower((utf8proc_int32_t)c));
            word_start = sep;
            break;
        }
        }
        first = 0;
        put_cp(&b, o);
    }
    return buf_result(rt, &b);
}

tv *tmpl_with_safe(tmpl_rt *rt, tv *s, int safe) {
    if (!s || s->kind != TV_STR || s->u.str.safe == safe) return s;
    if (s->rc == 1) {
        s->u.str.safe = safe;
        return s;
    }
    tv *c = tv_str(s->u.str.s, s->u.str.len);
    tv_unref(s);
    if (!c) return tmpl_oom(rt);
    c->u.str.safe = safe;
    return c;
}

tv *tmpl_escape(tmpl_rt *rt, const tv *v) {
    if (v->kind == TV_STR && v->u.str.safe) return tv_ref((tv *)v);
    tv_buf src = {0}, b = {.limit = TMPL_MAX_OUTPUT};
    tv_write_str(&src, v);
    for (size_t i = 0; i < src.len; i++) {
        char c = src.s[i];
        if (c == '&') tv_buf_puts(&b, "&amp;");
        else if (c == '<') tv_buf_puts(&b, "&lt;");
        else if (c == '>') tv_buf_puts(&b, "&gt;");
        else if (c == '"') tv_buf_puts(&b, "&#34;");
        else if (c == '\'') tv_buf_puts(&b, "&#39;");
        else tv_buf_put(&b, &c, 1);
    }
    tv_buf_free(&src);
    return tmpl_with_safe(rt, buf_result(rt, &b), 1);
}

static int in_chars(const tv *chars, uint32_t c) {
    if (!chars) return tmpl_is_space(c);
    for (size_t i = 0; i < chars->u.str.len;) {
        uint32_t x;
        i += tmpl_utf8_next(chars->u.str.s + i, chars->u.str.len - i, &x);
        if (x == c) return 1;
    }
    return 0;
}

tv *tmpl_str_strip(tmpl_rt *rt, const tv *s, const tv *chars, int which) {
    if (chars && chars->kind == TV_NONE) chars = NULL;
    if (chars && chars->kind != TV_STR)
        return tmpl_fail(rt, "TypeError: strip arg must be None or str");
    const char *p = s->u.str.s;
    size_t lo = 0, hi = s->u.str.len;
    if (which & 1) {
        while (lo < hi) {
            uint32_t c;
            size_t n = tmpl_utf8_next(p + lo, hi - lo, &c);
            if (!in_chars(chars, c)) break;
            lo += n;
        }
    }
    if (which & 2) {
        while (hi > lo) {
            size_t st = hi - 1;
            while (st > lo && ((unsigned char)p[st] & 0xC0) == 0x80) st--;
            uint32_t c;
            tmpl_utf8_next(p + st, hi - st, &c);
            if (!in_chars(chars, c)) break;
            hi = st;
        }
    }
    tv *r = tv_str(p + lo, hi - lo);
    return r ? r : tmpl_oom(rt);
}

/* ---- str methods ---- */

#define SELF_STR(self) ((self)->u.str.s)
#define SELF_LEN(self) ((self)->u.str.len)

/* what: Python's wording before "must be str, not <type>" ("" for plain methods) */
static tv *need_str(tmpl_rt *rt, tv *v, const char *what) {
    if (v && v->kind == TV_STR) return v;
    if (!v) return tmpl_fail(rt, "TypeError: %smissing required argument", what);
    return tmpl_fail(rt, "TypeError: %smust be str, not %s", what, tv_type_name(v));
}

static tv *m_upper(tmpl_rt *rt, tv *self, const tv_args *a) { (void)a; return tmpl_str_case(rt, self, TMPL_UPPER); }
static tv *m_lower(tmpl_rt *rt, tv *self, const tv_args *a) { (void)a; return tmpl_str_case(rt, self, TMPL_LOWER); }
static tv *m_title(tmpl_rt *rt, tv *self, const tv_args *a) { (void)a; return tmpl_str_case(rt, self, TMPL_PYTITLE); }
static tv *m_capitalize(tmpl_rt *rt, tv *self, const tv_args *a) { (void)a; return tmpl_str_case(rt, self, TMPL_CAPITALIZE); }
static tv *m_strip(tmpl_rt *rt, tv *self, const tv_args *a) { return tmpl_str_strip(rt, self, tmpl_arg(a, 0, "chars"), 3); }
static tv *m_lstrip(tmpl_rt *rt, tv *self, const tv_args *a) { return tmpl_str_strip(rt, self, tmpl_arg(a, 0, "chars"), 1); }
static tv *m_rstrip(tmpl_rt *rt, tv *self, const tv_args *a) { return tmpl_str_strip(rt, self, tmpl_arg(a, 0, "chars"), 2); }

static int affix_match(const tv *self, const tv *x, int end) {
    if (x->u.str.len > SELF_LEN(self)) return 0;
    const char *at = end ? SELF_STR(self) + SELF_LEN(self) - x->u.str.len : SELF_STR(self);
    return !memcmp(at, x->u.str.s, x->u.str.len);
}

static tv *affix(tmpl_rt *rt, tv *self, const tv_args *a, int end) {
    tv *x = tmpl_arg(a, 0, NULL);
    if (x && x->kind == TV_LIST) {
        for (size_t i = 0; i < x->u.list.n; i++) {
            if (x->u.list.v[i]->kind != TV_STR)
                return tmpl_fail(rt, "TypeError: tuple for %s must only contain str, not %s",
                                 end ? "endswith" : "startswith", tv_type_name(x->u.list.v[i]));
            if (affix_match(self, x->u.list.v[i], end)) return tv_bool(1);
        }
        return tv_bool(0);
    }
    if (!x || x->kind != TV_STR)
        return tmpl_fail(rt, "TypeError: %s first arg must be str or a tuple of str, not %s",
                         end ? "endswith" : "startswith", x ? tv_type_name(x) : "nothing");
    return tv_bool(affix_match(self, x, end));
}
static tv *m_startswith(tmpl_rt *rt, tv *self, const tv_args *a) { return affix(rt, self, a, 0); }
static tv *m_endswith(tmpl_rt *rt, tv *self, const tv_args *a) { return affix(rt, self, a, 1); }

static int64_t int_arg(const tv *v, int64_t def) {
    if (!v || v->kind == TV_NONE) return def;
    if (v->kind == TV_INT) return v->u.i;
    if (v->kind == TV_BOOL) return v->u.b;
    return def;
}

/* Whitespace split works on bytes; only ASCII bytes may be spaces (0x85/0xA0 bytes are
 * parts of multi-byte characters there). */
static int ascii_space(char c) { return (unsigned char)c < 0x80 && tmpl_is_space((unsigned char)c); }

static tv *split_impl(tmpl_rt *rt, tv *self, const tv_args *a, int from_right) {
    tv *sep = tmpl_arg(a, 0, "sep");
    int64_t maxsplit = int_arg(tmpl_arg(a, 1, "maxsplit"), -1);
    if (sep && sep->kind == TV_NONE) sep = NULL;
    if (sep && sep->kind != TV_STR)
        return tmpl_fail(rt, "TypeError: must be str or None, not %s", tv_type_name(sep));
    if (sep && sep->u.str.len == 0) return tmpl_fail(rt, "ValueError: empty separator");
    tv *parts = tv_list();
    if (!parts) return tmpl_oom(rt);
    const char *s = SELF_STR(self);
    size_t len = SELF_LEN(self);
    /* collect (start, end) pieces in order of discovery, then reverse for rsplit */
    size_t cap = 16, n = 0;
    size_t *pe = malloc(cap * 2 * sizeof *pe);
    if (!pe) return tv_unref(parts), tmpl_oom(rt);
#define ADD(x, y) do { if (n == cap) { cap *= 2; size_t *np2 = realloc(pe, cap * 2 * sizeof *pe); \
        if (!np2) { free(pe); tv_unref(parts); return tmpl_oom(rt); } pe = np2; } \
        pe[2 * n] = (x); pe[2 * n + 1] = (y); n++; } while (0)
    if (sep) {
        size_t sl = sep->u.str.len;
        if (!from_right) {
            size_t st = 0;
            for (;;) {
                const char *hit = maxsplit == 0 ? NULL : memmem(s + st, len - st, sep->u.str.s, sl);
                if (!hit) break;
                ADD(st, (size_t)(hit - s));
                st = (size_t)(hit - s) + sl;
                if (maxsplit > 0) maxsplit--;
            }
            ADD(st, len);
        } else {
            size_t en = len;
            for (;;) {
                if (maxsplit == 0 || en < sl) break;
                size_t p = en - sl + 1, found = (size_t)-1;
                while (p-- > 0) {
                    if (!memcmp(s + p, sep->u.str.s, sl)) {
                        found = p;
                        break;
                    }
                }
                if (found == (size_t)-1) break;
                ADD(found + sl, en);
                en = found;
                if (maxsplit > 0) maxsplit--;
            }
            ADD(0, en);
        }
    } else if (!from_right) {
        size_t i = 0;
        for (;;) {
            while (i < len && ascii_space(s[i])) i++;
            if (i >= len) break;
            if (maxsplit == 0) {   /* the rest keeps its trailing whitespace */
                ADD(i, len);
                break;
            }
            size_t st = i;
            while (i < len && !ascii_space(s[i])) i++;
            ADD(st, i);
            if (maxsplit > 0) maxsplit--;
        }
    } else {
        size_t i = len;
        for (;;) {
            while (i > 0 && ascii_space(s[i - 1])) i--;
            if (i == 0) break;
            if (maxsplit == 0) {
                ADD(0, i);
                break;
            }
            size_t en = i;
            while (i > 0 && !ascii_space(s[i - 1])) i--;
            ADD(i, en);
            if (maxsplit > 0) maxsplit--;
        }
    }
#undef ADD
    for (size_t k = 0; k < n; k++) {
        size_t j = from_right ? n - 1 - k : k;
        if (tv_list_push_steal(parts, tv_str(s + pe[2 * j], pe[2 * j + 1] - pe[2 * j]))) {
            free(pe);
            tv_unref(parts);
            return tmpl_oom(rt);
        }
    }
    free(pe);
    return parts;
}
static tv *m_split(tmpl_rt *rt, tv *self, const tv_args *a) { return split_impl(rt, self, a, 0); }
static tv *m_rsplit(tmpl_rt *rt, tv *self, const tv_args *a) { return split_impl(rt, self, a, 1); }

static tv *m_splitlines(tmpl_rt *rt, tv *self, const tv_args *a) {
    int keep = tmpl_arg(a, 0, "keepends") && tv_truthy(tmpl_arg(a, 0, "keepends"));
    tv *l = tv_list();
    if (!l) return tmpl_oom(rt);
    const char *s = SELF_STR(self);
    size_t len = SELF_LEN(self), st = 0, i = 0;
    while (i < len) {
        size_t eol = 0;
        if (s[i] == '\r' && i + 1 < len && s[i + 1] == '\n') eol = 2;
        else if (s[i] == '\n' || s[i] == '\r' || s[i] == '\v' || s[i] == '\f' ||
                 (s[i] >= 0x1c && s[i] <= 0x1e)) eol = 1;
        if (!eol) {
            i++;
            continue;
        }
        if (tv_list_push_steal(l, tv_str(s + st, i - st + (keep ? eol : 0))))
            return tv_unref(l), tmpl_oom(rt);
        i += eol;
        st = i;
    }
    if (st < len && tv_list_push_steal(l, tv_str(s + st, len - st))) return tv_unref(l), tmpl_oom(rt);
    return l;
}

static tv *m_replace(tmpl_rt *rt, tv *self, const tv_args *a) {
    tv *old = tmpl_arg(a, 0, "old"), *new = tmpl_arg(a, 1, "new");
    int64_t count = int_arg(tmpl_arg(a, 2, "count"), -1);
    if (!need_str(rt, old, "replace() argument 1 ") || !need_str(rt, new, "replace() argument 2 "))
        return NULL;
    tv_buf b = {.limit = TMPL_MAX_OUTPUT};
    const char *s = SELF_STR(self);
    size_t len = SELF_LEN(self), i = 0;
    if (old->u.str.len == 0) {   /* Python inserts `new` around every code point */
        while (count != 0) {
            tv_buf_put(&b, new->u.str.s, new->u.str.len);
            if (count > 0) count--;
            if (i >= len) break;
            uint32_t c;
            size_t n = tmpl_utf8_next(s + i, len - i, &c);
            tv_buf_put(&b, s + i, n);
            i += n;
        }
        tv_buf_put(&b, s + i, len - i);
        return buf_result(rt, &b);
    }
    while (count != 0) {
        const char *hit = memmem(s + i, len - i, old->u.str.s, old->u.str.len);
        if (!hit) break;
        tv_buf_put(&b, s + i, (size_t)(hit - s) - i);
        tv_buf_put(&b, new->u.str.s, new->u.str.len);
        i = (size_t)(hit - s) + old->u.str.len;
        if (count > 0) count--;
    }
    tv_buf_put(&b, s + i, len - i);
    return buf_result(rt, &b);
}

static tv *find_impl(tmpl_rt *rt, tv *self, const tv_args *a, int rev, int strict) {
    tv *sub = tmpl_arg(a, 0, NULL);
    if (!need_str(rt, sub, "")) return NULL;
    const char *s = SELF_STR(self), *hit = NULL;
    size_t len = SELF_LEN(self), sl = sub->u.str.len;
    if (!rev) hit = memmem(s, len, sub->u.str.s, sl);
    else
        for (size_t p = len >= sl ? len - sl + 1 : 0; p-- > 0;)
            if (!memcmp(s + p, sub->u.str.s, sl)) {
                hit = s + p;
                break;
            }
    if (!hit && strict) return tmpl_fail(rt, "ValueError: substring not found");
    return tv_int(hit ? (int64_t)tv_utf8_len(s, (size_t)(hit - s)) : -1);
}
static tv *m_find(tmpl_rt *rt, tv *self, const tv_args *a) { return find_impl(rt, self, a, 0, 0); }
static tv *m_rfind(tmpl_rt *rt, tv *self, const tv_args *a) { return find_impl(rt, self, a, 1, 0); }
static tv *m_sindex(tmpl_rt *rt, tv *self, const tv_args *a) { return find_impl(rt, self, a, 0, 1); }
static tv *m_rindex(tmpl_rt *rt, tv *self, const tv_args *a) { return find_impl(rt, self, a, 1, 1); }

static tv *m_scount(tmpl_rt *rt, tv *self, const tv_args *a) {
    tv *sub = tmpl_arg(a, 0, NULL);
    if (!need_str(rt, sub, "")) return NULL;
    if (!sub->u.str.len) return tv_int((int64_t)tv_utf8_len(SELF_STR(self), SELF_LEN(self)) + 1);
    int64_t n = 0;
    const char *s = SELF_STR(self), *end = s + SELF_LEN(self);
    while ((s = memmem(s, (size_t)(end - s), sub->u.str.s, sub->u.str.len))) {
        n++;
        s += sub->u.str.len;
    }
    return tv_int(n);
}

static tv *m_join(tmpl_rt *rt, tv *self, const tv_args *a) {
    tv *x = tmpl_arg(a, 0, NULL);
    if (!x) return tmpl_fail(rt, "TypeError: join() takes exactly one argument (0 given)");
    tv *items = tmpl_iter_list(rt, x);
    if (!items) return NULL;
    tv_buf b = {.limit = TMPL_MAX_OUTPUT};
    for (size_t i = 0; i < items->u.list.n; i++) {
        tv *it = items->u.list.v[i];
        if (it->kind != TV_STR) {
            tv_buf_free(&b);
            tv_unref(items);
            return tmpl_fail(rt, "TypeError: sequence item %zu: expected str instance, %s found", i,
                             tv_type_name(it));
        }
        if (i) tv_buf_put(&b, SELF_STR(self), SELF_LEN(self));
        tv_buf_put(&b, it->u.str.s, it->u.str.len);
    }
    tv_unref(items);
    return buf_result(rt, &b);
}

static tv *str_pred(tv *self, int kind) {
    int any = 0, cased = 0, ok = 1;
    for (size_t i = 0; i < SELF_LEN(self) && ok;) {
        uint32_t c;
        i += tmpl_utf8_next(SELF_STR(self) + i, SELF_LEN(self) - i, &c);
        utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
        any = 1;
        switch (kind) {
        case 0: ok = k == UTF8PROC_CATEGORY_ND; break;                       /* isdigit */
        case 1: ok = k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO; break; /* isalpha */
        case 2: ok = is_alnum(c); break;                                      /* isalnum */
        case 3: ok = tmpl_is_space(c); break;                                 /* isspace */
        case 4: if (k == UTF8PROC_CATEGORY_LL) ok = 0; else if (k == UTF8PROC_CATEGORY_LU) cased = 1; break;
        case 5: if (k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LT) ok = 0; else if (k == UTF8PROC_CATEGORY_LL) cased = 1; break;
        }
    }
    if (kind >= 4) return tv_bool(ok && cased);
    return tv_bool(ok && any);
}
static tv *m_isdigit(tmpl_rt *rt, tv *self, const tv_args *a) { (void)rt; (void)a; return str_pred(self, 0); }
static tv *m_isalpha(tmpl_rt *rt, tv *self, const tv_args *a) { (void)rt; (void)a; return str_pred(self, 1); }
static tv *m_isalnum(tmpl_rt *rt, tv *self, const tv_args *a) { (void)rt; (void)a; return str_pred(self, 2); }
static tv *m_isspace(tmpl_rt *rt, tv *self, const tv_args *a) { (void)rt; (void)a; return str_pred(self, 3); }
static tv *m_isupper(tmpl_rt *rt, tv *self, const tv_args *a) { (void)rt; (void)a; return str_pred(self, 4); }
static tv *m_islower(tmpl_rt *rt, tv *self, const tv_args *a) { (void)rt; (void)a; return str_pred(self, 5); }

static tv *m_removeaffix(tmpl_rt *rt, tv *self, const tv_args *a, int end) {
    tv *x = tmpl_arg(a, 0, NULL);
    if (!need_str(rt, x, "")) return NULL;
    if (!affix_match(self, x, end)) return tv_ref(self);
    tv *r = tv_str(SELF_STR(self) + (end ? 0 : x->u.str.len), SELF_LEN(self) - x->u.str.len);
    return r ? r : tmpl_oom(rt);
}
static tv *m_removeprefix(tmpl_rt *rt, tv *self, const tv_args *a) { return m_removeaffix(rt, self, a, 0); }
static tv *m_removesuffix(tmpl_rt *rt, tv *self, const tv_args *a) { return m_removeaffix(rt, self, a, 1); }

/* str.format: {} / {0} / {name} / {name.attr} / {0[key]} fields with an optional
 * :spec of the form [[fill]align][sign][0][width][.precision][type]. */
static void format_spec(tv_buf *b, const tv *v, const char *spec, size_t sl);

static tv *m_format(tmpl_rt *rt, tv *self, const tv_args *a) {
    tv_buf b = {.limit = TMPL_MAX_OUTPUT};
    const char *s = SELF_STR(self);
    size_t len = SELF_LEN(self), auto_idx = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '}' && i + 1 < len && s[i + 1] == '}') {
            tv_buf_put(&b, "}", 1);
            i++;
            continue;
        }
        if (s[i] != '{') {
            tv_buf_put(&b, s + i, 1);
            continue;
        }
        if (i + 1 < len && s[i + 1] == '{') {
            tv_buf_put(&b, "{", 1);
            i++;
            continue;
        }
        const char *close = memchr(s + i, '}', len - i);
        if (!close) {
            tv_buf_free(&b);
            return tmpl_fail(rt, "ValueError: Single '{' encountered in format string");
        }
        const char *field = s + i + 1, *colon = memchr(field, ':', (size_t)(close - field));
        const char *fend = colon ? colon : close;
        size_t nl = 0;
        while (field + nl < fend && field[nl] != '.' && field[nl] != '[' && field[nl] != '!') nl++;
        tv *v = NULL;
        if (nl == 0) v = tmpl_arg(a, auto_idx++, NULL);
        else if (field[0] >= '0' && field[0] <= '9') v = tmpl_arg(a, (size_t)atoi(field), NULL);
        else
            for (size_t k = 0; k < a->nkw; k++)
                if (strlen(a->kwn[k]) == nl && !memcmp(a->kwn[k], field, nl)) v = a->kwv[k];
        if (!v) {
            tv_buf_free(&b);
            return tmpl_fail(rt, "IndexError: Replacement index %zu out of range for positional args tuple",
                             auto_idx ? auto_idx - 1 : 0);
        }
        tv_ref(v);
        const char *p = field + nl;
        while (v && p < fend && (*p == '.' || *p == '[')) {
            const char *q = p + 1;
            while (q < fend && *q != '.' && *q != '[' && *q != ']') q++;
            tv *key = (*p == '[' && *(p + 1) >= '0' && *(p + 1) <= '9') ? tv_int(atoll(p + 1))
                                                                        : tv_str(p + 1, (size_t)(q - p - 1));
            tv *nv = key ? (*p == '.' ? tmpl_getattr(rt, v, key->u.str.s) : tmpl_getitem(rt, v, key)) : NULL;
            tv_unref(key);
            tv_unref(v);
            v = nv;
            p = q < fend && *q == ']' ? q + 1 : q;
        }
        if (!v) {
            tv_buf_free(&b);
            return rt->failed ? NULL : tmpl_oom(rt);
        }
        if (colon) format_spec(&b, v, colon + 1, (size_t)(close - colon - 1));
        else tv_write_str(&b, v);
        tv_unref(v);
        i = (size_t)(close - s);
    }
    return buf_result(rt, &b);
}

static void pad_out(tv_buf *b, const char *body, size_t blen, char fill, char align, int width) {
    int n = (int)tv_utf8_len(body, blen), padn = width > n ? width - n : 0;
    int left = align == '>' ? padn : align == '^' ? padn / 2 : 0, right = padn - left;
    for (int k = 0; k < left; k++) tv_buf_put(b, &fill, 1);
    tv_buf_put(b, body, blen);
    for (int k = 0; k < right; k++) tv_buf_put(b, &fill, 1);
}

static void format_spec(tv_buf *b, const tv *v, const char *spec, size_t sl) {
    char fill = ' ', align = 0, type = 0;
    int width = 0, prec = -1, zero = 0;
    size_t i = 0;
    if (sl >= 2 && strchr("<>^", spec[1])) {
        fill = spec[0];
        align = spec[1];
        i = 2;
    } else if (sl >= 1 && strchr("<>^", spec[0])) {
        align = spec[0];
        i = 1;
    }
    if (i < sl && spec[i] == '0') zero = 1;
    while (i < sl && spec[i] >= '0' && spec[i] <= '9') width = width * 10 + (spec[i++] - '0');
    if (i < sl && spec[i] == '.') {
        prec = 0;
        i++;
        while (i < sl && spec[i] >= '0' && spec[i] <= '9') prec = prec * 10 + (spec[i++] - '0');
    }
    if (i < sl) type = spec[i];
    tv_buf body = {0};
    if (tv_is_number(v) && (type == 'f' || type == 'F' || type == 'e' || type == '%' ||
                            (v->kind == TV_FLOAT && prec >= 0 && !type))) {
        double x = tv_num(v) * (type == '%' ? 100 : 1);
        tv_buf_printf(&body, type == 'e' ? "%.*e" : "%.*f", prec < 0 ? 6 : prec, x);
        if (type == '%') tv_buf_put(&body, "%", 1);
    } else if (tv_is_number(v) && (type == 'x' || type == 'X' || type == 'o' || type == 'd')) {
        long long x = (long long)tv_num(v);
        tv_buf_printf(&body, type == 'x' ? "%llx" : type == 'X' ? "%llX" : type == 'o' ? "%llo" : "%lld", x);
    } else {
        tv_write_str(&body, v);
        if (prec >= 0 && v->kind == TV_STR)
            body.len = tv_utf8_offset(body.s, body.len, (size_t)prec);
    }
    if (!align) align = tv_is_number(v) ? '>' : '<';
    if (zero && tv_is_number(v)) fill = '0';
    pad_out(b, body.s ? body.s : "", body.len, fill, align, width);
    tv_buf_free(&body);
}

/* printf-style `fmt % args`: %s %r %d %i %f %e %g %x %o %c %% with flags and width. */
tv *tmpl_percent_format(tmpl_rt *rt, const tv *fmt, tv **args, size_t nargs) {
    tv_buf b = {.limit = TMPL_MAX_OUTPUT};
    const char *s = fmt->u.str.s;
    size_t len = fmt->u.str.len, ai = 0;
    /* one mapping argument: %(key)s takes from it, and it need not be used up */
    tv *mapping = nargs == 1 && args[0]->kind == TV_DICT ? args[0] : NULL;
    for (size_t i = 0; i < len; i++) {
        if (s[i] != '%') {
            tv_buf_put(&b, s + i, 1);
            continue;
        }
        char spec[32] = "%";
        size_t k = 1;
        i++;
        tv *keyed = NULL;
        if (i < len && s[i] == '(') {
            const char *close = memchr(s + i, ')', len - i);
            if (!close || !mapping) {
                tv_buf_free(&b);
                return tmpl_fail(rt, close ? "TypeError: format requires a mapping"
                                           : "ValueError: incomplete format key");
            }
            tv *key = tv_str(s + i + 1, (size_t)(close - s) - i - 1);
            keyed = key ? tv_dict_get(mapping, key) : NULL;
            if (!keyed) {
                tmpl_fail(rt, "KeyError: '%s'", key ? key->u.str.s : "");
                tv_unref(key);
                tv_buf_free(&b);
                return NULL;
            }
            tv_unref(key);
            i = (size_t)(close - s) + 1;
        }
        while (i < len && strchr("-+ #0", s[i]) && k < 8) spec[k++] = s[i++];
        while (i < len && ((s[i] >= '0' && s[i] <= '9') || s[i] == '.') && k < 24) spec[k++] = s[i++];
        if (i >= len) {
            tv_buf_free(&b);
            return tmpl_fail(rt, "ValueError: incomplete format");
        }
        char c = s[i];
        if (c == '%') {
            tv_buf_put(&b, "%", 1);
            continue;
        }
        if (!keyed && ai >= nargs) {
            tv_buf_free(&b);
            return tmpl_fail(rt, "TypeError: not enough arguments for format string");
        }
        tv *v = keyed ? keyed : args[ai++];
        if (c == 's' || c == 'r' || c == 'a') {
            tv_buf t = {0};
            if (c == 's') tv_write_str(&t, v);
            else tv_write_repr(&t, v);
            spec[k++] = 's';
            spec[k] = 0;
            tv_buf_printf(&b, spec, t.s ? t.s : "");
            tv_buf_free(&t);
        } else if (strchr("diouxXc", c) && tv_is_number(v)) {
            spec[k++] = 'l';
            spec[k++] = 'l';
            spec[k++] = c == 'i' || c == 'u' ? 'd' : c;
            spec[k] = 0;
            tv_buf_printf(&b, spec, (long long)tv_num(v));
        } else if (strchr("eEfFgG", c) && tv_is_number(v)) {
            spec[k++] = c;
            spec[k] = 0;
            tv_buf_printf(&b, spec, tv_num(v));
        } else {
            tv_buf_free(&b);
            return tmpl_fail(rt, "TypeError: %%%c format: a real number is required, not %s", c,
                             tv_type_name(v));
        }
    }
    if (ai < nargs && !mapping) {
        tv_buf_free(&b);
        return tmpl_fail(rt, "TypeError: not all arguments converted during string formatting");
    }
    return buf_result(rt, &b);
}

/* ---- list methods ---- */

static tv *m_lindex(tmpl_rt *rt, tv *self, const tv_args *a) {
    tv *x = tmpl_arg(a, 0, NULL);
    for (size_t i = 0; x && i < self->u.list.n; i++)
        if (tv_equal(self->u.list.v[i], x)) return tv_int((int64_t)i);
    tv_buf b = {0};
    if (x) tv_write_repr(&b, x);
    tmpl_fail(rt, "ValueError: %s is not in list", b.s ? b.s : "");
    tv_buf_free(&b);
    return NULL;
}

static tv *m_lcount(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)rt;
    tv *x = tmpl_arg(a, 0, NULL);
    int64_t n = 0;
    for (size_t i = 0; x && i < self->u.list.n; i++) n += tv_equal(self->u.list.v[i], x);
    return tv_int(n);
}

/* ---- dict methods ---- */

static tv *dict_view(tmpl_rt *rt, tv *self, int which) {
    tv *l = tv_view(which == 0 ? "dict_keys" : which == 1 ? "dict_values" : "dict_items");
    if (!l) return tmpl_oom(rt);
    for (size_t i = 0; i < self->u.dict.n; i++) {
        tv *it;
        if (which == 0) it = tv_ref(self->u.dict.k[i]);
        else if (which == 1) it = tv_ref(self->u.dict.v[i]);
        else {
            it = tv_tuple();
            if (it && (tv_list_push(it, self->u.dict.k[i]) || tv_list_push(it, self->u.dict.v[i]))) {
                tv_unref(it);
                it = NULL;
            }
        }
        if (tv_list_push_steal(l, it)) return tv_unref(l), tmpl_oom(rt);
    }
    return l;
}
static tv *m_keys(tmpl_rt *rt, tv *self, const tv_args *a) { (void)a; return dict_view(rt, self, 0); }
static tv *m_values(tmpl_rt *rt, tv *self, const tv_args *a) { (void)a; return dict_view(rt, self, 1); }
static tv *m_items(tmpl_rt *rt, tv *self, const tv_args *a) { (void)a; return dict_view(rt, self, 2); }

static tv *m_get(tmpl_rt *rt, tv *self, const tv_args *a) {
    tv *k = tmpl_arg(a, 0, NULL), *d = tmpl_arg(a, 1, "default");
    if (!k) return tmpl_fail(rt, "TypeError: get expected at least 1 argument, got 0");
    tv *v = tv_dict_get(self, k);
    return tv_ref(v ? v : d ? d : tv_none());
}

static tv *m_copy(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)a;
    tv *d = tv_dict();
    if (!d) return tmpl_oom(rt);
    for (size_t i = 0; i < self->u.dict.n; i++)
        if (tv_dict_set(d, self->u.dict.k[i], self->u.dict.v[i])) return tv_unref(d), tmpl_oom(rt);
    return d;
}

typedef struct {
    const char *name;
    tv_builtin_fn fn;
} method_entry;

static const method_entry str_methods[] = {
    {"upper", m_upper}, {"lower", m_lower}, {"title", m_title}, {"capitalize", m_capitalize},
    {"strip", m_strip}, {"lstrip", m_lstrip}, {"rstrip", m_rstrip},
    {"startswith", m_startswith}, {"endswith", m_endswith}, {"split", m_split},
    {"rsplit", m_rsplit}, {"splitlines", m_splitlines}, {"replace", m_replace},
    {"find", m_find}, {"rfind", m_rfind}, {"index", m_sindex}, {"rindex", m_rindex},
    {"count", m_scount}, {"join", m_join}, {"format", m_format}, {"isdigit", m_isdigit},
    {"isalpha", m_isalpha}, {"isalnum", m_isalnum}, {"isspace", m_isspace},
    {"isupper", m_isupper}, {"islower", m_islower}, {"removeprefix", m_removeprefix},
    {"removesuffix", m_removesuffix}, {NULL, NULL}};
static const method_entry list_methods[] = {{"index", m_lindex}, {"count", m_lcount}, {NULL, NULL}};
static const method_entry dict_methods[] = {{"keys", m_keys}, {"values", m_values},
                                            {"items", m_items}, {"get", m_get},
                                            {"copy", m_copy}, {NULL, NULL}};
static const char *const list_unsafe[] = {"append", "clear", "pop", "reverse", "insert",
                                          "sort", "extend", "remove", NULL};
static const char *const dict_unsafe[] = {"clear", "pop", "popitem", "setdefault", "update", NULL};

tv_builtin_fn tmpl_find_method(const tv *obj, const char *name, int *unsafe) {
    const method_entry *t = obj->kind == TV_STR ? str_methods
                          : obj->kind == TV_DICT ? dict_methods
                          : obj->kind == TV_LIST ? list_methods : NULL;
    const char *const *bad = obj->kind == TV_DICT ? dict_unsafe
                           : (obj->kind == TV_LIST && !obj->u.list.tuple) ? list_unsafe : NULL;
    *unsafe = 0;
    for (size_t i = 0; bad && bad[i]; i++)
        if (!strcmp(bad[i], name)) {
            *unsafe = 1;
            return NULL;
        }
    for (size_t i = 0; t && t[i].name; i++)
        if (!strcmp(t[i].name, name)) return t[i].fn;
    return NULL;
}

/* ---- loop ---- */

static tv *loop_cycle(tmpl_rt *rt, tv *self, const tv_args *a) {
    if (!a->npos) return tmpl_fail(rt, "TypeError: no items for cycling given");
    return tv_ref(a->pos[self->u.loop.index0 % (int64_t)a->npos]);
}

tv *tmpl_loop_attr(tmpl_rt *rt, tv *loop, const char *name) {
    int64_t i = loop->u.loop.index0, n = loop->u.loop.length;
    tv *r = NULL;
    if (!strcmp(name, "index")) r = tv_int(i + 1);
    else if (!strcmp(name, "index0")) r = tv_int(i);
    else if (!strcmp(name, "revindex")) r = tv_int(n - i);
    else if (!strcmp(name, "revindex0")) r = tv_int(n - i - 1);
    else if (!strcmp(name, "first")) r = tv_bool(i == 0);
    else if (!strcmp(name, "last")) r = tv_bool(i == n - 1);
    else if (!strcmp(name, "length")) r = tv_int(n);
    else if (!strcmp(name, "depth")) r = tv_int(1);
    else if (!strcmp(name, "depth0")) r = tv_int(0);
    else if (!strcmp(name, "previtem")) {
        if (i > 0) return tv_ref(loop->u.loop.items->u.list.v[i - 1]);
        r = tv_undef_hint("UndefinedError: there is no previous item");
    } else if (!strcmp(name, "nextitem")) {
        if (i + 1 < n) return tv_ref(loop->u.loop.items->u.list.v[i + 1]);
        r = tv_undef_hint("UndefinedError: there is no next item");
    } else if (!strcmp(name, "cycle")) {
        r = tv_func(loop_cycle, loop, "cycle");
    } else {
        return NULL;
    }
    return r ? r : tmpl_oom(rt);
}
