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
    int n_full_hashed;       /* leading blocks whose hash is registered */
    uint64_t last_hash;      /* hash of block n_full_hashed-1 (chain input) */
} kv_seq;

kv_pool *kv_pool_create(const kv_pool_config *cfg, char *err, size_t errlen);
void kv_pool_destroy(kv_pool *p);

int kv_num_blocks(const kv_pool *p);     /* total including null block */
int kv_block_size(const kv_pool *p);
int kv_num_free(const kv_pool *p);       /* allocatable now (free + evictable cached) */
int kv_num_used(const kv_pool *p);       /* blocks with ref > 0 */
int kv_ref(const kv_pool *p, int32_t block);

/* Number of blocks needed to hold num_blocks for sizing: blocks = ceil(tokens / bs). */
int kv_blocks_for(const kv_pool *p, int tokens);

/* max_blocks: capacity of the table (ceil(max_seq_len / block_size)). */
int kv_seq_init(kv_seq *s, int max_blocks);
/* Release every block (ref--, freed blocks to the LRU tail, last block first) and
 * empty the table; the table's memory is kept (kv_seq_destroy frees it). */
void kv_seq_release(kv_pool *p, kv_seq *s);
void kv_seq_destroy(kv_seq *s);

/* Prefix-cache lookup for an empty table: appends the longest run of cached full blocks
 * matching tokens[0..n) (never the whole prompt: at least one token is left to compute)
 * with ref++, and returns the number of tokens covered (a multiple of block_size). */
int kv_seq_match_prefix(kv_pool *p, kv_seq *s, const int32_t *tokens, int n);

/* Make the table hold at least n_tokens tokens, allocating new blocks. All or nothing:
 * returns SPECD_ENOSPACE (table unchanged) if the pool cannot supply them, SPECD_ERANGE if
 * n_tokens exceeds the table capacity. */
int kv_seq_reserve(kv_pool *p, kv_seq *s, int n_tokens);
/* How many new blocks kv_seq_reserve(s, n_tokens) would need. */
int kv_seq_blocks_needed(const kv_pool *p, const kv_seq *s, int n_tokens);

/* Register hashes of full blocks whose KV is now computed: tokens[0..n_computed). */
void kv_seq_commit(kv_pool *p, kv_seq *s, const int32_t *tokens, int n_computed);

/* Share src's blocks with dst (empty) for parallel sampling: full blocks by ref++; a
 * partial last block gets a fresh copy target. If a copy is needed, returns 1 and sets
 * *copy_src/*copy_dst (the caller copies the KV bytes through the runner); 0 if none;
 * SPECD_ENOSPACE if no block for the copy. */
int kv_seq_fork(kv_pool *p, const kv_seq *src, kv_seq *dst, int32_t *copy_src, int32_t *copy_dst);

/* Invariant check for tests: ref counts equal the number of tables holding each block
 * (tables passed in), free list holds exactly the ref-0 blocks, no block lost, block 0
 * never used. Returns 0 or SPECD_ESTATE with a message. */
int kv_check(const kv_pool *p, const kv_seq *const *tables, int n_tables, char *err, size_t errlen);

#endif
