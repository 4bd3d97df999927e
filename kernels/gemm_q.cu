/* GEMM over GGUF-quantized weights read in place, on tensor cores (issue #17): Y[t, o]
 * (+)= sum_k W[o, k] X[t, k] for more token rows than the GEMV takes (decode batches above
 * K_GEMV_MAX_N, verify steps, short prefills). W's rows are in / E blocks of S bytes
 * (kernels/quant_blocks.h), X [n, in] bf16, Y [n, out] fp32.
 *
 * The other path for such batches (k_dequant_q into a bf16 scratch copy, then cuBLAS)
 * reads every weight quantized, writes it as bf16 and reads it again each step (about 4.5
 * bytes per weight where a bf16 model reads 2). Here the quantized bytes are read once per
 * tile of token rows and decoded into shared memory:
 *   - A block of GQ_NT threads (4 warps, 2 x 2) owns GQ_TM token rows x GQ_TN output
 *     columns; each warp 32 x 32 of it (2 x 4 mma tiles of m16n8k16, bf16 in, fp32
 *     accumulators). Warps whose rows are all past n skip their multiplies (decode
 *     batches of 9..63 tokens fill one or two row groups).
 *   - The reduction runs in chunks of GQ_TK = 64 elements, double-buffered: the X chunk
 *     comes by cp.async (zero-filled past n and past the end of a row of 32-element
 *     blocks that is not a whole chunk), the W chunk is decoded by the block's threads
 *     (two threads per column, each 32 weights: Q4_K / Q5_K from three or four 16-byte
 *     loads with qb_k45_word, Q6_K and the 32-element types from 2-byte loads with
 *     qb_q6k_word, qb_q8_0_words, qb_q4_01_words; host decoders, bit-exact with ggml's
 *     dequantization, test_quant_blocks), rounded to bf16 and stored as
 *     16-byte words, while the other buffer is multiplied.
 *   - Tiles of the same columns for different token rows are neighbours in the grid
 *     (blockIdx.x), so a matrix's bytes come from DRAM about once and from L2 for the
 *     other row tiles.
 *   - When the tiles are too few to fill the GPU (a 4096-wide projection of a decode batch
 *     gives 64 blocks), the reduction is split over blockIdx.z: each split writes fp32
 *     partial sums into a caller's workspace and a second kernel adds them in split order
 *     (deterministic: the same bits every run).
 * Each weight is rounded to bf16 as the scratch path rounds it (k_dequant_q); products are
 * summed in fp32 in another order than cuBLAS's, so the two agree to fp32 rounding. */
#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/quant_blocks.h"
#include "kernels/tc.cuh"

#define GQ_TM 64          /* token rows per tile */
#define GQ_TN 64          /* output columns per tile */
#define GQ_TK 64          /* reduction chunk: four mma k-steps, a quarter of a K-quant block */
#define GQ_LD (GQ_TK + 8) /* padded shared row (144 bytes): ldmatrix's 8 rows fall in 8 bank groups */
#define GQ_NT 128         /* threads: 4 warps */
#define GQ_MAX_SPLIT 16
#define GI_LD (GQ_TK + 16) /* int8 shared row (80 bytes): 32-bit fragment loads of 8 rows x 4 words hit 32 banks */

/* Eight decoded weights -> one 16-byte word of bf16 (round to nearest even, as k_dequant_q). */
__device__ __forceinline__ uint4 gq_pack8(const float *w) {
    return make_uint4(tc_pack(w[0], w[1]), tc_pack(w[2], w[3]), tc_pack(w[4], w[5]), tc_pack(w[6], w[7]));
}

/* Chunk k0 of output column `col` into shared row dst[GQ_TK] for Q4_K / Q5_K: thread half h
 * takes 16-byte word 2 p + h of the block's qs (p = the chunk's quarter of the block), which
 * holds 16 elements of each of the chunk's two sub-blocks (qb_k45_word): three or four
 * vector loads and a decode that reads the scales once per 16 weights. W and rows 16-byte
 * aligned (blocks of 144 and 176 bytes). */
