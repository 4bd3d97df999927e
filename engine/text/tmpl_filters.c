/* Chat-template filters: jinja2's builtin filters, each behaving as its jinja2 3.1
 * counterpart in HF's ImmutableSandboxedEnvironment, with HF's own tojson (json.dumps:
 * ensure_ascii=False by default, indent, separators, sort_keys). A filter receives its
 * operand as pos[0]. Tests and global functions are in tmpl_tests.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

#include "engine/text/tmpl_internal.h"

/* jinja2's make_attrgetter: "a.b.0" walks getitem per part (digits become ints). */
static tv *attr_path(tmpl_rt *rt, tv *item, const tv *attr, tv *def) {
    if (attr->kind != TV_STR) return tmpl_getitem(rt, item, (tv *)attr);
    tv *cur = tv_ref(item);
    const char *p = attr->u.str.s, *end = p + attr->u.str.len;
    while (cur && p <= end) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        if (!dot) dot = end;
        size_t n = (size_t)(dot - p);
        int digits = n > 0;
        for (size_t i = 0; i < n; i++)
            if (p[i] < '0' || p[i] > '9') digits = 0;
        tv *key = digits ? tv_int(atoll(p)) : tv_str(p, n);
        tv *nv = key ? tmpl_getitem(rt, cur, key) : tmpl_oom(rt);
        tv_unref(key);
        tv_unref(cur);
        cur = nv;
        p = dot + 1;
    }
    if (cur && def && cur->kind == TV_UNDEF) {
        tv_unref(cur);
        return tv_ref(def);
    }
    return cur;
}

static tv *buf_str(tmpl_rt *rt, tv_buf *b) {
    if (b->oom) {
        tv_buf_free(b);
        return tmpl_fail(rt, "MemoryError: string too large");
    }
    size_t n;
    char *s = tv_buf_take(b, &n);
    return s ? tmpl_oom_or(rt, tv_str_take(s, n)) : tmpl_oom(rt);
}

/* Filters that do arithmetic or int()/float() on the value itself raise on Undefined
 * (its __int__, __add__, ... fail), unlike string filters which see "". */
static int undef_raises(tmpl_rt *rt, const tv_args *a) {
    if (tmpl_arg0(a)->kind != TV_UNDEF) return 0;
    tmpl_undef_raise(rt, tmpl_arg0(a));
    return 1;
}

/* ---- string filters ---- */

/* String filters work on soft_str(value): a Markup stays a Markup through them. */
static int is_markup(const tv *v) { return v->kind == TV_STR && v->u.str.safe; }

static tv *f_case(tmpl_rt *rt, const tv_args *a, int mode) {
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!s) return NULL;
    tv *r = tmpl_str_case(rt, s, mode);
    tv_unref(s);
    return tmpl_with_safe(rt, r, is_markup(tmpl_arg0(a)));
}
static tv *f_upper(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return f_case(rt, a, TMPL_UPPER); }
static tv *f_lower(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return f_case(rt, a, TMPL_LOWER); }
static tv *f_title(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return f_case(rt, a, TMPL_JTITLE); }
static tv *f_capitalize(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return f_case(rt, a, TMPL_CAPITALIZE); }

static tv *f_trim(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!s) return NULL;
    tv *r = tmpl_str_strip(rt, s, tmpl_arg(a, 1, "chars"), 3);
    tv_unref(s);
    return tmpl_with_safe(rt, r, is_markup(tmpl_arg0(a)));
}

static tv *f_string(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return tmpl_to_str(rt, tmpl_arg0(a)); }

static tv *call_method(tmpl_rt *rt, tv *obj, const char *name, tv **pos, size_t np) {
    int unsafe;
    tv_builtin_fn m = tmpl_find_method(obj, name, &unsafe);
    tv_args a = {pos, np, NULL, NULL, 0};
    return m(rt, obj, &a);
}

static tv *f_replace(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!s) return NULL;
    tv *pos[3] = {tmpl_arg(a, 1, "old"), tmpl_arg(a, 2, "new"), tmpl_arg(a, 3, "count")};
    tv *r = NULL;
    if (!pos[0] || !pos[1]) tmpl_fail(rt, "TypeError: replace() missing required arguments");
    else {
        /* without autoescape jinja2 replaces on str(s): the result is never Markup */
        tv *o = tmpl_to_str(rt, pos[0]), *n = o ? tmpl_to_str(rt, pos[1]) : NULL;
        tv *p2[3] = {o, n, pos[2]};
        if (n) r = tmpl_with_safe(rt, call_method(rt, s, "replace", p2, pos[2] ? 3 : 2), 0);
        tv_unref(o);
        tv_unref(n);
    }
    tv_unref(s);
    return r;
}

static tv *f_escape(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return tmpl_escape(rt, tmpl_arg0(a)); }

static tv *f_forceescape(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!(s = tmpl_with_safe(rt, s, 0))) return NULL;
    tv *r = tmpl_escape(rt, s);
    tv_unref(s);
    return r;
}

