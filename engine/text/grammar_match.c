/* The vocabulary trie and the matcher (see grammar.h).
 *
 * Trie: every allowed token's bytes, sorted, laid out in depth-first preorder as a flat
 * array. Node i has its byte, its depth and skip = the index just past its subtree, so a
 * mask is one forward scan: a node whose byte the matcher rejects jumps to skip, and the
 * whole subtree (every token with that prefix) is dropped at once.
 *
 * Matcher state: up to MT_MAX_STACKS stacks (the pushdown automaton is nondeterministic
 * where a grammar is ambiguous at the byte level). A stack is its top DFA state plus a
 * parent frame in an arena of persistent frames {return state, parent}: pushing allocates
 * one frame, popping just follows parent, so a state is copied by copying a few ints and
 * thrown away by resetting the arena top. The scan keeps one state per trie depth and
 * resets the arena to that depth's mark before stepping. After a committed token the
 * live stacks are copied to the bottom of the arena (compaction), so the arena does not
 * grow with the output. Stacks over MT_MAX_STACKS are dropped (the language narrows, the
 * mask and the accepts stay consistent); frames deeper than MT_MAX_FRAMES are refused
 * (JSON nested deeper than that cannot be produced). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/grammar_internal.h"

#define MT_MAX_STACKS 32
#define MT_MAX_FRAMES 128
#define MT_STEP_BUDGET 512
#define MT_CACHE 4           /* masks remembered per matcher */
#define MT_KEY_MAX 96        /* longest state key (ints) worth caching */

typedef struct {
    uint32_t skip;       /* index past this node's subtree */
    int32_t tok;         /* first token whose bytes end here, -1 */
    uint16_t depth;      /* 1 for a first byte */
    uint8_t byte;
    uint8_t flags;       /* VT_DUP, VT_PLAIN */
    int32_t tlo, thi;    /* the subtree's tokens: sorted[tlo..thi) */
} vt_node;

enum {
    VT_DUP = 1,          /* more tokens with these bytes: follow tok_next (rare) */
    VT_PLAIN = 2,        /* every byte in the subtree is plain (grammar_plain_byte) */
    VT_TEXT = 4,         /* every token in the subtree is text (grammar_text_step) */
};

struct vocab_trie {
    int n_vocab;
    vt_node *nodes;
    int32_t n_nodes;
    int32_t *tok_next;   /* (n_vocab) next token with the same bytes, -1 */
    int32_t *sorted;     /* the trie's tokens in byte order (a subtree's are contiguous) */
    uint32_t *tok_off, *tok_len;   /* (n_vocab) into blob; len 0: never allowed */
    char *blob;
    uint8_t *is_eos;     /* (n_vocab) */
    int32_t eos[16];
    int n_eos;
    int max_depth;
    uint64_t id;         /* unique per trie built (never reused, unlike an address) */
};

static atomic_ullong trie_ids;

/* ---- trie ----------------------------------------------------------------------------- */

static const char *g_sort_blob;   /* qsort has no context argument in C11 */
static const uint32_t *g_sort_off, *g_sort_len;

