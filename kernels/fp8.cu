/* FP8 E4M3 helpers of the FP8 weight path (--dtype fp8, FP8 checkpoints):
 *   - k_quant_fp8_rows: per-row quantization of a bf16 matrix, the expressions of
 *     engine/model/fp8.c's fp8_quantize_row in the same order (max |x|, then 448 / max as
 *     one IEEE division, then one product and a saturating round-to-nearest-even cvt per
 *     element), so the device and the host give the same bytes. Weights at load (per
 *     output row), activations before an FP8 GEMM (per token).
 *   - k_fp8_scale_rows: the outer-product rescaling of an unscaled FP8 GEMM's output, for
 *     a cuBLASLt without per-row scale vectors.
 *   - k_rmsnorm_fp8 / k_gated_mul_fp8q: the producers of an FP8 GEMM's activations that
 *     quantize as they write (and take the scales of the unscaled GEMM before them), so
 *     neither a quantize nor a rescale launch runs between the GEMMs of a layer; the bytes
 *     and scales equal the separate kernels' (k_fp8_scale_rows, k_rmsnorm,
 *     k_gated_mul_fp8, then k_quant_fp8_rows).
 * The GEMVs that read FP8 weights are kernels/gemv.cu's (k_wmat). */
#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

#define QF8_THREADS 256

/* The row's E4M3 scale and its multiplier from max |x| (fp8_quantize_row's expressions). */
__device__ __forceinline__ float qf8_inv(float amax) { return amax > 0.f ? 448.f / amax : 1.f; }
__device__ __forceinline__ float qf8_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

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
    __shared__ float red[32];
    amax = k_block_max(amax, red);   /* (a max: the same in any order) */
    const float inv = qf8_inv(amax);
    if (threadIdx.x == 0) scale[row] = qf8_scale(amax);
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
    float4 v;
    if (accumulate) {   /* one fused multiply-add each, spelled out (k_rmsnorm_fp8 adds the same way) */
        const float4 y = Y[i];
        v = make_float4(fmaf(t.x, w.x * st, y.x), fmaf(t.y, w.y * st, y.y), fmaf(t.z, w.z * st, y.z),
                        fmaf(t.w, w.w * st, y.w));
    } else {
        v = make_float4(t.x * (w.x * st), t.y * (w.y * st), t.z * (w.z * st), t.w * (w.w * st));
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

/* One block per row (k_rmsnorm's block size for the width): with T, first resid[row] =
 * fma(T[row], sw * sx[row], resid[row]) (k_fp8_scale_rows' arithmetic: the residual add of
 * an unscaled FP8 GEMM, the fma written out in both so the compiler's contraction cannot
 * differ); then v = bf16(resid * rsqrt(mean(resid^2) + eps) * w) (k_rmsnorm's, the same
 * block reduction), and v to E4M3 over the row's max as k_quant_fp8_rows does. sx may be
 * scale: the row's token scale is read before the row's new one is written. */
__global__ void rmsnorm_fp8_kernel(const float4 *__restrict__ T, const float4 *__restrict__ sw, const float *sx,
                                   float4 *resid, const float4 *__restrict__ w, int h4, float eps, uint32_t *Q,
                                   float *scale) {
    __shared__ float red[32];
    k_pdl_trigger();
    k_pdl_wait();
    const size_t row = blockIdx.x;
    float4 *x = resid + row * h4;
    if (T) {
        const float st = sx[row];
        const float4 *tr = T + row * h4;
        for (int j = threadIdx.x; j < h4; j += blockDim.x) {
            const float4 t = tr[j], g = sw[j], y = x[j];
            x[j] = make_float4(fmaf(t.x, g.x * st, y.x), fmaf(t.y, g.y * st, y.y), fmaf(t.z, g.z * st, y.z),
                               fmaf(t.w, g.w * st, y.w));   /* read back below by this thread only */
        }
    }
    float ss = 0.f;
    for (int j = threadIdx.x; j < h4; j += blockDim.x) {
        const float4 v = x[j];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = k_block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)(4 * h4) + eps);
    auto normed = [&](int j, float (&f)[4]) {
        const float4 v = x[j], g = w[j];
        f[0] = k_bf2f(k_f2bf(v.x * inv * g.x)), f[1] = k_bf2f(k_f2bf(v.y * inv * g.y));
        f[2] = k_bf2f(k_f2bf(v.z * inv * g.z)), f[3] = k_bf2f(k_f2bf(v.w * inv * g.w));
    };
    float amax = 0.f;
    for (int j = threadIdx.x; j < h4; j += blockDim.x) {
        float f[4];
        normed(j, f);
#pragma unroll
        for (int e = 0; e < 4; e++) amax = fmaxf(amax, fabsf(f[e]));
    }
    amax = k_block_max(amax, red);
    const float q8 = qf8_inv(amax);
    for (int j = threadIdx.x; j < h4; j += blockDim.x) {
        float f[4];
        normed(j, f);
        uint32_t c = 0u;
#pragma unroll
        for (int e = 0; e < 4; e++) c |= (uint32_t)k_f2fp8(f[e] * q8) << (8 * e);
        Q[row * h4 + j] = c;
    }
    if (threadIdx.x == 0) scale[row] = qf8_scale(amax);
}

