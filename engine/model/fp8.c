/* FP8 E4M3 conversions and the per-row quantizer (see fp8.h). */
#include "engine/model/fp8.h"

#include <math.h>

float fp8_e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) return NAN;
    if (e == 0) v = ldexpf((float)m, -9);                  /* subnormal: m/8 * 2^-6 */
    else v = ldexpf(1.0f + (float)m * 0.125f, e - 7);
    return (b & 0x80) ? -v : v;
}

uint8_t fp8_e4m3_from_f32(float x) {
    if (isnan(x)) return 0x7f;
    const uint8_t s = signbit(x) ? 0x80 : 0;
    const float a = fabsf(x);
    if (a >= FP8_E4M3_MAX) return s | 0x7e;                /* satfinite (infinities too) */
    if (a < 0x1p-6f) return s | (uint8_t)nearbyintf(a * 0x1p9f);   /* subnormal; 8 = 2^-6 */
    int ex;
    frexpf(a, &ex);                                        /* a = f 2^ex, f in [0.5, 1) */
    int e = ex - 1;
    int q = (int)nearbyintf((ldexpf(a, -e) - 1.0f) * 8.0f);   /* exact until this rounding */
    if (q == 8) {
        e++;
        q = 0;
    }
    return s | (uint8_t)((e + 7) << 3 | q);
}

void fp8_quantize_row(const float *x, int64_t n, uint8_t *q, float *scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.f ? FP8_E4M3_MAX / amax : 1.f;
    *scale = amax > 0.f ? amax / FP8_E4M3_MAX : 1.f;
    for (int64_t i = 0; i < n; i++) q[i] = fp8_e4m3_from_f32(x[i] * inv);
}

void fp8_round_row(float *x, int64_t n) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (!(amax > 0.f)) return;
    const float inv = FP8_E4M3_MAX / amax, scale = amax / FP8_E4M3_MAX;
    for (int64_t i = 0; i < n; i++) x[i] = fp8_e4m3_to_f32(fp8_e4m3_from_f32(x[i] * inv)) * scale;
}
