/* Speculative acceptance rules; see spec.h for the contract. */
#include "engine/core/spec.h"

#include "engine/core/sample.h"

int spec_accept_greedy(const float *target_logits, int vocab, const int32_t *drafts, int k,
                       int32_t *out) {
    int n = 0;
    for (; n < k; n++) {
        int t = sample_argmax(target_logits + (size_t)n * vocab, vocab);
        if (t != drafts[n]) break;
        out[n] = t;
    }
    out[n] = sample_argmax(target_logits + (size_t)n * vocab, vocab);
    return n + 1;
}

int spec_accept_sample(const float *p, const float *q, int vocab, const int32_t *drafts, int k,
                       const double *u_accept, double u_resample, float *residual,
                       int skip_accept_test, int32_t *out) {
    for (int i = 0; i < k; i++) {
        const float *pi = p + (size_t)i * vocab, *qi = q + (size_t)i * vocab;
        int d = drafts[i];
        double ratio = qi[d] > 0 ? (double)pi[d] / qi[d] : 0.0;
        if (skip_accept_test || u_accept[i] < ratio) {
            out[i] = d;
            continue;
        }
        /* rejected: draw from normalise(max(0, p - q)) */
        double tot = 0;
        for (int v = 0; v < vocab; v++) {
            float r = pi[v] - qi[v];
            residual[v] = r > 0 ? r : 0;
            tot += residual[v];
        }
        if (tot <= 0) { /* p == q up to rounding: the residual is empty, p itself is exact */
            out[i] = sample_from_probs(pi, vocab, u_resample);
            return i + 1;
        }
        for (int v = 0; v < vocab; v++) residual[v] = (float)(residual[v] / tot);
        out[i] = sample_from_probs(residual, vocab, u_resample);
        return i + 1;
    }
    out[k] = sample_from_probs(p + (size_t)k * vocab, vocab, u_resample);
    return k + 1;
}

int spec_accept_draws(const int32_t *x, const int32_t *drafts, int k, int32_t *out) {
    int n = 0;
    while (n < k && x[n] == drafts[n]) {
        out[n] = x[n];
        n++;
    }
    out[n] = x[n];
    return n + 1;
}

void spec_point_uniforms(uint64_t seed, uint64_t counter, int k, double *u) {
    for (int j = 0; j <= k; j++) u[j] = sample_uniform(seed, 2 * (counter + (uint64_t)j));
}

int spec_accept_point(const float *p, int vocab, const int32_t *drafts, int k, const double *u, int32_t *out) {
    int n = 0;
    for (;; n++) {
        out[n] = sample_from_probs(p + (size_t)n * vocab, vocab, u[n]);
        if (n == k || out[n] != drafts[n]) return n + 1;
    }
}
