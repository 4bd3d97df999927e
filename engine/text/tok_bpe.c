/* BPE model of the tokenizer: the vocabulary hash map, the merge map keyed by the pair of
 * ids, and the merge loop over one pre-token. Merges run lowest rank first, ties to the
 * leftmost pair (as HF's BPE), through a binary heap over a linked list of symbols, so
 * a long word costs O(n log n), never O(n^2). */
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/tok_internal.h"

/* ---- hashing ---- */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t k) {
    k *= 0x9E3779B97F4A7C15ull;
    return k ^ (k >> 31);
}

static uint64_t pow2_at_least(size_t n) {
    uint64_t c = 16;
    while (c < n) c *= 2;
    return c;
}

/* ---- string map ---- */

int tok_strmap_init(tok_strmap *m, size_t n_keys, const char *const *strs,
                    const uint32_t *lens) {
    uint64_t cap = pow2_at_least(n_keys * 2 + 1);
    m->slots = calloc(cap, sizeof *m->slots);
    if (!m->slots) return SPECD_ENOMEM;
    m->mask = (uint32_t)(cap - 1);
    m->strs = strs;
    m->lens = lens;
    return 0;
}

void tok_strmap_add(tok_strmap *m, uint32_t id) {
    const char *s = m->strs[id];
    uint32_t n = m->lens[id];
    uint32_t i = (uint32_t)hash_bytes(s, n) & m->mask;
    for (;; i = (i + 1) & m->mask) {
        uint32_t v = m->slots[i];
        if (!v) {
            m->slots[i] = id + 1;
            return;
        }
        if (m->lens[v - 1] == n && !memcmp(m->strs[v - 1], s, n)) return;
    }
}

int tok_strmap_get(const tok_strmap *m, const char *s, size_t len) {
    if (!m->slots) return -1;
    uint32_t i = (uint32_t)hash_bytes(s, len) & m->mask;
    for (;; i = (i + 1) & m->mask) {
        uint32_t v = m->slots[i];
        if (!v) return -1;
        if (m->lens[v - 1] == len && !memcmp(m->strs[v - 1], s, len)) return (int)(v - 1);
    }
}

void tok_strmap_free(tok_strmap *m) {
    free(m->slots);
    m->slots = NULL;
}

/* ---- merge map ---- */

int tok_mergemap_init(tok_mergemap *m, size_t n) {
    uint64_t cap = pow2_at_least(n * 2 + 1);
    m->slots = calloc(cap, sizeof *m->slots);
    if (!m->slots) return SPECD_ENOMEM;
    m->mask = cap - 1;
    m->n = 0;
    return 0;
}