template <int T>
__device__ __forceinline__ void gq_decode_k45(const uint8_t *__restrict__ row, int k0, int h, uint16_t *dst) {
    const uint8_t *blk = row + (size_t)(k0 >> 8) * qb_bytes(T);
    const int w = 2 * ((k0 & 255) >> 6) + h;
    const uint4 hv = __ldg((const uint4 *)blk), qv = __ldg((const uint4 *)(blk + (T == QB_Q5_K ? 48 : 16) + 16 * w));
    const uint32_t hdr[4] = {hv.x, hv.y, hv.z, hv.w}, qs[4] = {qv.x, qv.y, qv.z, qv.w};
    float y[32];
    if (T == QB_Q5_K) {
        const uint4 bv = __ldg((const uint4 *)(blk + 16 + 16 * h));
        const uint32_t qh[4] = {bv.x, bv.y, bv.z, bv.w};
        qb_k45_word(hdr, qs, qh, w, y);
    } else {
        qb_k45_word(hdr, qs, NULL, w, y);
    }
    *(uint4 *)(dst + 16 * h) = gq_pack8(y);
    *(uint4 *)(dst + 16 * h + 8) = gq_pack8(y + 8);
    *(uint4 *)(dst + 32 + 16 * h) = gq_pack8(y + 16);
    *(uint4 *)(dst + 32 + 16 * h + 8) = gq_pack8(y + 24);
}

/* 16 bytes at a 2-byte aligned address as four little-endian words (eight 2-byte loads). */
__device__ __forceinline__ void gq_ld16_2(const uint8_t *p, uint32_t w[4]) {
    const unsigned short *h = (const unsigned short *)p;
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)__ldg(h + 2 * i) | (uint32_t)__ldg(h + 2 * i + 1) << 16;
}

/* The same for Q6_K (blocks of 210 bytes: only 2-byte aligned): thread half h takes
 * elements 16 h .. 16 h + 15 of the chunk's two quarters (qb_q6k_word) from 2-byte loads
 * of its low bits, high bits and scales. */
__device__ __forceinline__ void gq_decode_q6k(const uint8_t *__restrict__ row, int k0, int h, uint16_t *dst) {
    const uint8_t *blk = row + (size_t)(k0 >> 8) * 210;
    const int half = (k0 & 255) >> 7, u0 = (k0 & 127) >> 5, l0 = 16 * h;
    uint32_t qla[4], qlb[4], qh[4];
    gq_ld16_2(blk + 64 * half + l0, qla);
    gq_ld16_2(blk + 64 * half + 32 + l0, qlb);
    gq_ld16_2(blk + 128 + 32 * half + l0, qh);
    const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half + h;
    const float d = qb_half_bits(__ldg((const unsigned short *)(blk + 208)));
    float y[32];
    qb_q6k_word(qla, qlb, qh, u0, d, __ldg(sc + 2 * u0), __ldg(sc + 2 * u0 + 2), y);
    *(uint4 *)(dst + l0) = gq_pack8(y);
    *(uint4 *)(dst + l0 + 8) = gq_pack8(y + 8);
    *(uint4 *)(dst + 32 + l0) = gq_pack8(y + 16);
    *(uint4 *)(dst + 32 + l0 + 8) = gq_pack8(y + 24);
}

/* The same for the 32-element types (blocks of 34, 18, 20 bytes: only 2-byte aligned):
 * thread half h takes the chunk's block h (elements 32 h .. 32 h + 31), zeros where the
 * row ends inside the chunk. */
