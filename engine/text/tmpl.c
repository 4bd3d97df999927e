/* Chat-template interpreter: walks the syntax tree of engine/text/tmpl_parse.c with Jinja2's
 * semantics as HF transformers configures it (ImmutableSandboxedEnvironment, default
 * Undefined, loop controls, trim_blocks + lstrip_blocks).
 *
 * Scoping follows jinja2: `if` shares its scope; each for-loop iteration, set/filter/call
 * block, with and block gets a fresh scope (a `set` inside is invisible after it); a
 * macro call gets a scope whose parent is the template's top level. Names are looked up
 * through enclosing frames at run time, and the one case where jinja2's compile-time
 * scoping differs is precomputed by tmpl_scope.c. Statement executors return 0, -1
 * (error recorded in rt), or EX_BREAK / EX_CONTINUE travelling up to the enclosing loop.
 *
 * Errors read as Python prints them, "<ExceptionClass>: <message>" (what transformers
 * shows, e.g. "TemplateError: System role not supported"). */
#include "engine/text/tmpl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/tmpl_internal.h"

enum { EX_OK = 0, EX_ERR = -1, EX_BREAK = 1, EX_CONTINUE = 2 };

typedef struct tmpl_frame {
    struct tmpl_frame *parent;
    tv *vars;       /* dict, created on first set */
} tmpl_frame;

struct tmpl_template {
    tnode_list *body;
    char **undef;       /* names that start Undefined at the top level (tmpl_scope.c) */
    size_t nundef;
};

static tv *eval(tmpl_rt *rt, tmpl_frame *f, const tnode *n);
static int exec_body(tmpl_rt *rt, tmpl_frame *f, const tnode_list *body);

/* ---- errors ---- */

void *tmpl_fail(tmpl_rt *rt, const char *fmt, ...) {
    if (!rt->failed) {
        rt->failed = 1;
        if (rt->err && rt->errlen) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(rt->err, rt->errlen, fmt, ap);
            va_end(ap);
        }
    }
    return NULL;
}

void *tmpl_oom(tmpl_rt *rt) { return tmpl_fail(rt, "MemoryError: out of memory"); }

void *tmpl_undef_raise(tmpl_rt *rt, const tv *u) {
    if (u->kind == TV_UNDEF && u->u.undef.hint) return tmpl_fail(rt, "%s", u->u.undef.hint);
    return tmpl_fail(rt, "UndefinedError: 'undefined' is undefined");
}

/* ---- frames ---- */

static int frame_set(tmpl_rt *rt, tmpl_frame *f, const char *name, tv *v) {
    if (!f->vars && !(f->vars = tv_dict())) return tmpl_oom(rt), -1;
    if (tv_dict_set_str(f->vars, name, v)) return tmpl_oom(rt), -1;
    return 0;
}

static tv *frame_lookup(tmpl_rt *rt, tmpl_frame *f, const char *name) {
    for (; f; f = f->parent) {
        if (!f->vars) continue;
        tv *v = tv_dict_get_str(f->vars, name);
        if (v) return tv_ref(v);
    }
    tv_builtin_fn g = tmpl_find_global(name);
    if (g) {
        tv *fn = tv_func(g, NULL, name);
        return fn ? fn : tmpl_oom(rt);
    }
    tv *u = tv_undef_hint("UndefinedError: '%s' is undefined", name);
    return u ? u : tmpl_oom(rt);
}

/* Entering a frame: the names jinja2 would start as Undefined there (tmpl_scope.c). */
static int frame_enter(tmpl_rt *rt, tmpl_frame *f, char *const *names, size_t n) {
    for (size_t i = 0; i < n; i++) {
        tv *u = tv_undef_hint("UndefinedError: '%s' is undefined", names[i]);
        int rc = u ? frame_set(rt, f, names[i], u) : (tmpl_oom(rt), -1);
        tv_unref(u);
        if (rc) return -1;
    }
    return 0;
}

static void frame_clear(tmpl_frame *f) {
    tv_unref(f->vars);
    f->vars = NULL;
}

/* ---- calls ---- */

typedef struct {
    tv_args a;
    size_t cap;
} argv_t;

