/* Small memory-bound kernels of the forward pass: embedding gather, RMSNorm (the
 * residual add happens in the GEMM epilogue with beta = 1, so the norm only reads the
 * fp32 residual stream), SiLU-and-mul, the context-length advance, and device-side
 * random fills used by tests and benchmarks. */
#include <stdlib.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

/* pdl, attn_pdl, attn_simt, attn_tiled, attn_dec, gemvq_rows, gemvq_split, gemvq_rows_q6k, gemvq_stream,
 * gemvq_tc_split, gemm_qi8_bps, sample_hist, gemv_tc_min, moe_r1, sample_vec, attn_rope, moe_tcv,
 * attn_dec_pipe */
extern "C" const k_tuning k_tuning_default = {1, 2, 0, 0, 8, 4, 32, 2, 1, 32, 8, 1, 3, 1, 1, 1, -1, 0};
static k_tuning tuning = k_tuning_default;

extern "C" void k_set_tuning(const k_tuning *t) { tuning = *t; }
const k_tuning *k_tuning_get(void) { return &tuning; }

__global__ void embed_kernel(const uint16_t *table, const int32_t *tokens, float *out,
                             int hidden, int vocab) {
    k_pdl_trigger();
    k_pdl_wait();
    int t = blockIdx.x;
    int id = tokens[t];
    if (id < 0 || id >= vocab) id = 0;
    const uint16_t *row = table + (size_t)id * hidden;
    float *o = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = k_bf2f(row[i]);
}

extern "C" int k_embed(const uint16_t *table, const int32_t *tokens, float *out, int n,
                       int hidden, int vocab, cudaStream_t s) {
    if (n <= 0 || hidden <= 0 || vocab <= 0) return n == 0 ? 0 : -1;
    return k_launch(embed_kernel, dim3(n), dim3(256), 0, s, table, tokens, out, hidden, vocab);
}

__global__ void rmsnorm_kernel(const float *x, const int32_t *rows, const float *w,
                               uint16_t *out, int hidden, float eps) {
    __shared__ float red[32];
    k_pdl_trigger();
    k_pdl_wait();
    int i = blockIdx.x;
    int r = rows ? rows[i] : i;
    const float *xr = x + (size_t)r * hidden;
    uint16_t *o = out + (size_t)i * hidden;
    float ss = 0.f;
    if ((hidden & 3) == 0) {   /* 16-byte loads: one or two per thread at common sizes */
        const float4 *x4 = (const float4 *)xr, *w4 = (const float4 *)w;
        for (int j = threadIdx.x; j < hidden / 4; j += blockDim.x) {
            float4 v = x4[j];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        ss = k_block_sum(ss, red);
        float inv = rsqrtf(ss / (float)hidden + eps);
        for (int j = threadIdx.x; j < hidden / 4; j += blockDim.x) {
            float4 v = x4[j], g = w4[j];
            uint2 p;
            p.x = (uint32_t)k_f2bf(v.x * inv * g.x) | ((uint32_t)k_f2bf(v.y * inv * g.y) << 16);
            p.y = (uint32_t)k_f2bf(v.z * inv * g.z) | ((uint32_t)k_f2bf(v.w * inv * g.w) << 16);
            ((uint2 *)o)[j] = p;
        }
        return;
    }
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) ss += xr[j] * xr[j];
    ss = k_block_sum(ss, red);
    float inv = rsqrtf(ss / (float)hidden + eps);
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) o[j] = k_f2bf(xr[j] * inv * w[j]);
}

extern "C" int k_rmsnorm(const float *x, const int32_t *rows, const float *w, uint16_t *out,
                         int n, int hidden, float eps, cudaStream_t s) {
    if (n < 0 || hidden <= 0) return -1;
    if (n == 0) return 0;
    int nt = hidden >= 4096 ? 1024 : hidden >= 2048 ? 512 : 256;
    if ((uintptr_t)x % 16 || (uintptr_t)w % 16 || (uintptr_t)out % 8) nt = 256;
    return k_launch(rmsnorm_kernel, dim3(n), dim3(nt), 0, s, x, rows, w, out, hidden, eps);
}

/* k_rmsnorm (the 16-byte form) that also rounds its bf16 output to int8 per 32 elements
 * into scratch exactly as k_quant_x8 would (the same max, scale, rounding and code sum), so
 * the int8 GEMV after it needs no rounding launch of its own. All threads run every
 * iteration (the 8 lanes of a 32-element group exchange their max and sum by shuffles). */
