/* Decode GEMV over GGUF-quantized weights read in place (issue #17). Y[t, o] (+)= sum_k
 * W[o, k] X[t, k] for t < n <= 8: W's row o is in / E blocks of S bytes (kernels/
 * quant_blocks.h: Q8_0 32/34, Q4_0 32/18, Q4_1 32/20, Q4_K 256/144, Q5_K 256/176, Q6_K
 * 256/210), X [n, in] bf16, Y [n, out] fp32.
 *
 * Written for memory bandwidth (batch 1 streams every weight byte once per token):
 *   - A warp owns R (2 or 4) consecutive rows and a contiguous run of their blocks (split
 *     K over the warps of a block when there are too few rows to fill the GPU; partial
 *     sums meet in shared memory). It walks the run in steps of 1024 elements.
 *   - A step's bytes are copied global -> shared with 16-byte cp.async (coalesced,
 *     L1-bypassing), GEMVQ_STAGES - 1 steps ahead, the first ones before the PDL wait.
 *     Rows are contiguous, so each (row, step) is one byte range; the copy takes the
 *     aligned 16-byte words that cover it, which is how Q8_0 and Q6_K rows (34- and
 *     210-byte blocks: starts only 2-byte aligned) are read with wide loads. Needs W
 *     16-byte aligned; the one word past the end of the matrix is zero-filled, not read.
 *   - Each lane decodes one 32-element part of a block from shared memory (16-byte reads,
 *     realigned with byte_perm where a block is not 4-byte aligned), in registers, and
 *     dots it with every token's activations (16-byte __ldg, L1 resident); each
 *     activation load serves all R rows.
 *   - The integer codes become floats with one byte_perm each: the code is put into the
 *     top mantissa bits of 0.5 (f = 0.5 + q * 2^-m), the part's dot sum(f x) is taken in
 *     fp32 and sum(q x) = 2^m (sum(f x) - sum(x) / 2) recovered per 16 or 32
 *     elements (Q4_K needs sum(x) for its mins anyway). This costs a few bits in the
 *     products (f carries 4-6 bits of code in 24): the error vs the double host reference
 *     should stay ~1e-6 relative (tests/gpu/test_gpu_gemv.c checks < 1e-4).
 *     Q8_0 uses the exact 2^23 magic instead (its budget per weight is larger).
 * The result equals the host decode (qb_decode8, bit-exact vs ggml) dotted in a different
 * order and scaled per sub-block rather than per element, so it matches to fp32 rounding,
 * not bit for bit.
 * At 1-2 tokens over the larger projections the launch takes the streaming form instead
 * (gemv_qs_kernel below: a fixed grid whose warps each stream one run of steps).
 * k_gemv_qi8 (below, the runner's default for --dtype gguf) is the same kernel over X
 * rounded to int8 per 32 elements (k_quant_x8): integer dp4a dots, scaled once per run of
 * codes, equal to the host decode dotted with the rounded X to fp32 rounding. */
#include <cuda_fp16.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/quant_blocks.h"
#include "kernels/tc.cuh"

#define GEMVQ_WARPS 8
/* Rows per warp (template R): each activation load and unpack serves all of them, so more
 * rows spend fewer instructions per weight, at the price of registers and staging memory.
 * (Counted from the source, not profiled: at 2 rows a weight costs about 7 instructions,
 * half of them unpacking activations, where the copy roofline leaves room for about 3 at
 * batch 1; the measured GEMV runs at 20-45% of that roofline.) k_tuning.gemvq_rows picks
 * 4 (the default: the 8B shapes' batch-1 GEMVs took about 10% less time than at 2 on an
 * H100, 2026-12-05) or 2 (GEMVQ_ROWS). K-quant blocks have a tensor-core form below
 * (k_gemv_qtc) that spends far fewer instructions per weight. */
#define GEMVQ_ROWS 2
#define GEMVQ_STAGES 3   /* shared-memory steps per warp: two in flight while one is used */

/* Per type: elements E and bytes S of a block, blocks SB of a 1024-element step (lane
 * l takes part l % (32 / SB) of block l / (32 / SB) in it). */
template <int T> struct gq;
template <> struct gq<QB_Q8_0> { enum { E = 32, S = 34, SB = 32 }; };
template <> struct gq<QB_Q4_0> { enum { E = 32, S = 18, SB = 32 }; };
template <> struct gq<QB_Q4_1> { enum { E = 32, S = 20, SB = 32 }; };
template <> struct gq<QB_Q5_K> { enum { E = 256, S = 176, SB = 4 }; };
template <> struct gq<QB_Q4_K> { enum { E = 256, S = 144, SB = 4 }; };
template <> struct gq<QB_Q6_K> { enum { E = 256, S = 210, SB = 4 }; };

/* uint4 words of one staged (row, step): its bytes from any 2-aligned start, plus a word
 * of slack that gq_lds16's fifth read may touch. Blocks of a whole number of words (Q4_K,
 * Q5_K) start every step on a word and are never read with gq_lds16: no slack, which lets
 * a fourth block of Q4_K rows onto a multiprocessor (55 KB of staging, not 58). */
template <int T> __host__ __device__ constexpr int gq_words() {
    return (gq<T>::SB * gq<T>::S + 15) / 16 + (gq<T>::S % 16 ? 2 : 0);
}
template <int T, int R> constexpr size_t gq_smem_bytes() {
    return (size_t)GEMVQ_WARPS * GEMVQ_STAGES * R * gq_words<T>() * 16;
}

/* 16 bytes global -> shared, asynchronously; the first n read, the rest zero-filled
 * (called with n = 16: compute-sanitizer counts a zero-filling copy as a 16-byte read, so
 * the matrix's partial last word is copied with plain loads instead). */
__device__ __forceinline__ void gq_cp16(void *dst, const void *src, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tc_smem_addr(dst)), "l"(src), "r"(n)
                 : "memory");
}

/* 16 bytes of shared memory at a 2-aligned address: five word reads, shifted by two bytes
 * when p is not 4-aligned (blocks of 34 and 210 bytes). */
__device__ __forceinline__ uint4 gq_lds16(const uint8_t *p) {
    const uint32_t *a = (const uint32_t *)((uintptr_t)p & ~(uintptr_t)3);
    const uint32_t sel = ((uintptr_t)p & 2) ? 0x5432u : 0x3210u;
    const uint32_t w0 = a[0], w1 = a[1], w2 = a[2], w3 = a[3], w4 = a[4];
    return make_uint4(__byte_perm(w0, w1, sel), __byte_perm(w1, w2, sel), __byte_perm(w2, w3, sel),
                      __byte_perm(w3, w4, sel));
}

__device__ __forceinline__ float gq_h2f(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }

/* Byte e of b (a code c in its bits 0..6) as the float with bits 0x3f000000 | c << 16, i.e.
 * 0.5 * (1 + c * 2^-7): one byte_perm. */
__device__ __forceinline__ float gq_half_plus(uint32_t b, int e) {
    return __uint_as_float(__byte_perm(b, 0x3f000000u, 0x7044u | (uint32_t)e << 8));
}

/* s[r][t] += f[r] . x[t] over 8 elements at x (token rows `in` apart); sx[t] += sum x[t]
 * when SX. */
template <int NB, bool SX, int R>
__device__ __forceinline__ void gq_fma8(const float (&f)[R][8], const uint16_t *x, int in,
                                        float (&s)[R][NB], float (&sx)[NB]) {
#pragma unroll
    for (int t = 0; t < NB; t++) {
        float xf[8];
        k_bf16x8(__ldg((const uint4 *)(x + (size_t)t * in)), xf);
        if (SX) sx[t] += ((xf[0] + xf[1]) + (xf[2] + xf[3])) + ((xf[4] + xf[5]) + (xf[6] + xf[7]));
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int e = 0; e < 8; e++) s[r][t] = fmaf(f[r][e], xf[e], s[r][t]);
    }
}

/* A warp's sums per (row, token), zeroed. */
template <int NB, int R>
__device__ __forceinline__ void gq_zero(float (&acc)[R][NB]) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NB; t++) acc[r][t] = 0.f;
}

/* A part decoder's partial sums: s[r][t] of f . x, sx[t] of x. */
template <int NB, int R>
__device__ __forceinline__ void gq_clear(float (&s)[R][NB], float (&sx)[NB]) {
#pragma unroll
    for (int t = 0; t < NB; t++) sx[t] = 0.f;
    gq_zero(s);
}

/* ---- per-type part decoders: acc[r][t] += part p of blk[r] . X[t, k0 + ...] ------------ */

/* Q8_0: the part is the whole block (d, 32 int8). Codes + 128 go under the 2^23 magic:
 * exact integers, one byte_perm and one add each. */
template <int NB, int R>
__device__ __forceinline__ void gq_part_q8_0(const uint8_t *const (&blk)[R], int p, const uint16_t *x,
                                             int in, float (&acc)[R][NB]) {
    (void)p;
    uint4 q[R][2];
    float d[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        d[r] = gq_h2f(*(const uint16_t *)blk[r]);
        q[r][0] = gq_lds16(blk[r] + 2);
        q[r][1] = gq_lds16(blk[r] + 18);
    }
    float s[R][NB], sx[NB];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NB; t++) s[r][t] = 0.f;
