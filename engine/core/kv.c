/* KV block manager (see kv.h): the accounting of the one paged KV pool.
 *
 * Per block we keep a ref count, intrusive LRU free-list links (prev/next), and for
 * cached full blocks the chained hash, the parent's hash and a copy of the block's token
 * ids (to confirm a hit). The hash table is chained through the blocks themselves
 * (hnext/hprev), so insert, lookup and removal allocate nothing and removal is O(1).
 * Block ids are int32; -1 means "none" in every link. Block 0 is never linked anywhere. */
#include "engine/core/kv.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"

/* Chain input of a request's first block: an arbitrary odd constant, not 0, so the first
 * block of a prompt never hashes like a block whose parent hash happened to be 0. */
#define KV_ROOT_HASH 0x6a09e667f3bcc909ULL

typedef struct {
    int32_t ref;
    int32_t prev, next;      /* free list links (valid only while ref == 0) */
    int32_t hprev, hnext;    /* hash chain links (valid only while hashed) */
    int hashed;
    uint64_t hash, parent;   /* parent: hash of the previous block in the prefix */
} kv_block;

struct kv_pool {
    int num_blocks, block_size, prefix_cache;
    kv_block *blk;           /* [num_blocks] */
    int32_t *tok;            /* [num_blocks * block_size] token ids of hashed blocks */
    int32_t free_head, free_tail;
    int n_free, n_cached;
    int32_t *bucket;         /* [n_buckets] first block of each hash chain, -1 empty */
    uint64_t bucket_mask;
    kv_hash_fn hash_fn;
};

/* ---- hashing ------------------------------------------------------------------------ */

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* splitmix64's finalizer: full avalanche, so nearby token ids land far apart. */
static uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

uint64_t kv_hash_block(uint64_t parent, const int32_t *tokens, int n) {
    /* Two token ids per 64-bit word, each word multiplied into a rotating accumulator
     * (xxhash-style), length folded in so [a] and [a, 0] differ. */
    uint64_t h = mix64(parent ^ 0x9e3779b97f4a7c15ULL) + (uint64_t)n * 0xc2b2ae3d27d4eb4fULL;
    int i = 0;
    for (; i + 1 < n; i += 2) {
        uint64_t w = (uint64_t)(uint32_t)tokens[i] | ((uint64_t)(uint32_t)tokens[i + 1] << 32);
        h ^= mix64(w + 0x165667b19e3779f9ULL);
        h = rotl64(h, 27) * 0x9e3779b185ebca87ULL + 0x85ebca77c2b2ae63ULL;
    }
    if (i < n) {
        h ^= mix64((uint64_t)(uint32_t)tokens[i] ^ 0x27d4eb2f165667c5ULL);
        h = rotl64(h, 23) * 0xc2b2ae3d27d4eb4fULL;
    }
    return mix64(h);
}

/* ---- free list ---------------------------------------------------------------------- */

static void free_unlink(kv_pool *p, int32_t b) {
    kv_block *k = &p->blk[b];
    if (k->prev >= 0) p->blk[k->prev].next = k->next; else p->free_head = k->next;
    if (k->next >= 0) p->blk[k->next].prev = k->prev; else p->free_tail = k->prev;
    k->prev = k->next = -1;
    p->n_free--;
}

static void free_push_tail(kv_pool *p, int32_t b) {
    kv_block *k = &p->blk[b];
    k->prev = p->free_tail;
    k->next = -1;
    if (p->free_tail >= 0) p->blk[p->free_tail].next = b; else p->free_head = b;
    p->free_tail = b;
    p->n_free++;
}

/* ---- hash table --------------------------------------------------------------------- */

static void hash_remove(kv_pool *p, int32_t b) {
    kv_block *k = &p->blk[b];
    if (k->hprev >= 0) p->blk[k->hprev].hnext = k->hnext;
    else p->bucket[k->hash & p->bucket_mask] = k->hnext;
    if (k->hnext >= 0) p->blk[k->hnext].hprev = k->hprev;
    k->hprev = k->hnext = -1;
    k->hashed = 0;
    p->n_cached--;
}

