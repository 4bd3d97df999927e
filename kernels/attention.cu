/* Paged attention over the KV pool for rows of n_new query tokens (decode: 1, verify:
 * k+1, chunked prefill: a chunk). One block handles one KV head of one work item (up to
 * qt query tokens of one row, times the G = H/KVH query heads sharing that KV head) over
 * one split of the keys; keys are staged through shared memory in tiles of 64 with an
 * online softmax (flash attention). With several splits (flash-decoding, so one long
 * sequence still fills the GPU) each block writes an unnormalised partial and a combine
 * kernel merges them by their (max, sum) pairs.
 *
 * Causality: query j of a row sits at position len + q0 + j and sees keys <= that
 * position; len is read from device memory (lens) so graphs replay correctly.
 *
 * k_attention sends calls with at least 16 rows per block (qt * G >= 16) and D = 64 or
 * 128 to the tensor-core version of this kernel (attention_tc.cu); SPECD_ATTN_SIMT=1
 * keeps them here. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

#define ATT_NT 128
#define ATT_TILE 64

template <int D, int R>
struct att_smem {
    static constexpr int KS = D + 2;   /* padded K row: odd word stride, no bank conflicts */
    static constexpr size_t q_bytes = (size_t)R * D * 4;   /* q kept in fp32 */
    static constexpr size_t k_bytes = (size_t)ATT_TILE * KS * 2;
    static constexpr size_t v_bytes = (size_t)ATT_TILE * D * 2;
    static constexpr size_t p_bytes = (size_t)R * ATT_TILE * 4;
    static constexpr size_t total = q_bytes + k_bytes + v_bytes + p_bytes + 3 * R * 4;
};