static void args_free(tv_args *a) {
    for (size_t i = 0; i < a->npos; i++) tv_unref(a->pos[i]);
    for (size_t i = 0; i < a->nkw; i++) tv_unref(a->kwv[i]);
    free(a->pos);
    free(a->kwv);
    free(a->kwn);
    memset(a, 0, sizeof *a);
}

/* Evaluate n's arguments (l1 positional, names/l2 keywords); first, when given, is
 * prepended as the operand of a filter or test (the reference is stolen). */
static int eval_args(tmpl_rt *rt, tmpl_frame *f, const tnode *n, tv *first, tv_args *a) {
    memset(a, 0, sizeof *a);
    size_t np = n->l1.n + (first ? 1 : 0);
    a->pos = calloc(np + 1, sizeof *a->pos);
    a->kwv = calloc(n->l2.n + 1, sizeof *a->kwv);
    a->kwn = calloc(n->l2.n + 1, sizeof *a->kwn);
    if (!a->pos || !a->kwv || !a->kwn) {
        tv_unref(first);
        args_free(a);
        tmpl_oom(rt);
        return -1;
    }
    if (first) a->pos[a->npos++] = first;
    for (size_t i = 0; i < n->l1.n; i++) {
        tv *v = eval(rt, f, n->l1.v[i]);
        if (!v) return args_free(a), -1;
        a->pos[a->npos++] = v;
    }
    for (size_t i = 0; i < n->l2.n; i++) {
        tv *v = eval(rt, f, n->l2.v[i]);
        if (!v) return args_free(a), -1;
        a->kwn[a->nkw] = n->names[i];
        a->kwv[a->nkw++] = v;
    }
    return 0;
}

static tv *call_macro(tmpl_rt *rt, tv *m, const tv_args *a) {
    const tnode *node = m->u.macro.node;
    int is_caller = node->type == S_CALLBLOCK;
    const char *mname = is_caller ? "caller" : node->name;
    size_t np = is_caller ? 0 : node->nnames;
    if (rt->call_depth >= TMPL_MAX_CALL_DEPTH)
        return tmpl_fail(rt, "RecursionError: maximum recursion depth exceeded");
    if (a->npos > np)
        return tmpl_fail(rt, "TypeError: macro '%s' takes not more than %zu argument(s)", mname, np);
    tmpl_frame fr = {rt->root, NULL};
    tv *caller = rt->caller;
    rt->caller = NULL;
    tv *result = NULL;
    tv_buf buf = {.limit = TMPL_MAX_OUTPUT};
    tv_buf *saved = rt->out;
    for (size_t k = 0; k < a->nkw; k++) {
        size_t j = 0;
        while (j < np && strcmp(node->names[j], a->kwn[k])) j++;
        if (j == np) {
            tmpl_fail(rt, "TypeError: macro '%s' takes no keyword argument '%s'", mname, a->kwn[k]);
            goto done;
        }
        if (j < a->npos) {
            tmpl_fail(rt, "TypeError: macro '%s' got multiple values for argument '%s'", mname,
                      a->kwn[k]);
            goto done;
        }
    }
    for (size_t j = 0; j < np; j++) {
        tv *v = NULL;
        if (j < a->npos) v = tv_ref(a->pos[j]);
        for (size_t k = 0; !v && k < a->nkw; k++)
            if (!strcmp(node->names[j], a->kwn[k])) v = tv_ref(a->kwv[k]);
        if (!v && node->l1.v[j]) {
            if (!(v = eval(rt, &fr, node->l1.v[j]))) goto done;
        }
        if (!v) v = tv_undef_hint("UndefinedError: parameter '%s' was not provided", node->names[j]);
        if (!v) {
            tmpl_oom(rt);
            goto done;
        }
        int rc = frame_set(rt, &fr, node->names[j], v);
        tv_unref(v);
        if (rc) goto done;
    }
    if (caller && frame_set(rt, &fr, "caller", caller)) goto done;
    if (frame_enter(rt, &fr, node->undef, node->nundef)) goto done;
    rt->call_depth++;
    rt->out = &buf;
    int rc = exec_body(rt, &fr, is_caller ? &node->l1 : &node->l2);
    rt->out = saved;
    rt->call_depth--;
    if (rc == EX_ERR) goto done;
    if (buf.oom) {
        tmpl_fail(rt, "MemoryError: rendered output too large");
        goto done;
    }
    size_t len;
    char *s = tv_buf_take(&buf, &len);
    if (!s || !(result = tv_str_take(s, len))) tmpl_oom(rt);
done:
    rt->out = saved;
    tv_buf_free(&buf);
    tv_unref(caller);
    frame_clear(&fr);
    return result;
}

