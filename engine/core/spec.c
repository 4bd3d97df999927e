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

int spec_accept_point(float *p, int vocab, const int32_t *drafts, int k, const double *u_accept,
                      double u_resample, int32_t *out) {
    for (int i = 0; i < k; i++) {
        float *pi = p + (size_t)i * vocab;
        int d = drafts[i];
        if (u_accept[i] < (double)pi[d]) {
            out[i] = d;
            continue;
        }
        double rest = 0;   /* mass left once d is removed */
        for (int v = 0; v < vocab; v++)
            if (v != d) rest += pi[v];
        if (rest <= 0) {   /* p was a point mass on d up to rounding: d is p's own draw */
            out[i] = d;
            return i + 1;
        }
        pi[d] = 0;
        for (int v = 0; v < vocab; v++) pi[v] = (float)(pi[v] / rest);
        out[i] = sample_from_probs(pi, vocab, u_resample);
        return i + 1;
    }
    out[k] = sample_from_probs(p + (size_t)k * vocab, vocab, u_resample);
    return k + 1;
}