template <int D, int R>
__global__ void __launch_bounds__(ATT_NT)
attention_kernel(const float *__restrict__ q, uint16_t *__restrict__ out, int H, int KVH,
                 float scale, k_kv_geom g, k_attn_work w) {
    typedef att_smem<D, R> SM;
    extern __shared__ __align__(16) unsigned char smem[];
    float *qs = (float *)smem;
    uint16_t *ks = (uint16_t *)(smem + SM::q_bytes);
    uint16_t *vs = (uint16_t *)(smem + SM::q_bytes + SM::k_bytes);
    float *ps = (float *)(smem + SM::q_bytes + SM::k_bytes + SM::v_bytes);
    float *m_s = ps + R * ATT_TILE, *l_s = m_s + R, *c_s = l_s + R;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, kvh = blockIdx.y, item = blockIdx.z;
    const int G = H / KVH;
    const int row = w.item_row[item], q0 = w.item_q0[item];
    const int slot = w.row_slot[row];
    const int tok0 = w.row_tok_off[row] + q0;
    const int nq = min(w.qt, w.row_n_new[row] - q0);
    const int rows = nq * G;
    const int len = g.lens[slot * 2 + g.which];
    const int cap = g.max_blocks * g.block_size;
    const int kend = min(len + q0 + nq, cap);
    int split_len = w.split_len;
    if (split_len <= 0) {
        int per = (kend + w.n_splits - 1) / w.n_splits;
        split_len = max(ATT_TILE, (per + ATT_TILE - 1) / ATT_TILE * ATT_TILE);
    }
    const int ks0 = split * split_len;
    /* The last split takes every remaining key, so a split count sized from a stale host
     * view of the lengths costs speed, never keys. */
    const int ke = split == w.n_splits - 1 ? kend : min(ks0 + split_len, kend);
    const int *bt = g.bt + (size_t)slot * g.max_blocks;
    const uint16_t *pool = *g.pool_pp;
    const size_t v_off = (size_t)KVH * g.block_size * D;

    if (ks0 >= ke || rows <= 0) {
        /* This split holds no key for this item: mark its partials empty. */
        if (w.n_splits > 1)
            for (int r = tid; r < rows; r += ATT_NT) {
                int tok = tok0 + r / G, head = kvh * G + r % G;
                float *ml = w.ws_ml + (((size_t)split * w.n_tok + tok) * H + head) * 2;
                ml[0] = -INFINITY;
                ml[1] = 0.f;
            }
        return;
    }

    /* Q rows of this block: r = qi * G + gg. Rows past `rows` are zero (never written). */
    for (int i = tid; i < R * D / 2; i += ATT_NT) {
        int r = i / (D / 2), dp = i % (D / 2);
        float2 v = make_float2(0.f, 0.f);
        if (r < rows) {
            int tok = tok0 + r / G, head = kvh * G + r % G;
            v = *(const float2 *)(q + ((size_t)tok * H + head) * D + 2 * dp);
        }
        ((float2 *)qs)[r * (D / 2) + dp] = v;
    }
    for (int r = tid; r < R; r += ATT_NT) {
        m_s[r] = -INFINITY;
        l_s[r] = 0.f;
    }

    constexpr int NACC = R * D / ATT_NT;
    float acc[NACC];
#pragma unroll
    for (int j = 0; j < NACC; j++) acc[j] = 0.f;

    for (int kt0 = ks0; kt0 < ke; kt0 += ATT_TILE) {
        __syncthreads();
        /* Stage K and V of keys kt0 .. kt0+63 (16-byte global loads). */
        for (int i = tid; i < ATT_TILE * D / 8; i += ATT_NT) {
            int k = i / (D / 8), c = i % (D / 8), key = kt0 + k;
            uint4 kk = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (key < ke) {
                int b = bt[key / g.block_size];
                const uint16_t *kp = pool + (size_t)b * g.block_elems + g.layer_off +
                                     ((size_t)kvh * g.block_size + key % g.block_size) * D + c * 8;
                kk = *(const uint4 *)kp;
                vv = *(const uint4 *)(kp + v_off);
            }
            *(uint4 *)(vs + k * D + c * 8) = vv;
            uint32_t *kd = (uint32_t *)(ks + k * SM::KS + c * 8);
            kd[0] = kk.x; kd[1] = kk.y; kd[2] = kk.z; kd[3] = kk.w;
        }
        __syncthreads();

        /* Scores: thread owns key k = tid % 64 and rows rg, rg + 2, ... */
        {
            const int k = tid % ATT_TILE, rg = tid / ATT_TILE;
            constexpr int RPT = R / (ATT_NT / ATT_TILE);
            float s[RPT];
#pragma unroll
            for (int i = 0; i < RPT; i++) s[i] = 0.f;
            const __nv_bfloat162 *kr = (const __nv_bfloat162 *)(ks + k * SM::KS);
#pragma unroll 4
            for (int dp = 0; dp < D / 2; dp++) {
                float2 kf = __bfloat1622float2(kr[dp]);
#pragma unroll
                for (int i = 0; i < RPT; i++) {
                    int r = rg + 2 * i;
                    float2 qf = ((const float2 *)qs)[r * (D / 2) + dp];
                    s[i] = fmaf(qf.x, kf.x, fmaf(qf.y, kf.y, s[i]));
                }
            }
            const int key = kt0 + k;
#pragma unroll
            for (int i = 0; i < RPT; i++) {
                int r = rg + 2 * i;
                int qpos = len + q0 + r / G;
                bool ok = r < rows && key < ke && key <= qpos;
                ps[r * ATT_TILE + k] = ok ? s[i] * scale : -INFINITY;
            }
        }
        __syncthreads();

        /* Online softmax, one warp per row. */
        for (int r = warp; r < rows; r += ATT_NT / 32) {
            float a = ps[r * ATT_TILE + lane], b = ps[r * ATT_TILE + lane + 32];
            float tmax = k_warp_max(fmaxf(a, b));
            float m_old = m_s[r], m_new = fmaxf(m_old, tmax);
            float pa = 0.f, pb = 0.f, corr = 1.f;
            if (m_new != -INFINITY) {
                pa = __expf(a - m_new);
                pb = __expf(b - m_new);
                corr = __expf(m_old - m_new);
            }
            float sum = k_warp_sum(pa + pb);
            ps[r * ATT_TILE + lane] = pa;
            ps[r * ATT_TILE + lane + 32] = pb;
            __syncwarp();
            if (lane == 0) {
                m_s[r] = m_new;
                l_s[r] = l_s[r] * corr + sum;
                c_s[r] = corr;
            }
        }
        __syncthreads();

        /* acc[r][d] = acc * corr + P[r, :] . V[:, d]; thread's d is fixed, rows vary. */
#pragma unroll
        for (int j = 0; j < NACC; j++) {
            int o = tid + j * ATT_NT, r = o / D;
            if (r < rows) acc[j] *= c_s[r];
        }
        for (int k = 0; k < ATT_TILE; k += 4) {
#pragma unroll
            for (int j = 0; j < NACC; j++) {
                int o = tid + j * ATT_NT, r = o / D, d = o % D;
                if (r >= rows) continue;
                float4 p = *(const float4 *)(ps + r * ATT_TILE + k);
                acc[j] = fmaf(p.x, k_bf2f(vs[(k + 0) * D + d]), acc[j]);
                acc[j] = fmaf(p.y, k_bf2f(vs[(k + 1) * D + d]), acc[j]);
                acc[j] = fmaf(p.z, k_bf2f(vs[(k + 2) * D + d]), acc[j]);
                acc[j] = fmaf(p.w, k_bf2f(vs[(k + 3) * D + d]), acc[j]);
            }
        }
    }
    __syncthreads();

#pragma unroll
    for (int j = 0; j < NACC; j++) {
        int o = tid + j * ATT_NT, r = o / D, d = o % D;
        if (r >= rows) continue;
        int tok = tok0 + r / G, head = kvh * G + r % G;
        if (w.n_splits == 1) {
            float l = l_s[r];
            out[((size_t)tok * H + head) * D + d] = k_f2bf(l > 0.f ? acc[j] / l : 0.f);
        } else {
            size_t base = ((size_t)split * w.n_tok + tok) * H + head;
            w.ws_o[base * D + d] = acc[j];
            if (d == 0) {
                w.ws_ml[base * 2] = m_s[r];
                w.ws_ml[base * 2 + 1] = l_s[r];
            }
        }
    }
}

