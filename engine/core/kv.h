/* KV block manager (prefix kv_): pure accounting for the one paged KV pool shared by the
 * target and the draft model. No CUDA, no I/O: the runner owns the bytes, this module
 * owns which block belongs to whom.
 *
 * - Block 0 is the null block: never handed out; padding rows point at it.
 * - Each block has a ref count. Full blocks carry a prefix hash chained from the
 *   previous block's hash and their token ids (a hash hit is confirmed by comparing
 *   tokens), so a new request whose prompt starts with cached full blocks reuses them.
 * - Free blocks sit on an intrusive doubly linked list in LRU order: allocation takes
 *   the head; a freed block goes to the tail; a cached (hashed) free block that gets
 *   reused is unlinked in O(1). Allocating a cached free block evicts its hash.
 * - A request's blocks are freed last-block-first, so its prefix stays cached longest.
 * - A hit must match the stored parent hash AND the stored token ids, so a 64-bit hash
 *   collision never shares KV between different prefixes. When two requests compute the
 *   same block at once, only the first one committed is registered; the other stays a
 *   plain (unhashed) block and is simply reused when freed.
 *
 * Threading: not thread safe; one owner (the loop/engine thread). */
#ifndef SPECD_KV_H
#define SPECD_KV_H

#include <stddef.h>
#include <stdint.h>

typedef struct kv_pool kv_pool;

typedef struct {
    int num_blocks;          /* total, including the null block 0; >= 2 */
    int block_size;          /* tokens per block */
    int enable_prefix_cache;
} kv_pool_config;

/* A request's block table. Owned by the request; kv_ functions fill it. */
typedef struct {
    int32_t *blocks;         /* block ids, blocks[i] holds tokens [i*bs, (i+1)*bs) */
    int n_blocks;
    int cap;                 /* capacity of blocks[] (max blocks per sequence) */
    int n_full_hashed;       /* leading full blocks committed by kv_seq_commit (their hash
                              * is computed; registered in the prefix cache unless caching
                              * is off or an identical block already was). Immutable. */
    uint64_t last_hash;      /* hash of block n_full_hashed-1 (chain input) */
    int n_dropped;           /* leading entries released behind a sliding window
                              * (kv_seq_drop_front): they hold the null block 0 */
} kv_seq;

kv_pool *kv_pool_create(const kv_pool_config *cfg, char *err, size_t errlen);
void kv_pool_destroy(kv_pool *p);

int kv_num_blocks(const kv_pool *p);     /* total including null block */
int kv_block_size(const kv_pool *p);
int kv_num_free(const kv_pool *p);       /* allocatable now (free + evictable cached) */
int kv_num_used(const kv_pool *p);       /* blocks with ref > 0 */
int kv_ref(const kv_pool *p, int32_t block);

/* Number of blocks needed to hold `tokens` tokens: ceil(tokens / bs); 0 for tokens <= 0. */
int kv_blocks_for(const kv_pool *p, int tokens);
int kv_num_cached(const kv_pool *p);     /* blocks whose hash is registered (any ref) */
/* Unregister the hashes of every evictable block (ref 0): the prefix cache forgets them,
 * they stay free in their LRU order. Returns how many. */
int kv_prefix_forget(kv_pool *p);

/* max_blocks: capacity of the table: ceil((max_seq_len + lookahead) / block_size), so a
 * speculative step at the end of the context still has room for its draft tokens (with
 * ceil(max_seq_len / block_size) the scheduler clamps the lookahead there; see
 * sched_lookahead_room). */
int kv_seq_init(kv_seq *s, int max_blocks);
/* Release every block (ref--, freed blocks to the LRU tail, last block first) and
 * empty the table; the table's memory is kept (kv_seq_destroy frees it). */
void kv_seq_release(kv_pool *p, kv_seq *s);
void kv_seq_destroy(kv_seq *s);

/* Prefix-cache lookup for an empty table: appends the longest run of cached full blocks
 * matching tokens[0..n) (never the whole prompt: at most floor((n-1)/bs) blocks, so at
 * least one token is left to compute and the request gets logits; never more than the
 * table's cap) with ref++, and returns the number of tokens covered (a multiple of
 * block_size; 0 when caching is off). SPECD_ESTATE if the table is not empty. */
int kv_seq_match_prefix(kv_pool *p, kv_seq *s, const int32_t *tokens, int n);
/* The same lookup without side effects, for admission control: returns the tokens
 * kv_seq_match_prefix would cover for a table of capacity max_blocks, and in
 * *n_evictable (may be NULL) how many of those blocks are now free (ref 0): taking them
 * lowers kv_num_free by that much. */
int kv_prefix_lookup(const kv_pool *p, const int32_t *tokens, int n, int max_blocks,
                     int *n_evictable);

