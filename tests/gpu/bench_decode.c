/* Benchmarks of the CUDA runner on random bf16 weights of real shapes (filled on the
 * device: no host weights), one JSON line per measurement on stdout:
 *   - device copy bandwidth (cudaMemcpy D2D, bytes read + written / time), measured here;
 *   - batch-1 decode (captured graph, on-device greedy) with a 512-token context: ms per
 *     token and the fraction of the bandwidth roofline = (weight bytes read per token /
 *     copy bandwidth) / measured time;
 *   - decode tokens/s at batch 1, 8, 32, 64, 128, 256 with 512-token contexts;
 *   - prefill tokens/s for one 4096-token prompt.
 * Usage: bench_decode [shape ...]   (default llama-3.1-8b llama-3.2-1b) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/cuda/cuda_runner.h"
#include "engine/model/model.h"
#include "tests/gpu/gpu_util.h"

#define BS 16
#define CTX 512
#define SWEEP_BLOCKS 40        /* per slot in the sweep: 640 tokens */
#define PREFILL 4096

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double copy_bandwidth(void) {
    size_t bytes = (size_t)2 << 30;
    void *a = gu_dev(bytes), *b = gu_dev(bytes);
    cudaEvent_t e0, e1;
    GPU_CHECK(cudaEventCreate(&e0));
    GPU_CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) GPU_CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    GPU_CHECK(cudaEventRecord(e0, 0));
    for (int i = 0; i < 20; i++) GPU_CHECK(cudaMemcpyAsync(i & 1 ? a : b, i & 1 ? b : a, bytes, cudaMemcpyDeviceToDevice, 0));
    GPU_CHECK(cudaEventRecord(e1, 0));
    GPU_CHECK(cudaEventSynchronize(e1));
    float ms;
    GPU_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes * 20 / (ms * 1e-3);
}

static int set_slot(runner *r, int slot, int first_block, int n) {
    int32_t b[512];
    for (int i = 0; i < n; i++) b[i] = first_block + i;
    int rc = r->ops->slot_write_blocks(r, slot, 0, b, n);
    return rc ? rc : r->ops->slot_set_len(r, slot, RUNNER_TARGET, 0);
}

/* Prefill slots [0, n) with CTX random tokens each, 8 rows per forward. */
static int prefill_slots(runner *r, int n, uint64_t *rng, int vocab, float *logits) {
    int32_t *tok = malloc(sizeof(int32_t) * 8 * CTX);
    int rc = 0;
    for (int s0 = 0; s0 < n && !rc; s0 += 8) {
        runner_row rows[8];
        int nr = n - s0 < 8 ? n - s0 : 8;
        for (int i = 0; i < nr; i++) {
            rows[i] = (runner_row){.slot = s0 + i, .n_new = CTX, .tok_off = i * CTX, .n_logits = 1, .logits_off = i};
            if ((rc = set_slot(r, s0 + i, 1 + (s0 + i) * SWEEP_BLOCKS, SWEEP_BLOCKS))) break;
        }
        for (int i = 0; i < nr * CTX; i++) tok[i] = (int32_t)(gu_next(rng) % (uint64_t)vocab);
        runner_batch b = {.which = RUNNER_TARGET, .n_rows = nr, .rows = rows, .tokens = tok,
                          .n_tokens = nr * CTX, .logits = logits};
        if (!rc) rc = runner_forward(r, &b);
    }
    free(tok);
    return rc;
}

static int decode_steps(runner *r, int n, int steps, uint64_t *rng, int vocab, double *secs) {
    int slots[256];
    int32_t in[256], out[256];
    runner_sampling sp[256];
    memset(sp, 0, sizeof sp);
    for (int i = 0; i < n; i++) {
        slots[i] = i;
        in[i] = (int32_t)(gu_next(rng) % (uint64_t)vocab);
    }
    runner_decode_batch d = {.n = n, .slots = slots, .tokens = in, .sp = sp, .out_tokens = out};
    double t0 = 0;
    for (int s = 0; s < steps + 3; s++) {
        if (s == 3) t0 = now_s();   /* 3 warm-up steps */
        int rc = r->ops->decode(r, &d);
        if (rc) return rc;
        memcpy(in, out, sizeof(int32_t) * (size_t)n);
    }
    *secs = now_s() - t0;
    return 0;
}

