/* FP8 E4M3 on the host (prefix fp8_): the element format of FP8 checkpoints and of
 * `--dtype fp8` weights, and the per-row quantizer both runners share.
 *
 * E4M3 as NVIDIA's __nv_fp8_e4m3 and the OCP "E4M3FN" define it: 1 sign bit, 4 exponent
 * bits (bias 7), 3 mantissa bits, subnormals, no infinities, one NaN pattern per sign
 * (S.1111.111); the largest finite value is 448. Conversion from fp32 rounds to nearest,
 * ties to even, and saturates to +-448 (what the device's cvt with satfinite does, so a
 * row quantized here and on the GPU gives the same bytes: tests/gpu checks it). */
#ifndef SPECD_FP8_H
#define SPECD_FP8_H

#include <stdint.h>

#define FP8_E4M3_MAX 448.0f

float fp8_e4m3_to_f32(uint8_t b);
uint8_t fp8_e4m3_from_f32(float x);

/* Per-row (per output channel) quantization: scale = max|x| / 448 (1 for a row of zeros),
 * q[i] = e4m3(x[i] * (448 / max|x|)), so x[i] ~ q[i] * scale. The kernels' quantizers
 * (kernels/fp8.cu) compute the same expressions in the same order. */
void fp8_quantize_row(const float *x, int64_t n, uint8_t *q, float *scale);

/* x[i] = e4m3(x[i] quantized as above) * scale: a row rounded to what FP8 weights hold. */
void fp8_round_row(float *x, int64_t n);

#endif
