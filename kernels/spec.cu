/* Device side of the speculative step (engine/cuda/cuda_spec.c captures it in one graph):
 * the per-step layout kernels (draft length = target length - 1, token -> slot maps,
 * the verify pass's tokens), the draft's pick (argmax, or a draw from its filtered
 * distribution q), and the acceptance kernel that decides the emitted tokens and then
 * advances both models' lengths, all from device memory so nothing per step is baked
 * into a graph.
 *
 * Random streams (same salts as engine/core/spec.h, passed in by the caller since kernels/
 * includes no engine header): draft draw j uses philox(seed ^ salt_draft, counter + j),
 * accept test j philox(seed ^ salt_accept, counter + j), the final draw philox(seed,
 * 2 * counter). A row is greedy when temperature <= 0 or top_k == 1 (as in k_sample). */
#include <math.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/sample.cuh"

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

/* One thread per row: a row that continues row pr of the speculative step before takes
 * that row's last two tokens (of its fed last token, vtok's first, and the m it emitted)
 * and its sampling counter moves on by m. */
__global__ void spec_feed_prev_kernel(int32_t *tokens, k_sample_params *par, const int32_t *prev,
                                      const int32_t *prev_out, const int32_t *prev_n, const int32_t *prev_vtok,
                                      int K1, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || prev[i] < 0) return;
    const int pr = prev[i];
    int m = prev_n[pr];
    m = m < 1 ? 1 : m > K1 ? K1 : m;   /* (the host checks it when the step is waited for) */
    const int32_t *o = prev_out + (size_t)pr * K1;
    tokens[2 * i] = m >= 2 ? o[m - 2] : prev_vtok[(size_t)pr * K1];
    tokens[2 * i + 1] = o[m - 1];
    par[i].counter += (uint64_t)m;
}

extern "C" int k_spec_feed_prev(int32_t *tokens, k_sample_params *par, const int32_t *prev, const int32_t *prev_out,
                                const int32_t *prev_n, const int32_t *prev_vtok, int K1, int n, cudaStream_t s) {
    if (n < 0 || K1 < 2) return -1;
    if (n == 0) return 0;
    spec_feed_prev_kernel<<<(n + 127) / 128, 128, 0, s>>>(tokens, par, prev, prev_out, prev_n, prev_vtok, K1, n);
    return K_LAUNCH_RESULT();
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

/* Block-wide argmax (lowest index on ties, as k_sample and sample_argmax); an all-NaN
 * row gives token 0. vec: k_tuning.sample_vec (sample.cuh sample_row_visit). */
__device__ int block_argmax(const float *x, int vocab, float *wv, int *wi, bool vec) {
    int r = sample_block_argmax<SPEC_NT>(x, vocab, wv, wi, NULL, vec);
    return r < vocab ? r : 0;
}

/* Weight of token v in a draw: p[v] (mode 0) or max(0, p[v] - q[v]) (mode 1). */
__device__ __forceinline__ float spec_w(const float *p, const float *q, int v, int mode) {
    if (mode == 0) return p[v];
    float r = p[v] - q[v];
    return r > 0.f ? r : 0.f;
}

/* The weights of a draw as sample_block_draw takes them: a token is in the draw when its
 * weight is positive. */
struct spec_weight {
    const float *p, *q;
    int mode;
    __device__ __forceinline__ bool operator()(int v, float &w) const {
        w = spec_w(p, q, v, mode);
        return w > 0.f;
    }
};

/* Draw one token from the weights (unnormalised) in index order at u * total; returns
 * the token and the total mass through *total_out (every thread). */
__device__ int block_draw(const float *p, const float *q, int vocab, int mode, float u,
                          float *total_out) {
    const spec_weight wt = {p, q, mode};
    return sample_block_draw<SPEC_NT>(vocab, wt, u, 0, total_out);
}

__global__ void __launch_bounds__(SPEC_NT)
spec_draft_pick_kernel(const float *logits, const float *q, int vocab,
                       const k_sample_params *params, int j, uint64_t salt_draft, int32_t *out, int vec) {
    __shared__ float wv[32];
    __shared__ int wi[32];
    const int row = blockIdx.x;
    const k_sample_params p = params[row];
    int tok;
    if (spec_greedy(p)) {
        tok = block_argmax(logits + (size_t)row * vocab, vocab, wv, wi, vec);
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
    spec_draft_pick_kernel<<<B, SPEC_NT, 0, s>>>(logits, q, vocab, params, j, salt_draft, out,
                                                 k_tuning_get()->sample_vec);
    return K_LAUNCH_RESULT();
}

__global__ void __launch_bounds__(SPEC_NT)
spec_accept_kernel(const float *tl, const float *q, int vocab, int k, int ldq,
                   const int32_t *drafts, int ldd, const k_sample_params *params,
                   const int32_t *slots, int dummy, uint64_t salt_accept, int32_t *lens,
                   int32_t *out_tok, int32_t *out_n, int vec) {
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
            int t = block_argmax(t0 + (size_t)j * vocab, vocab, wv, wi, vec);
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
                                             salt_accept, lens, out_tok, out_n, k_tuning_get()->sample_vec);
    return K_LAUNCH_RESULT();
}

/* ---- verify of drafts proposed outside the runner (prompt lookup) --------------------- */

__global__ void verify_prep_kernel(const int32_t *slots, int B, int K1, int32_t *tok_slot) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < B * K1) tok_slot[t] = slots[t / K1];
}

