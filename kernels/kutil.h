/* Device-side helpers shared by the kernels/ .cu files (C++ only; never included by engine code):
 * bf16 <-> fp32 on raw bits, warp reductions, Philox4x32-10 (counter-based RNG, so a
 * draw depends only on (seed, counter) and sampling is reproducible per request). */
#ifndef SPECD_KUTIL_H
#define SPECD_KUTIL_H

#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/specd_kernels.h"

#define K_LAUNCH_RESULT() ((int)cudaGetLastError())

/* Programmatic dependent launch (Hopper): a kernel launched with k_launch may start while
 * the kernel before it on the stream is still running, once every block of that one has
 * started (each calls k_pdl_trigger first). Until k_pdl_wait returns -- the previous grid
 * has completed and its writes are visible -- a kernel may only read data no earlier
 * kernel writes (weights) and must write nothing. Every kernel launched with k_launch
 * calls k_pdl_wait before its first activation read or any write, and always before it
 * ends, so the order of the whole chain is kept. Both are no-ops without the launch
 * attribute. SPECD_CUDA_PDL=0 launches everything normally (to time the difference). */
__device__ __forceinline__ void k_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void k_pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }

/* One bulk L2 prefetch of [p, p + len) (cp.async.bulk.prefetch.L2, sm_90; 16-byte
 * multiples; a hint: no registers, nothing to wait for). */
__device__ __forceinline__ void k_l2_prefetch(const void *p, unsigned len) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(len) : "memory");
#endif
}
/* Part `part` of `nparts` of an L2 prefetch of [p, p + bytes) (16-byte multiples) in
 * K_L2PF_CHUNK requests, chunk i issued by thread i / nparts of block part i % nparts, so a
 * grid spreads a range over its blocks. */
#define K_L2PF_CHUNK 16384
__device__ __forceinline__ void k_l2_prefetch_part(const void *p, size_t bytes, int part, int nparts) {
    const size_t n_ch = (bytes + K_L2PF_CHUNK - 1) / K_L2PF_CHUNK;
    for (size_t i = (size_t)threadIdx.x * nparts + part; i < n_ch; i += (size_t)blockDim.x * nparts) {
        const size_t off = i * K_L2PF_CHUNK;
        k_l2_prefetch((const char *)p + off, (unsigned)(bytes - off < K_L2PF_CHUNK ? bytes - off : K_L2PF_CHUNK));
    }
}

/* The launch choices in force (k_set_tuning; defaults until then). */
const k_tuning *k_tuning_get(void);

template <typename... KArgs, typename... Args>
static inline int k_launch_pdl(bool pdl, void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                               Args... args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = pdl && k_tuning_get()->pdl;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return (int)cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...);
}

template <typename... KArgs, typename... Args>
static inline int k_launch(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                           Args... args) {
    return k_launch_pdl(true, kern, grid, block, smem, s, args...);
}

/* Multiprocessors of the current device, for launch sizing; queried once (132 when the
 * query fails). */
static inline int k_sm_count(void) {
    static int sms = 0;
    if (!sms) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
            sms = 132;
    }
    return sms;
}

/* The int8 activations' layout in scratch (k_quant_x8, specd_kernels.h): int8 codes [n, in]
 * first, then (scale, sum of the 32 codes) float2 [n, in / 32] at k_x8_codes_bytes(n, in). */
__host__ __device__ static inline size_t k_x8_codes_bytes(int n, int in) { return ((size_t)n * (size_t)in + 15) / 16 * 16; }

/* The int8 rounding of one 32-element group held by 32 / E adjacent lanes, E values each
 * (every lane of the warp calls it): a = max |v| over the group, codes q = v * (127 / a)
 * rounded to nearest even (0 for an all-zero group), sum = the group's code sum. The max
 * and the integer sum are exact in any order, so every kernel that rounds this way
 * (k_quant_x8 and the producers that round as they write) makes the same bits. The
 * group's pair in scratch is k_x8_pair(a, sum). */
