/* Template values: construction, ref counting, containers, Python truthiness/equality,
 * and the three ways a value becomes text: str() (what {{ }} prints), repr() (how lists
 * and dicts print their items) and json.dumps (HF's tojson filter). Floats print as
 * Python's shortest round-tripping repr, because templates that print numbers must match
 * transformers byte for byte. */
#include "engine/text/tmpl_value.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static tv s_undef = {.kind = TV_UNDEF, .rc = -1};
static tv s_none = {.kind = TV_NONE, .rc = -1};
static tv s_true = {.kind = TV_BOOL, .rc = -1, .u.b = 1};
static tv s_false = {.kind = TV_BOOL, .rc = -1, .u.b = 0};

static tv *tv_alloc(tv_kind k) {
    tv *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    v->kind = k;
    v->rc = 1;
    return v;
}

tv *tv_undef(void) { return &s_undef; }
tv *tv_none(void) { return &s_none; }
tv *tv_bool(int b) { return b ? &s_true : &s_false; }

tv *tv_undef_hint(const char *fmt, ...) {
    tv *v = tv_alloc(TV_UNDEF);
    if (!v) return NULL;
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(&v->u.undef.hint, fmt, ap) < 0) v->u.undef.hint = NULL;
    va_end(ap);
    return v;
}

tv *tv_int(int64_t i) {
    tv *v = tv_alloc(TV_INT);
    if (v) v->u.i = i;
    return v;
}

tv *tv_float(double f) {
    tv *v = tv_alloc(TV_FLOAT);
    if (v) v->u.f = f;
    return v;
}

tv *tv_str(const char *s, size_t len) {
    char *c = malloc(len + 1);
    if (!c) return NULL;
    if (len) memcpy(c, s, len);
    c[len] = 0;
    return tv_str_take(c, len);
}

tv *tv_cstr(const char *s) { return tv_str(s, strlen(s)); }

tv *tv_str_take(char *s, size_t len) {
    tv *v = tv_alloc(TV_STR);
    if (!v) {
        free(s);
        return NULL;
    }
    v->u.str.s = s;
    v->u.str.len = len;
    return v;
}

tv *tv_list(void) { return tv_alloc(TV_LIST); }

tv *tv_tuple(void) {
    tv *v = tv_alloc(TV_LIST);
    if (v) v->u.list.tuple = 1;
    return v;
}

tv *tv_view(const char *view) {
    tv *v = tv_alloc(TV_LIST);
    if (v) v->u.list.view = view;
    return v;
}

int tv_is_iterator(const tv *v) {
    return v->kind == TV_LIST && v->u.list.view &&
           (!strcmp(v->u.list.view, "generator") || !strcmp(v->u.list.view, "list_reverseiterator") ||
            !strcmp(v->u.list.view, "reversed") ||
            !strcmp(v->u.list.view, "dict_reversekeyiterator") ||
            !strcmp(v->u.list.view, "range_iterator"));
}

tv *tv_dict(void) { return tv_alloc(TV_DICT); }
tv *tv_ns(void) { return tv_alloc(TV_NS); }

tv *tv_macro(const void *node) {
    tv *v = tv_alloc(TV_MACRO);
    if (v) v->u.macro.node = node;
    return v;
}

tv *tv_func(tv_builtin_fn fn, tv *self, const char *name) {
    tv *v = tv_alloc(TV_FUNC);
    if (!v) return NULL;
    v->u.func.fn = fn;
    v->u.func.self = self ? tv_ref(self) : NULL;
    v->u.func.name = name;
    return v;
}

tv *tv_loop(tv *items) {
    tv *v = tv_alloc(TV_LOOP);
    if (!v) return NULL;
    v->u.loop.items = tv_ref(items);
    v->u.loop.length = (int64_t)items->u.list.n;
    return v;
}

tv *tv_ref(tv *v) {
    if (v && v->rc >= 0) v->rc++;
    return v;
}

/* Drop one reference of child; if it was the last, queue the child for freeing. */
typedef struct {
    tv **v;
    size_t n, cap;
} free_stack;

static void release(free_stack *fs, tv *c) {
    if (!c || c->rc < 0 || --c->rc > 0) return;
    if (fs->n == fs->cap) {
        size_t cap = fs->cap ? fs->cap * 2 : 64;
        tv **nv = realloc(fs->v, cap * sizeof *nv);
        if (!nv) {   /* cannot queue: free it right here (recursing) */
            c->rc = 1;
            tv_unref(c);
            return;
        }
        fs->v = nv;
        fs->cap = cap;
    }
    fs->v[fs->n++] = c;
}

