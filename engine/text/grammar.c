/* Grammar compile: the NFA fragment builder the front ends use, the choice front end, and
 * the NFA -> DFA step (subset construction per rule, over byte classes; call edges are
 * labels like bytes). See grammar.h for the model and grammar_internal.h for the builder's
 * contiguity rule. */
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/grammar_internal.h"

/* ---- builder --------------------------------------------------------------------------- */

int gb_fail(gbuild *b, const char *fmt, ...) {
    if (!b->failed && b->err && b->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->err, b->errlen, fmt, ap);
        va_end(ap);
    }
    b->failed = 1;
    return -1;
}

int32_t gb_state(gbuild *b) {
    if (b->n_states >= GB_MAX_STATES) {
        gb_fail(b, "grammar too large (more than %d NFA states)", GB_MAX_STATES);
        return 0;   /* keeps building harmlessly; the caller checks b->failed */
    }
    return b->n_states++;
}

static gedge *new_edge(gbuild *b, int32_t from, int32_t to, int32_t rule) {
    if (b->n_edges == b->cap_edges) {
        int32_t cap = b->cap_edges ? b->cap_edges * 2 : 256;
        gedge *n = realloc(b->edges, (size_t)cap * sizeof *n);
        if (!n) {
            gb_fail(b, "out of memory");
            static gedge sink;
            return &sink;
        }
        b->edges = n;
        b->cap_edges = cap;
    }
    gedge *e = &b->edges[b->n_edges++];
    memset(e, 0, sizeof *e);
    e->from = from;
    e->to = to;
    e->rule = rule;
    return e;
}

void gb_eps(gbuild *b, int32_t from, int32_t to) { new_edge(b, from, to, GE_EPS); }

static gfrag frag2(gbuild *b, int32_t s0, int32_t e0) {
    gfrag f = {.s0 = s0, .e0 = e0};
    f.in = gb_state(b);
    f.out = gb_state(b);
    return f;
}

gfrag gb_empty(gbuild *b) {
    gfrag f = frag2(b, b->n_states, b->n_edges);
    gb_eps(b, f.in, f.out);
    return f;
}

gfrag gb_set(gbuild *b, const gbyteset *s) {
    gfrag f = frag2(b, b->n_states, b->n_edges);
    new_edge(b, f.in, f.out, GE_BYTES)->set = *s;
    return f;
}

gfrag gb_byte(gbuild *b, int c) {
    gbyteset s = {{0}};
    gbs_add(&s, c & 255);
    return gb_set(b, &s);
}

gfrag gb_lit(gbuild *b, const char *s, size_t n) {
    gfrag f = {.s0 = b->n_states, .e0 = b->n_edges};
    f.in = f.out = gb_state(b);
    for (size_t i = 0; i < n; i++) {
        int32_t t = gb_state(b);
        gbyteset set = {{0}};
        gbs_add(&set, (unsigned char)s[i]);
        new_edge(b, f.out, t, GE_BYTES)->set = set;
        f.out = t;
    }
    return f;
}

gfrag gb_call(gbuild *b, int32_t rule) {
    gfrag f = frag2(b, b->n_states, b->n_edges);
    new_edge(b, f.in, f.out, rule);
    return f;
}

static int32_t min32(int32_t a, int32_t c) { return a < c ? a : c; }

gfrag gb_seq(gbuild *b, gfrag a, gfrag c) {
    gb_eps(b, a.out, c.in);
    return (gfrag){.in = a.in, .out = c.out, .s0 = min32(a.s0, c.s0), .e0 = min32(a.e0, c.e0)};
}

gfrag gb_alt(gbuild *b, gfrag a, gfrag c) {
    gfrag f = frag2(b, min32(a.s0, c.s0), min32(a.e0, c.e0));
    gb_eps(b, f.in, a.in);
    gb_eps(b, f.in, c.in);
    gb_eps(b, a.out, f.out);
    gb_eps(b, c.out, f.out);
    return f;
}

gfrag gb_opt(gbuild *b, gfrag a) {
    gfrag f = frag2(b, a.s0, a.e0);
    gb_eps(b, f.in, a.in);
    gb_eps(b, f.in, f.out);
    gb_eps(b, a.out, f.out);
    return f;
}

gfrag gb_star(gbuild *b, gfrag a) {
    gfrag f = frag2(b, a.s0, a.e0);
    gb_eps(b, f.in, a.in);
    gb_eps(b, f.in, f.out);
    gb_eps(b, a.out, a.in);
    gb_eps(b, a.out, f.out);
    return f;
}

