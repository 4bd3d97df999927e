/* On-device token selection: greedy argmax or seeded sampling with temperature, top-k,
 * top-p and min-p, one block per row. Thresholds are found without sorting: top-k and
 * top-p by a 4-pass 8-bit radix select over an order-preserving integer key of the fp32
 * logit (the k-th largest key, and the key where the descending mass crosses top_p),
 * min-p directly. The draw is u * (kept mass) located by a block-wide prefix sum in index
 * order, with u from Philox4x32-10 at (seed, counter), so a request with a fixed seed
 * draws the same tokens on every run and batch composition. The block-wide pieces (argmax,
 * thresholds, draw) are in sample.cuh, which spec.cu's draft pick and acceptance share.
 *
 * Before the selection a row's sparse logit adjustments (logit bias, suppressed ids,
 * penalties over its token statistics) are written into the row in place, each entry
 * keeping the value it replaced; after it they are undone in reverse order, so the chosen
 * token's logprob and the top logprobs are of the row as it came, and so is the row. */
#include <math.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/sample.cuh"

#define SAMPLE_NT 512

/* Whether entry j is the first of adj[lo, j] with its id (an id listed twice is applied by
 * its first entry alone, so no two threads write one logit). */
static __device__ __forceinline__ bool first_of(const k_logit_adj *adj, int lo, int j, int32_t id) {
    for (int q = lo; q < j; q++)
        if (adj[q].id == id) return false;
    return true;
}

/* A penalised logit (engine/core/sample.c's penalize, rounded the same); *saved gets the
 * logit it replaces. */
static __device__ __forceinline__ float penalize(float old, float count, const k_sample_params &p, bool use_rep,
                                                 bool use_add, float *saved) {
    float l = old;
    if (use_rep) l = l > 0.f ? __fdiv_rn(l, p.repetition) : __fmul_rn(l, p.repetition);
    if (use_add && count > 0.f) l = __fsub_rn(l, __fadd_rn(__fmul_rn(p.frequency, count), p.presence));
    *saved = old;
    return l;
}

/* The row's adjustments in place, in engine/core/sample.c's order and arithmetic (the
 * intrinsics keep the compiler from fusing a multiply and an add, which the host does
 * not). Each applying entry's v becomes the logit it replaced. Ends with a barrier. */
template <int NT>
__device__ void adjust_row(float *x, int vocab, const k_sample_params &p) {
    k_logit_adj *a = p.adj;
    const int nb = p.n_bias, ns = p.n_suppress, nst = p.n_stats;
    /* 1. bias: the first entry of an id adds all of that id's biases, in list order */
    for (int j = threadIdx.x; j < nb; j += NT) {
        const int32_t id = a[j].id;
        if (id < 0 || id >= vocab || !first_of(a, 0, j, id)) continue;
        const float old = x[id];
        float l = old;
        for (int q = j; q < nb; q++)
            if (a[q].id == id) l = __fadd_rn(l, a[q].v);
        x[id] = l;
        a[j].v = old;   /* read by no other thread: only j's thread reads id's entries */
    }
    __syncthreads();
    /* 2. suppressed ids (eos before min_tokens) */
    for (int j = threadIdx.x; j < ns; j += NT) {
        const int32_t id = a[nb + j].id;
        if (id < 0 || id >= vocab || !first_of(a, nb, nb + j, id)) continue;
        a[nb + j].v = x[id];
        x[id] = -INFINITY;
    }
    __syncthreads();
    /* 3. penalties over the token statistics (distinct ids); with p.fed the last entry is a
     * placeholder for the token the row was fed: a listed id's count + 1, else the
     * placeholder becomes that id with count 1 (id -1 when it applies nothing) */
    const float rep = p.repetition;
    const bool use_rep = rep > 0.f && rep != 1.f, use_add = p.presence != 0.f || p.frequency != 0.f;
    const int32_t fed = p.fed ? *p.fed : -1;
    const int listed_n = p.fed ? nst - 1 : nst;
    __shared__ int fed_listed;
    if (threadIdx.x == 0) fed_listed = 0;
    __syncthreads();
    for (int j = threadIdx.x; (use_rep || use_add) && j < listed_n; j += NT) {
        k_logit_adj *e = &a[nb + ns + j];
        if (e->id < 0 || e->id >= vocab) continue;
        if (e->id == fed) fed_listed = 1;
        x[e->id] = penalize(x[e->id], e->v + (e->id == fed ? 1.f : 0.f), p, use_rep, use_add, &e->v);
    }
    __syncthreads();
    if (p.fed && threadIdx.x == 0) {
        k_logit_adj *e = &a[nb + ns + nst - 1];
        e->id = -1;
        if ((use_rep || use_add) && !fed_listed && fed >= 0 && fed < vocab) {
            e->id = fed;
            x[fed] = penalize(x[fed], 1.f, p, use_rep, use_add, &e->v);
        }
    }
    __syncthreads();
}

