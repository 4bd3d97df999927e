/* Chat-template operators and lookups with Python/jinja2 semantics: attribute and item
 * access (jinja2's getattr/getitem fallbacks and the Undefined hints its errors carry),
 * iteration, ordering, `in`, arithmetic (int vs float, floor division and modulo with
 * the divisor's sign, str/list repetition and concatenation, Markup escaping) and
 * slicing. Integers are int64; a result that overflows becomes a float. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tmpl_internal.h"

/* ---- lookups ---- */

static const char *obj_type_repr(const tv *v) {
    switch (v->kind) {
    case TV_NONE: return "None";
    case TV_NS: return "jinja2.utils.Namespace object";
    case TV_LOOP: return "jinja2.runtime.LoopContext object";
    case TV_MACRO: return "jinja2.runtime.Macro object";
    case TV_FUNC: return "builtin_function_or_method object";
    case TV_LIST:
        if (v->u.list.view) {
            static const char *const views[] = {"generator object", "list_reverseiterator object",
                                                "reversed object", "dict_items object",
                                                "dict_keys object", "dict_values object",
                                                "range object"};
            size_t n = strlen(v->u.list.view);
            for (size_t i = 0; i < sizeof views / sizeof views[0]; i++)
                if (!strncmp(views[i], v->u.list.view, n) && views[i][n] == ' ') return views[i];
            return "object";
        }
        return v->u.list.tuple ? "tuple object" : "list object";
    case TV_DICT: return "dict object";
    case TV_STR: return "str object";
    case TV_INT: return "int object";
    case TV_FLOAT: return "float object";
    case TV_BOOL: return "bool object";
    default: return "object";
    }
}

static tv *no_attr(tmpl_rt *rt, const tv *obj, const char *name) {
    tv *u = tv_undef_hint("UndefinedError: '%s' has no attribute '%s'", obj_type_repr(obj), name);
    return u ? u : tmpl_oom(rt);
}

tv *tmpl_getattr(tmpl_rt *rt, tv *obj, const char *name) {
    switch (obj->kind) {
    case TV_UNDEF: return tmpl_undef_raise(rt, obj);
    case TV_LOOP: {
        tv *v = tmpl_loop_attr(rt, obj, name);
        return v || rt->failed ? v : no_attr(rt, obj, name);
    }
    case TV_NS: {
        tv *v = tv_dict_get_str(obj, name);
        return v ? tv_ref(v) : no_attr(rt, obj, name);
    }
    case TV_DICT:
    case TV_STR:
    case TV_LIST: {
        int unsafe = 0;
        tv_builtin_fn m = tmpl_find_method(obj, name, &unsafe);
        if (unsafe) {
            tv *u = tv_undef_hint("SecurityError: access to attribute '%s' of '%s' object is unsafe.",
                                  name, tv_type_name(obj));
            return u ? u : tmpl_oom(rt);
        }
        if (m) {
            tv *fn = tv_func(m, obj, name);
            return fn ? fn : tmpl_oom(rt);
        }
        if (obj->kind == TV_DICT) {
            tv *v = tv_dict_get_str(obj, name);
            if (v) return tv_ref(v);
        }
        return no_attr(rt, obj, name);
    }
    default: return no_attr(rt, obj, name);
    }
}

static tv *no_element(tmpl_rt *rt, const tv *obj, const tv *key) {
    tv_buf b = {0};
    tv_write_repr(&b, key);
    tv *u = tv_undef_hint("UndefinedError: %s has no element %s", obj_type_repr(obj),
                          b.s ? b.s : "");
    tv_buf_free(&b);
    return u ? u : tmpl_oom(rt);
}