gfrag gb_plus(gbuild *b, gfrag a) {
    gfrag f = frag2(b, a.s0, a.e0);
    gb_eps(b, f.in, a.in);
    gb_eps(b, a.out, a.in);
    gb_eps(b, a.out, f.out);
    return f;
}

/* A copy of fragment a, whose range is [a.s0, s_end) states and [a.e0, e_end) edges. */
static gfrag copy_range(gbuild *b, gfrag a, int32_t s_end, int32_t e_end) {
    int32_t base = b->n_states, e_base = b->n_edges, ds = base - a.s0;
    for (int32_t i = a.s0; i < s_end; i++) gb_state(b);
    for (int32_t i = a.e0; i < e_end && !b->failed; i++) {
        gedge src = b->edges[i];   /* by value: new_edge may move the array */
        gedge *e = new_edge(b, src.from + ds, src.to + ds, src.rule);
        e->set = src.set;
    }
    return (gfrag){.in = a.in + ds, .out = a.out + ds, .s0 = base, .e0 = e_base};
}

gfrag gb_repeat(gbuild *b, gfrag a, int min, int max) {
    if (max == 0) return gb_empty(b);
    int count = max < 0 ? (min > 1 ? min : 1) : max;
    if ((long long)count * (b->n_states - a.s0) > GB_MAX_STATES) {
        gb_fail(b, "grammar too large (a repetition of %d copies)", count);
        return a;
    }
    int32_t s_end = b->n_states, e_end = b->n_edges;
    gfrag *c = malloc((size_t)count * sizeof *c);
    if (!c) {
        gb_fail(b, "out of memory");
        return a;
    }
    c[0] = a;
    for (int i = 1; i < count && !b->failed; i++) c[i] = copy_range(b, a, s_end, e_end);
    gfrag f;
    if (max < 0) {
        if (min <= 1) {
            f = min == 0 ? gb_star(b, c[0]) : gb_plus(b, c[0]);
        } else {
            f = c[0];
            for (int i = 1; i < min - 1; i++) f = gb_seq(b, f, c[i]);
            f = gb_seq(b, f, gb_plus(b, c[min - 1]));
        }
    } else {
        gfrag tail = gb_opt(b, c[max - 1]);
        int have_tail = max > min;
        if (have_tail)
            for (int j = max - 2; j >= min; j--) tail = gb_opt(b, gb_seq(b, c[j], tail));
        if (min == 0) {
            f = tail;
        } else {
            f = c[0];
            for (int i = 1; i < min; i++) f = gb_seq(b, f, c[i]);
            if (have_tail) f = gb_seq(b, f, tail);
        }
    }
    free(c);
    f.s0 = a.s0;
    f.e0 = a.e0;
    return f;
}

/* ---- UTF-8 code point ranges ----------------------------------------------------------- */

static int utf8_len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

static void utf8_put(uint32_t cp, unsigned char *o) {
    int n = utf8_len(cp);
    if (n == 1) {
        o[0] = (unsigned char)cp;
        return;
    }
    static const unsigned char lead[5] = {0, 0, 0xC0, 0xE0, 0xF0};
    for (int i = n - 1; i > 0; i--) {
        o[i] = (unsigned char)(0x80 | (cp & 0x3F));
        cp >>= 6;
    }
    o[0] = (unsigned char)(lead[n] | cp);
}

/* Chains from in to out for every encoding of lo..hi: split until each piece is one byte
 * range per position (the classic UTF-8 range split). */
static void utf8_ranges(gbuild *b, int32_t in, int32_t out, uint32_t lo, uint32_t hi) {
    static const uint32_t top[3] = {0x7F, 0x7FF, 0xFFFF};
    for (int i = 0; i < 3; i++)
        if (lo <= top[i] && hi > top[i]) {
            utf8_ranges(b, in, out, lo, top[i]);
            utf8_ranges(b, in, out, top[i] + 1, hi);
            return;
        }
    int n = utf8_len(lo);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if (lo & m) {
                utf8_ranges(b, in, out, lo, lo | m);
                utf8_ranges(b, in, out, (lo | m) + 1, hi);
                return;
            }
            if ((hi & m) != m) {
                utf8_ranges(b, in, out, lo, (hi & ~m) - 1);
                utf8_ranges(b, in, out, hi & ~m, hi);
                return;
            }
        }
    }
    unsigned char a[4], c[4];
    utf8_put(lo, a);
    utf8_put(hi, c);
    int32_t s = in;
    for (int i = 0; i < n; i++) {
        int32_t t = i == n - 1 ? out : gb_state(b);
        gbyteset set = {{0}};
        gbs_range(&set, a[i], c[i]);
        new_edge(b, s, t, GE_BYTES)->set = set;
        s = t;
    }
}