/* Frees iteratively with an explicit stack: a template can build lists nested 100k deep
 * (set ns.x = [ns.x] in a loop), which recursive freeing would overflow the C stack on. */
void tv_unref(tv *v) {
    if (!v || v->rc < 0) return;
    if (--v->rc > 0) return;
    free_stack fs = {0};
    for (;;) {
        switch (v->kind) {
        case TV_STR: free(v->u.str.s); break;
        case TV_UNDEF: free(v->u.undef.hint); break;
        case TV_LIST:
            for (size_t i = 0; i < v->u.list.n; i++) release(&fs, v->u.list.v[i]);
            free(v->u.list.v);
            free(v->u.list.pending);
            break;
        case TV_DICT:
        case TV_NS:
            for (size_t i = 0; i < v->u.dict.n; i++) {
                release(&fs, v->u.dict.k[i]);
                release(&fs, v->u.dict.v[i]);
            }
            free(v->u.dict.k);
            free(v->u.dict.v);
            break;
        case TV_FUNC: release(&fs, v->u.func.self); break;
        case TV_LOOP: release(&fs, v->u.loop.items); break;
        default: break;
        }
        free(v);
        if (!fs.n) break;
        v = fs.v[--fs.n];
    }
    free(fs.v);
}

void tv_make_literal(tv *v) {
    if (v && v->rc > 0) v->rc = -2;   /* -2: immortal but owned by a template */
}

void tv_free_literal(tv *v) {
    if (!v || v->rc != -2) {
        tv_unref(v);
        return;
    }
    if (v->kind == TV_STR) free(v->u.str.s);
    free(v);
}

int tv_list_push_steal(tv *l, tv *item) {
    if (!item) return -1;
    if (l->u.list.n == l->u.list.cap) {
        size_t cap = l->u.list.cap ? l->u.list.cap * 2 : 4;
        tv **nv = realloc(l->u.list.v, cap * sizeof *nv);
        if (!nv) {
            tv_unref(item);
            return -1;
        }
        l->u.list.v = nv;
        l->u.list.cap = cap;
    }
    l->u.list.v[l->u.list.n++] = item;
    return 0;
}

int tv_list_push(tv *l, tv *item) { return tv_list_push_steal(l, tv_ref(item)); }

static long dict_find(const tv *d, const tv *key) {
    for (size_t i = 0; i < d->u.dict.n; i++)
        if (tv_equal(d->u.dict.k[i], key)) return (long)i;
    return -1;
}

int tv_dict_set(tv *d, tv *key, tv *val) {
    long i = dict_find(d, key);
    if (i >= 0) {
        tv_unref(d->u.dict.v[i]);
        d->u.dict.v[i] = tv_ref(val);
        return 0;
    }
    if (d->u.dict.n == d->u.dict.cap) {
        size_t cap = d->u.dict.cap ? d->u.dict.cap * 2 : 4;
        tv **nk = realloc(d->u.dict.k, cap * sizeof *nk);
        if (!nk) return -1;
        d->u.dict.k = nk;
        tv **nv = realloc(d->u.dict.v, cap * sizeof *nv);
        if (!nv) return -1;
        d->u.dict.v = nv;
        d->u.dict.cap = cap;
    }
    d->u.dict.k[d->u.dict.n] = tv_ref(key);
    d->u.dict.v[d->u.dict.n] = tv_ref(val);
    d->u.dict.n++;
    return 0;
}

int tv_dict_set_str(tv *d, const char *key, tv *val) {
    tv *k = tv_cstr(key);
    if (!k) return -1;
    int rc = tv_dict_set(d, k, val);
    tv_unref(k);
    return rc;
}

tv *tv_dict_get(const tv *d, const tv *key) {
    long i = dict_find(d, key);
    return i >= 0 ? d->u.dict.v[i] : NULL;
}

tv *tv_dict_get_str(const tv *d, const char *key) {
    size_t n = strlen(key);
    for (size_t i = 0; i < d->u.dict.n; i++) {
        const tv *k = d->u.dict.k[i];
        if (k->kind == TV_STR && k->u.str.len == n && !memcmp(k->u.str.s, key, n))
            return d->u.dict.v[i];
    }
    return NULL;
}

