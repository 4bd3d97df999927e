/* Skinny GEMM for decode (n <= 8 rows of activations): Y[t, o] (+)= sum_k W[o, k] X[t, k],
 * W [out, in] bf16, X [n, in] bf16, Y [n, out] fp32, fp32 accumulation. At batch 1-8 a
 * decode step is a stream over every weight once, so this kernel is written for memory
 * bandwidth: one warp per output row, 16-byte weight loads marked streaming (they are
 * read once per step and must not evict the activations from L1), four loads in flight
 * per lane before any arithmetic, and the n activation rows re-read from L1. */
#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

#define GEMV_WARPS 8
#define GEMV_UNROLL 4

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    float s = 0.f;
    uint32_t wa[4] = {w.x, w.y, w.z, w.w}, xa[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s = fmaf(__uint_as_float(wa[i] << 16), __uint_as_float(xa[i] << 16), s);
        s = fmaf(__uint_as_float(wa[i] & 0xffff0000u), __uint_as_float(xa[i] & 0xffff0000u), s);
    }
    return s;
}

template <int NB>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(const uint4 *__restrict__ W, const uint4 *__restrict__ X, float *__restrict__ Y,
            int out, int in8, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= out) return;
    const uint4 *w = W + (size_t)row * in8;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; b++) acc[b] = 0.f;
    int k = lane;
    for (; k + 32 * (GEMV_UNROLL - 1) < in8; k += 32 * GEMV_UNROLL) {
        uint4 wv[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) wv[u] = __ldcs(w + k + 32 * u);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int b = 0; b < NB; b++) acc[b] += dot8(wv[u], __ldg(X + (size_t)b * in8 + k + 32 * u));
    }
    for (; k < in8; k += 32) {
        uint4 wv = __ldcs(w + k);
#pragma unroll
        for (int b = 0; b < NB; b++) acc[b] += dot8(wv, __ldg(X + (size_t)b * in8 + k));
    }
#pragma unroll
    for (int b = 0; b < NB; b++) {
        float v = k_warp_sum(acc[b]);
        if (lane == 0) {
            float *y = Y + (size_t)b * out + row;
            *y = accumulate ? *y + v : v;
        }
    }
}

extern "C" int k_gemv_bf16(const uint16_t *W, const uint16_t *X, float *Y, int out, int in,
                           int n, int accumulate, cudaStream_t s) {
    if (out <= 0 || in <= 0 || in % 8 || n < 1 || n > K_GEMV_MAX_N ||
        ((uintptr_t)W | (uintptr_t)X) % 16)
        return -1;
    dim3 grid((out + GEMV_WARPS - 1) / GEMV_WARPS), block(GEMV_WARPS * 32);
    const uint4 *w = (const uint4 *)W, *x = (const uint4 *)X;
    int in8 = in / 8;
    switch (n) {
    case 1: gemv_kernel<1><<<grid, block, 0, s>>>(w, x, Y, out, in8, accumulate); break;
    case 2: gemv_kernel<2><<<grid, block, 0, s>>>(w, x, Y, out, in8, accumulate); break;
    case 3: gemv_kernel<3><<<grid, block, 0, s>>>(w, x, Y, out, in8, accumulate); break;
    case 4: gemv_kernel<4><<<grid, block, 0, s>>>(w, x, Y, out, in8, accumulate); break;
    case 5: gemv_kernel<5><<<grid, block, 0, s>>>(w, x, Y, out, in8, accumulate); break;
    case 6: gemv_kernel<6><<<grid, block, 0, s>>>(w, x, Y, out, in8, accumulate); break;
    case 7: gemv_kernel<7><<<grid, block, 0, s>>>(w, x, Y, out, in8, accumulate); break;
    default: gemv_kernel<8><<<grid, block, 0, s>>>(w, x, Y, out, in8, accumulate); break;
    }
    return K_LAUNCH_RESULT();
}
