/* Paged attention over the KV pool for rows of n_new query tokens (decode: 1, verify:
 * k+1, chunked prefill: a chunk). One block handles one KV head of one work item (up to
 * qt query tokens of one row, times the G = H/KVH query heads sharing that KV head) over
 * one split of the keys; keys are staged through shared memory in tiles of 64 with an
 * online softmax (flash attention). With several splits (flash-decoding, so one long
 * sequence still fills the GPU) each block writes an unnormalised partial and a combine
 * kernel merges them by their (max, sum) pairs -- or, given counters, the last split
 * block of each item does, and no combine kernel runs.
 *
 * Causality: query j of a row sits at position len + q0 + j and sees keys <= that
 * position; len is read from device memory (lens) so graphs replay correctly.
 *
 * For an int8 GEMV after it (k_attn_work.x8) the decode kernel and its merges also write
 * the output's int8 rounding per 32 elements as they store it (att_store: a warp is one
 * group), so no rounding launch runs before the O projection; the other kernels are
 * followed by k_quant_x8.
 *
 * FP8 cache (k_kv_geom.kv_fp8, a template flag of every kernel): keys and values are E4M3
 * codes, read at half the bytes and converted exactly (to bf16 in the tiled kernels'
 * shared memory, to fp32 in the decode kernel's registers); K's scale is folded into the
 * softmax scale by the launchers and V's multiplies the output (or the partials).
 *
 * k_attention picks the kernel: one query token per item with G <= 8 and D = 64 or 128
 * (decode) goes to attention_decode_kernel below, built for latency rather than tiles,
 * or over as many (item, KV head) pairs as SMs to the tensor-core decode form
 * (attention_tc.cu; launch_attention_decode_kv says where; SPECD_ATTN_DEC=0 keeps those
 * on the SIMT kernel too, SPECD_ATTN_TILED=1 keeps decode on the tiled kernel); at
 * least 16 rows per block (qt * G >= 16, prefill and verify) with D = 64 or 128 to the
 * tensor-core kernel (attention_tc.cu; SPECD_ATTN_SIMT=1 keeps them here); the rest to
 * attention_kernel. Only the decode kernels are programmatic-dependent launches: the
 * SIMT one computes its geometry and requests its first K/V chunk while the QKV GEMV
 * before it still runs, and both let the O GEMV launch once their key loop is done
 * (SPECD_ATTN_PDL=0/1 to compare). Letting the O GEMV in at the start of attention made
 * the 8B batch-1 step slower on an H200 (4.77 vs 4.64 ms): its weight prefetch
 * competes with attention's dependent loads.
 *
 * k_rope_attention takes passes of single-token rows straight from the QKV projection:
 * where the batch-1 form of the decode kernel serves them, that kernel (RP) norms and
 * rotates its block's q heads itself (a warp a head, rope.cuh rope_head, as the rotary
 * kernel does) and the split block holding the new key computes that key's K and V,
 * stores them in the pool and reads them from shared memory, so no rotary launch runs
 * between the QKV GEMV and the attention (H100, Qwen3-30B-A3B shape at batch 1: 3.79
 * against 3.84 ms a token; the kernel test times 14.2 against 15.7 us). */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/attention.cuh"
#include "kernels/rope.cuh"

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

/* Output element d of (token, head) th merged from the first ns partials by their
 * (max, sum) pairs; the partials are read through L2 (written by other blocks). */
__device__ __forceinline__ float combine_one(const k_attn_work &w, int H, int D, size_t th, int d, int ns) {
    const size_t stride = (size_t)w.n_tok * H;
    float M = -INFINITY;
    for (int s = 0; s < ns; s++) {
        const float *ml = w.ws_ml + ((size_t)s * stride + th) * 2;
        if (__ldcg(ml + 1) > 0.f) M = fmaxf(M, __ldcg(ml));
    }
    float num = 0.f, den = 0.f;
    for (int s = 0; s < ns; s++) {
        const float *ml = w.ws_ml + ((size_t)s * stride + th) * 2;
        const float l = __ldcg(ml + 1);
        if (!(l > 0.f)) continue;
        const float f = __expf(__ldcg(ml) - M);
        num += f * __ldcg(w.ws_o + ((size_t)s * stride + th) * D + d);
        den += f * l;
    }
    return den > 0.f ? num / den : 0.f;
}

/* In-kernel combine: each of the ns split blocks of (item, KV head) that hold keys (the
 * first ns; the others write nothing and do not count) counts itself done after its
 * partials are written and fenced; the last one merges the item's rows (query tokens
 * tok0.., heads head0 .. head0 + G - 1) and re-zeroes the counter for the next launch. The merge weights go through shared memory (ps: rows
 * x 64 floats, ns <= 32), so each output element is one pass of independent loads. */