template <int T>
__device__ __forceinline__ void gq_decode_32(const uint8_t *__restrict__ row, int k0, int h, int ke, uint16_t *dst) {
    float y[32];
    const int k = k0 + 32 * h;
    if (k >= ke) {
#pragma unroll
        for (int i = 0; i < 32; i++) y[i] = 0.f;
    } else {
        const uint8_t *blk = row + (size_t)(k >> 5) * qb_bytes(T);
        const float d = qb_half_bits(__ldg((const unsigned short *)blk));
        uint32_t q[8];
        if (T == QB_Q8_0) {
            gq_ld16_2(blk + 2, q);
            gq_ld16_2(blk + 18, q + 4);
            qb_q8_0_words(q, d, y);
        } else {
            gq_ld16_2(blk + (T == QB_Q4_1 ? 4 : 2), q);
            const float m = T == QB_Q4_1 ? qb_half_bits(__ldg((const unsigned short *)(blk + 2))) : 0.f;
            qb_q4_01_words(q, d, m, T == QB_Q4_1, y);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) *(uint4 *)(dst + 32 * h + 8 * i) = gq_pack8(y + 8 * i);
}

/* A warp's 32 x 32 accumulator tile (rows r0.., columns c0..; tc_mma's layout) into Y
 * (overwrite or add) or, with a split reduction, into this split's slice of part. */
__device__ __forceinline__ void gq_store_tile(const float (&acc)[2][4][4], int r0, int c0, int lane, int n, int out,
                                              int accumulate, float *Y, float *part, int ldy) {
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = r0 + mi * 16 + gid + 8 * h;
            if (row >= n) continue;
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int col = c0 + 8 * j + 2 * tig + q;
                    if (col >= out) continue;
                    const float v = acc[mi][j][2 * h + q];
                    if (part) {
                        part[(size_t)blockIdx.z * n * out + (size_t)row * out + col] = v;
                    } else {
                        float *y = Y + (size_t)row * ldy + col;
                        *y = accumulate ? *y + v : v;
                    }
                }
        }
}

template <int T>
__global__ void __launch_bounds__(GQ_NT)
gemm_q_kernel(const uint8_t *__restrict__ W, const uint16_t *__restrict__ X, int n, int out, int in, int kchunk,
              int accumulate, float *__restrict__ Y, float *__restrict__ part, int ldy) {
    __shared__ __align__(16) uint16_t as[2][GQ_TM][GQ_LD];
    __shared__ __align__(16) uint16_t bs[2][GQ_TN][GQ_LD];
    k_pdl_trigger();
    k_pdl_wait();   /* X is the kernel before's output; Y / part may still be read */
    const int m0 = blockIdx.x * GQ_TM, c0 = blockIdx.y * GQ_TN, kb = blockIdx.z * kchunk;
    const int ke = min(in, kb + kchunk), nk = (ke - kb + GQ_TK - 1) / GQ_TK;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
    const size_t row_bytes = (size_t)(in / qb_elems(T)) * qb_bytes(T);
    /* X: 64 rows x 8 words of 8 per chunk, four per thread (row idx / 8, word idx % 8 for
     * idx = tid + i GQ_NT); past n or the split's end, zeros */
    auto load_x = [&](int st, int k0) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int idx = tid + i * GQ_NT, r = idx >> 3, c = (idx & 7) * 8;
            const bool ok = m0 + r < n && k0 + c < ke;
            tc_cp16(tc_smem_addr(&as[st][r][c]), ok ? X + (size_t)(m0 + r) * in + k0 + c : X, ok);
        }
        tc_commit();
    };
    /* W: a column's chunk per pair of threads (gq_decode_k45, _q6k, _32: words loaded
     * whole, decoded by the host decoders); columns past out are zeros */
    auto decode_w = [&](int st, int k0) {
        const int r = tid >> 1, h = tid & 1, col = c0 + r;
        uint16_t *dst = bs[st][r];
        if (col >= out) {
#pragma unroll
            for (int q = 0; q < 4; q++) *(uint4 *)(dst + 32 * (q >> 1) + 16 * h + 8 * (q & 1)) = make_uint4(0, 0, 0, 0);
            return;
        }
        const uint8_t *row = W + (size_t)col * row_bytes;
        if constexpr (T == QB_Q6_K) gq_decode_q6k(row, k0, h, dst);
        else if constexpr (T == QB_Q4_K || T == QB_Q5_K) gq_decode_k45<T>(row, k0, h, dst);
        else gq_decode_32<T>(row, k0, h, ke, dst);
    };
    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[mi][j][0] = acc[mi][j][1] = acc[mi][j][2] = acc[mi][j][3] = 0.f;
    /* which of the warp's two 16-row groups hold rows below n (warp-uniform) */
    const bool act0 = m0 + wm * 32 < n, act1 = m0 + wm * 32 + 16 < n;
    if (nk > 0) {
        load_x(0, kb);
        decode_w(0, kb);
    }
    for (int it = 0; it < nk; it++) {
        const int st = it & 1;
        tc_wait<0>();      /* chunk it's X has landed (this thread's copies) */
        __syncthreads();   /* ... everyone's, its W is stored, chunk it - 1 is multiplied */
        if (it + 1 < nk) {
            load_x(st ^ 1, kb + (it + 1) * GQ_TK);
            decode_w(st ^ 1, kb + (it + 1) * GQ_TK);
        }
        if (!act0) continue;
#pragma unroll
        for (int kp = 0; kp < GQ_TK / 32; kp++) {
            uint32_t a[2][2][4];   /* [k-step][row group] */
#pragma unroll
            for (int ks = 0; ks < 2; ks++)
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
                    if (mi == 0 || act1)
                        tc_ldsm4(tc_smem_addr(&as[st][wm * 32 + mi * 16 + (lane & 15)][kp * 32 + ks * 16 + (lane >> 4) * 8]),
                                 a[ks][mi][0], a[ks][mi][1], a[ks][mi][2], a[ks][mi][3]);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint32_t b0, b1, b2, b3;   /* columns 8j + (lane & 7), k 8 (lane >> 3): both k-steps */
                tc_ldsm4(tc_smem_addr(&bs[st][wn * 32 + 8 * j + (lane & 7)][kp * 32 + (lane >> 3) * 8]), b0, b1, b2, b3);
                tc_mma(acc[0][j], a[0][0], b0, b1);
                tc_mma(acc[0][j], a[1][0], b2, b3);
                if (act1) {
                    tc_mma(acc[1][j], a[0][1], b0, b1);
                    tc_mma(acc[1][j], a[1][1], b2, b3);
                }
            }
        }
    }
    gq_store_tile(acc, m0 + wm * 32, c0 + wn * 32, lane, n, out, accumulate, Y, part, ldy);
}

