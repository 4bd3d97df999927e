/* NCCL for tensor parallelism (prefix cuda_tp_): one communicator per process (one rank
 * per GPU), the in-place bf16 sum all-reduce the row-parallel projections need (enqueued
 * on the caller's stream, so it can be captured inside a CUDA graph), a broadcast from a
 * root (the step's inputs), and failure handling that never hangs: the communicator is
 * non-blocking, every wait polls ncclCommGetAsyncError with a deadline, and a failure or
 * timeout calls ncclCommAbort (which also releases the peers' collectives with an error).
 *
 * libnccl is opened with dlopen at the first call ($SPECD_NCCL_LIB, else libnccl.so.2,
 * else libnccl.so), so builds and TP-1 runs never need it; only TP > 1 does, and its
 * absence is a clear error. NCCL_NVLS_ENABLE=0 is set before NCCL reads its environment.
 *
 * This header needs no CUDA header: streams are passed as void * (cudaStream_t).
 * Built only with SPECD_HAVE_CUDA (engine/cuda_*.c). Errors: SPECD_ECUDA (NCCL / CUDA
 * failure), SPECD_ETIMEOUT (deadline passed: the communicator is aborted), SPECD_EUNSUPPORTED
 * (no libnccl), SPECD_ESTATE (already aborted); cuda_tp_error() says what happened.
 *
 * Threading: one engine thread issues collectives; cuda_tp_abort may be called from any
 * thread (the tp watchdog) and makes every later call fail fast. */
#ifndef SPECD_CUDA_TP_H
#define SPECD_CUDA_TP_H

#include <stddef.h>
#include <stdint.h>

#define CUDA_TP_UID_BYTES 128   /* == TP_UID_BYTES (engine/tp/tp.h) == sizeof(ncclUniqueId) */

typedef struct cuda_tp cuda_tp;

/* Rank 0: a fresh unique id to hand to every rank (tp_rendezvous). */
int cuda_tp_get_unique_id(uint8_t uid[CUDA_TP_UID_BYTES], char *err, size_t errlen);

/* Join the communicator on `device` (cudaSetDevice first). Waits at most timeout_ms for
 * all ranks (then aborts and returns NULL with SPECD_ETIMEOUT's message). */
cuda_tp *cuda_tp_create(const uint8_t uid[CUDA_TP_UID_BYTES], int rank, int world, int device,
                        int timeout_ms, char *err, size_t errlen);
int cuda_tp_rank(const cuda_tp *t);
int cuda_tp_world(const cuda_tp *t);

/* In-place sum over ranks of count bf16 (or f32) elements of device memory buf, enqueued
 * on stream (capturable: call it between cudaStreamBeginCapture/EndCapture and the graph
 * replays it). Returns once enqueued; completion is the stream's. */
int cuda_tp_all_reduce_bf16(cuda_tp *t, void *buf, size_t count, void *stream);
int cuda_tp_all_reduce_f32(cuda_tp *t, void *buf, size_t count, void *stream);
/* In-place minimum over ranks of count int32 (start-up agreements, e.g. the KV pool size). */
int cuda_tp_all_reduce_min_i32(cuda_tp *t, void *buf, size_t count, void *stream);
/* recv [world][count] = every rank's send [count] in rank order (capturable). */
int cuda_tp_all_gather_f32(cuda_tp *t, const void *send, void *recv, size_t count, void *stream);
/* bytes of device memory buf from `root` to every rank, in place, on stream. */
int cuda_tp_bcast(cuda_tp *t, void *buf, size_t bytes, int root, void *stream);

/* Wait for stream with a deadline, polling the communicator's async error; on an error
 * or at timeout_ms, abort the communicator and return SPECD_ECUDA / SPECD_ETIMEOUT. Use it
 * instead of cudaStreamSynchronize after a step that contains collectives. */
int cuda_tp_wait(cuda_tp *t, void *stream, int timeout_ms);
/* Poll once: 0 healthy, SPECD_ECUDA after an asynchronous NCCL error (the peer died). */
int cuda_tp_check(cuda_tp *t);
/* Abort (idempotent, any thread): pending and later collectives fail. */
void cuda_tp_abort(cuda_tp *t);
const char *cuda_tp_error(const cuda_tp *t);
/* Finalize and destroy (abort if the communicator failed). */
void cuda_tp_destroy(cuda_tp *t);

#endif