tv *tmpl_call(tmpl_rt *rt, tv *callee, const tv_args *a) {
    switch (callee->kind) {
    case TV_MACRO: return call_macro(rt, callee, a);
    case TV_FUNC: return callee->u.func.fn(rt, callee->u.func.self, a);
    case TV_UNDEF: return tmpl_undef_raise(rt, callee);
    default: return tmpl_fail(rt, "TypeError: '%s' object is not callable", tv_type_name(callee));
    }
}

/* Call a filter or test: the subject becomes the first positional argument. */
static tv *apply_builtin(tmpl_rt *rt, tv_builtin_fn fn, tv *v, const tv_args *extra) {
    size_t np = 1 + (extra ? extra->npos : 0);
    tv **pos = calloc(np, sizeof *pos);
    if (!pos) return tmpl_oom(rt);
    pos[0] = v;
    for (size_t i = 1; i < np; i++) pos[i] = extra->pos[i - 1];
    tv_args a = {pos, np, extra ? extra->kwn : NULL, extra ? extra->kwv : NULL,
                 extra ? extra->nkw : 0};
    tv *r = fn(rt, NULL, &a);
    free(pos);
    return r;
}

tv *tmpl_apply_filter(tmpl_rt *rt, const char *name, tv *v, const tv_args *extra) {
    tv_builtin_fn fn = tmpl_find_filter(name);
    if (!fn) return tmpl_fail(rt, "TemplateAssertionError: No filter named '%s'.", name);
    return apply_builtin(rt, fn, v, extra);
}

tv *tmpl_apply_test(tmpl_rt *rt, const char *name, tv *v, const tv_args *extra) {
    tv_builtin_fn fn = tmpl_find_test(name);
    if (!fn) return tmpl_fail(rt, "TemplateAssertionError: No test named '%s'.", name);
    return apply_builtin(rt, fn, v, extra);
}

/* ---- expressions ---- */
static tv *eval_seq(tmpl_rt *rt, tmpl_frame *f, const tnode *n) {
    tv *r = n->type == N_DICT ? tv_dict() : n->type == N_TUPLE ? tv_tuple() : tv_list();
    if (!r) return tmpl_oom(rt);
    for (size_t i = 0; i < n->l1.n; i++) {
        tv *v = eval(rt, f, n->l1.v[i]);
        if (!v) return tv_unref(r), NULL;
        if (n->type == N_DICT) {
            tv *val = eval(rt, f, n->l2.v[i]);
            int rc = val ? tv_dict_set(r, v, val) : -1;
            if (val && rc) tmpl_oom(rt);
            tv_unref(val);
            tv_unref(v);
            if (rc) return tv_unref(r), NULL;
        } else if (tv_list_push_steal(r, v)) {
            tv_unref(r);
            return tmpl_oom(rt);
        }
    }
    return r;
}

static tv *eval_filter_or_test(tmpl_rt *rt, tmpl_frame *f, const tnode *n) {
    int is_test = n->type == N_TEST;
    tv_builtin_fn fn = is_test ? tmpl_find_test(n->name) : tmpl_find_filter(n->name);
    if (!fn)
        return tmpl_fail(rt, "TemplateRuntimeError: No %s named '%s' found.", is_test ? "test" : "filter",
                         n->name);
    tv *operand = eval(rt, f, n->a);
    if (!operand) return NULL;
    tv_args a;
    if (eval_args(rt, f, n, operand, &a)) return NULL;
    tv *r = fn(rt, NULL, &a);
    args_free(&a);
    if (r && is_test && (n->op & 1)) {
        int t = tv_truthy(r);
        tv_unref(r);
        r = tv_bool(!t);
    }
    return r;
}

