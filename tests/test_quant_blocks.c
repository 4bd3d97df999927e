/* kernels/quant_blocks.h (the 8-element block decoders the quantized-weight kernels use)
 * against engine/model/gguf.c's ggml_dequantize, which the loader's tests check on blocks
 * of known codes: every 8-element chunk of random blocks of each type must decode to the
 * same floats, bit for bit; fp16 halves cover normal, subnormal and zero scales. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "engine/model/gguf.h"
#include "kernels/quant_blocks.h"

static uint64_t g_state = 0x9e3779b97f4a7c15ULL;

static uint32_t rnd(void) {
    g_state ^= g_state << 13;
    g_state ^= g_state >> 7;
    g_state ^= g_state << 17;
    return (uint32_t)(g_state >> 11);
}

/* A random finite half: mostly normal, sometimes subnormal or zero, either sign. */
static void put_half(uint8_t *p) {
    uint32_t r = rnd();
    uint16_t h;
    if (r % 17 == 0) h = 0;
    else if (r % 13 == 0) h = (uint16_t)(rnd() & 0x3ff);                       /* subnormal */
    else h = (uint16_t)(((rnd() % 30) + 1) << 10 | (rnd() & 0x3ff));            /* normal */
    h |= (uint16_t)((r >> 20) & 1) << 15;
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static void check_type(int t, ggml_type gt, int n_blocks) {
    const int E = qb_elems(t), S = qb_bytes(t);
    uint8_t blk[256];
    float ref[256], got[8];
    long chunks = 0;
    assert_true(S > 0 && S <= (int)sizeof blk);
    for (int b = 0; b < n_blocks; b++) {
        for (int i = 0; i < S; i++) blk[i] = (uint8_t)rnd();
        if (t == QB_Q8_0 || t == QB_Q4_0) put_half(blk);
        if (t == QB_Q4_K || t == QB_Q5_K || t == QB_Q4_1) put_half(blk), put_half(blk + 2);
        if (t == QB_Q6_K) put_half(blk + 208);
        assert_int_equal(ggml_dequantize(gt, blk, ref, E), 0);
        for (int e0 = 0; e0 < E; e0 += 8, chunks++) {
            qb_decode8(t, blk, e0, got);
            for (int j = 0; j < 8; j++)
                if (memcmp(&got[j], &ref[e0 + j], 4))
                    fail_msg("type %d block %d element %d: %.9g, ggml_dequantize %.9g", t, b, e0 + j,
                             (double)got[j], (double)ref[e0 + j]);
        }
    }
    printf("  type %d: %d blocks, %ld chunks of 8 equal to ggml_dequantize\n", t, n_blocks, chunks);
}

static void test_decode8_equals_dequantize(void **st) {
    (void)st;
    check_type(QB_Q8_0, GGML_Q8_0, 2000);
    check_type(QB_Q4_K, GGML_Q4_K, 2000);
    check_type(QB_Q6_K, GGML_Q6_K, 2000);
    check_type(QB_Q4_0, GGML_Q4_0, 2000);
    check_type(QB_Q4_1, GGML_Q4_1, 2000);
    check_type(QB_Q5_K, GGML_Q5_K, 2000);
}

/* qb_k45_word (Q4_K / Q5_K from 16-byte words, for the tensor-core GEMM) against
 * qb_decode8: every word of random blocks, bit for bit. */
static void check_k45_word(int t, int n_blocks) {
    const int q5 = t == QB_Q5_K, S = qb_bytes(t);
    uint8_t blk[176];
    float ref[256], got[32];
    for (int b = 0; b < n_blocks; b++) {
        for (int i = 0; i < S; i++) blk[i] = (uint8_t)rnd();
        put_half(blk), put_half(blk + 2);
        for (int e0 = 0; e0 < 256; e0 += 8) qb_decode8(t, blk, e0, ref + e0);
        uint32_t hdr[4], qs[4], qh[4];
        memcpy(hdr, blk, 16);   /* (little-endian host, as the GPU) */
        for (int w = 0; w < 8; w++) {
            memcpy(qs, blk + (q5 ? 48 : 16) + 16 * w, 16);
            if (q5) memcpy(qh, blk + 16 + 16 * (w % 2), 16);
            qb_k45_word(hdr, qs, q5 ? qh : NULL, w, got);
            const int s = 2 * (w / 2), l0 = 16 * (w % 2);
            for (int j = 0; j < 32; j++) {
                const int e = 32 * (s + j / 16) + l0 + j % 16;
                if (memcmp(&got[j], &ref[e], 4))
                    fail_msg("type %d block %d word %d: y[%d] %.9g, element %d %.9g", t, b, w, j, (double)got[j], e,
                             (double)ref[e]);
            }
        }
    }
    printf("  type %d: %d blocks, every 16-byte word of qs equal to qb_decode8\n", t, n_blocks);
}

/* qb_q6k_word (Q6_K from words, for the tensor-core GEMM) against qb_decode8: every half,
 * pair of quarters and 16-element run of random blocks, bit for bit. */
static void check_q6k_word(int n_blocks) {
    uint8_t blk[210];
    float ref[256], got[32];
    for (int b = 0; b < n_blocks; b++) {
        for (int i = 0; i < 210; i++) blk[i] = (uint8_t)rnd();
        put_half(blk + 208);
        for (int e0 = 0; e0 < 256; e0 += 8) qb_decode8(QB_Q6_K, blk, e0, ref + e0);
        const float d = qb_half(blk + 208);
        for (int half = 0; half < 2; half++)
            for (int u0 = 0; u0 < 4; u0 += 2)
                for (int l0 = 0; l0 < 32; l0 += 16) {
                    uint32_t qla[4], qlb[4], qh[4];
                    memcpy(qla, blk + 64 * half + l0, 16);
                    memcpy(qlb, blk + 64 * half + 32 + l0, 16);
                    memcpy(qh, blk + 128 + 32 * half + l0, 16);
                    const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half;
                    qb_q6k_word(qla, qlb, qh, u0, d, sc[l0 / 16 + 2 * u0], sc[l0 / 16 + 2 * (u0 + 1)], got);
                    for (int j = 0; j < 32; j++) {
                        const int e = 128 * half + 32 * (u0 + j / 16) + l0 + j % 16;
                        if (memcmp(&got[j], &ref[e], 4))
                            fail_msg("Q6_K block %d half %d u0 %d l0 %d: y[%d] %.9g, element %d %.9g", b, half, u0, l0, j,
                                     (double)got[j], e, (double)ref[e]);
                    }
                }
    }
    printf("  type 14: %d blocks, every run of 16 of every pair of quarters equal to qb_decode8\n", n_blocks);
}

/* qb_q8_0_words / qb_q4_01_words against qb_decode8: whole random blocks, bit for bit. */
static void check_32_words(int t, int n_blocks) {
    const int S = qb_bytes(t);
    uint8_t blk[34];
    float ref[32], got[32];
    for (int b = 0; b < n_blocks; b++) {
        for (int i = 0; i < S; i++) blk[i] = (uint8_t)rnd();
        put_half(blk);
        if (t == QB_Q4_1) put_half(blk + 2);
        for (int e0 = 0; e0 < 32; e0 += 8) qb_decode8(t, blk, e0, ref + e0);
        uint32_t q[8];
        if (t == QB_Q8_0) {
            memcpy(q, blk + 2, 32);
            qb_q8_0_words(q, qb_half(blk), got);
        } else {
            memcpy(q, blk + (t == QB_Q4_1 ? 4 : 2), 16);
            qb_q4_01_words(q, qb_half(blk), t == QB_Q4_1 ? qb_half(blk + 2) : 0.f, t == QB_Q4_1, got);
        }
        for (int j = 0; j < 32; j++)
            if (memcmp(&got[j], &ref[j], 4))
                fail_msg("type %d block %d: y[%d] %.9g, qb_decode8 %.9g", t, b, j, (double)got[j], (double)ref[j]);
    }
    printf("  type %d: %d blocks decoded whole from words equal to qb_decode8\n", t, n_blocks);
}

static void test_word_decoders_equal_decode8(void **st) {
    (void)st;
    check_k45_word(QB_Q4_K, 2000);
    check_k45_word(QB_Q5_K, 2000);
    check_q6k_word(2000);
    check_32_words(QB_Q8_0, 2000);
    check_32_words(QB_Q4_0, 2000);
    check_32_words(QB_Q4_1, 2000);
}

/* qb_half on every one of the 65536 halves, NaNs by class. */
static void test_half_every_value(void **st) {
    (void)st;
    for (uint32_t h = 0; h < 65536; h++) {
        uint8_t p[2] = {(uint8_t)h, (uint8_t)(h >> 8)};
        float a = qb_half(p), b = ggml_fp16_to_f32((uint16_t)h);
        if (a != a || b != b) {
            assert_true(a != a && b != b);
            continue;
        }
        if (memcmp(&a, &b, 4)) fail_msg("half 0x%04x: %.9g vs %.9g", h, (double)a, (double)b);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode8_equals_dequantize),
        cmocka_unit_test(test_half_every_value),
        cmocka_unit_test(test_word_decoders_equal_decode8),
    };
    return cmocka_run_group_tests_name("quant_blocks", tests, NULL, NULL);
}