__global__ void rmsnorm_q8_kernel(const float *x, const float *w, uint16_t *out, int hidden, float eps,
                                  int8_t *xq, float2 *xs) {
    __shared__ float red[32];
    k_pdl_trigger();
    k_pdl_wait();
    const int i = blockIdx.x, n4 = hidden / 4;
    const float4 *x4 = (const float4 *)(x + (size_t)i * hidden), *w4 = (const float4 *)w;
    float ss = 0.f;
    for (int j = threadIdx.x; j < n4; j += blockDim.x) {
        float4 v = x4[j];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = k_block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)hidden + eps);
    for (int base = 0; base < n4; base += blockDim.x) {
        const int j = base + threadIdx.x;
        const bool on = j < n4;
        uint16_t b[4] = {0, 0, 0, 0};
        if (on) {
            const float4 v = x4[j], g = w4[j];
            b[0] = k_f2bf(v.x * inv * g.x), b[1] = k_f2bf(v.y * inv * g.y);
            b[2] = k_f2bf(v.z * inv * g.z), b[3] = k_f2bf(v.w * inv * g.w);
            ((uint2 *)(out + (size_t)i * hidden))[j] =
                make_uint2((uint32_t)b[0] | (uint32_t)b[1] << 16, (uint32_t)b[2] | (uint32_t)b[3] << 16);
        }
        float f[4], a;
        int q[4], sum;
#pragma unroll
        for (int e = 0; e < 4; e++) f[e] = k_bf2f(b[e]);
        k_x8_round<4>(f, q, a, sum);
        if (!on) continue;
        const size_t e0 = (size_t)i * hidden + 4 * (size_t)j;
        *(uint32_t *)(xq + e0) = k_x8_pack4(q);
        if ((j & 7) == 0) xs[e0 / 32] = k_x8_pair(a, sum);
    }
}

extern "C" int k_rmsnorm_q8(const float *x, const float *w, uint16_t *out, int n, int hidden, float eps,
                            void *scratch, cudaStream_t s) {
    if (n <= 0 || hidden <= 0 || hidden % 32 || !scratch || ((uintptr_t)x | (uintptr_t)w | (uintptr_t)scratch) % 16 ||
        (uintptr_t)out % 8)
        return -1;
    const int nt = hidden >= 4096 ? 1024 : hidden >= 2048 ? 512 : 256;
    return k_launch(rmsnorm_q8_kernel, dim3(n), dim3(nt), 0, s, x, w, out, hidden, eps, (int8_t *)scratch,
                    (float2 *)((uint8_t *)scratch + k_x8_codes_bytes(n, hidden)));
}

/* out[t, j] = bf16(act(gate) * up) for gu [n, 2*ffn] (gate | up): SiLU, or GELU-tanh. A
 * block row per token (blockIdx.y, no divisions); with FP8 scales the products are an
 * unscaled FP8 GEMM's, scaled here by sw[row] * sx[t] (row j for gate, ffn + j for up). */
/* Q8: the bf16 output also rounded to int8 per 32 elements into xq / xs exactly as
 * k_quant_x8 would (a warp is one 32-element group: ffn % 32 == 0). */
template <bool GELU, bool Q8 = false>
__global__ void gated_mul_kernel(const float *__restrict__ gu, const float *__restrict__ sw,
                                 const float *__restrict__ sx, uint16_t *__restrict__ out, int ffn, int t0,
                                 int8_t *xq = nullptr, float2 *xs = nullptr) {
    k_pdl_trigger();
    const int j = blockIdx.x * blockDim.x + threadIdx.x, t = t0 + blockIdx.y;
    float s1 = 1.f, s2 = 1.f;
    if (sw && j < ffn) {   /* weight scales are constant: before the wait */
        s1 = sw[j];
        s2 = sw[ffn + j];
    }
    k_pdl_wait();
    if (j >= ffn) return;   /* (with Q8 a whole warp: ffn % 32 == 0) */
    if (sx) {
        s1 *= sx[t];
        s2 *= sx[t];
    }
    const float *row = gu + (size_t)t * 2 * ffn;
    const float g = row[j] * s1, u = row[ffn + j] * s2;
    const uint16_t b = k_f2bf((GELU ? k_gelu_tanh(g) : k_silu(g)) * u);
    out[(size_t)t * ffn + j] = b;
    if (Q8) {
        const float f[1] = {k_bf2f(b)};
        float a;
        int q[1], sum;
        k_x8_round<1>(f, q, a, sum);
        const size_t e = (size_t)t * ffn + j;
        xq[e] = (int8_t)q[0];
        if ((threadIdx.x & 31) == 0) xs[e / 32] = k_x8_pair(a, sum);
    }
}

