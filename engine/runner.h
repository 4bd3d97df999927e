/* The runner seam (prefix runner_): everything between "these rows feed these tokens"
 * and logits. The scheduler and block manager never see how compute is done; a runner
 * never sees requests. Two implementations: the CPU reference (runner_cpu.c, fp32) and
 * the CUDA runner (cuda_runner.c, bf16 + cuBLAS + CUDA graphs).
 *
 * KV: a runner owns the storage of ONE paged pool of `num_blocks` blocks of
 * `block_size` tokens for n_layers(target) + n_layers(draft) layers; draft layer i is
 * pool layer L_target + i. Block 0 is the null block: never handed to a request,
 * padding rows write there.
 *
 * Slots: a table of max_batch + 1 rows; row max_batch is the dummy slot. Each row holds a
 * block table (max_blocks_per_seq entries, unused entries = 0) and a context length per
 * model (target, draft). The host writes a row when a request enters or leaves it (and
 * appends block ids as the request grows); forward() reads positions from the lengths
 * and advances them by the tokens it fed. Rollback after speculation is set_len.
 *
 * Threading: a runner is driven by one thread at a time. */
#ifndef SPECD_RUNNER_H
#define SPECD_RUNNER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"

enum { RUNNER_TARGET = 0, RUNNER_DRAFT = 1 };

typedef struct {
    int num_blocks;          /* including the null block 0 */
    int block_size;          /* tokens per block */
    int max_batch;           /* live slots; the dummy slot is one more */
    int max_seq_len;         /* max_blocks_per_seq = ceil(max_seq_len / block_size) */
    int max_tokens_per_step; /* upper bound of runner_batch.n_tokens */
    int threads;             /* CPU runner: worker threads (0 = number of cores) */
    int device;              /* CUDA runner: device ordinal */
} runner_config;

typedef struct {
    int slot;                /* row of the slot table (0..max_batch; max_batch = dummy) */
    int n_new;               /* tokens this row feeds, at positions len .. len+n_new-1 */
    int tok_off;             /* index of its first token in runner_batch.tokens */
    int n_logits;            /* 0: none, 1: last position only, n_new: every position */
    int logits_off;          /* its first row in runner_batch.logits */
} runner_row;

typedef struct {
    int which;               /* RUNNER_TARGET or RUNNER_DRAFT */
    int n_rows;
    const runner_row *rows;
    const int32_t *tokens;   /* [n_tokens] */
    int n_tokens;
    float *logits;           /* [sum of n_logits, vocab], fp32, host memory */
} runner_batch;

typedef struct runner runner;

typedef struct {
    const char *name;
    /* Run one forward pass of `which` over all rows: write K/V of every fed token into
     * the pool through the slot's block table, attend causally over the slot's context,
     * write requested logits, then advance each row's length by n_new. */
    int (*forward)(runner *r, const runner_batch *b);
    /* Write a slot's block table: entries [first, first+n) = blocks; with first == 0 the
     * rest of the row is reset to the null block. */
    int (*slot_write_blocks)(runner *r, int slot, int first, const int32_t *blocks, int n);
    int (*slot_set_len)(runner *r, int slot, int which, int len);
    int (*slot_get_len)(runner *r, int slot, int which);
    /* Copy the K/V of pool block src to dst for every layer (copy-on-write). */
    int (*copy_block)(runner *r, int dst, int src);
    /* Bytes one KV block takes for all layers (for sizing before creation, see
     * runner_*_block_bytes). */
    void (*destroy)(runner *r);
} runner_ops;

struct runner {
    const runner_ops *ops;
    runner_config cfg;
    const model *target;
    const model *draft;      /* NULL without speculation */
    int vocab;
};

static inline int runner_forward(runner *r, const runner_batch *b) { return r->ops->forward(r, b); }
static inline void runner_destroy(runner *r) { if (r) r->ops->destroy(r); }

/* CPU reference runner. Converts all weights to fp32 at creation. */
runner *runner_cpu_create(const model *target, const model *draft, const runner_config *cfg,
                          char *err, size_t errlen);
/* Bytes of one KV block (all target + draft layers) in the CPU runner's storage. */
size_t runner_cpu_block_bytes(const model *target, const model *draft, int block_size);

#endif
