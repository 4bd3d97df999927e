/* Chat-template tests (`x is defined`, `n is divisibleby 3`, ...) as jinja2 3.1 defines
 * them, and the global functions of HF's environment: range (the sandbox's, capped at
 * MAX_RANGE), dict, namespace, joiner, raise_exception (TemplateError with the message)
 * and strftime_now (the render's clock, local time). Tests receive the operand as pos[0]. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/text/tmpl_internal.h"

static tv *call_method(tmpl_rt *rt, tv *obj, const char *name, tv **pos, size_t np) {
    int unsafe;
    tv_builtin_fn m = tmpl_find_method(obj, name, &unsafe);
    tv_args a = {pos, np, NULL, NULL, 0};
    return m(rt, obj, &a);
}

/* ---- tests ---- */

#define TEST(name, expr) \
    static tv *name(tmpl_rt *rt, tv *self, const tv_args *a) { \
        (void)rt; (void)self; tv *v = tmpl_arg0(a); (void)v; return tv_bool(expr); }

TEST(t_defined, v->kind != TV_UNDEF)
TEST(t_undefined, v->kind == TV_UNDEF)
TEST(t_none, v->kind == TV_NONE)
TEST(t_boolean, v->kind == TV_BOOL)
TEST(t_true, v->kind == TV_BOOL && v->u.b)
TEST(t_false, v->kind == TV_BOOL && !v->u.b)
TEST(t_integer, v->kind == TV_INT)
TEST(t_float, v->kind == TV_FLOAT)
TEST(t_number, tv_is_number(v))
TEST(t_string, v->kind == TV_STR)
TEST(t_mapping, v->kind == TV_DICT)
TEST(t_iterable, v->kind == TV_STR || v->kind == TV_LIST || v->kind == TV_DICT || v->kind == TV_UNDEF)
TEST(t_sequence, v->kind == TV_STR || v->kind == TV_DICT || v->kind == TV_UNDEF ||
                (v->kind == TV_LIST && (!v->u.list.view || !strcmp(v->u.list.view, "range"))))
TEST(t_callable, v->kind == TV_MACRO || v->kind == TV_FUNC || v->kind == TV_LOOP)
TEST(t_escaped, 0)

static tv *t_sameas(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)rt;
    (void)self;
    tv *v = tmpl_arg0(a), *o = tmpl_arg(a, 1, "other");
    if (!o) return tv_bool(0);
    if (v == o) return tv_bool(1);
    if (v->kind == TV_NONE || v->kind == TV_BOOL) return tv_bool(v->kind == o->kind && tv_equal(v, o));
    return tv_bool(0);
}

static tv *case_test(tmpl_rt *rt, const tv_args *a, int upper) {
    tv *s = tmpl_to_str(rt, tmpl_arg0(a));
    if (!s) return NULL;
    tv *r = call_method(rt, s, upper ? "isupper" : "islower", NULL, 0);
    tv_unref(s);
    return r;
}
static tv *t_lower(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return case_test(rt, a, 0); }
static tv *t_upper(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return case_test(rt, a, 1); }

static tv *int_mod(tmpl_rt *rt, tv *v, int64_t m, int *res) {
    if (v->kind == TV_UNDEF) return tmpl_undef_raise(rt, v);
    if (v->kind == TV_STR)   /* str % int is printf formatting with too many arguments */
        return tmpl_fail(rt, "TypeError: not all arguments converted during string formatting");
    if (!tv_is_number(v) || m == 0)
        return tmpl_fail(rt, m ? "TypeError: unsupported operand type(s) for %%: '%s' and 'int'"
                               : "ZeroDivisionError: integer division or modulo by zero%s",
                         m ? tv_type_name(v) : "");
    /* *res = Python's value % m (0 divisible/even, 1 odd; a float may be neither) */
    if (v->kind == TV_FLOAT) {
        double r = fmod(v->u.f, (double)m);
        if (r != 0 && ((r < 0) != (m < 0))) r += (double)m;
        *res = r == 0 ? 0 : r == 1 ? 1 : 2;
    } else {
        int64_t r = (v->kind == TV_INT ? v->u.i : v->u.b) % m;
        if (r != 0 && ((r < 0) != (m < 0))) r += m;
        *res = r == 0 ? 0 : r == 1 ? 1 : 2;
    }
    return tv_bool(1);
}
static tv *t_divisibleby(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    int r;
    tv *n = tmpl_arg(a, 1, "num");
    if (!n || !tv_is_number(n)) return tmpl_fail(rt, "TypeError: divisibleby needs a number");
    return int_mod(rt, tmpl_arg0(a), tmpl_int_or(n, 1), &r) ? tv_bool(r == 0) : NULL;
}
static tv *t_even(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    int r;
    return int_mod(rt, tmpl_arg0(a), 2, &r) ? tv_bool(r == 0) : NULL;
}
static tv *t_odd(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    int r;
    return int_mod(rt, tmpl_arg0(a), 2, &r) ? tv_bool(r == 1) : NULL;
}