/* Y (+)= the splits' partial sums ([n, out] each), added in split order; Y's rows ldy apart. */
__global__ void gemm_q_reduce_kernel(const float *__restrict__ part, int splits, size_t total, int accumulate,
                                     float *__restrict__ Y, int out, int ldy) {
    k_pdl_trigger();
    k_pdl_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float *y = Y + (i / (size_t)out) * (size_t)ldy + i % (size_t)out;
    float s = accumulate ? *y : 0.f;
    for (int z = 0; z < splits; z++) s += part[(size_t)z * total + i];
    *y = s;
}

/* Splits of the reduction: enough blocks for two per multiprocessor, each split at least
 * four chunks, the partial sums within the workspace. */
static int gemm_q_splits(int tiles, int in, int n, int out, size_t ws_bytes) {
    const int nk = (in + GQ_TK - 1) / GQ_TK, sms = k_sm_count();
    if (tiles >= sms) return 1;
    int s = (2 * sms + tiles - 1) / tiles;
    if (s > nk / 4) s = nk / 4;
    const size_t per = (size_t)n * out * sizeof(float);
    if (per && (size_t)s > ws_bytes / per) s = (int)(ws_bytes / per);
    if (s > GQ_MAX_SPLIT) s = GQ_MAX_SPLIT;
    return s < 1 ? 1 : s;
}

template <int T>
static int gemm_q_launch(const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                         int accumulate, float *ws, size_t ws_bytes, cudaStream_t s) {
    const int mt = (n + GQ_TM - 1) / GQ_TM, nt = (out + GQ_TN - 1) / GQ_TN;
    int splits = gemm_q_splits(mt * nt, in, n, out, ws ? ws_bytes : 0);
    const int nk = (in + GQ_TK - 1) / GQ_TK, per = (nk + splits - 1) / splits;
    splits = (nk + per - 1) / per;   /* no empty split */
    const dim3 grid((unsigned)mt, (unsigned)nt, (unsigned)splits);
    int rc = k_launch(gemm_q_kernel<T>, grid, dim3(GQ_NT), 0, s, W, X, n, out, in, per * GQ_TK, accumulate, Y,
                      splits > 1 ? ws : (float *)NULL, ldy);
    if (rc || splits == 1) return rc;
    const size_t total = (size_t)n * out;
    return k_launch(gemm_q_reduce_kernel, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, s, (const float *)ws,
                    splits, total, accumulate, Y, out, ldy);
}