tv *tmpl_getitem(tmpl_rt *rt, tv *obj, tv *key) {
    if (obj->kind == TV_UNDEF) return tmpl_undef_raise(rt, obj);
    if (obj->kind == TV_DICT || obj->kind == TV_NS) {
        tv *v = tv_dict_get(obj, key);
        if (v) return tv_ref(v);
    } else if (((obj->kind == TV_LIST && (!obj->u.list.view || !strcmp(obj->u.list.view, "range"))) ||
                obj->kind == TV_STR) && (key->kind == TV_INT || key->kind == TV_BOOL)) {
        int64_t i = key->kind == TV_INT ? key->u.i : key->u.b;
        if (obj->kind == TV_LIST) {
            int64_t n = (int64_t)obj->u.list.n;
            if (i < 0) i += n;
            if (i >= 0 && i < n) return tv_ref(obj->u.list.v[i]);
        } else {
            int64_t n = (int64_t)tv_utf8_len(obj->u.str.s, obj->u.str.len);
            if (i < 0) i += n;
            if (i >= 0 && i < n) {
                size_t a = tv_utf8_offset(obj->u.str.s, obj->u.str.len, (size_t)i);
                size_t b = tv_utf8_offset(obj->u.str.s, obj->u.str.len, (size_t)i + 1);
                tv *c = tv_str(obj->u.str.s + a, b - a);
                return c ? c : tmpl_oom(rt);
            }
        }
    }
    if (key->kind == TV_STR) return tmpl_getattr(rt, obj, key->u.str.s);
    return no_element(rt, obj, key);
}

tv *tmpl_iter_list(tmpl_rt *rt, tv *v) {
    switch (v->kind) {
    case TV_LIST:
        if (v->u.list.pending) return tmpl_fail(rt, "%s", v->u.list.pending);
        if (tv_is_iterator(v)) {   /* iterating a generator uses it up */
            tv *l = tv_list();
            if (!l) return tmpl_oom(rt);
            l->u.list.v = v->u.list.v;
            l->u.list.n = v->u.list.n;
            l->u.list.cap = v->u.list.cap;
            v->u.list.v = NULL;
            v->u.list.n = v->u.list.cap = 0;
            return l;
        }
        return tv_ref(v);
    case TV_UNDEF: {
        tv *l = tv_list();
        return l ? l : tmpl_oom(rt);
    }
    case TV_DICT: {
        tv *l = tv_list();
        if (!l) return tmpl_oom(rt);
        for (size_t i = 0; i < v->u.dict.n; i++)
            if (tv_list_push(l, v->u.dict.k[i])) return tv_unref(l), tmpl_oom(rt);
        return l;
    }
    case TV_STR: {
        tv *l = tv_list();
        if (!l) return tmpl_oom(rt);
        size_t i = 0;
        while (i < v->u.str.len) {
            size_t j = i + 1;
            while (j < v->u.str.len && ((unsigned char)v->u.str.s[j] & 0xC0) == 0x80) j++;
            if (tv_list_push_steal(l, tv_str(v->u.str.s + i, j - i))) return tv_unref(l), tmpl_oom(rt);
            i = j;
        }
        return l;
    }
    default:
        return tmpl_fail(rt, "TypeError: '%s' object is not iterable", tv_type_name(v));
    }
}

static int compare_sym(tmpl_rt *rt, const tv *a, const tv *b, const char *sym, int depth) {
    if (depth > 500) {
        tmpl_fail(rt, "RecursionError: maximum recursion depth exceeded in comparison");
        return -2;
    }
    if (tv_is_number(a) && tv_is_number(b)) {
        if (a->kind != TV_FLOAT && b->kind != TV_FLOAT) {
            int64_t x = a->kind == TV_INT ? a->u.i : a->u.b, y = b->kind == TV_INT ? b->u.i : b->u.b;
            return x < y ? -1 : x > y;
        }
        double x = tv_num(a), y = tv_num(b);
        return x < y ? -1 : x > y;
    }
    if (a->kind == TV_STR && b->kind == TV_STR) {
        size_t n = a->u.str.len < b->u.str.len ? a->u.str.len : b->u.str.len;
        int c = memcmp(a->u.str.s, b->u.str.s, n);
        if (c) return c < 0 ? -1 : 1;
        return a->u.str.len < b->u.str.len ? -1 : a->u.str.len > b->u.str.len;
    }
    if (a->kind == TV_LIST && b->kind == TV_LIST && a->u.list.tuple == b->u.list.tuple &&
        !a->u.list.view && !b->u.list.view) {
        for (size_t i = 0; i < a->u.list.n && i < b->u.list.n; i++) {
            if (tv_equal(a->u.list.v[i], b->u.list.v[i])) continue;
            return compare_sym(rt, a->u.list.v[i], b->u.list.v[i], sym, depth + 1);
        }
        return a->u.list.n < b->u.list.n ? -1 : a->u.list.n > b->u.list.n;
    }
    if (a->kind == TV_UNDEF) return tmpl_undef_raise(rt, a), -2;
    if (b->kind == TV_UNDEF) return tmpl_undef_raise(rt, b), -2;
    tmpl_fail(rt, "TypeError: '%s' not supported between instances of '%s' and '%s'", sym,
              tv_type_name(a), tv_type_name(b));
    return -2;
}