/* adjust_row undone: each applying entry writes back the value it replaced, the phases in
 * reverse, so the row ends as it was. Ends with a barrier. */
template <int NT>
__device__ void restore_row(float *x, int vocab, const k_sample_params &p) {
    const k_logit_adj *a = p.adj;
    const int nb = p.n_bias, ns = p.n_suppress, nst = p.n_stats;
    const bool use = (p.repetition > 0.f && p.repetition != 1.f) || p.presence != 0.f || p.frequency != 0.f;
    for (int j = threadIdx.x; use && j < nst; j += NT) {
        const int32_t id = a[nb + ns + j].id;
        if (id >= 0 && id < vocab) x[id] = a[nb + ns + j].v;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < ns; j += NT) {
        const int32_t id = a[nb + j].id;
        if (id >= 0 && id < vocab && first_of(a, nb, nb + j, id)) x[id] = a[nb + j].v;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < nb; j += NT) {
        const int32_t id = a[j].id;
        if (id >= 0 && id < vocab && first_of(a, 0, j, id)) x[id] = a[j].v;
    }
    __syncthreads();
}

static __device__ __forceinline__ bool has_adjust(const k_sample_params &p) {
    return p.adj && p.n_bias + p.n_suppress + p.n_stats > 0;
}

/* Block-wide max of x (every thread gets it); red: 32 floats of shared memory; vec:
 * sample_row_visit's. */
template <int NT>
__device__ __forceinline__ float block_max(const float *x, int vocab, float *red, bool vec) {
    float m = -INFINITY;
    sample_row_visit<NT>(x, vocab, vec, [&](float v, int) { m = fmaxf(m, v); });
    m = k_warp_max(m);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = (threadIdx.x & 31) < NT / 32 ? red[threadIdx.x & 31] : -INFINITY;
    return k_warp_max(m);
}

/* log sum_i exp(x_i - xmax) over the row (every thread gets it); red as block_max's. */
template <int NT>
__device__ __forceinline__ float row_log_se(const float *x, int vocab, float xmax, float *red, bool vec) {
    float se = 0.f;
    sample_row_visit<NT>(x, vocab, vec, [&](float v, int) { se += __expf(v - xmax); });
    return logf(k_block_sum(se, red));
}

/* The n (<= K_MAX_TOP, <= vocab) largest values of x, descending, ties to the lower id,
 * as ids and logprobs (x_i - xmax) - log_se. The key of the n-th largest value (counting
 * repeats) by radix select; then, in index order over contiguous chunks, every value
 * above that key and the first (n - those) equal to it. hist: 256 floats of shared memory. */
template <int NT>
__device__ void top_n(const float *x, int vocab, int n, float xmax, float log_se, float *hist,
                      int32_t *out_ids, float *out_lps, bool agg, bool vec) {
    typedef cub::BlockScan<int, NT> Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ int32_t ids_s[K_MAX_TOP];
    __shared__ float val_s[K_MAX_TOP];
    const uint32_t thr = radix_select(x, vocab, 0, (float)n, 0, 0.f, 0.f, hist, agg);
    /* (with vec the chunks are whole 16-byte words: sample_chunk_visit's loads) */
    const bool v4 = vec && (uintptr_t)x % 16 == 0;
    const int chunk = v4 ? ((vocab + NT - 1) / NT + 3) / 4 * 4 : (vocab + NT - 1) / NT;
    const int i0 = min(vocab, (int)threadIdx.x * chunk), i1 = min(vocab, i0 + chunk);
    int gt = 0, eq = 0;
    sample_chunk_visit(x, i0, i1, v4, [&](float v, int) {
        const uint32_t k = f2key(v);
        gt += k > thr;
        eq += k == thr;
    });
    int gt_ex, gt_tot, eq_ex, eq_tot;
    Scan(scan_tmp).ExclusiveSum(gt, gt_ex, gt_tot);
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(eq, eq_ex, eq_tot);
    const int need = n - gt_tot;   /* >= 1: fewer than n values lie above the n-th's key */
    if (gt > 0 || (eq > 0 && eq_ex < need)) {
        int g = gt_ex, q = eq_ex;
        sample_chunk_visit(x, i0, i1, v4, [&](float v, int i) {
            const uint32_t k = f2key(v);
            if (k > thr) {
                ids_s[g] = i;
                val_s[g++] = v;
            } else if (k == thr && q < need) {
                ids_s[gt_tot + q] = i;
                val_s[gt_tot + q++] = v;
            }
        });
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int a = 1; a < n; a++) {   /* insertion sort: value desc, id asc */
            const int32_t id = ids_s[a];
            const float v = val_s[a];
            int b = a;
            for (; b > 0 && (val_s[b - 1] < v || (val_s[b - 1] == v && ids_s[b - 1] > id)); b--) {
                ids_s[b] = ids_s[b - 1];
                val_s[b] = val_s[b - 1];
            }
            ids_s[b] = id;
            val_s[b] = v;
        }
        for (int a = 0; a < n; a++) {
            out_ids[a] = ids_s[a];
            out_lps[a] = val_s[a] - xmax - log_se;
        }
    }
    __syncthreads();
}

