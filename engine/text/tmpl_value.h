/* Template values (prefix tv_): the dynamic, ref-counted value type the chat-template
 * interpreter computes with. Models Python/Jinja2 objects: Undefined, None, bool, int,
 * float, str, list, tuple, dict (insertion ordered), namespace, macro, builtin function
 * (optionally bound to a receiver: "abc".upper), and the for-loop's `loop` object.
 *
 * Ownership: every function returning tv * returns a NEW reference the caller must
 * tv_unref(). Functions taking tv * borrow it unless they say "steals". None, True, False
 * and the plain Undefined are immortal singletons (never freed, ref counts untouched), so
 * values of one render may be used from one thread only, but singletons are shared safely.
 * Strings are UTF-8, NUL-terminated, with an explicit byte length. */
#ifndef SPECD_TMPL_VALUE_H
#define SPECD_TMPL_VALUE_H

#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

typedef enum {
    TV_UNDEF, TV_NONE, TV_BOOL, TV_INT, TV_FLOAT, TV_STR, TV_LIST, TV_DICT, TV_NS,
    TV_MACRO, TV_FUNC, TV_LOOP
} tv_kind;

typedef struct tv tv;
typedef struct tmpl_rt tmpl_rt;   /* one render's state (tmpl_internal.h) */

/* Call arguments: positional values and keyword (name, value) pairs, all borrowed. */
typedef struct {
    tv **pos;
    size_t npos;
    const char **kwn;
    tv **kwv;
    size_t nkw;
} tv_args;

/* A builtin callable. self is the bound receiver (NULL for free functions). Returns a
 * new reference, or NULL after recording an error in rt (tmpl_rt_error). */
typedef tv *(*tv_builtin_fn)(tmpl_rt *rt, tv *self, const tv_args *a);

struct tv {
    tv_kind kind;
    int rc;         /* < 0: immortal */
    union {
        int b;
        int64_t i;
        double f;
        struct { char *s; size_t len; int safe; } str;   /* safe: a markupsafe Markup */
        /* view: NULL for a list/tuple; else the Python type this sequence stands for:
         * "generator" / "list_reverseiterator" (one-pass iterators: always truthy, no
         * len, emptied by iteration), "dict_items" / "dict_keys" / "dict_values",
         * "range". jinja2's map/select/... return generators, and templates that print,
         * measure or JSON-dump those fail in transformers; so must they here. */
        struct {
            tv **v;
            size_t n, cap;
            int tuple;
            const char *view;
            const char *origin;   /* generators: the function that made it (for printing) */
            char *pending;        /* generators: error raised when it is consumed */
        } list;
        struct { tv **k; tv **v; size_t n, cap; } dict;     /* TV_DICT and TV_NS */
        struct { char *hint; } undef;   /* error text when used; NULL: generic */
        struct { const void *node; } macro;                 /* AST node, outlives render */
        struct { tv_builtin_fn fn; tv *self; const char *name; } func;
        struct { int64_t index0, length; tv *items; } loop; /* items: the list iterated */
    } u;
};

/* Constructors (new references; NULL on allocation failure). */
tv *tv_undef(void);
tv *tv_undef_hint(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
tv *tv_none(void);
tv *tv_bool(int b);
tv *tv_int(int64_t i);
tv *tv_float(double f);
tv *tv_str(const char *s, size_t len);
tv *tv_cstr(const char *s);
tv *tv_str_take(char *s, size_t len);   /* steals s (malloc'd, NUL-terminated) */
tv *tv_list(void);
tv *tv_tuple(void);
tv *tv_view(const char *view);          /* empty list standing for a Python view */
tv *tv_dict(void);
tv *tv_ns(void);
tv *tv_macro(const void *node);
tv *tv_func(tv_builtin_fn fn, tv *self, const char *name);   /* refs self */
tv *tv_loop(tv *items);                                       /* refs items */

tv *tv_ref(tv *v);
void tv_unref(tv *v);

/* Literals of a parsed template are shared by every render, possibly on several threads
 * at once, so they are made immortal (ref counting leaves them alone) and freed with the
 * template by tv_free_literal. Only scalars (str, int, float) are literals. */
void tv_make_literal(tv *v);
void tv_free_literal(tv *v);

/* Containers. Append/set take a new reference of their own (the caller keeps its). */
int tv_list_push(tv *l, tv *item);
int tv_list_push_steal(tv *l, tv *item);    /* item consumed even on failure */
int tv_dict_set(tv *d, tv *key, tv *val);
int tv_dict_set_str(tv *d, const char *key, tv *val);
tv *tv_dict_get(const tv *d, const tv *key);          /* borrowed, NULL if absent */
tv *tv_dict_get_str(const tv *d, const char *key);    /* borrowed, NULL if absent */

/* Python semantics. */
int tv_truthy(const tv *v);
int tv_equal(const tv *a, const tv *b);
int tv_is_number(const tv *v);      /* int, float or bool */
int tv_is_iterator(const tv *v);    /* a one-pass generator-like view */
double tv_num(const tv *v);
const char *tv_type_name(const tv *v);   /* Python's type name: 'str', 'dict', ... */

/* Growable byte buffer used for output and formatting. */
typedef struct {
    char *s;
    size_t len, cap;
    size_t limit;       /* 0: unbounded; else appends beyond it fail */
    int oom;            /* sticky failure flag (allocation or limit) */
} tv_buf;
void tv_buf_put(tv_buf *b, const char *s, size_t n);
void tv_buf_puts(tv_buf *b, const char *s);
void tv_buf_printf(tv_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
char *tv_buf_take(tv_buf *b, size_t *len);     /* NUL-terminated; resets b */
void tv_buf_free(tv_buf *b);

/* str(v) (what {{ v }} prints) and repr(v), appended to b. */
void tv_write_str(tv_buf *b, const tv *v);
void tv_write_repr(tv_buf *b, const tv *v);
void tv_write_float(tv_buf *b, double f);   /* Python repr of a float */
tv *tv_to_str(const tv *v);                 /* new str value holding str(v) */

/* json.dumps(v, ensure_ascii, indent, separators, sort_keys) as HF's tojson does (HF
 * defaults ensure_ascii to False). indent < 0: none. item_sep / key_sep NULL: Python
 * defaults. Returns 0, or -1 with a TypeError message in err for values JSON cannot
 * hold. */
int tv_write_json(tv_buf *b, const tv *v, int indent, const char *item_sep,
                  const char *key_sep, int sort_keys, int ensure_ascii, char *err,
                  size_t errlen);

/* Conversion from jansson (deep copy; new reference). */
tv *tv_from_json(json_t *j);

/* UTF-8 helpers: number of code points, byte offset of code point index. */
size_t tv_utf8_len(const char *s, size_t len);
size_t tv_utf8_offset(const char *s, size_t len, size_t cp);

#endif