static void hash_insert(kv_pool *p, int32_t b, uint64_t hash, uint64_t parent,
                        const int32_t *tokens) {
    kv_block *k = &p->blk[b];
    int32_t *head = &p->bucket[hash & p->bucket_mask];
    k->hash = hash;
    k->parent = parent;
    k->hashed = 1;
    memcpy(&p->tok[(size_t)b * p->block_size], tokens, sizeof(int32_t) * p->block_size);
    k->hprev = -1;
    k->hnext = *head;
    if (*head >= 0) p->blk[*head].hprev = b;
    *head = b;
    p->n_cached++;
}

/* A cached block holding exactly these tokens after exactly this parent, or -1. */
static int32_t hash_find(const kv_pool *p, uint64_t hash, uint64_t parent,
                         const int32_t *tokens) {
    for (int32_t b = p->bucket[hash & p->bucket_mask]; b >= 0; b = p->blk[b].hnext) {
        const kv_block *k = &p->blk[b];
        if (k->hash == hash && k->parent == parent &&
            memcmp(&p->tok[(size_t)b * p->block_size], tokens,
                   sizeof(int32_t) * p->block_size) == 0)
            return b;
    }
    return -1;
}

/* ---- pool --------------------------------------------------------------------------- */

kv_pool *kv_pool_create(const kv_pool_config *cfg, char *err, size_t errlen) {
    kv_pool *p = NULL;
    if (!cfg || cfg->num_blocks < 2 || cfg->block_size < 1) {
        specd_errf(err, errlen, SPECD_EINVAL,
                   "kv_pool_create: num_blocks must be >= 2 (got %d) and block_size >= 1 (got %d)",
                   cfg ? cfg->num_blocks : 0, cfg ? cfg->block_size : 0);
        return NULL;
    }
    if ((size_t)cfg->num_blocks > SIZE_MAX / sizeof(int32_t) / (size_t)cfg->block_size) {
        specd_errf(err, errlen, SPECD_ERANGE, "kv_pool_create: num_blocks * block_size overflows");
        return NULL;
    }
    p = calloc(1, sizeof(*p));
    if (!p) goto fail;
    p->num_blocks = cfg->num_blocks;
    p->block_size = cfg->block_size;
    p->prefix_cache = cfg->enable_prefix_cache != 0;
    p->hash_fn = kv_hash_block;
    size_t nb = 16;
    while (nb < (size_t)cfg->num_blocks) nb <<= 1;
    p->bucket_mask = nb - 1;
    p->blk = calloc((size_t)cfg->num_blocks, sizeof(*p->blk));
    p->bucket = malloc(nb * sizeof(*p->bucket));
    /* Token copies exist only to confirm prefix hits. */
    if (p->prefix_cache)
        p->tok = malloc((size_t)cfg->num_blocks * cfg->block_size * sizeof(*p->tok));
    if (!p->blk || !p->bucket || (p->prefix_cache && !p->tok)) goto fail;
    for (size_t i = 0; i < nb; i++) p->bucket[i] = -1;
    p->free_head = p->free_tail = -1;
    p->blk[0] = (kv_block){.ref = 0, .prev = -1, .next = -1, .hprev = -1, .hnext = -1};
    /* Fresh blocks in id order, so allocation order is predictable (1, 2, 3, ...). */
    for (int32_t b = 1; b < cfg->num_blocks; b++) {
        p->blk[b] = (kv_block){.ref = 0, .hprev = -1, .hnext = -1};
        free_push_tail(p, b);
    }
    return p;
fail:
    kv_pool_destroy(p);
    specd_errf(err, errlen, SPECD_ENOMEM, "kv_pool_create: out of memory for %d blocks of %d tokens",
               cfg->num_blocks, cfg->block_size);
    return NULL;
}

void kv_pool_destroy(kv_pool *p) {
    if (!p) return;
    free(p->blk);
    free(p->tok);
    free(p->bucket);
    free(p);
}

