/* Host-side sampling (prefix sample_): logits -> token, as the CPU runner path and the
 * speculative acceptance use it. Counter-based randomness: the uniform for a request's
 * n-th draw is a pure function of (seed, n), so a seeded request gives the same tokens
 * whatever batch it ran in. */
#ifndef SPECD_SAMPLE_H
#define SPECD_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    float temperature;        /* 0 = greedy */
    float top_p;              /* 1 = off */
    int top_k;                /* 0 = off */
    float min_p;              /* 0 = off */
    float presence_penalty, frequency_penalty;  /* over generated tokens (OpenAI) */
    float repetition_penalty; /* 1 = off; over prompt + generated (HF) */
    int n_logit_bias;
    const int32_t *logit_bias_ids;
    const float *logit_bias_vals;
    int suppress_eos;         /* min_tokens not reached */
    const int32_t *eos_ids;
    int n_eos;
} sample_params;

/* Uniform in [0, 1) from (seed, counter). */
double sample_uniform(uint64_t seed, uint64_t counter);

/* Apply logit bias and penalties in place. history = prompt + generated tokens;
 * n_prompt marks where generated tokens start. scratch: vocab ints (counts). */
void sample_apply_penalties(float *logits, int vocab, const sample_params *p,
                            const int32_t *history, int n_history, int n_prompt, int *scratch);

/* Turn processed logits into the sampling distribution in place (probabilities summing
 * to 1 over the kept tokens, 0 elsewhere) after temperature, top-k, top-p, min-p.
 * Requires temperature > 0. scratch: vocab ints. */
void sample_probs(float *logits, int vocab, const sample_params *p, int *scratch);

int sample_argmax(const float *logits, int vocab);
/* Draw from a probability vector with uniform u. */
int sample_from_probs(const float *probs, int vocab, double u);

/* log_softmax value of one token, and the top-n (ids, logprobs) sorted descending. */
float sample_logprob(const float *logits, int vocab, int token);
int sample_top_logprobs(const float *logits, int vocab, int n, int32_t *ids, float *lps);

#endif