static tv *cmp_test(tmpl_rt *rt, const tv_args *a, int op) {
    tv *o = tmpl_arg(a, 1, "other");
    if (!o) return tmpl_fail(rt, "TypeError: test requires an argument");
    if (op == 0) return tv_bool(tv_equal(tmpl_arg0(a), o));
    if (op == 1) return tv_bool(!tv_equal(tmpl_arg0(a), o));
    int c = tmpl_compare(rt, tmpl_arg0(a), o);
    if (c == -2) return NULL;
    return tv_bool(op == 2 ? c < 0 : op == 3 ? c <= 0 : op == 4 ? c > 0 : c >= 0);
}
static tv *t_eq(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return cmp_test(rt, a, 0); }
static tv *t_ne(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return cmp_test(rt, a, 1); }
static tv *t_lt(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return cmp_test(rt, a, 2); }
static tv *t_le(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return cmp_test(rt, a, 3); }
static tv *t_gt(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return cmp_test(rt, a, 4); }
static tv *t_ge(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return cmp_test(rt, a, 5); }

static tv *t_in(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *seq = tmpl_arg(a, 1, "seq"), *v = tmpl_arg0(a);
    if (!seq) return tmpl_fail(rt, "TypeError: in test requires a sequence");
    if (seq->kind == TV_STR) {
        if (v->kind != TV_STR) return tmpl_fail(rt, "TypeError: 'in <string>' requires string as left operand, not %s", tv_type_name(v));
        return tv_bool(memmem(seq->u.str.s, seq->u.str.len, v->u.str.s, v->u.str.len) != NULL);
    }
    if (seq->kind == TV_DICT) return tv_bool(tv_dict_get(seq, v) != NULL);
    if (seq->kind == TV_LIST) {
        for (size_t i = 0; i < seq->u.list.n; i++)
            if (tv_equal(seq->u.list.v[i], v)) return tv_bool(1);
        return tv_bool(0);
    }
    if (seq->kind == TV_UNDEF) return tv_bool(0);
    return tmpl_fail(rt, "TypeError: argument of type '%s' is not iterable", tv_type_name(seq));
}

static tv *t_filter(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)rt;
    (void)self;
    tv *v = tmpl_arg0(a);
    return tv_bool(v->kind == TV_STR && tmpl_find_filter(v->u.str.s) != NULL);
}
static tv *t_test(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)rt;
    (void)self;
    tv *v = tmpl_arg0(a);
    return tv_bool(v->kind == TV_STR && tmpl_find_test(v->u.str.s) != NULL);
}

/* ---- globals ---- */

static tv *g_raise_exception(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv_buf b = {0};
    if (a->npos) tv_write_str(&b, a->pos[0]);
    tmpl_fail(rt, "TemplateError: %s", b.s ? b.s : "");
    tv_buf_free(&b);
    return NULL;
}

static tv *g_strftime_now(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *fmt = tmpl_arg(a, 0, "format");
    if (!fmt || fmt->kind != TV_STR) return tmpl_fail(rt, "TypeError: strftime() argument 1 must be str");
    struct tm tm;
    localtime_r(&rt->now, &tm);
    char out[1024];
    size_t n = fmt->u.str.len ? strftime(out, sizeof out, fmt->u.str.s, &tm) : 0;
    return tmpl_oom_or(rt, tv_str(out, n));
}

static tv *g_range(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    for (size_t i = 0; i < a->npos; i++)
        if (a->pos[i]->kind != TV_INT && a->pos[i]->kind != TV_BOOL)
            return tmpl_fail(rt, "TypeError: '%s' object cannot be interpreted as an integer",
                             tv_type_name(a->pos[i]));
    if (a->npos < 1 || a->npos > 3)
        return tmpl_fail(rt, "TypeError: range expected 1 to 3 arguments, got %zu", a->npos);
    int64_t start = 0, stop, step = 1;
    if (a->npos == 1) stop = tmpl_int_or(a->pos[0], 0);
    else {
        start = tmpl_int_or(a->pos[0], 0);
        stop = tmpl_int_or(a->pos[1], 0);
        if (a->npos == 3) step = tmpl_int_or(a->pos[2], 1);
    }
    if (step == 0) return tmpl_fail(rt, "ValueError: range() arg 3 must not be zero");
    double count = step > 0 ? ceil(((double)stop - (double)start) / (double)step)
                            : ceil(((double)start - (double)stop) / (double)-step);
    if (count > TMPL_MAX_RANGE)
        return tmpl_fail(rt, "OverflowError: Range too big. The sandbox blocks ranges larger than "
                             "MAX_RANGE (%d).", TMPL_MAX_RANGE);
    tv *l = tv_view("range");
    for (int64_t i = start; l && (step > 0 ? i < stop : i > stop); i += step)
        if (tv_list_push_steal(l, tv_int(i))) {
            tv_unref(l);
            l = NULL;
        }
    return tmpl_oom_or(rt, l);
}