int kv_num_blocks(const kv_pool *p) { return p->num_blocks; }
int kv_block_size(const kv_pool *p) { return p->block_size; }
int kv_num_free(const kv_pool *p) { return p->n_free; }
int kv_num_used(const kv_pool *p) { return p->num_blocks - 1 - p->n_free; }
int kv_num_cached(const kv_pool *p) { return p->n_cached; }

int kv_prefix_forget(kv_pool *p) {
    int n = 0;
    for (int32_t b = p->free_head; b >= 0; b = p->blk[b].next)
        if (p->blk[b].hashed) {
            hash_remove(p, b);
            n++;
        }
    return n;
}

int kv_ref(const kv_pool *p, int32_t block) {
    if (block < 0 || block >= p->num_blocks) return SPECD_EINVAL;
    return p->blk[block].ref;
}

int kv_blocks_for(const kv_pool *p, int tokens) {
    if (tokens <= 0) return 0;
    return (int)(((int64_t)tokens + p->block_size - 1) / p->block_size);
}

int kv_pool_set_hash_fn(kv_pool *p, kv_hash_fn fn) {
    if (p->n_cached) return SPECD_ESTATE;
    p->hash_fn = fn ? fn : kv_hash_block;
    return 0;
}

int kv_test_set_ref(kv_pool *p, int32_t block, int ref) {
    if (block < 0 || block >= p->num_blocks) return SPECD_EINVAL;
    p->blk[block].ref = ref;
    return 0;
}

/* Take the LRU head. A cached block loses its hash: its content is about to change. */
static int32_t alloc_block(kv_pool *p) {
    int32_t b = p->free_head;
    free_unlink(p, b);
    if (p->blk[b].hashed) hash_remove(p, b);
    p->blk[b].ref = 1;
    return b;
}

/* ---- sequences ---------------------------------------------------------------------- */

int kv_seq_init(kv_seq *s, int max_blocks) {
    memset(s, 0, sizeof(*s));
    if (max_blocks < 1) return SPECD_EINVAL;
    s->blocks = malloc((size_t)max_blocks * sizeof(*s->blocks));
    if (!s->blocks) return SPECD_ENOMEM;
    s->cap = max_blocks;
    return 0;
}

void kv_seq_release(kv_pool *p, kv_seq *s) {
    /* Last block first: the tail end of the free list is evicted last, so the request's
     * first blocks (the prefix others are most likely to share) survive longest. */
    for (int i = s->n_blocks - 1; i >= s->n_dropped; i--) {
        int32_t b = s->blocks[i];
        if (--p->blk[b].ref == 0) free_push_tail(p, b);
    }
    s->n_blocks = 0;
    s->n_full_hashed = 0;
    s->last_hash = 0;
    s->n_dropped = 0;
}

int kv_seq_drop_front(kv_pool *p, kv_seq *s, int upto) {
    if (upto > s->n_full_hashed) upto = s->n_full_hashed;
    int n = 0;
    for (; s->n_dropped < upto; s->n_dropped++, n++) {
        int32_t b = s->blocks[s->n_dropped];
        if (--p->blk[b].ref == 0) free_push_tail(p, b);
        s->blocks[s->n_dropped] = 0;
    }
    return n;
}

void kv_seq_destroy(kv_seq *s) {
    free(s->blocks);
    memset(s, 0, sizeof(*s));
}

int kv_prefix_lookup(const kv_pool *p, const int32_t *tokens, int n, int max_blocks,
                     int *n_evictable) {
    int evictable = 0, i = 0;
    if (p->prefix_cache && n > 1) {
        int limit = (n - 1) / p->block_size;
        if (limit > max_blocks) limit = max_blocks;
        uint64_t parent = KV_ROOT_HASH;
        for (; i < limit; i++) {
            const int32_t *t = tokens + (size_t)i * p->block_size;
            uint64_t h = p->hash_fn(parent, t, p->block_size);
            int32_t b = hash_find(p, h, parent, t);
            if (b < 0) break;
            if (p->blk[b].ref == 0) evictable++;
            parent = h;
        }
    }
    if (n_evictable) *n_evictable = evictable;
    return i * p->block_size;
}