static tv *f_safe(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    return tmpl_with_safe(rt, tmpl_to_str(rt, tmpl_arg0(a)), 1);
}

static tv *f_indent(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    if (undef_raises(rt, a)) return NULL;
    if (tmpl_arg0(a)->kind == TV_LIST && !tmpl_arg0(a)->u.list.view)   /* s += "\n" on the value itself */
        return tmpl_fail(rt, "AttributeError: 'list' object has no attribute 'splitlines'");
    if (tmpl_arg0(a)->kind != TV_STR)
        return tmpl_fail(rt, "TypeError: unsupported operand type(s) for +=: '%s' and 'str'",
                         tv_type_name(tmpl_arg0(a)));
    tv *w = tmpl_arg(a, 1, "width");
    int first = tmpl_arg(a, 2, "first") && tv_truthy(tmpl_arg(a, 2, "first"));
    int blank = tmpl_arg(a, 3, "blank") && tv_truthy(tmpl_arg(a, 3, "blank"));
    tv_buf ind = {0};
    if (w && w->kind == TV_STR) tv_buf_put(&ind, w->u.str.s, w->u.str.len);
    else
        for (int64_t i = 0; i < tmpl_int_or(w, 4); i++) tv_buf_put(&ind, " ", 1);
    tv_buf_put(&ind, "", 0);
    tv_buf src = {0};
    tv_write_str(&src, tmpl_arg0(a));
    tv_buf_put(&src, "\n", 1);   /* jinja2 appends a newline before splitlines */
    tv *s = src.oom ? NULL : tv_str_take(src.s, src.len);
    if (!s) {
        tv_buf_free(&ind);
        if (src.oom) tv_buf_free(&src);
        return tmpl_oom(rt);
    }
    tv *lines = call_method(rt, s, "splitlines", NULL, 0);
    tv_unref(s);
    if (!lines) return tv_buf_free(&ind), NULL;
    tv_buf b = {.limit = TMPL_MAX_OUTPUT};
    if (first) tv_buf_put(&b, ind.s, ind.len);
    for (size_t i = 0; i < lines->u.list.n; i++) {
        tv *ln = lines->u.list.v[i];
        if (i) {
            tv_buf_put(&b, "\n", 1);
            if (blank || ln->u.str.len) tv_buf_put(&b, ind.s, ind.len);
        }
        tv_buf_put(&b, ln->u.str.s, ln->u.str.len);
    }
    tv_unref(lines);
    tv_buf_free(&ind);
    return buf_str(rt, &b);
}

static tv *f_center(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!s) return NULL;
    int64_t width = tmpl_int_or(tmpl_arg(a, 1, "width"), 80);
    int64_t n = (int64_t)tv_utf8_len(s->u.str.s, s->u.str.len);
    if (width <= n) return s;
    int64_t marg = width - n, left = marg / 2 + (marg & width & 1);
    tv_buf b = {.limit = TMPL_MAX_OUTPUT};
    for (int64_t i = 0; i < left; i++) tv_buf_put(&b, " ", 1);
    tv_buf_put(&b, s->u.str.s, s->u.str.len);
    for (int64_t i = 0; i < marg - left; i++) tv_buf_put(&b, " ", 1);
    tv_unref(s);
    return buf_str(rt, &b);
}

static tv *f_truncate(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *v0 = tmpl_arg0(a);
    if (v0->kind != TV_STR) {   /* jinja2 takes len() of the value itself, then slices it */
        int64_t n0 = v0->kind == TV_LIST && !tv_is_iterator(v0) ? (int64_t)v0->u.list.n
                   : v0->kind == TV_DICT ? (int64_t)v0->u.dict.n : v0->kind == TV_UNDEF ? 0 : -1;
        if (n0 < 0)
            return tmpl_fail(rt, "TypeError: object of type '%s' has no len()", tv_type_name(v0));
        if (n0 <= tmpl_int_or(tmpl_arg(a, 1, "length"), 255) + tmpl_int_or(tmpl_arg(a, 4, "leeway"), 5))
            return tv_ref(v0);
        return tmpl_fail(rt, "AttributeError: '%s' object has no attribute 'rsplit'", tv_type_name(v0));
    }
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!s) return NULL;
    int64_t length = tmpl_int_or(tmpl_arg(a, 1, "length"), 255);
    int kill = tmpl_arg(a, 2, "killwords") && tv_truthy(tmpl_arg(a, 2, "killwords"));
    tv *endv = tmpl_arg(a, 3, "end");
    int64_t leeway = tmpl_int_or(tmpl_arg(a, 4, "leeway"), 5);
    const char *end = endv && endv->kind == TV_STR ? endv->u.str.s : "...";
    size_t endlen = strlen(end);
    int64_t n = (int64_t)tv_utf8_len(s->u.str.s, s->u.str.len);
    if (n <= length + leeway) return s;
    int64_t keep = length - (int64_t)tv_utf8_len(end, endlen);
    if (keep < 0) keep = 0;
    size_t cut = tv_utf8_offset(s->u.str.s, s->u.str.len, (size_t)keep);
    if (!kill) {
        size_t sp = cut;
        while (sp > 0 && s->u.str.s[sp - 1] != ' ') sp--;
        if (sp > 0) cut = sp - 1;
    }
    tv_buf b = {0};
    tv_buf_put(&b, s->u.str.s, cut);
    tv_buf_put(&b, end, endlen);
    tv_unref(s);
    return buf_str(rt, &b);
}