gfrag gb_codepoints(gbuild *b, const uint32_t *lo, const uint32_t *hi, int n) {
    gfrag f = frag2(b, b->n_states, b->n_edges);
    for (int i = 0; i < n; i++) {
        uint32_t l = lo[i], h = hi[i] > 0x10FFFF ? 0x10FFFF : hi[i];
        if (l > h) continue;
        if (l < 0xD800 && h > 0xDFFF) {   /* skip the surrogates */
            utf8_ranges(b, f.in, f.out, l, 0xD7FF);
            utf8_ranges(b, f.in, f.out, 0xE000, h);
        } else if (h < 0xD800 || l > 0xDFFF) {
            utf8_ranges(b, f.in, f.out, l, h);
        } else if (l < 0xD800) {
            utf8_ranges(b, f.in, f.out, l, 0xD7FF);
        } else if (h > 0xDFFF) {
            utf8_ranges(b, f.in, f.out, 0xE000, h);
        }
    }
    return f;
}

int32_t gb_rule(gbuild *b) {
    if (b->n_rules == b->cap_rules) {
        int32_t cap = b->cap_rules ? b->cap_rules * 2 : 16;
        void *n = realloc(b->rules, (size_t)cap * sizeof *b->rules);
        if (!n) return gb_fail(b, "out of memory"), 0;
        b->rules = n;
        b->cap_rules = cap;
    }
    b->rules[b->n_rules].start = b->rules[b->n_rules].accept = -1;
    return b->n_rules++;
}

void gb_rule_set(gbuild *b, int32_t rule, gfrag body) {
    b->rules[rule].start = body.in;
    b->rules[rule].accept = body.out;
}

/* ---- choice ---------------------------------------------------------------------------- */

static int build_choice(gbuild *b, const char *spec, size_t len) {
    json_error_t je;
    json_t *a = json_loadb(spec, len, 0, &je);
    if (!json_is_array(a) || json_array_size(a) == 0) {
        json_decref(a);
        return gb_fail(b, "choice must be a non-empty JSON array of strings");
    }
    gfrag f = {0};
    size_t i;
    json_t *v;
    json_array_foreach(a, i, v) {
        if (!json_is_string(v)) {
            json_decref(a);
            return gb_fail(b, "choice[%zu] is not a string", i);
        }
        gfrag l = gb_lit(b, json_string_value(v), json_string_length(v));
        f = i ? gb_alt(b, f, l) : l;
    }
    json_decref(a);
    gb_rule_set(b, 0, f);
    return b->failed ? -1 : 0;
}

/* ---- NFA -> DFA ------------------------------------------------------------------------ */

typedef struct {
    gbuild *b;
    int32_t *off;              /* (n_states + 1) CSR of edges by from */
    int32_t *adj;              /* edge ids */
    uint32_t *mark;            /* (n_states) closure stamps */
    uint32_t stamp;
    int32_t *stack;
    gbyteset *edge_cls;        /* per edge: the byte classes it covers (bit c) */
    /* interned subsets: pool of sorted NFA state lists */
    int32_t *pool;
    size_t n_pool, cap_pool;
    int64_t *set_off;          /* (n_dfa + 1) */
    int32_t *set_rule;
    int32_t n_dfa, cap_dfa;
    int32_t *hash;             /* open addressing: dfa id + 1 */
    uint32_t hash_mask;
} dfa_build;

static int cmp_i32(const void *a, const void *c) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)c;
    return (x > y) - (x < y);
}

/* Epsilon closure of the n states in buf (buf has room for every NFA state); returns the
 * new count, sorted. */
static int closure(dfa_build *d, int32_t *buf, int n) {
    uint32_t st = ++d->stamp;
    int sp = 0, m = 0;
    for (int i = 0; i < n; i++)
        if (d->mark[buf[i]] != st) d->mark[buf[i]] = st, d->stack[sp++] = buf[i];
    while (sp) {
        int32_t s = d->stack[--sp];
        buf[m++] = s;
        for (int32_t k = d->off[s]; k < d->off[s + 1]; k++) {
            const gedge *e = &d->b->edges[d->adj[k]];
            if (e->rule == GE_EPS && d->mark[e->to] != st) {
                d->mark[e->to] = st;
                d->stack[sp++] = e->to;
            }
        }
    }
    qsort(buf, (size_t)m, sizeof *buf, cmp_i32);
    return m;
}

