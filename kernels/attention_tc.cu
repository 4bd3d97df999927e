/* Tensor-core paged attention: the work of attention_kernel (attention.cu) done with warp
 * mma.sync m16n8k16 bf16 -> fp32, flash-attention-2 style. Same grid (n_splits, KVH,
 * n_items), same item / split / clamp rules, same row order (row r = qi * G + gg is token
 * tok0 + r / G, head kvh * G + r % G), same partial format in ws_o / ws_ml and the same
 * combine kernel, so k_attention can pick either per call.
 *
 * A block is 4 warps; warp w owns query rows 16w .. 16w+15 (rows past `rows` are zero
 * padding and never written) and keeps them as bf16 A fragments in registers for the whole
 * key loop. Keys come from the paged pool in tiles of 64 through shared memory with
 * cp.async, double-buffered: tile i+1 is in flight while tile i is used. Per tile a warp
 * computes S = Q K^T (16 x 64, fp32 registers), applies scale and the causal mask, updates
 * its running max / sum (online softmax, base-2 exponent), turns S into bf16 A fragments
 * of P without going through shared memory and accumulates O += P V in fp32.
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16, lane = 4 * gid + tig): A regs {row gid k 2tig..,
 * row gid+8 k 2tig.., row gid k 2tig+8.., row gid+8 k 2tig+8..}; B regs {k 2tig.. col gid,
 * k 2tig+8.. col gid}; C {row gid col 2tig, 2tig+1, row gid+8 col 2tig, 2tig+1}. The C
 * fragments of two adjacent 8-key tiles of S are exactly the A fragment of one 16-key
 * chunk of P. K tiles are stored [key][d], which is B "col" for S = Q K^T (ldmatrix);
 * V tiles are stored [key][d] too, which is B transposed for O = P V (ldmatrix.trans). */
#include <limits.h>
#include <math.h>
#include <type_traits>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/attention.cuh"
#include "kernels/tc.cuh"

#define TC_NT 128     /* 4 warps x 16 query rows = 64 rows at most */
#define TC_TILE 64    /* keys per shared-memory tile */

/* Launches the split combine (attention.cu); the same pass the SIMT path uses. */
int attention_combine_launch(uint16_t *out, int H, int D, const k_attn_work *w, cudaStream_t s);

template <int D>
struct tc_smem {
    static constexpr int LD = D + 8;   /* 16 bytes of padding per key row: ldmatrix's 8 row
                                          addresses fall in 8 different bank groups */
    static constexpr int tile_elems = TC_TILE * LD;
    static constexpr uint32_t tile_bytes = tile_elems * 2;
    static constexpr size_t total = (size_t)4 * tile_bytes;   /* K[2], V[2] */
};


/* ---- kernel ------------------------------------------------------------------------- */

