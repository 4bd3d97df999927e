/* GGUF quantized blocks decoded 8 elements at a time, for the kernels that read quantized
 * weights in place (kernels/gemv_q.cu) and for their host tests: plain C that nvcc compiles
 * for the device and cc for the host (tests/test_quant_blocks.c checks every chunk of
 * every supported type against engine/model/gguf.c's ggml_dequantize).
 *
 * A row of a quantized matrix is a run of blocks (32 or 256 elements each); element k of
 * the row is element k % QB_ELEMS(t) of block k / QB_ELEMS(t). qb_decode8(t, blk, e0, y)
 * writes elements e0 .. e0 + 7 of one block (e0 a multiple of 8), so a kernel can walk a
 * row in the 8-element steps its bf16 form takes. Layouts (ggml's, see gguf.c):
 *   Q8_0 (32 elements, 34 bytes):  fp16 d, int8 q[32]                       x = d * q
 *   Q4_0 (32, 18):    fp16 d, u8 qs[16]; element j < 16 the low nibble of qs[j], j >= 16
 *                     the high nibble of qs[j - 16];                       x = d * (q - 8)
 *   Q4_1 (32, 20):    fp16 d, fp16 m, u8 qs[16] (as Q4_0);                x = d * q + m
 *   Q4_K (256, 144):  fp16 d, fp16 dmin, u8 scales[12], u8 qs[128]; sub-block s (32
 *                     elements) has a 6-bit scale and min; x = d * sc * nibble - dmin * m
 *   Q5_K (256, 176):  Q4_K's d, dmin, scales[12], then u8 qh[32], u8 qs[128]: Q4_K's
 *                     nibbles plus a fifth bit, bit s of qh[e % 32] for sub-block s
 *   Q6_K (256, 210):  u8 ql[128], u8 qh[64], int8 sc[16], fp16 d; x = d * sc * (q - 32)
 * Products are rounded before a following add (QB_MUL), as the host reference's are. */
#ifndef SPECD_QUANT_BLOCKS_H
#define SPECD_QUANT_BLOCKS_H

#include <stdint.h>

#ifdef __CUDACC__
#define QB_HD __host__ __device__ __forceinline__
#else
#define QB_HD static inline
#endif

enum { QB_Q4_0 = 2, QB_Q4_1 = 3, QB_Q8_0 = 8, QB_Q4_K = 12, QB_Q5_K = 13, QB_Q6_K = 14 };   /* ggml type ids */

QB_HD int qb_elems(int t) { return t == QB_Q8_0 || t == QB_Q4_0 || t == QB_Q4_1 ? 32 : 256; }
QB_HD int qb_bytes(int t) {
    switch (t) {
    case QB_Q4_0: return 18;
    case QB_Q4_1: return 20;
    case QB_Q8_0: return 34;
    case QB_Q4_K: return 144;
    case QB_Q5_K: return 176;
    case QB_Q6_K: return 210;
    default: return 0;
    }
}

/* a * b rounded on its own (no fused multiply-add into a following add on the device) */
#ifdef __CUDA_ARCH__
#define QB_MUL(a, b) __fmul_rn((a), (b))
#else
#define QB_MUL(a, b) ((a) * (b))
#endif

/* IEEE half (the low 16 bits of h) -> float without intrinsics (normal, subnormal, zero,
 * inf / NaN). */