static tv *eval_inner(tmpl_rt *rt, tmpl_frame *f, const tnode *n) {
    tv *a = NULL, *b = NULL, *r = NULL;
    switch (n->type) {
    case N_LIT: return tv_ref(n->value);
    case N_NAME: return frame_lookup(rt, f, n->name);
    case N_ATTR:
        if (!(a = eval(rt, f, n->a))) return NULL;
        r = tmpl_getattr(rt, a, n->name);
        break;
    case N_ITEM:
        if (!(a = eval(rt, f, n->a)) || !(b = eval(rt, f, n->b))) break;
        r = tmpl_getitem(rt, a, b);
        break;
    case N_SLICE: {
        tv *c = NULL, *d = NULL;
        if ((a = eval(rt, f, n->a)) && (!n->b || (b = eval(rt, f, n->b))) &&
            (!n->c || (c = eval(rt, f, n->c))) && (!n->d || (d = eval(rt, f, n->d))))
            r = tmpl_slice(rt, a, b, c, d);
        tv_unref(c);
        tv_unref(d);
        break;
    }
    case N_CALL: {
        if (!(a = eval(rt, f, n->a))) return NULL;
        tv_args args;
        if (eval_args(rt, f, n, NULL, &args)) break;
        r = tmpl_call(rt, a, &args);
        args_free(&args);
        break;
    }
    case N_FILTER:
    case N_TEST: return eval_filter_or_test(rt, f, n);
    case N_NOT:
        if (!(a = eval(rt, f, n->a))) return NULL;
        r = tv_bool(!tv_truthy(a));
        break;
    case N_NEG:
    case N_POS:
        if (!(a = eval(rt, f, n->a))) return NULL;
        if (a->kind == TV_UNDEF) r = tmpl_undef_raise(rt, a);
        else if (!tv_is_number(a))
            r = tmpl_fail(rt, "TypeError: bad operand type for unary %s: '%s'",
                          n->type == N_NEG ? "-" : "+", tv_type_name(a));
        else if (a->kind == TV_FLOAT) r = tv_float(n->type == N_NEG ? -a->u.f : a->u.f);
        else {
            int64_t i = a->kind == TV_INT ? a->u.i : a->u.b;
            r = tv_int(n->type == N_NEG ? -i : i);
        }
        break;
    case N_AND:
    case N_OR:
        if (!(a = eval(rt, f, n->a))) return NULL;
        if (tv_truthy(a) == (n->type == N_OR)) return a;
        tv_unref(a);
        return eval(rt, f, n->b);
    case N_BIN:
        if ((a = eval(rt, f, n->a)) && (b = eval(rt, f, n->b))) r = tmpl_binop(rt, n->op, a, b);
        break;
    case N_COMPARE: {
        if (!(a = eval(rt, f, n->a))) return NULL;
        int res = 1;
        for (size_t i = 0; i < n->l1.n && res == 1; i++) {
            if (!(b = eval(rt, f, n->l1.v[i]))) {
                res = -1;
                break;
            }
            res = tmpl_compare_op(rt, n->ops[i], a, b);
            tv_unref(a);
            a = b;
            b = NULL;
        }
        if (res >= 0) r = tv_bool(res);
        break;
    }
    case N_COND:
        if (!(a = eval(rt, f, n->a))) return NULL;
        if (tv_truthy(a)) r = eval(rt, f, n->b);
        else if (n->c) r = eval(rt, f, n->c);
        else if (!(r = tv_undef_hint("UndefinedError: the inline if-expression on line %d "
                                     "evaluated to false and no else section was defined.", n->line)))
            tmpl_oom(rt);
        break;
    case N_LIST:
    case N_TUPLE:
    case N_DICT: return eval_seq(rt, f, n);
    default: return tmpl_fail(rt, "TemplateRuntimeError: bad expression node");
    }
    tv_unref(a);
    tv_unref(b);
    return r;
}

static tv *eval(tmpl_rt *rt, tmpl_frame *f, const tnode *n) {
    if (rt->failed) return NULL;
    if (++rt->eval_depth > TMPL_MAX_EVAL_DEPTH) {
        rt->eval_depth--;
        return tmpl_fail(rt, "RecursionError: maximum recursion depth exceeded");
    }
    tv *r = eval_inner(rt, f, n);
    rt->eval_depth--;
    if (!r && !rt->failed) tmpl_oom(rt);
    return r;
}