int tv_truthy(const tv *v) {
    switch (v->kind) {
    case TV_UNDEF:
    case TV_NONE: return 0;
    case TV_BOOL: return v->u.b;
    case TV_INT: return v->u.i != 0;
    case TV_FLOAT: return v->u.f != 0.0;
    case TV_STR: return v->u.str.len != 0;
    case TV_LIST: return v->u.list.n != 0 || tv_is_iterator(v);
    case TV_DICT: return v->u.dict.n != 0;
    default: return 1;
    }
}

int tv_is_number(const tv *v) {
    return v->kind == TV_INT || v->kind == TV_FLOAT || v->kind == TV_BOOL;
}

double tv_num(const tv *v) {
    if (v->kind == TV_INT) return (double)v->u.i;
    if (v->kind == TV_FLOAT) return v->u.f;
    if (v->kind == TV_BOOL) return v->u.b;
    return 0;
}

static int equal_depth(const tv *a, const tv *b, int depth);

int tv_equal(const tv *a, const tv *b) { return equal_depth(a, b, 0); }

/* Deeper than MAX_EQ_DEPTH counts as unequal rather than overflowing the stack. */
#define MAX_EQ_DEPTH 500

static int equal_depth(const tv *a, const tv *b, int depth) {
    if (a == b) return 1;
    if (depth > MAX_EQ_DEPTH) return 0;
    if (tv_is_number(a) && tv_is_number(b)) {
        if (a->kind != TV_FLOAT && b->kind != TV_FLOAT) {
            int64_t x = a->kind == TV_INT ? a->u.i : a->u.b;
            int64_t y = b->kind == TV_INT ? b->u.i : b->u.b;
            return x == y;
        }
        return tv_num(a) == tv_num(b);
    }
    if (a->kind != b->kind) return 0;
    switch (a->kind) {
    case TV_UNDEF:
    case TV_NONE: return 1;
    case TV_STR:
        return a->u.str.len == b->u.str.len && !memcmp(a->u.str.s, b->u.str.s, a->u.str.len);
    case TV_LIST:
        if (a->u.list.tuple != b->u.list.tuple || a->u.list.n != b->u.list.n) return 0;
        if (a->u.list.view || b->u.list.view) {   /* views: equal when same kind and items */
            if (!a->u.list.view || !b->u.list.view || strcmp(a->u.list.view, b->u.list.view) ||
                tv_is_iterator(a))
                return 0;
        }
        for (size_t i = 0; i < a->u.list.n; i++)
            if (!equal_depth(a->u.list.v[i], b->u.list.v[i], depth + 1)) return 0;
        return 1;
    case TV_DICT:
        if (a->u.dict.n != b->u.dict.n) return 0;
        for (size_t i = 0; i < a->u.dict.n; i++) {
            const tv *o = tv_dict_get(b, a->u.dict.k[i]);
            if (!o || !equal_depth(a->u.dict.v[i], o, depth + 1)) return 0;
        }
        return 1;
    case TV_FUNC:
        return a->u.func.fn == b->u.func.fn && a->u.func.self == b->u.func.self;
    case TV_MACRO: return a->u.macro.node == b->u.macro.node;
    default: return 0;
    }
}

const char *tv_type_name(const tv *v) {
    switch (v->kind) {
    case TV_UNDEF: return "Undefined";
    case TV_NONE: return "NoneType";
    case TV_BOOL: return "bool";
    case TV_INT: return "int";
    case TV_FLOAT: return "float";
    case TV_STR: return v->u.str.safe ? "Markup" : "str";
    case TV_LIST: return v->u.list.view ? v->u.list.view : v->u.list.tuple ? "tuple" : "list";
    case TV_DICT: return "dict";
    case TV_NS: return "Namespace";
    case TV_MACRO: return "Macro";
    case TV_FUNC: return "builtin_function_or_method";
    case TV_LOOP: return "LoopContext";
    }
    return "object";
}

/* ---- buffers ---- */

void tv_buf_put(tv_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->limit && b->len + n > b->limit) {
        b->oom = 2;
        return;
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *ns = realloc(b->s, cap);
        if (!ns) {
            b->oom = 1;
            return;
        }
        b->s = ns;
        b->cap = cap;
    }
    if (n) memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

void tv_buf_puts(tv_buf *b, const char *s) { tv_buf_put(b, s, strlen(s)); }