/* ---- Q8_0 with int8 activations on int8 tensor cores (k_gemm_qi8) ---------------------------
 * gemm_q_kernel's tiling (64 token rows x 64 columns per block of 4 warps, chunks of 64
 * elements double-buffered, the same split of the reduction) with X rounded to int8 per 32
 * elements by k_quant_x8 and the weights' codes stored as they are: a chunk is two Q8_0
 * blocks, each one mma m16n8k32 (s8 x s8 -> s32, exact) per 16 x 8 tile, scaled once by
 * the token's and the column's block scales into the fp32 accumulators. A column's chunk
 * is 68 bytes starting 4-byte aligned (in % 64 == 0, W 4-aligned): its two threads take a
 * block each with nine 32-bit loads (block 0's codes realigned by byte_perm), issued a
 * chunk ahead into registers; X and its scales come by cp.async. The reduction is split
 * until about k_tuning.gemm_qi8_bps blocks per multiprocessor are busy (decode batches:
 * one tile row). */
__global__ void __launch_bounds__(GQ_NT)
gemm_qi8_kernel(const uint8_t *__restrict__ W, const int8_t *__restrict__ XQ, const float2 *__restrict__ XS, int n,
                int out, int in, int kchunk, int accumulate, float *__restrict__ Y, float *__restrict__ part) {
    __shared__ __align__(16) int8_t as[2][GQ_TM][GI_LD];
    __shared__ __align__(16) int8_t bs[2][GQ_TN][GI_LD];
    __shared__ __align__(16) float4 xsd[2][GQ_TM];   /* a row's (scale, sum) of the chunk's two blocks */
    __shared__ float wsd[2][GQ_TN][2];
    k_pdl_trigger();
    k_pdl_wait();
    const int m0 = blockIdx.x * GQ_TM, c0 = blockIdx.y * GQ_TN, kb = blockIdx.z * kchunk;
    const int ke = min(in, kb + kchunk), nk = (ke - kb + GQ_TK - 1) / GQ_TK, nbk = in / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
    const size_t row_bytes = (size_t)nbk * 34;
    /* X by cp.async: 64 rows x 4 words of 16 codes per chunk, two per thread, and each row's
     * two (scale, sum) pairs (one word: nbk and the chunk's first block are even); zeros
     * past n */
    auto load_x = [&](int st, int k0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int idx = tid + i * GQ_NT, r = idx >> 2, c = (idx & 3) * 16;
            const bool ok = m0 + r < n;
            tc_cp16(tc_smem_addr(&as[st][r][c]), ok ? XQ + (size_t)(m0 + r) * in + k0 + c : XQ, ok);
        }
        if (tid < GQ_TM) {
            const bool ok = m0 + tid < n;
            tc_cp16(tc_smem_addr(&xsd[st][tid]), ok ? XS + (size_t)(m0 + tid) * nbk + (k0 >> 5) : XS, ok);
        }
        tc_commit();
    };
    /* W: column r's two blocks, thread h block h, fetched into registers a chunk ahead of
     * their store (so the loads are in flight while the chunk before is multiplied); zeros
     * past out */
    const int wr = tid >> 1, wh = tid & 1, wcol = c0 + wr;
    uint32_t wq[9];
    auto fetch_w = [&](int k0) {
        if (wcol >= out) return;
        const uint32_t *p = (const uint32_t *)(W + (size_t)wcol * row_bytes + (size_t)(k0 >> 5) * 34) + 8 * wh;
#pragma unroll
        for (int i = 0; i < 9; i++) wq[i] = __ldg(p + i);
    };
    auto store_w = [&](int st) {
        uint4 *dst = (uint4 *)&bs[st][wr][32 * wh];
        if (wcol >= out) {
            dst[0] = dst[1] = make_uint4(0, 0, 0, 0);
            wsd[st][wr][wh] = 0.f;
            return;
        }
        uint32_t q[8];
        if (wh == 0) {   /* words 0..8: d in word 0's low half, codes from byte 2 */
#pragma unroll
            for (int i = 0; i < 8; i++) q[i] = __byte_perm(wq[i], wq[i + 1], 0x5432);
            wsd[st][wr][0] = qb_half_bits((unsigned short)(wq[0] & 0xffff));
        } else {         /* words 8..16: d in word 8's high half, codes from word 9 */
#pragma unroll
            for (int i = 0; i < 8; i++) q[i] = wq[i + 1];
            wsd[st][wr][1] = qb_half_bits((unsigned short)(wq[0] >> 16));
        }
        dst[0] = make_uint4(q[0], q[1], q[2], q[3]);
        dst[1] = make_uint4(q[4], q[5], q[6], q[7]);
    };
    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[mi][j][0] = acc[mi][j][1] = acc[mi][j][2] = acc[mi][j][3] = 0.f;
    const bool act0 = m0 + wm * 32 < n, act1 = m0 + wm * 32 + 16 < n;
    const int g = lane >> 2, t4 = 4 * (lane & 3);
    if (nk > 0) {
        load_x(0, kb);
        fetch_w(kb);
        store_w(0);
        if (nk > 1) fetch_w(kb + GQ_TK);
    }
    for (int it = 0; it < nk; it++) {
        const int st = it & 1;
        tc_wait<0>();
        __syncthreads();   /* chunk it landed and stored; chunk it - 1's buffers are free */
        if (it + 1 < nk) {
            load_x(st ^ 1, kb + (it + 1) * GQ_TK);
            store_w(st ^ 1);
            if (it + 2 < nk) fetch_w(kb + (it + 2) * GQ_TK);
        }
        if (!act0) continue;
#pragma unroll
        for (int kp = 0; kp < 2; kp++) {   /* the chunk's two blocks */
            uint32_t a[2][4];
            float xd[2][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const int r = wm * 32 + mi * 16 + g;
                a[mi][0] = *(const uint32_t *)&as[st][r][kp * 32 + t4];
                a[mi][1] = *(const uint32_t *)&as[st][r + 8][kp * 32 + t4];
                a[mi][2] = *(const uint32_t *)&as[st][r][kp * 32 + 16 + t4];
                a[mi][3] = *(const uint32_t *)&as[st][r + 8][kp * 32 + 16 + t4];
                xd[mi][0] = kp ? xsd[st][r].z : xsd[st][r].x, xd[mi][1] = kp ? xsd[st][r + 8].z : xsd[st][r + 8].x;
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = wn * 32 + 8 * j;
                const uint32_t b0 = *(const uint32_t *)&bs[st][c + g][kp * 32 + t4];
                const uint32_t b1 = *(const uint32_t *)&bs[st][c + g][kp * 32 + 16 + t4];
                const float wd0 = wsd[st][c + t4 / 2][kp], wd1 = wsd[st][c + t4 / 2 + 1][kp];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    if (mi == 1 && !act1) continue;
                    int ci[4] = {0, 0, 0, 0};
                    tc_mma_s8(ci, a[mi], b0, b1);
                    acc[mi][j][0] = fmaf(xd[mi][0] * wd0, (float)ci[0], acc[mi][j][0]);
                    acc[mi][j][1] = fmaf(xd[mi][0] * wd1, (float)ci[1], acc[mi][j][1]);
                    acc[mi][j][2] = fmaf(xd[mi][1] * wd0, (float)ci[2], acc[mi][j][2]);
                    acc[mi][j][3] = fmaf(xd[mi][1] * wd1, (float)ci[3], acc[mi][j][3]);
                }
            }
        }
    }
    gq_store_tile(acc, m0 + wm * 32, c0 + wn * 32, lane, n, out, accumulate, Y, part, out);
}