int kv_seq_match_prefix(kv_pool *p, kv_seq *s, const int32_t *tokens, int n) {
    if (s->n_blocks != 0) return SPECD_ESTATE;
    if (!p->prefix_cache || n <= 1) return 0;
    int limit = (n - 1) / p->block_size;
    if (limit > s->cap) limit = s->cap;
    uint64_t parent = KV_ROOT_HASH;
    for (int i = 0; i < limit; i++) {
        const int32_t *t = tokens + (size_t)i * p->block_size;
        uint64_t h = p->hash_fn(parent, t, p->block_size);
        int32_t b = hash_find(p, h, parent, t);
        if (b < 0) break;
        /* A free cached block comes back to life: off the free list, hash kept. */
        if (p->blk[b].ref++ == 0) free_unlink(p, b);
        s->blocks[s->n_blocks++] = b;
        s->n_full_hashed = s->n_blocks;
        s->last_hash = h;
        parent = h;
    }
    return s->n_blocks * p->block_size;
}

/* Chain hashes of the first n blocks of tokens: h[i] of block i (its parent is h[i - 1]). */
static void chain_hashes(const kv_pool *p, const int32_t *tokens, int n, uint64_t *h) {
    uint64_t parent = KV_ROOT_HASH;
    for (int i = 0; i < n; i++) h[i] = parent = p->hash_fn(parent, tokens + (size_t)i * p->block_size, p->block_size);
}

/* The cached block i of the chain h over tokens, or -1. */
static int32_t chain_find(const kv_pool *p, const int32_t *tokens, const uint64_t *h, int i) {
    return hash_find(p, h[i], i ? h[i - 1] : KV_ROOT_HASH, tokens + (size_t)i * p->block_size);
}

int kv_prefix_lookup_window(const kv_pool *p, const int32_t *tokens, int n_blocks, int window,
                            int *n_evictable) {
    if (n_evictable) *n_evictable = 0;
    if (!p->prefix_cache || n_blocks <= 0) return 0;
    uint64_t *h = malloc((size_t)n_blocks * sizeof(*h));
    if (!h) return 0;   /* no hit is always correct */
    chain_hashes(p, tokens, n_blocks, h);
    /* run: first block of the run of cached blocks ending at block i; the answer is the
     * largest m whose needed blocks [drop(m), m) lie inside the run ending at m - 1. */
    int best = 0, run = 0;
    for (int i = 0; i < n_blocks; i++) {
        if (chain_find(p, tokens, h, i) < 0) {
            run = i + 1;
            continue;
        }
        if (run <= kv_window_drop_upto((i + 1) * p->block_size, window, p->block_size)) best = i + 1;
    }
    if (n_evictable)
        for (int i = kv_window_drop_upto(best * p->block_size, window, p->block_size); i < best; i++)
            *n_evictable += p->blk[chain_find(p, tokens, h, i)].ref == 0;
    free(h);
    return best * p->block_size;
}

int kv_seq_match_window(kv_pool *p, kv_seq *s, const int32_t *tokens, int n_tokens, int window) {
    if (s->n_blocks != 0) return SPECD_ESTATE;
    int m = n_tokens / p->block_size;
    if (m <= 0) return 0;
    if (!p->prefix_cache || m > s->cap || m * p->block_size != n_tokens) return SPECD_EINVAL;
    uint64_t *h = malloc((size_t)m * sizeof(*h));
    if (!h) return SPECD_ENOMEM;
    chain_hashes(p, tokens, m, h);
    int lo = kv_window_drop_upto(n_tokens, window, p->block_size);
    for (int i = 0; i < m; i++) {
        int32_t b = 0;
        if (i >= lo && (b = chain_find(p, tokens, h, i)) < 0) {
            s->n_dropped = lo;
            kv_seq_release(p, s);
            free(h);
            return SPECD_EINVAL;
        }
        if (b && p->blk[b].ref++ == 0) free_unlink(p, b);
        s->blocks[s->n_blocks++] = b;
    }
    s->n_dropped = lo;
    s->n_full_hashed = m;
    s->last_hash = h[m - 1];
    free(h);
    return n_tokens;
}

