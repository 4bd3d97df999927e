/* Device side of the speculative step (engine/cuda_spec.c captures it in one graph):
 * the per-step layout kernels (draft length = target length - 1, token -> slot maps,
 * the verify pass's tokens), the draft's pick (argmax, or a draw from its filtered
 * distribution q), and the acceptance kernel that decides the emitted tokens and then
 * advances both models' lengths, all from device memory so nothing per step is baked
 * into a graph.
 *
 * Random streams (same salts as engine/spec.h, passed in by the caller since kernels/
 * includes no engine header): draft draw j uses philox(seed ^ salt_draft, counter + j),
 * accept test j philox(seed ^ salt_accept, counter + j), the final draw philox(seed,
 * 2 * counter). A row is greedy when temperature <= 0 or top_k == 1 (as in k_sample). */
#include <math.h>
#include <cub/block/block_scan.cuh>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

#define SPEC_NT 512

__device__ __forceinline__ int spec_greedy(const k_sample_params &p) {
    return !(p.temperature > 0.f) || p.top_k == 1;
}

__global__ void spec_prep_kernel(int32_t *lens, const int32_t *slots, int B, int k, int dummy,
                                 int32_t *tok_slot2, int32_t *tok_slotv) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B) return;
    int s = slots[i];
    /* Dummy rows keep draft length 0 (their target length is 0: L - 1 would be -1). */
    if (s != dummy) lens[s * 2 + 1] = lens[s * 2] - 1;
    tok_slot2[2 * i] = tok_slot2[2 * i + 1] = s;
    for (int j = 0; j <= k; j++) tok_slotv[i * (k + 1) + j] = s;
}

extern "C" int k_spec_prep(int32_t *lens, const int32_t *slots, int B, int k, int dummy,
                           int32_t *tok_slot2, int32_t *tok_slotv, cudaStream_t s) {
    if (B <= 0 || k < 1) return -1;
    spec_prep_kernel<<<(B + 127) / 128, 128, 0, s>>>(lens, slots, B, k, dummy, tok_slot2, tok_slotv);
    return K_LAUNCH_RESULT();
}

__global__ void spec_verify_tokens_kernel(const int32_t *in_tokens, const int32_t *drafts, int B,
                                          int k, int ld, int32_t *vtok) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= B * (k + 1)) return;
    int i = t / (k + 1), j = t % (k + 1);
    vtok[t] = j == 0 ? in_tokens[2 * i + 1] : drafts[(size_t)(j - 1) * ld + i];
}

extern "C" int k_spec_verify_tokens(const int32_t *in_tokens, const int32_t *drafts, int B, int k,
                                    int ld, int32_t *vtok, cudaStream_t s) {
    if (B <= 0 || k < 1 || ld < B) return -1;
    int n = B * (k + 1);
    spec_verify_tokens_kernel<<<(n + 127) / 128, 128, 0, s>>>(in_tokens, drafts, B, k, ld, vtok);
    return K_LAUNCH_RESULT();
}