int tmpl_compare(tmpl_rt *rt, const tv *a, const tv *b) { return compare_sym(rt, a, b, "<", 0); }

/* ---- operators ---- */

static int contains(tmpl_rt *rt, tv *container, tv *item) {
    switch (container->kind) {
    case TV_STR:
        if (item->kind != TV_STR) {
            tmpl_fail(rt, "TypeError: 'in <string>' requires string as left operand, not %s",
                      tv_type_name(item));
            return -1;
        }
        return item->u.str.len == 0 ||
               memmem(container->u.str.s, container->u.str.len, item->u.str.s, item->u.str.len) != NULL;
    case TV_LIST:
        for (size_t i = 0; i < container->u.list.n; i++)
            if (tv_equal(container->u.list.v[i], item)) return 1;
        return 0;
    case TV_DICT:
    case TV_NS: return tv_dict_get(container, item) != NULL;
    case TV_UNDEF: return 0;
    default:
        tmpl_fail(rt, "TypeError: argument of type '%s' is not iterable", tv_type_name(container));
        return -1;
    }
}

static tv *num_result(tmpl_rt *rt, int is_int, int64_t i, double d) {
    tv *v = is_int ? tv_int(i) : tv_float(d);
    return v ? v : tmpl_oom(rt);
}

static const char *op_sym(int op) {
    static const char *const s[] = {"+", "-", "*", "/", "//", "%", "**", "~"};
    return op <= OP_CONCAT ? s[op] : "?";
}

static tv *repeat(tmpl_rt *rt, tv *seq, int64_t times) {
    if (times < 0) times = 0;
    if (seq->kind == TV_STR) {
        if (seq->u.str.len && (uint64_t)times > TMPL_MAX_OUTPUT / seq->u.str.len)
            return tmpl_fail(rt, "MemoryError: string too large");
        tv_buf b = {0};
        for (int64_t k = 0; k < times; k++) tv_buf_put(&b, seq->u.str.s, seq->u.str.len);
        if (b.oom) return tv_buf_free(&b), tmpl_oom(rt);
        size_t n;
        char *s = tv_buf_take(&b, &n);
        return s ? tv_str_take(s, n) : tmpl_oom(rt);
    }
    if (seq->u.list.n && (uint64_t)times > TMPL_MAX_OUTPUT / seq->u.list.n)
        return tmpl_fail(rt, "MemoryError: list too large");
    tv *l = seq->u.list.tuple ? tv_tuple() : tv_list();
    if (!l) return tmpl_oom(rt);
    for (int64_t k = 0; k < times; k++)
        for (size_t i = 0; i < seq->u.list.n; i++)
            if (tv_list_push(l, seq->u.list.v[i])) return tv_unref(l), tmpl_oom(rt);
    return l;
}

/* Python float // and %: the quotient is floored and the remainder takes the divisor's
 * sign (CPython's float_divmod). */