static int cmp_tok(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = g_sort_len[x], ly = g_sort_len[y];
    int c = memcmp(g_sort_blob + g_sort_off[x], g_sort_blob + g_sort_off[y], lx < ly ? lx : ly);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

void vocab_trie_free(vocab_trie *v) {
    if (!v) return;
    free(v->nodes);
    free(v->tok_next);
    free(v->sorted);
    free(v->tok_off);
    free(v->tok_len);
    free(v->blob);
    free(v->is_eos);
    free(v);
}

int vocab_trie_n_vocab(const vocab_trie *v) { return v->n_vocab; }
int vocab_trie_n_nodes(const vocab_trie *v) { return v->n_nodes; }
int vocab_trie_max_bytes(const vocab_trie *v) { return v->max_depth; }

vocab_trie *vocab_trie_build(const tok_tokenizer *t, int n_vocab, const int32_t *eos, int n_eos,
                             char *err, size_t errlen) {
    vocab_trie *v = calloc(1, sizeof *v);
    if (v) v->id = atomic_fetch_add(&trie_ids, 1) + 1;
    int32_t *order = NULL, *path = NULL;
    if (!v || n_vocab <= 0) goto nomem;
    v->n_vocab = n_vocab;
    int tv = tok_vocab_size(t);
    size_t total = 0;
    v->tok_next = malloc((size_t)n_vocab * sizeof *v->tok_next);
    v->tok_off = calloc((size_t)n_vocab, sizeof *v->tok_off);
    v->tok_len = calloc((size_t)n_vocab, sizeof *v->tok_len);
    v->is_eos = calloc((size_t)n_vocab, 1);
    order = malloc((size_t)n_vocab * sizeof *order);
    if (!v->tok_next || !v->tok_off || !v->tok_len || !v->is_eos || !order) goto nomem;
    for (int i = 0; i < n_eos && v->n_eos < 16; i++)
        if (eos[i] >= 0 && eos[i] < n_vocab) v->is_eos[eos[i]] = 1, v->eos[v->n_eos++] = eos[i];
    for (int id = 0; id < n_vocab && id < tv; id++) {
        const char *p;
        size_t n;
        if (!tok_is_special(t, id) && !v->is_eos[id] && !tok_token_bytes(t, id, &p, &n) && n > 0 && n < 65535)
            total += n;
    }
    v->blob = malloc(total + 1);
    if (!v->blob) goto nomem;
    int n_tok = 0;
    size_t off = 0;
    for (int id = 0; id < n_vocab; id++) {
        v->tok_next[id] = -1;
        const char *p;
        size_t n;
        if (id >= tv || tok_is_special(t, id) || v->is_eos[id] || tok_token_bytes(t, id, &p, &n) || n == 0 || n >= 65535)
            continue;
        memcpy(v->blob + off, p, n);
        v->tok_off[id] = (uint32_t)off;
        v->tok_len[id] = (uint32_t)n;
        off += n;
        order[n_tok++] = id;
        if ((int)n > v->max_depth) v->max_depth = (int)n;
    }
    g_sort_blob = v->blob, g_sort_off = v->tok_off, g_sort_len = v->tok_len;
    qsort(order, (size_t)n_tok, sizeof *order, cmp_tok);
    /* at most one node per byte of every token: total bounds the node count */
    v->nodes = malloc((total + 1) * sizeof *v->nodes);
    path = malloc(((size_t)v->max_depth + 1) * sizeof *path);
    if (!v->nodes || !path) goto nomem;
    int depth = 0;   /* nodes on the current path */
    int8_t *text_u = malloc(((size_t)v->max_depth + 2) * sizeof *text_u);   /* recognizer state by depth */
    uint8_t *text_ok = malloc((total + 1) * sizeof *text_ok);               /* per node: path is text */
    if (!text_u || !text_ok) {
        free(text_u);
        free(text_ok);
        goto nomem;
    }
    text_u[0] = 0;
    int32_t prev = -1;
    for (int k = 0; k < n_tok; k++) {
        int32_t id = order[k];
        const unsigned char *s = (const unsigned char *)v->blob + v->tok_off[id];
        uint32_t n = v->tok_len[id];
        uint32_t lcp = 0;
        if (prev >= 0) {
            const unsigned char *ps = (const unsigned char *)v->blob + v->tok_off[prev];
            uint32_t pn = v->tok_len[prev];
            while (lcp < pn && lcp < n && ps[lcp] == s[lcp]) lcp++;
        }
        while (depth > (int)lcp) {
            vt_node *nd = &v->nodes[path[--depth]];
            nd->skip = (uint32_t)v->n_nodes;
            nd->thi = k;
        }
        for (uint32_t j = lcp; j < n; j++) {
            vt_node *nd = &v->nodes[v->n_nodes];
            nd->byte = s[j];
            nd->depth = (uint16_t)(j + 1);
            nd->tok = -1;
            nd->flags = 0;
            nd->tlo = k;
            text_u[j + 1] = (int8_t)(text_u[j] < 0 ? -1 : grammar_text_step(text_u[j], s[j]));
            text_ok[v->n_nodes] = text_u[j + 1] >= 0;
            path[depth++] = v->n_nodes++;
        }
        /* the token ends at the path's last node; equal byte strings chain */
        vt_node *end = &v->nodes[path[n - 1]];
        if (end->tok < 0) {
            end->tok = id;
        } else {
            end->flags |= VT_DUP;
            int32_t x = end->tok;
            while (v->tok_next[x] >= 0) x = v->tok_next[x];
            v->tok_next[x] = id;
        }
        prev = id;
    }
    while (depth > 0) {
        vt_node *nd = &v->nodes[path[--depth]];
        nd->skip = (uint32_t)v->n_nodes;
        nd->thi = n_tok;
    }
    /* VT_PLAIN: no non-plain byte in [i, skip) (the next one, scanning from the back) */
    uint32_t next_bad = (uint32_t)v->n_nodes, next_nontext = (uint32_t)v->n_nodes;
    for (int32_t i = v->n_nodes - 1; i >= 0; i--) {
        if (!grammar_plain_byte(v->nodes[i].byte)) next_bad = (uint32_t)i;
        if (!text_ok[i]) next_nontext = (uint32_t)i;
        if (next_bad >= v->nodes[i].skip) v->nodes[i].flags |= VT_PLAIN;
        if (next_nontext >= v->nodes[i].skip) v->nodes[i].flags |= VT_TEXT;
    }
    free(text_u);
    free(text_ok);
    v->sorted = order;
    free(path);
    return v;
nomem:
    free(order);
    free(path);
    vocab_trie_free(v);
    specd_errf(err, errlen, SPECD_ENOMEM, "vocabulary trie: out of memory");
    return NULL;
}

/* ---- matcher -------------------------------------------------------------------------- */

typedef struct { int32_t state, parent, depth, below; } mt_frame;   /* below: dist of the frames' states */
typedef struct { int32_t top, parent; } mt_stack;

struct matcher {
    grammar *g;
    const vocab_trie *v;
    mt_frame *fr;               /* arena; [0, n_live) are the committed stacks' frames */
    int32_t n_fr, cap_fr;
    mt_frame *fr2;              /* compaction target, MT_MAX_STACKS * MT_MAX_FRAMES */
    mt_stack cur[MT_MAX_STACKS];
    int n_cur;
    int finished;               /* eos accepted */
    mt_stack *lvl;              /* (max_depth + 1, MT_MAX_STACKS) scan states by depth */
    int *lvl_n;
    int32_t *lvl_mark;
    /* Recent masks by state: inside a long string every token comes back to the same
     * state (same top, same frames below), and the mask is a copy. */
    struct {
        int32_t key[MT_KEY_MAX];
        int klen, count;
        uint64_t used;          /* LRU tick; 0 = empty */
        uint32_t *mask;
    } cache[MT_CACHE];
    uint64_t tick;
    int no_cache;               /* matcher_set_cache(m, 0): every mask a full scan */
    /* cache keys name states by their mask class (grammar_mask_classes for the trie's
     * longest token): the 1000 states of [a-z ]{1000} far from its end are one class */
    const grammar_mask_classes *mc;
    grammar_mask_classes *mc_own;   /* when the grammar's are for another length */
};

static int32_t push(matcher *m, int32_t state, int32_t parent) {
    int32_t depth = parent < 0 ? 1 : m->fr[parent].depth + 1;
    if (depth > MT_MAX_FRAMES) return -1;
    if (m->n_fr == m->cap_fr) {
        int32_t cap = m->cap_fr * 2;
        mt_frame *n = realloc(m->fr, (size_t)cap * sizeof *n);
        if (!n) return -1;
        m->fr = n;
        m->cap_fr = cap;
    }
    int32_t below = gdist_add(m->g->dist[state], parent < 0 ? 0 : m->fr[parent].below);
    m->fr[m->n_fr] = (mt_frame){state, parent, depth, below};
    return m->n_fr++;
}

static void add_stack(mt_stack *out, int *n, int32_t top, int32_t parent) {
    for (int i = 0; i < *n; i++)
        if (out[i].top == top && out[i].parent == parent) return;
    if (*n < MT_MAX_STACKS) out[(*n)++] = (mt_stack){top, parent};
}

/* Every way stack (s, p) reads one byte of class c: the state's own edge, entering a
 * called rule, or returning to the caller when the rule may end here. */
static void step(matcher *m, int32_t s, int32_t p, int c, mt_stack *out, int *n, int budget) {
    const grammar *g = m->g;
    int32_t t = g->trans[(size_t)s * g->n_cls + c];
    if (t >= 0) add_stack(out, n, t, p);
    if ((g->flags[s] & GS_SIMPLE) || budget <= 0) return;
    for (int32_t k = g->call_off[s]; k < g->call_off[s + 1]; k++) {
        int32_t q = push(m, g->call_to[k], p);
        if (q >= 0) step(m, g->rule_start[g->call_rule[k]], q, c, out, n, budget - 1);
    }
    if ((g->flags[s] & GS_FINAL) && p >= 0) {
        mt_frame f = m->fr[p];
        step(m, f.state, f.parent, c, out, n, budget - 1);
    }
}

static int step_all(matcher *m, const mt_stack *in, int nin, int byte, mt_stack *out) {
    const grammar *g = m->g;
    int c = g->cls[byte], n = 0;
    if (nin == 1 && (g->flags[in[0].top] & GS_SIMPLE)) {
        int32_t t = g->trans[(size_t)in[0].top * g->n_cls + c];
        if (t < 0) return 0;
        out[0] = (mt_stack){t, in[0].parent};
        return 1;
    }
    for (int i = 0; i < nin; i++) step(m, in[i].top, in[i].parent, c, out, &n, MT_STEP_BUDGET);
    return n;
}

static int stack_accepting(const matcher *m, int32_t s, int32_t p) {
    for (;;) {
        if (!(m->g->flags[s] & GS_FINALX)) return 0;
        if (p < 0) return 1;
        s = m->fr[p].state;
        p = m->fr[p].parent;
    }
}

static int stack_continues(const matcher *m, int32_t s, int32_t p) {
    for (;;) {
        uint8_t f = m->g->flags[s];
        if (f & GS_HASOUT) return 1;
        if (!(f & GS_FINALX) || p < 0) return 0;
        s = m->fr[p].state;
        p = m->fr[p].parent;
    }
}

/* Bytes on the shortest way from stacks s[0..n) to the end of the grammar. */
static int32_t stacks_dist(const matcher *m, const mt_stack *s, int n) {
    int32_t best = GRAMMAR_DIST_INF;
    for (int i = 0; i < n; i++) {
        int32_t d = gdist_add(m->g->dist[s[i].top], s[i].parent < 0 ? 0 : m->fr[s[i].parent].below);
        best = d < best ? d : best;
    }
    return best;
}

int matcher_distance(const matcher *m) {
    return m->finished ? 0 : stacks_dist(m, m->cur, m->n_cur);
}

int matcher_accepting(const matcher *m) {
    if (m->finished) return 0;
    for (int i = 0; i < m->n_cur; i++)
        if (stack_accepting(m, m->cur[i].top, m->cur[i].parent)) return 1;
    return 0;
}

int matcher_done(const matcher *m) {
    if (m->finished) return 1;
    if (!matcher_accepting(m)) return 0;
    for (int i = 0; i < m->n_cur; i++)
        if (stack_continues(m, m->cur[i].top, m->cur[i].parent)) return 0;
    return 1;
}

void matcher_free(matcher *m) {
    if (!m) return;
    grammar_unref(m->g);
    free(m->fr);
    free(m->fr2);
    free(m->lvl);
    free(m->lvl_n);
    free(m->lvl_mark);
    for (int i = 0; i < MT_CACHE; i++) free(m->cache[i].mask);
    free(m->mc_own);
    free(m);
}

/* ---- mask classes ---------------------------------------------------------------------- */

#define MC_BUDGET 200000000.0   /* state x class x round steps at most, else no classes */

/* One round of Moore's refinement: state s's signature is its class and its successors'
 * classes per byte class (a state with calls keeps its own class: cur is unique there);
 * new ids are dense in order of first appearance. Returns the number of classes. */
static int32_t mc_round(const grammar *g, const int32_t *cur, int32_t *nxt, int32_t *table, uint32_t mask) {
    const int C = g->n_cls;
    int32_t n_new = 0;
    int32_t *rep_of = nxt;   /* nxt doubles as the output; table holds representatives */
    memset(table, -1, ((size_t)mask + 1) * sizeof *table);
    for (int32_t s = 0; s < g->n_states; s++) {
        const int32_t *ts = g->trans + (size_t)s * C;
        uint64_t h = 1469598103934665603ull ^ (uint64_t)(uint32_t)cur[s];
        for (int c = 0; c < C; c++) h = (h ^ (uint64_t)(uint32_t)(ts[c] < 0 ? -1 : cur[ts[c]])) * 1099511628211ull;
        uint32_t i = (uint32_t)(h ^ (h >> 29)) & mask;
        for (;; i = (i + 1) & mask) {
            int32_t r = table[i];
            if (r < 0) {
                table[i] = s;
                rep_of[s] = n_new++;
                break;
            }
            const int32_t *tr = g->trans + (size_t)r * C;
            int same = cur[r] == cur[s];
            for (int c = 0; same && c < C; c++)
                same = (ts[c] < 0 ? -1 : cur[ts[c]]) == (tr[c] < 0 ? -1 : cur[tr[c]]);
            if (same) {
                rep_of[s] = rep_of[r];
                break;
            }
        }
    }
    return n_new;
}

grammar_mask_classes *grammar_mask_classes_make(const grammar *g, int L) {
    const int32_t n = g->n_states;
    grammar_mask_classes *mc = malloc(sizeof *mc + (size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (!mc) return NULL;
    mc->L = L;
    uint32_t mask = 1;
    while (mask < 2u * (uint32_t)n) mask <<= 1;
    int32_t *cur = mc->cls, *nxt = malloc((size_t)(n > 0 ? n : 1) * sizeof *nxt),
            *table = malloc((size_t)mask * sizeof *table);
    if (!nxt || !table) {
        free(nxt);
        free(table);
        free(mc);
        return NULL;
    }
    /* round 0: where a rule may end, and states with calls apart */
    int32_t n_cls = 0;
    for (int32_t s = 0; s < n; s++) {
        int calls = g->call_off[s + 1] > g->call_off[s];
        cur[s] = calls ? 4 + s : g->flags[s] & (GS_FINAL | GS_FINALX);
    }
    if ((double)n * (g->n_cls + 1) * L <= MC_BUDGET) {
        n_cls = mc_round(g, cur, nxt, table, mask - 1);   /* densify, with the first round */
        memcpy(cur, nxt, (size_t)n * sizeof *cur);
        for (int k = 1; k < L; k++) {
            int32_t m2 = mc_round(g, cur, nxt, table, mask - 1);
            memcpy(cur, nxt, (size_t)n * sizeof *cur);
            if (m2 == n_cls) break;   /* stable: no later round splits a class */
            n_cls = m2;
        }
    } else {
        for (int32_t s = 0; s < n; s++) cur[s] = s;   /* too large to refine: states themselves */
    }
    free(nxt);
    free(table);
    return mc;
}

/* The grammar's classes for tokens of up to L bytes, made once and shared by its matchers
 * (any thread). Classes made for a larger L serve (they only merge less); for another L
 * the caller gets its own in *own (NULL when none could be made). */
static const grammar_mask_classes *mc_get(grammar *g, int L, grammar_mask_classes **own) {
    grammar_mask_classes *have = atomic_load(&g->mclasses);
    if (have && have->L >= L) return have;
    grammar_mask_classes *mc = grammar_mask_classes_make(g, L);
    if (!mc) return NULL;
    if (!have && atomic_compare_exchange_strong(&g->mclasses, &have, mc)) return mc;
    if (have && have->L >= L) {   /* another thread made them first */
        free(mc);
        return have;
    }
    *own = mc;
    return mc;
}

int grammar_prepare_masks(grammar *g, int max_token_bytes) {
    grammar_mask_classes *own = NULL;
    const grammar_mask_classes *mc = mc_get(g, max_token_bytes, &own);
    free(own);   /* the grammar holds others: a matcher makes its own */
    return mc ? 0 : SPECD_ENOMEM;
}

matcher *matcher_new(grammar *g, const vocab_trie *v) {
    matcher *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->g = grammar_ref(g);
    m->v = v;
    m->cap_fr = 1024;
    int levels = (v ? v->max_depth : 0) + 1;
    m->fr = malloc((size_t)m->cap_fr * sizeof *m->fr);
    m->fr2 = malloc((size_t)MT_MAX_STACKS * MT_MAX_FRAMES * sizeof *m->fr2);
    m->lvl = malloc((size_t)levels * MT_MAX_STACKS * sizeof *m->lvl);
    m->lvl_n = malloc((size_t)levels * sizeof *m->lvl_n);
    m->lvl_mark = malloc((size_t)levels * sizeof *m->lvl_mark);
    if (!m->fr || !m->fr2 || !m->lvl || !m->lvl_n || !m->lvl_mark) {
        matcher_free(m);
        return NULL;
    }
    m->cur[0] = (mt_stack){g->root, -1};
    m->n_cur = 1;
    m->mc = v ? mc_get(g, v->max_depth, &m->mc_own) : NULL;   /* without them keys are states */
    return m;
}

/* After compaction the committed state is cur[0, n_cur), the frames [0, n_fr) they
 * point into, and finished: a saved state is a copy of those. */
struct matcher_saved {
    mt_stack cur[MT_MAX_STACKS];
    int n_cur, finished;
    int32_t n_fr;
    mt_frame fr[MT_MAX_STACKS * MT_MAX_FRAMES];
};

matcher_saved *matcher_saved_new(void) { return malloc(sizeof(matcher_saved)); }
void matcher_saved_free(matcher_saved *s) { free(s); }

void matcher_save(const matcher *m, matcher_saved *s) {
    memcpy(s->cur, m->cur, (size_t)m->n_cur * sizeof *m->cur);
    s->n_cur = m->n_cur;
    s->finished = m->finished;
    s->n_fr = m->n_fr;
    memcpy(s->fr, m->fr, (size_t)m->n_fr * sizeof *m->fr);
}

void matcher_restore(matcher *m, const matcher_saved *s) {
    memcpy(m->cur, s->cur, (size_t)s->n_cur * sizeof *m->cur);
    m->n_cur = s->n_cur;
    m->finished = s->finished;
    m->n_fr = s->n_fr;
    memcpy(m->fr, s->fr, (size_t)s->n_fr * sizeof *m->fr);
}

/* Copy the committed stacks' frames to the bottom of the arena. */
static void compact(matcher *m) {
    int32_t n2 = 0, chain[MT_MAX_FRAMES];
    for (int i = 0; i < m->n_cur; i++) {
        int k = 0;
        for (int32_t p = m->cur[i].parent; p >= 0 && k < MT_MAX_FRAMES; p = m->fr[p].parent) chain[k++] = p;
        int32_t parent = -1;
        while (k > 0) {
            mt_frame f = m->fr[chain[--k]];
            m->fr2[n2] = (mt_frame){f.state, parent, parent < 0 ? 1 : m->fr2[parent].depth + 1,
                                    gdist_add(m->g->dist[f.state], parent < 0 ? 0 : m->fr2[parent].below)};
            parent = n2++;
        }
        m->cur[i].parent = parent;
    }
    memcpy(m->fr, m->fr2, (size_t)n2 * sizeof *m->fr);
    m->n_fr = n2;
}

/* Steps the committed state through s; on success the result is in out (frames above
 * the committed ones), else 0. The caller resets n_fr when it does not commit. */
static int run_bytes(matcher *m, const char *s, size_t n, mt_stack *out) {
    mt_stack a[MT_MAX_STACKS], b[MT_MAX_STACKS];
    int na = m->n_cur;
    memcpy(a, m->cur, (size_t)na * sizeof *a);
    for (size_t i = 0; i < n; i++) {
        na = step_all(m, a, na, (unsigned char)s[i], b);
        if (!na) return 0;
        memcpy(a, b, (size_t)na * sizeof *a);
    }
    memcpy(out, a, (size_t)na * sizeof *a);
    return na;
}

int matcher_check_bytes(matcher *m, const char *s, size_t n) {
    if (m->finished) return 0;
    int32_t mark = m->n_fr;
    mt_stack out[MT_MAX_STACKS];
    int ok = run_bytes(m, s, n, out) > 0;
    m->n_fr = mark;
    return ok;
}

int matcher_distance_after(matcher *m, const char *s, size_t n) {
    if (m->finished) return -1;
    int32_t mark = m->n_fr;
    mt_stack out[MT_MAX_STACKS];
    int k = run_bytes(m, s, n, out);
    int d = k ? stacks_dist(m, out, k) : -1;
    m->n_fr = mark;
    return d;
}

int matcher_accept_bytes(matcher *m, const char *s, size_t n) {
    if (m->finished) return SPECD_EINVAL;
    int32_t mark = m->n_fr;
    mt_stack out[MT_MAX_STACKS];
    int k = run_bytes(m, s, n, out);
    if (!k) {
        m->n_fr = mark;
        return SPECD_EINVAL;
    }
    memcpy(m->cur, out, (size_t)k * sizeof *out);
    m->n_cur = k;
    compact(m);
    return 0;
}

int matcher_accept_token(matcher *m, int32_t id) {
    const vocab_trie *v = m->v;
    if (m->finished || id < 0 || id >= v->n_vocab) return SPECD_EINVAL;
    if (v->is_eos[id]) {
        if (!matcher_accepting(m)) return SPECD_EINVAL;
        m->finished = 1;
        return 0;
    }
    if (!v->tok_len[id]) return SPECD_EINVAL;
    return matcher_accept_bytes(m, v->blob + v->tok_off[id], v->tok_len[id]);
}

/* The committed state as ints (each stack: top, frame states from the top down, -1, each
 * state as its mask class); 0 if too long to cache. */
static int state_key(const matcher *m, int32_t *key) {
    const int32_t *cls = m->mc ? m->mc->cls : NULL;
    int n = 0;
    for (int i = 0; i < m->n_cur; i++) {
        if (n + 2 > MT_KEY_MAX) return 0;
        key[n++] = cls ? cls[m->cur[i].top] : m->cur[i].top;
        for (int32_t p = m->cur[i].parent; p >= 0; p = m->fr[p].parent) {
            if (n + 2 > MT_KEY_MAX) return 0;
            key[n++] = cls ? cls[m->fr[p].state] : m->fr[p].state;
        }
        key[n++] = -1;
    }
    return n;
}

static int walk_mask(matcher *m, uint32_t *mask, int32_t limit);

int matcher_fill_mask_within(matcher *m, uint32_t *mask, int max_dist) {
    if (m->finished || max_dist >= GRAMMAR_DIST_INF) return matcher_fill_mask(m, mask);
    return walk_mask(m, mask, max_dist < 0 ? 0 : max_dist);
}

void matcher_set_cache(matcher *m, int enabled) { m->no_cache = !enabled; }

/* The grammar's shared masks (grammar_mask_cache): usable when this matcher's keys are the
 * grammar's classes and its trie is the cache's (the first to use it claims it). */
void grammar_mask_cache_clear(grammar_mask_cache *c) {
    for (int i = 0; i < c->n; i++) {
        free(c->e[i].key);
        free(c->e[i].mask);
        c->e[i].key = NULL;
        c->e[i].mask = NULL;
    }
    c->n = 0;
}

static grammar_mask_cache *shared_of(matcher *m) {
    grammar_mask_cache *c = &m->g->shared;
    if (!m->mc || m->mc_own || m->mc != atomic_load(&m->g->mclasses)) return NULL;
    pthread_mutex_lock(&c->mu);
    if (c->trie_id != m->v->id) {   /* another vocabulary's masks: this one takes over */
        grammar_mask_cache_clear(c);
        c->trie_id = m->v->id;
        c->gen++;   /* a pending entry's owner drops its mask; its waiters walk */
        pthread_cond_broadcast(&c->done);
    }
    pthread_mutex_unlock(&c->mu);
    return c;
}

/* The shared mask for key into mask (its count), waiting while another matcher computes
 * it; else -1, and *slot >= 0 when this caller is to compute it (shared_fill with *gen). */
static int shared_get(grammar_mask_cache *c, uint64_t trie, const int32_t *key, int klen, uint32_t *mask,
                      size_t words, int *slot, uint64_t *gen) {
    *slot = -1;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (c->trie_id != trie) break;
        int i = 0;
        while (i < c->n && !(c->e[i].klen == klen && !memcmp(c->e[i].key, key, (size_t)klen * sizeof *key))) i++;
        if (i < c->n && c->e[i].pending) {
            pthread_cond_wait(&c->done, &c->mu);
            continue;   /* filled, evicted later, or the cache taken over: look again */
        }
        if (i < c->n) {
            c->e[i].used = ++c->tick;
            memcpy(mask, c->e[i].mask, words * sizeof *mask);
            int count = c->e[i].count;
            pthread_mutex_unlock(&c->mu);
            return count;
        }
        /* a miss: claim a slot (a new one, else the least recently used that is not pending) */
        int s = -1;
        if (c->n < GRAMMAR_SHARED_MASKS) s = c->n;
        else
            for (int k = 0; k < c->n; k++)
                if (!c->e[k].pending && (s < 0 || c->e[k].used < c->e[s].used)) s = k;
        if (s < 0) break;   /* all pending: compute without sharing */
        int32_t *kb = malloc((size_t)klen * sizeof *kb);
        uint32_t *mb = c->e[s].mask ? c->e[s].mask : malloc(words * sizeof *mb);
        if (!kb || !mb) {   /* out of memory: only the sharing misses out */
            free(kb);
            if (mb != c->e[s].mask) free(mb);
            break;
        }
        memcpy(kb, key, (size_t)klen * sizeof *kb);
        free(c->e[s].key);
        c->e[s].key = kb;
        c->e[s].mask = mb;
        c->e[s].klen = klen;
        c->e[s].pending = 1;
        c->e[s].used = ++c->tick;
        if (s == c->n) c->n++;
        *slot = s;
        *gen = c->gen;
        break;
    }
    pthread_mutex_unlock(&c->mu);
    return -1;
}

/* The claimed entry's mask, computed: ready for every matcher, its waiters woken. */
static void shared_fill(grammar_mask_cache *c, int slot, uint64_t gen, const uint32_t *mask, size_t words,
                        int count) {
    pthread_mutex_lock(&c->mu);
    if (c->gen == gen) {   /* not taken over meanwhile (then the slot is another's) */
        memcpy(c->e[slot].mask, mask, words * sizeof *mask);
        c->e[slot].count = count;
        c->e[slot].pending = 0;
    }
    pthread_cond_broadcast(&c->done);
    pthread_mutex_unlock(&c->mu);
}

int matcher_fill_mask(matcher *m, uint32_t *mask) {
    size_t words = vocab_mask_words(m->v->n_vocab);
    if (m->no_cache && !m->finished) return walk_mask(m, mask, GRAMMAR_DIST_INF);
    if (m->finished) {
        memset(mask, 0, words * sizeof *mask);
        return 0;
    }
    int32_t key[MT_KEY_MAX];
    int klen = state_key(m, key);
    m->tick++;
    int slot = 0;
    for (int i = 0; klen && i < MT_CACHE; i++) {
        if (m->cache[i].used && m->cache[i].klen == klen && !memcmp(m->cache[i].key, key, (size_t)klen * sizeof *key)) {
            m->cache[i].used = m->tick;
            memcpy(mask, m->cache[i].mask, words * sizeof *mask);
            return m->cache[i].count;
        }
        if (m->cache[i].used < m->cache[slot].used) slot = i;
    }
    grammar_mask_cache *sc = klen ? shared_of(m) : NULL;
    int claim = -1;
    uint64_t gen = 0;
    int count = sc ? shared_get(sc, m->v->id, key, klen, mask, words, &claim, &gen) : -1;
    if (count < 0) {
        count = walk_mask(m, mask, GRAMMAR_DIST_INF);
        if (claim >= 0) shared_fill(sc, claim, gen, mask, words, count);
    }
    if (klen && (m->cache[slot].mask || (m->cache[slot].mask = malloc(words * sizeof *mask)))) {
        memcpy(m->cache[slot].key, key, (size_t)klen * sizeof *key);
        m->cache[slot].klen = klen;
        m->cache[slot].count = count;
        m->cache[slot].used = m->tick;
        memcpy(m->cache[slot].mask, mask, words * sizeof *mask);
    }
    return count;
}

/* The trie scan (see the file comment). limit: a token is kept only if the shortest way
 * to the end after it is at most limit bytes (GRAMMAR_DIST_INF: no limit). */
static int walk_mask(matcher *m, uint32_t *mask, int32_t limit) {
    const vocab_trie *v = m->v;
    const grammar *g = m->g;
    memset(mask, 0, vocab_mask_words(v->n_vocab) * sizeof *mask);
    int count = 0;
    memcpy(m->lvl, m->cur, (size_t)m->n_cur * sizeof *m->lvl);
    m->lvl_n[0] = m->n_cur;
    m->lvl_mark[0] = m->n_fr;
    const vt_node *nodes = v->nodes;
    const int32_t *trans = g->trans;
    const uint8_t *flags = g->flags;
    int ncls = g->n_cls;
    for (uint32_t i = 0; i < (uint32_t)v->n_nodes;) {
        const vt_node *nd = &nodes[i];
        int d = nd->depth;
        const mt_stack *in = m->lvl + (size_t)(d - 1) * MT_MAX_STACKS;
        mt_stack *out = m->lvl + (size_t)d * MT_MAX_STACKS;
        int nin = m->lvl_n[d - 1], nout;
        uint8_t top_flags = nin == 1 ? flags[in[0].top] : 0;
        int plain = (nd->flags & VT_PLAIN) && (top_flags & GS_PLAINLOOP);
        if ((top_flags & GS_SIMPLE) && (plain || ((nd->flags & VT_TEXT) && (top_flags & GS_TEXTLOOP)))) {
            /* text inside a string: every token below is taken. Plain tokens leave the
             * state as it is (so its distance to the end); a token that ends inside a
             * character is at most 3 bytes further from the end. */
            int32_t d0 = limit >= GRAMMAR_DIST_INF ? 0 : stacks_dist(m, in, 1);
            if (d0 + (plain ? 0 : 3) <= limit) {
                for (int32_t k = nd->tlo; k < nd->thi; k++) {
                    int32_t t = v->sorted[k];
                    mask[t >> 5] |= 1u << (t & 31);
                }
                count += nd->thi - nd->tlo;
                i = nd->skip;
                continue;
            }
            if (d0 > limit) {   /* none of them can end in time */
                i = nd->skip;
                continue;
            }
        }
        if (nin == 1 && (flags[in[0].top] & GS_SIMPLE)) {   /* the common case: one lookup */
            int32_t t = trans[(size_t)in[0].top * ncls + g->cls[nd->byte]];
            if (t < 0) {
                i = nd->skip;
                continue;
            }
            out[0] = (mt_stack){t, in[0].parent};
            nout = 1;
            m->lvl_mark[d] = m->lvl_mark[d - 1];
        } else {
            m->n_fr = m->lvl_mark[d - 1];
            nout = step_all(m, in, nin, nd->byte, out);
            if (!nout) {
                i = nd->skip;
                continue;
            }
            m->lvl_mark[d] = m->n_fr;
        }
        m->lvl_n[d] = nout;
        if (nd->tok >= 0 && (limit >= GRAMMAR_DIST_INF || stacks_dist(m, out, nout) <= limit)) {
            int32_t t = nd->tok;
            mask[t >> 5] |= 1u << (t & 31);
            count++;
            if (nd->flags & VT_DUP)
                for (t = v->tok_next[t]; t >= 0; t = v->tok_next[t]) {
                    mask[t >> 5] |= 1u << (t & 31);
                    count++;
                }
        }
        i++;
    }
    m->n_fr = m->lvl_mark[0];
    if (matcher_accepting(m))
        for (int i = 0; i < v->n_eos; i++) mask[v->eos[i] >> 5] |= 1u << (v->eos[i] & 31);
    return count;
}