#pragma unroll
    for (int g = 0; g < 4; g++) {   /* elements 8g .. 8g + 7 */
        float f[R][8];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint4 v = q[r][g >> 1];
            const uint32_t lo = ((g & 1) ? v.z : v.x) ^ 0x80808080u, hi = ((g & 1) ? v.w : v.y) ^ 0x80808080u;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                f[r][e] = __uint_as_float(__byte_perm(lo, 0x4b000000u, 0x7440u | (uint32_t)e)) - 8388736.f;
                f[r][4 + e] = __uint_as_float(__byte_perm(hi, 0x4b000000u, 0x7440u | (uint32_t)e)) - 8388736.f;
            }
        }
        gq_fma8<NB, false>(f, x + 8 * g, in, s, sx);
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NB; t++) acc[r][t] = fmaf(d[r], s[r][t], acc[r][t]);
}

/* Q4_K: part p (0..7) is qs bytes 16p .. 16p + 15: low nibbles are elements 64j + l0 + i
 * of sub-block 2j, high nibbles 64j + 32 + l0 + i of sub-block 2j + 1 (j = p / 2, l0 =
 * 16 (p % 2)). The 6-bit scales and mins of all eight sub-blocks are unpacked four to a
 * word (qb_k4_scale_min's layout). f = 0.5 + q / 32, so sum(q x) = 32 s - 16 sum(x).
 * Q5_K (Q5): the same parts with qs at 48 and a fifth bit from qh[l0 + i], bit 2j (low
 * nibbles) or 2j + 1 (high): the 5-bit code goes to bits 2..6 of a byte, f = 0.5 + q / 64,
 * so sum(q x) = 64 s - 32 sum(x). Both blocks are 16-aligned (144 = 9 x 16, 176 = 11 x 16). */
template <int NB, bool Q5, int R>
__device__ __forceinline__ void gq_part_k45(const uint8_t *const (&blk)[R], int p, const uint16_t *x,
                                            int in, float (&acc)[R][NB]) {
    const int j = p >> 1, l0 = (p & 1) * 16, sh = 16 * (j & 1);
    constexpr float QS = Q5 ? 64.f : 32.f;   /* sum(q x) = QS (s - sum(x) / 2) */
    uint4 q[R], qh[R];
    float ds[R][2], dm[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const uint4 h = *(const uint4 *)blk[r];   /* d, dmin, scales[12] */
        q[r] = *(const uint4 *)(blk[r] + (Q5 ? 48 : 16) + 16 * p);
        qh[r] = Q5 ? *(const uint4 *)(blk[r] + 16 + l0) : make_uint4(0, 0, 0, 0);
        const float d = gq_h2f(h.x & 0xffff), dmin = gq_h2f(h.x >> 16);
        const uint32_t sc = j < 2 ? h.y & 0x3f3f3f3fu : (h.w & 0x0f0f0f0fu) | ((h.y >> 2) & 0x30303030u);
        const uint32_t mn = j < 2 ? h.z & 0x3f3f3f3fu : ((h.w >> 4) & 0x0f0f0f0fu) | ((h.z >> 2) & 0x30303030u);
        ds[r][0] = d * (float)((sc >> sh) & 0xff), dm[r][0] = dmin * (float)((mn >> sh) & 0xff);
        ds[r][1] = d * (float)((sc >> (sh + 8)) & 0xff), dm[r][1] = dmin * (float)((mn >> (sh + 8)) & 0xff);
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {   /* low nibbles (sub-block 2j), then high (2j + 1) */
        float s[R][NB], sx[NB];
        gq_clear(s, sx);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            float f[R][8];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t w[2] = {g ? q[r].z : q[r].x, g ? q[r].w : q[r].y};
                const uint32_t u[2] = {g ? qh[r].z : qh[r].x, g ? qh[r].w : qh[r].y};
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    /* Q4_K: the nibble to bits 3..6 of its byte; Q5_K: to bits 2..5, its
                     * fifth bit to bit 6 */
                    const uint32_t b = Q5 ? ((hf ? w[k] >> 2 : w[k] << 2) & 0x3c3c3c3cu) |
                                                (((u[k] >> (2 * j + hf)) & 0x01010101u) << 6)
                                          : (hf ? w[k] >> 1 : w[k] << 3) & 0x78787878u;
#pragma unroll
                    for (int e = 0; e < 4; e++) f[r][4 * k + e] = gq_half_plus(b, e);
                }
            }
            gq_fma8<NB, true>(f, x + 64 * j + 32 * hf + l0 + 8 * g, in, s, sx);
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < NB; t++)
                acc[r][t] += ds[r][hf] * (QS * s[r][t] - 0.5f * QS * sx[t]) - dm[r][hf] * sx[t];
    }
}

/* Q6_K: part p = (h, a, c) = (p / 4, p / 2 % 2, p % 2) is ql bytes 64h + 32a + 16c + i and
 * qh bytes 32h + 16c + i (i < 16): elements 128h + 32u + 16c + i for u = a (low nibbles,
 * qh bits 2a..2a+1) and u = a + 2 (high nibbles, bits 2a+4..2a+5), scales sc[8h + c + 2u].
 * The 6-bit code goes to bits 1..6 of a byte: f = 0.5 + q / 128, sum((q - 32) x) =
 * 128 s - 96 sum(x). */
template <int NB, int R>
__device__ __forceinline__ void gq_part_q6_k(const uint8_t *const (&blk)[R], int p, const uint16_t *x,
                                             int in, float (&acc)[R][NB]) {
    const int h = p >> 2, a = (p >> 1) & 1, c = p & 1;
    uint4 ql[R], qh[R];
    float dsc[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) {
        ql[r] = gq_lds16(blk[r] + 64 * h + 32 * a + 16 * c);
        qh[r] = gq_lds16(blk[r] + 128 + 32 * h + 16 * c);
        const float d = gq_h2f(*(const uint16_t *)(blk[r] + 208));
        const int8_t *sc = (const int8_t *)(blk[r] + 192 + 8 * h + c + 2 * a);
        dsc[r][0] = d * (float)sc[0];
        dsc[r][1] = d * (float)sc[4];
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {   /* u = a, then u = a + 2 */
        float s[R][NB], sx[NB];
        gq_clear(s, sx);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            float f[R][8];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t l[2] = {g ? ql[r].z : ql[r].x, g ? ql[r].w : ql[r].y};
                const uint32_t u[2] = {g ? qh[r].z : qh[r].x, g ? qh[r].w : qh[r].y};
#pragma unroll
                for (int w = 0; w < 2; w++) {
                    const uint32_t hb = u[w] >> (2 * a);   /* this u's two bits at 0..1 (hf 0) or 4..5 */
                    const uint32_t b = ((hf ? l[w] >> 3 : l[w] << 1) & 0x1e1e1e1eu) |
                                       ((hf ? hb << 1 : hb << 5) & 0x60606060u);
#pragma unroll
                    for (int e = 0; e < 4; e++) f[r][4 * w + e] = gq_half_plus(b, e);
                }
            }
            gq_fma8<NB, true>(f, x + 128 * h + 32 * (a + 2 * hf) + 16 * c + 8 * g, in, s, sx);
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < NB; t++) acc[r][t] += dsc[r][hf] * (128.f * s[r][t] - 96.f * sx[t]);
    }
}

/* Q4_0 / Q4_1: the part is the whole block (d [, m], 16 bytes of nibbles: the low ones are
 * elements 0..15, the high ones 16..31). f = 0.5 + q / 32 as in Q4_K, so sum(q x) =
 * 32 s - 16 sum(x); Q4_0's x = d (q - 8), Q4_1's x = d q + m. */
template <int NB, bool MIN, int R>
__device__ __forceinline__ void gq_part_q4_01(const uint8_t *const (&blk)[R], const uint16_t *x, int in,
                                              float (&acc)[R][NB]) {
    uint4 q[R];
    float d[R], m[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        d[r] = gq_h2f(*(const uint16_t *)blk[r]);
        m[r] = MIN ? gq_h2f(*(const uint16_t *)(blk[r] + 2)) : 0.f;
        q[r] = gq_lds16(blk[r] + (MIN ? 4 : 2));
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float s[R][NB], sx[NB];
        gq_clear(s, sx);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            float f[R][8];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t w0 = g ? q[r].z : q[r].x, w1 = g ? q[r].w : q[r].y;
                const uint32_t b0 = (hf ? w0 >> 1 : w0 << 3) & 0x78787878u, b1 = (hf ? w1 >> 1 : w1 << 3) & 0x78787878u;
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    f[r][e] = gq_half_plus(b0, e);
                    f[r][4 + e] = gq_half_plus(b1, e);
                }
            }
            gq_fma8<NB, true>(f, x + 16 * hf + 8 * g, in, s, sx);
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < NB; t++)
                acc[r][t] += MIN ? d[r] * (32.f * s[r][t] - 16.f * sx[t]) + m[r] * sx[t]
                                 : d[r] * (32.f * s[r][t] - 24.f * sx[t]);
    }
}

template <int T, int NB, int R>
__device__ __forceinline__ void gq_part(const uint8_t *const (&blk)[R], int p, const uint16_t *x, int in,
                                        float (&acc)[R][NB]) {
    if (T == QB_Q8_0) gq_part_q8_0<NB>(blk, p, x, in, acc);
    else if (T == QB_Q4_0) gq_part_q4_01<NB, false>(blk, x, in, acc);
    else if (T == QB_Q4_1) gq_part_q4_01<NB, true>(blk, x, in, acc);
    else if (T == QB_Q4_K) gq_part_k45<NB, false>(blk, p, x, in, acc);
    else if (T == QB_Q5_K) gq_part_k45<NB, true>(blk, p, x, in, acc);
    else gq_part_q6_k<NB>(blk, p, x, in, acc);
}

