/* Host-side sampling; see sample.h. The order of processing follows HF / vLLM:
 * logit bias and penalties on raw logits, then temperature, then top-k, top-p, min-p
 * filters on the tempered distribution. */
#include "engine/core/sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

double sample_uniform(uint64_t seed, uint64_t counter) {
    uint64_t h = splitmix64(splitmix64(seed) ^ (counter * 0xd1342543de82ef95ULL + 1));
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

/* The first two steps: logit bias (in list order), then -inf for eos ids while
 * min_tokens is not reached. */
static void apply_bias_eos(float *logits, int vocab, const sample_params *p) {
    for (int i = 0; i < p->n_logit_bias; i++) {
        int id = p->logit_bias_ids[i];
        if (id >= 0 && id < vocab) logits[id] += p->logit_bias_vals[i];
    }
    if (p->suppress_eos)
        for (int i = 0; i < p->n_eos; i++)
            if (p->eos_ids[i] >= 0 && p->eos_ids[i] < vocab) logits[p->eos_ids[i]] = -INFINITY;
}

/* The penalties of one distinct token of the history with `count` generated occurrences
 * (the device sampler, kernels/sample.cu, repeats this arithmetic operation for operation). */
static float penalize(float l, int count, const sample_params *p, int rep, int add) {
    if (rep) l = l > 0 ? l / p->repetition_penalty : l * p->repetition_penalty;
    if (add && count > 0) l -= p->frequency_penalty * (float)count + p->presence_penalty;
    return l;
}

void sample_apply_penalties(float *logits, int vocab, const sample_params *p,
                            const int32_t *history, int n_history, int n_prompt, int *scratch) {
    apply_bias_eos(logits, vocab, p);
    int rep = p->repetition_penalty > 0 && p->repetition_penalty != 1.0f;
    int add = p->presence_penalty != 0 || p->frequency_penalty != 0;
    if (!rep && !add) return;
    /* scratch[id]: count among generated tokens, plus DONE once the token was handled */
    enum { DONE = 1 << 30 };
    for (int i = 0; i < n_history; i++) scratch[history[i]] = 0;
    for (int i = n_prompt; i < n_history; i++) scratch[history[i]]++;
    for (int i = 0; i < n_history; i++) {
        int id = history[i];
        if (scratch[id] & DONE) continue;
        int count = scratch[id];
        scratch[id] |= DONE;
        logits[id] = penalize(logits[id], count, p, rep, add);
    }
}

void sample_apply_penalties_sparse(float *logits, int vocab, const sample_params *p,
                                   const int32_t *ids, const int32_t *counts, int n) {
    sample_apply_penalties_fed(logits, vocab, p, ids, counts, n, -1);
}

void sample_apply_penalties_fed(float *logits, int vocab, const sample_params *p, const int32_t *ids,
                                const int32_t *counts, int n, int32_t fed) {
    apply_bias_eos(logits, vocab, p);
    int rep = p->repetition_penalty > 0 && p->repetition_penalty != 1.0f;
    int add = p->presence_penalty != 0 || p->frequency_penalty != 0;
    if (!rep && !add) return;
    int listed = 0;
    for (int j = 0; j < n; j++) {
        if (ids[j] < 0 || ids[j] >= vocab) continue;
        listed |= ids[j] == fed;
        logits[ids[j]] = penalize(logits[ids[j]], counts[j] + (ids[j] == fed), p, rep, add);
    }
    if (!listed && fed >= 0 && fed < vocab) logits[fed] = penalize(logits[fed], 1, p, rep, add);
}

int sample_stats_init(sample_stats *s, int cap) {
    memset(s, 0, sizeof *s);
    uint32_t m = 16;
    while (m < 2u * (uint32_t)(cap > 0 ? cap : 1)) m *= 2;   /* load at most 1/2 */
    s->cap = cap > 0 ? cap : 1;
    s->ids = malloc((size_t)s->cap * sizeof(int32_t));
    s->counts = malloc((size_t)s->cap * sizeof(int32_t));
    s->slots = calloc(m, sizeof(int32_t));
    s->mask = m - 1;
    if (!s->ids || !s->counts || !s->slots) {
        sample_stats_free(s);
        return -1;
    }
    return 0;
}

/* The hash slot of id: where it is listed, else the empty slot where it would go. */
static uint32_t stats_slot(const sample_stats *s, int32_t id) {
    uint32_t h = ((uint32_t)id * 2654435761u) & s->mask;
    while (s->slots[h] && s->ids[s->slots[h] - 1] != id) h = (h + 1) & s->mask;
    return h;
}

int sample_stats_find(const sample_stats *s, int32_t id) {
    return s->cap ? s->slots[stats_slot(s, id)] - 1 : -1;
}

int sample_stats_add(sample_stats *s, int32_t id, int generated) {
    const uint32_t h = stats_slot(s, id);
    if (!s->slots[h]) {
        if (s->n == s->cap) return -1;
        s->ids[s->n] = id;
        s->counts[s->n] = 0;
        s->slots[h] = ++s->n;
    }
    if (generated) s->counts[s->slots[h] - 1]++;
    return 0;
}

void sample_stats_free(sample_stats *s) {
    free(s->ids);
    free(s->counts);
    free(s->slots);
    memset(s, 0, sizeof *s);
}

int sample_argmax(const float *logits, int vocab) {
    int best = 0;
    for (int i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

/* Candidates are ordered by probability, descending, ties by id: a strict total order,
 * so "the first c" is well defined and partial selection agrees with a full sort. */
static int better(const float *v, int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); }

static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *v = ctx;
    int x = *(const int *)a, y = *(const int *)b;
    return better(v, x, y) ? -1 : better(v, y, x) ? 1 : 0;
}

/* Rearrange idx[0..n) so that idx[0..k) are its k best (in any order): quickselect, O(n).
 * Vocabularies are ~1e5 and a full sort per sampled token would cost milliseconds. */
static void select_top(const float *v, int *idx, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi && want >= lo && want <= hi) {
        int pv = idx[lo + (hi - lo) / 2], i = lo, j = hi;
        while (i <= j) {
            while (better(v, idx[i], pv)) i++;
            while (better(v, pv, idx[j])) j--;
            if (i <= j) {
                int t = idx[i];
                idx[i++] = idx[j];
                idx[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
}

/* top-k then top-p over the probability vector p (vocab entries; ids with p > 0 are the
 * candidates): zeroes every token outside the kept set. idx: vocab ints of scratch. */
static void filter_top_k_p(float *p, int vocab, int top_k, float top_p, int *idx) {
    int m = 0;
    for (int i = 0; i < vocab; i++)
        if (p[i] > 0) idx[m++] = i;
    int keep = top_k > 0 && top_k < m ? top_k : m;
    if (keep < m) select_top(p, idx, m, keep);
    if (top_p > 0 && top_p < 1.0f) {
        double tot = 0;
        for (int i = 0; i < keep; i++) tot += p[idx[i]];
        /* the smallest prefix whose mass reaches top_p (at least one token): sort a few
         * best candidates, widen only while the mass is not reached */
        for (int c = keep < 64 ? keep : 64;; c = c * 4 < keep ? c * 4 : keep) {
            select_top(p, idx, keep, c);
            qsort_r(idx, (size_t)c, sizeof(int), cmp_desc, p);
            double cum = 0;
            int j = 0;
            while (j < c && cum < top_p) cum += p[idx[j++]] / tot;
            if (cum >= top_p || c == keep) {
                keep = j < 1 ? 1 : j;
                break;
            }
        }
    }
    for (int i = keep; i < m; i++) p[idx[i]] = 0;
}

void sample_probs(float *logits, int vocab, const sample_params *p, int *scratch) {
    float inv_t = 1.0f / p->temperature;
    float mx = -INFINITY;
    for (int i = 0; i < vocab; i++) {
        logits[i] *= inv_t;
        if (logits[i] > mx) mx = logits[i];
    }
    double sum = 0;
    for (int i = 0; i < vocab; i++) {
        float e = isinf(logits[i]) && logits[i] < 0 ? 0.f : expf(logits[i] - mx);
        logits[i] = e;
        sum += e;
    }
    for (int i = 0; i < vocab; i++) logits[i] = (float)(logits[i] / sum);
    /* HF's order: temperature, top-k, top-p (over the top-k set), min-p */
    if ((p->top_k > 0 && p->top_k < vocab) || (p->top_p > 0 && p->top_p < 1.0f))
        filter_top_k_p(logits, vocab, p->top_k, p->top_p, scratch);
    if (p->min_p > 0) {
        float pmax = 0;
        for (int i = 0; i < vocab; i++) pmax = logits[i] > pmax ? logits[i] : pmax;
        float th = p->min_p * pmax;
        for (int i = 0; i < vocab; i++)
            if (logits[i] < th) logits[i] = 0;
    }
    double s = 0;
    for (int i = 0; i < vocab; i++) s += logits[i];
    if (s <= 0) return;
    for (int i = 0; i < vocab; i++) logits[i] = (float)(logits[i] / s);
}

int sample_from_probs(const float *probs, int vocab, double u) {
    double cum = 0;
    int last = -1;
    for (int i = 0; i < vocab; i++) {
        if (probs[i] <= 0) continue;
        cum += probs[i];
        last = i;
        if (u < cum) return i;
    }
    return last < 0 ? 0 : last;  /* rounding left u above the total */
}

static double logsumexp(const float *l, int vocab) {
    float mx = -INFINITY;
    for (int i = 0; i < vocab; i++) mx = l[i] > mx ? l[i] : mx;
    double s = 0;
    for (int i = 0; i < vocab; i++) s += exp((double)l[i] - mx);
    return mx + log(s);
}

float sample_logprob(const float *logits, int vocab, int token) {
    return (float)(logits[token] - logsumexp(logits, vocab));
}

int sample_rank(const float *logits, int vocab, int token) {
    int rank = 1;
    for (int v = 0; v < vocab; v++) rank += logits[v] > logits[token];
    return rank;
}

int sample_top_logprobs(const float *logits, int vocab, int n, int32_t *ids, float *lps) {
    if (n > vocab) n = vocab;
    double lse = logsumexp(logits, vocab);
    /* insertion into a small sorted list: n <= 20 */
    int k = 0;
    for (int i = 0; i < vocab; i++) {
        float v = logits[i];
        if (k == n && v <= logits[ids[k - 1]]) continue;
        int j = k < n ? k++ : n - 1;
        while (j > 0 && logits[ids[j - 1]] < v) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = i;
    }
    for (int i = 0; i < k; i++) lps[i] = (float)(logits[ids[i]] - lse);
    return k;
}
