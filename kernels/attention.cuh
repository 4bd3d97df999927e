/* What the attention kernels of attention.cu and attention_tc.cu share so that k_attention
 * can pick any per call: the keys one block covers (work item, split), the empty partials
 * of a split without keys, the store of an output element (with its int8 rounding for
 * an int8 O GEMV), and the merge of a decode block's warps. The SIMT decode kernel keeps
 * its own copy of the geometry: it computes it twice around its programmatic-launch wait,
 * with its own chunk size. */
#ifndef SPECD_ATTENTION_CUH
#define SPECD_ATTENTION_CUH

#include <math.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/tc.cuh"

/* One block's share of the work: query tokens tok0 .. tok0 + nq - 1 of row `row` (q0 ..
 * of its new tokens, rows = nq * G query rows), whose keys lie in [kbeg, kend) (kbeg > 0
 * only with a sliding window: the first query's oldest visible key), and of those the
 * keys [ks0, ke) of this split. */
struct att_split {
    int row, q0, slot, tok0, nq, rows, len, kbeg, kend, split_len, ks0, ke, ns_keys;
};

/* The geometry of split `split` of work item `item`; a split length computed here (w
 * gives none) is rounded up to whole tiles of TILE keys. */
template <int TILE>
__device__ __forceinline__ att_split att_split_geom(const k_kv_geom &g, const k_attn_work &w, int G, int split,
                                                    int item) {
    att_split s;
    s.row = w.item_row[item];
    s.q0 = w.item_q0[item];
    s.slot = w.row_slot[s.row];
    s.tok0 = w.row_tok_off[s.row] + s.q0;
    s.nq = min(w.qt, w.row_n_new[s.row] - s.q0);
    s.rows = s.nq * G;
    s.len = g.lens[s.slot * 2 + g.which];
    const int cap = g.max_blocks * g.block_size;
    s.kend = min(s.len + s.q0 + s.nq, cap);
    s.kbeg = w.window > 0 ? min(max(0, s.len + s.q0 - w.window + 1), s.kend) : 0;
    const int span = s.kend - s.kbeg;
    s.split_len = w.split_len;
    if (s.split_len <= 0) {
        int per = (span + w.n_splits - 1) / w.n_splits;
        s.split_len = max(TILE, (per + TILE - 1) / TILE * TILE);
    }
    s.ks0 = s.kbeg + split * s.split_len;
    /* The last split takes every remaining key, so a split count sized from a stale host
     * view of the lengths costs speed, never keys. */
    s.ke = split == w.n_splits - 1 ? s.kend : min(s.ks0 + s.split_len, s.kend);
    s.ns_keys = min(w.n_splits, (span + s.split_len - 1) / s.split_len);   /* splits holding keys */
    return s;
}

/* A split that holds no key for its item: its partials of rows tok0.. (heads kvh * G ..)
 * marked empty, (max, sum) = (-inf, 0), for the combine kernel. nt: threads per block. */
__device__ __forceinline__ void att_mark_empty(const k_attn_work &w, int H, int G, int kvh, int split, int tok0,
                                               int rows, int nt) {
    for (int r = threadIdx.x; r < rows; r += nt) {
        int tok = tok0 + r / G, head = kvh * G + r % G;
        float *ml = w.ws_ml + (((size_t)split * w.n_tok + tok) * H + head) * 2;
        ml[0] = -INFINITY;
        ml[1] = 0.f;
    }
}

/* Stores output element e = th * D + d: bf16, and with w.x8 its int8 code and its group's
 * (scale, sum) pair as k_quant_x8 would make them. The callers' loops run over rows * D
 * elements in warp-sized steps (D % 32 == 0), so a warp holds exactly one 32-element
 * group here and every lane calls this together. */
__device__ __forceinline__ void att_store(uint16_t *out, const k_attn_work &w, int H, int D, size_t e, float v) {
    const uint16_t b = k_f2bf(v);
    out[e] = b;
    if (!w.x8) return;
    const float f[1] = {k_bf2f(b)};
    float a;
    int q[1], sum;
    k_x8_round<1>(f, q, a, sum);
    ((int8_t *)w.x8)[e] = (int8_t)q[0];
    if ((threadIdx.x & 31) == 0)
        ((float2 *)((uint8_t *)w.x8 + k_x8_codes_bytes(w.n_tok, H * D)))[e / 32] = k_x8_pair(a, sum);
}

/* The end of a decode block whose NW warps each ran an online softmax over their share of
 * the keys: for query row r (token tok0, head kvh G + r), warp v's running max wm[v][r], sum
 * wl[v][r] and unnormalised output wacc[v][r][col(d)] (shared memory, after a barrier)
 * merge at the largest max among the warps that saw a key. direct: the output (times vsc)
 * is stored; else this split's partials go to the workspace for the combine, its max in
 * natural-log units. LOG2: the warps' maxima are in base-2 units. tid: the thread's index
 * in the block; NT: threads per block where the kernel fixes them, else 0 (blockDim.x).
 * The loop runs over rows * D elements in whole warps, as att_store needs. */
template <bool LOG2, int NT, int NW, int R, int DC, class Col>
__device__ __forceinline__ void att_merge_warps(const float (&wm)[NW][R], const float (&wl)[NW][R],
                                                const float (&wacc)[NW][R][DC], Col col, float vsc, bool direct,
                                                uint16_t *out, const k_attn_work &w, int H, int D, int tok0, int kvh,
                                                int G, int split, int rows, int tid) {
    for (int i = tid; i < rows * D; i += NT ? NT : blockDim.x) {
        const int r = i / D, d = i % D, at = col(d);
        float M = -INFINITY;
#pragma unroll
        for (int v = 0; v < NW; v++)
            if (wl[v][r] > 0.f) M = fmaxf(M, wm[v][r]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int v = 0; v < NW; v++) {
            if (!(wl[v][r] > 0.f)) continue;
            const float f = LOG2 ? tc_exp2(wm[v][r] - M) : __expf(wm[v][r] - M);
            num += f * wacc[v][r][at];
            den += f * wl[v][r];
        }
        const size_t th = (size_t)tok0 * H + kvh * G + r;
        if (direct) {
            att_store(out, w, H, D, th * D + d, den > 0.f ? num * vsc / den : 0.f);
        } else {
            const size_t base = (size_t)split * w.n_tok * H + th;
            w.ws_o[base * D + d] = num * vsc;
            if (d == 0) {
                w.ws_ml[base * 2] = LOG2 ? M * 0.6931471805599453f : M;
                w.ws_ml[base * 2 + 1] = den;
            }
        }
    }
}

#endif