/* ---- statements ---- */

static int write_value(tmpl_rt *rt, const tv *v) {
    tv_write_str(rt->out, v);
    if (rt->out->oom == 3)
        return tmpl_fail(rt, "RecursionError: maximum recursion depth exceeded while getting the "
                             "repr of an object"), -1;
    if (rt->out->oom)
        return tmpl_fail(rt, rt->out->oom == 2 ? "MemoryError: rendered output exceeds %u bytes"
                                                 : "MemoryError: out of memory", TMPL_MAX_OUTPUT), -1;
    return 0;
}

static int assign_targets(tmpl_rt *rt, tmpl_frame *f, char *const *names, size_t n, tv *v) {
    if (n == 1) return frame_set(rt, f, names[0], v);
    if (v->kind != TV_LIST && v->kind != TV_STR && v->kind != TV_DICT)
        return tmpl_fail(rt, "TypeError: cannot unpack non-iterable %s object", tv_type_name(v)), -1;
    tv *items = tmpl_iter_list(rt, v);
    if (!items) return -1;
    int rc = 0;
    if (items->u.list.n != n) {
        if (items->u.list.n > n) tmpl_fail(rt, "ValueError: too many values to unpack (expected %zu)", n);
        else tmpl_fail(rt, "ValueError: not enough values to unpack (expected %zu, got %zu)", n,
                       items->u.list.n);
        rc = -1;
    }
    for (size_t i = 0; !rc && i < n; i++) rc = frame_set(rt, f, names[i], items->u.list.v[i]);
    tv_unref(items);
    return rc;
}

static int exec_for(tmpl_rt *rt, tmpl_frame *f, const tnode *n) {
    tv *seq = eval(rt, f, n->a);
    if (!seq) return EX_ERR;
    tv *items = tmpl_iter_list(rt, seq);
    tv_unref(seq);
    if (!items) return EX_ERR;
    int rc = EX_OK;
    if (n->b) {   /* `for x in xs if cond`: filter first, so loop.length counts kept items */
        tv *kept = tv_list();
        if (!kept) rc = EX_ERR, tmpl_oom(rt);
        for (size_t i = 0; !rc && i < items->u.list.n; i++) {
            tmpl_frame fr = {f, NULL};
            rc = assign_targets(rt, &fr, n->names, n->nnames, items->u.list.v[i]);
            tv *c = rc ? NULL : eval(rt, &fr, n->b);
            if (!c) rc = EX_ERR;
            else if (tv_truthy(c) && tv_list_push(kept, items->u.list.v[i])) rc = EX_ERR, tmpl_oom(rt);
            tv_unref(c);
            frame_clear(&fr);
        }
        tv_unref(items);
        items = kept;
        if (rc) return tv_unref(items), EX_ERR;
    }
    /* jinja2 runs the else block unless some iteration reached the end of the body: a loop
     * whose every iteration ends in continue (or that breaks before one completes) also
     * takes it. */
    int completed = 0;
    tv *loop = tv_loop(items);
    if (!loop) return tv_unref(items), tmpl_oom(rt), EX_ERR;
    for (size_t i = 0; i < items->u.list.n; i++) {
        if (++rt->steps > TMPL_MAX_STEPS) {
            tmpl_fail(rt, "TemplateRuntimeError: template exceeded %llu steps",
                      (unsigned long long)TMPL_MAX_STEPS);
            rc = EX_ERR;
            break;
        }
        loop->u.loop.index0 = (int64_t)i;
        tmpl_frame fr = {f, NULL};
        rc = assign_targets(rt, &fr, n->names, n->nnames, items->u.list.v[i]);
        if (!rc) rc = frame_set(rt, &fr, "loop", loop);
        if (!rc) rc = frame_enter(rt, &fr, n->undef, n->nundef);
        if (!rc) rc = exec_body(rt, &fr, &n->l1);
        frame_clear(&fr);
        if (rc == EX_OK) completed = 1;
        if (rc == EX_CONTINUE) rc = EX_OK;
        if (rc == EX_BREAK) {
            rc = EX_OK;
            break;
        }
        if (rc) break;
    }
    tv_unref(loop);
    tv_unref(items);
    if (rc == EX_OK && !completed && n->l2.n) {
        tmpl_frame fr = {f, NULL};
        rc = exec_body(rt, &fr, &n->l2);
        frame_clear(&fr);
    }
    return rc;
}

