/* FP8 E4M3 weights: the host conversions and the per-row quantizer (engine/model/fp8.h),
 * FP8 checkpoints (config.json quantization_config + F8_E4M3 safetensors weights with
 * their weight_scale / weight_scale_inv tensors) and --dtype fp8 on the CPU runner.
 *
 * Everything expected is computed here independently of the engine: E4M3 values from the
 * definition (sign, 4 exponent bits of bias 7, 3 mantissa bits, subnormals m/8 * 2^-6,
 * S.1111.111 NaN), rounding as the nearest entry of that table with ties to the even code,
 * and the FP8 checkpoints are written by this file's own quantizer from the bf16 fixture
 * llama-tiny (and phi3-tiny, whose fused qkv / gate_up rows are split into views that
 * start inside a scale block) into a fresh temp directory per test, their safetensors
 * written with stdio and jansson.
 *
 * Each check of the conversions and of the quantizer is also run against deliberately
 * broken copies of the engine's logic (ties away from zero, no saturation, ...): a check
 * that would pass a broken implementation fails the test. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/core/engine.h"
#include "engine/core/err.h"
#include "engine/core/runner.h"
#include "engine/model/fp8.h"
#include "engine/model/model.h"
#include "tests/fixtures.h"
#include "tests/st_util.h"

/* ---- E4M3 from its definition ------------------------------------------------------- */

static double pow2(int k) {
    double p = 1.0;
    for (; k > 0; k--) p *= 2.0;
    for (; k < 0; k++) p *= 0.5;
    return p;
}

/* The value of code b (exact in double and in float); NaN for 0x7f and 0xff. */
static double ref_value(int b) {
    const int s = (b >> 7) & 1, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    double mag = e == 0 ? (m / 8.0) * pow2(-6) : (1.0 + m / 8.0) * pow2(e - 7);
    return s ? -mag : mag;
}

static float ref_pos[127];   /* values of codes 0x00..0x7e, ascending */

static void ref_init(void) {
    for (int b = 0; b < 127; b++) ref_pos[b] = (float)ref_value(b);
}

