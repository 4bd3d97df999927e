/* NCCL wrapper for tensor parallelism (see cuda_tp.h). libnccl is resolved with dlopen so
 * that only TP > 1 depends on it; nccl.h is used for types and constants only.
 *
 * The communicator is created non-blocking (ncclConfig_t.blocking = 0): init and every
 * collective may return ncclInProgress, after which we poll ncclCommGetAsyncError until
 * it settles, with a deadline. That is what lets a dead or hung peer turn into an error
 * (and an ncclCommAbort) instead of a process stuck forever in a collective. */
#include "engine/cuda/cuda_tp.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "engine/core/err.h"

_Static_assert(sizeof(ncclUniqueId) == CUDA_TP_UID_BYTES, "ncclUniqueId is 128 bytes");

/* ---- libnccl, resolved once ---------------------------------------------------------- */

static struct {
    void *lib;
    char err[256];
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*CommFinalize)(ncclComm_t);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
    const char *(*GetErrorString)(ncclResult_t);
    const char *(*GetLastError)(ncclComm_t);
    ncclResult_t (*GetVersion)(int *);
} N;
static pthread_once_t n_once = PTHREAD_ONCE_INIT;

static void nccl_load(void) {
    /* NCCL reads its environment once, at its first call: NVLink SHARP (multicast) off. */
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    /* Connect every channel at init rather than at a collective's first use, which may be
     * inside a CUDA graph capture (a user's setting wins). */
    setenv("NCCL_RUNTIME_CONNECT", "0", 0);
    const char *names[] = {getenv("SPECD_NCCL_LIB"), "libnccl.so.2", "libnccl.so"};
    for (size_t i = 0; i < 3 && !N.lib; i++)
        if (names[i] && *names[i]) N.lib = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
    if (!N.lib) {
        snprintf(N.err, sizeof N.err, "tensor parallelism needs NCCL: cannot load libnccl.so.2 (%s); "
                 "install libnccl2 or set SPECD_NCCL_LIB", dlerror());
        return;
    }
    struct { void **fn; const char *name; } syms[] = {
        {(void **)&N.GetUniqueId, "ncclGetUniqueId"},
        {(void **)&N.CommInitRankConfig, "ncclCommInitRankConfig"},
        {(void **)&N.CommGetAsyncError, "ncclCommGetAsyncError"},
        {(void **)&N.CommAbort, "ncclCommAbort"},
        {(void **)&N.CommFinalize, "ncclCommFinalize"},
        {(void **)&N.CommDestroy, "ncclCommDestroy"},
        {(void **)&N.AllReduce, "ncclAllReduce"},
        {(void **)&N.Broadcast, "ncclBroadcast"},
        {(void **)&N.AllGather, "ncclAllGather"},
        {(void **)&N.GetErrorString, "ncclGetErrorString"},
        {(void **)&N.GetLastError, "ncclGetLastError"},
        {(void **)&N.GetVersion, "ncclGetVersion"},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        if (!(*syms[i].fn = dlsym(N.lib, syms[i].name))) {
            snprintf(N.err, sizeof N.err, "libnccl lacks %s: NCCL >= 2.18 is needed", syms[i].name);
            dlclose(N.lib);
            N.lib = NULL;
            return;
        }
    }
}

static int nccl_ready(char *err, size_t errlen) {
    pthread_once(&n_once, nccl_load);
    return N.lib ? 0 : specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s", N.err);
}

/* ---- communicator -------------------------------------------------------------------- */

struct cuda_tp {
    ncclComm_t comm;
    int rank, world, device;
    atomic_int aborted;
    pthread_mutex_t abort_mu;
    char err[512];
};

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void cuda_tp_abort(cuda_tp *t) {
    if (!t) return;
    pthread_mutex_lock(&t->abort_mu);
    if (!atomic_exchange(&t->aborted, 1) && t->comm) N.CommAbort(t->comm);
    pthread_mutex_unlock(&t->abort_mu);
}

