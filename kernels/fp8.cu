/* FP8 E4M3 helpers of the FP8 weight path (--dtype fp8, FP8 checkpoints):
 *   - k_quant_fp8_rows: per-row quantization of a bf16 matrix, the expressions of
 *     engine/model/fp8.c's fp8_quantize_row in the same order (max |x|, then 448 / max as
 *     one IEEE division, then one product and a saturating round-to-nearest-even cvt per
 *     element), so the device and the host give the same bytes. Weights at load (per
 *     output row), activations before an FP8 GEMM (per token).
 *   - k_fp8_scale_rows: the outer-product rescaling of an unscaled FP8 GEMM's output, for
 *     a cuBLASLt without per-row scale vectors.
 * The GEMVs that read FP8 weights are kernels/gemv.cu's (k_wmat). */
#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

#define QF8_THREADS 256

/* One block per row: the row's max |x| (block reduction), then its bytes, 8 per thread and
 * step (16-byte loads, 8-byte stores). */
__global__ void __launch_bounds__(QF8_THREADS)
quant_fp8_rows_kernel(const uint4 *__restrict__ X, int cols8, uint2 *__restrict__ Q, float *__restrict__ scale) {
    k_pdl_trigger();
    k_pdl_wait();
    const size_t row = blockIdx.x;
    const uint4 *x = X + row * cols8;
    float amax = 0.f;
    for (int k = threadIdx.x; k < cols8; k += QF8_THREADS) {
        float f[8];
        k_bf16x8(x[k], f);
#pragma unroll
        for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(f[e]));
    }
    __shared__ float red[QF8_THREADS / 32];
    amax = k_warp_max(amax);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.f;
#pragma unroll
    for (int w = 0; w < QF8_THREADS / 32; w++) amax = fmaxf(amax, red[w]);
    const float inv = amax > 0.f ? 448.f / amax : 1.f;
    if (threadIdx.x == 0) scale[row] = amax > 0.f ? amax / 448.f : 1.f;
    uint2 *q = Q + row * cols8;
    for (int k = threadIdx.x; k < cols8; k += QF8_THREADS) {
        float f[8];
        k_bf16x8(x[k], f);
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int e = 0; e < 8; e++) w[e >> 2] |= (uint32_t)k_f2fp8(f[e] * inv) << (8 * (e & 3));
        q[k] = make_uint2(w[0], w[1]);
    }
}

extern "C" int k_quant_fp8_rows(const uint16_t *X, int rows, int cols, uint8_t *Q, float *scale, cudaStream_t s) {
    if (rows < 0 || cols <= 0 || cols % 8 || ((uintptr_t)X % 16) || ((uintptr_t)Q % 8) || !scale) return -1;
    if (!rows) return 0;
    return k_launch(quant_fp8_rows_kernel, dim3(rows), dim3(QF8_THREADS), 0, s, (const uint4 *)X, cols / 8, (uint2 *)Q,
                    scale);
}

/* Y[t, o] = (accumulate ? Y[t, o] : 0) + sw[o] * sx[t] * T[t, o]: a block row per token
 * (blockIdx.y), four columns a thread (16-byte loads; out % 4 == 0). */
__global__ void fp8_scale_rows_kernel(const float4 *__restrict__ T, const float4 *__restrict__ sw,
                                      const float *__restrict__ sx, float4 *__restrict__ Y, int out4, int accumulate) {
    k_pdl_trigger();
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    const size_t i = (size_t)blockIdx.y * out4 + o;
    float4 w = o < out4 ? sw[o] : make_float4(0.f, 0.f, 0.f, 0.f);   /* constant: before the wait */
    k_pdl_wait();
    if (o >= out4) return;
    const float st = sx[blockIdx.y];
    const float4 t = T[i];
    float4 v = make_float4(t.x * (w.x * st), t.y * (w.y * st), t.z * (w.z * st), t.w * (w.w * st));
    if (accumulate) {
        const float4 y = Y[i];
        v.x += y.x, v.y += y.y, v.z += y.z, v.w += y.w;
    }
    Y[i] = v;
}

extern "C" int k_fp8_scale_rows(const float *T, const float *sw, const float *sx, float *Y, int n, int out,
                                int accumulate, cudaStream_t s) {
    if (n < 0 || out <= 0 || out % 4 || n > 65535 || (((uintptr_t)T | (uintptr_t)sw | (uintptr_t)Y) % 16)) return -1;
    if (!n) return 0;
    const int out4 = out / 4;
    return k_launch(fp8_scale_rows_kernel, dim3((out4 + 255) / 256, n), dim3(256), 0, s, (const float4 *)T,
                    (const float4 *)sw, sx, (float4 *)Y, out4, accumulate);
}