/* ---- int8 activations (k_gemv_qi8): the blocks against X quantized per 32 elements --------
 * A lane's 32 codes (a 32-element block, or a K-quant part: two runs of 16) as words of
 * int8 / small unsigned codes, dotted with each token's int8 activations by eight dp4a
 * (exact int32), then scaled once per run: 32-element types acc += dw dx sum(q xq), with
 * Q4_0's codes shifted by -8 and Q4_1's minimum through the activations' code sum. */
template <int T, int NB, int R>
__device__ __forceinline__ void gq_part_i8_32(const uint8_t *const (&blk)[R], const int8_t *xq, const float2 *xs,
                                              int in, float (&acc)[R][NB]) {
    uint32_t q[R][8];
    float d[R], m[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        d[r] = gq_h2f(*(const uint16_t *)blk[r]);
        m[r] = T == QB_Q4_1 ? gq_h2f(*(const uint16_t *)(blk[r] + 2)) : 0.f;
        if (T == QB_Q8_0) {
            const uint4 a = gq_lds16(blk[r] + 2), b = gq_lds16(blk[r] + 18);
            q[r][0] = a.x, q[r][1] = a.y, q[r][2] = a.z, q[r][3] = a.w;
            q[r][4] = b.x, q[r][5] = b.y, q[r][6] = b.z, q[r][7] = b.w;
        } else {   /* low nibbles: elements 0..15, high: 16..31 */
            const uint4 a = gq_lds16(blk[r] + (T == QB_Q4_1 ? 4 : 2));
            const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int i = 0; i < 4; i++) q[r][i] = w[i] & 0x0f0f0f0fu, q[r][4 + i] = (w[i] >> 4) & 0x0f0f0f0fu;
        }
    }
    const int nb = in / 32;
#pragma unroll
    for (int t = 0; t < NB; t++) {
        const uint4 a = __ldg((const uint4 *)(xq + (size_t)t * in)), b = __ldg((const uint4 *)(xq + (size_t)t * in + 16));
        const float2 ds = __ldg(xs + (size_t)t * nb);   /* (scale, sum of the 32 codes) */
        const int x[8] = {(int)a.x, (int)a.y, (int)a.z, (int)a.w, (int)b.x, (int)b.y, (int)b.z, (int)b.w};
#pragma unroll
        for (int r = 0; r < R; r++) {
            int s = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) s = __dp4a((int)q[r][i], x[i], s);
            if (T == QB_Q8_0) acc[r][t] = fmaf(d[r] * ds.x, (float)s, acc[r][t]);
            else if (T == QB_Q4_0) acc[r][t] = fmaf(d[r] * ds.x, (float)s - 8.f * ds.y, acc[r][t]);
            else acc[r][t] = fmaf(ds.x, fmaf(d[r], (float)s, m[r] * ds.y), acc[r][t]);
        }
    }
}

/* Two runs of 16 int8 products (four words each): s0 = a . x, s1 = b . y. */
__device__ __forceinline__ void gq_dp4a_2x16(const uint32_t (&a)[4], const uint32_t (&b)[4], const int (&x)[4],
                                             const int (&y)[4], int &s0, int &s1) {
    s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) s0 = __dp4a((int)a[i], x[i], s0), s1 = __dp4a((int)b[i], y[i], s1);
}

/* Q4_K / Q5_K part p (k_gemv_q's parts: 16 codes of sub-block 2j at l0 .. l0 + 15 in
 * the low nibbles, 16 of sub-block 2j + 1 in the high ones; j = p / 2, l0 = 16 (p % 2)):
 * two runs of four dp4a against the two groups' int8 activations. The minimum's term
 * dmin m sum(x) takes the group's whole code sum, so only the even part of each pair
 * adds it. Q5_K's fifth bit goes to bit 4 of each code byte. */
template <int NB, bool Q5, int R>
__device__ __forceinline__ void gq_part_i8_k45(const uint8_t *const (&blk)[R], int p, const int8_t *xq,
                                               const float2 *xs, int in, float (&acc)[R][NB]) {
    const int j = p >> 1, l0 = (p & 1) * 16, sh = 16 * (j & 1);
    uint32_t lo[R][4], hi[R][4];
    float ds[R][2], dm[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const uint4 h = *(const uint4 *)blk[r];
        const uint4 q = *(const uint4 *)(blk[r] + (Q5 ? 48 : 16) + 16 * p);
        const uint4 qh = Q5 ? *(const uint4 *)(blk[r] + 16 + l0) : make_uint4(0, 0, 0, 0);
        const float d = gq_h2f(h.x & 0xffff), dmin = gq_h2f(h.x >> 16);
        const uint32_t sc = j < 2 ? h.y & 0x3f3f3f3fu : (h.w & 0x0f0f0f0fu) | ((h.y >> 2) & 0x30303030u);
        const uint32_t mn = j < 2 ? h.z & 0x3f3f3f3fu : ((h.w >> 4) & 0x0f0f0f0fu) | ((h.z >> 2) & 0x30303030u);
        ds[r][0] = d * (float)((sc >> sh) & 0xff), dm[r][0] = dmin * (float)((mn >> sh) & 0xff);
        ds[r][1] = d * (float)((sc >> (sh + 8)) & 0xff), dm[r][1] = dmin * (float)((mn >> (sh + 8)) & 0xff);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w}, u[4] = {qh.x, qh.y, qh.z, qh.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[r][i] = w[i] & 0x0f0f0f0fu;
            hi[r][i] = (w[i] >> 4) & 0x0f0f0f0fu;
            if (Q5) {
                lo[r][i] |= ((u[i] >> (2 * j)) & 0x01010101u) << 4;
                hi[r][i] |= ((u[i] >> (2 * j + 1)) & 0x01010101u) << 4;
            }
        }
    }
    const int nb = in / 32;
    const bool mins = (p & 1) == 0;
#pragma unroll
    for (int t = 0; t < NB; t++) {
        const int8_t *x = xq + (size_t)t * in + 64 * j + l0;
        const uint4 a = __ldg((const uint4 *)x), b = __ldg((const uint4 *)(x + 32));
        const float2 s0 = __ldg(xs + (size_t)t * nb + 2 * j), s1 = __ldg(xs + (size_t)t * nb + 2 * j + 1);
        const int xa[4] = {(int)a.x, (int)a.y, (int)a.z, (int)a.w}, xb[4] = {(int)b.x, (int)b.y, (int)b.z, (int)b.w};
#pragma unroll
        for (int r = 0; r < R; r++) {
            int c0, c1;
            gq_dp4a_2x16(lo[r], hi[r], xa, xb, c0, c1);
            float v = fmaf(ds[r][0] * s0.x, (float)c0, ds[r][1] * s1.x * (float)c1);
            if (mins) v -= fmaf(dm[r][0] * s0.x, s0.y, dm[r][1] * s1.x * s1.y);
            acc[r][t] += v;
        }
    }
}

/* Q6_K part p = (h, a, c) (k_gemv_q's): 16 codes of sub-block 8h + c + 2u for u = a (low
 * nibbles of ql, qh bits 2a..2a+1) and u = a + 2 (high nibbles, bits 2a+4..2a+5), elements
 * 128h + 32u + 16c + i: group 4h + u of the activations at offset 16c. Codes - 32 as
 * signed bytes, four dp4a per run. */
template <int NB, int R>
__device__ __forceinline__ void gq_part_i8_q6k(const uint8_t *const (&blk)[R], int p, const int8_t *xq,
                                               const float2 *xs, int in, float (&acc)[R][NB]) {
    const int h = p >> 2, a = (p >> 1) & 1, c = p & 1;
    uint32_t c0w[R][4], c1w[R][4];
    float dsc[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const uint4 ql = gq_lds16(blk[r] + 64 * h + 32 * a + 16 * c), qh = gq_lds16(blk[r] + 128 + 32 * h + 16 * c);
        const float d = gq_h2f(*(const uint16_t *)(blk[r] + 208));
        const int8_t *sc = (const int8_t *)(blk[r] + 192 + 8 * h + c + 2 * a);
        dsc[r][0] = d * (float)sc[0];
        dsc[r][1] = d * (float)sc[4];
        const uint32_t l[4] = {ql.x, ql.y, ql.z, ql.w}, u[4] = {qh.x, qh.y, qh.z, qh.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            c0w[r][i] = __vsub4((l[i] & 0x0f0f0f0fu) | (((u[i] >> (2 * a)) & 0x03030303u) << 4), 0x20202020u);
            c1w[r][i] = __vsub4(((l[i] >> 4) & 0x0f0f0f0fu) | (((u[i] >> (2 * a + 4)) & 0x03030303u) << 4), 0x20202020u);
        }
    }
    const int nb = in / 32;
#pragma unroll
    for (int t = 0; t < NB; t++) {
        const int8_t *x = xq + (size_t)t * in + 128 * h + 32 * a + 16 * c;
        const uint4 xa = __ldg((const uint4 *)x), xb = __ldg((const uint4 *)(x + 64));
        const float d0 = __ldg(xs + (size_t)t * nb + 4 * h + a).x, d1 = __ldg(xs + (size_t)t * nb + 4 * h + a + 2).x;
        const int va[4] = {(int)xa.x, (int)xa.y, (int)xa.z, (int)xa.w}, vb[4] = {(int)xb.x, (int)xb.y, (int)xb.z, (int)xb.w};
#pragma unroll
        for (int r = 0; r < R; r++) {
            int s0, s1;
            gq_dp4a_2x16(c0w[r], c1w[r], va, vb, s0, s1);
            acc[r][t] += fmaf(dsc[r][0] * d0, (float)s0, dsc[r][1] * d1 * (float)s1);
        }
    }
}