__global__ void __launch_bounds__(SAMPLE_NT)
sample_kernel(float *logits, int vocab, const k_sample_params *params, int32_t *out_tok, float *out_logprob,
              int32_t *out_top_ids, float *out_top_lps, int32_t *out_rank, const uint32_t *mask, const int32_t *has,
              int agg, int vec) {
    __shared__ float hist[256];
    __shared__ float red[32];
    __shared__ float wv[32];
    __shared__ int wi[32];

    const int row = blockIdx.x, tid = threadIdx.x;
    float *x = logits + (size_t)row * vocab;
    const k_sample_params p = params[row];
    const bool adjusted = !p.force && has_adjust(p);
    const int n_top = out_top_ids && out_top_lps ? min(min(p.n_top, K_MAX_TOP), vocab) : 0;

    /* -1. a grammar mask (k_sample_masked): the row's log-sum-exp and top logprobs first,
     * of its logits as they came, then every token its mask leaves out to -inf, in place */
    const bool masked = mask && has[row];
    float raw_max = 0.f, raw_lse = 0.f;
    if (masked) {
        raw_max = block_max<SAMPLE_NT>(x, vocab, red, vec);
        raw_lse = row_log_se<SAMPLE_NT>(x, vocab, raw_max, red, vec);
        if (n_top > 0)
            top_n<SAMPLE_NT>(x, vocab, n_top, raw_max, raw_lse, hist, out_top_ids + (size_t)row * K_MAX_TOP,
                             out_top_lps + (size_t)row * K_MAX_TOP, agg, vec);
        const uint32_t *mr = mask + (size_t)row * (((size_t)vocab + 31) / 32);
        for (int i = tid; i < vocab; i += SAMPLE_NT)
            if (!((mr[i >> 5] >> (i & 31)) & 1u)) x[i] = -INFINITY;
        __syncthreads();
    }

    /* 0. the adjustments, in place */
    if (adjusted) adjust_row<SAMPLE_NT>(x, vocab, p);

    /* 1. max + argmax (lowest index on ties), then the draw. */
    float xmax;
    const int argmax = sample_block_argmax<SAMPLE_NT>(x, vocab, wv, wi, &xmax, vec);

    int tok = p.force ? p.force_tok : argmax;
    const int greedy = !(p.temperature > 0.f) || p.top_k == 1;
    if (!greedy && !p.force) {
        const sample_keep keep = sample_kept_set<SAMPLE_NT>(x, vocab, p, xmax, hist, red, agg);
        float total;
        tok = sample_block_draw<SAMPLE_NT>(vocab, keep, k_philox_u01(p.seed, p.counter), argmax, &total);
    }

    /* 2. the row as it came: the logprob and the top logprobs are of it */
    if (adjusted) {
        restore_row<SAMPLE_NT>(x, vocab, p);
        xmax = block_max<SAMPLE_NT>(x, vocab, red, vec);
    }
    if (masked) {   /* the chosen token is one the mask keeps: its logit is as it came */
        if (out_logprob && tid == 0) out_logprob[row] = x[tok] - raw_max - raw_lse;
    } else if (out_logprob || n_top > 0) {
        const float log_se = row_log_se<SAMPLE_NT>(x, vocab, xmax, red, vec);
        if (out_logprob && tid == 0) out_logprob[row] = x[tok] - xmax - log_se;
        if (n_top > 0)
            top_n<SAMPLE_NT>(x, vocab, n_top, xmax, log_se, hist, out_top_ids + (size_t)row * K_MAX_TOP,
                             out_top_lps + (size_t)row * K_MAX_TOP, agg, vec);
    }
    if (p.force && out_rank) {   /* (a count below 2^24: exact in a float sum) */
        const float xt = x[tok];
        float above = 0.f;
        for (int i = tid; i < vocab; i += SAMPLE_NT) above += x[i] > xt ? 1.f : 0.f;
        above = k_block_sum(above, red);
        if (tid == 0) out_rank[row] = 1 + (int32_t)above;
    }
    if (tid == 0) out_tok[row] = tok;
}