static void float_divmod(double x, double y, double *div_out, double *mod_out) {
    double mod = fmod(x, y), div = (x - mod) / y;
    if (mod != 0) {
        if ((y < 0) != (mod < 0)) {
            mod += y;
            div -= 1.0;
        }
    } else {
        mod = copysign(0.0, y);
    }
    double fl;
    if (div != 0) {
        fl = floor(div);
        if (div - fl > 0.5) fl += 1.0;
    } else {
        fl = copysign(0.0, x / y);
    }
    *div_out = fl;
    *mod_out = mod;
}

/* Arithmetic on int/float/bool with Python's rules: ints stay ints (int64; a result that
 * overflows becomes a float, where Python would grow a big int), / is always float. */
static tv *num_binop(tmpl_rt *rt, int op, const tv *a, const tv *b) {
    int ints = a->kind != TV_FLOAT && b->kind != TV_FLOAT;
    int64_t x = a->kind == TV_INT ? a->u.i : a->kind == TV_BOOL ? a->u.b : 0;
    int64_t y = b->kind == TV_INT ? b->u.i : b->kind == TV_BOOL ? b->u.b : 0;
    double fx = tv_num(a), fy = tv_num(b);
    int64_t r;
    switch (op) {
    case OP_ADD:
        if (ints && !__builtin_add_overflow(x, y, &r)) return num_result(rt, 1, r, 0);
        return num_result(rt, 0, 0, fx + fy);
    case OP_SUB:
        if (ints && !__builtin_sub_overflow(x, y, &r)) return num_result(rt, 1, r, 0);
        return num_result(rt, 0, 0, fx - fy);
    case OP_MUL:
        if (ints && !__builtin_mul_overflow(x, y, &r)) return num_result(rt, 1, r, 0);
        return num_result(rt, 0, 0, fx * fy);
    case OP_DIV:
        if (fy == 0)
            return tmpl_fail(rt, ints ? "ZeroDivisionError: division by zero"
                                      : "ZeroDivisionError: float division by zero");
        return num_result(rt, 0, 0, fx / fy);
    case OP_FLOORDIV:
    case OP_MOD:
        if (ints) {
            if (y == 0)
                return tmpl_fail(rt, op == OP_MOD ? "ZeroDivisionError: integer modulo by zero"
                                                  : "ZeroDivisionError: integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) return num_result(rt, 0, 0, op == OP_MOD ? 0 : -fx);
            int64_t q = x / y, m = x % y;
            if (m && ((m < 0) != (y < 0))) {
                q--;
                m += y;
            }
            return num_result(rt, 1, op == OP_MOD ? m : q, 0);
        }
        if (fy == 0)
            return tmpl_fail(rt, op == OP_MOD ? "ZeroDivisionError: float modulo"
                                              : "ZeroDivisionError: float floor division by zero");
        {
            double dv, md;
            float_divmod(fx, fy, &dv, &md);
            return num_result(rt, 0, 0, op == OP_MOD ? md : dv);
        }
    case OP_POW:
        if (ints && y >= 0) {
            int64_t acc = 1, base = x, e = y;
            int ovf = 0;
            while (e && !ovf) {
                if (e & 1) ovf |= __builtin_mul_overflow(acc, base, &acc);
                e >>= 1;
                if (e) ovf |= __builtin_mul_overflow(base, base, &base);
            }
            if (!ovf) return num_result(rt, 1, acc, 0);
        }
        if (fx == 0 && fy < 0)
            return tmpl_fail(rt, "ZeroDivisionError: 0.0 cannot be raised to a negative power");
        return num_result(rt, 0, 0, pow(fx, fy));
    default: return tmpl_fail(rt, "TemplateRuntimeError: bad operator");
    }
}

tv *tmpl_binop(tmpl_rt *rt, int op, tv *a, tv *b) {
    if (op == OP_CONCAT) {
        tv_buf buf = {0};
        tv_write_str(&buf, a);
        tv_write_str(&buf, b);
        if (buf.oom) return tv_buf_free(&buf), tmpl_oom(rt);
        size_t n;
        char *s = tv_buf_take(&buf, &n);
        return s ? tv_str_take(s, n) : tmpl_oom(rt);
    }
    if (a->kind == TV_UNDEF) return tmpl_undef_raise(rt, a);
    if (b->kind == TV_UNDEF) return tmpl_undef_raise(rt, b);
    if (tv_is_number(a) && tv_is_number(b)) return num_binop(rt, op, a, b);
    if (op == OP_ADD && a->kind == b->kind && a->kind == TV_STR) {
        /* Markup + str escapes the str (markupsafe), and the sum is Markup */
        int safe = a->u.str.safe || b->u.str.safe;
        tv *x = safe ? tmpl_escape(rt, a) : tv_ref(a), *y = safe && x ? tmpl_escape(rt, b) : tv_ref(b);
        if (!x || !y) return tv_unref(x), tv_unref(y), NULL;
        tv_buf buf = {.limit = TMPL_MAX_OUTPUT};
        tv_buf_put(&buf, x->u.str.s, x->u.str.len);
        tv_buf_put(&buf, y->u.str.s, y->u.str.len);
        tv_unref(x);
        tv_unref(y);
        if (buf.oom) return tv_buf_free(&buf), tmpl_fail(rt, "MemoryError: string too large");
        size_t n;
        char *s = tv_buf_take(&buf, &n);
        return tmpl_with_safe(rt, s ? tv_str_take(s, n) : tmpl_oom(rt), safe);
    }
    if (op == OP_ADD && a->kind == TV_LIST && b->kind == TV_LIST && a->u.list.tuple == b->u.list.tuple &&
        !a->u.list.view && !b->u.list.view) {
        tv *l = a->u.list.tuple ? tv_tuple() : tv_list();
        if (!l) return tmpl_oom(rt);
        for (size_t i = 0; i < a->u.list.n; i++)
            if (tv_list_push(l, a->u.list.v[i])) return tv_unref(l), tmpl_oom(rt);
        for (size_t i = 0; i < b->u.list.n; i++)
            if (tv_list_push(l, b->u.list.v[i])) return tv_unref(l), tmpl_oom(rt);
        return l;
    }
    if (op == OP_MUL && (a->kind == TV_STR || (a->kind == TV_LIST && !a->u.list.view)) &&
        (b->kind == TV_INT || b->kind == TV_BOOL))
        return repeat(rt, a, b->kind == TV_INT ? b->u.i : b->u.b);
    if (op == OP_MUL && (b->kind == TV_STR || (b->kind == TV_LIST && !b->u.list.view)) &&
        (a->kind == TV_INT || a->kind == TV_BOOL))
        return repeat(rt, b, a->kind == TV_INT ? a->u.i : a->u.b);
    if (op == OP_MUL && ((a->kind == TV_STR || (a->kind == TV_LIST && !a->u.list.view)) ||
                         (b->kind == TV_STR || (b->kind == TV_LIST && !b->u.list.view)))) {
        const tv *other = a->kind == TV_STR || (a->kind == TV_LIST && !a->u.list.view) ? b : a;
        return tmpl_fail(rt, "TypeError: can't multiply sequence by non-int of type '%s'",
                         tv_type_name(other));
    }
    if (op == OP_MOD && a->kind == TV_STR) {
        tv *fn = tv_func(tmpl_find_filter("format"), NULL, "format");
        if (!fn) return tmpl_oom(rt);
        tv *pos[64];
        size_t np = 0;
        pos[np++] = a;
        if (b->kind == TV_LIST && b->u.list.tuple)
            for (size_t i = 0; i < b->u.list.n && np < 64; i++) pos[np++] = b->u.list.v[i];
        else pos[np++] = b;
        tv_args args = {pos, np, NULL, NULL, 0};
        tv *r = tmpl_call(rt, fn, &args);
        tv_unref(fn);
        return r;
    }
    if (op == OP_ADD && ((a->kind == TV_STR && !a->u.str.safe) || (a->kind == TV_LIST && !a->u.list.view)))
        return tmpl_fail(rt, "TypeError: can only concatenate %s (not \"%s\") to %s",
                         tv_type_name(a), tv_type_name(b), tv_type_name(a));
    return tmpl_fail(rt, "TypeError: unsupported operand type(s) for %s: '%s' and '%s'",
                     op == OP_POW ? "** or pow()" : op_sym(op), tv_type_name(a), tv_type_name(b));
}

int tmpl_compare_op(tmpl_rt *rt, int op, tv *a, tv *b) {
    switch (op) {
    case OP_EQ: return tv_equal(a, b);
    case OP_NE: return !tv_equal(a, b);
    case OP_IN: return contains(rt, b, a);
    case OP_NOTIN: {
        int c = contains(rt, b, a);
        return c < 0 ? c : !c;
    }
    default: {
        static const char *const sym[] = {"<", "<=", ">", ">="};
        int c = compare_sym(rt, a, b, sym[op - OP_LT], 0);
        if (c == -2) return -1;
        return op == OP_LT ? c < 0 : op == OP_LE ? c <= 0 : op == OP_GT ? c > 0 : c >= 0;
    }
    }
}


static int64_t slice_index(tv *v, int64_t n, int64_t def, int step_neg, int *ok) {
    if (!v || v->kind == TV_NONE) return def;
    if (v->kind != TV_INT && v->kind != TV_BOOL) {
        *ok = 0;
        return 0;
    }
    int64_t i = v->kind == TV_INT ? v->u.i : v->u.b;
    if (i < 0) {
        i += n;
        if (i < 0) i = step_neg ? -1 : 0;
    } else if (i >= n) {
        i = step_neg ? n - 1 : n;
    }
    return i;
}

tv *tmpl_slice(tmpl_rt *rt, tv *obj, tv *start, tv *stop, tv *stepv) {
    if (obj->kind == TV_UNDEF) return tmpl_undef_raise(rt, obj);
    if ((obj->kind != TV_LIST && obj->kind != TV_STR) ||
        (obj->kind == TV_LIST && obj->u.list.view && strcmp(obj->u.list.view, "range"))) {
        tv *u = tv_undef_hint("UndefinedError: %s has no element slice", obj_type_repr(obj));
        return u ? u : tmpl_oom(rt);
    }
    int64_t step = 1;
    if (stepv && stepv->kind != TV_NONE) {
        if (stepv->kind != TV_INT) return tmpl_fail(rt, "TypeError: slice indices must be integers or None");
        step = stepv->u.i;
        if (step == 0) return tmpl_fail(rt, "ValueError: slice step cannot be zero");
    }
    int is_str = obj->kind == TV_STR;
    tv *items = is_str ? tmpl_iter_list(rt, obj) : tv_ref(obj);
    if (!items) return NULL;
    int64_t n = (int64_t)items->u.list.n;
    int ok = 1;
    int64_t lo = slice_index(start, n, step > 0 ? 0 : n - 1, step < 0, &ok);
    int64_t hi = slice_index(stop, n, step > 0 ? n : -1, step < 0, &ok);
    if (!ok) {
        tv_unref(items);
        return tmpl_fail(rt, "TypeError: slice indices must be integers or None");
    }
    tv_buf b = {0};
    tv *l = is_str ? NULL : (obj->u.list.tuple ? tv_tuple() : tv_list());
    if (!is_str && !l) return tv_unref(items), tmpl_oom(rt);
    for (int64_t i = lo; step > 0 ? i < hi : i > hi; i += step) {
        tv *it = items->u.list.v[i];
        if (is_str) tv_buf_put(&b, it->u.str.s, it->u.str.len);
        else if (tv_list_push(l, it)) {
            tv_unref(l);
            tv_unref(items);
            return tmpl_oom(rt);
        }
    }
    tv_unref(items);
    if (!is_str) return l;
    if (b.oom) return tv_buf_free(&b), tmpl_oom(rt);
    size_t len;
    char *s = tv_buf_take(&b, &len);
    return s ? tv_str_take(s, len) : tmpl_oom(rt);
}