static int fail(cuda_tp *t, int code, const char *what, ncclResult_t r) {
    const char *last = t->comm && N.GetLastError ? N.GetLastError(t->comm) : "";
    snprintf(t->err, sizeof t->err, "rank %d/%d: %s: %s%s%s", t->rank, t->world, what,
             r == ncclSuccess ? "timed out" : N.GetErrorString(r), last && *last ? ": " : "",
             last ? last : "");
    cuda_tp_abort(t);
    return code;
}

/* Settle a non-blocking call: poll the async state until it leaves ncclInProgress. */
static int settle(cuda_tp *t, ncclResult_t r, const char *what, int timeout_ms) {
    int64_t deadline = now_ms() + timeout_ms;
    while (r == ncclInProgress) {
        if (atomic_load(&t->aborted)) return SPECD_ESTATE;
        if (now_ms() > deadline) return fail(t, SPECD_ETIMEOUT, what, ncclSuccess);
        ncclResult_t a = ncclInProgress;
        ncclResult_t q = N.CommGetAsyncError(t->comm, &a);
        r = q != ncclSuccess ? q : a;
        if (r == ncclInProgress) usleep(100);
    }
    return r == ncclSuccess ? 0 : fail(t, SPECD_ECUDA, what, r);
}

int cuda_tp_get_unique_id(uint8_t uid[CUDA_TP_UID_BYTES], char *err, size_t errlen) {
    int rc = nccl_ready(err, errlen);
    if (rc) return rc;
    ncclUniqueId id;
    ncclResult_t r = N.GetUniqueId(&id);
    if (r != ncclSuccess)
        return specd_errf(err, errlen, SPECD_ECUDA, "ncclGetUniqueId: %s", N.GetErrorString(r));
    memcpy(uid, id.internal, CUDA_TP_UID_BYTES);
    return 0;
}

cuda_tp *cuda_tp_create(const uint8_t uid[CUDA_TP_UID_BYTES], int rank, int world, int device,
                        int timeout_ms, char *err, size_t errlen) {
    if (nccl_ready(err, errlen)) return NULL;
    if (!uid || world < 1 || rank < 0 || rank >= world) {
        specd_errf(err, errlen, SPECD_EINVAL, "cuda_tp_create: rank %d of %d", rank, world);
        return NULL;
    }
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess) {
        specd_errf(err, errlen, SPECD_ECUDA, "rank %d: cudaSetDevice(%d): %s", rank, device,
                   cudaGetErrorString(ce));
        return NULL;
    }
    cuda_tp *t = calloc(1, sizeof *t);
    if (!t) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    t->rank = rank;
    t->world = world;
    t->device = device;
    pthread_mutex_init(&t->abort_mu, NULL);
    ncclUniqueId id;
    memcpy(id.internal, uid, CUDA_TP_UID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;   /* see the top of this file */
    ncclResult_t r = N.CommInitRankConfig(&t->comm, world, id, rank, &cfg);
    int rc = t->comm ? settle(t, r, "ncclCommInitRank", timeout_ms > 0 ? timeout_ms : 300000)
                     : fail(t, SPECD_ECUDA, "ncclCommInitRank", r == ncclSuccess ? ncclInternalError : r);
    if (rc) {
        specd_errf(err, errlen, rc, "%s", t->err);
        cuda_tp_destroy(t);
        return NULL;
    }
    return t;
}

int cuda_tp_rank(const cuda_tp *t) { return t->rank; }
int cuda_tp_world(const cuda_tp *t) { return t->world; }
const char *cuda_tp_error(const cuda_tp *t) { return t ? t->err : ""; }

/* Enqueue timeouts are short: enqueueing does not wait for peers, only for NCCL's own
 * proxy setup on a first use. */
#define ENQUEUE_TIMEOUT_MS 60000

static int all_reduce(cuda_tp *t, void *buf, size_t count, ncclDataType_t dt, ncclRedOp_t op, void *stream) {
    if (!t || (!buf && count)) return SPECD_EINVAL;
    if (atomic_load(&t->aborted)) return SPECD_ESTATE;
    ncclResult_t r = N.AllReduce(buf, buf, count, dt, op, t->comm, (cudaStream_t)stream);
    return settle(t, r, "ncclAllReduce", ENQUEUE_TIMEOUT_MS);
}