/* Render body into a fresh string (set blocks, filter blocks), in a scope of its own as
 * jinja2 gives them (a set inside does not leak out). */
static tv *capture(tmpl_rt *rt, tmpl_frame *f, const tnode *n) {
    tv_buf buf = {.limit = TMPL_MAX_OUTPUT};
    tv_buf *saved = rt->out;
    tmpl_frame fr = {f, NULL};
    rt->out = &buf;
    int rc = frame_enter(rt, &fr, n->undef, n->nundef) ? EX_ERR : exec_body(rt, &fr, &n->l1);
    rt->out = saved;
    frame_clear(&fr);
    if (rc == EX_ERR) return tv_buf_free(&buf), NULL;
    if (buf.oom) return tv_buf_free(&buf), tmpl_fail(rt, "MemoryError: rendered output too large");
    size_t len;
    char *s = tv_buf_take(&buf, &len);
    return s ? tv_str_take(s, len) : tmpl_oom(rt);
}

static tv *apply_chain(tmpl_rt *rt, tmpl_frame *f, const tnode_list *chain, tv *v) {
    for (size_t i = 0; v && i < chain->n; i++) {
        const tnode *fl = chain->v[i];
        tv_args a;
        if (eval_args(rt, f, fl, NULL, &a)) return tv_unref(v), NULL;
        tv *r = tmpl_apply_filter(rt, fl->name, v, &a);
        args_free(&a);
        tv_unref(v);
        v = r;
    }
    return v;
}

static int exec_stmt(tmpl_rt *rt, tmpl_frame *f, const tnode *n) {
    tv *v = NULL;
    int rc = EX_OK;
    switch (n->type) {
    case S_TEXT: return write_value(rt, n->value);
    case S_OUTPUT:
        if (!(v = eval(rt, f, n->a))) return EX_ERR;
        rc = write_value(rt, v);
        break;
    case S_IF:
        if (!(v = eval(rt, f, n->a))) return EX_ERR;
        rc = exec_body(rt, f, tv_truthy(v) ? &n->l1 : &n->l2);
        break;
    case S_FOR: return exec_for(rt, f, n);
    case S_SET:
        if (!(v = eval(rt, f, n->b))) return EX_ERR;
        if (n->a) {
            tv *ns = eval(rt, f, n->a->a);
            if (!ns) rc = EX_ERR;
            else if (ns->kind != TV_NS) {
                tmpl_fail(rt, "TemplateRuntimeError: cannot assign attribute on non-namespace object");
                rc = EX_ERR;
            } else if (tv_dict_set_str(ns, n->a->name, v)) {
                tmpl_oom(rt);
                rc = EX_ERR;
            }
            tv_unref(ns);
        } else {
            rc = assign_targets(rt, f, n->names, n->nnames, v);
        }
        break;
    case S_SETBLOCK:
        if (!(v = apply_chain(rt, f, &n->l2, capture(rt, f, n)))) return EX_ERR;
        rc = frame_set(rt, f, n->names[0], v);
        break;
    case S_MACRO:
        if (!(v = tv_macro(n))) return tmpl_oom(rt), EX_ERR;
        rc = frame_set(rt, f, n->name, v);
        break;
    case S_BREAK: return EX_BREAK;
    case S_CONTINUE: return EX_CONTINUE;
    case S_FILTERBLOCK:
        if (!(v = apply_chain(rt, f, &n->l2, capture(rt, f, n)))) return EX_ERR;
        rc = write_value(rt, v);
        break;
    case S_BLOCK:
    case S_WITH: {   /* blocks (and generation blocks, which are call blocks) are scopes */
        tmpl_frame fr = {f, NULL};
        if (frame_enter(rt, &fr, n->undef, n->nundef)) rc = EX_ERR;
        for (size_t i = 0; rc == EX_OK && i < n->nnames; i++) {
            tv *x = eval(rt, &fr, n->l2.v[i]);
            rc = x ? frame_set(rt, &fr, n->names[i], x) : EX_ERR;
            tv_unref(x);
        }
        if (rc == EX_OK) rc = exec_body(rt, &fr, &n->l1);
        frame_clear(&fr);
        return rc;
    }
    case S_CALLBLOCK:
        tv_unref(rt->caller);
        if (!(rt->caller = tv_macro(n))) return tmpl_oom(rt), EX_ERR;
        v = eval(rt, f, n->a);
        tv_unref(rt->caller);
        rt->caller = NULL;
        if (!v) return EX_ERR;
        rc = write_value(rt, v);
        break;
    default:
        tmpl_fail(rt, "TemplateRuntimeError: bad statement node");
        return EX_ERR;
    }
    tv_unref(v);
    return rc;
}