template <int D, bool F8>
__global__ void __launch_bounds__(TC_NT)
attention_tc_kernel(const float *__restrict__ q, uint16_t *__restrict__ out, int H, int KVH,
                    float scale, k_kv_geom g, k_attn_work w) {
    typedef tc_smem<D> SM;
    extern __shared__ __align__(16) unsigned char smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int split = blockIdx.x, kvh = blockIdx.y, item = blockIdx.z;
    const int G = H / KVH;
    const att_split sp = att_split_geom<TC_TILE>(g, w, G, split, item);
    const int q0 = sp.q0, tok0 = sp.tok0, rows = sp.rows, len = sp.len, ks0 = sp.ks0, ke = sp.ke;

    if (ks0 >= ke || rows <= 0) {
        /* No key here; this kernel never merges in-kernel, so with several splits the
         * combine kernel reads these partials. */
        if (w.n_splits > 1) att_mark_empty(w, H, G, kvh, split, tok0, rows, TC_NT);
        return;
    }

    const int *bt = g.bt + (size_t)sp.slot * g.max_blocks;
    typedef typename std::conditional<F8, uint8_t, uint16_t>::type kv_t;
    const kv_t *pool = (const kv_t *)*g.pool_pp;
    const size_t v_off = (size_t)KVH * g.block_size * D;
    const uint32_t k_sm = tc_smem_addr(smem);            /* K tiles: [2][TILE][LD] */
    const uint32_t v_sm = k_sm + 2 * SM::tile_bytes;     /* V tiles: [2][TILE][LD] */

    /* Tile loader: thread owns 16-byte chunk c of keys kr, kr + KPP, ...; keys at or past
     * ke (split end, context end) are zero-filled so P = 0 never meets a NaN in V. */
    constexpr int CH = D / 8, KPP = TC_NT / CH;
    const int lc = tid % CH, lkr = tid / CH;
    /* FP8 cache: no async copy converts, so a tile's codes are fetched into registers
     * (f8k, f8v) before the current tile's math and stored as bf16 (exact; the scales are
     * applied later) after it, which keeps the loads in flight under the math. */
    constexpr int NL = TC_TILE / KPP;
    uint2 f8k[F8 ? NL : 1], f8v[F8 ? NL : 1];
    auto chunk_src = [&](int kt0, int i, bool &ok) {
        const int key = kt0 + lkr + i * KPP;
        ok = key < ke;
        return ok ? pool + (size_t)bt[key / g.block_size] * g.block_elems + g.layer_off +
                        ((size_t)kvh * g.block_size + key % g.block_size) * D + lc * 8
                  : pool;
    };
    auto chunk_off = [&](int buf, int i) {
        return (uint32_t)buf * SM::tile_bytes + (uint32_t)((lkr + i * KPP) * SM::LD + lc * 8) * 2;
    };
    auto fetch_f8 = [&](int kt0) {
#pragma unroll
        for (int i = 0; i < NL && F8; i++) {
            bool ok;
            const kv_t *src = chunk_src(kt0, i, ok);
            f8k[i] = ok ? *(const uint2 *)src : make_uint2(0, 0);   /* code 0 is +0 */
            f8v[i] = ok ? *(const uint2 *)(src + v_off) : make_uint2(0, 0);
        }
    };
    auto store_f8 = [&](int buf) {
#pragma unroll
        for (int i = 0; i < NL && F8; i++) {
            *(uint4 *)(smem + chunk_off(buf, i)) = k_fp8x8_bf16(f8k[i]);
            *(uint4 *)(smem + 2 * SM::tile_bytes + chunk_off(buf, i)) = k_fp8x8_bf16(f8v[i]);
        }
    };
    auto load_tile = [&](int buf, int kt0) {
#pragma unroll
        for (int i = 0; i < NL; i++) {
            bool ok;
            const kv_t *src = chunk_src(kt0, i, ok);
            tc_cp16(k_sm + chunk_off(buf, i), src, ok);
            tc_cp16(v_sm + chunk_off(buf, i), src + (ok ? v_off : 0), ok);
        }
    };

    const int ntiles = (ke - ks0 + TC_TILE - 1) / TC_TILE;
    if constexpr (F8) {
        fetch_f8(ks0);
        store_f8(0);
    } else {
        load_tile(0, ks0);
    }
    tc_commit();

    /* This thread's two rows and their last visible key (causal and split end). */
    const int r0 = warp * 16 + gid, r1 = r0 + 8;
    const int qbase = len + q0;
    const int lim0 = min(qbase + r0 / G, ke - 1), lim1 = min(qbase + r1 / G, ke - 1);
    /* ... and their first visible key (a sliding window; INT_MIN: none) */
    const int lo0 = w.window > 0 ? qbase + r0 / G - w.window + 1 : INT_MIN;
    const int lo1 = w.window > 0 ? qbase + r1 / G - w.window + 1 : INT_MIN;
    const bool active = warp * 16 < rows;   /* warp-uniform */
    const int wmin = qbase + (warp * 16) / G;                     /* first row's position */
    const int wmax = qbase + min(warp * 16 + 15, rows - 1) / G;   /* last real row's */
    const float sl2 = scale * 1.4426950408889634f;                /* scores in log2 units */

    /* Q rows as bf16 A fragments (zero past `rows`), loaded while tile 0 is in flight. */
    uint32_t qf[D / 16][4];
    {
        const float *qp0 = r0 < rows ? q + ((size_t)(tok0 + r0 / G) * H + kvh * G + r0 % G) * D : NULL;
        const float *qp1 = r1 < rows ? q + ((size_t)(tok0 + r1 / G) * H + kvh * G + r1 % G) * D : NULL;
        const float2 z = make_float2(0.f, 0.f);
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
            const int c = kc * 16 + 2 * tig;
            float2 a = qp0 ? *(const float2 *)(qp0 + c) : z;
            float2 b = qp1 ? *(const float2 *)(qp1 + c) : z;
            float2 e = qp0 ? *(const float2 *)(qp0 + c + 8) : z;
            float2 f = qp1 ? *(const float2 *)(qp1 + c + 8) : z;
            qf[kc][0] = tc_pack(a.x, a.y);
            qf[kc][1] = tc_pack(b.x, b.y);
            qf[kc][2] = tc_pack(e.x, e.y);
            qf[kc][3] = tc_pack(f.x, f.y);
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;   /* l: this lane's part */

    for (int it = 0; it < ntiles; it++) {
        const int kt0 = ks0 + it * TC_TILE, buf = it & 1;
        if (it + 1 < ntiles) {
            if constexpr (F8) fetch_f8(kt0 + TC_TILE);
            else load_tile(buf ^ 1, kt0 + TC_TILE);
        }
        tc_commit();       /* possibly empty: keeps "all but the newest group" = tile it */
        tc_wait<1>();
        __syncthreads();

        /* A tile past every real row of the warp changes nothing: skip its math. */
        if (active && kt0 <= wmax) {
            /* S = Q K^T: n-tile j is keys 8j..8j+7. ldmatrix x4: lane supplies key
             * 8j + (lane & 7), d 32kp + 8 (lane >> 3), giving B of chunks 2kp, 2kp+1. */
            float s[8][4];
#pragma unroll
            for (int j = 0; j < 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            const uint32_t kb = k_sm + (uint32_t)buf * SM::tile_bytes;
#pragma unroll
            for (int j = 0; j < 8; j++) {
#pragma unroll
                for (int kp = 0; kp < D / 32; kp++) {
                    uint32_t b0, b1, b2, b3;
                    tc_ldsm4(kb + (uint32_t)((8 * j + (lane & 7)) * SM::LD + kp * 32 + (lane >> 3) * 8) * 2,
                             b0, b1, b2, b3);
                    tc_mma(s[j], qf[2 * kp], b0, b1);
                    tc_mma(s[j], qf[2 * kp + 1], b2, b3);
                }
            }

            /* Scale; mask keys past a row's position or past ke (none when the whole
             * tile is below the warp's first row's position and below ke). */
            const bool full = kt0 + TC_TILE - 1 <= min(ke - 1, wmin) && (w.window <= 0 || kt0 > wmax - w.window);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int key = kt0 + 8 * j + 2 * tig;
                s[j][0] = full || (key <= lim0 && key >= lo0) ? s[j][0] * sl2 : -INFINITY;
                s[j][1] = full || (key + 1 <= lim0 && key + 1 >= lo0) ? s[j][1] * sl2 : -INFINITY;
                s[j][2] = full || (key <= lim1 && key >= lo1) ? s[j][2] * sl2 : -INFINITY;
                s[j][3] = full || (key + 1 <= lim1 && key + 1 >= lo1) ? s[j][3] * sl2 : -INFINITY;
            }

            /* Online softmax: a row lives in the 4 lanes of one quad. */
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
                mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            /* A row with no visible key yet keeps max -inf; subtract 0 so no inf - inf. */
            const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
            const float c0 = tc_exp2(m0 - mu0), c1 = tc_exp2(m1 - mu1);
            m0 = mn0;
            m1 = mn1;
            float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                s[j][0] = tc_exp2(s[j][0] - mu0);
                s[j][1] = tc_exp2(s[j][1] - mu0);
                s[j][2] = tc_exp2(s[j][2] - mu1);
                s[j][3] = tc_exp2(s[j][3] - mu1);
                ps0 += s[j][0] + s[j][1];
                ps1 += s[j][2] + s[j][3];
            }
            l0 = l0 * c0 + ps0;
            l1 = l1 * c1 + ps1;
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[n][0] *= c0;
                o[n][1] *= c0;
                o[n][2] *= c1;
                o[n][3] *= c1;
            }

            /* O += P V: key chunk kc is S tiles 2kc, 2kc+1. ldmatrix x4.trans: lane
             * supplies key 16kc + (lane & 7) + 8 ((lane >> 3) & 1), d 16np + 8 (lane >> 4),
             * giving B of d tiles 2np, 2np+1. */
            const uint32_t vb = v_sm + (uint32_t)buf * SM::tile_bytes;
#pragma unroll
            for (int kc = 0; kc < 4; kc++) {
                uint32_t pa[4];
                pa[0] = tc_pack(s[2 * kc][0], s[2 * kc][1]);
                pa[1] = tc_pack(s[2 * kc][2], s[2 * kc][3]);
                pa[2] = tc_pack(s[2 * kc + 1][0], s[2 * kc + 1][1]);
                pa[3] = tc_pack(s[2 * kc + 1][2], s[2 * kc + 1][3]);
                const int key = 16 * kc + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
                for (int np = 0; np < D / 16; np++) {
                    uint32_t b0, b1, b2, b3;
                    tc_ldsm4_t(vb + (uint32_t)(key * SM::LD + 16 * np + (lane >> 4) * 8) * 2,
                               b0, b1, b2, b3);
                    tc_mma(o[2 * np], pa, b0, b1);
                    tc_mma(o[2 * np + 1], pa, b2, b3);
                }
            }
        }
        if constexpr (F8) {   /* buf ^ 1's last readers passed the previous iteration's barrier */
            if (it + 1 < ntiles) store_f8(buf ^ 1);
        }
        __syncthreads();   /* everyone is done with buf before it is refilled */
    }
    if (!active) return;

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = h ? r1 : r0;
        if (r >= rows) continue;
        const int tok = tok0 + r / G, head = kvh * G + r % G;
        const float l = h ? l1 : l0, m = h ? m1 : m0;
        const float vsc = F8 ? g.v_scale : 1.f;   /* V's scale (K's is in `scale`) */
        if (w.n_splits == 1) {
            const float inv = l > 0.f ? vsc / l : 0.f;
            uint16_t *op = out + ((size_t)tok * H + head) * D + 2 * tig;
#pragma unroll
            for (int n = 0; n < D / 8; n++)
                *(uint32_t *)(op + 8 * n) = tc_pack(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        } else {
            const size_t base = ((size_t)split * w.n_tok + tok) * H + head;
            float *wo = w.ws_o + base * D + 2 * tig;
#pragma unroll
            for (int n = 0; n < D / 8; n++)
                *(float2 *)(wo + 8 * n) = make_float2(o[n][2 * h] * vsc, o[n][2 * h + 1] * vsc);
            if (tig == 0) {
                /* The combine works in natural-log units, like attention_kernel's m. */
                w.ws_ml[base * 2] = m * 0.6931471805599453f;
                w.ws_ml[base * 2 + 1] = l;
            }
        }
    }
}