/* Round to the nearest code (ties to the even code), saturating to +-448; NaN -> 0x7f. */
static uint8_t ref_encode(float x) {
    if (isnan(x)) return 0x7f;
    const uint8_t s = signbit(x) ? 0x80 : 0;
    const double a = fabs((double)x);
    if (a >= 448.0) return s | 0x7e;
    int lo = 0, hi = 126;   /* ref_pos[lo] <= a < ref_pos[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if ((double)ref_pos[mid] <= a) lo = mid;
        else hi = mid;
    }
    const double dlo = a - ref_pos[lo], dhi = (double)ref_pos[hi] - a;
    const int k = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return s | (uint8_t)k;
}

static float ref_decode(uint8_t b) { return (float)ref_value(b); }

static uint16_t f32_to_bf16(float f) {   /* nearest even; no NaN here */
    uint32_t b;
    memcpy(&b, &f, 4);
    b += 0x7fffu + ((b >> 16) & 1);
    return (uint16_t)(b >> 16);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static uint64_t g_rng;
static uint64_t rnd64(void) {   /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double rnd_unit(void) { return (double)(rnd64() >> 11) * 0x1p-53; }
static double rnd_normal(void) {
    double u = rnd_unit(), v = rnd_unit();
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

static int same_bits(float a, float b) { return !memcmp(&a, &b, sizeof a); }

/* ---- copies of the engine's logic with one thing broken (mutants) -------------------- */

enum { MUT_NONE = 0, MUT_TIES_AWAY, MUT_NO_SATURATE, MUT_SUBNORMAL_TRUNC, MUT_NO_CARRY, MUT_NAN_SIGNED };
static int g_enc_mut;

/* fp8_e4m3_from_f32 as in engine/model/fp8.c, broken as g_enc_mut says. */
static uint8_t mut_from_f32(float x) {
    if (isnan(x)) return g_enc_mut == MUT_NAN_SIGNED && signbit(x) ? 0xff : 0x7f;
    const uint8_t s = signbit(x) ? 0x80 : 0;
    const float a = fabsf(x);
    if (g_enc_mut != MUT_NO_SATURATE && a >= FP8_E4M3_MAX) return s | 0x7e;
    if (a < 0x1p-6f)
        return s | (uint8_t)(g_enc_mut == MUT_SUBNORMAL_TRUNC ? truncf(a * 0x1p9f) : nearbyintf(a * 0x1p9f));
    int ex;
    frexpf(a, &ex);
    int e = ex - 1;
    const float t = (ldexpf(a, -e) - 1.0f) * 8.0f;
    int q = (int)(g_enc_mut == MUT_TIES_AWAY ? roundf(t) : nearbyintf(t));
    if (q == 8 && g_enc_mut != MUT_NO_CARRY) {
        e++;
        q = 0;
    }
    return s | (uint8_t)((e + 7) << 3 | q);
}

enum { MUTD_NONE = 0, MUTD_SUBNORMAL_AS_NORMAL, MUTD_BIAS8, MUTD_NAN_POSITIVE_ONLY, MUTD_SIGNLESS_ZERO };
static int g_dec_mut;

static float mut_to_f32(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7 && (g_dec_mut != MUTD_NAN_POSITIVE_ONLY || !(b & 0x80))) return NAN;
    if (e == 0 && g_dec_mut != MUTD_SUBNORMAL_AS_NORMAL) v = ldexpf((float)m, -9);
    else v = ldexpf(1.0f + (float)m * 0.125f, e - (g_dec_mut == MUTD_BIAS8 ? 8 : 7));
    if (g_dec_mut == MUTD_SIGNLESS_ZERO && v == 0.f) return 0.f;
    return (b & 0x80) ? -v : v;
}

enum { MUTQ_NONE = 0, MUTQ_SCALE_INVERTED, MUTQ_TRUNCATE, MUTQ_ZERO_ROW_SCALE0, MUTQ_SIGNED_MAX, MUTQ_SCALE_ROUNDED };
static int g_q_mut;

/* fp8_quantize_row as in engine/model/fp8.c, broken as g_q_mut says. */
static void mut_quantize_row(const float *x, int64_t n, uint8_t *q, float *scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, g_q_mut == MUTQ_SIGNED_MAX ? x[i] : fabsf(x[i]));
    const float inv = amax > 0.f ? FP8_E4M3_MAX / amax : 1.f;
    *scale = amax > 0.f ? amax / FP8_E4M3_MAX : (g_q_mut == MUTQ_ZERO_ROW_SCALE0 ? 0.f : 1.f);
    if (g_q_mut == MUTQ_SCALE_INVERTED && amax > 0.f) *scale = inv;
    if (g_q_mut == MUTQ_SCALE_ROUNDED) *scale = bf16_to_f32(f32_to_bf16(*scale));
    for (int64_t i = 0; i < n; i++) {
        const float y = x[i] * inv;
        if (g_q_mut == MUTQ_TRUNCATE) {   /* toward zero: the lower neighbour in magnitude */
            uint8_t c = ref_encode(y);
            if (fabsf(ref_decode(c)) > fabsf(y) && (c & 0x7f)) c--;
            q[i] = c;
        } else {
            q[i] = fp8_e4m3_from_f32(y);
        }
    }
}

/* ---- 1. conversions ------------------------------------------------------------------ */

#define REPORT(...)                                                          \
    do {                                                                     \
        if (verbose && fails < 8) print_message("    " __VA_ARGS__);         \
        fails++;                                                             \
    } while (0)

/* Every code decodes to its value (+-0 with their signs, NaN for 0x7f / 0xff). */
static int check_decoder(float (*dec)(uint8_t), int verbose) {
    int fails = 0;
    for (int b = 0; b < 256; b++) {
        const double want = ref_value(b);
        const float got = dec((uint8_t)b);
        if (isnan(want) ? !isnan(got) : !same_bits(got, (float)want))
            REPORT("decode 0x%02x: got %a, want %a\n", b, (double)got, want);
    }
    return fails;
}

static int check_encoding(uint8_t (*enc)(float), float x, uint8_t want, int verbose) {
    const uint8_t got = enc(x);
    if (got == want) return 0;
    if (verbose) print_message("    encode %a: got 0x%02x, want 0x%02x\n", (double)x, got, want);
    return 1;
}

static int check_encoder(uint8_t (*enc)(float), int verbose) {
    int fails = 0;
    /* every finite code round-trips */
    for (int b = 0; b < 256; b++)
        if (b != 0x7f && b != 0xff) fails += check_encoding(enc, (float)ref_value(b), (uint8_t)b, verbose && fails < 8);
    /* midpoints between consecutive codes go to the even one, and just off them to the
     * nearer one; both signs */
    for (int k = 0; k < 126; k++) {
        const float lo = ref_pos[k], hi = ref_pos[k + 1], mid = (lo + hi) / 2;   /* exact */
        const uint8_t even = (uint8_t)(k % 2 == 0 ? k : k + 1);
        if ((double)mid != ((double)lo + hi) / 2) fails++;
        const float xs[3] = {mid, nextafterf(mid, 0.f), nextafterf(mid, INFINITY)};
        const uint8_t ws[3] = {even, (uint8_t)k, (uint8_t)(k + 1)};
        for (int i = 0; i < 3; i++) {
            fails += check_encoding(enc, xs[i], ws[i], verbose && fails < 8);
            fails += check_encoding(enc, -xs[i], (uint8_t)(0x80 | ws[i]), verbose && fails < 8);
        }
    }
    /* saturation: above 448 (464 is the midpoint to the 480 E4M3 does not have), inf */
    const float big[] = {448.0f, 448.5f, 463.9f, 464.0f, 464.1f, 480.0f, 500.0f, 1000.0f, 65504.0f, 1e30f, FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        fails += check_encoding(enc, big[i], 0x7e, verbose && fails < 8);
        fails += check_encoding(enc, -big[i], 0xfe, verbose && fails < 8);
    }
    fails += check_encoding(enc, NAN, 0x7f, verbose && fails < 8);
    fails += check_encoding(enc, -NAN, 0x7f, verbose && fails < 8);
    /* tiny values: the smallest subnormal is 2^-9; 2^-10 is a tie to 0 */
    const struct { float x; uint8_t want; } tiny[] = {
        {0.0f, 0x00}, {-0.0f, 0x80}, {0x1p-10f, 0x00}, {-0x1p-10f, 0x80}, {nextafterf(0x1p-10f, 1.f), 0x01},
        {nextafterf(0x1p-10f, 0.f), 0x00}, {0x1p-11f, 0x00}, {1e-30f, 0x00}, {FLT_TRUE_MIN, 0x00},
        {-FLT_TRUE_MIN, 0x80}, {FLT_MIN, 0x00}, {0x1p-9f, 0x01}, {0x3p-10f, 0x02}, {0x5p-10f, 0x02},
        {0x7p-10f, 0x04}, {0x1p-6f - 0x1p-10f, 0x08}, {nextafterf(0x1p-6f - 0x1p-10f, 0.f), 0x07},
        {0x1p-6f, 0x08}, {nextafterf(0x1p-6f, 0.f), 0x08}, {0x1p-6f + 0x1p-10f, 0x08}, {0x1p-6f + 0x3p-10f, 0x0a},
    };
    for (size_t i = 0; i < sizeof tiny / sizeof tiny[0]; i++)
        fails += check_encoding(enc, tiny[i].x, tiny[i].want, verbose && fails < 8);
    /* random values over the whole range E4M3 covers and past it, all mantissa bits */
    g_rng = 12345;
    for (int i = 0; i < 300000; i++) {
        uint32_t bits = (uint32_t)rnd64();
        float x;
        if (i % 4) {   /* exponent in [2^-14, 2^10) */
            const uint32_t e = 127 - 14 + (uint32_t)(rnd64() % 24);
            bits = (bits & 0x807fffffu) | e << 23;
        }
        memcpy(&x, &bits, 4);
        if (isnan(x)) continue;
        fails += check_encoding(enc, x, ref_encode(x), verbose && fails < 8);
    }
    return fails;
}

static void test_decode_all_codes(void **state) {
    (void)state;
    assert_int_equal(check_decoder(fp8_e4m3_to_f32, 1), 0);
    /* spot values of the definition */
    assert_true(fp8_e4m3_to_f32(0x7e) == 448.0f);
    assert_true(fp8_e4m3_to_f32(0x38) == 1.0f);
    assert_true(fp8_e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(fp8_e4m3_to_f32(0x08) == 0x1p-6f);
    assert_true(fp8_e4m3_to_f32(0xc4) == -3.0f);
    assert_true(signbit(fp8_e4m3_to_f32(0x80)));
}

static void test_encode_rounding_saturation_tiny(void **state) {
    (void)state;
    assert_int_equal(check_encoder(fp8_e4m3_from_f32, 1), 0);
}

/* Runs of the checks on the engine's logic copied here (broken as the g_*_mut switches say). */
static int enc_check(int verbose) { return check_encoder(mut_from_f32, verbose); }
static int dec_check(int verbose) { return check_decoder(mut_to_f32, verbose); }

/* `check` passes the unbroken copy (*mut = 0) and fails it with each of muts[0..n). */
static void expect_mutants_fail(const char *what, int *mut, const int *muts, size_t n, int (*check)(int)) {
    *mut = 0;
    assert_int_equal(check(1), 0);
    for (size_t i = 0; i < n; i++) {
        *mut = muts[i];
        const int f = check(0);
        print_message("  %s mutant %d: %d failed checks\n", what, muts[i], f);
        assert_true(f > 0);
    }
    *mut = 0;
}

/* The checks above reject broken conversions: the engine's logic copied here passes them
 * as it is and fails them with each of these changes. */
static void test_conversion_checks_catch_mutants(void **state) {
    (void)state;
    const int muts[] = {MUT_TIES_AWAY, MUT_NO_SATURATE, MUT_SUBNORMAL_TRUNC, MUT_NO_CARRY, MUT_NAN_SIGNED};
    const int dmuts[] = {MUTD_SUBNORMAL_AS_NORMAL, MUTD_BIAS8, MUTD_NAN_POSITIVE_ONLY, MUTD_SIGNLESS_ZERO};
    expect_mutants_fail("encoder", &g_enc_mut, muts, sizeof muts / sizeof muts[0], enc_check);
    expect_mutants_fail("decoder", &g_dec_mut, dmuts, sizeof dmuts / sizeof dmuts[0], dec_check);
}

/* ---- 2. the per-row quantizer ---------------------------------------------------------- */

/* Random rows of several lengths and spreads (subnormal codes included: a row with an
 * outlier), a row with its max negative, one of zeros. Checks the bound of E4M3 rounding
 * (half an ulp: 2^-4 relative for normal codes, 2^-10 * scale absolute for subnormals),
 * scale == amax / 448, the bytes against this file's encoder of x * (448 / amax), the
 * largest element at +-448, and a zero row's scale 1 and zero bytes. */
static int check_quantizer(void (*qr)(const float *, int64_t, uint8_t *, float *), int verbose) {
    int fails = 0;
    const int64_t lens[] = {1, 2, 7, 128, 344, 1000};
    g_rng = 777;
    for (int trial = 0; trial < 60; trial++) {
        const int64_t n = lens[trial % 6];
        float *x = malloc(sizeof(float) * (size_t)n);
        uint8_t *q = malloc((size_t)n);
        const double mag = pow(10.0, -3 + 6 * rnd_unit());
        for (int64_t i = 0; i < n; i++) x[i] = (float)(rnd_normal() * mag);
        if (trial % 5 == 1 && n > 1) x[rnd64() % (uint64_t)n] = (float)(1e4 * mag);    /* outlier */
        if (trial % 5 == 2) {   /* the max is negative */
            for (int64_t i = 0; i < n; i++) x[i] = fabsf(x[i]) * 0.5f;
            x[rnd64() % (uint64_t)n] = (float)(-3 * mag);
        }
        if (trial == 7) x[0] = -0.0f;
        float amax = 0.f;
        for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
        float scale = -1.f;
        qr(x, n, q, &scale);
        if (!same_bits(scale, amax / 448.0f)) REPORT("row %d: scale %a, want amax/448 = %a\n", trial, (double)scale, (double)(amax / 448.0f));
        const float inv = 448.0f / amax;
        int saw_max = 0;
        for (int64_t i = 0; i < n; i++) {
            const float y = ref_decode(q[i]) * scale;
            const double err = fabs((double)y - x[i]);
            const double bound = 0x1p-4 * fabs((double)x[i]) + 0x1p-10 * scale + 1e-6 * amax;
            if (!(err <= bound))
                REPORT("row %d [%lld]: x %a -> %a, error %.3g > %.3g\n", trial, (long long)i, (double)x[i], (double)y, err, bound);
            if (q[i] != ref_encode(x[i] * inv))
                REPORT("row %d [%lld]: x %a -> 0x%02x, want 0x%02x\n", trial, (long long)i, (double)x[i], q[i],
                       ref_encode(x[i] * inv));
            saw_max |= (q[i] & 0x7f) == 0x7e;
        }
        if (!saw_max) REPORT("row %d: no element at +-448\n", trial);
        free(x);
        free(q);
    }
    float z[5] = {0, 0, 0, 0, 0}, scale = -1.f;
    uint8_t qz[5];
    memset(qz, 0xaa, sizeof qz);
    qr(z, 5, qz, &scale);
    if (scale != 1.0f) REPORT("zero row: scale %g, want 1\n", (double)scale);
    for (int i = 0; i < 5; i++)
        if (qz[i] != 0) REPORT("zero row: byte %d is 0x%02x\n", i, qz[i]);
    return fails;
}

static void test_quantize_row(void **state) {
    (void)state;
    assert_int_equal(check_quantizer(fp8_quantize_row, 1), 0);
}

static int q_check(int verbose) { return check_quantizer(mut_quantize_row, verbose); }

static void test_quantizer_checks_catch_mutants(void **state) {
    (void)state;
    const int muts[] = {MUTQ_SCALE_INVERTED, MUTQ_TRUNCATE, MUTQ_ZERO_ROW_SCALE0, MUTQ_SIGNED_MAX, MUTQ_SCALE_ROUNDED};
    expect_mutants_fail("quantizer", &g_q_mut, muts, sizeof muts / sizeof muts[0], q_check);
}

/* fp8_round_row (what the CPU runner applies for --dtype fp8) is the quantizer's bytes
 * times its scale, bit for bit; a zero row stays as it is. */
static void test_round_row_matches_quantizer(void **state) {
    (void)state;
    g_rng = 99;
    for (int trial = 0; trial < 20; trial++) {
        const int64_t n = 1 + (int64_t)(rnd64() % 500);
        float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
        uint8_t *q = malloc((size_t)n);
        const double mag = pow(10.0, -2 + 4 * rnd_unit());
        for (int64_t i = 0; i < n; i++) x[i] = y[i] = (float)(rnd_normal() * mag);
        float scale;
        fp8_quantize_row(x, n, q, &scale);
        fp8_round_row(y, n);
        for (int64_t i = 0; i < n; i++) {
            const float want = ref_decode(q[i]) * scale;
            if (!same_bits(y[i], want))
                fail_msg("round_row trial %d [%lld]: %a, want %a", trial, (long long)i, (double)y[i], (double)want);
        }
        free(x);
        free(y);
        free(q);
    }
    float z[3] = {0.f, -0.f, 0.f};
    fp8_round_row(z, 3);
    assert_true(z[0] == 0.f && signbit(z[1]) && z[2] == 0.f);
}

/* ---- FP8 checkpoints written from the bf16 fixtures ------------------------------------- */

typedef enum {
    SCH_ROW_F32,      /* compressed-tensors float-quantized: F32 [rows, 1] weight_scale */
    SCH_TENSOR_BF16,  /* fbgemm_fp8: one BF16 scale per tensor, shape [] */
    SCH_BLOCK_F32,    /* HF fp8: F32 [ceil(rows/b0), ceil(cols/b1)] weight_scale_inv */
} scheme;

typedef struct {
    scheme sch;
    int block[2];             /* SCH_BLOCK_F32 */
    /* broken variants (a weight's full name): */
    const char *drop_scale;   /* its scale tensor is left out */
    const char *short_scale;  /* its scale has one row too few */
    const char *f16_scale;    /* its scale is declared F16 */
    const char *f8_vector;    /* this 1-D tensor is stored as F8_E4M3 (bytes of its values) */
    int misalign;             /* a 1-byte U8 tensor first: every tensor after it at an odd offset */
    int bf16;                 /* projections left bf16 (no quantization_config needed) */
    /* FP8 KV cache scales: each layer gets F32 scalars self_attn.k_scale and v_scale (when
     * nonzero); kv_scale_shape2 writes k_scale with shape [2] instead (a broken file) */
    float k_scale, v_scale;
    int kv_scale_shape2;
} ckpt_opts;

static void make_tmpdir(char *dir) {
    strcpy(dir, "/tmp/specd_fp8_XXXXXX");
    assert_non_null(mkdtemp(dir));
}

static void rm_tmpdir(const char *dir) {
    const char *names[] = {"config.json", "generation_config.json", "model.safetensors"};
    char p[512];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
}

/* A bf16 fixture tensor as fp32 (malloc'd); its shape into rows / cols (1-D: cols = 1). */
static float *raw_st_f32(const raw_st *r, const char *name, int64_t *rows, int64_t *cols) {
    json_t *t = json_object_get(r->header, name);
    if (!t) fail_msg("fixture has no tensor %s", name);
    assert_string_equal(json_string_value(json_object_get(t, "dtype")), "BF16");
    json_t *sh = json_object_get(t, "shape");
    *rows = json_integer_value(json_array_get(sh, 0));
    *cols = json_array_size(sh) > 1 ? json_integer_value(json_array_get(sh, 1)) : 1;
    size_t nb;
    const unsigned char *d = raw_st_data(r, name, &nb);
    assert_int_equal(nb, (size_t)(*rows * *cols) * 2);
    float *f = malloc(sizeof(float) * (size_t)(*rows * *cols));
    for (int64_t i = 0; i < *rows * *cols; i++) f[i] = bf16_to_f32((uint16_t)(d[2 * i] | d[2 * i + 1] << 8));
    return f;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

/* The dense projections: every layer's *_proj.weight (not embeddings, norms, lm_head). */
static int is_projection(const char *name) {
    return !strncmp(name, "model.layers.", 13) && ends_with(name, "_proj.weight");
}

/* This file's quantizer. q: rows*cols bytes; sc: the scales as stored (bf16-rounded for
 * SCH_TENSOR_BF16), *srows x *scols of them. */
static void quantize(const ckpt_opts *o, const float *x, int64_t rows, int64_t cols, uint8_t *q, float *sc,
                     int64_t *srows, int64_t *scols) {
    if (o->sch == SCH_ROW_F32) {   /* exactly fp8.h's per-row scheme */
        *srows = rows;
        *scols = 1;
        for (int64_t r = 0; r < rows; r++) {
            float amax = 0.f;
            for (int64_t c = 0; c < cols; c++) amax = fmaxf(amax, fabsf(x[r * cols + c]));
            const float inv = amax > 0.f ? 448.0f / amax : 1.f;
            sc[r] = amax > 0.f ? amax / 448.0f : 1.f;
            for (int64_t c = 0; c < cols; c++) q[r * cols + c] = ref_encode(x[r * cols + c] * inv);
        }
    } else if (o->sch == SCH_TENSOR_BF16) {
        *srows = *scols = 1;
        float amax = 0.f;
        for (int64_t i = 0; i < rows * cols; i++) amax = fmaxf(amax, fabsf(x[i]));
        sc[0] = amax > 0.f ? bf16_to_f32(f32_to_bf16(amax / 448.0f)) : 1.f;
        for (int64_t i = 0; i < rows * cols; i++) q[i] = ref_encode(x[i] / sc[0]);   /* saturates */
    } else {
        const int64_t b0 = o->block[0], b1 = o->block[1];
        *srows = (rows + b0 - 1) / b0;
        *scols = (cols + b1 - 1) / b1;
        for (int64_t br = 0; br < *srows; br++)
            for (int64_t bc = 0; bc < *scols; bc++) {
                float amax = 0.f;
                for (int64_t r = br * b0; r < rows && r < (br + 1) * b0; r++)
                    for (int64_t c = bc * b1; c < cols && c < (bc + 1) * b1; c++) amax = fmaxf(amax, fabsf(x[r * cols + c]));
                const float s = amax > 0.f ? amax / 448.0f : 1.f;
                sc[br * *scols + bc] = s;
                for (int64_t r = br * b0; r < rows && r < (br + 1) * b0; r++)
                    for (int64_t c = bc * b1; c < cols && c < (bc + 1) * b1; c++) q[r * cols + c] = ref_encode(x[r * cols + c] / s);
            }
    }
}

/* Element (r, c)'s scale. */
static float scale_for(const ckpt_opts *o, const float *sc, int64_t scols, int64_t r, int64_t c) {
    switch (o->sch) {
    case SCH_ROW_F32: return sc[r];
    case SCH_TENSOR_BF16: return sc[0];
    default: return sc[(r / o->block[0]) * scols + c / o->block[1]];
    }
}

/* A fixture tensor quantized, and its dequantization by this file. */
typedef struct {
    int64_t rows, cols, srows, scols;
    uint8_t *q;
    float *sc, *deq, *orig;
} qtensor;

static void qtensor_make(const ckpt_opts *o, const raw_st *r, const char *name, qtensor *t) {
    t->orig = raw_st_f32(r, name, &t->rows, &t->cols);
    t->q = malloc((size_t)(t->rows * t->cols));
    t->sc = malloc(sizeof(float) * (size_t)(t->rows * t->cols + 1));
    t->deq = malloc(sizeof(float) * (size_t)(t->rows * t->cols));
    quantize(o, t->orig, t->rows, t->cols, t->q, t->sc, &t->srows, &t->scols);
    for (int64_t i = 0; i < t->rows; i++)
        for (int64_t c = 0; c < t->cols; c++) {
            const float v = ref_decode(t->q[i * t->cols + c]) * scale_for(o, t->sc, t->scols, i, c);
            t->deq[i * t->cols + c] = v;
        }
}

static void qtensor_free(qtensor *t) {
    free(t->q);
    free(t->sc);
    free(t->deq);
    free(t->orig);
}

typedef struct {
    char name[200];
    const char *dtype;
    int ndim;
    int64_t shape[2];
    unsigned char *data;
    size_t n;
    int align;
} out_tensor;

static json_t *qconfig_of(const ckpt_opts *o) {
    switch (o->sch) {
    case SCH_ROW_F32:
        return json_pack("{s:s, s:s, s:{s:{s:{s:i, s:s, s:s, s:b, s:b}, s:{s:i, s:s, s:s, s:b}, s:[s]}}, s:[s], s:s}",
                         "quant_method", "compressed-tensors", "format", "float-quantized", "config_groups", "group_0",
                         "weights", "num_bits", 8, "type", "float", "strategy", "channel", "dynamic", 0, "symmetric", 1,
                         "input_activations", "num_bits", 8, "type", "float", "strategy", "token", "dynamic", 1,
                         "targets", "Linear", "ignore", "lm_head", "quantization_status", "compressed");
    case SCH_TENSOR_BF16:
        return json_pack("{s:s, s:f, s:[s]}", "quant_method", "fbgemm_fp8", "activation_scale_ub", 1200.0,
                         "modules_to_not_convert", "lm_head");
    default:
        return json_pack("{s:s, s:s, s:s, s:[i, i]}", "quant_method", "fp8", "activation_scheme", "dynamic", "fmt",
                         "e4m3", "weight_block_size", o->block[0], o->block[1]);
    }
}

/* Write the FP8 form of fixture `name` into dir: config.json with quantization_config
 * (qcfg, stolen; NULL: none), generation_config.json as it is, model.safetensors with
 * every projection quantized and its scale added, other tensors copied. The data are laid
 * out F32, then BF16, then F8 (as safetensors' writer sorts them), the header padded to 8
 * bytes, so every tensor is aligned to its element (unless o->misalign). */
static void write_checkpoint(const char *name, const char *dir, const ckpt_opts *o, json_t *qcfg) {
    char src[400], p[600];
    fixture_model(src, sizeof src, name);
    snprintf(p, sizeof p, "%s/config.json", src);
    json_t *cfg = load_json(p);
    if (qcfg) json_object_set_new(cfg, "quantization_config", qcfg);
    snprintf(p, sizeof p, "%s/config.json", dir);
    assert_int_equal(json_dump_file(cfg, p, JSON_INDENT(1)), 0);
    json_decref(cfg);
    snprintf(p, sizeof p, "%s/generation_config.json", src);
    size_t n;
    unsigned char *gen = read_file(p, &n);
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    write_all(p, gen, n);
    free(gen);

    raw_st r;
    snprintf(p, sizeof p, "%s/model.safetensors", src);
    raw_st_load(&r, p);
    out_tensor *ts = calloc(2 * json_object_size(r.header) + 2, sizeof *ts);
    int nt = 0;
    const char *key;
    json_t *val;
    json_object_foreach(r.header, key, val) {
        if (!strcmp(key, "__metadata__")) continue;
        json_t *sh = json_object_get(val, "shape");
        if (is_projection(key) && !o->bf16) {
            qtensor q;
            qtensor_make(o, &r, key, &q);
            out_tensor *w = &ts[nt++], *s = &ts[nt++];
            snprintf(w->name, sizeof w->name, "%s", key);
            w->dtype = "F8_E4M3";
            w->ndim = 2;
            w->shape[0] = q.rows;
            w->shape[1] = q.cols;
            w->n = (size_t)(q.rows * q.cols);
            w->data = malloc(w->n);
            memcpy(w->data, q.q, w->n);
            w->align = 1;
            snprintf(s->name, sizeof s->name, "%s%s", key, o->sch == SCH_BLOCK_F32 ? "_scale_inv" : "_scale");
            const int64_t ns = q.srows * q.scols;
            if (o->sch == SCH_TENSOR_BF16) {
                s->dtype = "BF16";
                s->ndim = 0;
                s->n = 2;
                s->data = malloc(2);
                const uint16_t h = f32_to_bf16(q.sc[0]);
                memcpy(s->data, &h, 2);
                s->align = 2;
            } else {
                s->dtype = "F32";
                s->ndim = 2;
                s->shape[0] = q.srows;
                s->shape[1] = q.scols;
                s->n = (size_t)ns * 4;
                s->data = malloc(s->n);
                memcpy(s->data, q.sc, s->n);
                s->align = 4;
            }
            if (o->short_scale && !strcmp(o->short_scale, key)) {
                assert_int_equal(s->ndim, 2);
                s->shape[0]--;
                s->n -= (size_t)s->shape[1] * 4;
            }
            if (o->f16_scale && !strcmp(o->f16_scale, key)) {   /* 2 bytes per scale (values unread) */
                s->dtype = "F16";
                s->n /= 2;
                s->align = 2;
            }
            if (o->drop_scale && !strcmp(o->drop_scale, key)) {
                free(s->data);
                memset(s, 0, sizeof *s);
                nt--;
            }
            qtensor_free(&q);
        } else {
            out_tensor *t = &ts[nt++];
            size_t nb;
            const unsigned char *d = raw_st_data(&r, key, &nb);
            snprintf(t->name, sizeof t->name, "%s", key);
            t->dtype = "BF16";
            assert_string_equal(json_string_value(json_object_get(val, "dtype")), "BF16");
            t->ndim = (int)json_array_size(sh);
            assert_true(t->ndim == 1 || t->ndim == 2);
            for (int i = 0; i < t->ndim; i++) t->shape[i] = json_integer_value(json_array_get(sh, (size_t)i));
            t->n = nb;
            t->data = malloc(nb);
            memcpy(t->data, d, nb);
            t->align = 2;
            if (o->f8_vector && !strcmp(o->f8_vector, key)) {   /* one byte per element */
                assert_int_equal(t->ndim, 1);
                t->dtype = "F8_E4M3";
                t->n = nb / 2;
                for (size_t i = 0; i < t->n; i++)
                    t->data[i] = ref_encode(bf16_to_f32((uint16_t)(d[2 * i] | d[2 * i + 1] << 8)));
                t->align = 1;
            }
        }
    }
    for (int l = 0; o->k_scale > 0 && l < 64; l++) {
        char probe[200];
        snprintf(probe, sizeof probe, "model.layers.%d.self_attn.q_proj.weight", l);
        if (!json_object_get(r.header, probe)) break;
        ts = realloc(ts, sizeof *ts * (size_t)(nt + 2));
        for (int kv = 0; kv < 2; kv++) {
            out_tensor *t = &ts[nt++];
            memset(t, 0, sizeof *t);
            snprintf(t->name, sizeof t->name, "model.layers.%d.self_attn.%s_scale", l, kv ? "v" : "k");
            t->dtype = "F32";
            t->ndim = !kv && o->kv_scale_shape2;
            t->shape[0] = 2;
            t->n = t->ndim ? 8 : 4;
            t->data = malloc(8);
            const float v[2] = {kv ? o->v_scale : o->k_scale, 1.0f};
            memcpy(t->data, v, 8);
            t->align = 4;
        }
    }
    json_t *hdr = json_object();
    json_object_set_new(hdr, "__metadata__", json_pack("{s:s}", "format", "pt"));
    size_t off = 0;
    if (o->misalign) {
        json_object_set_new(hdr, "misalign.pad", json_pack("{s:s, s:[i], s:[i, i]}", "dtype", "U8", "shape", 1,
                                                           "data_offsets", 0, 1));
        off = 1;
    }
    for (int align = 4; align >= 1; align /= 2)
        for (int i = 0; i < nt; i++) {
            out_tensor *t = &ts[i];
            if (t->align != align) continue;
            assert_int_equal(off % (size_t)align, o->misalign && align > 1 ? 1 : 0);
            json_t *sh = json_array();
            for (int d = 0; d < t->ndim; d++) json_array_append_new(sh, json_integer(t->shape[d]));
            json_object_set_new(hdr, t->name,
                                json_pack("{s:s, s:o, s:[I, I]}", "dtype", t->dtype, "shape", sh, "data_offsets",
                                          (json_int_t)off, (json_int_t)(off + t->n)));
            off += t->n;
        }
    char *js = json_dumps(hdr, JSON_COMPACT | JSON_SORT_KEYS);
    assert_non_null(js);
    size_t hl = strlen(js), padded = (hl + 7) / 8 * 8;
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    uint64_t hl64 = padded;
    assert_int_equal(fwrite(&hl64, 8, 1, f), 1);
    assert_int_equal(fwrite(js, 1, hl, f), hl);
    for (size_t i = hl; i < padded; i++) fputc(' ', f);
    if (o->misalign) fputc(0, f);
    for (int align = 4; align >= 1; align /= 2)
        for (int i = 0; i < nt; i++)
            if (ts[i].align == align) assert_int_equal(fwrite(ts[i].data, 1, ts[i].n, f), ts[i].n);
    assert_int_equal(fclose(f), 0);
    free(js);
    json_decref(hdr);
    for (int i = 0; i < nt; i++) free(ts[i].data);
    free(ts);
    raw_st_free(&r);
}

static model *load_ok(const char *path) {
    char err[1024] = "";
    model *m = model_load(path, err, sizeof err);
    if (!m) fail_msg("model_load(%s): %s", path, err);
    return m;
}

/* Load `dir` expecting failure with a message that names `file` and says `problem` (and
 * `problem2` when not NULL). */
static void expect_load_error(const char *dir, const char *file, const char *problem, const char *problem2) {
    char err[1024] = "";
    model *m = model_load(dir, err, sizeof err);
    if (m) {
        model_free(m);
        fail_msg("model_load(%s) succeeded; expected an error saying \"%s\"", dir, problem);
    }
    print_message("  refused: %s\n", err);
    if (!strstr(err, file) || !strstr(err, problem) || (problem2 && !strstr(err, problem2)))
        fail_msg("error \"%s\" should name \"%s\" and say \"%s\"%s%s", err, file, problem, problem2 ? " and " : "",
                 problem2 ? problem2 : "");
}

/* ---- 3. loading FP8 checkpoints -------------------------------------------------------- */

/* The projection views of layer l with the fixture tensor each comes from and its first
 * row there (Phi-3's fused qkv_proj / gate_up_proj are split into row views). */
static int layer_projections(const model *m, int l, int fused, const tensor_view *views[7], char names[7][128],
                             int64_t row0[7]) {
    const model_layer *L = &m->layers[l];
    const int64_t Q = (int64_t)m->cfg.n_heads * m->cfg.head_dim, KV = (int64_t)m->cfg.n_kv_heads * m->cfg.head_dim;
    const tensor_view *v[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
    const char *plain[7] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"};
    const char *fusedn[7] = {"self_attn.qkv_proj", "self_attn.qkv_proj", "self_attn.qkv_proj", "self_attn.o_proj",
                             "mlp.gate_up_proj", "mlp.gate_up_proj", "mlp.down_proj"};
    const int64_t r0[7] = {0, Q, Q + KV, 0, 0, m->cfg.ffn, 0};
    for (int i = 0; i < 7; i++) {
        views[i] = v[i];
        snprintf(names[i], 128, "model.layers.%d.%s.weight", l, fused ? fusedn[i] : plain[i]);
        row0[i] = fused ? r0[i] : 0;
    }
    return 7;
}

/* Every projection view of m is F8_E4M3 and converts to exactly this file's dequantization
 * (tensor_to_f32; tensor_to_bf16 its bf16 rounding), its raw rows are the bytes written,
 * and tensor_fp8_row_scales gives the per-row scales (per-row and per-tensor schemes) or
 * refuses (blocks). Other tensors stay bf16. */
static void check_fp8_model(const model *m, const char *fixture, const ckpt_opts *o, int fused) {
    char src[512], p[600];
    fixture_model(src, sizeof src, fixture);
    snprintf(p, sizeof p, "%s/model.safetensors", src);
    raw_st r;
    raw_st_load(&r, p);
    assert_int_equal(m->cfg.fp8, 1);
    assert_int_equal(m->cfg.fp8_block[0], o->sch == SCH_BLOCK_F32 ? o->block[0] : 0);
    assert_int_equal(m->cfg.fp8_block[1], o->sch == SCH_BLOCK_F32 ? o->block[1] : 0);
    assert_int_equal(m->tok_embd.dtype, TDT_BF16);
    assert_int_equal(m->lm_head.dtype, TDT_BF16);
    assert_int_equal(m->out_norm.dtype, TDT_BF16);
    double worst_rel = 0;
    int64_t n_checked = 0, n_changed = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const tensor_view *views[7];
        char names[7][128];
        int64_t row0[7];
        assert_int_equal(m->layers[l].attn_norm.dtype, TDT_BF16);
        assert_int_equal(m->layers[l].ffn_norm.dtype, TDT_BF16);
        layer_projections(m, l, fused, views, names, row0);
        for (int i = 0; i < 7; i++) {
            const tensor_view *v = views[i];
            qtensor q;
            qtensor_make(o, &r, names[i], &q);
            if (v->dtype != TDT_F8_E4M3) fail_msg("%s (view %d): dtype %d, not TDT_F8_E4M3", names[i], i, v->dtype);
            assert_int_equal(v->ndim, 2);
            assert_int_equal(v->shape[1], q.cols);
            const int64_t rows = v->shape[0], cols = q.cols, n = rows * cols;
            assert_true(row0[i] + rows <= q.rows);
            const float *want = q.deq + row0[i] * cols;
            float *f = malloc(sizeof(float) * (size_t)n), *rs = malloc(sizeof(float) * (size_t)rows);
            uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n);
            uint8_t *raw = malloc((size_t)n);
            assert_int_equal(tensor_to_f32(v, f), 0);
            for (int64_t k = 0; k < n; k++)
                if (!same_bits(f[k], want[k]))
                    fail_msg("%s rows [%lld, +%lld) element (%lld, %lld): tensor_to_f32 %a, expected %a (byte 0x%02x "
                             "scale %a)", names[i], (long long)row0[i], (long long)rows, (long long)(k / cols),
                             (long long)(k % cols), (double)f[k], (double)want[k], q.q[row0[i] * cols + k],
                             (double)scale_for(o, q.sc, q.scols, row0[i] + k / cols, k % cols));
            assert_int_equal(tensor_to_bf16(v, h), 0);
            for (int64_t k = 0; k < n; k++)
                if (h[k] != f32_to_bf16(want[k]))
                    fail_msg("%s element %lld: tensor_to_bf16 0x%04x, expected 0x%04x", names[i], (long long)k, h[k],
                             f32_to_bf16(want[k]));
            size_t rb = 0;
            assert_int_equal(tensor_rows_raw(v, 0, rows, raw, &rb), 0);
            assert_int_equal(rb, (size_t)cols);
            assert_memory_equal(raw, q.q + row0[i] * cols, (size_t)n);
            assert_int_equal(tensor_ggml_type(v), -1);
            const int rc = tensor_fp8_row_scales(v, rs);
            if (o->sch == SCH_BLOCK_F32) {
                if (rc == 0) fail_msg("%s: tensor_fp8_row_scales accepted a block-scaled view", names[i]);
            } else {
                if (rc) fail_msg("%s: tensor_fp8_row_scales: %s", names[i], specd_strerror(rc));
                for (int64_t k = 0; k < rows; k++) {
                    const float ws = o->sch == SCH_ROW_F32 ? q.sc[row0[i] + k] : q.sc[0];
                    if (!same_bits(rs[k], ws))
                        fail_msg("%s row %lld: scale %a, expected %a", names[i], (long long)k, (double)rs[k], (double)ws);
                }
            }
            /* the quantization is real and close */
            const float *orig = q.orig + row0[i] * cols;
            worst_rel = fmax(worst_rel, rel_err(f, orig, (size_t)n));
            for (int64_t k = 0; k < n; k++) n_changed += !same_bits(f[k], orig[k]);
            n_checked += n;
            free(f);
            free(rs);
            free(h);
            free(raw);
            qtensor_free(&q);
        }
    }
    print_message("  %s scheme %d: %lld projection weights exact, %lld changed by FP8, worst rel err %.3g\n", fixture,
                  (int)o->sch, (long long)n_checked, (long long)n_changed, worst_rel);
    assert_true(n_changed > n_checked / 4);
    assert_true(worst_rel < (o->sch == SCH_TENSOR_BF16 ? 0.1 : 0.07));
    raw_st_free(&r);
}

static void load_and_check(const char *fixture, const ckpt_opts *o, int fused) {
    char dir[64];
    make_tmpdir(dir);
    write_checkpoint(fixture, dir, o, qconfig_of(o));
    model *m = load_ok(dir);
    check_fp8_model(m, fixture, o, fused);
    model_free(m);
    rm_tmpdir(dir);
}

static void test_load_compressed_tensors_per_row(void **state) {
    (void)state;
    const ckpt_opts o = {.sch = SCH_ROW_F32};
    load_and_check("llama-tiny", &o, 0);
}

static void test_load_fbgemm_per_tensor_bf16(void **state) {
    (void)state;
    const ckpt_opts o = {.sch = SCH_TENSOR_BF16};
    load_and_check("llama-tiny", &o, 0);
}

static void test_load_fp8_blocks_16(void **state) {
    (void)state;
    /* 344 rows / columns: the last block of gate/up rows and of down columns is partial */
    const ckpt_opts o = {.sch = SCH_BLOCK_F32, .block = {16, 16}};
    load_and_check("llama-tiny", &o, 0);
}

/* Phi-3's fused qkv_proj [256, 128] and gate_up_proj [688, 128] are split into row views at
 * 128 / 192 and 344: with 48-row blocks each split starts inside a block, so the views
 * must keep the whole tensor's scale grid (scale_row0); per-row and per-tensor scales must
 * follow the views' rows too. */
static void test_load_fused_phi3_views(void **state) {
    (void)state;
    const ckpt_opts os[] = {{.sch = SCH_BLOCK_F32, .block = {48, 16}}, {.sch = SCH_BLOCK_F32, .block = {48, 40}},
                            {.sch = SCH_ROW_F32}, {.sch = SCH_TENSOR_BF16}};
    for (size_t i = 0; i < sizeof os / sizeof os[0]; i++) load_and_check("phi3-tiny", &os[i], 1);
}

/* safetensors does not align tensors (only the Python writer's dtype order happens to): a
 * file whose F32 / BF16 scales lie at odd offsets loads with the same values. (The rest of
 * the loader reads such tensors with memcpy; under UBSan a cast load of a scale aborts.) */
static void test_load_misaligned_scales(void **state) {
    (void)state;
    const ckpt_opts os[] = {{.sch = SCH_ROW_F32, .misalign = 1}, {.sch = SCH_TENSOR_BF16, .misalign = 1}};
    for (size_t i = 0; i < sizeof os / sizeof os[0]; i++) load_and_check("llama-tiny", &os[i], 0);
}

/* ---- 4. what the loader refuses ----------------------------------------------------------- */

static void test_unsupported_methods_are_named(void **state) {
    (void)state;
    char dir[64];
    const ckpt_opts o = {.sch = SCH_ROW_F32};
    make_tmpdir(dir);
    write_checkpoint("llama-tiny", dir, &o,
                     json_pack("{s:s, s:i, s:i, s:b, s:s}", "quant_method", "awq", "bits", 4, "group_size", 128,
                               "zero_point", 1, "version", "gemm"));
    expect_load_error(dir, "config.json", "\"awq\"", "not supported");
    write_checkpoint("llama-tiny", dir, &o,
                     json_pack("{s:s, s:s}", "quant_method", "compressed-tensors", "format", "pack-quantized"));
    expect_load_error(dir, "config.json", "\"pack-quantized\"", "not supported");
    /* an FP8 method with E5M2 elements */
    write_checkpoint("llama-tiny", dir, &o, json_pack("{s:s, s:s}", "quant_method", "fp8", "fmt", "e5m2"));
    expect_load_error(dir, "config.json", "\"e5m2\"", NULL);
    /* malformed weight_block_size */
    write_checkpoint("llama-tiny", dir, &o,
                     json_pack("{s:s, s:[i]}", "quant_method", "fp8", "weight_block_size", 128));
    expect_load_error(dir, "config.json", "weight_block_size", NULL);
    write_checkpoint("llama-tiny", dir, &o,
                     json_pack("{s:s, s:[i, i]}", "quant_method", "fp8", "weight_block_size", 0, 128));
    expect_load_error(dir, "config.json", "weight_block_size", NULL);
    rm_tmpdir(dir);
}

static void test_broken_fp8_tensors(void **state) {
    (void)state;
    char dir[64];
    make_tmpdir(dir);
    const char *down2 = "model.layers.2.mlp.down_proj.weight";
    const char *k1 = "model.layers.1.self_attn.k_proj.weight";
    ckpt_opts o = {.sch = SCH_ROW_F32, .drop_scale = down2};
    write_checkpoint("llama-tiny", dir, &o, qconfig_of(&o));
    expect_load_error(dir, "model.safetensors", down2, "weight_scale");
    /* one scale short: 63 for k_proj's 64 rows */
    o = (ckpt_opts){.sch = SCH_ROW_F32, .short_scale = k1};
    write_checkpoint("llama-tiny", dir, &o, qconfig_of(&o));
    expect_load_error(dir, "model.safetensors", "model.layers.1.self_attn.k_proj.weight_scale", "63");
    /* block scales one block row short */
    o = (ckpt_opts){.sch = SCH_BLOCK_F32, .block = {16, 16}, .short_scale = down2};
    write_checkpoint("llama-tiny", dir, &o, qconfig_of(&o));
    expect_load_error(dir, "model.safetensors", "model.layers.2.mlp.down_proj.weight_scale_inv", NULL);
    /* block-shaped scales [22, 8] in a checkpoint that declares no weight_block_size */
    o = (ckpt_opts){.sch = SCH_BLOCK_F32, .block = {16, 16}};
    write_checkpoint("llama-tiny", dir, &o, json_pack("{s:s}", "quant_method", "fp8"));
    expect_load_error(dir, "model.safetensors", "_proj.weight_scale_inv", NULL);
    /* a scale of another dtype */
    o = (ckpt_opts){.sch = SCH_ROW_F32, .f16_scale = k1};
    write_checkpoint("llama-tiny", dir, &o, qconfig_of(&o));
    expect_load_error(dir, "model.safetensors", "model.layers.1.self_attn.k_proj.weight_scale", "F16");
    /* an F8 vector (a norm) */
    o = (ckpt_opts){.sch = SCH_ROW_F32, .f8_vector = "model.layers.0.input_layernorm.weight"};
    write_checkpoint("llama-tiny", dir, &o, qconfig_of(&o));
    expect_load_error(dir, "model.safetensors", "model.layers.0.input_layernorm.weight", "F8_E4M3");
    /* F8 weights in a checkpoint whose config has no quantization_config */
    o = (ckpt_opts){.sch = SCH_ROW_F32};
    write_checkpoint("llama-tiny", dir, &o, NULL);
    expect_load_error(dir, "model.safetensors", "F8_E4M3", "quantization_config");
    rm_tmpdir(dir);
}

/* ---- 5. end to end on the CPU runner ------------------------------------------------------ */

#define E2E_PROMPT 20
#define E2E_GEN 16
#define E2E_ROWS (E2E_PROMPT + E2E_GEN - 1)   /* logits rows: every prompt position, then each fed token */

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* RMS of a - ref over RMS of ref. */
static double rms_rel(const float *a, const float *ref, int n) {
    double se = 0, sr = 0;
    for (int i = 0; i < n; i++) {
        se += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        sr += (double)ref[i] * ref[i];
    }
    return sqrt(se / sr);
}

static void e2e_prompt(int32_t *p) {
    for (int i = 0; i < E2E_PROMPT; i++) p[i] = (int32_t)((i * 131 + 7) % 1000 + 3);
}

/* Greedy on the CPU runner: the prompt in one forward (logits of every position), then
 * one token at a time. seq: prompt + E2E_GEN tokens (with `forced`, its tokens are fed
 * instead of the argmax: teacher forcing); logits: [E2E_ROWS, vocab]. */
static void run_greedy(const model *m, int weights_fp8, int kv_fp8, const int32_t *forced, int32_t *seq, float *logits) {
    char err[512] = "";
    runner_config rc = {.num_blocks = 8, .block_size = 16, .max_batch = 1, .max_seq_len = 64,
                        .max_tokens_per_step = 64, .threads = 2, .weights_fp8 = weights_fp8,
                        .kv_fp8 = kv_fp8};
    runner *r = runner_cpu_create(m, NULL, &rc, err, sizeof err);
    if (!r) fail_msg("runner_cpu_create: %s", err);
    const int32_t blocks[3] = {3, 1, 6};
    assert_int_equal(r->ops->slot_write_blocks(r, 0, 0, blocks, 3), 0);
    const int V = m->cfg.vocab;
    e2e_prompt(seq);
    runner_row row = {.slot = 0, .n_new = E2E_PROMPT, .n_logits = E2E_PROMPT};
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = seq, .n_tokens = E2E_PROMPT,
                      .logits = logits};
    assert_int_equal(runner_forward(r, &b), 0);
    for (int t = E2E_PROMPT; t < E2E_PROMPT + E2E_GEN; t++) {
        seq[t] = forced ? forced[t] : argmax(logits + (size_t)(t - 1) * V, V);
        if (t == E2E_PROMPT + E2E_GEN - 1) break;
        row = (runner_row){.slot = 0, .n_new = 1, .n_logits = 1};
        b = (runner_batch){.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = seq + t, .n_tokens = 1,
                           .logits = logits + (size_t)t * V};
        assert_int_equal(runner_forward(r, &b), 0);
    }
    runner_destroy(r);
}

/* The per-row checkpoint (this file's quantizer, fp8.h's scheme) loaded as it is and the
 * bf16 original loaded with weights_fp8 = 1 compute with the same weights: the same
 * logits, bit for bit, at every position of a 20-token prompt and 16 greedy tokens. The
 * unquantized original fed the same tokens gives other logits, close to them. */
static void test_e2e_runner_fp8_checkpoint_equals_dtype_fp8(void **state) {
    (void)state;
    char dir[64], orig_dir[512];
    fixture_model(orig_dir, sizeof orig_dir, "llama-tiny");
    make_tmpdir(dir);
    const ckpt_opts o = {.sch = SCH_ROW_F32};
    write_checkpoint("llama-tiny", dir, &o, qconfig_of(&o));
    model *mq = load_ok(dir), *mo = load_ok(orig_dir);
    const int V = mo->cfg.vocab;
    float *lq = malloc(sizeof(float) * (size_t)E2E_ROWS * V), *lf = malloc(sizeof(float) * (size_t)E2E_ROWS * V);
    float *lo = malloc(sizeof(float) * (size_t)E2E_ROWS * V), *lg = malloc(sizeof(float) * (size_t)E2E_ROWS * V);
    int32_t sq[E2E_PROMPT + E2E_GEN], sf[E2E_PROMPT + E2E_GEN], so[E2E_PROMPT + E2E_GEN], sg[E2E_PROMPT + E2E_GEN];
    run_greedy(mq, 0, 0, NULL, sq, lq);        /* FP8 checkpoint, dequantized by the runner */
    run_greedy(mo, 1, 0, NULL, sf, lf);        /* bf16 original, --dtype fp8 */
    run_greedy(mo, 0, 0, sq, so, lo);          /* bf16 original as it is, fed the same tokens */
    run_greedy(mo, 0, 0, NULL, sg, lg);        /* bf16 original, its own greedy tokens */
    assert_memory_equal(sq, sf, sizeof sq);
    for (size_t i = 0; i < (size_t)E2E_ROWS * V; i++)
        if (!same_bits(lq[i], lf[i]))
            fail_msg("logits row %zu id %zu: FP8 checkpoint %a, --dtype fp8 %a", i / V, i % V, (double)lq[i],
                     (double)lf[i]);
    /* The tiny random model's logits are flat (|logit| < 4, top-2 margins often < 0.1) and
     * FP8 moves them by a few tenths, so free-running greedy may part at once (it does at
     * the first generated token, margin 0.086): closeness is judged per position on the
     * same tokens instead, by the RMS of the difference over the RMS of the logits and by
     * the top-1 token. Wrong scales or bytes would give differences of the logits' size. */
    double worst = 0, maxdiff = 0;
    int top1 = 0;
    for (int p = 0; p < E2E_ROWS; p++) {
        const float *a = lq + (size_t)p * V, *r = lo + (size_t)p * V;
        worst = fmax(worst, rms_rel(a, r, V));
        for (int i = 0; i < V; i++) maxdiff = fmax(maxdiff, fabs((double)a[i] - r[i]));
        top1 += argmax(a, V) == argmax(r, V);
    }
    int agree = 0;
    while (agree < E2E_GEN && sq[E2E_PROMPT + agree] == sg[E2E_PROMPT + agree]) agree++;
    print_message("  FP8 vs bf16 logits on the same %d positions: max |diff| %.3g, worst RMS rel err %.3g, top-1 "
                  "equal at %d; free-running greedy tokens agree for the first %d of %d\n",
                  E2E_ROWS, maxdiff, worst, top1, agree, E2E_GEN);
    assert_true(maxdiff > 0.01);            /* the rounding is real */
    assert_true(worst < 0.25);
    assert_true(top1 >= E2E_ROWS * 3 / 4);
    free(lq);
    free(lf);
    free(lo);
    free(lg);
    model_free(mq);
    model_free(mo);
    rm_tmpdir(dir);
}

/* Through the engine: ENGINE_WEIGHTS_FP8 (--dtype fp8) on the bf16 original gives the FP8
 * checkpoint's tokens, logprobs, top logprobs and first-token logits exactly; the default
 * (or --dtype bf16) on the original gives other logits, close to them. */
typedef struct {
    int32_t ids[E2E_GEN];
    float lp[E2E_GEN];
    int32_t top_ids[E2E_GEN][5];
    float top_lp[E2E_GEN][5];
    int n;
    float *first_logits;
} engine_run;

/* nreq requests with ids id0.. of the e2e prompt (greedy, E2E_GEN tokens, 5 top logprobs)
 * on e, run to the end: out[q] gets request q's tokens and logprobs, and out[0] the first
 * token's logits too when out[0].first_logits is set (sized vocab). */
static void run_requests(engine *e, uint64_t id0, int nreq, engine_run *out) {
    char err[1024] = "";
    int32_t prompt[E2E_PROMPT];
    e2e_prompt(prompt);
    engine_sampling sp;
    engine_sampling_defaults(&sp);
    sp.temperature = 0;
    sp.ignore_eos = 1;
    sp.max_tokens = E2E_GEN;
    sp.logprobs = 5;
    for (int q = 0; q < nreq; q++) {
        out[q].n = 0;
        assert_int_equal(engine_add_ex(e, id0 + (uint64_t)q, prompt, E2E_PROMPT, &sp, 1, err, sizeof err), 0);
    }
    int got_logits = !out[0].first_logits;
    while (engine_has_work(e)) {
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int k = 0; k < o.n_events; k++) {
            const engine_event *ev = &o.events[k];
            assert_true(ev->req_id >= id0 && ev->req_id < id0 + (uint64_t)nreq);
            engine_run *r = &out[ev->req_id - id0];
            if (!got_logits && ev->req_id == id0 && ev->n_tokens > 0) {
                assert_int_equal(engine_first_logits(e, id0, r->first_logits), 0);
                got_logits = 1;
            }
            for (int t = 0; t < ev->n_tokens && r->n < E2E_GEN; t++, r->n++) {
                r->ids[r->n] = ev->tokens[t].id;
                r->lp[r->n] = ev->tokens[t].logprob;
                assert_int_equal(ev->tokens[t].n_top, 5);
                memcpy(r->top_ids[r->n], ev->tokens[t].top_ids, sizeof r->top_ids[0]);
                memcpy(r->top_lp[r->n], ev->tokens[t].top_logprobs, sizeof r->top_lp[0]);
            }
            assert_true(ev->finish == ENGINE_RUNNING || ev->finish == ENGINE_FINISH_LENGTH);
        }
    }
    for (int q = 0; q < nreq; q++) assert_int_equal(out[q].n, E2E_GEN);
    assert_true(got_logits);
}