template <bool GELU, bool Q8 = false>
static int launch_gated_mul(const float *gu, const float *sw, const float *sx, uint16_t *out, int n, int ffn,
                            cudaStream_t s, void *scratch = nullptr) {
    if (n < 0 || ffn <= 0 || (!sw != !sx)) return -1;
    int8_t *xq = (int8_t *)scratch;
    float2 *xs = Q8 ? (float2 *)((uint8_t *)scratch + k_x8_codes_bytes(n, ffn)) : nullptr;
    for (int t0 = 0; t0 < n; t0 += 65535) {   /* grid rows */
        const int nt = n - t0 < 65535 ? n - t0 : 65535;
        int rc = k_launch(gated_mul_kernel<GELU, Q8>, dim3((unsigned)((ffn + 255) / 256), (unsigned)nt), dim3(256), 0,
                          s, gu, sw, sx, out, ffn, t0, xq, xs);
        if (rc) return rc;
    }
    return 0;
}

extern "C" int k_gated_mul_q8(const float *gu, uint16_t *out, int n, int ffn, int gelu, void *scratch, cudaStream_t s) {
    if (!scratch || ffn % 32 || (uintptr_t)scratch % 16) return -1;
    return gelu ? launch_gated_mul<true, true>(gu, NULL, NULL, out, n, ffn, s, scratch)
                : launch_gated_mul<false, true>(gu, NULL, NULL, out, n, ffn, s, scratch);
}

extern "C" int k_silu_mul(const float *gu, uint16_t *out, int n, int ffn, cudaStream_t s) {
    return launch_gated_mul<false>(gu, NULL, NULL, out, n, ffn, s);
}

extern "C" int k_gelu_tanh_mul(const float *gu, uint16_t *out, int n, int ffn, cudaStream_t s) {
    return launch_gated_mul<true>(gu, NULL, NULL, out, n, ffn, s);
}

extern "C" int k_gated_mul_fp8(const float *gu, const float *sw, const float *sx, uint16_t *out, int n, int ffn,
                               int gelu, cudaStream_t s) {
    if (!sw || !sx) return -1;
    return gelu ? launch_gated_mul<true>(gu, sw, sx, out, n, ffn, s) : launch_gated_mul<false>(gu, sw, sx, out, n, ffn, s);
}

/* Grammar masks: row r of logits keeps token i only where bit i of its mask is set, for
 * rows with has[r] != 0. */
__global__ void mask_logits_kernel(float *logits, int vocab, const uint32_t *mask, const int32_t *has) {
    k_pdl_trigger();
    k_pdl_wait();
    const int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (!has[r] || i >= vocab) return;
    const size_t words = ((size_t)vocab + 31) / 32;
    if (!((mask[(size_t)r * words + (i >> 5)] >> (i & 31)) & 1u)) logits[(size_t)r * vocab + i] = -INFINITY;
}

extern "C" int k_mask_logits(float *logits, int n, int vocab, const uint32_t *mask, const int32_t *has,
                             cudaStream_t s) {
    if (n < 0 || vocab <= 0) return -1;
    if (n == 0) return 0;
    return k_launch(mask_logits_kernel, dim3((vocab + 255) / 256, n), dim3(256), 0, s, logits, vocab, mask, has);
}

/* resid[t, :] += x[t, :] * rsqrt(mean(x[t, :]^2) + eps) * w: a sublayer output normed
 * before its residual add (Gemma 3's post-attention / post-feedforward norms). */
__global__ void rmsnorm_add_kernel(const float *x, const float *w, float *resid, int hidden, float eps) {
    __shared__ float red[32];
    k_pdl_trigger();
    k_pdl_wait();
    const float *xr = x + (size_t)blockIdx.x * hidden;
    float *o = resid + (size_t)blockIdx.x * hidden;
    float ss = 0.f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) ss += xr[j] * xr[j];
    ss = k_block_sum(ss, red);
    float inv = rsqrtf(ss / (float)hidden + eps);
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) o[j] += xr[j] * inv * w[j];
}

