/* Decode GEMV over GGUF-quantized weights read in place (issue #17; work in progress: the
 * CUDA runner does not call it yet). Y[t, o] (+)= sum_k W[o, k] X[t, k] for t < n <= 8:
 * W's row o is in / qb_elems(type) blocks of qb_bytes(type) bytes (kernels/quant_blocks.h:
 * Q8_0, Q4_K, Q6_K), X [n, in] bf16, Y [n, out] fp32. One warp per output row; lane c
 * takes the row's 8-element chunks c, c + 32, ..., decodes each (qb_decode8, the same
 * code the host test checks against ggml_dequantize) and dots it with every token's 8
 * activations; a warp sum, then lane t writes token t. First form: written for
 * correctness, its loads are bytes (not yet the 16-byte streams of gemv.cu). */
#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/quant_blocks.h"

#define GEMVQ_WARPS 8

__device__ __forceinline__ void gemvq_unpack8(uint4 v, float (&f)[8]) {
    const uint32_t a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(a[i] << 16);
        f[2 * i + 1] = __uint_as_float(a[i] & 0xffff0000u);
    }
}

template <int NB, int T>
__global__ void __launch_bounds__(GEMVQ_WARPS * 32)
gemv_q_kernel(const uint8_t *__restrict__ W, const uint16_t *__restrict__ X, float *Y, int out, int in,
              int accumulate) {
    k_pdl_trigger();
    const int lane = threadIdx.x & 31, o = blockIdx.x * GEMVQ_WARPS + (threadIdx.x >> 5);
    const int E = qb_elems(T), S = qb_bytes(T), chunks = in / 8;
    const uint8_t *row = W + (size_t)(o < out ? o : 0) * (size_t)(in / E) * S;
    float acc[NB];
#pragma unroll
    for (int t = 0; t < NB; t++) acc[t] = 0.f;
    k_pdl_wait();
    if (o >= out) return;
    for (int c = lane; c < chunks; c += 32) {
        const int k0 = c * 8;
        float w[8];
        qb_decode8(T, row + (size_t)(k0 / E) * S, k0 % E, w);
#pragma unroll
        for (int t = 0; t < NB; t++) {
            float x[8];
            gemvq_unpack8(*(const uint4 *)(X + (size_t)t * in + k0), x);
#pragma unroll
            for (int j = 0; j < 8; j++) acc[t] = fmaf(w[j], x[j], acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < NB; t++) {
        const float v = k_warp_sum(acc[t]);
        if (lane == t) {
            float *y = Y + (size_t)t * out + o;
            *y = accumulate ? *y + v : v;
        }
    }
}

template <int T>
static int gemv_q_launch(const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
                         cudaStream_t s) {
    const dim3 grid((out + GEMVQ_WARPS - 1) / GEMVQ_WARPS), block(GEMVQ_WARPS * 32);
#define GEMVQ_CASE(N) \
    case N: return k_launch(gemv_q_kernel<N, T>, grid, block, 0, s, W, X, Y, out, in, accumulate)
    switch (n) {
        GEMVQ_CASE(1); GEMVQ_CASE(2); GEMVQ_CASE(3); GEMVQ_CASE(4);
        GEMVQ_CASE(5); GEMVQ_CASE(6); GEMVQ_CASE(7); GEMVQ_CASE(8);
    default: return -1;
    }
#undef GEMVQ_CASE
}

extern "C" int k_gemv_q(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n,
                        int accumulate, cudaStream_t s) {
    const int bytes = qb_bytes(type);
    if (!bytes || out <= 0 || in <= 0 || in % qb_elems(type) || n < 1 || n > K_GEMV_MAX_N || ((uintptr_t)X % 16))
        return -1;
    switch (type) {
    case QB_Q8_0: return gemv_q_launch<QB_Q8_0>(W, X, Y, out, in, n, accumulate, s);
    case QB_Q4_K: return gemv_q_launch<QB_Q4_K>(W, X, Y, out, in, n, accumulate, s);
    case QB_Q6_K: return gemv_q_launch<QB_Q6_K>(W, X, Y, out, in, n, accumulate, s);
    default: return -1;
    }
}

/* A quantized matrix [rows, in] to bf16 [rows, in] (for GEMMs of more tokens than the
 * GEMV takes: cuBLAS on the bf16 copy in a scratch buffer). One thread per 8 elements. */
template <int T>
__global__ void dequant_q_kernel(const uint8_t *__restrict__ W, uint16_t *out, int rows, int in) {
    k_pdl_trigger();
    const long per_row = in / 8, c = (long)blockIdx.x * blockDim.x + threadIdx.x;
    k_pdl_wait();   /* the scratch may still be read by the GEMM before */
    if (c >= (long)rows * per_row) return;
    const int r = (int)(c / per_row), k0 = (int)(c % per_row) * 8, E = qb_elems(T), S = qb_bytes(T);
    float w[8];
    qb_decode8(T, W + ((size_t)r * (in / E) + k0 / E) * S, k0 % E, w);
    uint32_t p[4];
#pragma unroll
    for (int i = 0; i < 4; i++) p[i] = (uint32_t)k_f2bf(w[2 * i]) | (uint32_t)k_f2bf(w[2 * i + 1]) << 16;
    *(uint4 *)(out + (size_t)r * in + k0) = make_uint4(p[0], p[1], p[2], p[3]);
}

extern "C" int k_dequant_q(int type, const uint8_t *W, uint16_t *out, int rows, int in, cudaStream_t s) {
    if (!qb_bytes(type) || rows <= 0 || in <= 0 || in % qb_elems(type) || ((uintptr_t)out % 16)) return -1;
    const long n = (long)rows * (in / 8);
    const dim3 grid((unsigned)((n + 255) / 256)), block(256);
    switch (type) {
    case QB_Q8_0: return k_launch(dequant_q_kernel<QB_Q8_0>, grid, block, 0, s, W, out, rows, in);
    case QB_Q4_K: return k_launch(dequant_q_kernel<QB_Q4_K>, grid, block, 0, s, W, out, rows, in);
    case QB_Q6_K: return k_launch(dequant_q_kernel<QB_Q6_K>, grid, block, 0, s, W, out, rows, in);
    default: return -1;
    }
}