static engine *open_engine(const char *path, int weights_dtype, int kv_dtype, int max_batch) {
    char err[1024] = "";
    engine_config c = {.model_path = path, .max_seq_len = 128, .max_batch = max_batch, .kv_bytes = 16u << 20,
                       .threads = 2, .weights_dtype = weights_dtype, .kv_dtype = kv_dtype};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("engine_create(%s): %s", path, err);
    return e;
}

static void run_engine(const char *path, int weights_dtype, int kv_dtype, engine_run *out) {
    engine *e = open_engine(path, weights_dtype, kv_dtype, 2);
    out->first_logits = malloc(sizeof(float) * (size_t)engine_model_config(e)->vocab);
    run_requests(e, 1, 1, out);
    engine_destroy(e);
}

static void test_e2e_engine_dtype_fp8(void **state) {
    (void)state;
    char dir[64], orig_dir[512];
    fixture_model(orig_dir, sizeof orig_dir, "llama-tiny");
    make_tmpdir(dir);
    const ckpt_opts o = {.sch = SCH_ROW_F32};
    write_checkpoint("llama-tiny", dir, &o, qconfig_of(&o));
    engine_run q, f, b, b16;
    run_engine(dir, ENGINE_WEIGHTS_AUTO, ENGINE_KV_AUTO, &q);
    run_engine(orig_dir, ENGINE_WEIGHTS_FP8, ENGINE_KV_AUTO, &f);
    run_engine(orig_dir, ENGINE_WEIGHTS_AUTO, ENGINE_KV_AUTO, &b);
    run_engine(orig_dir, ENGINE_WEIGHTS_BF16, ENGINE_KV_AUTO, &b16);   /* --dtype bf16: no rounding either */
    const int V = 1024;
    assert_memory_equal(b.ids, b16.ids, sizeof b.ids);
    assert_memory_equal(b.first_logits, b16.first_logits, sizeof(float) * V);
    assert_memory_equal(q.ids, f.ids, sizeof q.ids);
    assert_memory_equal(q.lp, f.lp, sizeof q.lp);
    assert_memory_equal(q.top_ids, f.top_ids, sizeof q.top_ids);
    assert_memory_equal(q.top_lp, f.top_lp, sizeof q.top_lp);
    assert_memory_equal(q.first_logits, f.first_logits, sizeof(float) * V);
    assert_memory_not_equal(q.first_logits, b.first_logits, sizeof(float) * V);
    const double rel = rms_rel(q.first_logits, b.first_logits, V);
    print_message("  engine: --dtype fp8 == FP8 checkpoint (16 tokens, logprobs, top 5, logits); vs bf16 first "
                  "logits RMS rel err %.3g\n", rel);
    assert_true(rel < 0.25);
    free(q.first_logits);
    free(f.first_logits);
    free(b.first_logits);
    free(b16.first_logits);
    rm_tmpdir(dir);
}