__device__ __noinline__ void combine_if_last(uint16_t *out, int H, int D, const k_attn_work &w, int ctr, int tok0, int head0,
                                int G, int rows, int ns, float *ps, float *den_s) {
    __shared__ unsigned last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(w.counters + ctr, 1u) == (unsigned)ns - 1;
    __syncthreads();
    if (!last) return;
    const size_t stride = (size_t)w.n_tok * H;
    if (ns > 32) {   /* more splits than the staging holds: the plain merge */
        for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
            const int r = i / D, d = i % D;
            const size_t th = (size_t)(tok0 + r / G) * H + head0 + r % G;
            att_store(out, w, H, D, th * D + d, combine_one(w, H, D, th, d, ns));
        }
    } else {
        for (int i = threadIdx.x; i < rows * ns; i += blockDim.x) {   /* (max, sum) of every split */
            const int r = i / ns, sp = i % ns;
            const size_t th = (size_t)(tok0 + r / G) * H + head0 + r % G;
            const float *ml = w.ws_ml + ((size_t)sp * stride + th) * 2;
            ps[r * 64 + sp] = __ldcg(ml);
            ps[r * 64 + 32 + sp] = __ldcg(ml + 1);
        }
        __syncthreads();
        for (int r = threadIdx.x; r < rows; r += blockDim.x) {   /* weights exp(m - M), denominator */
            float M = -INFINITY, den = 0.f;
            for (int sp = 0; sp < ns; sp++)
                if (ps[r * 64 + 32 + sp] > 0.f) M = fmaxf(M, ps[r * 64 + sp]);
            for (int sp = 0; sp < ns; sp++) {
                const float l = ps[r * 64 + 32 + sp], f = l > 0.f ? __expf(ps[r * 64 + sp] - M) : 0.f;
                ps[r * 64 + sp] = f;
                den += f * l;
            }
            den_s[r] = den;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
            const int r = i / D, d = i % D;
            const size_t th = (size_t)(tok0 + r / G) * H + head0 + r % G;
            const float *o = w.ws_o + th * D + d;
            float num = 0.f;
#pragma unroll 8
            for (int sp = 0; sp < ns; sp++) num += ps[r * 64 + sp] * __ldcg(o + (size_t)sp * stride * D);
            att_store(out, w, H, D, th * D + d, den_s[r] > 0.f ? num / den_s[r] : 0.f);
        }
    }
    if (threadIdx.x == 0) w.counters[ctr] = 0u;
}