extern "C" int k_sample_masked(float *logits, int n, int vocab, const k_sample_params *p, const uint32_t *mask,
                               const int32_t *has, int32_t *out_tok, float *out_logprob, int32_t *out_top_ids,
                               float *out_top_lps, int32_t *out_rank, cudaStream_t s) {
    if (n < 0 || vocab <= 0 || (mask && !has)) return -1;
    if (n == 0) return 0;
    sample_kernel<<<n, SAMPLE_NT, 0, s>>>(logits, vocab, p, out_tok, out_logprob, out_top_ids, out_top_lps, out_rank,
                                          mask, has, k_tuning_get()->sample_hist,
                                          k_tuning_get()->sample_vec);
    return K_LAUNCH_RESULT();
}

extern "C" int k_sample(float *logits, int n, int vocab, const k_sample_params *p, int32_t *out_tok,
                        float *out_logprob, int32_t *out_top_ids, float *out_top_lps, int32_t *out_rank,
                        cudaStream_t s) {
    return k_sample_masked(logits, n, vocab, p, NULL, NULL, out_tok, out_logprob, out_top_ids, out_top_lps, out_rank,
                           s);
}

__global__ void __launch_bounds__(SAMPLE_NT)
adjust_kernel(float *logits, int vocab, const k_sample_params *params) {
    const k_sample_params p = params[blockIdx.x];
    if (has_adjust(p)) adjust_row<SAMPLE_NT>(logits + (size_t)blockIdx.x * vocab, vocab, p);
}

extern "C" int k_logit_adjust(float *logits, int n, int vocab, const k_sample_params *p, cudaStream_t s) {
    if (n < 0 || vocab <= 0) return -1;
    if (n == 0) return 0;
    adjust_kernel<<<n, SAMPLE_NT, 0, s>>>(logits, vocab, p);
    return K_LAUNCH_RESULT();
}

/* The distribution sample_kernel draws from, written out: probs[r, i] = exp((x_i -
 * xmax) / T) / kept mass for kept tokens, else 0. Rows whose parameters are greedy are
 * left untouched (the speculative step reads their logits with an argmax). probs may
 * alias logits: each block reads its row fully before it writes. */
__global__ void __launch_bounds__(SAMPLE_NT)
probs_kernel(const float *logits, float *probs, int vocab, const k_sample_params *params,
             int rows_per_param, int agg) {
    __shared__ float hist[256];
    __shared__ float red[32];
    const int row = blockIdx.x, tid = threadIdx.x;
    const k_sample_params p = params[row / rows_per_param];
    if (!(p.temperature > 0.f) || p.top_k == 1) return;
    const float *x = logits + (size_t)row * vocab;
    float *y = probs + (size_t)row * vocab;
    float m = -INFINITY;
    for (int i = tid; i < vocab; i += SAMPLE_NT) m = fmaxf(m, x[i]);
    m = k_warp_max(m);
    __syncthreads();
    if ((tid & 31) == 0) red[tid >> 5] = m;
    __syncthreads();
    m = (tid & 31) < SAMPLE_NT / 32 ? red[tid & 31] : -INFINITY;
    const float xmax = k_warp_max(m);
    __syncthreads();
    const sample_keep keep = sample_kept_set<SAMPLE_NT>(x, vocab, p, xmax, hist, red, agg);
    float tot = 0.f;
    for (int i = tid; i < vocab; i += SAMPLE_NT) {
        float z = keep.z(x[i]);
        if (keep.kept(x[i], z)) tot += __expf(z);
    }
    tot = k_block_sum(tot, red);
    __syncthreads();
    const float inv = 1.f / tot;
    for (int i = tid; i < vocab; i += SAMPLE_NT) {
        float xi = x[i], z = keep.z(xi);
        y[i] = keep.kept(xi, z) ? __expf(z) * inv : 0.f;
    }
}

extern "C" int k_probs(const float *logits, float *probs, int n, int vocab,
                       const k_sample_params *p, int rows_per_param, cudaStream_t s) {
    if (n < 0 || vocab <= 0 || rows_per_param < 1) return -1;
    if (n == 0) return 0;
    probs_kernel<<<n, SAMPLE_NT, 0, s>>>(logits, probs, vocab, p, rows_per_param, k_tuning_get()->sample_hist);
    return K_LAUNCH_RESULT();
}