/* ---- 6. FP8 KV cache (--kv-cache-dtype fp8) on the CPU runner ---------------------------- */

/* Worst per-position RMS relative error of logits a against r over E2E_ROWS positions, the
 * largest absolute difference and the positions whose top-1 ids agree. */
static double worst_rel(const float *a, const float *r, int V, double *maxdiff, int *top1) {
    double worst = 0;
    *maxdiff = 0;
    *top1 = 0;
    for (int p = 0; p < E2E_ROWS; p++) {
        const float *x = a + (size_t)p * V, *y = r + (size_t)p * V;
        worst = fmax(worst, rms_rel(x, y, V));
        for (int i = 0; i < V; i++) *maxdiff = fmax(*maxdiff, fabs((double)x[i] - y[i]));
        *top1 += argmax(x, V) == argmax(y, V);
    }
    return worst;
}

/* The cache holds E4M3 codes: logits on the same tokens move by a bounded amount from the
 * fp32 cache's (the rounding is real, the values are right), a block takes a quarter of
 * the fp32 bytes, and the checkpoint's k_scale / v_scale are used on both sides: a power
 * of two that keeps the values in E4M3's normal range changes almost nothing (stored x / s,
 * read back times s), while a scale that pushes them into the subnormals costs far more. */
static void test_kv_fp8_runner(void **state) {
    (void)state;
    char orig_dir[512], dq[64], dbig[64];
    fixture_model(orig_dir, sizeof orig_dir, "llama-tiny");
    make_tmpdir(dq);
    make_tmpdir(dbig);
    const ckpt_opts oq = {.bf16 = 1, .k_scale = 0.25f, .v_scale = 0.125f};
    const ckpt_opts ob = {.bf16 = 1, .k_scale = 256.f, .v_scale = 256.f};
    write_checkpoint("llama-tiny", dq, &oq, NULL);
    write_checkpoint("llama-tiny", dbig, &ob, NULL);
    model *mo = load_ok(orig_dir), *mq = load_ok(dq), *mb = load_ok(dbig);
    assert_true(mo->layers[0].k_scale == 0.f && mo->layers[0].v_scale == 0.f);
    for (int l = 0; l < mq->cfg.n_layers; l++)
        assert_true(mq->layers[l].k_scale == 0.25f && mq->layers[l].v_scale == 0.125f);
    assert_int_equal(runner_cpu_block_bytes(mo, NULL, 16, 0, RUNNER_POOL_ALL), 4 * runner_cpu_block_bytes(mo, NULL, 16, 1, RUNNER_POOL_ALL));
    assert_int_equal(runner_cpu_block_bytes(mo, NULL, 16, 1, RUNNER_POOL_ALL), 2 * 16 * (size_t)mo->cfg.n_layers * mo->cfg.n_kv_heads *
                                                                    mo->cfg.head_dim);

    const int V = mo->cfg.vocab;
    const size_t nl = (size_t)E2E_ROWS * V;
    float *l32 = malloc(sizeof(float) * nl), *l8 = malloc(sizeof(float) * nl), *l8q = malloc(sizeof(float) * nl);
    float *l8b = malloc(sizeof(float) * nl), *lq32 = malloc(sizeof(float) * nl), *lfree = malloc(sizeof(float) * nl);
    int32_t s32[E2E_PROMPT + E2E_GEN], s8[E2E_PROMPT + E2E_GEN], tmp[E2E_PROMPT + E2E_GEN];
    run_greedy(mo, 0, 0, NULL, s32, l32);   /* fp32 cache, its own greedy tokens */
    run_greedy(mo, 0, 1, s32, tmp, l8);     /* FP8 cache, scale 1, fed the same tokens */
    run_greedy(mq, 0, 1, s32, tmp, l8q);    /* FP8 cache, the checkpoint's 1/4 and 1/8 */
    run_greedy(mb, 0, 1, s32, tmp, l8b);    /* FP8 cache, 256: values into the subnormals */
    run_greedy(mq, 0, 0, s32, tmp, lq32);   /* scales without --kv-cache-dtype fp8: unused */
    run_greedy(mo, 0, 1, NULL, s8, lfree);   /* free-running */
    double md, md_q, md_b;
    int top1, top1_q, top1_b;
    const double e = worst_rel(l8, l32, V, &md, &top1);
    const double eq = worst_rel(l8q, l8, V, &md_q, &top1_q);
    const double eb = worst_rel(l8b, l32, V, &md_b, &top1_b);
    int agree = 0;
    while (agree < E2E_GEN && s8[E2E_PROMPT + agree] == s32[E2E_PROMPT + agree]) agree++;
    print_message("  FP8 KV vs fp32 KV on the same %d positions: max |diff| %.3g, worst RMS rel %.3g, top-1 equal "
                  "at %d; scales 1/4, 1/8 vs 1: worst RMS rel %.3g; scale 256: %.3g (top-1 at %d); free-running "
                  "greedy agrees for %d of %d tokens\n",
                  E2E_ROWS, md, e, top1, eq, eb, top1_b, agree, E2E_GEN);
    assert_memory_equal(lq32, l32, sizeof(float) * nl);
    assert_true(md > 1e-3);                 /* the cache really is rounded */
    assert_true(e < 0.2);   /* 3 mantissa bits on flat logits (top-2 margins often < 0.1) */
    assert_true(top1 >= E2E_ROWS * 3 / 4);
    assert_true(eq < e / 2);                /* scaled by powers of two: the same values, nearly */
    assert_true(eb > 2 * e);                /* the scale reaches the cache */
    free(l32);
    free(l8);
    free(l8q);
    free(l8b);
    free(lq32);
    free(lfree);
    model_free(mo);
    model_free(mq);
    model_free(mb);
    rm_tmpdir(dq);
    rm_tmpdir(dbig);
}