static uint32_t set_hash(const int32_t *s, int n) {
    uint32_t h = 2166136261u;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)s[i]) * 16777619u;
    return h;
}

static int rehash(dfa_build *d) {
    uint32_t cap = d->hash_mask ? (d->hash_mask + 1) * 2 : 1024;
    int32_t *h = calloc(cap, sizeof *h);
    if (!h) return -1;
    for (int32_t i = 0; i < d->n_dfa; i++) {
        const int32_t *s = d->pool + d->set_off[i];
        uint32_t j = set_hash(s, (int)(d->set_off[i + 1] - d->set_off[i])) & (cap - 1);
        while (h[j]) j = (j + 1) & (cap - 1);
        h[j] = i + 1;
    }
    free(d->hash);
    d->hash = h;
    d->hash_mask = cap - 1;
    return 0;
}

/* The DFA id of a (sorted) subset, adding it if new; -1 on failure (error recorded). */
static int32_t intern(dfa_build *d, const int32_t *s, int n, int32_t rule) {
    if ((uint32_t)d->n_dfa * 2 >= d->hash_mask && rehash(d)) return gb_fail(d->b, "out of memory");
    uint32_t j = set_hash(s, n) & d->hash_mask;
    for (; d->hash[j]; j = (j + 1) & d->hash_mask) {
        int32_t id = d->hash[j] - 1;
        int64_t o = d->set_off[id];
        if (d->set_off[id + 1] - o == n && !memcmp(d->pool + o, s, (size_t)n * sizeof *s)) return id;
    }
    if (d->n_dfa >= GB_MAX_DFA_STATES) return gb_fail(d->b, "grammar too large (more than %d DFA states)", GB_MAX_DFA_STATES);
    if (d->n_dfa + 2 > d->cap_dfa) {
        int32_t cap = d->cap_dfa ? d->cap_dfa * 2 : 1024;
        int64_t *o = realloc(d->set_off, (size_t)(cap + 1) * sizeof *o);
        if (o) d->set_off = o;
        int32_t *r = realloc(d->set_rule, (size_t)cap * sizeof *r);
        if (r) d->set_rule = r;
        if (!o || !r) return gb_fail(d->b, "out of memory");
        d->cap_dfa = cap;
    }
    if (d->n_pool + (size_t)n > d->cap_pool) {
        size_t cap = (d->cap_pool + (size_t)n) * 2;
        int32_t *p = realloc(d->pool, cap * sizeof *p);
        if (!p) return gb_fail(d->b, "out of memory");
        d->pool = p;
        d->cap_pool = cap;
    }
    memcpy(d->pool + d->n_pool, s, (size_t)n * sizeof *s);
    int32_t id = d->n_dfa++;
    d->set_off[id] = (int64_t)d->n_pool;
    d->n_pool += (size_t)n;
    d->set_off[id + 1] = (int64_t)d->n_pool;
    d->set_rule[id] = rule;
    d->hash[j] = id + 1;
    return id;
}

/* Byte classes: bytes no edge tells apart share a class (partition refinement). */
static int byte_classes(const gbuild *b, uint8_t *cls) {
    memset(cls, 0, 256);
    int n = 1;
    const gbyteset *prev = NULL;
    for (int32_t i = 0; i < b->n_edges; i++) {
        const gedge *e = &b->edges[i];
        if (e->rule != GE_BYTES || (prev && !memcmp(prev, &e->set, sizeof *prev))) continue;
        prev = &e->set;
        int16_t remap[256][2];
        memset(remap, -1, sizeof remap);
        int m = 0;
        for (int c = 0; c < 256; c++) {
            int in = gbs_has(&e->set, c);
            if (remap[cls[c]][in] < 0) remap[cls[c]][in] = (int16_t)m++;
        }
        for (int c = 0; c < 256; c++) cls[c] = (uint8_t)remap[cls[c]][gbs_has(&e->set, c)];
        n = m;
    }
    return n;
}

static void dfa_build_free(dfa_build *d) {
    free(d->off);
    free(d->adj);
    free(d->mark);
    free(d->stack);
    free(d->edge_cls);
    free(d->pool);
    free(d->set_off);
    free(d->set_rule);
    free(d->hash);
}