void tv_buf_printf(tv_buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        tv_buf_put(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = 1;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    tv_buf_put(b, big, (size_t)n);
    free(big);
}

char *tv_buf_take(tv_buf *b, size_t *len) {
    if (!b->s) tv_buf_put(b, "", 0);
    char *s = b->s;
    if (len) *len = b->len;
    b->s = NULL;
    b->len = b->cap = 0;
    return s;
}

void tv_buf_free(tv_buf *b) {
    free(b->s);
    b->s = NULL;
    b->len = b->cap = 0;
}

/* ---- text forms ---- */

/* Python's float repr: the shortest digit string that reads back to the same double,
 * written positional when 1e-4 <= |f| < 1e16 and in exponent form otherwise. */
void tv_write_float(tv_buf *b, double f) {
    if (isnan(f)) {
        tv_buf_puts(b, "nan");
        return;
    }
    if (isinf(f)) {
        tv_buf_puts(b, f < 0 ? "-inf" : "inf");
        return;
    }
    char tmp[64];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    /* tmp: [-]d[.ddd]e[+-]xx */
    char digits[32];
    size_t nd = 0;
    const char *p = tmp;
    int neg = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    if (neg) tv_buf_put(b, "-", 1);
    if (exp < -4 || exp >= 16) {
        tv_buf_put(b, digits, 1);
        if (nd > 1) {
            tv_buf_put(b, ".", 1);
            tv_buf_put(b, digits + 1, nd - 1);
        }
        tv_buf_printf(b, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    } else if (exp < 0) {
        tv_buf_puts(b, "0.");
        for (int i = 0; i < -exp - 1; i++) tv_buf_put(b, "0", 1);
        tv_buf_put(b, digits, nd);
    } else {
        size_t intd = (size_t)exp + 1;
        if (nd <= intd) {
            tv_buf_put(b, digits, nd);
            for (size_t i = nd; i < intd; i++) tv_buf_put(b, "0", 1);
            tv_buf_puts(b, ".0");
        } else {
            tv_buf_put(b, digits, intd);
            tv_buf_put(b, ".", 1);
            tv_buf_put(b, digits + intd, nd - intd);
        }
    }
}

/* Decode one UTF-8 code point at s (len bytes left); returns its byte length (>= 1). */
static size_t utf8_next(const unsigned char *s, size_t len, uint32_t *cp) {
    unsigned c = s[0];
    size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (n > len || c >= 0xF8 || (c >= 0x80 && c < 0xC0)) {
        *cp = c;
        return 1;
    }
    uint32_t v = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t i = 1; i < n; i++) v = (v << 6) | (s[i] & 0x3F);
    *cp = v;
    return n;
}

static void write_str_repr(tv_buf *b, const char *s, size_t len) {
    int has_sq = memchr(s, '\'', len) != NULL, has_dq = memchr(s, '"', len) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    tv_buf_put(b, &q, 1);
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        uint32_t cp;
        size_t n = utf8_next(u + i, len - i, &cp);
        if (cp == (uint32_t)q || cp == '\\') {
            tv_buf_put(b, "\\", 1);
            tv_buf_put(b, s + i, 1);
        } else if (cp == '\n') tv_buf_puts(b, "\\n");
        else if (cp == '\r') tv_buf_puts(b, "\\r");
        else if (cp == '\t') tv_buf_puts(b, "\\t");
        else if (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp < 0xa0) || cp == 0xad)
            tv_buf_printf(b, "\\x%02x", cp);
        else if (cp == 0x2028 || cp == 0x2029 || (cp >= 0x200b && cp <= 0x200f) ||
                 cp == 0xfeff)
            tv_buf_printf(b, "\\u%04x", cp);
        else tv_buf_put(b, s + i, n);
        i += n;
    }
    tv_buf_put(b, &q, 1);
}

/* Containers nested deeper than this print as an error (Python raises RecursionError);
 * it also stops namespaces that contain themselves. */
#define MAX_REPR_DEPTH 500

static void write_any(tv_buf *b, const tv *v, int repr, int depth);

