/* Device helpers shared by the rotary / KV-write epilogues: the separate kernel
 * (rope_kv.cu, any batch, with q/k norm) and the fused QKV GEMV (gemv.cu, batch 1-2). */
#ifndef SPECD_ROPE_CUH
#define SPECD_ROPE_CUH

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

/* Token t's position and the element index in the pool where the current layer's K/V
 * of its block start (-1 when the position is past the slot's capacity: such tokens are
 * not written). */
__device__ __forceinline__ long long rope_kv_block(const k_kv_geom &g, int t, int &pos) {
    const int slot = g.tok_slot[t];
    pos = g.lens[slot * 2 + g.which] + g.tok_j[t];
    if (pos < 0 || pos >= g.max_blocks * g.block_size) return -1;
    const int b = g.bt[(size_t)slot * g.max_blocks + pos / g.block_size];
    return (long long)((size_t)b * g.block_elems + g.layer_off);
}

/* Where a K or V row starting at pool element e goes, and how its values are stored:
 * bf16, or E4M3 bytes of x * inv (inv = 1 / the layer's K or V scale). */
typedef struct {
    void *p;       /* NULL: not written */
    float inv;
    int f8;
} kv_dst;

__device__ __forceinline__ kv_dst kv_dst_at(const k_kv_geom &g, long long e, bool is_v) {
    kv_dst d;
    d.f8 = g.kv_fp8;
    d.inv = g.kv_fp8 ? 1.f / (is_v ? g.v_scale : g.k_scale) : 1.f;
    d.p = e < 0 ? NULL
                : g.kv_fp8 ? (void *)((uint8_t *)*g.pool_pp + e) : (void *)((uint16_t *)*g.pool_pp + e);
    return d;
}

/* Element i of the row. */
/* A K or V value as the pool stores it: bf16, or the E4M3 code of x * inv (inv: 1 / the
 * layer's scale). */
__device__ __forceinline__ uint16_t kv_code_bf16(float x) { return k_f2bf(x); }
__device__ __forceinline__ uint8_t kv_code_fp8(float x, float inv) { return k_f2fp8(x * inv); }

__device__ __forceinline__ void kv_put(const kv_dst &d, int i, float x) {
    if (d.f8) ((uint8_t *)d.p)[i] = kv_code_fp8(x, d.inv);
    else ((uint16_t *)d.p)[i] = kv_code_bf16(x);
}

/* Element offset of head kvh's row at pos inside a layer's block: K heads, then V heads. */
__device__ __forceinline__ size_t rope_kv_off(const k_kv_geom &g, int KVH, int D, int kvh, bool is_v, int pos) {
    size_t o = ((size_t)kvh * g.block_size + pos % g.block_size) * D;
    return is_v ? o + (size_t)KVH * g.block_size * D : o;
}

/* HF rotate_half on the pair (a, c) = (x[i], x[i + D/2]) at angle pos * f. */
__device__ __forceinline__ void rope_rotate(float a, float c, int pos, float f, float &o1, float &o2) {
    float sn, cs;
    sincosf((float)pos * f, &sn, &cs);
    o1 = a * cs - c * sn;
    o2 = c * cs + a * sn;
}

/* One warp's head of a QKV row, lane holding the pairs (i, i + D/2) for i = lane + 32p
 * (x1, x2: the projection's values there, pairs past D/2 ignored): the bias added; for q
 * and k (rot) the per-head RMSNorm with weight nw (NULL: none, Qwen3 / Gemma 3 have it)
 * and HF rotate_half at position pos. The separate rotary kernel (rope_kv.cu) and the
 * decode attention that does this itself (attention.cu, k_rope_attention) both call
 * it, so the two give the same bits. Every lane of the warp calls it together. */
template <int P>
__device__ __forceinline__ void rope_head(float (&x1)[P], float (&x2)[P], const float *bb, const float *nw,
                                          const float *inv_freq, float eps, int D, int pos, int lane, bool rot) {
    const int half = D / 2;
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < P; p++) {
        const int i = lane + 32 * p;
        if (i < half) {
            x1[p] = x1[p] + (bb ? bb[i] : 0.f);
            x2[p] = x2[p] + (bb ? bb[i + half] : 0.f);
            ss += x1[p] * x1[p] + x2[p] * x2[p];
        }
    }
    if (!rot) return;
    float inv = 1.f;
    if (nw) inv = rsqrtf(k_warp_sum(ss) / (float)D + eps);
#pragma unroll
    for (int p = 0; p < P; p++) {
        const int i = lane + 32 * p;
        if (i >= half) continue;
        float a = x1[p], c = x2[p];
        if (nw) {
            a = a * inv * nw[i];
            c = c * inv * nw[i + half];
        }
        rope_rotate(a, c, pos, inv_freq[i], x1[p], x2[p]);
    }
}

/* What the epilogue for pair (i, i + D/2) of head hh (q heads, then k, then v) of token
 * t reads besides the projection, gathered early so a GEMV's tail does not wait on its
 * chain of loads (slot -> length -> block table) or on sincosf. */
typedef struct {
    kv_dst dst;      /* the pair's K or V row in the pool (p NULL: q, or past the capacity) */
    float b1, b2;    /* bias (0 without) */
    float sn, cs;    /* rotation (q and k) */
} rope_pair_pre;

__device__ __forceinline__ void rope_pair_prepare(const k_kv_geom &g, const float *bias, const float *inv_freq,
                                                  int H, int KVH, int D, int t, int hh, int i, rope_pair_pre &pr) {
    const int half = D / 2;
    pr.b1 = bias ? bias[(size_t)hh * D + i] : 0.f;
    pr.b2 = bias ? bias[(size_t)hh * D + i + half] : 0.f;
    int pos;
    const long long blk = rope_kv_block(g, t, pos);
    pr.sn = 0.f;
    pr.cs = 1.f;
    if (hh < H + KVH) sincosf((float)pos * inv_freq[i], &pr.sn, &pr.cs);
    const bool is_v = hh >= H + KVH;
    pr.dst = kv_dst_at(g, hh >= H && blk >= 0 ? blk + (long long)rope_kv_off(g, KVH, D, is_v ? hh - H - KVH : hh - H,
                                                                             is_v, pos)
                                              : -1,
                       is_v);
}

/* The epilogue for that pair from the projection outputs v1, v2 (no q/k norm): bias,
 * rotation of q and k, q to q_out [t, hh, :] fp32, k and v into the pool. */
__device__ __forceinline__ void rope_store_pair(const rope_pair_pre &pr, float *q_out, int H, int D, int t, int hh,
                                                int i, float v1, float v2) {
    const int half = D / 2;
    v1 += pr.b1;
    v2 += pr.b2;
    const float o1 = v1 * pr.cs - v2 * pr.sn, o2 = v2 * pr.cs + v1 * pr.sn;   /* HF rotate_half */
    if (hh < H) {
        float *qd = q_out + ((size_t)t * H + hh) * D;
        qd[i] = o1;
        qd[i + half] = o2;
        return;
    }
    if (!pr.dst.p) return;
    kv_put(pr.dst, i, o1);   /* V: sn = 0, cs = 1 */
    kv_put(pr.dst, i + half, o2);
}

#endif