/* Make the table hold at least n_tokens tokens, allocating new blocks. All or nothing:
 * returns SPECD_ENOSPACE (table unchanged) if the pool cannot supply them, SPECD_ERANGE if
 * n_tokens exceeds the table capacity. */
int kv_seq_reserve(kv_pool *p, kv_seq *s, int n_tokens);
/* How many new blocks kv_seq_reserve(s, n_tokens) would need. */
int kv_seq_blocks_needed(const kv_pool *p, const kv_seq *s, int n_tokens);

/* Register hashes of full blocks whose KV is now computed: tokens[0..n_computed).
 * Call it after every step (it only hashes blocks not yet committed). */
void kv_seq_commit(kv_pool *p, kv_seq *s, const int32_t *tokens, int n_computed);

/* Release the leading blocks [n_dropped, upto) of a table whose model attends through a
 * sliding window that has left them behind: they become the null block 0 in the table
 * (never read again: every later query's window starts past them) and go back to the
 * pool, keeping their prefix hash so another request may still reuse them. Only
 * committed (hashed) blocks are dropped, so the prefix chain stays intact. Returns the
 * number released. */
int kv_seq_drop_front(kv_pool *p, kv_seq *s, int upto);

/* Window pools. A model that mixes sliding-window and full layers (Gemma 3) keeps the
 * window layers' KV in a second pool of its own (same block size, same hashes), so their
 * blocks can go back while the full layers' blocks stay. The leading blocks a table of
 * n_computed tokens may drop: every later query (position n_computed or later, or one
 * position earlier for the draft's re-fed token) sees keys from n_computed - W on, so
 * blocks wholly before n_computed - W - 1 are never read again. */
static inline int kv_window_drop_upto(int n_computed, int window, int block_size) {
    return n_computed - window - 1 > 0 ? (n_computed - window - 1) / block_size : 0;
}
/* Admission in a window pool beside a main pool whose prefix lookup found n_blocks full
 * blocks of tokens: the largest m <= n_blocks such that this pool still caches blocks
 * [kv_window_drop_upto(m * bs), m) of the same prefix (the earlier ones are not needed),
 * as tokens (m * bs); *n_evictable (may be NULL) counts those that are free (ref 0).
 * No side effects; 0 when caching is off. */
int kv_prefix_lookup_window(const kv_pool *p, const int32_t *tokens, int n_blocks, int window,
                            int *n_evictable);
/* Take what kv_prefix_lookup_window found for n_tokens (a multiple of block_size) into an
 * empty table: entries before the drop point are the null block (n_dropped), the rest the
 * cached blocks (ref++); the table is committed up to n_tokens. Returns n_tokens, or
 * SPECD_ESTATE (table not empty) / SPECD_EINVAL (a block is no longer cached: call it
 * right after the lookup; the table is then released). */
int kv_seq_match_window(kv_pool *p, kv_seq *s, const int32_t *tokens, int n_tokens, int window);

/* Share src's blocks with dst (empty) for parallel sampling: the committed full blocks
 * (src->n_full_hashed; call kv_seq_commit first) by ref++; the block after them, if src
 * has one (the partial block holding tokens [n_full_hashed*bs, n_computed)), gets a fresh
 * copy target; blocks src reserved beyond that (lookahead) are not forked. If a copy is
 * needed, returns 1 and sets *copy_src and *copy_dst (the caller copies the KV bytes through
 * the runner); 0 if none; SPECD_ENOSPACE if no block for the copy (dst unchanged);
 * SPECD_ESTATE if dst is not empty; SPECD_ERANGE if dst's cap is too small. */
int kv_seq_fork(kv_pool *p, const kv_seq *src, kv_seq *dst, int32_t *copy_src, int32_t *copy_dst);

/* Invariant check for tests: ref counts equal the number of tables holding each block
 * (tables passed in), free list holds exactly the ref-0 blocks, no block lost, block 0
 * never used, every hash-table entry is a block whose stored hash recomputes from its
 * stored parent hash and tokens. Returns 0 or SPECD_ESTATE with a message
 * (SPECD_ENOMEM if its scratch allocation fails). */
int kv_check(const kv_pool *p, const kv_seq *const *tables, int n_tables, char *err, size_t errlen);

/* The block hash: 64-bit mix of the parent block's hash and the block's token ids. */
typedef uint64_t (*kv_hash_fn)(uint64_t parent, const int32_t *tokens, int n);
uint64_t kv_hash_block(uint64_t parent, const int32_t *tokens, int n);
/* Test hook: replace the hash (NULL: kv_hash_block), e.g. with a constant to force
 * collisions. Only while no hash is registered; SPECD_ESTATE otherwise. */
int kv_pool_set_hash_fn(kv_pool *p, kv_hash_fn fn);
/* Test hook: overwrite a block's ref count so tests can prove kv_check catches it. */
int kv_test_set_ref(kv_pool *p, int32_t block, int ref);

#endif