/* The part decoder for int8 activations: xq and xs at the block's first element / group. */
template <int T, int NB, int R>
__device__ __forceinline__ void gq_part_i8(const uint8_t *const (&blk)[R], int p, const int8_t *xq, const float2 *xs,
                                           int in, float (&acc)[R][NB]) {
    if constexpr (T == QB_Q4_K) gq_part_i8_k45<NB, false>(blk, p, xq, xs, in, acc);
    else if constexpr (T == QB_Q5_K) gq_part_i8_k45<NB, true>(blk, p, xq, xs, in, acc);
    else if constexpr (T == QB_Q6_K) gq_part_i8_q6k<NB>(blk, p, xq, xs, in, acc);
    else gq_part_i8_32<T, NB>(blk, xq, xs, in, acc);
}

/* Copy step s of this warp's rows into its stage buffer `slot` (< GEMVQ_STAGES). */
template <int T, int R>
__device__ __forceinline__ void gq_stage(const uint8_t *W, size_t total, size_t row_bytes, const int (&row)[R],
                                         int kb0, int kb1, int s, int slot, uint4 *buf, int lane) {
    constexpr int S = gq<T>::S, SB = gq<T>::SB, WORDS = gq_words<T>();
    const int b0 = kb0 + s * SB, b1 = min(kb1, b0 + SB);
#pragma unroll
    for (int r = 0; r < R; r++) {
        const size_t gs = (size_t)row[r] * row_bytes + (size_t)b0 * S, ge = (size_t)row[r] * row_bytes + (size_t)b1 * S;
        const size_t w0 = gs >> 4;
        const int nw = (int)(((ge + 15) >> 4) - w0);
        uint4 *dst = buf + (slot * R + r) * WORDS;
        for (int l = lane; l < nw; l += 32) {
            const size_t off = (w0 + (size_t)l) * 16;
            if (total - off >= 16) {
                gq_cp16(dst + l, W + off, 16);
            } else {   /* the matrix's last, partial word: plain loads (visible after the
                        * step's __syncwarp), nothing read past its end */
                uint8_t *d = (uint8_t *)(dst + l);
                const int n = (int)(total - off);
                for (int i = 0; i < 16; i++) d[i] = i < n ? W[off + i] : 0;
            }
        }
    }
}

/* A warp's share of a k_gemv_q / k_gemv_qtc launch (blocks of WARPS warps, ks_n of them per
 * unit of R rows, warp ks taking blocks [nb ks / ks_n, nb (ks + 1) / ks_n) of each row):
 * its rows (past out: the last row again), its run of blocks, its GEMVQ_STAGES staging
 * buffers. prologue() copies the first steps (weights only: before the PDL wait); next(s)
 * queues step s + GEMVQ_STAGES - 1 and waits for step s to have landed for the whole warp. */
template <int T, int R, int WARPS>
struct gq_warp {
    static constexpr int P = GEMVQ_STAGES, SB = gq<T>::SB, WORDS = gq_words<T>();
    int lane, warp, ks, unit, kb0, kb1, nsteps;
    bool live;
    size_t row_bytes, total;
    uint4 *buf;
    int row[R];
    __device__ __forceinline__ gq_warp(int out, int in, int ks_n, uint4 *smem) {
        lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ks = warp % ks_n;
        unit = blockIdx.x * (WARPS / ks_n) + warp / ks_n;
        live = unit * R < out;
        const int nb = in / gq<T>::E;
        kb0 = (int)((long)nb * ks / ks_n), kb1 = (int)((long)nb * (ks + 1) / ks_n);
        nsteps = live ? (kb1 - kb0 + SB - 1) / SB : 0;
        row_bytes = (size_t)nb * gq<T>::S, total = (size_t)out * row_bytes;
        buf = smem + (size_t)warp * P * R * WORDS;
#pragma unroll
        for (int r = 0; r < R; r++) row[r] = min(unit * R + r, out - 1);
    }
    __device__ __forceinline__ void prologue(const uint8_t *W) {
#pragma unroll
        for (int s = 0; s < P - 1; s++) {
            if (s < nsteps) gq_stage<T>(W, total, row_bytes, row, kb0, kb1, s, s % P, buf, lane);
            tc_commit();
        }
    }
    __device__ __forceinline__ void next(const uint8_t *W, int s) {
        if (s + P - 1 < nsteps) gq_stage<T>(W, total, row_bytes, row, kb0, kb1, s + P - 1, (s + P - 1) % P, buf, lane);
        tc_commit();
        tc_wait<P - 1>();   /* step s's group has landed (this lane's copies) ... */
        __syncwarp();       /* ... and every other lane's */
    }
    /* Row r's bytes of step s in its stage buffer, from the step's first block. */
    __device__ __forceinline__ const uint8_t *staged(int s, int r, int rr) const {
        return (const uint8_t *)(buf + ((s % P) * R + r) * WORDS) +
               (((size_t)rr * row_bytes + (size_t)(kb0 + s * SB) * gq<T>::S) & 15);
    }
};

/* Block: GEMVQ_WARPS warps, each a gq_warp of R rows. I8: X is int8 [n, in] with
 * (scale, code sum) pairs XS [n, in / 32] (k_gemv_qi8), else bf16 and XS unused. */
template <int T, int NB, int R, bool I8>
__global__ void __launch_bounds__(GEMVQ_WARPS * 32)
gemv_q_kernel(const uint8_t *__restrict__ W, const uint16_t *__restrict__ X, const float2 *__restrict__ XS, float *Y,
              int out, int in, int ks_n, int accumulate, int ldy) {
    constexpr int E = gq<T>::E, S = gq<T>::S, SB = gq<T>::SB, LPB = 32 / SB;
    extern __shared__ uint4 gq_smem[];
    __shared__ float red[GEMVQ_WARPS][R * NB];
    k_pdl_trigger();
    gq_warp<T, R, GEMVQ_WARPS> w(out, in, ks_n, gq_smem);
    const int lane = w.lane, warp = w.warp;
    w.prologue(W);
    k_pdl_wait();
    float acc[R][NB];
    gq_zero(acc);
    const int bl = lane / LPB, p = lane % LPB;
    for (int s = 0; s < w.nsteps; s++) {
        w.next(W, s);
        const int b = w.kb0 + s * SB + bl;
        if (b < w.kb1) {
            const uint8_t *blk[R];
#pragma unroll
            for (int r = 0; r < R; r++) blk[r] = w.staged(s, r, w.row[r]) + bl * S;
            if constexpr (I8)
                gq_part_i8<T, NB>(blk, p, (const int8_t *)X + (size_t)b * E, XS + (size_t)b * (E / 32), in, acc);
            else
                gq_part<T, NB>(blk, p, X + (size_t)b * E, in, acc);
        }
        __syncwarp();       /* reads of this buffer done before the copy into it */
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NB; t++) {
            const float v = k_warp_sum(acc[r][t]);
            if (lane == 0) red[warp][r * NB + t] = v;
        }
    __syncthreads();
    if (w.live && w.ks == 0 && lane < R * NB) {   /* lane r NB + t writes row r, token t */
        const int o = w.unit * R + lane / NB, t = lane % NB;
        float v = 0.f;
        for (int j = 0; j < ks_n; j++) v += red[warp + j][lane];
        if (o < out) {
            float *y = Y + (size_t)t * ldy + o;
            *y = accumulate ? *y + v : v;
        }
    }
}

/* ---- the streaming form (k_tuning.gemvq_stream) -------------------------------------------
 * gemv_q_kernel gives each warp one unit of R rows (or a K-slice of one) and lets the GPU
 * schedule the blocks: a warp of an 8B gate|up GEMV walks 4 steps, so its cp.async pipeline
 * is mostly ramp and drain, and 896 blocks over 3 resident per SM leave a partial last wave
 * (ncu on an H100: 61% of DRAM bandwidth, 34% occupancy). Here the grid is a fixed number
 * of blocks per SM and work is cut by steps, not units:
 *   - block b takes units [U b / G, U (b + 1) / G) (G blocks), so blocks differ by at most
 *     one unit; its warps split the block's units x steps evenly into contiguous runs that
 *     may start and end inside a unit, and each warp keeps one pipeline across its run
 *     (the next unit's first steps are in flight while it finishes the current one).
 *   - A unit inside one warp's run is written by that warp. A unit cut between warps is
 *     left by each as a warp-summed piece in shared memory (a warp has at most two: its
 *     first and its last unit) and, after one barrier, added up by the warp that holds the
 *     unit's first step, in warp order.
 * The cut depends only on the matrix's shape, R and the SM count, never on the token
 * count or on timing: results are the same from run to run and for 1..8 tokens, though
 * not bit-equal to gemv_q_kernel's (other partial sums). */
#define GEMVQ_STREAM_BPS 4   /* at most this many blocks per SM in the grid (Q4_K at R 4: 4 resident) */

/* Blocks per SM of gemv_qs_kernel's grid: as many as the staging lets be resident (228 KB of
 * shared memory an SM; 3 KB a block for its pieces and the driver), at most
 * GEMVQ_STREAM_BPS: a grid of more would run a partial second wave. A function of T and R
 * only, so the cut of the work never depends on the token count. */
template <int T, int R> constexpr int gq_stream_bps() {
    return (int)((233472 / (gq_smem_bytes<T, R>() + 3072)) < GEMVQ_STREAM_BPS ? 233472 / (gq_smem_bytes<T, R>() + 3072)
                                                                              : GEMVQ_STREAM_BPS);
}