/* Block-wide argmax (lowest index on ties, as k_sample and sample_argmax). */
__device__ int block_argmax(const float *x, int vocab, float *wv, int *wi) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = tid; i < vocab; i += SPEC_NT) {
        float v = x[i];
        if (v > best) { best = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    __syncthreads();
    if (lane == 0) { wv[warp] = best; wi[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        best = lane < SPEC_NT / 32 ? wv[lane] : -INFINITY;
        bi = lane < SPEC_NT / 32 ? wi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) wi[0] = bi;
    }
    __syncthreads();
    int r = wi[0];
    __syncthreads();
    return r < vocab ? r : 0;
}

/* Weight of token v in a draw: p[v] (mode 0) or max(0, p[v] - q[v]) (mode 1). */
__device__ __forceinline__ float spec_w(const float *p, const float *q, int v, int mode) {
    if (mode == 0) return p[v];
    float r = p[v] - q[v];
    return r > 0.f ? r : 0.f;
}

/* Draw one token from the weights (unnormalised) in index order at u * total; returns
 * the token and the total mass through *total_out (every thread). */
__device__ int block_draw(const float *p, const float *q, int vocab, int mode, float u,
                          float *total_out) {
    typedef cub::BlockScan<float, SPEC_NT> Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ int pick_s;
    __shared__ int lk_s[SPEC_NT / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int chunk = (vocab + SPEC_NT - 1) / SPEC_NT;
    const int i0 = tid * chunk, i1 = min(vocab, i0 + chunk);
    float local = 0.f;
    int last = -1;
    for (int i = i0; i < i1; i++) {
        float w = spec_w(p, q, i, mode);
        if (w > 0.f) { local += w; last = i; }
    }
    float excl, total;
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(local, excl, total);
    if (tid == 0) pick_s = -1;
    __syncthreads();
    *total_out = total;
    const float ut = u * total;
    if (local > 0.f && ut >= excl && ut < excl + local) {
        float c = excl;
        int pick = last;
        for (int i = i0; i < i1; i++) {
            c += spec_w(p, q, i, mode);
            if (ut < c) { pick = i; break; }
        }
        pick_s = pick;
    }
    __syncthreads();
    if (pick_s < 0) {
        /* u * total fell past the float sum by rounding: the last token with mass. */
        int lk = last;
        for (int o = 16; o > 0; o >>= 1) lk = max(lk, __shfl_xor_sync(0xffffffffu, lk, o));
        if (lane == 0) lk_s[warp] = lk;
        __syncthreads();
        if (tid == 0) {
            int m = -1;
            for (int w = 0; w < SPEC_NT / 32; w++) m = max(m, lk_s[w]);
            pick_s = m >= 0 ? m : 0;
        }
    }
    __syncthreads();
    int r = pick_s;
    __syncthreads();
    return r;
}

__global__ void __launch_bounds__(SPEC_NT)
spec_draft_pick_kernel(const float *logits, const float *q, int vocab,
                       const k_sample_params *params, int j, uint64_t salt_draft, int32_t *out) {
    __shared__ float wv[32];
    __shared__ int wi[32];
    const int row = blockIdx.x;
    const k_sample_params p = params[row];
    int tok;
    if (spec_greedy(p)) {
        tok = block_argmax(logits + (size_t)row * vocab, vocab, wv, wi);
    } else {
        float tot;
        float u = k_philox_u01(p.seed ^ salt_draft, p.counter + (uint64_t)j);
        tok = block_draw(q + (size_t)row * vocab, NULL, vocab, 0, u, &tot);
    }
    if (threadIdx.x == 0) out[row] = tok;
}

extern "C" int k_spec_draft_pick(const float *logits, const float *q, int B, int vocab,
                                 const k_sample_params *params, int j, uint64_t salt_draft,
                                 int32_t *out, cudaStream_t s) {
    if (B <= 0 || vocab <= 0 || j < 0) return -1;
    spec_draft_pick_kernel<<<B, SPEC_NT, 0, s>>>(logits, q, vocab, params, j, salt_draft, out);
    return K_LAUNCH_RESULT();
}

__global__ void __launch_bounds__(SPEC_NT)
spec_accept_kernel(const float *tl, const float *q, int vocab, int k, int ldq,
                   const int32_t *drafts, int ldd, const k_sample_params *params,
                   const int32_t *slots, int dummy, uint64_t salt_accept, int32_t *lens,
                   int32_t *out_tok, int32_t *out_n) {
    __shared__ float wv[32];
    __shared__ int wi[32];
    const int row = blockIdx.x;
    const k_sample_params p = params[row];
    const float *t0 = tl + (size_t)row * (k + 1) * vocab;
    int32_t *o = out_tok + (size_t)row * (k + 1);
    int m = 0;
    if (spec_greedy(p)) {
        /* Longest prefix where the target's argmax equals the draft, then its token. */
        for (int j = 0; j <= k; j++) {
            int t = block_argmax(t0 + (size_t)j * vocab, vocab, wv, wi);
            if (threadIdx.x == 0) o[j] = t;
            if (j == k || t != drafts[(size_t)j * ldd + row]) { m = j + 1; break; }
        }
    } else {
        /* tl holds probabilities here (k_probs ran in place on sampled rows). */
        const float u_res = k_philox_u01(p.seed, 2 * p.counter);
        int j = 0;
        for (; j < k; j++) {
            const float *pj = t0 + (size_t)j * vocab;
            const float *qj = q + ((size_t)j * ldq + row) * vocab;
            int d = drafts[(size_t)j * ldd + row];
            float qd = qj[d], pd = pj[d];
            float ratio = qd > 0.f ? pd / qd : 0.f;
            float u = k_philox_u01(p.seed ^ salt_accept, p.counter + (uint64_t)j);
            if (u < ratio) {
                if (threadIdx.x == 0) o[j] = d;
                continue;
            }
            float tot;
            int t = block_draw(pj, qj, vocab, 1, u_res, &tot);
            /* p == q up to rounding: the residual is empty and p itself is exact. */
            if (!(tot > 0.f)) t = block_draw(pj, NULL, vocab, 0, u_res, &tot);
            if (threadIdx.x == 0) o[j] = t;
            break;
        }
        if (j == k) {
            float tot;
            int t = block_draw(t0 + (size_t)k * vocab, NULL, vocab, 0, u_res, &tot);
            if (threadIdx.x == 0) o[k] = t;
        }
        m = j + 1;
    }
    if (threadIdx.x == 0) {
        out_n[row] = m;
        int s = slots[row];
        if (s != dummy) {
            int L = lens[s * 2];   /* the verify pass does not advance it */
            lens[s * 2] = L + m;
            lens[s * 2 + 1] = min(L + k, L + m);
        }
    }
}

extern "C" int k_spec_accept(const float *tl, const float *q, int B, int vocab, int k, int ldq,
                             const int32_t *drafts, int ldd, const k_sample_params *params,
                             const int32_t *slots, int dummy, uint64_t salt_accept, int32_t *lens,
                             int32_t *out_tok, int32_t *out_n, cudaStream_t s) {
    if (B <= 0 || vocab <= 0 || k < 1 || ldq < B || ldd < B) return -1;
    spec_accept_kernel<<<B, SPEC_NT, 0, s>>>(tl, q, vocab, k, ldq, drafts, ldd, params, slots, dummy,
                                             salt_accept, lens, out_tok, out_n);
    return K_LAUNCH_RESULT();
}