int kv_seq_blocks_needed(const kv_pool *p, const kv_seq *s, int n_tokens) {
    int need = kv_blocks_for(p, n_tokens) - s->n_blocks;
    return need > 0 ? need : 0;
}

int kv_seq_reserve(kv_pool *p, kv_seq *s, int n_tokens) {
    if (kv_blocks_for(p, n_tokens) > s->cap) return SPECD_ERANGE;
    int need = kv_seq_blocks_needed(p, s, n_tokens);
    if (need > p->n_free) return SPECD_ENOSPACE;
    for (int i = 0; i < need; i++) s->blocks[s->n_blocks++] = alloc_block(p);
    return 0;
}

void kv_seq_commit(kv_pool *p, kv_seq *s, const int32_t *tokens, int n_computed) {
    int full = n_computed / p->block_size;
    if (full > s->n_blocks) full = s->n_blocks;
    while (s->n_full_hashed < full) {
        int i = s->n_full_hashed;
        int32_t b = s->blocks[i];
        const int32_t *t = tokens + (size_t)i * p->block_size;
        uint64_t parent = i == 0 ? KV_ROOT_HASH : s->last_hash;
        uint64_t h = p->hash_fn(parent, t, p->block_size);
        /* Register unless an identical block (same parent, same tokens) already is: one
         * entry per distinct prefix keeps lookups exact and the table small. */
        if (p->prefix_cache && !p->blk[b].hashed && hash_find(p, h, parent, t) < 0)
            hash_insert(p, b, h, parent, t);
        s->last_hash = h;
        s->n_full_hashed = i + 1;
    }
}

int kv_seq_fork(kv_pool *p, const kv_seq *src, kv_seq *dst, int32_t *copy_src, int32_t *copy_dst) {
    if (dst->n_blocks != 0) return SPECD_ESTATE;
    int shared = src->n_full_hashed;
    int copy = src->n_blocks > shared;
    if (shared + copy > dst->cap) return SPECD_ERANGE;
    if (copy && p->n_free < 1) return SPECD_ENOSPACE;
    for (int i = 0; i < shared; i++) {
        int32_t b = src->blocks[i];
        if (i >= src->n_dropped) p->blk[b].ref++;   /* held by src, so never on the free list */
        dst->blocks[i] = b;
    }
    dst->n_dropped = src->n_dropped;
    dst->n_blocks = shared;
    dst->n_full_hashed = shared;
    dst->last_hash = src->last_hash;
    if (!copy) return 0;
    int32_t nb = alloc_block(p);
    dst->blocks[dst->n_blocks++] = nb;
    *copy_src = src->blocks[shared];
    *copy_dst = nb;
    return 1;
}

/* ---- invariant check ---------------------------------------------------------------- */

static int check_tables(const kv_pool *p, const kv_seq *const *tables, int n_tables,
                        int32_t *count, char *err, size_t errlen) {
    for (int t = 0; t < n_tables; t++) {
        const kv_seq *s = tables[t];
        if (s->n_blocks < 0 || s->n_blocks > s->cap || s->n_full_hashed < 0 ||
            s->n_full_hashed > s->n_blocks)
            return specd_errf(err, errlen, SPECD_ESTATE,
                              "kv_check: table %d: n_blocks %d, n_full_hashed %d, cap %d",
                              t, s->n_blocks, s->n_full_hashed, s->cap);
        if (s->n_dropped < 0 || s->n_dropped > s->n_full_hashed)
            return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: table %d: n_dropped %d, n_full_hashed %d", t,
                              s->n_dropped, s->n_full_hashed);
        for (int i = 0; i < s->n_blocks; i++) {
            int32_t b = s->blocks[i];
            if (i < s->n_dropped) {   /* released behind a window: the null block */
                if (b != 0)
                    return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: table %d entry %d was dropped but holds %d",
                                      t, i, b);
                continue;
            }
            if (b <= 0 || b >= p->num_blocks)
                return specd_errf(err, errlen, SPECD_ESTATE,
                                  "kv_check: table %d entry %d holds block %d (null or out of range)",
                                  t, i, b);
            count[b]++;
        }
    }
    for (int32_t b = 1; b < p->num_blocks; b++)
        if (p->blk[b].ref != count[b])
            return specd_errf(err, errlen, SPECD_ESTATE,
                              "kv_check: block %d has ref %d but %d tables hold it",
                              b, p->blk[b].ref, count[b]);
    return 0;
}