template <int D, int R, bool F8>
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
    const att_split sp = att_split_geom<ATT_TILE>(g, w, G, split, item);
    const int q0 = sp.q0, tok0 = sp.tok0, rows = sp.rows, len = sp.len, ks0 = sp.ks0, ke = sp.ke;
    const int *bt = g.bt + (size_t)sp.slot * g.max_blocks;
    typedef typename std::conditional<F8, uint8_t, uint16_t>::type kv_t;
    const kv_t *pool = (const kv_t *)*g.pool_pp;
    const size_t v_off = (size_t)KVH * g.block_size * D;

    if (ks0 >= ke || rows <= 0) {
        /* No key here: the combine kernel reads every split's partials, the in-kernel
         * merge (counters) only those of the splits that hold keys. */
        if (w.n_splits > 1 && !w.counters) att_mark_empty(w, H, G, kvh, split, tok0, rows, ATT_NT);
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
        /* Stage K and V of keys kt0 .. kt0+63 (16-byte global loads), ST groups of loads
         * in flight per thread before the first shared store: one memory latency per group,
         * not per load (a short context is a single tile, so this latency is the kernel). */
        constexpr int PER = ATT_TILE * D / 8 / ATT_NT, ST0 = R >= 32 ? 2 : 4, ST = PER < ST0 ? PER : ST0;
#pragma unroll
        for (int j0 = 0; j0 < PER; j0 += ST) {
            uint4 kk[ST], vv[ST];
#pragma unroll
            for (int j = 0; j < ST; j++) {
                const int i = tid + (j0 + j) * ATT_NT, k = i / (D / 8), c = i % (D / 8), key = kt0 + k;
                kk[j] = vv[j] = make_uint4(0, 0, 0, 0);
                if (key < ke) {
                    const int b = bt[key / g.block_size];
                    const kv_t *kp = pool + (size_t)b * g.block_elems + g.layer_off +
                                     ((size_t)kvh * g.block_size + key % g.block_size) * D + c * 8;
                    if constexpr (F8) {   /* 8 codes -> 8 bf16, exact; the scales are applied later */
                        kk[j] = k_fp8x8_bf16(*(const uint2 *)kp);
                        vv[j] = k_fp8x8_bf16(*(const uint2 *)(kp + v_off));
                    } else {
                        kk[j] = *(const uint4 *)kp;
                        vv[j] = *(const uint4 *)(kp + v_off);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < ST; j++) {
                const int i = tid + (j0 + j) * ATT_NT, k = i / (D / 8), c = i % (D / 8);
                *(uint4 *)(vs + k * D + c * 8) = vv[j];
                uint32_t *kd = (uint32_t *)(ks + k * SM::KS + c * 8);
                kd[0] = kk[j].x; kd[1] = kk[j].y; kd[2] = kk[j].z; kd[3] = kk[j].w;
            }
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
                bool ok = r < rows && key < ke && key <= qpos && (w.window <= 0 || qpos - key < w.window);
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

    if constexpr (F8) {   /* V's scale (K's is folded into `scale` by the launcher) */
#pragma unroll
        for (int j = 0; j < NACC; j++) acc[j] *= g.v_scale;
    }
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
    if (w.n_splits > 1 && w.counters) combine_if_last(out, H, D, w, item * KVH + kvh, tok0, kvh * G, G, rows, sp.ns_keys, ps, l_s);
}

/* One block per (token, head); thread d merges the splits' partials. */
__global__ void attention_combine_kernel(uint16_t *out, int H, int D, k_attn_work w) {
    const size_t th = blockIdx.x;
    att_store(out, w, H, D, th * D + threadIdx.x, combine_one(w, H, D, th, threadIdx.x, w.n_splits));
}

/* Shared with the tensor-core path (attention_tc.cu): merge the n_splits partials. */
int attention_combine_launch(uint16_t *out, int H, int D, const k_attn_work *w, cudaStream_t s) {
    attention_combine_kernel<<<w->n_tok * H, D, 0, s>>>(out, H, D, *w);
    return K_LAUNCH_RESULT();
}

/* After a SIMT launch (rc its result): the combine kernel, where the launch left partials
 * of several splits (no counters: it did not merge them itself). */
static int attention_merge_after(int rc, uint16_t *out, int H, int D, const k_attn_work *w, cudaStream_t s) {
    if (rc || w->n_splits == 1 || w->counters) return rc;
    return attention_combine_launch(out, H, D, w, s);
}

/* Decode (one query token per row, G = H / KVH <= 8 query heads per KV head). At batch 1
 * a split is a handful of memory round trips and a short dependent chain of arithmetic,
 * so the kernel spreads keys thin: a warp takes 8 keys at a time, 4 lanes per key, each
 * lane a quarter of the head dimension. A lane computes its key's pool address once and
 * requests its quarter of the K row and the V values of its own head dims for the warp's
 * 8 keys (addresses shuffled from the key's lanes) together, before the q staging
 * barrier. Scores against the G query heads (q from shared memory, quarter rows padded
 * apart so the four quarters hit different banks) are summed over the 4 lanes by
 * shuffle, an online softmax per head runs over the warp, P.V from registers, then the
 * block's warps merge through shared memory. A context that fits one split is written
 * out directly; longer ones merge their splits as attention_kernel does. */
template <int D, int GM, int DEC_LPK, int DEC_WARPS, int MINB, bool F8, bool RP>
__global__ void __launch_bounds__(DEC_WARPS * 32, MINB)
attention_decode_kernel(const float *__restrict__ q, uint16_t *__restrict__ out, int H, int KVH, float scale,
                        k_kv_geom g, k_attn_work w, k_rope_in rp, int trigger_early, int pipe) {
    constexpr int DEC_KPW = 32 / DEC_LPK;   /* keys per warp and chunk */
    constexpr int DL = D / 32;             /* P.V dims per lane */
    constexpr int DS = D / DEC_LPK;        /* q.k dims per lane */
    constexpr int QP = DS + 4;             /* padded quarter row */
    constexpr int KS8 = DS / (F8 ? 16 : 8);   /* 16-byte words of the lane's K share */
    /* a lane's DL V values: bf16, or E4M3 bytes (F8: the cache holds codes; K's scale is
     * folded into `scale` by the launcher, V's applied at the merge) */
    typedef typename std::conditional<F8, typename std::conditional<DL == 4, uint32_t, uint16_t>::type,
                                      typename std::conditional<DL == 4, uint2, uint32_t>::type>::type vraw_t;
    typedef typename std::conditional<F8, uint8_t, uint16_t>::type kv_t;
    __shared__ __align__(16) float qs[GM][DEC_LPK][QP];
    __shared__ __align__(16) float wacc[DEC_WARPS][GM][D];
    __shared__ float wm[DEC_WARPS][GM], wl[DEC_WARPS][GM];
    /* RP: the new key's K and V as the pool stores them (written by this block) */
    __shared__ __align__(16) kv_t knew[RP ? D : 1], vnew[RP ? D : 1];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, kl = lane / DEC_LPK, sub = lane % DEC_LPK;
    const int split = blockIdx.x, kvh = blockIdx.y, item = blockIdx.z;
    const int G = H / KVH;
    /* Before the programmatic-launch wait (the QKV GEMV before this kernel may still be
     * running) only what no kernel of this pass writes is read: the step's metadata and
     * block tables (copied from the host), the lengths (advanced by the last step), and
     * the K/V of the keys before this pass's tokens; the first chunk of those is requested
     * here. After the wait the length is read again (a kernel that changed it would
     * only cost a reload) and the chunk that holds the new key is loaded in full. */
    const int row = w.item_row[item], q0 = w.item_q0[item];
    const int slot = w.row_slot[row];
    const int tok0 = w.row_tok_off[row] + q0;
    const int rows = w.row_n_new[row] > q0 ? G : 0;
    const int *bt = g.bt + (size_t)slot * g.max_blocks;
    const kv_t *pool = (const kv_t *)*g.pool_pp;
    const size_t v_off = (size_t)KVH * g.block_size * D;
    int len = g.lens[slot * 2 + g.which], kend, ks0, ke, ns_keys;
    auto geometry = [&]() {
        kend = min(len + q0 + 1, g.max_blocks * g.block_size);   /* keys <= the query's position */
        /* a sliding window: only the last `window` positions (one query: no mask needed) */
        const int kbeg = w.window > 0 ? min(max(0, len + q0 + 1 - w.window), kend) : 0, span = kend - kbeg;
        int split_len = w.split_len;
        if (split_len <= 0) {
            int per = (span + w.n_splits - 1) / w.n_splits;
            split_len = max(DEC_KPW * DEC_WARPS, (per + DEC_KPW - 1) / DEC_KPW * DEC_KPW);
        }
        ks0 = kbeg + split * split_len;
        ke = split == w.n_splits - 1 ? kend : min(ks0 + split_len, kend);
        ns_keys = min(w.n_splits, (span + split_len - 1) / split_len);
    };
    geometry();
    uint4 kr[KS8];
    vraw_t vr[DEC_KPW];
    const kv_t *kp = NULL;
    /* Keys c .. c + DEC_KPW - 1 of the chunk: the lane's key row (kp, NULL past ke), then
     * the K quarters and V values of the keys in [lo, hi) (the rest zero when lo == 0,
     * else left as they are). */
    auto bt_at = [&](int c) {   /* the block table entry of the lane's key (0 past ke) */
        const int key = c + kl;
        return key < ke ? bt[key / g.block_size] : 0;
    };
    auto key_row = [&](int c, int b) -> const kv_t * {   /* ... and its row, given that entry */
        const int key = c + kl;
        return key < ke ? pool + (size_t)b * g.block_elems + g.layer_off +
                              ((size_t)kvh * g.block_size + key % g.block_size) * D
                        : NULL;
    };
    auto chunk_addr = [&](int c) { kp = key_row(c, bt_at(c)); };
    auto load_into = [&](int c, int lo, int hi, const kv_t *p, auto &k, auto &v) {
        const int key = c + kl;
        if (p && key >= lo && key < hi) {
#pragma unroll
            for (int j = 0; j < KS8; j++) k[j] = ((const uint4 *)(p + sub * DS))[j];
        } else if (lo == 0) {
#pragma unroll
            for (int j = 0; j < KS8; j++) k[j] = make_uint4(0, 0, 0, 0);
        }
        const unsigned long long vaddr = p ? (unsigned long long)(p + v_off) : 0ull;
#pragma unroll
        for (int j = 0; j < DEC_KPW; j++) {
            const unsigned long long va = __shfl_sync(0xffffffffu, vaddr, j * DEC_LPK);
            if (va && c + j >= lo && c + j < hi) v[j] = *(const vraw_t *)((const kv_t *)va + lane * DL);
            else if (lo == 0) v[j] = vraw_t{};
        }
    };
    auto load_range = [&](int c, int lo, int hi) { load_into(c, lo, hi, kp, kr, vr); };
    int c0 = ks0 + warp * DEC_KPW;
    const bool has_chunk = rows > 0 && c0 < ke;
    if (has_chunk) {
        chunk_addr(c0);
        load_range(c0, 0, len);
    }
    k_pdl_wait();
    /* the next launch's weights into L2 while this kernel's loads leave DRAM idle */
    if (w.l2_next)
        k_l2_prefetch_part(w.l2_next, w.l2_next_bytes, blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z),
                           gridDim.x * gridDim.y * gridDim.z);
    /* this block's q rows (written by the kernel before): every load of the thread issued
     * at once, with the length's reload, and stored to shared memory further down */
    constexpr int QN = (GM * D + DEC_WARPS * 32 - 1) / (DEC_WARPS * 32);
    float qv[QN];
    /* RP: the projection's values of this warp's tasks instead (task t < G: q head
     * kvh * G + t; G: this KV head's K; G + 1: its V), lane holding pairs (i, i + D/2) */
    constexpr int RPP = RP ? D / 64 : 1, RPT = RP ? 2 : 1;
    static_assert(!RP || (GM + 2 <= 2 * DEC_WARPS && (D == 64 || D == 128)), "two tasks a warp at most");
    float ra[RPT][RPP], rc[RPT][RPP];
    auto task_head = [&](int t) { return t < G ? kvh * G + t : t == G ? H + kvh : H + KVH + kvh; };
    if constexpr (RP) {
        const float *x = rp.qkv + (size_t)tok0 * (H + 2 * KVH) * D;
#pragma unroll
        for (int k = 0; k < RPT; k++) {
            const int t = warp + k * DEC_WARPS;
#pragma unroll
            for (int p = 0; p < RPP; p++) {
                const int i = lane + 32 * p;
                ra[k][p] = rows > 0 && t < G + 2 ? x[(size_t)task_head(t) * D + i] : 0.f;
                rc[k][p] = rows > 0 && t < G + 2 ? x[(size_t)task_head(t) * D + i + D / 2] : 0.f;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < QN; j++) {
            const int i = tid + j * DEC_WARPS * 32, r = i / D;
            qv[j] = i < GM * D && r < rows ? q[((size_t)tok0 * H + kvh * G + r) * D + i % D] : 0.f;
        }
    }
    const int len_now = g.lens[slot * 2 + g.which];
    /* keys of this pass (RP: only the new one, which this kernel makes: below) */
    if (!RP && has_chunk && c0 + DEC_KPW > len) load_range(c0, len, INT_MAX);
    if (len_now != len) {   /* not in a pass as built: start over */
        len = len_now;
        geometry();
        c0 = ks0 + warp * DEC_KPW;
        if (rows > 0 && c0 < ke) {
            chunk_addr(c0);
            load_range(c0, 0, INT_MAX);
        }
    }
    /* one split holds every key (and the splits merge in-kernel): no partials at all */
    const bool direct = w.n_splits == 1 || (ns_keys == 1 && w.counters);
    float *ps = &wacc[0][0][0], *den_s = &wl[0][0];   /* combine staging, after the merge */

    if (ks0 >= ke || rows <= 0) {   /* no key here: only the combine kernel reads empty partials */
        if (direct || w.counters) return;
        for (int r = tid; r < rows; r += blockDim.x) {
            float *ml = w.ws_ml + (((size_t)split * w.n_tok + tok0) * H + kvh * G + r) * 2;
            ml[0] = -INFINITY;
            ml[1] = 0.f;
        }
        return;
    }

    /* RP: the new token's position, and whether this split holds it (then this block
     * writes its K and V to the pool; no other block reads them in this launch) */
    const int pos = len + q0;
    const bool own = RP && ks0 <= pos && pos < ke;
    if constexpr (RP) {
#pragma unroll
        for (int k = 0; k < RPT; k++) {
            const int t = warp + k * DEC_WARPS;
            if (t >= G + 2 || (t >= G && !own)) continue;
            const int hh = task_head(t);
            rope_head<RPP>(ra[k], rc[k], rp.bias ? rp.bias + (size_t)hh * D : NULL,
                           t < G ? rp.q_norm : rp.k_norm, rp.inv_freq, rp.eps, D, pos, lane, t <= G);
#pragma unroll
            for (int p = 0; p < RPP; p++) {
                const int i = lane + 32 * p, i2 = i + D / 2;
                if (t < G) {
                    qs[t][i / DS][i % DS] = ra[k][p];
                    qs[t][i2 / DS][i2 % DS] = rc[k][p];
                    continue;
                }
                kv_t *kvn = t == G ? knew : vnew;
                if constexpr (F8) {
                    const float inv = 1.f / (t == G ? g.k_scale : g.v_scale);
                    kvn[i] = kv_code_fp8(ra[k][p], inv);
                    kvn[i2] = kv_code_fp8(rc[k][p], inv);
                } else {
                    kvn[i] = kv_code_bf16(ra[k][p]);
                    kvn[i2] = kv_code_bf16(rc[k][p]);
                }
                kv_t *dst = (kv_t *)*g.pool_pp + (size_t)bt[pos / g.block_size] * g.block_elems + g.layer_off +
                            ((size_t)kvh * g.block_size + pos % g.block_size) * D + (t == G ? 0 : v_off);
                dst[i] = kvn[i];
                dst[i2] = kvn[i2];
            }
        }
        for (int i = tid; i < (GM - G) * D; i += blockDim.x) qs[G + i / D][i % D / DS][i % DS] = 0.f;
    } else {
#pragma unroll
        for (int j = 0; j < QN; j++) {
            const int i = tid + j * DEC_WARPS * 32, r = i / D, d = i % D;
            if (i < GM * D) qs[r][d / DS][d % DS] = qv[j];
        }
    }
    __syncthreads();

    float m[GM], l[GM], acc[GM][DL];
#pragma unroll
    for (int r = 0; r < GM; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < DL; e++) acc[r][e] = 0.f;
    }
    /* PIPE (the batch-1 form, with `pipe`: k_tuning.attn_dec_pipe): a warp with several
     * chunks (a long context) requests the next chunk's K and V before this chunk's math,
     * and that chunk's block table entries one chunk earlier still, so it waits on memory
     * about once a chunk instead of twice. The same loads and math: the same bits. */
    constexpr bool PIPE = MINB == 1 && DEC_WARPS == 8;
    constexpr int STEP = DEC_WARPS * DEC_KPW;
    const kv_t *kpn = NULL;
    uint4 krn[PIPE ? KS8 : 1];
    vraw_t vrn[PIPE ? DEC_KPW : 1];
    int btn = 0;
    if constexpr (PIPE) {
        if (pipe && c0 + STEP < ke) btn = bt_at(c0 + STEP);
    }
    for (int c = c0; c < ke; c += STEP) {
        if (c != c0) {
            if (PIPE && pipe) {
                kp = kpn;
#pragma unroll
                for (int j = 0; j < KS8 && PIPE; j++) kr[j] = krn[j];
#pragma unroll
                for (int j = 0; j < DEC_KPW && PIPE; j++) vr[j] = vrn[j];
            } else {
                chunk_addr(c);
                load_range(c, 0, INT_MAX);
            }
        }
        if constexpr (PIPE) {
            if (pipe && c + STEP < ke) {
                const int btnn = c + 2 * STEP < ke ? bt_at(c + 2 * STEP) : 0;
                kpn = key_row(c + STEP, btn);
                load_into(c + STEP, 0, INT_MAX, kpn, krn, vrn);
                btn = btnn;
            }
        }
        if (own && c <= pos && pos < c + DEC_KPW) {   /* RP: the new key from shared memory */
            if (c + kl == pos) {
#pragma unroll
                for (int j = 0; j < KS8; j++) kr[j] = ((const uint4 *)(knew + sub * DS))[j];
            }
#pragma unroll
            for (int j = 0; j < DEC_KPW; j++)
                if (c + j == pos) vr[j] = *(const vraw_t *)(vnew + lane * DL);
        }
        float sc[GM];
#pragma unroll
        for (int r = 0; r < GM; r++) sc[r] = 0.f;
#pragma unroll
        for (int j = 0; j < KS8 && F8; j++) {   /* 16 codes per word */
            float kf[16];
            k_fp8x8(make_uint2(kr[j].x, kr[j].y), *(float(*)[8])kf);
            k_fp8x8(make_uint2(kr[j].z, kr[j].w), *(float(*)[8])(kf + 8));
#pragma unroll
            for (int r = 0; r < GM; r++) {
                float t = sc[r];
#pragma unroll
                for (int e4 = 0; e4 < 4; e4++) {
                    const float4 qa = *(const float4 *)&qs[r][sub][j * 16 + 4 * e4];
                    t = fmaf(qa.x, kf[4 * e4], t);
                    t = fmaf(qa.y, kf[4 * e4 + 1], t);
                    t = fmaf(qa.z, kf[4 * e4 + 2], t);
                    t = fmaf(qa.w, kf[4 * e4 + 3], t);
                }
                sc[r] = t;
            }
        }
#pragma unroll
        for (int j = 0; j < KS8 && !F8; j++) {
            const uint32_t kw[4] = {kr[j].x, kr[j].y, kr[j].z, kr[j].w};
#pragma unroll
            for (int r = 0; r < GM; r++) {
                const float4 qa = *(const float4 *)&qs[r][sub][j * 8], qb = *(const float4 *)&qs[r][sub][j * 8 + 4];
                float t = sc[r];
                t = fmaf(qa.x, __uint_as_float(kw[0] << 16), t);
                t = fmaf(qa.y, __uint_as_float(kw[0] & 0xffff0000u), t);
                t = fmaf(qa.z, __uint_as_float(kw[1] << 16), t);
                t = fmaf(qa.w, __uint_as_float(kw[1] & 0xffff0000u), t);
                t = fmaf(qb.x, __uint_as_float(kw[2] << 16), t);
                t = fmaf(qb.y, __uint_as_float(kw[2] & 0xffff0000u), t);
                t = fmaf(qb.z, __uint_as_float(kw[3] << 16), t);
                t = fmaf(qb.w, __uint_as_float(kw[3] & 0xffff0000u), t);
                sc[r] = t;
            }
        }
        /* the key's DEC_LPK partial dots, then an online softmax per head over the warp's
         * keys (the xor reductions from DEC_LPK up visit each key once); sc becomes p */
#pragma unroll
        for (int r = 0; r < GM; r++) {
            float t = sc[r];
#pragma unroll
            for (int o = 1; o < DEC_LPK; o <<= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
            const float sv = kp ? t * scale : -INFINITY;
            float cm = sv;
            for (int o = DEC_LPK; o < 32; o <<= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
            const float mn = fmaxf(m[r], cm);
            const float corr = mn == -INFINITY ? 1.f : __expf(m[r] - mn);
            const float p = mn == -INFINITY ? 0.f : __expf(sv - mn);
            float ls = p;
            for (int o = DEC_LPK; o < 32; o <<= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o);
            l[r] = l[r] * corr + ls;
            m[r] = mn;
#pragma unroll
            for (int e = 0; e < DL; e++) acc[r][e] *= corr;
            sc[r] = p;
        }
        /* P.V: lane owns dims lane * DL ..; a key past the end has p = 0 and V = 0 */
#pragma unroll
        for (int j = 0; j < DEC_KPW; j++) {
            float v[DL];
            if constexpr (F8) {
                const uint32_t x = (uint32_t)vr[j];
#pragma unroll
                for (int e = 0; e < DL; e += 2) {
                    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(x >> (8 * e)), __NV_E4M3);
                    const float2 p = __half22float2(*reinterpret_cast<const __half2 *>(&h));
                    v[e] = p.x;
                    v[e + 1] = p.y;
                }
            } else if constexpr (DL == 4) {
                const uint2 x = (const uint2 &)vr[j];
                v[0] = __uint_as_float(x.x << 16);
                v[1 % DL] = __uint_as_float(x.x & 0xffff0000u);
                v[2 % DL] = __uint_as_float(x.y << 16);
                v[3 % DL] = __uint_as_float(x.y & 0xffff0000u);
            } else {
                const uint32_t x = (const uint32_t &)vr[j];
                v[0] = __uint_as_float(x << 16);
                v[1 % DL] = __uint_as_float(x & 0xffff0000u);
            }
#pragma unroll
            for (int r = 0; r < GM; r++) {
                const float pj = __shfl_sync(0xffffffffu, sc[r], j * DEC_LPK);
#pragma unroll
                for (int e = 0; e < DL; e++) acc[r][e] = fmaf(pj, v[e], acc[r][e]);
            }
        }
    }
    /* the O GEMV may launch now and start pulling its weights during the merge */
    if (trigger_early) k_pdl_trigger();
    /* merge the warps */
#pragma unroll
    for (int r = 0; r < GM; r++) {
        if (lane == 0) {
            wm[warp][r] = m[r];
            wl[warp][r] = l[r];
        }
#pragma unroll
        for (int e = 0; e < DL; e++) wacc[warp][r][lane * DL + e] = F8 ? acc[r][e] * g.v_scale : acc[r][e];
    }
    __syncthreads();
    att_merge_warps<false, 0>(wm, wl, wacc, [](int d) { return d; }, 1.f, direct, out, w, H, D, tok0, kvh, G,
                              split, rows, tid);
    if (!direct && w.counters) combine_if_last(out, H, D, w, item * KVH + kvh, tok0, kvh * G, G, rows, ns_keys, ps, den_s);
}

int attention_dec_tc_launch(const float *q, uint16_t *out, int H, int KVH, int D, float scale, const k_kv_geom *g,
                            const k_attn_work *w, int pdl, cudaStream_t s);

/* Fewer (item, KV head) pairs than SMs (batch 1-2): the batch-1 form of the decode kernel,
 * with or without the rotary step (k_attention, k_rope_attention). */
static bool decode_few_pairs(const k_attn_work *w, int KVH) { return (long)w->n_items * KVH < k_sm_count(); }

/* Few (row, KV head) pairs (batch 1-2): 4 lanes per key, 8 keys per warp, so a short
 * context still spreads over many warps. Enough pairs to fill the GPU: see below. */
template <int D, int GM, bool F8>
static int launch_attention_decode_kv(const float *q, uint16_t *out, int H, int KVH, float scale, const k_kv_geom *g,
                                      const k_attn_work *w, cudaStream_t s) {
    /* k_tuning.attn_pdl: 0 an ordinary launch, 1 a programmatic-dependent one, 2 that and
     * the O GEMV let in after the key loop */
    const int pdl = k_tuning_get()->attn_pdl;
    dim3 grid(w->n_splits, KVH, w->n_items);
    int rc;
    /* Many pairs: the tensor-core form (attention_tc.cu; k_tuning.attn_dec 6, 7 and the
     * default 8), which measured 1.04-1.20x of the SIMT forms wherever it applies (its
     * header). The SIMT forms stay for other head dims and groups, and for A/B: a
     * lane-quarter per key as at batch 1 (4 lanes, 8 keys per warp), 4 warps, registers
     * capped for 4 blocks per SM (attn_dec 0), so more warps hide the dependent loads.
     * H200, `specd bench --batch 64,256`, decode tok/s: 8B 10,600 / 21,431 and 1B at 256
     * 81,676, against 9,800 / 19,156 and 77,211 for a lane per key, 4 warps, no cap
     * (attn_dec 1, the earlier form); 2 (a lane-quarter, 2 warps, 8 blocks) gave 9,558 /
     * 21,807 and 82,689. Forms with 2 or 8 lanes per key or 8 warps measured between
     * these. */
#define DEC_LAUNCH(LPK, WARPS, MINB)                                                                                  \
    k_launch_pdl(pdl > 0, attention_decode_kernel<D, GM, LPK, WARPS, MINB, F8, false>, grid, dim3(WARPS * 32), 0, s, \
                 q, out, H, KVH, F8 ? scale * g->k_scale : scale, *g, *w, k_rope_in{}, pdl == 2,                \
                 k_tuning_get()->attn_dec_pipe)
    const int form = k_tuning_get()->attn_dec;
    const bool tc = form >= 6;
    if (decode_few_pairs(w, KVH)) rc = DEC_LAUNCH(4, 8, 1);
    else if (tc && (rc = attention_dec_tc_launch(q, out, H, KVH, D, scale, g, w, pdl, s)) != -1)
        return rc;   /* splits merged by the combine kernel */
    else if (form == 1) rc = DEC_LAUNCH(1, 4, 1);
    else if (form == 2) rc = DEC_LAUNCH(4, 2, 8);
    else rc = DEC_LAUNCH(4, 4, 4);
#undef DEC_LAUNCH
    return attention_merge_after(rc, out, H, D, w, s);
}

/* The batch-1 form (4 lanes a key, 8 warps) with the rotary step inside (k_rope_attention). */
template <int D, int GM, bool F8>
static int launch_attention_decode_rope(const k_rope_in *rp, uint16_t *out, int H, int KVH, float scale,
                                        const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    const int pdl = k_tuning_get()->attn_pdl;
    const int rc = k_launch_pdl(pdl > 0, attention_decode_kernel<D, GM, 4, 8, 1, F8, true>,
                                dim3(w->n_splits, KVH, w->n_items), dim3(8 * 32), 0, s, (const float *)NULL, out, H, KVH,
                                F8 ? scale * g->k_scale : scale, *g, *w, *rp, pdl == 2, k_tuning_get()->attn_dec_pipe);
    return attention_merge_after(rc, out, H, D, w, s);
}

/* The decode kernel's instances (head dim 64 or 128, up to 4 or 8 query heads per KV
 * head, bf16 or FP8 cache) for k_attention (L = dec_plain) and k_rope_attention
 * (dec_rope): L::run<D, GM, F8> of the one that fits. */
struct dec_plain {
    template <int D, int GM, bool F8>
    static int run(const float *q, const k_rope_in *, uint16_t *out, int H, int KVH, float scale, const k_kv_geom *g,
                   const k_attn_work *w, cudaStream_t s) {
        return launch_attention_decode_kv<D, GM, F8>(q, out, H, KVH, scale, g, w, s);
    }
};
struct dec_rope {
    template <int D, int GM, bool F8>
    static int run(const float *, const k_rope_in *rp, uint16_t *out, int H, int KVH, float scale, const k_kv_geom *g,
                   const k_attn_work *w, cudaStream_t s) {
        return launch_attention_decode_rope<D, GM, F8>(rp, out, H, KVH, scale, g, w, s);
    }
};
template <class L, int D, int GM>
static int decode_instance(const float *q, const k_rope_in *rp, uint16_t *out, int H, int KVH, float scale,
                           const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    return g->kv_fp8 ? L::template run<D, GM, true>(q, rp, out, H, KVH, scale, g, w, s)
                     : L::template run<D, GM, false>(q, rp, out, H, KVH, scale, g, w, s);
}
/* D is 64 or 128 and G <= 8 (the callers check) */
template <class L>
static int decode_dispatch(const float *q, const k_rope_in *rp, uint16_t *out, int H, int KVH, int D, float scale,
                           const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    const bool g4 = H / KVH <= 4;
    if (D == 128)
        return g4 ? decode_instance<L, 128, 4>(q, rp, out, H, KVH, scale, g, w, s)
                  : decode_instance<L, 128, 8>(q, rp, out, H, KVH, scale, g, w, s);
    return g4 ? decode_instance<L, 64, 4>(q, rp, out, H, KVH, scale, g, w, s)
              : decode_instance<L, 64, 8>(q, rp, out, H, KVH, scale, g, w, s);
}

template <int D, int R, bool F8>
static int launch_attention_kv(const float *q, uint16_t *out, int H, int KVH, float scale,
                               const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    size_t smem = att_smem<D, R>::total;
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(attention_kernel<D, R, F8>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    dim3 grid(w->n_splits, KVH, w->n_items);
    attention_kernel<D, R, F8><<<grid, ATT_NT, smem, s>>>(q, out, H, KVH, F8 ? scale * g->k_scale : scale, *g, *w);
    int rc = K_LAUNCH_RESULT();
    return attention_merge_after(rc, out, H, D, w, s);
}

template <int D, int R>
static int launch_attention(const float *q, uint16_t *out, int H, int KVH, float scale,
                            const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    return g->kv_fp8 ? launch_attention_kv<D, R, true>(q, out, H, KVH, scale, g, w, s)
                     : launch_attention_kv<D, R, false>(q, out, H, KVH, scale, g, w, s);
}

template <int D>
static int dispatch_rows(int rows, const float *q, uint16_t *out, int H, int KVH,
                         float scale, const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    if (rows <= 8) return launch_attention<D, 8>(q, out, H, KVH, scale, g, w, s);
    if (rows <= 16) return launch_attention<D, 16>(q, out, H, KVH, scale, g, w, s);
    if (rows <= 32) return launch_attention<D, 32>(q, out, H, KVH, scale, g, w, s);
    return launch_attention<D, 64>(q, out, H, KVH, scale, g, w, s);
}

/* k_tuning.attn_simt keeps every call on attention_kernel (to time the two against each
 * other); attn_tiled keeps decode rows on it too (to time and test the two). */
static bool attention_force_simt(void) { return k_tuning_get()->attn_simt != 0; }
static bool attention_force_tiled(void) { return k_tuning_get()->attn_tiled != 0; }

/* Enough rows for 16-row mma tiles (prefill chunks, verify): tensor cores. */
static bool attention_tc_takes(int D, int rows) {
    return (D == 64 || D == 128) && rows >= 16 && !attention_force_simt();
}

/* The kernels other than the decode kernel, which do not round for an int8 GEMV (w.x8
 * unset here); tc: the tensor cores take the pass (attention_tc_takes). */
static int attention_general(const float *q, uint16_t *out, int H, int KVH, int D, float scale, const k_kv_geom *g,
                             const k_attn_work *w, int rows, bool tc, cudaStream_t s) {
    if (tc) return k_attention_tc(q, out, H, KVH, D, scale, g, w, s);
    if (D == 32) return dispatch_rows<32>(rows, q, out, H, KVH, scale, g, w, s);
    if (D == 64) return dispatch_rows<64>(rows, q, out, H, KVH, scale, g, w, s);
    if (D == 128) return dispatch_rows<128>(rows, q, out, H, KVH, scale, g, w, s);
    if (D == 256) {   /* Gemma 3: the tiled kernel, at most 32 rows (registers) */
        if (rows <= 8) return launch_attention<256, 8>(q, out, H, KVH, scale, g, w, s);
        if (rows <= 16) return launch_attention<256, 16>(q, out, H, KVH, scale, g, w, s);
        if (rows <= 32) return launch_attention<256, 32>(q, out, H, KVH, scale, g, w, s);
    }
    return -1;
}

/* What k_attention and k_rope_attention refuse (-1). */
static bool attention_args_ok(int H, int KVH, int D, const k_attn_work *w) {
    if (H <= 0 || KVH <= 0 || H % KVH || w->qt <= 0 || w->n_splits <= 0 || w->split_len < 0) return false;
    if (w->qt * (H / KVH) > 64) return false;
    if (w->n_splits > 1 && (!w->ws_o || !w->ws_ml)) return false;
    if (w->split_len % ATT_TILE) return false;
    if (w->l2_next && ((uintptr_t)w->l2_next % 16 || w->l2_next_bytes % 16)) return false;
    return !(w->x8 && ((uintptr_t)w->x8 % 16 || (H * D) % 32));
}

extern "C" int k_attention(const float *q, uint16_t *out, int H, int KVH, int D,
                           float scale, const k_kv_geom *g, const k_attn_work *w,
                           cudaStream_t s) {
    if (!attention_args_ok(H, KVH, D, w)) return -1;
    const int rows = w->qt * (H / KVH);
    if (w->n_items == 0) return 0;
    /* one query token per item and at most 8 query heads per KV head (and too few rows for
     * the tensor cores): the decode kernel, which rounds for w.x8 itself */
    const bool tc = attention_tc_takes(D, rows);
    if (!tc && w->qt == 1 && rows <= 8 && (D == 64 || D == 128) && !attention_force_tiled())
        return decode_dispatch<dec_plain>(q, NULL, out, H, KVH, D, scale, g, w, s);
    if (!w->x8) return attention_general(q, out, H, KVH, D, scale, g, w, rows, tc, s);
    k_attn_work plain = *w;
    plain.x8 = NULL;
    const int rc = attention_general(q, out, H, KVH, D, scale, g, &plain, rows, tc, s);
    return rc ? rc : k_quant_x8(out, w->n_tok, H * D, w->x8, s);
}

extern "C" int k_rope_attention(const k_rope_in *rp, uint16_t *out, int H, int KVH, int D, float scale,
                                const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    if (!rp || !rp->qkv || !rp->inv_freq || !attention_args_ok(H, KVH, D, w) || w->qt != 1 ||
        w->n_items != w->n_tok)
        return -1;
    const int G = H / KVH;
    /* where k_attention would take the batch-1 form of the decode kernel */
    const bool fuse = k_tuning_get()->attn_rope && G <= 8 && (D == 64 || D == 128) && !attention_force_tiled() &&
                      decode_few_pairs(w, KVH);
    if (!fuse) {
        if (!rp->q_out) return -1;
        const int rc = k_qkv_rope_kv(rp->qkv, rp->bias, rp->q_norm, rp->k_norm, rp->inv_freq, rp->eps, rp->q_out,
                                     w->n_tok, H, KVH, D, g, s);
        return rc ? rc : k_attention(rp->q_out, out, H, KVH, D, scale, g, w, s);
    }
    if (w->n_items == 0) return 0;
    return decode_dispatch<dec_rope>(NULL, rp, out, H, KVH, D, scale, g, w, s);
}