void grammar_unref(grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    free(g->trans);
    free(g->call_off);
    free(g->call_rule);
    free(g->call_to);
    free(g->flags);
    free(g->dist);
    free(g->rule_start);
    free(atomic_load(&g->mclasses));
    grammar_mask_cache_clear(&g->shared);
    pthread_mutex_destroy(&g->shared.mu);
    pthread_cond_destroy(&g->shared.done);
    free(g);
}

grammar *grammar_ref(grammar *g) {
    atomic_fetch_add(&g->refs, 1);
    return g;
}

int grammar_n_states(const grammar *g) { return g->n_states; }
int grammar_n_rules(const grammar *g) { return g->n_rules; }

/* Growable int32 array for the DFA tables. */
typedef struct { int32_t *v; size_t n, cap; } ivec;
static int ivec_push(ivec *a, int32_t x) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 1024;
        int32_t *p = realloc(a->v, cap * sizeof *p);
        if (!p) return -1;
        a->v = p;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}

/* Subset construction of every rule into one table. */
static int determinize(gbuild *b, grammar *g) {
    dfa_build d = {.b = b};
    int32_t N = b->n_states, E = b->n_edges;
    int ncls = g->n_cls;
    ivec trans = {0}, coff = {0}, crule = {0}, cto = {0};
    int32_t *buf = NULL, *bucket_n = NULL, **buckets = NULL, *bucket_cap = NULL;
    d.off = calloc((size_t)N + 1, sizeof *d.off);
    d.adj = malloc(((size_t)E + 1) * sizeof *d.adj);
    d.mark = calloc((size_t)N + 1, sizeof *d.mark);
    d.stack = malloc(((size_t)N + 1) * sizeof *d.stack);
    d.edge_cls = calloc((size_t)E + 1, sizeof *d.edge_cls);
    buf = malloc(((size_t)N + 1) * sizeof *buf);
    bucket_n = calloc((size_t)ncls, sizeof *bucket_n);
    bucket_cap = calloc((size_t)ncls, sizeof *bucket_cap);
    buckets = calloc((size_t)ncls, sizeof *buckets);
    if (!d.off || !d.adj || !d.mark || !d.stack || !d.edge_cls || !buf || !bucket_n || !bucket_cap ||
        !buckets || rehash(&d)) {
        gb_fail(b, "out of memory");
        goto done;
    }
    for (int32_t i = 0; i < E; i++) d.off[b->edges[i].from + 1]++;
    for (int32_t i = 0; i < N; i++) d.off[i + 1] += d.off[i];
    {
        int32_t *fill = malloc(((size_t)N + 1) * sizeof *fill);
        if (!fill) {
            gb_fail(b, "out of memory");
            goto done;
        }
        memcpy(fill, d.off, ((size_t)N + 1) * sizeof *fill);
        for (int32_t i = 0; i < E; i++) d.adj[fill[b->edges[i].from]++] = i;
        free(fill);
    }
    for (int32_t i = 0; i < E; i++)
        if (b->edges[i].rule == GE_BYTES)
            for (int c = 0; c < 256; c++)
                if (gbs_has(&b->edges[i].set, c)) gbs_add(&d.edge_cls[i], g->cls[c]);
    g->n_rules = b->n_rules;
    g->rule_start = malloc((size_t)b->n_rules * sizeof *g->rule_start);
    if (!g->rule_start) {
        gb_fail(b, "out of memory");
        goto done;
    }
    for (int32_t r = 0; r < b->n_rules; r++) {
        if (b->rules[r].start < 0) {
            gb_fail(b, "rule %d has no body", r);
            goto done;
        }
        buf[0] = b->rules[r].start;
        int n = closure(&d, buf, 1);
        if ((g->rule_start[r] = intern(&d, buf, n, r)) < 0) goto done;
    }
    for (int32_t id = 0; id < d.n_dfa && !b->failed; id++) {
        int64_t o = d.set_off[id], n = d.set_off[id + 1] - o;
        int32_t rule = d.set_rule[id];
        memset(bucket_n, 0, (size_t)ncls * sizeof *bucket_n);
        if (ivec_push(&coff, (int32_t)crule.n)) goto oom;
        /* calls: one target subset per called rule (rules in first-seen order) */
        for (int64_t i = 0; i < n; i++) {
            int32_t s = d.pool[o + i];
            for (int32_t k = d.off[s]; k < d.off[s + 1]; k++) {
                const gedge *e = &b->edges[d.adj[k]];
                if (e->rule < 0) continue;
                size_t seen = coff.v[id];
                while (seen < crule.n && crule.v[seen] != e->rule) seen++;
                if (seen < crule.n) continue;
                int m = 0;
                for (int64_t i2 = 0; i2 < n; i2++) {
                    int32_t s2 = d.pool[d.set_off[id] + i2];
                    for (int32_t k2 = d.off[s2]; k2 < d.off[s2 + 1]; k2++) {
                        const gedge *e2 = &b->edges[d.adj[k2]];
                        if (e2->rule == e->rule) buf[m++] = e2->to;
                    }
                }
                m = closure(&d, buf, m);
                int32_t t = intern(&d, buf, m, rule);
                if (t < 0 || ivec_push(&crule, e->rule) || ivec_push(&cto, t)) goto oom;
            }
        }
        /* bytes: the targets of each class */
        for (int64_t i = 0; i < n; i++) {
            int32_t s = d.pool[d.set_off[id] + i];
            for (int32_t k = d.off[s]; k < d.off[s + 1]; k++) {
                const gedge *e = &b->edges[d.adj[k]];
                if (e->rule != GE_BYTES) continue;
                for (int c = 0; c < ncls; c++) {
                    if (!gbs_has(&d.edge_cls[d.adj[k]], c)) continue;
                    if (bucket_n[c] == bucket_cap[c]) {
                        int32_t cap = bucket_cap[c] ? bucket_cap[c] * 2 : 8;
                        int32_t *p = realloc(buckets[c], (size_t)cap * sizeof *p);
                        if (!p) goto oom;
                        buckets[c] = p;
                        bucket_cap[c] = cap;
                    }
                    buckets[c][bucket_n[c]++] = e->to;
                }
            }
        }
        for (int c = 0; c < ncls; c++) {
            int32_t t = -1;
            if (bucket_n[c]) {
                memcpy(buf, buckets[c], (size_t)bucket_n[c] * sizeof *buf);
                int m = closure(&d, buf, bucket_n[c]);
                if ((t = intern(&d, buf, m, rule)) < 0) goto done;
            }
            if (ivec_push(&trans, t)) goto oom;
        }
    }
    if (b->failed) goto done;
    if (ivec_push(&coff, (int32_t)crule.n)) goto oom;
    g->n_states = d.n_dfa;
    g->trans = trans.v;
    g->call_off = coff.v;
    g->call_rule = crule.v;
    g->call_to = cto.v;
    trans.v = coff.v = crule.v = cto.v = NULL;
    g->flags = calloc((size_t)d.n_dfa, 1);
    if (!g->flags) goto oom;
    for (int32_t s = 0; s < d.n_dfa; s++) {
        int64_t o = d.set_off[s], n = d.set_off[s + 1] - o;
        int32_t acc = b->rules[d.set_rule[s]].accept;
        for (int64_t i = 0; i < n; i++)
            if (d.pool[o + i] == acc) g->flags[s] |= GS_FINAL;
    }
    goto done;
oom:
    gb_fail(b, "out of memory");
done:
    for (int c = 0; buckets && c < ncls; c++) free(buckets[c]);
    free(buckets);
    free(bucket_n);
    free(bucket_cap);
    free(buf);
    free(trans.v);
    free(coff.v);
    free(crule.v);
    free(cto.v);
    dfa_build_free(&d);
    return b->failed ? -1 : 0;
}