static tv *build_mapping(tmpl_rt *rt, tv *d, const tv_args *a) {
    if (!d) return tmpl_oom(rt);
    tv *src = a->npos ? a->pos[0] : NULL;
    if (src && (src->kind == TV_DICT || src->kind == TV_NS)) {
        for (size_t i = 0; i < src->u.dict.n; i++)
            if (tv_dict_set(d, src->u.dict.k[i], src->u.dict.v[i])) return tv_unref(d), tmpl_oom(rt);
    } else if (src && src->kind == TV_LIST) {
        for (size_t i = 0; i < src->u.list.n; i++) {
            tv *p = src->u.list.v[i];
            if (p->kind != TV_LIST || p->u.list.n != 2) {
                tv_unref(d);
                return tmpl_fail(rt, "ValueError: dictionary update sequence element #%zu has wrong length", i);
            }
            if (tv_dict_set(d, p->u.list.v[0], p->u.list.v[1])) return tv_unref(d), tmpl_oom(rt);
        }
    } else if (src) {
        tv_unref(d);
        return tmpl_fail(rt, "TypeError: '%s' object is not iterable", tv_type_name(src));
    }
    for (size_t i = 0; i < a->nkw; i++)
        if (tv_dict_set_str(d, a->kwn[i], a->kwv[i])) return tv_unref(d), tmpl_oom(rt);
    return d;
}
static tv *g_dict(tmpl_rt *rt, tv *self, const tv_args *a) { (void)self; return build_mapping(rt, tv_dict(), a); }
static tv *g_namespace(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *ns = build_mapping(rt, tv_ns(), a);
    if (ns && !rt->namespaces && !(rt->namespaces = tv_list())) return tv_unref(ns), tmpl_oom(rt);
    if (ns && tv_list_push(rt->namespaces, ns)) return tv_unref(ns), tmpl_oom(rt);
    return ns;
}

/* joiner(sep): a callable returning "" on its first call and sep afterwards; its state is
 * a one-element list [used] next to the separator, held as the bound receiver. */
static tv *joiner_call(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)a;
    tv *used = self->u.list.v[1];
    if (!tv_truthy(used)) {
        tv_unref(self->u.list.v[1]);
        self->u.list.v[1] = tv_bool(1);
        return tmpl_oom_or(rt, tv_str("", 0));
    }
    return tv_ref(self->u.list.v[0]);
}
static tv *g_joiner(tmpl_rt *rt, tv *self, const tv_args *a) {
    (void)self;
    tv *sep = tmpl_arg(a, 0, "sep");
    tv *st = tv_list();
    if (!st || tv_list_push_steal(st, sep ? tv_to_str(sep) : tv_cstr(", ")) || tv_list_push(st, tv_bool(0)))
        return tv_unref(st), tmpl_oom(rt);
    tv *f = tv_func(joiner_call, st, "joiner");
    tv_unref(st);
    return tmpl_oom_or(rt, f);
}

typedef struct {
    const char *name;
    tv_builtin_fn fn;
} entry;

static const entry tests[] = {
    {"boolean", t_boolean}, {"callable", t_callable}, {"defined", t_defined},
    {"divisibleby", t_divisibleby}, {"eq", t_eq}, {"equalto", t_eq}, {"==", t_eq},
    {"escaped", t_escaped}, {"even", t_even}, {"false", t_false}, {"filter", t_filter},
    {"float", t_float}, {"ge", t_ge}, {">=", t_ge}, {"gt", t_gt}, {">", t_gt},
    {"greaterthan", t_gt}, {"in", t_in}, {"integer", t_integer}, {"iterable", t_iterable},
    {"le", t_le}, {"<=", t_le}, {"lower", t_lower}, {"lt", t_lt}, {"<", t_lt},
    {"lessthan", t_lt}, {"mapping", t_mapping}, {"ne", t_ne}, {"!=", t_ne}, {"none", t_none},
    {"number", t_number}, {"odd", t_odd}, {"sameas", t_sameas}, {"sequence", t_sequence},
    {"string", t_string}, {"test", t_test}, {"true", t_true}, {"undefined", t_undefined},
    {"upper", t_upper}, {NULL, NULL}};

static const entry globals[] = {
    {"range", g_range}, {"dict", g_dict}, {"namespace", g_namespace}, {"joiner", g_joiner},
    {"raise_exception", g_raise_exception}, {"strftime_now", g_strftime_now}, {NULL, NULL}};

static tv_builtin_fn find(const entry *t, const char *name) {
    for (size_t i = 0; t[i].name; i++)
        if (!strcmp(t[i].name, name)) return t[i].fn;
    return NULL;
}

tv_builtin_fn tmpl_find_test(const char *name) { return find(tests, name); }
tv_builtin_fn tmpl_find_global(const char *name) { return find(globals, name); }