static tv *f_wordcount(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!s) return NULL;
    int64_t n = 0;
    int in_word = 0;
    for (size_t i = 0; i < s->u.str.len;) {
        uint32_t c;
        i += tmpl_utf8_next(s->u.str.s + i, s->u.str.len - i, &c);
        utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
        int w = c == '_' || (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) ||
                (k >= UTF8PROC_CATEGORY_ND && k <= UTF8PROC_CATEGORY_NO);
        if (w && !in_word) n++;
        in_word = w;
    }
    tv_unref(s);
    return tmpl_oom_or(rt, tv_int(n));
}

static tv *f_format(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!s) return NULL;
    tv *r = tmpl_percent_format(rt, s, a->pos + 1, a->npos ? a->npos - 1 : 0);
    tv_unref(s);
    return r;
}

static tv *f_tojson(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *asc = tmpl_arg(a, 1, "ensure_ascii"), *ind = tmpl_arg(a, 2, "indent");
    tv *seps = tmpl_arg(a, 3, "separators"), *sk = tmpl_arg(a, 4, "sort_keys");
    int indent = -1;
    if (ind && ind->kind != TV_NONE) {
        if (ind->kind != TV_INT && ind->kind != TV_BOOL)
            return tmpl_fail(rt, "TypeError: tojson indent must be an integer");
        indent = (int)tmpl_int_or(ind, 0);
        if (indent < 0) indent = 0;
    }
    char isep[64] = "", ksep[64] = "";
    if (seps && seps->kind == TV_LIST && seps->u.list.n == 2 &&
        seps->u.list.v[0]->kind == TV_STR && seps->u.list.v[1]->kind == TV_STR) {
        snprintf(isep, sizeof isep, "%s", seps->u.list.v[0]->u.str.s);
        snprintf(ksep, sizeof ksep, "%s", seps->u.list.v[1]->u.str.s);
    }
    tv_buf b = {.limit = TMPL_MAX_OUTPUT};
    char err[256] = "";
    if (tv_write_json(&b, tmpl_arg0(a), indent, *isep || *ksep ? isep : NULL, *ksep ? ksep : NULL,
                      sk && tv_truthy(sk), asc && tv_truthy(asc), err, sizeof err)) {
        tv_buf_free(&b);
        return tmpl_fail(rt, "%s", err);
    }
    return buf_str(rt, &b);
}

/* ---- numbers ---- */

static tv *f_abs(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *v = tmpl_arg0(a);
    if (v->kind == TV_INT) return tmpl_oom_or(rt, tv_int(v->u.i < 0 ? -v->u.i : v->u.i));
    if (v->kind == TV_BOOL) return tmpl_oom_or(rt, tv_int(v->u.b));
    if (v->kind == TV_FLOAT) return tmpl_oom_or(rt, tv_float(fabs(v->u.f)));
    return tmpl_fail(rt, "TypeError: bad operand type for abs(): '%s'", tv_type_name(v));
}

/* Python int(str): optional sign, digits with single underscores, surrounding spaces. */
static int parse_int(const char *s, int base, int64_t *out) {
    while (*s && tmpl_is_space((unsigned char)*s)) s++;
    char buf[128];
    size_t k = 0;
    for (; *s && !tmpl_is_space((unsigned char)*s) && k + 1 < sizeof buf; s++)
        if (*s != '_') buf[k++] = *s;
    buf[k] = 0;
    while (*s && tmpl_is_space((unsigned char)*s)) s++;
    if (*s || !k) return -1;
    char *end;
    long long v = strtoll(buf, &end, base);
    if (*end || end == buf) return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, double *out) {
    char *end;
    while (*s && tmpl_is_space((unsigned char)*s)) s++;
    if (!*s) return -1;
    double d = strtod(s, &end);
    if (end == s) return -1;
    while (*end && tmpl_is_space((unsigned char)*end)) end++;
    if (*end) return -1;
    *out = d;
    return 0;
}

static tv *f_int(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    if (undef_raises(rt, a)) return NULL;
    tv *v = tmpl_arg0(a), *def = tmpl_arg(a, 1, "default");
    int64_t base = tmpl_int_or(tmpl_arg(a, 2, "base"), 10);
    if (v->kind == TV_INT) return tv_ref(v);
    if (v->kind == TV_BOOL) return tmpl_oom_or(rt, tv_int(v->u.b));
    if (v->kind == TV_FLOAT && isfinite(v->u.f)) return tmpl_oom_or(rt, tv_int((int64_t)v->u.f));
    if (v->kind == TV_STR) {
        int64_t i;
        double d;
        if (!parse_int(v->u.str.s, (int)base, &i)) return tmpl_oom_or(rt, tv_int(i));
        if (!parse_float(v->u.str.s, &d) && isfinite(d)) return tmpl_oom_or(rt, tv_int((int64_t)d));
    }
    return def ? tv_ref(def) : tmpl_oom_or(rt, tv_int(0));
}