/* Whether every text character (grammar_text_step) read from s comes back to s, through
 * defined transitions only: walks the pairs (recognizer state, DFA state) from (0, s). */
static int text_loop(const grammar *g, int32_t s) {
    struct { int u; int32_t d; } seen[64];
    int n = 1, next = 0;
    seen[0].u = 0;
    seen[0].d = s;
    while (next < n) {
        int u = seen[next].u;
        int32_t d = seen[next++].d;
        for (int b = 0; b < 256; b++) {
            int u2 = grammar_text_step(u, b);
            if (u2 < 0) continue;
            int32_t t = g->trans[(size_t)d * g->n_cls + g->cls[b]];
            if (t < 0 || (u2 == 0 && t != s)) return 0;
            if (u2 == 0) continue;
            int k = 0;
            while (k < n && !(seen[k].u == u2 && seen[k].d == t)) k++;
            if (k == n) {
                if (n == 64) return 0;
                seen[n].u = u2;
                seen[n++].d = t;
            }
        }
    }
    return 1;
}

/* Flags after the table: FINALX (fixpoint through calls of rules that may match nothing),
 * HASOUT, SIMPLE; then refuse left recursion (a rule that can call itself before reading
 * a byte would make the matcher loop). */
static int finish_flags(gbuild *b, grammar *g) {
    int32_t S = g->n_states;
    for (int32_t s = 0; s < S; s++)
        if (g->flags[s] & GS_FINAL) g->flags[s] |= GS_FINALX;
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t s = 0; s < S; s++) {
            if (g->flags[s] & GS_FINALX) continue;
            for (int32_t k = g->call_off[s]; k < g->call_off[s + 1]; k++)
                if ((g->flags[g->rule_start[g->call_rule[k]]] & GS_FINALX) && (g->flags[g->call_to[k]] & GS_FINALX)) {
                    g->flags[s] |= GS_FINALX;
                    changed = 1;
                    break;
                }
        }
    }
    for (int32_t s = 0; s < S; s++) {
        int out = g->call_off[s + 1] > g->call_off[s];
        for (int c = 0; c < g->n_cls && !out; c++) out = g->trans[(size_t)s * g->n_cls + c] >= 0;
        if (out) g->flags[s] |= GS_HASOUT;
        if (g->call_off[s + 1] == g->call_off[s] && !(g->flags[s] & GS_FINAL)) g->flags[s] |= GS_SIMPLE;
        int loop = 1;
        for (int c = 0x20; c < 0x7F && loop; c++)
            if (grammar_plain_byte(c)) loop = g->trans[(size_t)s * g->n_cls + g->cls[c]] == s;
        if (loop) g->flags[s] |= GS_PLAINLOOP;
        if (loop && text_loop(g, s)) g->flags[s] |= GS_TEXTLOOP;
    }
    /* shortest way to each rule's end (relaxation; states are numbered roughly in
     * breadth-first order, so a sweep from the back settles most of them at once) */
    g->dist = malloc((size_t)S * sizeof *g->dist);
    if (!g->dist) return gb_fail(b, "out of memory");
    for (int32_t s = 0; s < S; s++) g->dist[s] = (g->flags[s] & GS_FINAL) ? 0 : GRAMMAR_DIST_INF;
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t s = S - 1; s >= 0; s--) {
            int32_t best = g->dist[s];
            const int32_t *row = g->trans + (size_t)s * g->n_cls;
            for (int c = 0; c < g->n_cls; c++)
                if (row[c] >= 0) best = best < gdist_add(1, g->dist[row[c]]) ? best : gdist_add(1, g->dist[row[c]]);
            for (int32_t k = g->call_off[s]; k < g->call_off[s + 1]; k++) {
                int32_t d = gdist_add(g->dist[g->rule_start[g->call_rule[k]]], g->dist[g->call_to[k]]);
                best = best < d ? best : d;
            }
            if (best < g->dist[s]) g->dist[s] = best, changed = 1;
        }
    }
    if (g->dist[g->rule_start[0]] >= GRAMMAR_DIST_INF) return gb_fail(b, "the grammar matches nothing");
    /* left recursion: from each rule's start, moves that read nothing */
    int32_t *seen = calloc((size_t)S, sizeof *seen), *stack = malloc((size_t)S * sizeof *stack);
    if (!seen || !stack) {
        free(seen);
        free(stack);
        return gb_fail(b, "out of memory");
    }
    for (int32_t r = 0; r < g->n_rules && !b->failed; r++) {
        int sp = 0;
        stack[sp++] = g->rule_start[r];
        seen[g->rule_start[r]] = r + 1;
        while (sp && !b->failed) {
            int32_t s = stack[--sp];
            for (int32_t k = g->call_off[s]; k < g->call_off[s + 1]; k++) {
                int32_t callee = g->call_rule[k], t = g->rule_start[callee];
                if (callee == r) {
                    gb_fail(b, "grammar is left-recursive (a rule can reach itself before reading anything)");
                    break;
                }
                if (seen[t] != r + 1) seen[t] = r + 1, stack[sp++] = t;
                t = g->call_to[k];
                if ((g->flags[g->rule_start[callee]] & GS_FINALX) && seen[t] != r + 1) seen[t] = r + 1, stack[sp++] = t;
            }
        }
    }
    free(seen);
    free(stack);
    return b->failed ? -1 : 0;
}