extern "C" int k_rmsnorm_fp8(const float *T, const float *sw, const float *sx, float *resid, const float *w, int n,
                             int hidden, float eps, uint8_t *Q, float *scale, cudaStream_t s) {
    if (n < 0 || hidden <= 0 || hidden % 4 || !Q || !scale || (T && (!sw || !sx)) ||
        (((uintptr_t)T | (uintptr_t)sw | (uintptr_t)resid | (uintptr_t)w) % 16) || (uintptr_t)Q % 4)
        return -1;
    if (!n) return 0;
    const int nt = hidden >= 4096 ? 1024 : hidden >= 2048 ? 512 : 256;   /* k_rmsnorm's */
    return k_launch(rmsnorm_fp8_kernel, dim3(n), dim3(nt), 0, s, (const float4 *)T, (const float4 *)sw, sx,
                    (float4 *)resid, (const float4 *)w, hidden / 4, eps, (uint32_t *)Q, scale);
}

/* One block per token row t: act[j] = bf16(act(g) * u) for g = gu[t, j] * (sw[j] * sx[t]),
 * u = gu[t, ffn + j] * (sw[ffn + j] * sx[t]) (k_gated_mul_fp8's products), kept in shared
 * memory, then to E4M3 over the row's max (k_quant_fp8_rows). sx may be scale, as above. */
template <bool GELU>
__global__ void gated_fp8_kernel(const float *__restrict__ gu, const float *__restrict__ sw, const float *sx, int ffn,
                                 uint8_t *Q, float *scale) {
    extern __shared__ uint16_t act[];
    __shared__ float red[32];
    k_pdl_trigger();
    k_pdl_wait();
    const size_t t = blockIdx.x;
    const float st = sx[t];
    const float *row = gu + t * 2 * ffn;
    float amax = 0.f;
    for (int j = threadIdx.x; j < ffn; j += blockDim.x) {
        float s1 = sw[j], s2 = sw[ffn + j];
        s1 *= st;
        s2 *= st;
        const float g = row[j] * s1, u = row[ffn + j] * s2;
        const uint16_t b = k_f2bf((GELU ? k_gelu_tanh(g) : k_silu(g)) * u);
        act[j] = b;
        amax = fmaxf(amax, fabsf(k_bf2f(b)));
    }
    amax = k_block_max(amax, red);   /* (its barriers also publish act) */
    const float q8 = qf8_inv(amax);
    for (int j = threadIdx.x; j < ffn; j += blockDim.x) Q[t * ffn + j] = k_f2fp8(k_bf2f(act[j]) * q8);
    if (threadIdx.x == 0) scale[t] = qf8_scale(amax);
}

extern "C" int k_gated_mul_fp8q(const float *gu, const float *sw, const float *sx, int n, int ffn, int gelu,
                                uint8_t *Q, float *scale, cudaStream_t s) {
    const size_t smem = (size_t)ffn * 2;
    if (n < 0 || ffn <= 0 || !sw || !sx || !Q || !scale || smem > K_GATED_FP8Q_MAX_SMEM) return -1;
    if (!n) return 0;
    auto kern = gelu ? gated_fp8_kernel<true> : gated_fp8_kernel<false>;
    static bool big_ok[2];
    if (smem > 48 * 1024 && !big_ok[gelu ? 1 : 0]) {
        if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, K_GATED_FP8Q_MAX_SMEM) !=
            cudaSuccess)
            return -1;
        big_ok[gelu ? 1 : 0] = true;
    }
    return k_launch(kern, dim3(n), dim3(1024), smem, s, gu, sw, sx, ffn, Q, scale);
}