static tv *f_float(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    if (undef_raises(rt, a)) return NULL;
    tv *v = tmpl_arg0(a), *def = tmpl_arg(a, 1, "default");
    if (tv_is_number(v)) return tmpl_oom_or(rt, tv_float(tv_num(v)));
    double d;
    if (v->kind == TV_STR && !parse_float(v->u.str.s, &d)) return tmpl_oom_or(rt, tv_float(d));
    return def ? tv_ref(def) : tmpl_oom_or(rt, tv_float(0.0));
}

static tv *f_round(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *v = tmpl_arg0(a), *m = tmpl_arg(a, 2, "method");
    int64_t prec = tmpl_int_or(tmpl_arg(a, 1, "precision"), 0);
    if (!tv_is_number(v)) return tmpl_fail(rt, "TypeError: type %s doesn't define __round__ method", tv_type_name(v));
    double x = tv_num(v), p = pow(10, (double)prec);
    const char *method = m && m->kind == TV_STR ? m->u.str.s : "common";
    if (!strcmp(method, "common")) {
        if (v->kind != TV_FLOAT) return tmpl_oom_or(rt, tv_int((int64_t)x));   /* round(int) stays int */
        if (prec < 0 || prec > 30) return tmpl_oom_or(rt, tv_float(rint(x * p) / p));
        char tmp[512];
        snprintf(tmp, sizeof tmp, "%.*f", (int)prec, x);   /* correctly rounded, ties to even */
        return tmpl_oom_or(rt, tv_float(strtod(tmp, NULL)));
    }
    if (!strcmp(method, "floor")) return tmpl_oom_or(rt, tv_float(floor(x * p) / p));
    if (!strcmp(method, "ceil")) return tmpl_oom_or(rt, tv_float(ceil(x * p) / p));
    return tmpl_fail(rt, "FilterArgumentError: method must be common, ceil or floor");
}

/* ---- sequences ---- */

static tv *f_length(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *v = tmpl_arg0(a);
    switch (v->kind) {
    case TV_STR: return tmpl_oom_or(rt, tv_int((int64_t)tv_utf8_len(v->u.str.s, v->u.str.len)));
    case TV_LIST:
        if (tv_is_iterator(v))
            return tmpl_fail(rt, "TypeError: object of type '%s' has no len()", v->u.list.view);
        return tmpl_oom_or(rt, tv_int((int64_t)v->u.list.n));
    case TV_DICT:
    case TV_NS: return tmpl_oom_or(rt, tv_int((int64_t)v->u.dict.n));
    case TV_UNDEF: return tmpl_oom_or(rt, tv_int(0));
    default: return tmpl_fail(rt, "TypeError: object of type '%s' has no len()", tv_type_name(v));
    }
}

static tv *f_first_last(tmpl_rt *rt, const tv_args *a, int last) {
    tv *v = tmpl_arg0(a);
    if (last && (tv_is_iterator(v) || v->kind == TV_NONE || tv_is_number(v) || v->kind == TV_NS))
        return tmpl_fail(rt, "TypeError: '%s' object is not reversible", tv_type_name(v));
    if (!last && tv_is_iterator(v) && v->u.list.n && !v->u.list.pending) {   /* next(): one item */
        tv *r = v->u.list.v[0];
        memmove(v->u.list.v, v->u.list.v + 1, (v->u.list.n - 1) * sizeof *v->u.list.v);
        v->u.list.n--;
        return r;
    }
    tv *l = tmpl_iter_list(rt, v);
    if (!l) return NULL;
    tv *r;
    if (l->u.list.n) r = tv_ref(l->u.list.v[last ? l->u.list.n - 1 : 0]);
    else r = tmpl_oom_or(rt, tv_undef_hint("UndefinedError: No %s item, sequence was empty.",
                                      last ? "last" : "first"));
    tv_unref(l);
    return r;
}
static tv *f_first(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return f_first_last(rt, a, 0); }
static tv *f_last(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return f_first_last(rt, a, 1); }

static tv *copy_list(tmpl_rt *rt, tv *src) {
    tv *l = tv_list();
    if (!l) return tmpl_oom(rt);
    for (size_t i = 0; i < src->u.list.n; i++)
        if (tv_list_push(l, src->u.list.v[i])) return tv_unref(l), tmpl_oom(rt);
    return l;
}

static tv *f_list(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *it = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!it) return NULL;
    tv *l = copy_list(rt, it);
    tv_unref(it);
    return l;
}