template <int T, int NB, int R, bool I8>
__global__ void __launch_bounds__(GEMVQ_WARPS * 32, NB <= 2 ? GEMVQ_STREAM_BPS : 1)
gemv_qs_kernel(const uint8_t *__restrict__ W, const uint16_t *__restrict__ X, const float2 *__restrict__ XS, float *Y,
               int out, int in, int accumulate, int ldy) {
    constexpr int E = gq<T>::E, S = gq<T>::S, SB = gq<T>::SB, LPB = 32 / SB, P = GEMVQ_STAGES, WORDS = gq_words<T>();
    constexpr int V = R * NB;
    extern __shared__ uint4 gq_smem[];
    __shared__ float piece[GEMVQ_WARPS][2][V];
    k_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int units = (out + R - 1) / R, nb = in / E, ns = (nb + SB - 1) / SB;
    const int u0 = (int)((long)units * blockIdx.x / gridDim.x), nu = (int)((long)units * (blockIdx.x + 1) / gridDim.x) - u0;
    const long steps = (long)nu * ns;
    const int g0 = (int)(steps * warp / GEMVQ_WARPS), g1 = (int)(steps * (warp + 1) / GEMVQ_WARPS);
    const size_t row_bytes = (size_t)nb * S, total = (size_t)out * row_bytes;
    uint4 *buf = gq_smem + (size_t)warp * P * R * WORDS;
    /* step g of the block (unit u0 + g / ns, step g % ns of it) into slot g % P */
    auto stage = [&](int g) {
        int row[R];
        const int u = u0 + g / ns;
#pragma unroll
        for (int r = 0; r < R; r++) row[r] = min(u * R + r, out - 1);
        gq_stage<T>(W, total, row_bytes, row, 0, nb, g % ns, g % P, buf, lane);
    };
#pragma unroll
    for (int i = 0; i < P - 1; i++) {
        if (g0 + i < g1) stage(g0 + i);
        tc_commit();
    }
    k_pdl_wait();
    float acc[R][NB];
    gq_zero(acc);
    const int bl = lane / LPB, p = lane % LPB;
    for (int g = g0; g < g1; g++) {
        if (g + P - 1 < g1) stage(g + P - 1);
        tc_commit();
        tc_wait<P - 1>();
        __syncwarp();
        const int ul = g / ns, st = g % ns, u = u0 + ul;
        const int b = st * SB + bl;
        if (b < nb) {
            const uint8_t *blk[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int rr = min(u * R + r, out - 1);
                blk[r] = (const uint8_t *)(buf + ((g % P) * R + r) * WORDS) +
                         (((size_t)rr * row_bytes + (size_t)st * SB * S) & 15) + bl * S;
            }
            if constexpr (I8)
                gq_part_i8<T, NB>(blk, p, (const int8_t *)X + (size_t)b * E, XS + (size_t)b * (E / 32), in, acc);
            else
                gq_part<T, NB>(blk, p, X + (size_t)b * E, in, acc);
        }
        __syncwarp();   /* reads of this slot done before the copy into it */
        if (st == ns - 1 || g == g1 - 1) {   /* this warp's piece of unit u ends here */
            float mine = 0.f;
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int t = 0; t < NB; t++) {
                    const float v = k_warp_sum(acc[r][t]);
                    if (lane == r * NB + t) mine = v;
                    acc[r][t] = 0.f;
                }
            const int first = max(g0, ul * ns);
            if (first == ul * ns && st == ns - 1) {   /* the whole unit */
                const int o = u * R + lane / NB;
                if (lane < V && o < out) {
                    float *y = Y + (size_t)(lane % NB) * ldy + o;
                    *y = accumulate ? *y + mine : mine;
                }
            } else if (lane < V) {
                piece[warp][first == g0 ? 0 : 1][lane] = mine;
            }
        }
    }
    __syncthreads();
    /* The unit whose first step this warp holds and which runs past its run: add its
     * pieces, this warp's then the following warps' (each has it as its first piece). */
    if (g1 > g0) {
        const int ul = (g1 - 1) / ns;
        if (ul * ns >= g0 && (ul + 1) * ns > g1 && lane < V) {
            float v = piece[warp][ul * ns == g0 ? 0 : 1][lane];
            for (int w = warp + 1; w < GEMVQ_WARPS; w++) {
                const int a = (int)(steps * w / GEMVQ_WARPS), b = (int)(steps * (w + 1) / GEMVQ_WARPS);
                if (a >= (ul + 1) * ns) break;
                if (b > a) v += piece[w][0][lane];   /* a warp with no steps left no piece */
            }
            const int o = (u0 + ul) * R + lane / NB;
            if (o < out) {
                float *y = Y + (size_t)(lane % NB) * ldy + o;
                *y = accumulate ? *y + v : v;
            }
        }
    }
}

/* Warps per unit of rows (k_gemv_q's and k_gemv_qtc's): split K until about per_sm warps
 * per multiprocessor are busy (k_tuning.gemvq_split / gemvq_tc_split; 32 where unset), up
 * to max_ks warps and as long as each keeps at least one full step of sb blocks. */
static int gq_ksplit(int units, int nb, int sb, int max_ks, int per_sm) {
    const long want = (long)k_sm_count() * (per_sm > 0 ? per_sm : 32);
    int ks = 1;
    while (ks < max_ks && (long)units * ks < want && nb / (2 * ks) >= sb) ks *= 2;
    return ks;
}

/* Where the streaming form goes (k_tuning.gemvq_stream), from test_gpu_gemv "*gemv_qs_speed*"
 * on an H100 (2026-12-06):
 *   - 1-2 tokens: at 4-8 it was slower than a unit per warp on every 8B shape;
 *   - rows of at least 4 steps (4096 elements): a unit's end costs its warp R x NB warp sums,
 *     which 2-step rows pay twice as often (the 1B's Q4_1 gate|up streamed: 16384 x 2048,
 *     batch-1 decode of the 1B Q4_1 file 1,341-1,343 tok/s against 1,366-1,368);
 *   - at least two steps for each warp of its grid: the 4096-row O and QKV and the 1024-row
 *     V have about one, and half of each block's warps would idle;
 *   - at most 4 units of rows for each warp of its grid: past that the unit-per-warp grid runs
 *     many waves and its partial last one costs little, while the cut adds work to every
 *     step (the 128256-row output matrices streamed: 0.87x for the 8B's Q6_K, 0.95x and 0.98x
 *     for the 1B's Q6_K and Q4_1).
 * Where it went at 1 token: the 8B gate|up 1.03x, down 1.12x (Q4_K) and 1.16x (Q6_K, at 2 rows
 * a warp). */
static bool gq_stream_pays(int nb_tokens, int units, int nb, int sb, int bps) {
    const long full = (long)k_sm_count() * bps, grid = units < full ? units : full;
    const int steps = (nb + sb - 1) / sb;
    return nb_tokens <= 2 && steps >= 4 && (long)units * steps >= 2L * grid * GEMVQ_WARPS &&
           (long)units <= 4L * full * GEMVQ_WARPS;
}

/* Whether a pass of NB tokens over out rows streams (gemv_qs_kernel) at R rows a warp:
 * k_tuning.gemvq_stream 2 always, 1 where gq_stream_pays. */
template <int T, int R>
static bool gq_streams(int nb_tokens, int out, int in) {
    const int stream = k_tuning_get()->gemvq_stream;
    return stream == 2 || (stream == 1 && gq_stream_pays(nb_tokens, (out + R - 1) / R, in / gq<T>::E, gq<T>::SB,
                                                         gq_stream_bps<T, R>()));
}

template <int T, int NB, int R, bool I8>
static int gemv_q_launch_r(const uint8_t *W, const uint16_t *X, const float2 *XS, float *Y, int ldy, int out, int in,
                           int accumulate, bool stream, cudaStream_t s) {
    static bool smem_set = false;
    const size_t smem = gq_smem_bytes<T, R>();
    if (!smem_set) {
        if (cudaFuncSetAttribute(gemv_q_kernel<T, NB, R, I8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)smem) != cudaSuccess)
            return -1;
        smem_set = true;
    }
    const int units = (out + R - 1) / R;
    if (stream) {
        static bool qs_set = false;
        if (!qs_set) {
            if (cudaFuncSetAttribute(gemv_qs_kernel<T, NB, R, I8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem) != cudaSuccess)
                return -1;
            qs_set = true;
        }
        const int grid = min(units, k_sm_count() * gq_stream_bps<T, R>());
        return k_launch(gemv_qs_kernel<T, NB, R, I8>, dim3(grid), dim3(GEMVQ_WARPS * 32), smem, s, W, X, XS, Y, out,
                        in, accumulate, ldy);
    }
    const int ks = gq_ksplit(units, in / gq<T>::E, gq<T>::SB, GEMVQ_WARPS, k_tuning_get()->gemvq_split);
    const int upb = GEMVQ_WARPS / ks;
    return k_launch(gemv_q_kernel<T, NB, R, I8>, dim3((units + upb - 1) / upb), dim3(GEMVQ_WARPS * 32), smem, s, W,
                    X, XS, Y, out, in, ks, accumulate, ldy);
}

/* Rows a warp: k_tuning.gemvq_rows (4 or GEMVQ_ROWS), or for Q6_K where it streams
 * k_tuning.gemvq_rows_q6k (2 or 4: its 210-byte blocks take more staging); the streaming
 * decision is made once, here. */