extern "C" int k_gemm_qi8_takes(int type, int in) { return type == QB_Q8_0 && in > 0 && in % GQ_TK == 0; }

extern "C" int k_gemm_qi8(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n,
                          int accumulate, void *scratch, size_t scratch_bytes, cudaStream_t s) {
    const size_t need = k_x8_codes_bytes(n, in) + (size_t)n * (size_t)(in / 32) * sizeof(float2);
    if (!k_gemm_qi8_takes(type, in) || out <= 0 || n < 1 || ((uintptr_t)X % 16) || ((uintptr_t)W % 4) ||
        !scratch || ((uintptr_t)scratch % 16) || scratch_bytes < need)
        return -1;
    int rc = k_quant_x8(X, n, in, scratch, s);
    if (rc) return rc;
    const size_t ws_off = (need + 15) / 16 * 16;
    float *ws = scratch_bytes > ws_off ? (float *)((uint8_t *)scratch + ws_off) : NULL;
    const size_t ws_bytes = ws ? scratch_bytes - ws_off : 0;
    const int mt = (n + GQ_TM - 1) / GQ_TM, nt = (out + GQ_TN - 1) / GQ_TN, nk = in / GQ_TK;
    /* about k_tuning.gemm_qi8_bps blocks per multiprocessor (a block has one 64 x 64 tile and
     * 4 warps: too few bytes in flight per SM otherwise), each split at least four chunks */
    const int bps = k_tuning_get()->gemm_qi8_bps > 0 ? k_tuning_get()->gemm_qi8_bps : 8;
    int splits = (bps * k_sm_count() + mt * nt - 1) / (mt * nt);
    if (splits > nk / 4) splits = nk / 4;
    if (splits > GQ_MAX_SPLIT) splits = GQ_MAX_SPLIT;
    if ((size_t)splits * (size_t)n * out * sizeof(float) > ws_bytes) splits = (int)(ws_bytes / ((size_t)n * out * sizeof(float)));
    if (splits < 1) splits = 1;
    const int per = (nk + splits - 1) / splits;
    splits = (nk + per - 1) / per;
    const dim3 grid((unsigned)mt, (unsigned)nt, (unsigned)splits);
    rc = k_launch(gemm_qi8_kernel, grid, dim3(GQ_NT), 0, s, W, (const int8_t *)scratch,
                  (const float2 *)((uint8_t *)scratch + k_x8_codes_bytes(n, in)), n, out, in, per * GQ_TK, accumulate,
                  Y, splits > 1 ? ws : (float *)NULL);
    if (rc || splits == 1) return rc;
    const size_t total = (size_t)n * out;
    return k_launch(gemm_q_reduce_kernel, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, s, (const float *)ws,
                    splits, total, accumulate, Y, out, out);
}