static int bench_shape(const char *name, double bw) {
    char err[512];
    model m;
    memset(&m, 0, sizeof m);
    if (model_shape_preset(name, &m.cfg)) { fprintf(stderr, "unknown shape %s\n", name); return 1; }
    snprintf(m.path, sizeof m.path, "random:%s", name);
    m.layers = calloc((size_t)m.cfg.n_layers, sizeof(model_layer));
    runner_config cfg = {.num_blocks = 0, .block_size = BS, .max_batch = 256,
                         .max_seq_len = PREFILL + 64, .max_tokens_per_step = PREFILL,
                         .mem_fraction = 0.9};
    cuda_runner_opts o = {.world = 1, .random_weights = 1, .seed = 42};
    double t0 = now_s();
    runner *r = runner_cuda_create_ex(&m, NULL, &cfg, &o, err, sizeof err);
    if (!r) { fprintf(stderr, "%s: %s\n", name, err); free(m.layers); return 1; }
    double t_create = now_s() - t0;
    size_t wbytes, gbytes, kvbytes, work;
    cuda_runner_memory(r, &wbytes, &gbytes, &kvbytes, &work);
    const model_config *c = &m.cfg;
    /* Bytes read per decoded token: every weight once, except that the embedding table is
     * only gathered (one row) when the lm_head is a separate matrix. */
    size_t embed = (size_t)c->vocab * c->hidden * 2;
    size_t per_tok = c->tied_embeddings ? wbytes : wbytes - embed;
    printf("{\"shape\":\"%s\",\"create_s\":%.2f,\"weights_gib\":%.3f,\"graphs_gib\":%.4f,"
           "\"kv_gib\":%.2f,\"bytes_per_token\":%zu}\n", name, t_create, wbytes / 1073741824.0,
           gbytes / 1073741824.0, kvbytes / 1073741824.0, per_tok);
    uint64_t rng = 12345;
    float *logits = malloc(sizeof(float) * (size_t)c->vocab * 8);
    int rc = prefill_slots(r, 1, &rng, c->vocab, logits);
    double secs = 0;
    if (!rc) rc = decode_steps(r, 1, 200, &rng, c->vocab, &secs);
    if (!rc) {
        double ms = secs / 200 * 1e3, floor_ms = per_tok / bw * 1e3;
        printf("{\"shape\":\"%s\",\"bench\":\"decode_b1\",\"ctx\":%d,\"ms_per_token\":%.4f,"
               "\"roofline_ms\":%.4f,\"roofline_frac\":%.3f}\n", name, CTX, ms, floor_ms, floor_ms / ms);
    }
    int sizes[6] = {1, 8, 32, 64, 128, 256};
    for (int i = 0; i < 6 && !rc; i++) {
        int b = sizes[i];
        rc = prefill_slots(r, b, &rng, c->vocab, logits);
        if (!rc) rc = decode_steps(r, b, 32, &rng, c->vocab, &secs);
        if (!rc)
            printf("{\"shape\":\"%s\",\"bench\":\"decode_tps\",\"batch\":%d,\"ctx\":%d,"
                   "\"tokens_per_s\":%.1f,\"ms_per_step\":%.3f}\n", name, b, CTX, b * 32 / secs,
                   secs / 32 * 1e3);
        fflush(stdout);
    }
    /* Prefill: one 4096-token prompt in one forward (slot 0, blocks past the sweep's). */
    int32_t *tok = malloc(sizeof(int32_t) * PREFILL);
    for (int i = 0; i < PREFILL && !rc; i++) tok[i] = (int32_t)(gu_next(&rng) % (uint64_t)c->vocab);
    double best = 1e30;
    for (int rep = 0; rep < 4 && !rc; rep++) {
        rc = set_slot(r, 0, 1 + 256 * SWEEP_BLOCKS, PREFILL / BS + 1);
        runner_row row = {.slot = 0, .n_new = PREFILL, .tok_off = 0, .n_logits = 1};
        runner_batch bb = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = tok,
                           .n_tokens = PREFILL, .logits = logits};
        double t1 = now_s();
        if (!rc) rc = runner_forward(r, &bb);
        double dt = now_s() - t1;
        if (rep > 0 && dt < best) best = dt;   /* first run is warm-up */
    }
    if (!rc)
        printf("{\"shape\":\"%s\",\"bench\":\"prefill\",\"tokens\":%d,\"tokens_per_s\":%.1f,\"ms\":%.2f}\n",
               name, PREFILL, PREFILL / best, best * 1e3);
    if (rc) fprintf(stderr, "%s: error %d: %s\n", name, rc, cuda_runner_error(r));
    free(tok);
    free(logits);
    runner_destroy(r);
    free(m.layers);
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("bench_decode: skipped (no GPU)\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    GPU_CHECK(cudaGetDeviceProperties(&prop, 0));
    double bw = copy_bandwidth();
    printf("{\"device\":\"%s\",\"sms\":%d,\"copy_bw_gbs\":%.1f}\n", prop.name, prop.multiProcessorCount, bw / 1e9);
    fflush(stdout);
    const char *def[] = {"llama-3.1-8b", "llama-3.2-1b"};
    int n = argc > 1 ? argc - 1 : 2, fail = 0;
    for (int i = 0; i < n; i++) fail |= bench_shape(argc > 1 ? argv[i + 1] : def[i], bw);
    return fail;
}