template <int T, int NB, bool I8>
static int gemv_q_launch_n(const uint8_t *W, const uint16_t *X, const float2 *XS, float *Y, int ldy, int out, int in,
                           int accumulate, cudaStream_t s) {
    const k_tuning *kt = k_tuning_get();
    int rows = kt->gemvq_rows == 4 ? 4 : GEMVQ_ROWS;
    const int q6 = kt->gemvq_rows_q6k;
    bool stream;
    if (T == QB_Q6_K && (q6 == 2 || q6 == 4) && (q6 == 4 ? gq_streams<T, 4>(NB, out, in) : gq_streams<T, 2>(NB, out, in)))
        rows = q6, stream = true;
    else
        stream = rows == 4 ? gq_streams<T, 4>(NB, out, in) : gq_streams<T, GEMVQ_ROWS>(NB, out, in);
    if (rows == 4) return gemv_q_launch_r<T, NB, 4, I8>(W, X, XS, Y, ldy, out, in, accumulate, stream, s);
    return gemv_q_launch_r<T, NB, GEMVQ_ROWS, I8>(W, X, XS, Y, ldy, out, in, accumulate, stream, s);
}

template <int T, bool I8 = false>
static int gemv_q_launch(const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                         int accumulate, cudaStream_t s, const float2 *XS = nullptr) {
#define GEMVQ_CASE(N) \
    case N: return gemv_q_launch_n<T, N, I8>(W, X, XS, Y, ldy, out, in, accumulate, s)
    switch (n) {
        GEMVQ_CASE(1); GEMVQ_CASE(2); GEMVQ_CASE(3); GEMVQ_CASE(4);
        GEMVQ_CASE(5); GEMVQ_CASE(6); GEMVQ_CASE(7); GEMVQ_CASE(8);
    default: return -1;
    }
#undef GEMVQ_CASE
}

extern "C" int k_gemv_q_ld(int type, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                           int accumulate, cudaStream_t s) {
    const int bytes = qb_bytes(type);
    if (!bytes || out <= 0 || ldy < out || in <= 0 || in % qb_elems(type) || n < 1 || n > K_GEMV_MAX_N ||
        ((uintptr_t)X | (uintptr_t)W) % 16)
        return -1;
    switch (type) {
    case QB_Q8_0: return gemv_q_launch<QB_Q8_0>(W, X, Y, ldy, out, in, n, accumulate, s);
    case QB_Q4_0: return gemv_q_launch<QB_Q4_0>(W, X, Y, ldy, out, in, n, accumulate, s);
    case QB_Q4_1: return gemv_q_launch<QB_Q4_1>(W, X, Y, ldy, out, in, n, accumulate, s);
    case QB_Q5_K: return gemv_q_launch<QB_Q5_K>(W, X, Y, ldy, out, in, n, accumulate, s);
    case QB_Q4_K: return gemv_q_launch<QB_Q4_K>(W, X, Y, ldy, out, in, n, accumulate, s);
    case QB_Q6_K: return gemv_q_launch<QB_Q6_K>(W, X, Y, ldy, out, in, n, accumulate, s);
    default: return -1;
    }
}

extern "C" int k_gemv_q(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n,
                        int accumulate, cudaStream_t s) {
    return k_gemv_q_ld(type, W, X, Y, out, out, in, n, accumulate, s);
}

/* X [n, in] bf16 -> int8 codes xq (same shape) and per 32 elements (d, sum of codes) in xs
 * [n, in / 32]: d = max |x| / 127, code = x * (127 / max |x|) rounded to nearest even (0 for
 * an all-zero group). A thread takes 8 elements; the 4 threads of a group are adjacent
 * lanes. */
__global__ void quant_x8_kernel(const uint16_t *__restrict__ X, int8_t *xq, float2 *xs, size_t n8) {
    k_pdl_trigger();
    k_pdl_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (i < n8) k_bf16x8(__ldg((const uint4 *)X + i), v);
    float a;
    int q[8], sum;
    k_x8_round<8>(v, q, a, sum);
    if (i >= n8) return;
    *(uint2 *)(xq + 8 * i) = make_uint2(k_x8_pack4(q), k_x8_pack4(q + 4));
    if ((i & 3) == 0) xs[i >> 2] = k_x8_pair(a, sum);
}

extern "C" int k_gemv_qi8_takes(int type) { return qb_bytes(type) != 0; }

extern "C" size_t k_gemv_qi8_scratch(int in, int n) {
    return k_x8_codes_bytes(n, in) + (size_t)n * (size_t)(in / 32) * sizeof(float2);
}

extern "C" int k_quant_x8(const uint16_t *X, int n, int in, void *scratch, cudaStream_t s) {
    const size_t n8 = (size_t)n * (size_t)in / 8;
    return k_launch(quant_x8_kernel, dim3((unsigned)((n8 + 255) / 256)), dim3(256), 0, s, X, (int8_t *)scratch,
                    (float2 *)((uint8_t *)scratch + k_x8_codes_bytes(n, in)), n8);
}

extern "C" int k_gemv_qi8_ld(int type, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in,
                             int n, int accumulate, void *scratch, size_t scratch_bytes, int x_ready, cudaStream_t s) {
    if (!k_gemv_qi8_takes(type) || out <= 0 || ldy < out || in <= 0 || in % qb_elems(type) || n < 1 ||
        n > K_GEMV_MAX_N || ((uintptr_t)X | (uintptr_t)W | (uintptr_t)scratch) % 16 || !scratch ||
        scratch_bytes < k_gemv_qi8_scratch(in, n))
        return -1;
    int rc = x_ready ? 0 : k_quant_x8(X, n, in, scratch, s);
    if (rc) return rc;
    const uint16_t *xqp = (const uint16_t *)scratch;
    const float2 *xs = (const float2 *)((uint8_t *)scratch + k_x8_codes_bytes(n, in));
    switch (type) {
    case QB_Q8_0: return gemv_q_launch<QB_Q8_0, true>(W, xqp, Y, ldy, out, in, n, accumulate, s, xs);
    case QB_Q4_0: return gemv_q_launch<QB_Q4_0, true>(W, xqp, Y, ldy, out, in, n, accumulate, s, xs);
    case QB_Q4_1: return gemv_q_launch<QB_Q4_1, true>(W, xqp, Y, ldy, out, in, n, accumulate, s, xs);
    case QB_Q4_K: return gemv_q_launch<QB_Q4_K, true>(W, xqp, Y, ldy, out, in, n, accumulate, s, xs);
    case QB_Q5_K: return gemv_q_launch<QB_Q5_K, true>(W, xqp, Y, ldy, out, in, n, accumulate, s, xs);
    default: return gemv_q_launch<QB_Q6_K, true>(W, xqp, Y, ldy, out, in, n, accumulate, s, xs);
    }
}

extern "C" int k_gemv_qi8(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n,
                          int accumulate, void *scratch, size_t scratch_bytes, cudaStream_t s) {
    return k_gemv_qi8_ld(type, W, X, Y, out, out, in, n, accumulate, scratch, scratch_bytes, 0, s);
}

/* ---- the same product on tensor cores for K-quant and Q8_0 blocks, n <= 16 ---------------
 * k_gemv_qtc. k_gemv_q spends several instructions per weight turning codes into floats
 * and fp32 FMAs on every token; here a weight costs about half a mask and a byte_perm:
 *   - mma.sync m16n8k16 with the tokens as M (16; for n <= 8 its rows 8..15 are zero) and
 *     8 weight rows as N. A warp owns QTC_ROWS = 8 consecutive rows; their bytes are staged
 *     in shared memory by gq_stage exactly as k_gemv_q stages them (steps of SB blocks,
 *     GEMVQ_STAGES deep, cp.async, the first steps before the PDL wait), split K over up
 *     to QTC_WARPS warps of a block when the rows are too few to fill the GPU.
 *   - Lane (g, t) = (lane / 4, lane % 4) decodes row g's codes for B and holds the
 *     matching activations of tokens g and g + 8 for A. Each mma covers 16 elements of one
 *     sub-block (one scale); their order along k is free as long as A and B agree: lane t
 *     takes elements 8t .. 8t + 7 of each 32-element Q4_K / Q5_K sub-block (two mmas) and
 *     4t .. 4t + 3 of each 16-element Q6_K sub-block (one). Q8_0's 32-code blocks go in as
 *     two nibbles each (qtc_block_q8_0).
 *   - A code q goes in as the exact bf16 integer 128 + q (the byte under 0x43: 2^7 (1 +
 *     q 2^-7), q < 128), one byte_perm per two codes. A second mma with an all-ones B gives
 *     sum(x) per (token, sub-block), and per row and sub-block
 *         sum(w x) = d sc (sum((128 + q) x) - 128 sum(x)) - dmin m sum(x)    (Q4_K, Q5_K)
 *         sum(w x) = d sc (sum((128 + q) x) - 160 sum(x))                     (Q6_K: q - 32)
 *     The products are exact in the fp32 accumulators, so the result is the host decode's
 *     product to fp32 rounding (like k_gemv_q's; tests/gpu/test_gpu_gemv.c "*gemv_qtc*"). */
#define QTC_WARPS 4
#define QTC_ROWS 8
#define QTC_ONES 0x3f803f80u   /* two bf16 1.0 */

template <int T> constexpr size_t qtc_smem_bytes() {
    return (size_t)QTC_WARPS * GEMVQ_STAGES * QTC_ROWS * gq_words<T>() * 16;
}

/* Two codes (bytes 0, 1 of w: sel 0x5150; bytes 2, 3: 0x5352) as two bf16 128 + code. */
__device__ __forceinline__ uint32_t qtc_pair(uint32_t w, uint32_t sel) { return __byte_perm(w, 0x43434343u, sel); }