extern "C" int k_verify_prep(const int32_t *slots, int B, int K1, int32_t *tok_slot, cudaStream_t s) {
    if (B <= 0 || K1 < 2) return -1;
    int n = B * K1;
    verify_prep_kernel<<<(n + 127) / 128, 128, 0, s>>>(slots, B, K1, tok_slot);
    return K_LAUNCH_RESULT();
}

/* Point-mass acceptance (engine/core/spec.h spec_accept_point): the target's own token x_j
 * at every position j (its argmax, or a draw from p_j at philox(seed, counter + j), the
 * uniform the decode sampler uses for that output position), draft j standing while
 * x_j == d_j; the first x_j that differs, or x_nd, ends the row. */
__global__ void __launch_bounds__(SPEC_NT)
verify_accept_kernel(const float *tl, int vocab, int K1, const int32_t *tokens, const int32_t *n_drafts,
                     const k_sample_params *params, const int32_t *slots, int dummy, int32_t *lens,
                     int32_t *out_tok, int32_t *out_n, int vec) {
    __shared__ float wv[32];
    __shared__ int wi[32];
    const int row = blockIdx.x;
    const k_sample_params p = params[row];
    const float *t0 = tl + (size_t)row * K1 * vocab;
    const int32_t *d = tokens + (size_t)row * K1 + 1;   /* drafts follow the fed token */
    int32_t *o = out_tok + (size_t)row * K1;
    const int nd = min(max(n_drafts[row], 0), K1 - 1), greedy = spec_greedy(p);
    int j = 0;
    for (;; j++) {
        /* sampled rows: tl holds probabilities (k_probs ran in place) */
        const float *pj = t0 + (size_t)j * vocab;
        float tot;
        const int t = greedy ? block_argmax(pj, vocab, wv, wi, vec)
                             : block_draw(pj, NULL, vocab, 0, k_philox_u01(p.seed, p.counter + (uint64_t)j), &tot);
        if (threadIdx.x == 0) o[j] = t;
        if (j == nd || t != d[j]) break;
    }
    const int m = j + 1;
    if (threadIdx.x == 0) {
        out_n[row] = m;
        int s = slots[row];
        if (s != dummy) lens[s * 2] += m;   /* the verify pass does not advance it */
    }
}

extern "C" int k_verify_accept(const float *tl, int B, int vocab, int K1, const int32_t *tokens,
                               const int32_t *n_drafts, const k_sample_params *params,
                               const int32_t *slots, int dummy, int32_t *lens, int32_t *out_tok,
                               int32_t *out_n, cudaStream_t s) {
    if (B <= 0 || vocab <= 0 || K1 < 2) return -1;
    verify_accept_kernel<<<B, SPEC_NT, 0, s>>>(tl, vocab, K1, tokens, n_drafts, params, slots, dummy, lens,
                                               out_tok, out_n, k_tuning_get()->sample_vec);
    return K_LAUNCH_RESULT();
}