static tv *f_join(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *sep = tmpl_arg(a, 1, "d"), *attr = tmpl_arg(a, 2, "attribute");
    tv *items = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!items) return NULL;
    tv_buf b = {.limit = TMPL_MAX_OUTPUT};
    for (size_t i = 0; i < items->u.list.n; i++) {
        if (i && sep) tv_write_str(&b, sep);
        tv *it = attr ? attr_path(rt, items->u.list.v[i], attr, NULL) : tv_ref(items->u.list.v[i]);
        if (!it) {
            tv_buf_free(&b);
            tv_unref(items);
            return NULL;
        }
        tv_write_str(&b, it);
        tv_unref(it);
    }
    tv_unref(items);
    return buf_str(rt, &b);
}

static tv *f_default(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    (void)rt;
    tv *v = tmpl_arg0(a), *def = tmpl_arg(a, 1, "default_value"), *boolean = tmpl_arg(a, 2, "boolean");
    int use_def = v->kind == TV_UNDEF || (boolean && tv_truthy(boolean) && !tv_truthy(v));
    if (!use_def) return tv_ref(v);
    return def ? tv_ref(def) : tmpl_oom_or(rt, tv_str("", 0));
}

static tv *f_items_now(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *v = tmpl_arg0(a);
    if (v->kind == TV_UNDEF) return tmpl_oom_or(rt, tv_view("generator"));
    if (v->kind != TV_DICT) return tmpl_fail(rt, "TypeError: Can only get item pairs from a mapping.");
    tv *r = call_method(rt, v, "items", NULL, 0);
    if (r) r->u.list.view = "generator";   /* jinja2's items filter yields the pairs */
    return r;
}

static tv *f_reverse(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *v = tmpl_arg0(a);
    if (v->kind != TV_LIST && v->kind != TV_STR && v->kind != TV_DICT && v->kind != TV_UNDEF)
        return tmpl_fail(rt, "FilterArgumentError: argument must be iterable");
    tv *it = tmpl_iter_list(rt, v);
    if (!it) return NULL;
    tv *r = NULL;
    if (v->kind == TV_STR) {
        tv_buf b = {0};
        for (size_t i = it->u.list.n; i-- > 0;) tv_buf_put(&b, it->u.list.v[i]->u.str.s, it->u.list.v[i]->u.str.len);
        r = buf_str(rt, &b);
    } else if (v->kind == TV_UNDEF) {   /* reversed(Undefined) is a (empty) reversed object */
        r = tmpl_oom_or(rt, tv_view("reversed"));
    } else if ((r = tv_view(v->kind != TV_LIST || tv_is_iterator(v) ? NULL
                            : v->u.list.tuple ? "reversed" : "list_reverseiterator"))) {
        /* reversed(x) is an iterator; a generator cannot be reversed, so jinja2 makes a list */
        if (v->kind == TV_DICT) r->u.list.view = "dict_reversekeyiterator";
        if (v->kind == TV_LIST && v->u.list.view && !strcmp(v->u.list.view, "range"))
            r->u.list.view = "range_iterator";
        for (size_t i = it->u.list.n; i-- > 0;)
            if (tv_list_push(r, it->u.list.v[i])) {
                tv_unref(r);
                r = tmpl_oom(rt);
                break;
            }
    } else {
        tmpl_oom(rt);
    }
    tv_unref(it);
    return r;
}

/* Sort key: the attribute (if any), lower-cased when comparing strings case-blind. */
static tv *sort_key(tmpl_rt *rt, tv *item, tv *attr, int case_sensitive) {
    tv *k = attr ? attr_path(rt, item, attr, NULL) : tv_ref(item);
    if (k && !case_sensitive && k->kind == TV_STR) {
        tv *l = tmpl_str_case(rt, k, TMPL_LOWER);
        tv_unref(k);
        k = l;
    }
    return k;
}

/* Stable merge sort of idx[] by keys[]; returns -1 after a comparison TypeError. */
static int merge_sort(tmpl_rt *rt, size_t *idx, size_t *tmp, size_t n, tv **keys, int rev) {
    if (n < 2) return 0;
    size_t h = n / 2;
    if (merge_sort(rt, idx, tmp, h, keys, rev) || merge_sort(rt, idx + h, tmp, n - h, keys, rev)) return -1;
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        int c = tmpl_compare(rt, keys[idx[j]], keys[idx[i]]);
        if (c == -2) return -1;
        if (rev ? c > 0 : c < 0) tmp[k++] = idx[j++];
        else tmp[k++] = idx[i++];
    }
    while (i < h) tmp[k++] = idx[i++];
    while (j < n) tmp[k++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *idx);
    return 0;
}