static int exec_body(tmpl_rt *rt, tmpl_frame *f, const tnode_list *body) {
    if (++rt->eval_depth > TMPL_MAX_EVAL_DEPTH) {
        rt->eval_depth--;
        tmpl_fail(rt, "RecursionError: maximum recursion depth exceeded");
        return EX_ERR;
    }
    int rc = EX_OK;
    for (size_t i = 0; i < body->n && rc == EX_OK; i++) {
        if (++rt->steps > TMPL_MAX_STEPS) {
            tmpl_fail(rt, "TemplateRuntimeError: template exceeded %llu steps",
                      (unsigned long long)TMPL_MAX_STEPS);
            rc = EX_ERR;
            break;
        }
        rc = exec_stmt(rt, f, body->v[i]);
        if (rt->failed) rc = EX_ERR;
    }
    rt->eval_depth--;
    return rc;
}

/* ---- public API ---- */

/* jinja2 resolves filter and test names when it compiles: an unknown name is a
 * TemplateAssertionError at parse time, except inside an if statement or an inline if
 * ("soft" frames, which for-loops, macros and blocks do not inherit), where the error is
 * deferred to when the filter runs. Marks deferred nodes with op bit 2. */
static int check_names_list(const tnode_list *l, int soft, char *err, size_t errlen);

static int check_names(tnode *n, int soft, char *err, size_t errlen) {
    if (!n) return 0;
    int inner = soft;
    switch (n->type) {
    case S_IF:
    case N_COND: inner = 1; break;
    case S_FOR:
        if (check_names(n->a, soft, err, errlen)) return -1;
        return check_names(n->b, 0, err, errlen) || check_names_list(&n->l1, 0, err, errlen) ||
               check_names_list(&n->l2, 0, err, errlen) ? -1 : 0;
    case S_MACRO:
    case S_SETBLOCK:
    case S_FILTERBLOCK:
    case S_CALLBLOCK:
    case S_WITH: inner = 0; break;
    case N_FILTER:
    case N_TEST: {
        int known = n->type == N_FILTER ? tmpl_find_filter(n->name) != NULL
                                        : tmpl_find_test(n->name) != NULL;
        if (!known && !soft)
            return specd_errf(err, errlen, SPECD_ETEMPLATE,
                              "TemplateAssertionError: No %s named '%s'. (line %d)",
                              n->type == N_FILTER ? "filter" : "test", n->name, n->line);
        if (!known) n->op |= 2;
        break;
    }
    default: break;
    }
    /* chains of filters on set/filter blocks are evaluated in the enclosing frame */
    if (n->type == S_SETBLOCK || n->type == S_FILTERBLOCK) {
        if (check_names_list(&n->l2, soft, err, errlen) || check_names_list(&n->l1, 0, err, errlen))
            return -1;
        return 0;
    }
    if (check_names(n->a, inner, err, errlen) || check_names(n->b, inner, err, errlen) ||
        check_names(n->c, inner, err, errlen) || check_names(n->d, inner, err, errlen) ||
        check_names_list(&n->l1, inner, err, errlen) || check_names_list(&n->l2, inner, err, errlen))
        return -1;
    return 0;
}

static int check_names_list(const tnode_list *l, int soft, char *err, size_t errlen) {
    for (size_t i = 0; i < l->n; i++)
        if (check_names(l->v[i], soft, err, errlen)) return -1;
    return 0;
}