static void write_list(tv_buf *b, const tv *v, int depth) {
    const char *view = v->u.list.view;
    if (view && tv_is_iterator(v)) {
        /* CPython prints an address; print one of the usual width so that lengths agree */
        if (v->u.list.origin) tv_buf_printf(b, "<%s object %s at 0x7f0000000000>", view, v->u.list.origin);
        else tv_buf_printf(b, "<%s object at 0x7f0000000000>", view);
        return;
    }
    if (view && !strcmp(view, "range")) {
        int64_t n = (int64_t)v->u.list.n, a = n ? v->u.list.v[0]->u.i : 0;
        int64_t step = n > 1 ? v->u.list.v[1]->u.i - a : 1;
        if (step == 1) tv_buf_printf(b, "range(%lld, %lld)", (long long)a, (long long)(a + n));
        else tv_buf_printf(b, "range(%lld, %lld, %lld)", (long long)a, (long long)(a + n * step),
                           (long long)step);
        return;
    }
    if (view) {   /* dict_items([...]) and friends */
        tv_buf_printf(b, "%s(", view);
        tv plain = *v;
        plain.u.list.view = NULL;
        write_list(b, &plain, depth);
        tv_buf_put(b, ")", 1);
        return;
    }
    int tup = v->u.list.tuple;
    tv_buf_put(b, tup ? "(" : "[", 1);
    for (size_t i = 0; i < v->u.list.n; i++) {
        if (i) tv_buf_puts(b, ", ");
        write_any(b, v->u.list.v[i], 1, depth + 1);
    }
    if (tup && v->u.list.n == 1) tv_buf_put(b, ",", 1);
    tv_buf_put(b, tup ? ")" : "]", 1);
}

static void write_dict(tv_buf *b, const tv *v, int depth) {
    tv_buf_put(b, "{", 1);
    for (size_t i = 0; i < v->u.dict.n; i++) {
        if (i) tv_buf_puts(b, ", ");
        write_any(b, v->u.dict.k[i], 1, depth + 1);
        tv_buf_puts(b, ": ");
        write_any(b, v->u.dict.v[i], 1, depth + 1);
    }
    tv_buf_put(b, "}", 1);
}

static void write_any(tv_buf *b, const tv *v, int repr, int depth) {
    if (depth > MAX_REPR_DEPTH) {
        b->oom = 3;
        return;
    }
    switch (v->kind) {
    case TV_UNDEF:
        if (repr) tv_buf_puts(b, "Undefined");
        break;
    case TV_NONE: tv_buf_puts(b, "None"); break;
    case TV_BOOL: tv_buf_puts(b, v->u.b ? "True" : "False"); break;
    case TV_INT: tv_buf_printf(b, "%lld", (long long)v->u.i); break;
    case TV_FLOAT: tv_write_float(b, v->u.f); break;
    case TV_STR:
        if (repr && v->u.str.safe) tv_buf_puts(b, "Markup(");
        if (repr) write_str_repr(b, v->u.str.s, v->u.str.len);
        else tv_buf_put(b, v->u.str.s, v->u.str.len);
        if (repr && v->u.str.safe) tv_buf_puts(b, ")");
        break;
    case TV_LIST: write_list(b, v, depth); break;
    case TV_DICT: write_dict(b, v, depth); break;
    case TV_NS:
        tv_buf_puts(b, "<Namespace ");
        write_dict(b, v, depth);
        tv_buf_puts(b, ">");
        break;
    case TV_MACRO: tv_buf_puts(b, "<Macro>"); break;
    case TV_FUNC: tv_buf_printf(b, "<built-in method %s>", v->u.func.name); break;
    case TV_LOOP:
        tv_buf_printf(b, "<LoopContext %lld/%lld>", (long long)v->u.loop.index0 + 1,
                      (long long)v->u.loop.length);
        break;
    }
}

void tv_write_str(tv_buf *b, const tv *v) { write_any(b, v, 0, 0); }
void tv_write_repr(tv_buf *b, const tv *v) { write_any(b, v, 1, 0); }

tv *tv_to_str(const tv *v) {
    if (v->kind == TV_STR) return tv_ref((tv *)v);
    tv_buf b = {0};
    tv_write_str(&b, v);
    if (b.oom) {
        tv_buf_free(&b);
        return NULL;
    }
    size_t n;
    char *s = tv_buf_take(&b, &n);
    return s ? tv_str_take(s, n) : NULL;
}

/* ---- JSON (Python json.dumps with ensure_ascii=False) ---- */

