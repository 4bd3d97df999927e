/* Two-GPU smoke test of engine/cuda_tp.c over engine/tp.c's rendezvous (fork, one process
 * per GPU): eager bf16 and f32 all-reduce sums, an all-reduce captured in a CUDA graph and
 * replayed 3 times, a broadcast, and a dead peer turning cuda_tp_wait into an error within
 * its deadline. Prints one line per check; exit 0 when all pass.
 * Build (repo root): cc -std=c11 -D_GNU_SOURCE -O2 -pthread -I. -I$CUDA/include
 *   -DSPECD_HAVE_CUDA=1 tests/gpu/tp_nccl_smoke.c engine/tp.c engine/cuda_tp.c engine/err.c
 *   -L$CUDA/lib64 -lcudart_static -ldl -lrt -o build/gpu/tp_nccl_smoke */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/cuda_tp.h"
#include "engine/err.h"
#include "engine/tp.h"

#define N 4096
static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }
static float fb(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static long long ms(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000LL + t.tv_nsec / 1000000; }
#define CK(x) do { cudaError_t e_ = (x); if (e_) { fprintf(stderr, "rank %d: %s: %s\n", rank, #x, cudaGetErrorString(e_)); return 90; } } while (0)

static int run(int rank, int port, int die) {
    tp_config c = {.world_size = 2, .nnodes = 1, .rank = rank, .local_rank = rank, .master_port = port, .timeout_ms = 60000};
    snprintf(c.master_addr, sizeof c.master_addr, "127.0.0.1");
    uint8_t uid[TP_UID_BYTES] = {0};
    char err[512];
    if (rank == 0 && cuda_tp_get_unique_id(uid, err, sizeof err)) { fprintf(stderr, "uid: %s\n", err); return 10; }
    tp_comm *comm = tp_rendezvous(&c, uid, err, sizeof err);
    if (!comm) { fprintf(stderr, "rank %d rendezvous: %s\n", rank, err); return 11; }
    long long t0 = ms();
    cuda_tp *t = cuda_tp_create(uid, rank, 2, rank, 60000, err, sizeof err);
    if (!t) { fprintf(stderr, "rank %d create: %s\n", rank, err); return 12; }
    printf("rank %d: communicator up in %lld ms (NCCL_NVLS_ENABLE=%s)\n", rank, ms() - t0, getenv("NCCL_NVLS_ENABLE"));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    uint16_t *h = malloc(N * 2), *d;
    float *hf = malloc(N * 4), *df;
    CK(cudaMalloc((void **)&d, N * 2));
    CK(cudaMalloc((void **)&df, N * 4));
    for (int i = 0; i < N; i++) h[i] = bf((float)((rank + 1) * (i % 7)));
    CK(cudaMemcpy(d, h, N * 2, cudaMemcpyHostToDevice));
    if (cuda_tp_all_reduce_bf16(t, d, N, s) || cuda_tp_wait(t, s, 10000)) { fprintf(stderr, "%s\n", cuda_tp_error(t)); return 13; }
    CK(cudaMemcpy(h, d, N * 2, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++) if (fb(h[i]) != 3.0f * (i % 7)) { fprintf(stderr, "rank %d bf16 sum [%d]=%g\n", rank, i, fb(h[i])); return 14; }
    printf("rank %d: eager bf16 all-reduce ok\n", rank);
    for (int i = 0; i < N; i++) hf[i] = (float)(rank + 1) * 0.5f * (float)i;
    CK(cudaMemcpy(df, hf, N * 4, cudaMemcpyHostToDevice));
    if (cuda_tp_all_reduce_f32(t, df, N, s) || cuda_tp_wait(t, s, 10000)) { fprintf(stderr, "%s\n", cuda_tp_error(t)); return 15; }
    CK(cudaMemcpy(hf, df, N * 4, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++) if (hf[i] != 1.5f * (float)i) { fprintf(stderr, "rank %d f32 sum [%d]=%g\n", rank, i, hf[i]); return 16; }
    printf("rank %d: eager f32 all-reduce ok\n", rank);
    /* captured */
    for (int i = 0; i < N; i++) h[i] = bf((float)((rank + 1) * (i % 7)));
    CK(cudaMemcpy(d, h, N * 2, cudaMemcpyHostToDevice));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    int rc = cuda_tp_all_reduce_bf16(t, d, N, s);
    CK(cudaStreamEndCapture(s, &g));
    if (rc) { fprintf(stderr, "capture: %s\n", cuda_tp_error(t)); return 17; }
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int k = 0; k < 3; k++) CK(cudaGraphLaunch(ge, s));
    if (cuda_tp_wait(t, s, 10000)) { fprintf(stderr, "%s\n", cuda_tp_error(t)); return 18; }
    CK(cudaMemcpy(h, d, N * 2, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++) if (fb(h[i]) != 12.0f * (i % 7)) { fprintf(stderr, "rank %d graph sum [%d]=%g\n", rank, i, fb(h[i])); return 19; }
    printf("rank %d: graph-captured all-reduce x3 ok\n", rank);
    /* broadcast */
    uint8_t *hb = malloc(256), *db;
    for (int i = 0; i < 256; i++) hb[i] = rank == 0 ? (uint8_t)i : 0;
    CK(cudaMalloc((void **)&db, 256));
    CK(cudaMemcpy(db, hb, 256, cudaMemcpyHostToDevice));
    if (cuda_tp_bcast(t, db, 256, 0, s) || cuda_tp_wait(t, s, 10000)) { fprintf(stderr, "%s\n", cuda_tp_error(t)); return 20; }
    CK(cudaMemcpy(hb, db, 256, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 256; i++) if (hb[i] != (uint8_t)i) return 21;
    printf("rank %d: broadcast ok\n", rank);
    if (!die) { cuda_tp_destroy(t); tp_comm_close(comm); return 0; }
    /* rank 1 dies; rank 0's next all-reduce must fail within the deadline */
    if (rank == 1) _exit(0);
    usleep(200000);
    t0 = ms();
    rc = cuda_tp_all_reduce_bf16(t, d, N, s);
    if (!rc) rc = cuda_tp_wait(t, s, 5000);
    printf("rank 0: all-reduce with a dead peer -> %s after %lld ms: %s\n", specd_strerror(rc), ms() - t0, cuda_tp_error(t));
    cuda_tp_destroy(t);
    return rc ? 0 : 22;
}

int main(int argc, char **argv) {
    int die = argc > 1 && !strcmp(argv[1], "die");
    int port = 29700 + (int)(getpid() % 500);
    pid_t p = fork();
    if (p == 0) _exit(run(1, port, die));
    int r0 = run(0, port, die), st = 0;
    waitpid(p, &st, 0);
    printf("tp_nccl_smoke %s: rank0 rc %d, rank1 status %d -> %s\n", die ? "die" : "basic", r0, WEXITSTATUS(st),
           !r0 && !WEXITSTATUS(st) ? "PASS" : "FAIL");
    return r0 || WEXITSTATUS(st);
}