/* Sorted copy of items (a list) by key; NULL on error. */
static tv *sorted(tmpl_rt *rt, tv *items, tv *attr, int cs, int rev, tv *(*keyf)(tmpl_rt *, tv *, tv *, int)) {
    size_t n = items->u.list.n;
    tv **keys = calloc(n + 1, sizeof *keys);
    size_t *idx = malloc((n + 1) * sizeof *idx), *tmp = malloc((n + 1) * sizeof *tmp);
    tv *r = NULL;
    if (!keys || !idx || !tmp) {
        tmpl_oom(rt);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        idx[i] = i;
        if (!(keys[i] = keyf(rt, items->u.list.v[i], attr, cs))) goto done;
    }
    if (merge_sort(rt, idx, tmp, n, keys, rev)) goto done;
    if (!(r = tv_list())) {
        tmpl_oom(rt);
        goto done;
    }
    for (size_t i = 0; i < n; i++)
        if (tv_list_push(r, items->u.list.v[idx[i]])) {
            tv_unref(r);
            r = tmpl_oom(rt);
            break;
        }
done:
    for (size_t i = 0; keys && i < n; i++) tv_unref(keys[i]);
    free(keys);
    free(idx);
    free(tmp);
    return r;
}

static tv *f_sort(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *rev = tmpl_arg(a, 1, "reverse"), *cs = tmpl_arg(a, 2, "case_sensitive");
    tv *attr = tmpl_arg(a, 3, "attribute");
    tv *items = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!items) return NULL;
    tv *r = sorted(rt, items, attr, cs && tv_truthy(cs), rev && tv_truthy(rev), sort_key);
    tv_unref(items);
    return r;
}

static tv *pair_key(tmpl_rt *rt, tv *pair, tv *by, int cs) {
    return sort_key(rt, pair->u.list.v[by->u.i], NULL, cs);
}

static tv *f_dictsort(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *cs = tmpl_arg(a, 1, "case_sensitive"), *by = tmpl_arg(a, 2, "by"), *rev = tmpl_arg(a, 3, "reverse");
    if (tmpl_arg0(a)->kind != TV_DICT)
        return tmpl_fail(rt, "AttributeError: '%s' object has no attribute 'items'", tv_type_name(tmpl_arg0(a)));
    tv *items = call_method(rt, tmpl_arg0(a), "items", NULL, 0);
    if (!items) return NULL;
    int by_value = by && by->kind == TV_STR && !strcmp(by->u.str.s, "value");
    tv *pos = tv_int(by_value);
    tv *r = pos ? sorted(rt, items, pos, cs && tv_truthy(cs), rev && tv_truthy(rev), pair_key) : tmpl_oom(rt);
    tv_unref(pos);
    tv_unref(items);
    return r;
}

static tv *f_unique_now(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *cs = tmpl_arg(a, 1, "case_sensitive"), *attr = tmpl_arg(a, 2, "attribute");
    tv *items = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!items) return NULL;
    tv *r = tv_view("generator"), *seen = tv_list();
    for (size_t i = 0; r && seen && i < items->u.list.n; i++) {
        tv *k = sort_key(rt, items->u.list.v[i], attr, cs && tv_truthy(cs));
        if (!k) {
            tv_unref(r);
            r = NULL;
            break;
        }
        int dup = 0;
        for (size_t j = 0; j < seen->u.list.n && !dup; j++) dup = tv_equal(seen->u.list.v[j], k);
        if (!dup && (tv_list_push(seen, k) || tv_list_push(r, items->u.list.v[i]))) {
            tv_unref(r);
            r = tmpl_oom(rt);
        }
        tv_unref(k);
    }
    if (!seen && r) {
        tv_unref(r);
        r = tmpl_oom(rt);
    }
    tv_unref(seen);
    tv_unref(items);
    return r;
}

static tv *f_minmax(tmpl_rt *rt, const tv_args *a, int want_max) {
    tv *cs = tmpl_arg(a, 1, "case_sensitive"), *attr = tmpl_arg(a, 2, "attribute");
    tv *items = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!items) return NULL;
    if (!items->u.list.n) {
        tv_unref(items);
        return tmpl_oom_or(rt, tv_undef_hint("UndefinedError: No aggregated item, sequence was empty."));
    }
    tv *best = NULL, *bestk = NULL;
    for (size_t i = 0; i < items->u.list.n; i++) {
        tv *k = sort_key(rt, items->u.list.v[i], attr, cs && tv_truthy(cs));
        if (!k) goto fail;
        int c = bestk ? tmpl_compare(rt, k, bestk) : 1;
        if (c == -2) {
            tv_unref(k);
            goto fail;
        }
        if (!bestk || (want_max ? c > 0 : c < 0)) {
            tv_unref(bestk);
            bestk = k;
            best = items->u.list.v[i];
        } else {
            tv_unref(k);
        }
    }
    tv_ref(best);
    tv_unref(bestk);
    tv_unref(items);
    return best;
fail:
    tv_unref(bestk);
    tv_unref(items);
    return NULL;
}
static tv *f_max(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return f_minmax(rt, a, 1); }
static tv *f_min(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return f_minmax(rt, a, 0); }