/* 4 bytes of shared memory at a 2-aligned address (Q6_K blocks are 210 bytes). */
__device__ __forceinline__ uint32_t qtc_lds4(const uint8_t *p) {
    const uint16_t *h = (const uint16_t *)p;
    return (uint32_t)h[0] | (uint32_t)h[1] << 16;
}

template <typename V> __device__ __forceinline__ V qtc_ldx(const uint16_t *p, bool ok);
template <> __device__ __forceinline__ uint4 qtc_ldx<uint4>(const uint16_t *p, bool ok) {
    return ok ? __ldg((const uint4 *)p) : make_uint4(0, 0, 0, 0);
}
template <> __device__ __forceinline__ uint2 qtc_ldx<uint2>(const uint16_t *p, bool ok) {
    return ok ? __ldg((const uint2 *)p) : make_uint2(0, 0);
}

/* One sub-block's 16 (Q6_K) or 2 x 16 elements: c = A . codes, sx = A . ones, from zero;
 * then acc[i] += ds c[i] - dk sx[i] for the lane's two rows (ds[0] / dk[0]: row 2t, [1]:
 * row 2t + 1; acc 0, 1: token g, 2, 3: token g + 8). */
template <bool BIG, int NCH>
__device__ __forceinline__ void qtc_sub(const uint32_t (&a)[NCH][4], const uint32_t (&b)[NCH][2], const float (&ds)[2],
                                        const float (&dk)[2], float (&acc)[4]) {
    float c[4] = {0.f, 0.f, 0.f, 0.f}, sx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int h = 0; h < NCH; h++) {
        tc_mma(c, a[h], b[h][0], b[h][1]);
        tc_mma(sx, a[h], QTC_ONES, QTC_ONES);
    }
#pragma unroll
    for (int i = 0; i < (BIG ? 4 : 2); i++) acc[i] += ds[i & 1] * c[i] - dk[i & 1] * sx[i];
}

/* Q4_K / Q5_K block: bg row g's block, bh[0] / bh[1] rows 2t / 2t + 1's (16-aligned),
 * xg / xg8 the tokens' activations at the block's first element. */
template <bool Q5, bool BIG>
__device__ __forceinline__ void qtc_block_k45(const uint8_t *bg, const uint8_t *const (&bh)[2], const uint16_t *xg,
                                              const uint16_t *xg8, bool gok, bool g8ok, int t, float (&acc)[4]) {
    uint32_t scw[2][2], mnw[2][2];
    float d[2], dmin[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const uint4 h = *(const uint4 *)bh[r];   /* d, dmin, scales[12] */
        d[r] = gq_h2f(h.x & 0xffff), dmin[r] = gq_h2f(h.x >> 16);
        scw[r][0] = h.y & 0x3f3f3f3fu, mnw[r][0] = h.z & 0x3f3f3f3fu;   /* sub-blocks 0..3 */
        scw[r][1] = (h.w & 0x0f0f0f0fu) | ((h.y >> 2) & 0x30303030u);   /* 4..7 */
        mnw[r][1] = ((h.w >> 4) & 0x0f0f0f0fu) | ((h.z >> 2) & 0x30303030u);
    }
    const uint2 qh = Q5 ? *(const uint2 *)(bg + 16 + 8 * t) : make_uint2(0, 0);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint2 q = *(const uint2 *)(bg + (Q5 ? 48 : 16) + 32 * j + 8 * t);
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {   /* low nibbles: sub-block 2j; high: 2j + 1 */
            const int sb = 2 * j + hf;
            uint32_t w[2] = {hf ? (q.x >> 4) & 0x0f0f0f0fu : q.x & 0x0f0f0f0fu,
                             hf ? (q.y >> 4) & 0x0f0f0f0fu : q.y & 0x0f0f0f0fu};
            if (Q5) {
                w[0] |= ((qh.x >> sb) & 0x01010101u) << 4;
                w[1] |= ((qh.y >> sb) & 0x01010101u) << 4;
            }
            float ds[2], dk[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int sh = 8 * (sb & 3);
                const float sc = (float)((scw[r][sb >> 2] >> sh) & 0xff), mn = (float)((mnw[r][sb >> 2] >> sh) & 0xff);
                ds[r] = d[r] * sc;
                dk[r] = 128.f * ds[r] + dmin[r] * mn;
            }
            const int e = 32 * sb + 8 * t;
            const uint4 xa = qtc_ldx<uint4>(xg + e, gok), xb = BIG ? qtc_ldx<uint4>(xg8 + e, g8ok) : make_uint4(0, 0, 0, 0);
            const uint32_t a[2][4] = {{xa.x, xb.x, xa.y, xb.y}, {xa.z, xb.z, xa.w, xb.w}};
            const uint32_t b[2][2] = {{qtc_pair(w[0], 0x5150), qtc_pair(w[0], 0x5352)},
                                      {qtc_pair(w[1], 0x5150), qtc_pair(w[1], 0x5352)}};
            qtc_sub<BIG, 2>(a, b, ds, dk, acc);
        }
    }
}

/* Q6_K block (2-aligned): ql [128], qh [64], scales int8 [16], d at 208. */
template <bool BIG>
__device__ __forceinline__ void qtc_block_q6k(const uint8_t *bg, const uint8_t *const (&bh)[2], const uint16_t *xg,
                                              const uint16_t *xg8, bool gok, bool g8ok, int t, float (&acc)[4]) {
    float d[2];
#pragma unroll
    for (int r = 0; r < 2; r++) d[r] = gq_h2f(*(const uint16_t *)(bh[r] + 208));
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const uint32_t wa = qtc_lds4(bg + 64 * h + 16 * c + 4 * t), wb = qtc_lds4(bg + 64 * h + 32 + 16 * c + 4 * t);
            const uint32_t wh = qtc_lds4(bg + 128 + 32 * h + 16 * c + 4 * t);
            const uint32_t q[4] = {(wa & 0x0f0f0f0fu) | ((wh << 4) & 0x30303030u),
                                   (wb & 0x0f0f0f0fu) | ((wh << 2) & 0x30303030u),
                                   ((wa >> 4) & 0x0f0f0f0fu) | (wh & 0x30303030u),
                                   ((wb >> 4) & 0x0f0f0f0fu) | ((wh >> 2) & 0x30303030u)};
#pragma unroll
            for (int u = 0; u < 4; u++) {   /* elements 128h + 32u + 16c + i, scale 8h + c + 2u */
                const int sb = 8 * h + c + 2 * u, e = 128 * h + 32 * u + 16 * c + 4 * t;
                float ds[2], dk[2];
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    ds[r] = d[r] * (float)(int8_t)bh[r][192 + sb];
                    dk[r] = 160.f * ds[r];
                }
                const uint2 xa = qtc_ldx<uint2>(xg + e, gok), xb = BIG ? qtc_ldx<uint2>(xg8 + e, g8ok) : make_uint2(0, 0);
                const uint32_t a[1][4] = {{xa.x, xb.x, xa.y, xb.y}};
                const uint32_t b[1][2] = {{qtc_pair(q[u], 0x5150), qtc_pair(q[u], 0x5352)}};
                qtc_sub<BIG, 1>(a, b, ds, dk, acc);
            }
        }
}

/* Q8_0 block (2-aligned): d at 0, 32 int8 codes q at 2. u = q + 128 (the byte with its top
 * bit flipped) = 16 hi + lo, each nibble an exact bf16 128 + nibble, so a 16-code chunk
 * takes two code mmas and the ones mma:
 *     sum(q x) = 16 (c_hi - 128 sx) + (c_lo - 128 sx) - 128 sx = 16 c_hi + c_lo - 2304 sx.
 * Lane t takes codes 8t .. 8t + 3 and 8t + 4 .. 8t + 7 (one chunk each). */
template <bool BIG>
__device__ __forceinline__ void qtc_block_q8_0(const uint8_t *bg, const uint8_t *const (&bh)[2], const uint16_t *xg,
                                               const uint16_t *xg8, bool gok, bool g8ok, int t, float (&acc)[4]) {
    const float ds[2] = {gq_h2f(*(const uint16_t *)bh[0]), gq_h2f(*(const uint16_t *)bh[1])};
    const uint32_t u[2] = {qtc_lds4(bg + 2 + 8 * t) ^ 0x80808080u, qtc_lds4(bg + 6 + 8 * t) ^ 0x80808080u};
    const uint4 xa = qtc_ldx<uint4>(xg + 8 * t, gok), xb = BIG ? qtc_ldx<uint4>(xg8 + 8 * t, g8ok) : make_uint4(0, 0, 0, 0);
    const uint32_t a[2][4] = {{xa.x, xb.x, xa.y, xb.y}, {xa.z, xb.z, xa.w, xb.w}};
    float cl[4] = {0.f, 0.f, 0.f, 0.f}, ch[4] = {0.f, 0.f, 0.f, 0.f}, sx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const uint32_t lo = u[h] & 0x0f0f0f0fu, hi = (u[h] >> 4) & 0x0f0f0f0fu;
        tc_mma(cl, a[h], qtc_pair(lo, 0x5150), qtc_pair(lo, 0x5352));
        tc_mma(ch, a[h], qtc_pair(hi, 0x5150), qtc_pair(hi, 0x5352));
        tc_mma(sx, a[h], QTC_ONES, QTC_ONES);
    }
#pragma unroll
    for (int i = 0; i < (BIG ? 4 : 2); i++) acc[i] += ds[i & 1] * (16.f * ch[i] + cl[i] - 2304.f * sx[i]);
}

