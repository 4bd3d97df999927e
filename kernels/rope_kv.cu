/* QKV epilogue: the fused QKV GEMM writes fp32 [n, (H + 2*KVH) * D] (or an unscaled FP8
 * GEMM does, and the row and token scales are applied here first); this kernel adds the
 * Qwen2 bias, applies the Qwen3 per-head q/k RMSNorm, rotates q and k (HF rotate_half:
 * pairs (i, i + D/2)), and writes q (fp32) for the attention and k, v (bf16, or E4M3 over
 * the layer's scale) into the paged pool. The position comes from the slot's length in
 * device memory plus the token's index in its row, so the same launch works inside a
 * replayed graph. */
#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/rope.cuh"

#define ROPE_MAX_PAIRS_PER_LANE 4   /* D <= 256 */

__global__ void qkv_rope_kv_kernel(const float *qkv, const float *sw, const float *sx, const float *bias,
                                   const float *q_norm, const float *k_norm, const float *inv_freq, float eps,
                                   float *q_out, int H, int KVH, int D, k_kv_geom g) {
    k_pdl_trigger();
    k_pdl_wait();
    int t = blockIdx.x;
    int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    int warp = blockIdx.y * nwarps + (threadIdx.x >> 5);   /* heads spread over gridDim.y blocks */
    nwarps *= gridDim.y;
    int width = (H + 2 * KVH) * D, half = D / 2;
    int pos;
    const long long blk = rope_kv_block(g, t, pos);
    const float *row = qkv + (size_t)t * width;
    const float st = sw ? sx[t] : 1.f;

    for (int hh = warp; hh < H + 2 * KVH; hh += nwarps) {
        const float *x = row + (size_t)hh * D;
        const float *bb = bias ? bias + (size_t)hh * D : NULL;
        int is_q = hh < H, is_k = !is_q && hh < H + KVH;
        float x1[ROPE_MAX_PAIRS_PER_LANE], x2[ROPE_MAX_PAIRS_PER_LANE];
#pragma unroll
        for (int p = 0; p < ROPE_MAX_PAIRS_PER_LANE; p++) {
            int i = lane + 32 * p;
            x1[p] = x2[p] = 0.f;
            if (i < half) {
                float a = x[i], c = x[i + half];
                if (sw) {   /* an unscaled FP8 GEMM's output: k_fp8_scale_rows' product (never fused with the bias add) */
                    a = __fmul_rn(a, sw[(size_t)hh * D + i] * st);
                    c = __fmul_rn(c, sw[(size_t)hh * D + i + half] * st);
                }
                x1[p] = a;
                x2[p] = c;
            }
        }
        rope_head(x1, x2, bb, is_q ? q_norm : k_norm, inv_freq, eps, D, pos, lane, is_q || is_k);
        if (is_q) {
            float *qd = q_out + ((size_t)t * H + hh) * D;
#pragma unroll
            for (int p = 0; p < ROPE_MAX_PAIRS_PER_LANE; p++) {
                int i = lane + 32 * p;
                if (i >= half) continue;
                qd[i] = x1[p];
                qd[i + half] = x2[p];
            }
            continue;
        }
        if (blk < 0) continue;
        const kv_dst dst =
            kv_dst_at(g, blk + (long long)rope_kv_off(g, KVH, D, is_k ? hh - H : hh - H - KVH, !is_k, pos), !is_k);
#pragma unroll
        for (int p = 0; p < ROPE_MAX_PAIRS_PER_LANE; p++) {
            int i = lane + 32 * p;
            if (i >= half) continue;
            kv_put(dst, i, x1[p]);
            kv_put(dst, i + half, x2[p]);
        }
    }
}

extern "C" int k_qkv_rope_kv_fp8(const float *qkv, const float *sw, const float *sx, const float *bias,
                                 const float *q_norm, const float *k_norm, const float *inv_freq, float eps,
                                 float *q_out, int n, int H, int KVH, int D, const k_kv_geom *g, cudaStream_t s) {
    if (n < 0 || H <= 0 || KVH <= 0 || D <= 0 || (D & 1) || D > 64 * ROPE_MAX_PAIRS_PER_LANE || (!sw != !sx))
        return -1;
    if (n == 0) return 0;
    /* one warp per head: small batches get a block per 8 heads, so one token still spreads
     * over several multiprocessors */
    int heads = H + 2 * KVH, by = n >= 64 ? 1 : (heads + 7) / 8;
    return k_launch(qkv_rope_kv_kernel, dim3(n, by), dim3(256), 0, s, qkv, sw, sx, bias, q_norm, k_norm, inv_freq,
                    eps, q_out, H, KVH, D, *g);
}

extern "C" int k_qkv_rope_kv(const float *qkv, const float *bias, const float *q_norm, const float *k_norm,
                             const float *inv_freq, float eps, float *q_out, int n, int H, int KVH, int D,
                             const k_kv_geom *g, cudaStream_t s) {
    return k_qkv_rope_kv_fp8(qkv, NULL, NULL, bias, q_norm, k_norm, inv_freq, eps, q_out, n, H, KVH, D, g, s);
}