static tv *f_sum(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *attr = tmpl_arg(a, 1, "attribute"), *start = tmpl_arg(a, 2, "start");
    tv *items = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!items) return NULL;
    tv *acc = start ? tv_ref(start) : tmpl_oom_or(rt, tv_int(0));
    for (size_t i = 0; acc && i < items->u.list.n; i++) {
        tv *x = attr ? attr_path(rt, items->u.list.v[i], attr, NULL) : tv_ref(items->u.list.v[i]);
        if (!x) {
            tv_unref(acc);
            acc = NULL;
            break;
        }
        tv *nacc = NULL;
        if (!tv_is_number(acc) || !tv_is_number(x))
            tmpl_fail(rt, "TypeError: unsupported operand type(s) for +: '%s' and '%s'",
                      tv_type_name(acc), tv_type_name(x));
        else if (acc->kind == TV_FLOAT || x->kind == TV_FLOAT) nacc = tmpl_oom_or(rt, tv_float(tv_num(acc) + tv_num(x)));
        else nacc = tmpl_oom_or(rt, tv_int((int64_t)tv_num(acc) + (int64_t)tv_num(x)));
        tv_unref(x);
        tv_unref(acc);
        acc = nacc;
    }
    tv_unref(items);
    return acc;
}

static tv *f_batch_now(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    int64_t n = tmpl_int_or(tmpl_arg(a, 1, "linecount"), 0);
    tv *fill = tmpl_arg(a, 2, "fill_with");
    if (n <= 0) return tmpl_fail(rt, "ValueError: batch size must be positive");
    tv *items = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!items) return NULL;
    tv *r = tv_view("generator"), *cur = NULL;
    for (size_t i = 0; r && i < items->u.list.n; i++) {
        if (!cur && !(cur = tv_list())) break;
        if (tv_list_push(cur, items->u.list.v[i])) break;
        if ((int64_t)cur->u.list.n == n) {
            if (tv_list_push_steal(r, cur)) {
                cur = NULL;
                break;
            }
            cur = NULL;
        }
    }
    if (r && cur) {
        while (fill && (int64_t)cur->u.list.n < n) tv_list_push(cur, fill);
        tv_list_push_steal(r, cur);
    }
    tv_unref(items);
    return tmpl_oom_or(rt, r);
}

/* ---- map / select ---- */

static tv *f_map_now(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *attr = tmpl_arg(a, a->npos + 8, "attribute"), *def = tmpl_arg(a, a->npos + 8, "default");
    tv *fname = a->npos > 1 ? a->pos[1] : NULL;
    if (!attr && (!fname || fname->kind != TV_STR))
        return tmpl_fail(rt, "FilterArgumentError: map requires a filter name or attribute=");
    if (!tv_truthy(tmpl_arg0(a))) return tmpl_oom_or(rt, tv_view("generator"));   /* jinja2: `if value:` */
    tv *items = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!items) return NULL;
    tv *r = tv_view("generator");
    tv_args extra = {a->npos > 2 ? a->pos + 2 : NULL, a->npos > 2 ? a->npos - 2 : 0, a->kwn, a->kwv, a->nkw};
    for (size_t i = 0; r && i < items->u.list.n; i++) {
        tv *x = attr ? attr_path(rt, items->u.list.v[i], attr, def)
                     : tmpl_apply_filter(rt, fname->u.str.s, items->u.list.v[i], &extra);
        if (!x || tv_list_push_steal(r, x)) {
            tv_unref(r);
            r = NULL;
        }
    }
    tv_unref(items);
    if (!r && !rt->failed) tmpl_oom(rt);
    return r;
}

/* select / reject / selectattr / rejectattr: keep items whose (attribute's) test result
 * equals want; with no test name, truthiness decides. */
static tv *select_impl(tmpl_rt *rt, const tv_args *a, int by_attr, int want) {
    size_t ti = by_attr ? 2 : 1;
    tv *attr = by_attr ? tmpl_arg(a, 1, NULL) : NULL;
    if (by_attr && !attr) return tmpl_fail(rt, "TypeError: selectattr requires an attribute name");
    tv *test = a->npos > ti ? a->pos[ti] : NULL;
    if (test && test->kind != TV_STR) return tmpl_fail(rt, "TypeError: test name must be a string");
    tv_args extra = {a->npos > ti + 1 ? a->pos + ti + 1 : NULL, a->npos > ti + 1 ? a->npos - ti - 1 : 0,
                     NULL, NULL, 0};
    if (!tv_truthy(tmpl_arg0(a))) return tmpl_oom_or(rt, tv_view("generator"));   /* jinja2: `if value:` */
    tv *items = tmpl_iter_list(rt, tmpl_arg0(a));
    if (!items) return NULL;
    tv *r = tv_view("generator");
    for (size_t i = 0; r && i < items->u.list.n; i++) {
        tv *it = items->u.list.v[i];
        tv *x = attr ? attr_path(rt, it, attr, NULL) : tv_ref(it);
        tv *res = !x ? NULL : test ? tmpl_apply_test(rt, test->u.str.s, x, &extra) : tv_ref(x);
        tv_unref(x);
        if (!res) {
            tv_unref(r);
            r = NULL;
            break;
        }
        int keep = tv_truthy(res) == want;
        tv_unref(res);
        if (keep && tv_list_push(r, it)) {
            tv_unref(r);
            r = NULL;
        }
    }
    tv_unref(items);
    if (!r && !rt->failed) tmpl_oom(rt);
    return r;
}
/* jinja2's map, select*, reject*, unique, batch and items are generators: their bodies run
 * only when the result is iterated. We compute eagerly, but an error on the way is kept in
 * the generator and raised when (if ever) it is consumed, as jinja2 would. */
