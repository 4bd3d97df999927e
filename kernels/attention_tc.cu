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

/* ---- decode rows on tensor cores ------------------------------------------------------
 * One query token per item (decode, or a verify pass run token by token) with G = H / KVH
 * <= 8 query heads per KV head, over many (item, KV head) pairs: the SIMT decode kernel
 * (attention.cu) spends fp32 FMAs and, with an FP8 cache, three conversions per pair of
 * codes on every key, so at 256 rows it costs well above its bytes. Here a block of
 * DTC_WARPS warps takes one (item, KV head, split); warp w takes the chunks of 16 keys w,
 * w + DTC_WARPS, ... with its own online softmax, and the warps merge through shared
 * memory at the end. Nothing is staged in shared memory: each lane loads the K and V bytes
 * its mma fragments need straight into registers, 16 bytes at a time, the loads of one
 * instruction covering whole 32-byte sectors. Registers are capped for 4 blocks per SM.
 *
 * Per chunk (keys c .. c + 15), with m16n8k16 (lane = 4 gid + tig):
 *   S = Q K^T, two n-tiles of 8 keys. A = Q: row gid is query head gid (rows >= G and
 *   gid + 8 are zero). The sum over head dims may run in any order as long as Q and K
 *   agree: B of n-tile t is key c + 8 t + gid, and lane tig loads the 16-byte pieces tig,
 *   tig + 4, ... of that key's row; k-step kc takes 4 consecutive dims of them
 *   (dtc_kdim), and Q's A registers hold the same dims.
 *   P = softmax(S) straight from S's C fragments: lane (gid, tig) holds head gid's keys
 *   c + 2 tig, + 1 and c + 8 + 2 tig, + 1.
 *   O^T += V^T P^T (rather than O += P V, whose A operand P would pad the G <= 8 heads to
 *   16 rows and leave half of O's D / 8 accumulator tiles empty): P^T is the B operand,
 *   8 columns, and the lane's share of it is exactly what S's C fragment holds. A = V^T:
 *   lane gid loads the 16-byte pieces gid, gid + 8, ... (VU dims each) of the four keys
 *   c + 2 tig, + 1, + 8, + 9 (its k-slots), and m-tile mt's rows gid and gid + 8 are
 *   elements mt and mt + D / 16 of that share (dtc_vdim); a byte_perm pairs two keys'
 *   values per register. D / 16 accumulator tiles, whose columns 2 tig and 2 tig + 1
 *   are heads, so their rescaling comes from those heads' lanes.
 * bf16 cache: bf16 mma, q rounded to bf16 (as the prefill kernel does). FP8 cache: fp16
 * mma; codes become fp16 pairs with one cvt each (exact), q is scaled by a power of two
 * so that the warp's largest |q| is about 2^12 (fp16 keeps its full precision; the scores
 * take the power back), K's scale is in `scale` and V's multiplies the output. Splits
 * write partials in the combine kernel's format (the launcher runs it).
 *
 * H100, decode tok/s against the SIMT form (tests/gpu/BENCH.md, twenty-eighth and
 * twenty-ninth sessions): 8B shape 1.04x / 1.07x at 32 / 256 rows, 1.10x at 32 rows of
 * 4096-token contexts (1.20x on an FP8 cache), 1B shape 1.05x at 32 and 64 rows, 1.13x
 * at 256 (another 1.05x with the prefetch below). Its retired forms: O += P V with 3
 * blocks per SM (k_tuning.attn_dec 3, and 4 where it measured faster), which lost 1-5% to
 * the SIMT form at 64 rows of the 8B shape, and O^T with 3 blocks per SM (5), within 1% of
 * 3: the gain is the fourth block. */
#define DTC_WARPS 4

/* The first of the 4 dims k-step kc of lane tig covers in S = Q K^T. */
template <bool F8> __device__ __forceinline__ int dtc_kdim(int kc, int tig) {
    constexpr int U = F8 ? 16 : 8, PER = U / 4;   /* dims (8 bf16, 16 E4M3) and k-steps per 16-byte piece */
    return (4 * (kc / PER) + tig) * U + 4 * (kc % PER);
}