/* A KV scale that is not one positive value is refused by name. */
static void test_kv_fp8_broken_scales(void **state) {
    (void)state;
    char dir[64];
    const ckpt_opts bad[] = {{.bf16 = 1, .k_scale = 1.f, .v_scale = 1.f, .kv_scale_shape2 = 1},
                             {.bf16 = 1, .k_scale = 1.f, .v_scale = -2.f}};
    const char *which[] = {"model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"};
    for (int i = 0; i < 2; i++) {
        make_tmpdir(dir);
        write_checkpoint("llama-tiny", dir, &bad[i], NULL);
        expect_load_error(dir, which[i], "one positive", "KV cache scale");
        rm_tmpdir(dir);
    }
}

/* Through the engine with prefix caching: the same prompt alone, then four at once (their
 * prompt blocks shared from the cache), gives the same tokens and logprobs every time on
 * an FP8 cache, and other logprobs than the fp32 cache. */
static void test_kv_fp8_engine(void **state) {
    (void)state;
    char orig_dir[512];
    fixture_model(orig_dir, sizeof orig_dir, "llama-tiny");
    engine_run a, f;
    run_engine(orig_dir, ENGINE_WEIGHTS_AUTO, ENGINE_KV_FP8, &a);
    run_engine(orig_dir, ENGINE_WEIGHTS_AUTO, ENGINE_KV_AUTO, &f);
    assert_memory_not_equal(a.lp, f.lp, sizeof a.lp);
    engine *e = open_engine(orig_dir, ENGINE_WEIGHTS_AUTO, ENGINE_KV_FP8, 4);
    for (int round = 0; round < 2; round++) {   /* alone, then four at once sharing the prompt's blocks */
        const int nreq = round ? 4 : 1;
        engine_run r[4];
        memset(r, 0, sizeof r);
        run_requests(e, (uint64_t)(10 * round + 1), nreq, r);
        for (int q = 0; q < nreq; q++) {
            assert_memory_equal(r[q].ids, a.ids, sizeof a.ids);
            assert_memory_equal(r[q].lp, a.lp, sizeof a.lp);
        }
    }
    engine_destroy(e);
    free(a.first_logits);
    free(f.first_logits);
}