const char *grammar_kind_name(grammar_kind k) {
    switch (k) {
    case GRAMMAR_JSON: return "json_object";
    case GRAMMAR_JSON_SCHEMA: return "json_schema";
    case GRAMMAR_REGEX: return "regex";
    case GRAMMAR_CHOICE: return "choice";
    case GRAMMAR_GBNF: return "grammar";
    default: return "none";
    }
}

/* ---- compile cache ---------------------------------------------------------------------
 * Clients send the same schema with every call (an agent's tools, a parse() model), so
 * the last GC_SLOTS compiled grammars are kept by (kind, spec text) and shared: a grammar
 * is immutable and reference counted. Process-wide, under one lock held only to look up
 * and insert (compiling runs outside it). Specs over GC_MAX_SPEC bytes are not kept. */
#define GC_SLOTS 32
#define GC_MAX_SPEC 65536

static struct {
    grammar_kind kind;
    char *spec;
    size_t len;
    grammar *g;
    uint64_t used;
} gc_slot[GC_SLOTS];
static uint64_t gc_tick;
static pthread_mutex_t gc_lock = PTHREAD_MUTEX_INITIALIZER;

static grammar *gc_find(grammar_kind kind, const char *spec, size_t len) {
    grammar *g = NULL;
    pthread_mutex_lock(&gc_lock);
    for (int i = 0; i < GC_SLOTS && !g; i++)
        if (gc_slot[i].g && gc_slot[i].kind == kind && gc_slot[i].len == len &&
            (!len || !memcmp(gc_slot[i].spec, spec, len))) {
            gc_slot[i].used = ++gc_tick;
            g = grammar_ref(gc_slot[i].g);
        }
    pthread_mutex_unlock(&gc_lock);
    return g;
}