QB_HD float qb_half_bits(uint32_t h) {
    h &= 0xffff;
    const uint32_t sign = (h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v;
    if (e == 0) {
        v = (float)m * (1.0f / 16777216.0f);   /* m * 2^-24: subnormal (or zero) */
    } else if (e == 31) {
        union { uint32_t u; float f; } c;
        c.u = 0x7f800000u | (m << 13);
        v = c.f;
    } else {
        union { uint32_t u; float f; } c;
        c.u = ((e + 112) << 23) | (m << 13);
        v = c.f;
    }
    return sign ? -v : v;
}

QB_HD float qb_half(const uint8_t *p) { return qb_half_bits((uint32_t)p[0] | (uint32_t)p[1] << 8); }

/* Q4_K sub-block s's 6-bit scale and min (four in the low bits of bytes 0..7, four split
 * between bytes 8..11 and the spare top bits of bytes 0..7). */
QB_HD void qb_k4_scale_min(int s, const uint8_t *sc, int *scale, int *min) {
    if (s < 4) {
        *scale = sc[s] & 63;
        *min = sc[s + 4] & 63;
    } else {
        *scale = (sc[s + 4] & 0xf) | ((sc[s - 4] >> 6) << 4);
        *min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

QB_HD void qb_decode8_q8_0(const uint8_t *b, int e0, float *y) {
    const float d = qb_half(b);
    for (int j = 0; j < 8; j++) y[j] = d * (float)(int8_t)b[2 + e0 + j];
}

/* Elements e0..e0+7 of sub-block s = e0 / 32: the 32 bytes of qs at 32 * (s / 2) hold
 * sub-block s's values in their low nibbles (s even) or high nibbles (s odd). Q5_K (q5):
 * qs starts at 48 and the fifth bit of element l of sub-block s is bit s of qh[l]. */
QB_HD void qb_decode8_k45(const uint8_t *b, int e0, float *y, int q5) {
    const float d = qb_half(b), dmin = qb_half(b + 2);
    const int s = e0 >> 5, l0 = e0 & 31;
    int sc, mn;
    qb_k4_scale_min(s, b + 4, &sc, &mn);
    const float ds = d * (float)sc, dm = dmin * (float)mn;
    const uint8_t *qh = b + 16 + l0, *q = b + (q5 ? 48 : 16) + 32 * (s >> 1) + l0;
    const int shift = (s & 1) * 4;
    for (int j = 0; j < 8; j++) {
        const int hi = q5 ? ((qh[j] >> s) & 1) << 4 : 0;
        y[j] = QB_MUL(ds, (float)(((q[j] >> shift) & 0xf) | hi)) - dm;
    }
}

/* Q4_K / Q5_K from 16-byte words already in registers (the tensor-core GEMM loads them
 * with one vector load each): hdr the block's first 16 bytes (d, dmin, scales[12]), qs
 * word w (0..7) of its qs (bytes 16 w ..), and for Q5_K qh word w % 2 (qh bytes 16 (w % 2)
 * ..; NULL for Q4_K); words little-endian, byte i of a word in bits 8i.. . The word holds
 * elements l0 .. l0 + 15 (l0 = 16 (w % 2)) of sub-block s = 2 (w / 2) in its low nibbles
 * and of sub-block s + 1 in its high nibbles: y[j] is element 32 s + l0 + j of the block,
 * y[16 + j] element 32 (s + 1) + l0 + j, the same floats as qb_decode8_k45. Only shifts of
 * whole words: no byte arrays that a kernel would have to keep in local memory. */
QB_HD void qb_k45_word(const uint32_t hdr[4], const uint32_t qs[4], const uint32_t *qh, int w, float y[32]) {
    const float d = qb_half_bits(hdr[0]), dmin = qb_half_bits(hdr[0] >> 16);
    const uint64_t lo8 = (uint64_t)hdr[1] | (uint64_t)hdr[2] << 32;   /* scales[0..7] */
    const int s0 = 2 * (w >> 1);
    for (int t = 0; t < 2; t++) {
        const int s = s0 + t;
        int sc, mn;   /* as qb_k4_scale_min, byte i of scales at bits 8i of lo8 / hdr[3] */
        if (s < 4) {
            sc = (int)(lo8 >> (8 * s)) & 63;
            mn = (int)(lo8 >> (8 * (s + 4))) & 63;
        } else {
            const int b4 = (int)(hdr[3] >> (8 * (s - 4))) & 0xff;   /* scales[s + 4] */
            sc = (b4 & 0xf) | (((int)(lo8 >> (8 * (s - 4))) & 0xff) >> 6) << 4;
            mn = (b4 >> 4) | (((int)(lo8 >> (8 * s)) & 0xff) >> 6) << 4;
        }
        const float ds = d * (float)sc, dm = dmin * (float)mn;
        for (int j = 0; j < 16; j++) {
            const uint32_t byte = (qs[j >> 2] >> (8 * (j & 3))) & 0xff;
            int q = (int)(byte >> (4 * t)) & 0xf;
            if (qh) q |= (int)((qh[j >> 2] >> (8 * (j & 3) + s)) & 1) << 4;
            y[16 * t + j] = QB_MUL(ds, (float)q) - dm;
        }
    }
}

/* Q6_K from words already in registers (a block is only 2-byte aligned: the tensor-core
 * GEMM builds them from 2-byte loads): the 32 elements l0 .. l0 + 15 (l0 0 or 16) of
 * quarters u0 and u0 + 1 (u0 0 or 2) of one half of the block. qla: ql bytes l0 .. of
 * the half (quarter u0's low 4 bits: low nibbles for u0 0, high for 2), qlb: ql bytes
 * 32 + l0 .. (quarter u0 + 1's), qh: qh bytes l0 .. of the half (bits 2u, 2u + 1 of
 * quarter u); d the block's half scale, sca / scb the int8 scales of groups l0 / 16 +
 * 2 u0 and + 2 (u0 + 1). y[j]: element 32 u0 + l0 + j of the half, y[16 + j]: element
 * 32 (u0 + 1) + l0 + j; the same floats as qb_decode8_q6_k. */
QB_HD void qb_q6k_word(const uint32_t qla[4], const uint32_t qlb[4], const uint32_t qh[4], int u0, float d, int sca,
                       int scb, float y[32]) {
    for (int t = 0; t < 2; t++) {
        const int u = u0 + t, lo_shift = (u >> 1) * 4, hi_shift = 2 * u;
        const uint32_t *ql = t ? qlb : qla;
        const float du = d * (float)(t ? scb : sca);
        for (int j = 0; j < 16; j++) {
            const int sh = 8 * (j & 3);
            const int q = (int)((((ql[j >> 2] >> sh) >> lo_shift) & 0xf) | (((qh[j >> 2] >> (sh + hi_shift)) & 3) << 4)) - 32;
            y[16 * t + j] = du * (float)q;
        }
    }
}

/* The 32-element types from words already in registers (blocks only 2-byte aligned): a
 * whole block, y[j] its element j, the same floats as qb_decode8. Q8_0: q its 32 int8
 * codes (bytes 2 ..), d its scale. Q4_0 / Q4_1 (q41): qs its 16 code bytes (element j < 16
 * the low nibble of byte j, j >= 16 the high nibble of byte j - 16), d and, for Q4_1, m. */
QB_HD void qb_q8_0_words(const uint32_t q[8], float d, float y[32]) {
    for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)(uint8_t)(q[j >> 2] >> (8 * (j & 3)));
}

QB_HD void qb_q4_01_words(const uint32_t qs[4], float d, float m, int q41, float y[32]) {
    for (int j = 0; j < 32; j++) {
        const int q = (int)(qs[(j & 15) >> 2] >> (8 * (j & 3) + (j >> 4) * 4)) & 0xf;
        y[j] = q41 ? QB_MUL(d, (float)q) + m : d * (float)(q - 8);
    }
}

/* Q4_0 / Q4_1: elements e0..e0+7 are the low (e0 < 16) or high nibbles of qs[e0 % 16 ..]. */
QB_HD void qb_decode8_q4_0(const uint8_t *b, int e0, float *y) {
    const float d = qb_half(b);
    const uint8_t *q = b + 2 + (e0 & 15);
    const int shift = e0 >= 16 ? 4 : 0;
    for (int j = 0; j < 8; j++) y[j] = d * (float)(((q[j] >> shift) & 0xf) - 8);
}

QB_HD void qb_decode8_q4_1(const uint8_t *b, int e0, float *y) {
    const float d = qb_half(b), m = qb_half(b + 2);
    const uint8_t *q = b + 4 + (e0 & 15);
    const int shift = e0 >= 16 ? 4 : 0;
    for (int j = 0; j < 8; j++) y[j] = QB_MUL(d, (float)((q[j] >> shift) & 0xf)) + m;
}

/* Q6_K: two halves of 128 elements; in a half, quarter u = (e % 128) / 32 of element l
 * (l < 32) takes its low 4 bits from ql[l] (u 0, 2: low / high nibble) or ql[l + 32]
 * (u 1, 3) and its top 2 bits from bits 2u, 2u+1 of qh[l]; group l / 16 + 2u of the
 * half's 8 scales. */
QB_HD void qb_decode8_q6_k(const uint8_t *b, int e0, float *y) {
    const int half = e0 >> 7, r = e0 & 127, u = r >> 5, l0 = r & 31;
    const uint8_t *ql = b + 64 * half + (u & 1) * 32, *qh = b + 128 + 32 * half;
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * half;
    const float d = qb_half(b + 208) * (float)sc[(l0 >> 4) + 2 * u];
    const int lo_shift = (u >> 1) * 4, hi_shift = 2 * u;
    for (int j = 0; j < 8; j++) {
        const int l = l0 + j;
        const int q = (int)(((ql[l] >> lo_shift) & 0xf) | (((qh[l] >> hi_shift) & 3) << 4)) - 32;
        y[j] = d * (float)q;
    }
}

/* Elements e0..e0+7 of block b of type t (a supported one). */
QB_HD void qb_decode8(int t, const uint8_t *b, int e0, float *y) {
    if (t == QB_Q8_0) qb_decode8_q8_0(b, e0, y);
    else if (t == QB_Q4_0) qb_decode8_q4_0(b, e0, y);
    else if (t == QB_Q4_1) qb_decode8_q4_1(b, e0, y);
    else if (t == QB_Q4_K) qb_decode8_k45(b, e0, y, 0);
    else if (t == QB_Q5_K) qb_decode8_k45(b, e0, y, 1);
    else qb_decode8_q6_k(b, e0, y);
}

#endif