/* One block per (token, head); thread d merges the splits' partials. */
__global__ void attention_combine_kernel(uint16_t *out, int H, int D, k_attn_work w) {
    int th = blockIdx.x, d = threadIdx.x;
    size_t stride = (size_t)w.n_tok * H;
    float M = -INFINITY;
    for (int s = 0; s < w.n_splits; s++) {
        const float *ml = w.ws_ml + ((size_t)s * stride + th) * 2;
        if (ml[1] > 0.f) M = fmaxf(M, ml[0]);
    }
    float num = 0.f, den = 0.f;
    for (int s = 0; s < w.n_splits; s++) {
        const float *ml = w.ws_ml + ((size_t)s * stride + th) * 2;
        if (!(ml[1] > 0.f)) continue;
        float f = __expf(ml[0] - M);
        num += f * w.ws_o[((size_t)s * stride + th) * D + d];
        den += f * ml[1];
    }
    out[(size_t)th * D + d] = k_f2bf(den > 0.f ? num / den : 0.f);
}

/* Shared with the tensor-core path (attention_tc.cu): merge the n_splits partials. */
int attention_combine_launch(uint16_t *out, int H, int D, const k_attn_work *w, cudaStream_t s) {
    attention_combine_kernel<<<w->n_tok * H, D, 0, s>>>(out, H, D, *w);
    return K_LAUNCH_RESULT();
}

template <int D, int R>
static int launch_attention(const float *q, uint16_t *out, int H, int KVH, float scale,
                            const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    size_t smem = att_smem<D, R>::total;
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(attention_kernel<D, R>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    dim3 grid(w->n_splits, KVH, w->n_items);
    attention_kernel<D, R><<<grid, ATT_NT, smem, s>>>(q, out, H, KVH, scale, *g, *w);
    int rc = K_LAUNCH_RESULT();
    if (rc || w->n_splits == 1) return rc;
    return attention_combine_launch(out, H, D, w, s);
}

template <int D>
static int dispatch_rows(int rows, const float *q, uint16_t *out, int H, int KVH,
                         float scale, const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    if (rows <= 8) return launch_attention<D, 8>(q, out, H, KVH, scale, g, w, s);
    if (rows <= 16) return launch_attention<D, 16>(q, out, H, KVH, scale, g, w, s);
    if (rows <= 32) return launch_attention<D, 32>(q, out, H, KVH, scale, g, w, s);
    return launch_attention<D, 64>(q, out, H, KVH, scale, g, w, s);
}

/* SPECD_ATTN_SIMT=1 keeps every call on attention_kernel (to time the two against each
 * other); read once. */
static bool attention_force_simt(void) {
    static const bool force = [] {
        const char *e = getenv("SPECD_ATTN_SIMT");
        return e && strcmp(e, "1") == 0;
    }();
    return force;
}

extern "C" int k_attention(const float *q, uint16_t *out, int H, int KVH, int D,
                           float scale, const k_kv_geom *g, const k_attn_work *w,
                           cudaStream_t s) {
    if (H <= 0 || KVH <= 0 || H % KVH || w->qt <= 0 || w->n_splits <= 0 || w->split_len < 0)
        return -1;
    int rows = w->qt * (H / KVH);
    if (rows > 64) return -1;
    if (w->n_splits > 1 && (!w->ws_o || !w->ws_ml)) return -1;
    if (w->split_len % ATT_TILE) return -1;
    if (w->n_items == 0) return 0;
    /* Enough rows for 16-row mma tiles (prefill chunks, verify): tensor cores. Decode
     * rows (a few query heads) stay on the SIMT kernel. */
    if ((D == 64 || D == 128) && rows >= 16 && !attention_force_simt())
        return k_attention_tc(q, out, H, KVH, D, scale, g, w, s);
    if (D == 32) return dispatch_rows<32>(rows, q, out, H, KVH, scale, g, w, s);
    if (D == 64) return dispatch_rows<64>(rows, q, out, H, KVH, scale, g, w, s);
    if (D == 128) return dispatch_rows<128>(rows, q, out, H, KVH, scale, g, w, s);
    return -1;
}
