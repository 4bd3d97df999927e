/* The tensor-parallel runner (prefix runner_tp_): rank 0's runner_ops mirrored to every
 * rank (see docs/tensor-parallel.md, "The step broadcast").
 *
 * On rank 0, runner_tp_wrap() puts a thin runner around the local one (this rank's
 * shard): every op that changes state -- forward (with its rows and tokens),
 * slot_write_blocks, slot_set_len, copy_block, decode, spec_step -- is encoded, broadcast
 * to the workers (tp_bcast over the rendezvous sockets) and then run on the local runner.
 * Results that come back to the host (logits, sampled / accepted tokens) are rank 0's;
 * the workers compute the same ones (replicated lm_head over an all-reduced residual,
 * deterministic sampling) and drop them. slot_get_len answers locally: lengths agree on
 * every rank because every change to them is mirrored.
 *
 * Workers call runner_tp_worker_run(), which receives and applies ops until rank 0 sends
 * STOP (destroying the wrapper does) or goes away.
 *
 * The CPU all-reduce: runner_tp_allreduce is the runner_config.allreduce hook, with the
 * tp_comm as its context (tp_allreduce_sum_f32 with the step timeout). On GPUs the same
 * seams take NCCL (cuda_tp_bcast, cuda_tp_all_reduce_f32).
 *
 * The wire format is the host's (little-endian x86 / arm64 on every rank). */
#ifndef SPECD_RUNNER_TP_H
#define SPECD_RUNNER_TP_H

#include <stddef.h>
#include <stdint.h>

#include "engine/core/runner.h"
#include "engine/tp/tp.h"

/* Longest time a rank waits on another inside a step (broadcast, all-reduce, the GPU
 * step's collectives): a rank that hangs fails the step after this long. 60 s unless
 * SPECD_TP_STEP_TIMEOUT_MS says otherwise (read once; at least 100). */
#define RUNNER_TP_STEP_TIMEOUT_MS tp_step_timeout_ms()

/* Rank 0: the wrapper owns `local` (destroyed with it) but not `t`. Destroying it
 * broadcasts STOP (best effort: dead workers are not waited for). NULL on error. */
runner *runner_tp_wrap(runner *local, tp_comm *t, char *err, size_t errlen);

/* Worker: apply rank 0's ops to `local` until STOP (returns 0) or an error: rank 0 gone
 * (SPECD_EIO), out of step (SPECD_EFORMAT), a failed op. err says which. */
int runner_tp_worker_run(runner *local, tp_comm *t, char *err, size_t errlen);

/* runner_config.allreduce for the CPU runner; ctx is the tp_comm. */
int runner_tp_allreduce(void *ctx, float *buf, size_t n);

/* Start-up agreement: rank 0 sends its runner_config's sizes (num_blocks, block_size,
 * max_batch, max_seq_len, max_tokens_per_step, num_draft_tokens, rope_bf16_freqs) and a
 * description of its models; a worker overwrites its own sizes with them and fails when
 * its models differ. Block ids are global, so every pool must have rank 0's num_blocks.
 * model_sig: any int32 words describing the models (layers, vocab, ...), same length on
 * every rank. */
int runner_tp_share_config(tp_comm *t, runner_config *rc, const int32_t *model_sig, int n_sig,
                           int timeout_ms, char *err, size_t errlen);

/* How a rank builds its local runner. The CPU one (NULL backend) shards the target with
 * shard_model and all-reduces over TCP; the CUDA one (runner_cuda_tp_backend, in
 * engine/cuda/cuda_runner.c) makes an NCCL communicator from the unique id rank 0 shares at the
 * rendezvous and all-reduces inside the CUDA graphs. */
typedef struct {
    const char *name;
    /* rank 0, before the rendezvous: the id every rank joins with (NULL: zeros) */
    int (*unique_id)(uint8_t uid[TP_UID_BYTES], char *err, size_t errlen);
    /* every rank, after the start-up agreement: this rank's runner. rc's sizes are rank 0's;
     * rc->num_blocks == 0 means "size from free memory", and the backend must then make
     * every rank agree on one count (block ids are global). */
    runner *(*create)(const tp_config *tp, const uint8_t uid[TP_UID_BYTES], const model *target,
                      const model *draft, const runner_config *rc, char *err, size_t errlen);
} runner_tp_backend;

/* Join the group described by `tp` and create this rank's runner: checks that the target
 * splits over tp->world_size ranks (shard_check), rendezvous, start-up agreement (rank 0's
 * sizes win), then the backend's runner on this rank's shard (NULL backend: a CPU runner
 * with the TCP all-reduce); on rank 0 wrapped by runner_tp_wrap. *comm receives the group
 * (close it after destroying the runner). On a worker, run runner_tp_worker_run(result,
 * *comm) next. */
runner *runner_tp_create(const tp_config *tp, const runner_tp_backend *be, const model *target,
                         const model *draft, runner_config *rc, tp_comm **comm, char *err, size_t errlen);

#endif