tmpl_template *tmpl_parse(const char *src, size_t len, char *err, size_t errlen) {
    tk_list toks;
    if (tmpl_lex(src, len, &toks, err, errlen)) return NULL;
    tnode_list *body = tmpl_parse_tokens(&toks, err, errlen);
    tmpl_tokens_free(&toks);
    if (!body) return NULL;
    if (check_names_list(body, 0, err, errlen)) {
        tmpl_body_free(body);
        return NULL;
    }
    tmpl_template *t = calloc(1, sizeof *t);
    if (!t || tmpl_analyse_scopes(body, &t->undef, &t->nundef)) {
        if (t) free(t->undef);
        free(t);
        tmpl_body_free(body);
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    t->body = body;
    return t;
}

void tmpl_free(tmpl_template *t) {
    if (!t) return;
    free(t->undef);
    tmpl_body_free(t->body);
    free(t);
}

int tmpl_render_at(const tmpl_template *t, json_t *context, time_t now, char **out,
                   size_t *out_len, char *err, size_t errlen) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (context && !json_is_object(context))
        return specd_errf(err, errlen, SPECD_EINVAL, "template context must be a JSON object");
    tv_buf buf = {.limit = TMPL_MAX_OUTPUT};
    tmpl_frame root = {NULL, NULL};
    tmpl_rt rt = {.err = err, .errlen = errlen, .out = &buf, .root = &root, .now = now};
    if (context) {
        root.vars = tv_from_json(context);
        if (!root.vars) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    }
    int rc = frame_enter(&rt, &root, t->undef, t->nundef) ? EX_ERR : exec_body(&rt, &root, t->body);
    frame_clear(&root);
    tv_unref(rt.caller);
    /* Namespaces are the only values mutated after creation, so the only way to build a
     * reference cycle (set ns.me = [ns]); emptying them all breaks every cycle. */
    for (size_t i = 0; rt.namespaces && i < rt.namespaces->u.list.n; i++) {
        tv *ns = rt.namespaces->u.list.v[i];
        tv *keep = tv_dict();   /* swap the contents out, then free them */
        if (!keep) break;
        tv tmp = *keep;
        keep->u.dict = ns->u.dict;
        ns->u.dict = tmp.u.dict;
        tv_unref(keep);
    }
    tv_unref(rt.namespaces);
    if (rc == EX_ERR || rt.failed) {
        tv_buf_free(&buf);
        return SPECD_ETEMPLATE;
    }
    *out = tv_buf_take(&buf, out_len);
    if (!*out) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    return 0;
}

int tmpl_render(const tmpl_template *t, json_t *context, char **out, size_t *out_len,
                char *err, size_t errlen) {
    return tmpl_render_at(t, context, time(NULL), out, out_len, err, errlen);
}

json_t *tmpl_chat_context(json_t *messages, json_t *tools, int add_generation_prompt,
                          const char *bos_token, const char *eos_token, json_t *extra) {
    json_t *ctx = json_object();
    if (!ctx) return NULL;
    /* HF passes tools and documents as None when absent, so `tools is not none` works and
     * iterating them raises as it does there. */
    int rc = json_object_set(ctx, "messages", messages ? messages : json_null());
    rc |= json_object_set(ctx, "tools", tools ? tools : json_null());
    rc |= json_object_set_new(ctx, "documents", json_null());
    rc |= json_object_set_new(ctx, "add_generation_prompt", json_boolean(add_generation_prompt));
    if (bos_token) rc |= json_object_set_new(ctx, "bos_token", json_string(bos_token));
    if (eos_token) rc |= json_object_set_new(ctx, "eos_token", json_string(eos_token));
    if (extra && json_is_object(extra)) rc |= json_object_update(ctx, extra);
    if (rc) {
        json_decref(ctx);
        return NULL;
    }
    return ctx;
}

int tmpl_render_chat(const tmpl_template *t, json_t *messages, json_t *tools,
                     int add_generation_prompt, const char *bos_token,
                     const char *eos_token, json_t *extra, char **out, size_t *out_len,
                     char *err, size_t errlen) {
    *out = NULL;
    json_t *ctx = tmpl_chat_context(messages, tools, add_generation_prompt, bos_token, eos_token,
                                    extra);
    if (!ctx) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    int rc = tmpl_render(t, ctx, out, out_len, err, errlen);
    json_decref(ctx);
    return rc;
}