static tv *lazy(tmpl_rt *rt, tv *r, const char *origin) {
    if (!rt->failed) {
        if (r && tv_is_iterator(r)) r->u.list.origin = origin;
        return r;
    }
    tv_unref(r);
    tv *g = tv_view("generator");
    if (g) g->u.list.origin = origin;
    if (!g || !(g->u.list.pending = strdup(rt->err ? rt->err : "error"))) {
        tv_unref(g);
        return NULL;   /* keeps the error as raised */
    }
    rt->failed = 0;
    if (rt->err && rt->errlen) rt->err[0] = 0;
    return g;
}

static tv *f_select(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return lazy(rt, select_impl(rt, a, 0, 1), "select_or_reject"); }
static tv *f_reject(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return lazy(rt, select_impl(rt, a, 0, 0), "select_or_reject"); }
static tv *f_selectattr(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return lazy(rt, select_impl(rt, a, 1, 1), "select_or_reject"); }
static tv *f_rejectattr(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return lazy(rt, select_impl(rt, a, 1, 0), "select_or_reject"); }
static tv *f_map(tmpl_rt *rt, tv *self, const tv_args *a) { return lazy(rt, f_map_now(rt, self, a), "sync_do_map"); }
static tv *f_unique(tmpl_rt *rt, tv *self, const tv_args *a) { return lazy(rt, f_unique_now(rt, self, a), "sync_do_unique"); }
static tv *f_batch(tmpl_rt *rt, tv *self, const tv_args *a) { return lazy(rt, f_batch_now(rt, self, a), "do_batch"); }
static tv *f_items(tmpl_rt *rt, tv *self, const tv_args *a) { return lazy(rt, f_items_now(rt, self, a), "do_items"); }

static tv *f_attr(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *name = tmpl_arg(a, 1, "name");
    if (!name || name->kind != TV_STR) return tmpl_fail(rt, "TypeError: attr name must be a string");
    tv *v = tmpl_arg0(a);
    if (v->kind == TV_DICT) {   /* sandboxed getattr: methods only, never keys */
        int unsafe;
        tv_builtin_fn m = tmpl_find_method(v, name->u.str.s, &unsafe);
        if (m) return tmpl_oom_or(rt, tv_func(m, v, "method"));
        return tmpl_oom_or(rt, tv_undef_hint("UndefinedError: 'dict object' has no attribute '%s'", name->u.str.s));
    }
    return tmpl_getattr(rt, v, name->u.str.s);
}

static tv *f_pprint(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv_buf b = {0};
    tv_write_repr(&b, tmpl_arg0(a));
    return buf_str(rt, &b);
}

typedef struct {
    const char *name;
    tv_builtin_fn fn;
} entry;

static const entry filters[] = {
    {"abs", f_abs}, {"attr", f_attr}, {"batch", f_batch}, {"capitalize", f_capitalize},
    {"center", f_center}, {"count", f_length}, {"d", f_default}, {"default", f_default},
    {"dictsort", f_dictsort}, {"e", f_escape}, {"escape", f_escape}, {"first", f_first},
    {"float", f_float}, {"forceescape", f_forceescape}, {"format", f_format}, {"indent", f_indent},
    {"int", f_int}, {"items", f_items}, {"join", f_join}, {"last", f_last},
    {"length", f_length}, {"list", f_list}, {"lower", f_lower}, {"map", f_map}, {"max", f_max},
    {"min", f_min}, {"pprint", f_pprint}, {"reject", f_reject}, {"rejectattr", f_rejectattr},
    {"replace", f_replace}, {"reverse", f_reverse}, {"round", f_round}, {"safe", f_safe},
    {"select", f_select}, {"selectattr", f_selectattr}, {"sort", f_sort}, {"string", f_string},
    {"sum", f_sum}, {"title", f_title}, {"tojson", f_tojson}, {"trim", f_trim},
    {"truncate", f_truncate}, {"unique", f_unique}, {"upper", f_upper},
    {"wordcount", f_wordcount}, {NULL, NULL}};

static tv_builtin_fn find(const entry *t, const char *name) {
    for (size_t i = 0; t[i].name; i++)
        if (!strcmp(t[i].name, name)) return t[i].fn;
    return NULL;
}

tv_builtin_fn tmpl_find_filter(const char *name) { return find(filters, name); }
