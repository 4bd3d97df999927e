/* Helpers shared by the GPU tests and benchmarks in tests/gpu/: bf16 bit conversions
 * that match the device (round to nearest even), a small seeded RNG, checked CUDA calls,
 * NaN poisoning, and relative error (max abs error / max abs reference). */
#ifndef SPECD_GPU_UTIL_H
#define SPECD_GPU_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#define GPU_CHECK(call)                                                                    \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                  \
                    cudaGetErrorString(e_));                                               \
            abort();                                                                       \
        }                                                                                  \
    } while (0)

static inline uint16_t gu_f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float gu_bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float gu_round_bf(float f) { return gu_bf2f(gu_f2bf(f)); }

/* splitmix64: fresh per run unless SPECD_TEST_SEED is set. */
static inline uint64_t gu_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline float gu_uniform(uint64_t *s, float lo, float hi) {
    return lo + (hi - lo) * (float)((gu_next(s) >> 40) * (1.0 / 16777216.0));
}

static inline uint64_t gu_seed(void) {
    const char *e = getenv("SPECD_TEST_SEED");
    if (e && *e) return strtoull(e, NULL, 0);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20);
}

static inline void *gu_dev(size_t bytes) {
    void *p = NULL;
    GPU_CHECK(cudaMalloc(&p, bytes ? bytes : 4));
    GPU_CHECK(cudaMemset(p, 0xff, bytes ? bytes : 4));   /* NaN for fp32 and bf16 */
    return p;
}

static inline void *gu_upload(const void *h, size_t bytes) {
    void *d = gu_dev(bytes);
    GPU_CHECK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}

static inline void gu_download(void *h, const void *d, size_t bytes) {
    GPU_CHECK(cudaDeviceSynchronize());
    GPU_CHECK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

/* max |a - ref| / max |ref|; NaN anywhere in a gives +inf. */
static inline double gu_rel_err(const float *a, const double *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        double d = fabs((double)a[i] - ref[i]);
        if (d > num) num = d;
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    return den > 0 ? num / den : num;
}

#endif