int cuda_tp_all_reduce_bf16(cuda_tp *t, void *buf, size_t count, void *stream) {
    return all_reduce(t, buf, count, ncclBfloat16, ncclSum, stream);
}

int cuda_tp_all_reduce_f32(cuda_tp *t, void *buf, size_t count, void *stream) {
    return all_reduce(t, buf, count, ncclFloat32, ncclSum, stream);
}

int cuda_tp_all_reduce_min_i32(cuda_tp *t, void *buf, size_t count, void *stream) {
    return all_reduce(t, buf, count, ncclInt32, ncclMin, stream);
}

int cuda_tp_all_gather_f32(cuda_tp *t, const void *send, void *recv, size_t count, void *stream) {
    if (!t || ((!send || !recv) && count)) return SPECD_EINVAL;
    if (atomic_load(&t->aborted)) return SPECD_ESTATE;
    ncclResult_t r = N.AllGather(send, recv, count, ncclFloat32, t->comm, (cudaStream_t)stream);
    return settle(t, r, "ncclAllGather", ENQUEUE_TIMEOUT_MS);
}

int cuda_tp_bcast(cuda_tp *t, void *buf, size_t bytes, int root, void *stream) {
    if (!t || (!buf && bytes) || root < 0 || root >= t->world) return SPECD_EINVAL;
    if (atomic_load(&t->aborted)) return SPECD_ESTATE;
    ncclResult_t r = N.Broadcast(buf, buf, bytes, ncclUint8, root, t->comm, (cudaStream_t)stream);
    return settle(t, r, "ncclBroadcast", ENQUEUE_TIMEOUT_MS);
}

int cuda_tp_check(cuda_tp *t) {
    if (!t) return SPECD_EINVAL;
    if (atomic_load(&t->aborted)) return SPECD_ESTATE;
    ncclResult_t a = ncclSuccess, q = N.CommGetAsyncError(t->comm, &a);
    ncclResult_t r = q != ncclSuccess ? q : a;
    if (r == ncclSuccess || r == ncclInProgress) return 0;
    return fail(t, SPECD_ECUDA, "asynchronous NCCL error (a peer rank failed?)", r);
}

int cuda_tp_wait(cuda_tp *t, void *stream, int timeout_ms) {
    if (!t) return SPECD_EINVAL;
    int64_t start = now_ms(), deadline = start + (timeout_ms > 0 ? timeout_ms : 60000), last_check = start;
    for (;;) {
        cudaError_t ce = cudaStreamQuery((cudaStream_t)stream);
        if (ce == cudaSuccess) return cuda_tp_check(t);
        if (ce != cudaErrorNotReady) {
            snprintf(t->err, sizeof t->err, "rank %d/%d: stream: %s", t->rank, t->world, cudaGetErrorString(ce));
            cuda_tp_abort(t);
            return SPECD_ECUDA;
        }
        /* A decode step takes milliseconds: spin (yielding) for the first 20 ms so the
         * step's end is seen at once, then sleep between polls; look at NCCL's async error
         * state once a millisecond. */
        int64_t now = now_ms();
        if (now != last_check) {
            last_check = now;
            int rc = cuda_tp_check(t);
            if (rc) return rc;
            if (now > deadline) return fail(t, SPECD_ETIMEOUT, "step did not finish (a peer rank hung?)", ncclSuccess);
        }
        if (now - start < 20) sched_yield();
        else usleep(100);
    }
}

void cuda_tp_destroy(cuda_tp *t) {
    if (!t) return;
    if (t->comm) {
        if (!atomic_load(&t->aborted)) {
            /* Finalize flushes outstanding work; bounded, then destroy. */
            ncclResult_t r = N.CommFinalize(t->comm);
            if (settle(t, r, "ncclCommFinalize", 10000) == 0) N.CommDestroy(t->comm);
        }
        /* an aborted communicator's resources are already released by ncclCommAbort */
    }
    pthread_mutex_destroy(&t->abort_mu);
    free(t);
}