static int setup(void **state) {
    (void)state;
    ref_init();
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_all_codes),
        cmocka_unit_test(test_encode_rounding_saturation_tiny),
        cmocka_unit_test(test_conversion_checks_catch_mutants),
        cmocka_unit_test(test_quantize_row),
        cmocka_unit_test(test_quantizer_checks_catch_mutants),
        cmocka_unit_test(test_round_row_matches_quantizer),
        cmocka_unit_test(test_load_compressed_tensors_per_row),
        cmocka_unit_test(test_load_fbgemm_per_tensor_bf16),
        cmocka_unit_test(test_load_fp8_blocks_16),
        cmocka_unit_test(test_load_fused_phi3_views),
        cmocka_unit_test(test_unsupported_methods_are_named),
        cmocka_unit_test(test_broken_fp8_tensors),
        cmocka_unit_test(test_e2e_runner_fp8_checkpoint_equals_dtype_fp8),
        cmocka_unit_test(test_e2e_engine_dtype_fp8),
        cmocka_unit_test(test_kv_fp8_runner),
        cmocka_unit_test(test_kv_fp8_broken_scales),
        cmocka_unit_test(test_kv_fp8_engine),
        cmocka_unit_test(test_load_misaligned_scales),   /* last: UBSan aborts the binary here */
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