/* Block: QTC_WARPS warps, each a gq_warp of QTC_ROWS rows. BIG: n > 8. */
template <int T, bool BIG>
__global__ void __launch_bounds__(QTC_WARPS * 32)
gemv_qtc_kernel(const uint8_t *__restrict__ W, const uint16_t *__restrict__ X, float *Y, int out, int in, int n,
                int ks_n, int accumulate, int ldy) {
    constexpr int E = gq<T>::E, S = gq<T>::S, SB = gq<T>::SB, R = QTC_ROWS;
    extern __shared__ uint4 gq_smem[];
    __shared__ float red[QTC_WARPS][16 * R];
    k_pdl_trigger();
    gq_warp<T, R, QTC_WARPS> w(out, in, ks_n, gq_smem);
    const int lane = w.lane, warp = w.warp;
    w.prologue(W);
    k_pdl_wait();
    const int g = lane >> 2, t = lane & 3, u0 = w.unit * R;
    const int rg = min(u0 + g, out - 1), r0 = min(u0 + 2 * t, out - 1), r1 = min(u0 + 2 * t + 1, out - 1);
    const bool gok = g < n, g8ok = BIG && g + 8 < n;
    const uint16_t *xg = X + (size_t)(gok ? g : 0) * in, *xg8 = X + (size_t)(g8ok ? g + 8 : 0) * in;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < w.nsteps; s++) {
        w.next(W, s);
        const int b0 = w.kb0 + s * SB, nbl = min(SB, w.kb1 - b0);
        const uint8_t *pg = w.staged(s, g, rg), *ph[2] = {w.staged(s, 2 * t, r0), w.staged(s, 2 * t + 1, r1)};
        for (int bl = 0; bl < nbl; bl++) {
            const uint8_t *bh[2] = {ph[0] + bl * S, ph[1] + bl * S};
            const size_t xo = (size_t)(b0 + bl) * E;
            if (T == QB_Q6_K) qtc_block_q6k<BIG>(pg + bl * S, bh, xg + xo, xg8 + xo, gok, g8ok, t, acc);
            else if (T == QB_Q8_0) qtc_block_q8_0<BIG>(pg + bl * S, bh, xg + xo, xg8 + xo, gok, g8ok, t, acc);
            else qtc_block_k45<T == QB_Q5_K, BIG>(pg + bl * S, bh, xg + xo, xg8 + xo, gok, g8ok, t, acc);
        }
        __syncwarp();
    }
    /* acc: token g rows 2t, 2t + 1, then token g + 8's; reduce over the K split */
    red[warp][g * R + 2 * t] = acc[0];
    red[warp][g * R + 2 * t + 1] = acc[1];
    if (BIG) {
        red[warp][(g + 8) * R + 2 * t] = acc[2];
        red[warp][(g + 8) * R + 2 * t + 1] = acc[3];
    }
    __syncthreads();
    if (w.live && w.ks == 0) {
        for (int i = lane; i < (BIG ? 16 : 8) * R; i += 32) {
            const int tok = i / R, o = u0 + i % R;
            if (tok >= n || o >= out) continue;
            float v = 0.f;
            for (int j = 0; j < ks_n; j++) v += red[warp + j][i];
            float *y = Y + (size_t)tok * ldy + o;
            *y = accumulate ? *y + v : v;
        }
    }
}

/* k_gemv_qtc's K split aims at k_tuning.gemvq_tc_split (32) warps per multiprocessor (on an
 * H100 the 8B gate shape took 42.5 / 55.6 us at 8 / 16 tokens with 32 against 43.8 / 59.5
 * with 16; the down and qkv shapes were the same within 1%). */
template <int T, bool BIG>
static int gemv_qtc_launch(const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                           int accumulate, cudaStream_t s) {
    static bool smem_set = false;
    const size_t smem = qtc_smem_bytes<T>();
    if (!smem_set) {
        if (cudaFuncSetAttribute(gemv_qtc_kernel<T, BIG>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
            cudaSuccess)
            return -1;
        smem_set = true;
    }
    const int units = (out + QTC_ROWS - 1) / QTC_ROWS;
    const int ks = gq_ksplit(units, in / gq<T>::E, gq<T>::SB, QTC_WARPS, k_tuning_get()->gemvq_tc_split);
    const int upb = QTC_WARPS / ks;
    return k_launch(gemv_qtc_kernel<T, BIG>, dim3((units + upb - 1) / upb), dim3(QTC_WARPS * 32), smem, s, W, X, Y,
                    out, in, n, ks, accumulate, ldy);
}

template <int T>
static int gemv_qtc_launch_t(const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                             int accumulate, cudaStream_t s) {
    return n > 8 ? gemv_qtc_launch<T, true>(W, X, Y, ldy, out, in, n, accumulate, s)
                 : gemv_qtc_launch<T, false>(W, X, Y, ldy, out, in, n, accumulate, s);
}

extern "C" int k_gemv_qtc_takes(int type) {
    return type == QB_Q4_K || type == QB_Q5_K || type == QB_Q6_K || type == QB_Q8_0;
}

extern "C" int k_gemv_qtc_ld(int type, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in,
                             int n, int accumulate, cudaStream_t s) {
    if (!k_gemv_qtc_takes(type) || out <= 0 || ldy < out || in <= 0 || in % qb_elems(type) || n < 1 ||
        n > K_GEMV_QTC_MAX_N || ((uintptr_t)X | (uintptr_t)W) % 16)
        return -1;
    switch (type) {
    case QB_Q4_K: return gemv_qtc_launch_t<QB_Q4_K>(W, X, Y, ldy, out, in, n, accumulate, s);
    case QB_Q5_K: return gemv_qtc_launch_t<QB_Q5_K>(W, X, Y, ldy, out, in, n, accumulate, s);
    case QB_Q8_0: return gemv_qtc_launch_t<QB_Q8_0>(W, X, Y, ldy, out, in, n, accumulate, s);
    default: return gemv_qtc_launch_t<QB_Q6_K>(W, X, Y, ldy, out, in, n, accumulate, s);
    }
}

extern "C" int k_gemv_qtc(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n,
                          int accumulate, cudaStream_t s) {
    return k_gemv_qtc_ld(type, W, X, Y, out, out, in, n, accumulate, s);
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
    case QB_Q4_0: return k_launch(dequant_q_kernel<QB_Q4_0>, grid, block, 0, s, W, out, rows, in);
    case QB_Q4_1: return k_launch(dequant_q_kernel<QB_Q4_1>, grid, block, 0, s, W, out, rows, in);
    case QB_Q5_K: return k_launch(dequant_q_kernel<QB_Q5_K>, grid, block, 0, s, W, out, rows, in);
    case QB_Q4_K: return k_launch(dequant_q_kernel<QB_Q4_K>, grid, block, 0, s, W, out, rows, in);
    case QB_Q6_K: return k_launch(dequant_q_kernel<QB_Q6_K>, grid, block, 0, s, W, out, rows, in);
    default: return -1;
    }
}

/* The token embedding kept in its blocks: out[t, :] = fp32(bf16(row tokens[t] decoded)), the
 * values the bf16 table holds (the loader rounds the host decode to nearest even, as
 * k_f2bf does), so both forms embed alike. One block per token, 8 elements a thread. */
template <int T>
__global__ void embed_q_kernel(const uint8_t *__restrict__ W, const int32_t *tokens, float *out, int hidden,
                               int vocab) {
    k_pdl_trigger();
    k_pdl_wait();
    int id = tokens[blockIdx.x];
    if (id < 0 || id >= vocab) id = 0;
    const int E = qb_elems(T), S = qb_bytes(T);
    const uint8_t *row = W + (size_t)id * (size_t)(hidden / E) * S;
    float *o = out + (size_t)blockIdx.x * hidden;
    for (int k0 = threadIdx.x * 8; k0 < hidden; k0 += blockDim.x * 8) {
        float w[8];
        qb_decode8(T, row + (size_t)(k0 / E) * S, k0 % E, w);
#pragma unroll
        for (int i = 0; i < 8; i++) o[k0 + i] = k_bf2f(k_f2bf(w[i]));
    }
}

extern "C" int k_embed_q(int type, const uint8_t *W, const int32_t *tokens, float *out, int n, int hidden, int vocab,
                         cudaStream_t s) {
    if (n == 0) return 0;
    if (!qb_bytes(type) || n < 0 || hidden <= 0 || vocab <= 0 || hidden % qb_elems(type)) return -1;
    const dim3 grid((unsigned)n), block(128);
    switch (type) {
    case QB_Q8_0: return k_launch(embed_q_kernel<QB_Q8_0>, grid, block, 0, s, W, tokens, out, hidden, vocab);
    case QB_Q4_0: return k_launch(embed_q_kernel<QB_Q4_0>, grid, block, 0, s, W, tokens, out, hidden, vocab);
    case QB_Q4_1: return k_launch(embed_q_kernel<QB_Q4_1>, grid, block, 0, s, W, tokens, out, hidden, vocab);
    case QB_Q5_K: return k_launch(embed_q_kernel<QB_Q5_K>, grid, block, 0, s, W, tokens, out, hidden, vocab);
    case QB_Q4_K: return k_launch(embed_q_kernel<QB_Q4_K>, grid, block, 0, s, W, tokens, out, hidden, vocab);
    case QB_Q6_K: return k_launch(embed_q_kernel<QB_Q6_K>, grid, block, 0, s, W, tokens, out, hidden, vocab);
    default: return -1;
    }
}