template <int D, bool F8>
static int launch_attention_tc_kv(const float *q, uint16_t *out, int H, int KVH, float scale,
                                  const k_kv_geom *g, const k_attn_work *w, cudaStream_t s) {
    size_t smem = tc_smem<D>::total;
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(attention_tc_kernel<D, F8>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    dim3 grid(w->n_splits, KVH, w->n_items);
    attention_tc_kernel<D, F8><<<grid, TC_NT, smem, s>>>(q, out, H, KVH, F8 ? scale * g->k_scale : scale, *g, *w);
    int rc = K_LAUNCH_RESULT();
    if (rc || w->n_splits == 1) return rc;
    return attention_combine_launch(out, H, D, w, s);
}

extern "C" int k_attention_tc(const float *q, uint16_t *out, int H, int KVH, int D,
                              float scale, const k_kv_geom *g, const k_attn_work *w,
                              cudaStream_t s) {
    if (D != 64 && D != 128) return -1;
    if (H <= 0 || KVH <= 0 || H % KVH || w->qt <= 0 || w->n_splits <= 0 || w->split_len < 0)
        return -1;
    if (w->qt * (H / KVH) > 64) return -1;
    if (w->n_splits > 1 && (!w->ws_o || !w->ws_ml)) return -1;
    if (w->split_len % TC_TILE) return -1;
    if (w->n_items == 0) return 0;
    if (D == 64) return g->kv_fp8 ? launch_attention_tc_kv<64, true>(q, out, H, KVH, scale, g, w, s)
                                  : launch_attention_tc_kv<64, false>(q, out, H, KVH, scale, g, w, s);
    return g->kv_fp8 ? launch_attention_tc_kv<128, true>(q, out, H, KVH, scale, g, w, s)
                     : launch_attention_tc_kv<128, false>(q, out, H, KVH, scale, g, w, s);
}