static void gc_insert(grammar_kind kind, const char *spec, size_t len, grammar *g) {
    char *copy = malloc(len + 1);
    if (!copy) return;
    if (len) memcpy(copy, spec, len);
    pthread_mutex_lock(&gc_lock);
    int slot = 0;
    for (int i = 1; i < GC_SLOTS; i++)
        if (gc_slot[i].used < gc_slot[slot].used) slot = i;
    grammar *old = gc_slot[slot].g;
    char *old_spec = gc_slot[slot].spec;
    gc_slot[slot].kind = kind;
    gc_slot[slot].spec = copy;
    gc_slot[slot].len = len;
    gc_slot[slot].g = grammar_ref(g);
    gc_slot[slot].used = ++gc_tick;
    pthread_mutex_unlock(&gc_lock);
    grammar_unref(old);
    free(old_spec);
}

static grammar *compile_uncached(grammar_kind kind, const char *spec, size_t len, char *err, size_t errlen);

grammar *grammar_compile(grammar_kind kind, const char *spec, size_t len, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!spec) len = 0;
    if (len <= GC_MAX_SPEC) {
        grammar *g = gc_find(kind, spec, len);
        if (g) return g;
    }
    grammar *g = compile_uncached(kind, spec, len, err, errlen);
    if (g && len <= GC_MAX_SPEC) gc_insert(kind, spec, len, g);
    return g;
}

static grammar *compile_uncached(grammar_kind kind, const char *spec, size_t len, char *err, size_t errlen) {
    gbuild b = {.err = err, .errlen = errlen};
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    atomic_init(&g->refs, 1);
    pthread_mutex_init(&g->shared.mu, NULL);
    pthread_cond_init(&g->shared.done, NULL);
    g->kind = kind;
    gb_rule(&b);   /* rule 0: the root */
    int rc;
    if (kind != GRAMMAR_JSON && !spec) {
        rc = gb_fail(&b, "%s: no grammar given", grammar_kind_name(kind));
    } else {
        switch (kind) {
        case GRAMMAR_JSON: rc = grammar_build_json(&b); break;
        case GRAMMAR_JSON_SCHEMA: rc = grammar_build_schema(&b, spec, len); break;
        case GRAMMAR_REGEX: rc = grammar_build_regex(&b, spec, len); break;
        case GRAMMAR_CHOICE: rc = build_choice(&b, spec, len); break;
        case GRAMMAR_GBNF: rc = grammar_build_gbnf(&b, spec, len); break;
        default: rc = gb_fail(&b, "unknown grammar kind %d", (int)kind); break;
        }
    }
    if (!rc && !b.failed) {
        g->n_cls = byte_classes(&b, g->cls);
        if (!determinize(&b, g)) finish_flags(&b, g);
        g->root = b.failed ? 0 : g->rule_start[0];
    }
    free(b.edges);
    free(b.rules);
    if (rc || b.failed) {
        if (err && errlen && !err[0]) snprintf(err, errlen, "grammar does not compile");
        grammar_unref(g);
        return NULL;
    }
    return g;
}