static void json_str(tv_buf *b, const char *s, size_t len, int ascii) {
    tv_buf_put(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char tmp[16];
        if (ascii && c >= 0x7f) {
            uint32_t cp;
            size_t n = utf8_next((const unsigned char *)s + i, len - i, &cp);
            tv_buf_put(b, s + run, i - run);
            if (cp >= 0x10000)
                tv_buf_printf(b, "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10),
                              0xDC00 + ((cp - 0x10000) & 0x3FF));
            else
                tv_buf_printf(b, "\\u%04x", cp);
            i += n - 1;
            run = i + 1;
            continue;
        }
        if (c == '"') esc = "\\\"";
        else if (c == '\\') esc = "\\\\";
        else if (c == '\n') esc = "\\n";
        else if (c == '\r') esc = "\\r";
        else if (c == '\t') esc = "\\t";
        else if (c == '\b') esc = "\\b";
        else if (c == '\f') esc = "\\f";
        else if (c < 0x20) {
            snprintf(tmp, sizeof tmp, "\\u%04x", c);
            esc = tmp;
        }
        if (esc) {
            tv_buf_put(b, s + run, i - run);
            tv_buf_puts(b, esc);
            run = i + 1;
        }
    }
    tv_buf_put(b, s + run, len - run);
    tv_buf_put(b, "\"", 1);
}

typedef struct {
    int indent;
    int ascii;
    const char *isep, *ksep;
    int sort;
    char *err;
    size_t errlen;
} json_opts;

static void json_newline(tv_buf *b, const json_opts *o, int depth) {
    tv_buf_put(b, "\n", 1);
    for (int i = 0; i < o->indent * depth; i++) tv_buf_put(b, " ", 1);
}

/* Python's json coerces non-string keys to text; ordering by key is by that text only
 * when all keys are strings, which is what chat data holds. */
static int json_key(tv_buf *b, const tv *k, const json_opts *o) {
    switch (k->kind) {
    case TV_STR: json_str(b, k->u.str.s, k->u.str.len, o->ascii); return 0;
    case TV_INT: tv_buf_printf(b, "\"%lld\"", (long long)k->u.i); return 0;
    case TV_BOOL: tv_buf_puts(b, k->u.b ? "\"true\"" : "\"false\""); return 0;
    case TV_NONE: tv_buf_puts(b, "\"null\""); return 0;
    case TV_FLOAT:
        tv_buf_put(b, "\"", 1);
        tv_write_float(b, k->u.f);
        tv_buf_put(b, "\"", 1);
        return 0;
    default:
        snprintf(o->err, o->errlen,
                 "TypeError: keys must be str, int, float, bool or None, not %s",
                 tv_type_name(k));
        return -1;
    }
}

static int str_cmp(const tv *a, const tv *b) {
    size_t n = a->u.str.len < b->u.str.len ? a->u.str.len : b->u.str.len;
    int c = memcmp(a->u.str.s, b->u.str.s, n);
    if (c) return c;
    return a->u.str.len < b->u.str.len ? -1 : a->u.str.len > b->u.str.len;
}

static int json_any(tv_buf *b, const tv *v, const json_opts *o, int depth);

static int json_dict(tv_buf *b, const tv *v, const json_opts *o, int depth) {
    size_t n = v->u.dict.n;
    if (!n) {
        tv_buf_puts(b, "{}");
        return 0;
    }
    size_t *ord = malloc(n * sizeof *ord);
    if (!ord) return -1;
    for (size_t i = 0; i < n; i++) ord[i] = i;
    if (o->sort) {   /* insertion sort: stable and dicts are small */
        for (size_t i = 1; i < n; i++) {
            size_t x = ord[i], j = i;
            const tv *kx = v->u.dict.k[x];
            while (j > 0 && kx->kind == TV_STR && v->u.dict.k[ord[j - 1]]->kind == TV_STR &&
                   str_cmp(v->u.dict.k[ord[j - 1]], kx) > 0) {
                ord[j] = ord[j - 1];
                j--;
            }
            ord[j] = x;
        }
    }
    tv_buf_put(b, "{", 1);
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        if (i) tv_buf_puts(b, o->isep);
        if (o->indent >= 0) json_newline(b, o, depth + 1);
        rc = json_key(b, v->u.dict.k[ord[i]], o);
        if (!rc) {
            tv_buf_puts(b, o->ksep);
            rc = json_any(b, v->u.dict.v[ord[i]], o, depth + 1);
        }
    }
    free(ord);
    if (o->indent >= 0) json_newline(b, o, depth);
    tv_buf_put(b, "}", 1);
    return rc;
}