/* BYTES (8 or a multiple of 16) of a row into words w[]: piece i (16 bytes, or the 8) from
 * byte (stride i + first) * 16 (* 8), so that the lanes of one load instruction read whole
 * sectors; zero when p is NULL. */
template <int BYTES>
__device__ __forceinline__ void dtc_load(const void *p, int first, int stride, uint32_t (&w)[BYTES / 4]) {
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
        for (int i = 0; i < BYTES / 16; i++) {
            const uint4 v = p ? __ldg((const uint4 *)p + stride * i + first) : make_uint4(0, 0, 0, 0);
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else {
        static_assert(BYTES == 8, "a lane's share of a row is 8 bytes or whole 16-byte pieces");
        const uint2 v = p ? __ldg((const uint2 *)p + first) : make_uint2(0, 0);
        w[0] = v.x, w[1] = v.y;
    }
}

/* The head dim of element e of lane group gid's V share (its pieces gid, gid + 8, ... of
 * VU dims each, in load order). */
template <int VU> __device__ __forceinline__ int dtc_vdim(int e, int gid) {
    return ((e / VU) * 8 + gid) * VU + e % VU;
}

/* Two E4M3 codes (bits 0..15 of x, the first in the low byte) as an fp16 pair, exactly. */
__device__ __forceinline__ uint32_t dtc_f8x2(uint32_t x) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(x & 0xffffu), __NV_E4M3);
    return (uint32_t)h.x | (uint32_t)h.y << 16;
}

/* PF (k_tuning.attn_dec 7; by default where it keeps its registers: an FP8 cache or head
 * dim 64): each warp's loop waits on its K and V loads once per chunk, and a block of a
 * short context (192 keys: three chunks a warp) is mostly that chain of waits plus q's
 * load before it. With PF the block first asks L2 for the rows of its first DTC_PF keys,
 * one key a thread, and each chunk asks for the chunk DTC_PF keys ahead, so a load finds
 * its row in L2 (prefetch.global.L2: no registers, no wait). DTC_PF is two rounds of the
 * block's warps; 128 keys a block are 64 KB of a bf16 cache at head dim 128, 34 MB over
 * 528 resident blocks, within an H100's 50 MB of L2. H100 (BENCH.md, twenty-ninth
 * session), against the form without it: FP8 cache 1.03x at 256 rows (8B shape, FP8
 * weights) and at 32 rows of 4096 keys, 1B shape 1.05x at 256 rows; but a bf16 cache at
 * head dim 128, where the cap already spills 40 bytes and PF makes it 76, 0.97x at 256
 * rows and 0.94x at 4096 keys. */
#define DTC_PF 128

/* Ask L2 for the BYTES of a row at p (whole 128-byte lines; a row is 64-256 bytes). */
template <int BYTES> __device__ __forceinline__ void dtc_prefetch(const void *p) {
#pragma unroll
    for (int i = 0; i < (BYTES + 127) / 128; i++)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p + 128 * i));
}

