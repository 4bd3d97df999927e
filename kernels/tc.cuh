/* Hopper/Ampere warp-level tensor-core and async-copy PTX wrappers shared by the
 * tensor-core kernels (attention_tc.cu, gemv*.cu, gemm_q.cu, moe.cu): bf16 and fp16
 * mma.sync m16n8k16 with fp32 accumulators, int8 m16n8k32, ldmatrix, cp.async with zero
 * fill. */
#ifndef SPECD_TC_CUH
#define SPECD_TC_CUH

#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ uint32_t tc_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, asynchronously; ok == false writes 16 zero bytes instead. */
__device__ __forceinline__ void tc_cp16(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(ok ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void tc_commit(void) {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Wait until at most N of this thread's committed groups are still in flight. */
template <int N>
__device__ __forceinline__ void tc_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void tc_ldsm4(uint32_t addr, uint32_t &r0, uint32_t &r1,
                                         uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void tc_ldsm4_t(uint32_t addr, uint32_t &r0, uint32_t &r1,
                                           uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

/* c += a (16x16 bf16, row) * b (16x8 bf16, col), fp32 accumulate. */
__device__ __forceinline__ void tc_mma(float c[4], const uint32_t a[4], uint32_t b0,
                                       uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* The same with fp16 a and b (an FP8 cache's E4M3 codes convert to fp16 exactly). */
__device__ __forceinline__ void tc_mma_f16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* c += a (16x32 int8, row) * b (32x8 int8, col), int32 accumulate: a0 / a1 rows g / g + 8,
 * k 4t .. 4t + 3; a2 / a3 the same rows, k 16 + 4t ..; b0 k 4t .., b1 k 16 + 4t .., column g;
 * c as tc_mma's (g = lane / 4, t = lane % 4). */
__device__ __forceinline__ void tc_mma_s8(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float tc_exp2(float x) {   /* exp2(-inf) = +0 */
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Two floats -> one register of two bf16 (round to nearest even), lo in the low half. */
__device__ __forceinline__ uint32_t tc_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* Two floats -> one register of two fp16 (round to nearest even), lo in the low half. */
__device__ __forceinline__ uint32_t tc_pack_f16(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

#endif