static inline uint64_t pair_key(int32_t a, int32_t b) {
    return (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
}

void tok_mergemap_add(tok_mergemap *m, int32_t a, int32_t b, int32_t rank, int32_t id) {
    uint64_t k = pair_key(a, b);
    for (uint64_t i = hash_u64(k) & m->mask;; i = (i + 1) & m->mask) {
        tok_merge_slot *s = &m->slots[i];
        if (!s->key) {
            *s = (tok_merge_slot){k, rank, id};
            m->n++;
            return;
        }
        if (s->key == k) return;
    }
}

static inline const tok_merge_slot *merge_get(const tok_mergemap *m, int32_t a, int32_t b) {
    uint64_t k = pair_key(a, b);
    for (uint64_t i = hash_u64(k) & m->mask;; i = (i + 1) & m->mask) {
        const tok_merge_slot *s = &m->slots[i];
        if (s->key == k) return s;
        if (!s->key) return NULL;
    }
}

void tok_mergemap_free(tok_mergemap *m) {
    free(m->slots);
    m->slots = NULL;
}

int tok_add_merge(tok_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                  int32_t rank) {
    int ia = tok_strmap_get(&t->vocab, a, alen);
    int ib = tok_strmap_get(&t->vocab, b, blen);
    if (ia < 0 || ib < 0) return SPECD_ENOTFOUND;
    char stackbuf[256];
    char *cat = alen + blen <= sizeof stackbuf ? stackbuf : malloc(alen + blen);
    if (!cat) return SPECD_ENOMEM;
    memcpy(cat, a, alen);
    memcpy(cat + alen, b, blen);
    int id = tok_strmap_get(&t->vocab, cat, alen + blen);
    if (cat != stackbuf) free(cat);
    if (id < 0) return SPECD_ENOTFOUND;
    tok_mergemap_add(&t->merges, ia, ib, rank, id);
    return 0;
}

/* ---- id vector ---- */

int tok_ids_push(tok_ids *ids, int32_t id) {
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? ids->cap * 2 : 64;
        int32_t *v = realloc(ids->v, cap * sizeof *v);
        if (!v) return SPECD_ENOMEM;
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return 0;
}

/* ---- the merge loop ---- */

typedef struct {
    uint64_t key;         /* rank << 32 | position: lowest rank, then leftmost */
    int32_t left, right;  /* ids the pair had when queued; stale entries are skipped */
} cand;

/* Per-call cache of short pre-tokens already encoded (text repeats words a lot). It lives
 * in the scratch, so the tokenizer itself stays immutable and thread-safe. */
typedef struct { uint64_t h; uint32_t soff, slen, ioff, nids; } cache_ent;
#define CACHE_MAX_PIECE 64
#define CACHE_MAX_ENTRIES (1u << 20)

struct tok_bpe_scratch {
    int32_t *sym, *prev, *next;
    size_t cap;
    cand *heap;
    size_t hcap, hn;
    tok_buf map;
    cache_ent *ct;       /* open addressing, slen == 0 marks empty */
    size_t ccap, cn;
    tok_buf cstr;
    tok_ids cids;
    int cache_on;
};

tok_bpe_scratch *tok_bpe_scratch_new(int cache) {
    tok_bpe_scratch *s = calloc(1, sizeof(tok_bpe_scratch));
    if (s) s->cache_on = cache;
    return s;
}

void tok_bpe_scratch_free(tok_bpe_scratch *s) {
    if (!s) return;
    free(s->sym);
    free(s->prev);
    free(s->next);
    free(s->heap);
    tok_buf_free(&s->map);
    free(s->ct);
    tok_buf_free(&s->cstr);
    free(s->cids.v);
    free(s);
}

static int scratch_grow(tok_bpe_scratch *s, size_t n) {
    if (n <= s->cap && 3 * n + 4 <= s->hcap) return 0;
    size_t cap = s->cap ? s->cap : 64;
    while (cap < n) cap *= 2;
    int32_t *a = realloc(s->sym, cap * sizeof *a);
    if (a) s->sym = a;
    int32_t *b = realloc(s->prev, cap * sizeof *b);
    if (b) s->prev = b;
    int32_t *c = realloc(s->next, cap * sizeof *c);
    if (c) s->next = c;
    cand *h = realloc(s->heap, (3 * cap + 4) * sizeof *h);
    if (h) s->heap = h;
    if (!a || !b || !c || !h) return SPECD_ENOMEM;
    s->cap = cap;
    s->hcap = 3 * cap + 4;
    return 0;
}

static void heap_push(tok_bpe_scratch *s, cand c) {
    size_t i = s->hn++;
    while (i) {
        size_t p = (i - 1) / 2;
        if (s->heap[p].key <= c.key) break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = c;
}

static cand heap_pop(tok_bpe_scratch *s) {
    cand top = s->heap[0], last = s->heap[--s->hn];
    size_t i = 0, n = s->hn;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        if (l >= n) break;
        m = l;
        if (l + 1 < n && s->heap[l + 1].key < s->heap[l].key) m = l + 1;
        if (last.key <= s->heap[m].key) break;
        s->heap[i] = s->heap[m];
        i = m;
    }
    if (n) s->heap[i] = last;
    return top;
}

static void queue_pair(const tok_tokenizer *t, tok_bpe_scratch *s, int32_t pos) {
    int32_t nx = s->next[pos];
    if (nx < 0) return;
    const tok_merge_slot *m = merge_get(&t->merges, s->sym[pos], s->sym[nx]);
    if (m)
        heap_push(s, (cand){((uint64_t)(uint32_t)m->rank << 32) | (uint32_t)pos, s->sym[pos],
                            s->sym[nx]});
}

/* Initial symbols of a pre-token: its bytes (byte-level) or its chars, with unknown chars
 * turned into <0xNN> byte tokens (byte fallback) or the unk token. */
static int initial_symbols(const tok_tokenizer *t, const char *s, size_t n,
                           tok_bpe_scratch *sc, size_t *count) {
    size_t k = 0;
    int last_unk = 0;
    if (t->bytelevel) {
        for (size_t i = 0; i < n; i++) {
            int32_t id = t->byte_sym[(unsigned char)s[i]];
            if (id < 0) id = t->unk_id;
            if (id >= 0) sc->sym[k++] = id;
        }
        *count = k;
        return 0;
    }
    for (size_t i = 0; i < n;) {
        size_t cl = tok_utf8_valid_len((const unsigned char *)s + i, n - i);
        if (!cl) cl = 1;
        int id = tok_strmap_get(&t->vocab, s + i, cl);
        if (id >= 0) {
            sc->sym[k++] = id;
            last_unk = 0;
        } else {
            int ok = t->byte_fallback;
            for (size_t j = 0; ok && j < cl; j++) ok = t->byte_sym[(unsigned char)s[i + j]] >= 0;
            if (ok) {
                for (size_t j = 0; j < cl; j++) sc->sym[k++] = t->byte_sym[(unsigned char)s[i + j]];
                last_unk = 0;
            } else if (t->unk_id >= 0 && !(t->fuse_unk && last_unk)) {
                sc->sym[k++] = t->unk_id;
                last_unk = 1;
            }
        }
        i += cl;
    }
    *count = k;
    return 0;
}

int tok_bpe_piece(const tok_tokenizer *t, const char *s, size_t n, tok_bpe_scratch *sc,
                  tok_ids *out) {
    if (!n) return 0;
    int direct = tok_strmap_get(&t->direct, s, n);
    if (direct >= 0) return tok_ids_push(out, direct);
    if (t->ignore_merges) {   /* a pre-token that is a whole vocab entry skips the merges */
        const char *key = s;
        size_t klen = n;
        if (t->bytelevel) {
            sc->map.len = 0;
            if (tok_buf_reserve(&sc->map, 2 * n)) return SPECD_ENOMEM;
            for (size_t i = 0; i < n; i++)
                sc->map.len += tok_utf8_encode(tok_byte_cp((unsigned char)s[i]),
                                               sc->map.p + sc->map.len);
            key = sc->map.p;
            klen = sc->map.len;
        }
        int id = tok_strmap_get(&t->vocab, key, klen);
        if (id >= 0) return tok_ids_push(out, id);
    }
    if (scratch_grow(sc, 4 * n)) return SPECD_ENOMEM;   /* byte fallback: 4 per char max */
    size_t k;
    initial_symbols(t, s, n, sc, &k);
    if (k == 0) return 0;
    if (k == 1) return tok_ids_push(out, sc->sym[0]);
    sc->hn = 0;
    for (size_t i = 0; i < k; i++) {
        sc->prev[i] = (int32_t)i - 1;
        sc->next[i] = i + 1 < k ? (int32_t)i + 1 : -1;
    }
    for (size_t i = 0; i + 1 < k; i++) queue_pair(t, sc, (int32_t)i);
    while (sc->hn) {
        cand c = heap_pop(sc);
        int32_t pos = (int32_t)(uint32_t)c.key, nx = sc->next[pos];
        if (sc->sym[pos] != c.left || nx < 0 || sc->sym[nx] != c.right) continue;
        const tok_merge_slot *m = merge_get(&t->merges, c.left, c.right);
        sc->sym[pos] = m->id;
        sc->sym[nx] = -1;    /* dead */
        sc->next[pos] = sc->next[nx];
        if (sc->next[nx] >= 0) sc->prev[sc->next[nx]] = pos;
        if (sc->prev[pos] >= 0) queue_pair(t, sc, sc->prev[pos]);
        queue_pair(t, sc, pos);
    }
    for (int32_t i = 0; i >= 0; i = sc->next[i])
        if (tok_ids_push(out, sc->sym[i])) return SPECD_ENOMEM;
    return 0;
}

static int cache_grow(tok_bpe_scratch *sc) {
    size_t cap = sc->ccap ? sc->ccap * 2 : 4096;
    cache_ent *ct = calloc(cap, sizeof *ct);
    if (!ct) return SPECD_ENOMEM;
    for (size_t i = 0; i < sc->ccap; i++) {
        if (!sc->ct[i].slen) continue;
        size_t j = sc->ct[i].h & (cap - 1);
        while (ct[j].slen) j = (j + 1) & (cap - 1);
        ct[j] = sc->ct[i];
    }
    free(sc->ct);
    sc->ct = ct;
    sc->ccap = cap;
    return 0;
}

int tok_bpe_piece_cached(const tok_tokenizer *t, const char *s, size_t n, tok_bpe_scratch *sc,
                         tok_ids *out) {
    if (!sc->cache_on || n == 0 || n > CACHE_MAX_PIECE) return tok_bpe_piece(t, s, n, sc, out);
    if (sc->cn * 2 >= sc->ccap && sc->cn < CACHE_MAX_ENTRIES && cache_grow(sc))
        return SPECD_ENOMEM;
    uint64_t h = hash_bytes(s, n);
    size_t j = h & (sc->ccap - 1);
    for (; sc->ct[j].slen; j = (j + 1) & (sc->ccap - 1)) {
        const cache_ent *e = &sc->ct[j];
        if (e->h == h && e->slen == n && !memcmp(sc->cstr.p + e->soff, s, n)) {
            for (uint32_t k = 0; k < e->nids; k++)
                if (tok_ids_push(out, sc->cids.v[e->ioff + k])) return SPECD_ENOMEM;
            return 0;
        }
    }
    size_t start = out->n;
    int rc = tok_bpe_piece(t, s, n, sc, out);
    if (rc || sc->cn * 2 >= sc->ccap) return rc;   /* full: stop adding */
    cache_ent e = {h, (uint32_t)sc->cstr.len, (uint32_t)n, (uint32_t)sc->cids.n,
                   (uint32_t)(out->n - start)};
    if (tok_buf_put(&sc->cstr, s, n)) return SPECD_ENOMEM;
    for (size_t k = start; k < out->n; k++)
        if (tok_ids_push(&sc->cids, out->v[k])) return SPECD_ENOMEM;
    sc->ct[j] = e;
    sc->cn++;
    return 0;
}

int tok_build_direct(tok_tokenizer *t, const uint8_t *in_model) {
    t->direct_key = calloc((size_t)t->n_vocab + 1, sizeof *t->direct_key);
    tok_bpe_scratch *sc = tok_bpe_scratch_new(0);
    tok_ids ids = {0};
    int rc = !t->direct_key || !sc ? SPECD_ENOMEM : 0;
    const uint32_t *lens = t->bytelevel ? t->piece_len : t->tok_len;
    if (!rc) rc = tok_strmap_init(&t->direct, (size_t)t->n_vocab, t->direct_key, lens);
    for (int id = 0; id < t->n_vocab && !rc; id++) {
        t->direct_key[id] = t->bytelevel ? t->piece_blob + t->piece_off[id] : t->tok_str[id];
        if (!in_model[id] || !lens[id]) continue;
        ids.n = 0;
        rc = tok_bpe_piece(t, t->direct_key[id], lens[id], sc, &ids);
        if (!rc && ids.n == 1 && ids.v[0] == id) tok_strmap_add(&t->direct, (uint32_t)id);
    }
    free(ids.v);
    tok_bpe_scratch_free(sc);
    return rc;
}
