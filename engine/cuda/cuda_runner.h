/* CUDA runner extras (prefix cuda_runner_): options beyond runner_config and hooks for
 * GPU tests and benchmarks. The runner itself is created through runner_cuda_create
 * (engine/core/runner.h); runner_cuda_create_ex takes these options.
 *
 * Only compiled when nvcc exists (SPECD_HAVE_CUDA). */
#ifndef SPECD_CUDA_RUNNER_H
#define SPECD_CUDA_RUNNER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/core/runner.h"
#include "engine/tp/runner_tp.h"

struct cuda_tp;

typedef struct {
    int rank, world;          /* tensor-parallel position (the target's shard) */
    struct cuda_tp *tp;       /* world > 1: the NCCL communicator (engine/cuda/cuda_tp.h); the
                                 runner owns it from here on, also when creation fails */
    int random_weights;       /* fill weights on the device from `seed` (benchmarks of
                                 real shapes without host weights; views are ignored) */
    uint64_t seed;
    int no_graphs;            /* decode runs eagerly (tests compare both paths) */
    int quiet;                /* no start-up summary on stderr */
} cuda_runner_opts;

runner *runner_cuda_create_ex(const model *target, const model *draft, const runner_config *cfg,
                              const cuda_runner_opts *opts, char *err, size_t errlen);

/* Tensor parallelism on CUDA (runner_tp_create's backend): rank 0 makes the NCCL unique
 * id, every rank joins the communicator on GPU tp->local_rank and builds a runner on its
 * shard of the target (draft replicated) whose graphs hold the all-reduces; ranks agree
 * on the smallest KV pool any of them can hold. */
extern const runner_tp_backend runner_cuda_tp_backend;

/* Bytes of one KV block (all target + draft layers) in the CUDA runner's storage (bf16, or
 * one byte per element with kv_fp8). */
size_t runner_cuda_block_bytes(const model *target, const model *draft, int block_size, int kv_fp8);

/* Test hooks. */
size_t cuda_runner_block_bytes(runner *r);
/* Copy pool block `block` (all layers, bf16) into host memory of block_bytes. */
int cuda_runner_read_block(runner *r, int block, void *host);
/* A slot length as the device holds it (slot_get_len answers from the host's mirror,
 * which every op keeps equal to it): tests compare the two. */
int cuda_runner_device_len(runner *r, int slot, int which);
/* Overwrite pool block `block` with host bytes (block_bytes). */
int cuda_runner_write_block(runner *r, int block, const void *host);
/* Captured decode batch sizes, largest first; returns how many (<= max). */
int cuda_runner_graph_sizes(runner *r, int *sizes, int max);
/* Last CUDA error text ("" when none); the runner is failed once this is set. */
const char *cuda_runner_error(runner *r);
/* Bytes measured for: weights, graphs, KV pool, workspace. */
void cuda_runner_memory(runner *r, size_t *weights, size_t *graphs, size_t *kv, size_t *work);

#endif