template <int E>
__device__ __forceinline__ void k_x8_round(const float (&v)[E], int (&q)[E], float &a, int &sum) {
    a = 0.f;
#pragma unroll
    for (int e = 0; e < E; e++) a = fmaxf(a, fabsf(v[e]));
#pragma unroll
    for (int o = 1; o < 32 / E; o <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    const float id = a > 0.f ? 127.f / a : 0.f;
    sum = 0;
#pragma unroll
    for (int e = 0; e < E; e++) sum += q[e] = __float2int_rn(v[e] * id);
#pragma unroll
    for (int o = 1; o < 32 / E; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
}
__device__ __forceinline__ float2 k_x8_pair(float a, int sum) { return make_float2(a / 127.f, (float)sum); }
/* four codes as the bytes of one word, the first lowest */
__device__ __forceinline__ uint32_t k_x8_pack4(const int *q) {
    return (uint32_t)(q[0] & 0xff) | (uint32_t)(q[1] & 0xff) << 8 | (uint32_t)(q[2] & 0xff) << 16 |
           (uint32_t)(q[3] & 0xff) << 24;
}

__device__ __forceinline__ float k_bf2f(uint16_t b) {
    return __uint_as_float(((uint32_t)b) << 16);
}

__device__ __forceinline__ uint16_t k_f2bf(float f) {
    __nv_bfloat16 h = __float2bfloat16_rn(f);
    return *reinterpret_cast<uint16_t *>(&h);
}

/* The 8 bf16 of a 16-byte load as fp32 (a shift or a mask each). */
__device__ __forceinline__ void k_bf16x8(uint4 v, float (&f)[8]) {
    const uint32_t a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(a[i] << 16);
        f[2 * i + 1] = __uint_as_float(a[i] & 0xffff0000u);
    }
}

/* The 8 FP8 E4M3 of an 8-byte load as fp32 (element i is byte i; two per cvt). Exact:
 * every E4M3 value is a half. */
__device__ __forceinline__ void k_fp8x8(uint2 v, float (&f)[8]) {
    const uint32_t a[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(a[i >> 1] >> (16 * (i & 1))), __NV_E4M3);
        const float2 p = __half22float2(*reinterpret_cast<const __half2 *>(&h));
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

/* The same 8 values as packed bf16 (exact: E4M3 has 3 mantissa bits), for mma fragments. */
__device__ __forceinline__ uint4 k_fp8x8_bf16(uint2 v) {
    float f[8];
    k_fp8x8(v, f);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (__float_as_uint(f[2 * i]) >> 16) | (__float_as_uint(f[2 * i + 1]) & 0xffff0000u);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* fp32 -> E4M3, nearest even, saturating to +-448 (NaN stays NaN): engine/model/fp8.c's
 * fp8_e4m3_from_f32 on the device. */
__device__ __forceinline__ uint8_t k_f2fp8(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float k_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float k_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* A block-wide reduction: each warp's WARP result through `red` (>= 32 floats of shared
 * memory; lanes past the block's warps bring `none`), then WARP over those; every thread
 * gets the result. */
template <float (*WARP)(float)>
__device__ __forceinline__ float k_block_reduce(float v, float *red, float none) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = WARP(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : none;
    return WARP(v);
}
__device__ __forceinline__ float k_block_sum(float v, float *red) { return k_block_reduce<k_warp_sum>(v, red, 0.f); }
__device__ __forceinline__ float k_block_max(float v, float *red) {
    return k_block_reduce<k_warp_max>(v, red, -INFINITY);
}

/* Fixed-point sums of squares for the norm fold (specd_kernels.h, K_SS_FRAC_BITS). */
__device__ __forceinline__ unsigned long long k_ss_units(float v) {
    return __double2ull_rn((double)v * (double)(1ull << K_SS_FRAC_BITS));
}
__device__ __forceinline__ float k_ss_value(unsigned long long u) { return (float)K_SS_VALUE(u); }

__device__ __forceinline__ float k_silu(float g) { return g / (1.f + expf(-g)); }
/* HF's gelu_pytorch_tanh (Gemma's gate activation). */
__device__ __forceinline__ float k_gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

/* Philox4x32-10 (Salmon et al., SC'11): key = seed, counter = (counter, 0, 0). */
__host__ __device__ __forceinline__ void k_philox(uint64_t seed, uint64_t counter, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int i = 0; i < 10; i++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* 24 random bits -> [0, 1): exactly representable, never 1. */
__host__ __device__ __forceinline__ float k_philox_u01(uint64_t seed, uint64_t counter) {
    uint32_t r[4];
    k_philox(seed, counter, r);
    return (float)(r[0] >> 8) * (1.0f / 16777216.0f);
}

#endif