template <int D, bool F8, bool PF>
__global__ void __launch_bounds__(DTC_WARPS * 32, 4)
attention_dec_tc_kernel(const float *__restrict__ q, uint16_t *__restrict__ out, int H, int KVH, float scale,
                        k_kv_geom g, k_attn_work w, int trigger_early) {
    constexpr int KC = D / 16, NO = D / 16, ES = F8 ? 1 : 2;   /* k-steps of S, accumulator tiles of O^T */
    constexpr int KB = D / 4 * ES, VB = D / 8 * ES;   /* a lane's bytes of one K / V row */
    constexpr int VU = (VB < 16 ? VB : 16) / ES;      /* dims per piece of its V share */
    typedef typename std::conditional<F8, uint8_t, uint16_t>::type kv_t;
    /* a warp's output, head by head, dims in order (rows padded against bank conflicts) */
    __shared__ __align__(16) float so[DTC_WARPS][8][D + 8];
    __shared__ float sm[DTC_WARPS][8], sl[DTC_WARPS][8];

    k_pdl_wait();   /* q and this pass's keys come from the kernel before */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int split = blockIdx.x, kvh = blockIdx.y, item = blockIdx.z;
    const int G = H / KVH;
    const att_split sp = att_split_geom<16>(g, w, G, split, item);
    const int rows = sp.rows, ks0 = sp.ks0, ke = sp.ke, bs = g.block_size;
    if (ks0 >= ke || rows <= 0) {
        if (w.n_splits > 1) att_mark_empty(w, H, G, kvh, split, sp.tok0, rows, DTC_WARPS * 32);
        return;
    }
    const int *bt = g.bt + (size_t)sp.slot * g.max_blocks;
    const kv_t *pool = (const kv_t *)*g.pool_pp + g.layer_off + (size_t)kvh * bs * D;
    const size_t v_off = (size_t)KVH * bs * D;
    /* Key c + j (j < 16) of the chunk at c = cb bs + co, NULL past ke: no division per key */
    auto key_row = [&](int c, int cb, int co, int j) -> const kv_t * {
        if (c + j >= ke) return NULL;
        int b = cb, o = co + j;
        if (bs >= 16) {
            const int over = o >= bs;
            b += over, o -= over ? bs : 0;
        } else {
            b += o / bs, o %= bs;
        }
        return pool + (size_t)bt[b] * g.block_elems + (size_t)o * D;
    };
    /* PF: the K (part 0) or V (part 1) row of key k into L2, nothing past ke */
    auto prefetch_key = [&](int k, int part) {
        if (k >= ke) return;
        const kv_t *r = pool + (size_t)bt[k / bs] * g.block_elems + (size_t)(k % bs) * D;
        dtc_prefetch<D * (int)sizeof(kv_t)>(part ? r + v_off : r);
    };

    /* Q: head gid, k-step kc's dims as this lane's K pieces hold them */
    uint32_t qa[KC][2];
    float qsh = 1.f;   /* F8: the scores' factor back from q's power-of-two scaling */
    {
        float qv[D / 4];
        const float *qp = q + ((size_t)sp.tok0 * H + kvh * G + gid) * D;
#pragma unroll
        for (int kc = 0; kc < KC; kc++) {
            const float4 v = gid < G ? *(const float4 *)(qp + dtc_kdim<F8>(kc, tig)) : make_float4(0.f, 0.f, 0.f, 0.f);
            qv[4 * kc] = v.x, qv[4 * kc + 1] = v.y, qv[4 * kc + 2] = v.z, qv[4 * kc + 3] = v.w;
        }
        if constexpr (PF) {   /* while q's loads are in flight */
            static_assert(DTC_PF <= DTC_WARPS * 32 && DTC_PF % (16 * DTC_WARPS) == 0, "a key a thread, whole rounds");
            if (tid < DTC_PF) prefetch_key(ks0 + tid, 0), prefetch_key(ks0 + tid, 1);
        }
        if constexpr (F8) {
            float mx = 0.f;
#pragma unroll
            for (int i = 0; i < D / 4; i++) mx = fmaxf(mx, fabsf(qv[i]));
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            int ex = 0;
            frexpf(mx, &ex);   /* mx < 2^ex (0 for mx = 0); inf / NaN leave ex 0 and pass through */
            const int sh = mx > 0.f && isfinite(mx) ? ex - 12 : 0;
            qsh = ldexpf(1.f, sh);
#pragma unroll
            for (int i = 0; i < D / 4; i++) qv[i] = ldexpf(qv[i], -sh);
        }
#pragma unroll
        for (int kc = 0; kc < KC; kc++) {
            qa[kc][0] = F8 ? tc_pack_f16(qv[4 * kc], qv[4 * kc + 1]) : tc_pack(qv[4 * kc], qv[4 * kc + 1]);
            qa[kc][1] = F8 ? tc_pack_f16(qv[4 * kc + 2], qv[4 * kc + 3]) : tc_pack(qv[4 * kc + 2], qv[4 * kc + 3]);
        }
    }
    const float sl2 = scale * qsh * 1.4426950408889634f;   /* scores in log2 units */

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m = -INFINITY, l = 0.f;   /* head gid's running max (log2 units) and this lane's sum */

    for (int c = ks0 + 16 * warp; c < ke; c += 16 * DTC_WARPS) {
        const int cb = c / bs, co = c - cb * bs;
        uint32_t kw[2][KB / 4], vw[4][VB / 4];
#pragma unroll
        for (int t = 0; t < 2; t++) dtc_load<KB>(key_row(c, cb, co, 8 * t + gid), tig, 4, kw[t]);
#pragma unroll
        for (int j = 0; j < 4; j++) {   /* keys c + 2 tig, + 1, + 8, + 9 */
            const kv_t *r = key_row(c, cb, co, 2 * tig + (j & 1) + 8 * (j >> 1));
            dtc_load<VB>(r ? r + v_off : NULL, gid, 8, vw[j]);
        }
        /* after the loads, so the wait on the block table's entry overlaps them */
        if constexpr (PF) prefetch_key(c + DTC_PF + (lane & 15), lane >> 4);   /* this warp's chunk two rounds on */
        float s[2][4];
#pragma unroll
        for (int t = 0; t < 2; t++) {
            s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
            for (int kc = 0; kc < KC; kc++) {
                const uint32_t a[4] = {qa[kc][0], 0u, qa[kc][1], 0u};
                if constexpr (F8) {
                    const uint32_t x = kw[t][kc];   /* codes of k-step kc's 4 dims */
                    tc_mma_f16(s[t], a, dtc_f8x2(x), dtc_f8x2(x >> 16));
                } else {
                    tc_mma(s[t], a, kw[t][2 * kc], kw[t][2 * kc + 1]);
                }
            }
        }
        /* this lane's four keys of head gid: c + 2 tig + {0, 1} (tile 0), + 8 (tile 1) */
        float p[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int key = c + 8 * (i >> 1) + 2 * tig + (i & 1);
            p[i] = key < ke ? s[i >> 1][i & 1] * sl2 : -INFINITY;
        }
        float mx = fmaxf(fmaxf(p[0], p[1]), fmaxf(p[2], p[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m, mx), mu = mn == -INFINITY ? 0.f : mn;
        const float corr = tc_exp2(m - mu);
        m = mn;
        float ps = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            p[i] = tc_exp2(p[i] - mu);
            ps += p[i];
        }
        l = l * corr + ps;
        const uint32_t pa[4] = {F8 ? tc_pack_f16(p[0], p[1]) : tc_pack(p[0], p[1]), 0u,
                                F8 ? tc_pack_f16(p[2], p[3]) : tc_pack(p[2], p[3]), 0u};
        /* O^T += V^T P^T: m-tile mt's rows gid / gid + 8 are elements mt / mt + D/16 of
         * this lane's V share (dtc_vdim), its columns 2 tig, + 1 heads, whose
         * corrections come from the lanes of those heads */
        const float c0 = __shfl_sync(0xffffffffu, corr, 8 * tig), c1 = __shfl_sync(0xffffffffu, corr, 8 * tig + 4);
#pragma unroll
        for (int mt = 0; mt < NO; mt++) o[mt][0] *= c0, o[mt][1] *= c1, o[mt][2] *= c0, o[mt][3] *= c1;
#pragma unroll
        for (int mt = 0; mt < NO; mt += F8 ? 2 : 1) {
            uint32_t a[2][4];   /* (F8: m-tiles mt and mt + 1) */
#pragma unroll
            for (int h = 0; h < 2; h++) {   /* keys (c + 2 tig, + 1), then (+ 8, + 9) */
                const uint32_t *va = vw[2 * h], *vb = vw[2 * h + 1];
#pragma unroll
                for (int hi = 0; hi < 2; hi++) {   /* row gid, then gid + 8 */
                    const int e = mt + hi * (D / 16);
                    if constexpr (F8) {
                        const uint32_t x = __byte_perm(va[e >> 2], vb[e >> 2], (e & 2) ? 0x7362u : 0x5140u);
                        a[0][2 * h + hi] = dtc_f8x2(x);
                        a[1][2 * h + hi] = dtc_f8x2(x >> 16);
                    } else {
                        a[0][2 * h + hi] = __byte_perm(va[e >> 1], vb[e >> 1], (e & 1) ? 0x7632u : 0x5410u);
                    }
                }
            }
            if constexpr (F8) {
                tc_mma_f16(o[mt], a[0], pa[0], pa[2]);
                tc_mma_f16(o[mt + 1], a[1], pa[0], pa[2]);
            } else {
                tc_mma(o[mt], a[0], pa[0], pa[2]);
            }
        }
    }
    if (trigger_early) k_pdl_trigger();   /* the O GEMV may launch and fetch weights now */

    /* merge the warps: head gid's (max, sum) and dims through shared memory */
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (tig == 0) sm[warp][gid] = m, sl[warp][gid] = l;
#pragma unroll
    for (int mt = 0; mt < NO; mt++) {
        const int d0 = dtc_vdim<VU>(mt, gid), d1 = dtc_vdim<VU>(mt + D / 16, gid);
        so[warp][2 * tig][d0] = o[mt][0], so[warp][2 * tig + 1][d0] = o[mt][1];
        so[warp][2 * tig][d1] = o[mt][2], so[warp][2 * tig + 1][d1] = o[mt][3];
    }
    __syncthreads();
    const auto col = [](int d) { return d; };   /* so holds the dims in order */
    att_merge_warps<true, DTC_WARPS * 32>(sm, sl, so, col, F8 ? g.v_scale : 1.f, w.n_splits == 1, out, w, H, D,
                                          sp.tok0, kvh, G, split, rows, tid);
}

template <int D, bool F8>
static int launch_attention_dec_tc(const float *q, uint16_t *out, int H, int KVH, float scale, const k_kv_geom *g,
                                   const k_attn_work *w, int pdl, cudaStream_t s) {
    dim3 grid(w->n_splits, KVH, w->n_items);
    const int v = k_tuning_get()->attn_dec;   /* 7 always, 8 where it keeps its registers */
    const bool pf = v == 7 || (v == 8 && (F8 || D == 64));
    int rc = k_launch_pdl(pdl > 0, pf ? attention_dec_tc_kernel<D, F8, true> : attention_dec_tc_kernel<D, F8, false>,
                          grid, dim3(DTC_WARPS * 32), 0, s, q, out, H, KVH,
                          F8 ? scale * g->k_scale : scale, *g, *w, pdl == 2);
    if (rc || w->n_splits == 1) return rc;
    return attention_combine_launch(out, H, D, w, s);
}

/* Called by attention.cu's decode launcher for decode items of G <= 8 query heads per KV
 * head; pdl as k_tuning.attn_pdl; -1 where it does not apply. */
int attention_dec_tc_launch(const float *q, uint16_t *out, int H, int KVH, int D, float scale, const k_kv_geom *g,
                            const k_attn_work *w, int pdl, cudaStream_t s) {
    if ((D != 64 && D != 128) || H % KVH || H / KVH > 8 || w->qt != 1) return -1;
    if (w->n_splits > 1 && (!w->ws_o || !w->ws_ml)) return -1;
    if (D == 64) return g->kv_fp8 ? launch_attention_dec_tc<64, true>(q, out, H, KVH, scale, g, w, pdl, s)
                                  : launch_attention_dec_tc<64, false>(q, out, H, KVH, scale, g, w, pdl, s);
    return g->kv_fp8 ? launch_attention_dec_tc<128, true>(q, out, H, KVH, scale, g, w, pdl, s)
                     : launch_attention_dec_tc<128, false>(q, out, H, KVH, scale, g, w, pdl, s);
}