extern "C" int k_rmsnorm_add(const float *x, const float *w, float *resid, int n, int hidden, float eps,
                             cudaStream_t s) {
    if (n < 0 || hidden <= 0) return -1;
    if (n == 0) return 0;
    return k_launch(rmsnorm_add_kernel, dim3(n), dim3(256), 0, s, x, w, resid, hidden, eps);
}

__global__ void scale_kernel(float *x, size_t n, float a) {
    k_pdl_trigger();
    k_pdl_wait();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] *= a;
}

extern "C" int k_scale_f32(float *x, size_t n, float a, cudaStream_t s) {
    if (n == 0) return 0;
    size_t blocks = (n + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    return k_launch(scale_kernel, dim3((unsigned)blocks), dim3(256), 0, s, x, n, a);
}

__global__ void advance_kernel(int32_t *lens, const int32_t *row_slot, const int32_t *row_n,
                               int n, int which, int dummy) {
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        int slot = row_slot[r];
        /* Rows of one step never share a live slot, so plain stores do not race; padding
         * rows all name the dummy slot and are skipped (it is zeroed right after). */
        if (slot != dummy) lens[slot * 2 + which] += row_n[r];
    }
}

extern "C" int k_advance_lens(int32_t *lens, const int32_t *row_slot, const int32_t *row_n,
                              int n, int which, int dummy, cudaStream_t s) {
    if (n < 0 || which < 0 || which > 1) return -1;
    if (n == 0) return 0;
    advance_kernel<<<1, 256, 0, s>>>(lens, row_slot, row_n, n, which, dummy);
    return K_LAUNCH_RESULT();
}

__global__ void feed_prev_kernel(int32_t *tokens, const int32_t *prev, const int32_t *prev_out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (prev[i] >= 0) tokens[i] = prev_out[prev[i]];
}

extern "C" int k_feed_prev(int32_t *tokens, const int32_t *prev, const int32_t *prev_out, int n, cudaStream_t s) {
    if (n < 0) return -1;
    if (n == 0) return 0;
    feed_prev_kernel<<<1, 256, 0, s>>>(tokens, prev, prev_out, n);
    return K_LAUNCH_RESULT();
}

extern "C" float k_philox_uniform_host(uint64_t seed, uint64_t counter) {
    return k_philox_u01(seed, counter);
}

/* Element (i, j) of a rows x cols slice at (row0, col0) of a matrix with full_cols columns
 * takes the value of element (row0 + i) * full_cols + col0 + j of the whole matrix: a
 * tensor-parallel shard filled this way holds exactly its slice of the unsharded tensor. */
__global__ void fill_bf16_kernel(uint16_t *dst, size_t rows, size_t cols, uint64_t seed, float scale,
                                 size_t row0, size_t col0, size_t full_cols) {
    size_t n = rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / cols, c = i - r * cols;
        dst[i] = k_f2bf((2.f * k_philox_u01(seed, (row0 + r) * full_cols + col0 + c) - 1.f) * scale);
    }
}

__global__ void fill_f32_kernel(float *dst, size_t n, uint64_t seed, float lo, float hi, size_t offset) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = lo + (hi - lo) * k_philox_u01(seed, offset + i);
}

extern "C" int k_fill_uniform_bf16_slice(uint16_t *dst, size_t rows, size_t cols, size_t row0, size_t col0,
                                         size_t full_cols, uint64_t seed, float scale, cudaStream_t s) {
    if (rows == 0 || cols == 0) return 0;
    if (col0 + cols > full_cols) return -1;
    fill_bf16_kernel<<<4096, 256, 0, s>>>(dst, rows, cols, seed, scale, row0, col0, full_cols);
    return K_LAUNCH_RESULT();
}

extern "C" int k_fill_uniform_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale,
                                   cudaStream_t s) {
    return k_fill_uniform_bf16_slice(dst, 1, n, 0, 0, n, seed, scale, s);
}

extern "C" int k_fill_uniform_f32_at(float *dst, size_t n, size_t offset, uint64_t seed, float lo, float hi,
                                     cudaStream_t s) {
    if (n == 0) return 0;
    fill_f32_kernel<<<4096, 256, 0, s>>>(dst, n, seed, lo, hi, offset);
    return K_LAUNCH_RESULT();
}

extern "C" int k_fill_uniform_f32(float *dst, size_t n, uint64_t seed, float lo, float hi,
                                  cudaStream_t s) {
    return k_fill_uniform_f32_at(dst, n, 0, seed, lo, hi, s);
}
