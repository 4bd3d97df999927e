/* Host-side sampling; see sample.h. The order of processing follows HF / vLLM:
 * logit bias and penalties on raw logits, then temperature, then top-k, top-p, min-p
 * filters on the tempered distribution. */
#include "engine/sample.h"

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

void sample_apply_penalties(float *logits, int vocab, const sample_params *p,
                            const int32_t *history, int n_history, int n_prompt, int *scratch) {
    for (int i = 0; i < p->n_logit_bias; i++) {
        int id = p->logit_bias_ids[i];
        if (id >= 0 && id < vocab) logits[id] += p->logit_bias_vals[i];
    }
    if (p->suppress_eos)
        for (int i = 0; i < p->n_eos; i++)
            if (p->eos_ids[i] >= 0 && p->eos_ids[i] < vocab) logits[p->eos_ids[i]] = -INFINITY;
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
        if (rep) {
            float l = logits[id];
            logits[id] = l > 0 ? l / p->repetition_penalty : l * p->repetition_penalty;
        }
        if (add && count > 0)
            logits[id] -= p->frequency_penalty * (float)count + p->presence_penalty;
    }
}

int sample_argmax(const float *logits, int vocab) {
    int best = 0;
    for (int i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *vals = ctx;
    float x = vals[*(const int *)a], y = vals[*(const int *)b];
    if (x > y) return -1;
    if (x < y) return 1;
    return *(const int *)a - *(const int *)b;
}

/* Sort candidate ids by probability, descending. A full sort: vocabularies are ~1e5
 * and this runs once per sampled token on the host path, where the forward pass costs
 * far more. */
static void sort_desc(const float *vals, int *idx, int m) {
    qsort_r(idx, (size_t)m, sizeof(int), cmp_desc, (void *)vals);
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
    int filt_k = p->top_k > 0 && p->top_k < vocab;
    int filt_p = p->top_p > 0 && p->top_p < 1.0f;
    if (p->min_p > 0) {
        float pmax = 0;
        for (int i = 0; i < vocab; i++) pmax = logits[i] > pmax ? logits[i] : pmax;
        float th = p->min_p * pmax;
        for (int i = 0; i < vocab; i++)
            if (logits[i] < th) logits[i] = 0;
    }
    if (filt_k || filt_p) {
        int m = 0;
        for (int i = 0; i < vocab; i++)
            if (logits[i] > 0) scratch[m++] = i;
        sort_desc(logits, scratch, m);
        int keep = filt_k && p->top_k < m ? p->top_k : m;
        if (filt_p) {
            double tot = 0, cum = 0;
            for (int i = 0; i < keep; i++) tot += logits[scratch[i]];
            int j = 0;
            /* keep the smallest prefix whose mass reaches top_p (at least one token) */
            for (; j < keep; j++) {
                cum += logits[scratch[j]] / tot;
                if (cum >= p->top_p) { j++; break; }
            }
            keep = j < 1 ? 1 : j;
        }
        for (int i = keep; i < m; i++) logits[scratch[i]] = 0;
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