static int json_any(tv_buf *b, const tv *v, const json_opts *o, int depth) {
    if (depth > 200) {
        snprintf(o->err, o->errlen, "RecursionError: maximum recursion depth exceeded");
        return -1;
    }
    switch (v->kind) {
    case TV_NONE: tv_buf_puts(b, "null"); return 0;
    case TV_BOOL: tv_buf_puts(b, v->u.b ? "true" : "false"); return 0;
    case TV_INT: tv_buf_printf(b, "%lld", (long long)v->u.i); return 0;
    case TV_FLOAT:
        if (isnan(v->u.f)) tv_buf_puts(b, "NaN");
        else if (isinf(v->u.f)) tv_buf_puts(b, v->u.f < 0 ? "-Infinity" : "Infinity");
        else tv_write_float(b, v->u.f);
        return 0;
    case TV_STR: json_str(b, v->u.str.s, v->u.str.len, o->ascii); return 0;
    case TV_LIST:
        if (v->u.list.view) {
            snprintf(o->err, o->errlen, "TypeError: Object of type %s is not JSON serializable",
                     v->u.list.view);
            return -1;
        }
        if (!v->u.list.n) {
            tv_buf_puts(b, "[]");
            return 0;
        }
        tv_buf_put(b, "[", 1);
        for (size_t i = 0; i < v->u.list.n; i++) {
            if (i) tv_buf_puts(b, o->isep);
            if (o->indent >= 0) json_newline(b, o, depth + 1);
            if (json_any(b, v->u.list.v[i], o, depth + 1)) return -1;
        }
        if (o->indent >= 0) json_newline(b, o, depth);
        tv_buf_put(b, "]", 1);
        return 0;
    case TV_DICT: return json_dict(b, v, o, depth);
    default:
        snprintf(o->err, o->errlen, "TypeError: Object of type %s is not JSON serializable",
                 tv_type_name(v));
        return -1;
    }
}

int tv_write_json(tv_buf *b, const tv *v, int indent, const char *item_sep,
                  const char *key_sep, int sort_keys, int ensure_ascii, char *err,
                  size_t errlen) {
    json_opts o = {indent, ensure_ascii, item_sep ? item_sep : (indent >= 0 ? "," : ", "),
                   key_sep ? key_sep : ": ", sort_keys, err, errlen};
    return json_any(b, v, &o, 0);
}

tv *tv_from_json(json_t *j) {
    switch (json_typeof(j)) {
    case JSON_NULL: return tv_none();
    case JSON_TRUE: return tv_bool(1);
    case JSON_FALSE: return tv_bool(0);
    case JSON_INTEGER: return tv_int((int64_t)json_integer_value(j));
    case JSON_REAL: return tv_float(json_real_value(j));
    case JSON_STRING: return tv_str(json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        tv *l = tv_list();
        if (!l) return NULL;
        for (size_t i = 0; i < json_array_size(j); i++)
            if (tv_list_push_steal(l, tv_from_json(json_array_get(j, i)))) {
                tv_unref(l);
                return NULL;
            }
        return l;
    }
    case JSON_OBJECT: {
        /* jansson keys are unique: append without the duplicate search (which would make
         * a large object quadratic to load) */
        size_t n = json_object_size(j);
        tv *d = tv_dict();
        if (!d) return NULL;
        d->u.dict.k = calloc(n + 1, sizeof *d->u.dict.k);
        d->u.dict.v = calloc(n + 1, sizeof *d->u.dict.v);
        d->u.dict.cap = n + 1;
        if (!d->u.dict.k || !d->u.dict.v) {
            tv_unref(d);
            return NULL;
        }
        const char *k;
        json_t *x;
        json_object_foreach(j, k, x) {
            tv *key = tv_cstr(k), *val = key ? tv_from_json(x) : NULL;
            if (!val) {
                tv_unref(key);
                tv_unref(d);
                return NULL;
            }
            d->u.dict.k[d->u.dict.n] = key;
            d->u.dict.v[d->u.dict.n++] = val;
        }
        return d;
    }
    }
    return NULL;
}

size_t tv_utf8_len(const char *s, size_t len) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) n++;
    return n;
}

size_t tv_utf8_offset(const char *s, size_t len, size_t cp) {
    size_t i = 0, n = 0;
    for (; i < len; i++) {
        if (((unsigned char)s[i] & 0xC0) != 0x80) {
            if (n == cp) return i;
            n++;
        }
    }
    return len;
}