static int check_free_list(const kv_pool *p, int32_t *seen, char *err, size_t errlen) {
    int n = 0;
    int32_t prev = -1;
    for (int32_t b = p->free_head; b >= 0; prev = b, b = p->blk[b].next) {
        if (b == 0 || b >= p->num_blocks)
            return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: free list holds block %d", b);
        if (seen[b]++)
            return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: block %d twice on the free list", b);
        if (p->blk[b].ref != 0)
            return specd_errf(err, errlen, SPECD_ESTATE,
                              "kv_check: block %d on the free list with ref %d", b, p->blk[b].ref);
        if (p->blk[b].prev != prev)
            return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: block %d has a broken prev link", b);
        n++;
    }
    if (p->free_tail != prev)
        return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: free list tail is %d, walk ends at %d",
                          p->free_tail, prev);
    if (n != p->n_free)
        return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: free list has %d blocks, n_free says %d",
                          n, p->n_free);
    for (int32_t b = 1; b < p->num_blocks; b++)
        if (p->blk[b].ref == 0 && !seen[b])
            return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: block %d is lost (ref 0, not free)", b);
    return 0;
}

static int check_hash_table(const kv_pool *p, char *err, size_t errlen) {
    int n = 0, hashed = 0;
    for (uint64_t i = 0; i <= p->bucket_mask; i++) {
        int32_t prev = -1;
        for (int32_t b = p->bucket[i]; b >= 0; prev = b, b = p->blk[b].hnext) {
            const kv_block *k = &p->blk[b];
            if (b == 0 || b >= p->num_blocks || !k->hashed || (k->hash & p->bucket_mask) != i ||
                k->hprev != prev)
                return specd_errf(err, errlen, SPECD_ESTATE,
                                  "kv_check: hash bucket %llu holds a bad entry (block %d)",
                                  (unsigned long long)i, b);
            if (p->hash_fn(k->parent, &p->tok[(size_t)b * p->block_size], p->block_size) != k->hash)
                return specd_errf(err, errlen, SPECD_ESTATE,
                                  "kv_check: block %d: stored hash does not match its tokens", b);
            if (++n > p->num_blocks)
                return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: hash chain %llu loops",
                                  (unsigned long long)i);
        }
    }
    for (int32_t b = 0; b < p->num_blocks; b++) hashed += p->blk[b].hashed != 0;
    if (n != p->n_cached || hashed != p->n_cached)
        return specd_errf(err, errlen, SPECD_ESTATE,
                          "kv_check: %d hash entries, %d hashed blocks, n_cached %d",
                          n, hashed, p->n_cached);
    return 0;
}

int kv_check(const kv_pool *p, const kv_seq *const *tables, int n_tables, char *err, size_t errlen) {
    const kv_block *z = &p->blk[0];
    if (z->ref != 0 || z->hashed || z->prev != -1 || z->next != -1)
        return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: null block 0 was touched (ref %d)",
                          z->ref);
    if (p->n_free < 0 || p->n_free > p->num_blocks - 1)
        return specd_errf(err, errlen, SPECD_ESTATE, "kv_check: n_free %d out of range", p->n_free);
    int32_t *scratch = calloc((size_t)p->num_blocks * 2, sizeof(*scratch));
    if (!scratch) return specd_errf(err, errlen, SPECD_ENOMEM, "kv_check: out of memory");
    int rc = check_tables(p, tables, n_tables, scratch, err, errlen);
    if (rc == 0) rc = check_free_list(p, scratch + p->num_blocks, err, errlen);
    if (rc == 0) rc = check_hash_table(p, err, errlen);
    free(scratch);
    return rc;
}
