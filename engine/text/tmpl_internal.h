/* Chat-template runtime internals shared by the interpreter (tmpl.c) and the builtins
 * (tmpl_builtins.c: filters, tests, methods, global functions). Not a public header.
 *
 * Errors are recorded once per render in tmpl_rt as "<PythonExceptionName>: message",
 * the same text transformers shows (e.g. "TemplateError: System role not supported"),
 * and every evaluator returns NULL (or -1) from then on. */
#ifndef SPECD_TMPL_INTERNAL_H
#define SPECD_TMPL_INTERNAL_H

#include <stdint.h>
#include <time.h>

#include "engine/text/tmpl_ast.h"
#include "engine/text/tmpl_value.h"

/* Bounds that keep a hostile template from hanging or exhausting memory. */
#define TMPL_MAX_CALL_DEPTH 160            /* nested macro calls */
#define TMPL_MAX_EVAL_DEPTH 3000           /* nested expression / statement evaluation */
#define TMPL_MAX_OUTPUT (64u << 20)        /* bytes of rendered text, and of any string */
#define TMPL_MAX_STEPS 10000000ull         /* statements + loop iterations per render */
#define TMPL_MAX_RANGE 100000              /* jinja2's sandbox MAX_RANGE */

struct tmpl_rt {
    char *err;
    size_t errlen;
    int failed;
    tv_buf *out;            /* where text goes now (swapped for macros and set blocks) */
    struct tmpl_frame *root;
    tv *caller;             /* body of the enclosing {% call %}, for the next macro call */
    int call_depth, eval_depth;
    uint64_t steps;
    time_t now;             /* what strftime_now() reports */
    tv *namespaces;         /* list of every namespace made, emptied at the end */
};

/* Record an error (first one wins). Returns NULL so callers can `return tmpl_fail(...)`. */
void *tmpl_fail(tmpl_rt *rt, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void *tmpl_oom(tmpl_rt *rt);

/* Raise the error an Undefined carries (UndefinedError / SecurityError). Returns NULL. */
void *tmpl_undef_raise(tmpl_rt *rt, const tv *u);

/* Callable dispatch (macros and builtins). Returns a new reference or NULL. */
tv *tmpl_call(tmpl_rt *rt, tv *callee, const tv_args *a);

/* Lookups used by filters and the evaluator. getattr: obj.name (attribute first, then
 * item); getitem: obj[key] (item first, then attribute). New references; an Undefined
 * with a hint when missing; NULL on error. */
tv *tmpl_getattr(tmpl_rt *rt, tv *obj, const char *name);
tv *tmpl_getitem(tmpl_rt *rt, tv *obj, tv *key);

/* Materialise anything iterable as a list (new ref): list/tuple itself, dict keys, str
 * characters, Undefined empty. TypeError for the rest. */
tv *tmpl_iter_list(tmpl_rt *rt, tv *v);

/* Python ordering: -1/0/1, or -2 after recording a TypeError. */
int tmpl_compare(tmpl_rt *rt, const tv *a, const tv *b);

/* Operators (tmpl_ops.c). binop: OP_ADD..OP_CONCAT, new ref or NULL. compare_op:
 * OP_EQ..OP_NOTIN, 1/0 or -1 after an error. slice: obj[start:stop:step], any bound NULL. */
tv *tmpl_binop(tmpl_rt *rt, int op, tv *a, tv *b);
int tmpl_compare_op(tmpl_rt *rt, int op, tv *a, tv *b);
tv *tmpl_slice(tmpl_rt *rt, tv *obj, tv *start, tv *stop, tv *stepv);

/* Builtin tables (tmpl_builtins.c). Filters and tests receive the operand as pos[0]. */
tv_builtin_fn tmpl_find_filter(const char *name);
tv_builtin_fn tmpl_find_test(const char *name);
tv_builtin_fn tmpl_find_global(const char *name);
/* Method of a str/list/dict (bound later by the caller); NULL if none. *unsafe set to 1
 * for methods the immutable sandbox refuses (list.append, dict.pop, ...). */
tv_builtin_fn tmpl_find_method(const tv *obj, const char *name, int *unsafe);
/* Attribute of a loop object (new ref, or NULL if no such attribute). */
tv *tmpl_loop_attr(tmpl_rt *rt, tv *loop, const char *name);

/* Argument helpers for builtins: positional i or keyword name, else NULL (borrowed). */
tv *tmpl_arg(const tv_args *a, size_t i, const char *name);

/* Small helpers of the builtin filters and tests: v, or the out-of-memory error when NULL;
 * str(v); the first positional argument (undefined if none); v as an integer (bools and
 * floats too), def for None / missing / other kinds. */
static inline tv *tmpl_oom_or(tmpl_rt *rt, tv *v) { return v ? v : (tv *)tmpl_oom(rt); }
static inline tv *tmpl_to_str(tmpl_rt *rt, const tv *v) { return tmpl_oom_or(rt, tv_to_str(v)); }
static inline tv *tmpl_arg0(const tv_args *a) { return a->npos ? a->pos[0] : tv_undef(); }
static inline int64_t tmpl_int_or(const tv *v, int64_t def) {
    if (!v || v->kind == TV_NONE) return def;
    if (v->kind == TV_INT) return v->u.i;
    if (v->kind == TV_BOOL) return v->u.b;
    if (v->kind == TV_FLOAT) return (int64_t)v->u.f;
    return def;
}

/* Apply a filter by name to v with extra args (used by map / filter blocks). */
tv *tmpl_apply_filter(tmpl_rt *rt, const char *name, tv *v, const tv_args *extra);
tv *tmpl_apply_test(tmpl_rt *rt, const char *name, tv *v, const tv_args *extra);

/* String helpers shared by methods and filters (tmpl_methods.c). */
enum { TMPL_UPPER, TMPL_LOWER, TMPL_PYTITLE, TMPL_CAPITALIZE, TMPL_JTITLE };
tv *tmpl_str_case(tmpl_rt *rt, const tv *s, int mode);
/* which: 1 left, 2 right, 3 both; chars NULL/None: Python whitespace. */
tv *tmpl_str_strip(tmpl_rt *rt, const tv *s, const tv *chars, int which);
/* Python printf-style formatting: fmt % args (what jinja2's format filter does). */
tv *tmpl_percent_format(tmpl_rt *rt, const tv *fmt, tv **args, size_t nargs);
int tmpl_is_space(uint32_t cp);
/* markupsafe: escape(v) (a Markup is returned as is) and a copy of string s (stolen)
 * with its Markup flag set to `safe`. Both return Markup / new references. */
tv *tmpl_escape(tmpl_rt *rt, const tv *v);
tv *tmpl_with_safe(tmpl_rt *rt, tv *s, int safe);
/* Decode one code point; returns bytes used (>= 1). */
size_t tmpl_utf8_next(const char *s, size_t len, uint32_t *cp);

#endif