extern "C" int k_gemm_q_ld(int type, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out, int in, int n,
                           int accumulate, float *ws, size_t ws_bytes, cudaStream_t s) {
    if (!qb_bytes(type) || out <= 0 || ldy < out || in <= 0 || in % qb_elems(type) || n < 1 ||
        ((uintptr_t)X % 16) || ((uintptr_t)ws % 16) ||
        (uintptr_t)W % ((type == QB_Q4_K || type == QB_Q5_K) ? 16 : 2))   /* (K4/K5 rows: whole 16-byte words) */
        return -1;
    switch (type) {
    case QB_Q8_0: return gemm_q_launch<QB_Q8_0>(W, X, Y, ldy, out, in, n, accumulate, ws, ws_bytes, s);
    case QB_Q4_0: return gemm_q_launch<QB_Q4_0>(W, X, Y, ldy, out, in, n, accumulate, ws, ws_bytes, s);
    case QB_Q4_1: return gemm_q_launch<QB_Q4_1>(W, X, Y, ldy, out, in, n, accumulate, ws, ws_bytes, s);
    case QB_Q5_K: return gemm_q_launch<QB_Q5_K>(W, X, Y, ldy, out, in, n, accumulate, ws, ws_bytes, s);
    case QB_Q4_K: return gemm_q_launch<QB_Q4_K>(W, X, Y, ldy, out, in, n, accumulate, ws, ws_bytes, s);
    case QB_Q6_K: return gemm_q_launch<QB_Q6_K>(W, X, Y, ldy, out, in, n, accumulate, ws, ws_bytes, s);
    default: return -1;
    }
}

extern "C" int k_gemm_q(int type, const uint8_t *W, const uint16_t *X, float *Y, int out, int in, int n,
                        int accumulate, float *ws, size_t ws_bytes, cudaStream_t s) {
    return k_gemm_q_ld(type, W, X, Y, out, out, in, n, accumulate, ws, ws_bytes, s);
}
