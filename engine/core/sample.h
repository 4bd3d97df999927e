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

/* The same from the history's statistics instead of the history itself (the form the
 * runners take, runner_sampling): ids[0..n) distinct, counts[j] the occurrences of ids[j]
 * among generated tokens. The repetition penalty applies to every listed id, presence and
 * frequency to those with a count > 0, so the result equals sample_apply_penalties when
 * the list holds every token of the history (or, without a repetition penalty, at least
 * every generated one). */
void sample_apply_penalties_sparse(float *logits, int vocab, const sample_params *p,
                                   const int32_t *ids, const int32_t *counts, int n);
/* The same with one more generated token, fed (>= 0; -1: none), that the list may lack:
 * its count + 1 where listed, else a new id of count 1 (runner_sampling.stats_fed). */
void sample_apply_penalties_fed(float *logits, int vocab, const sample_params *p, const int32_t *ids,
                                const int32_t *counts, int n, int32_t fed);

/* A request's token statistics in that form, kept up to date token by token: each
 * distinct id once (in order of first appearance) with its count among generated tokens.
 * cap bounds the distinct ids (prompt + max new tokens). */
typedef struct {
    int n, cap;
    int32_t *ids, *counts;    /* [cap] */
    int32_t *slots;           /* [mask + 1] open addressing: index into ids + 1, 0 empty */
    uint32_t mask;
} sample_stats;

/* 0, or -1 when out of memory. */
int sample_stats_init(sample_stats *s, int cap);
/* Count one occurrence of id: generated != 0 adds to its count, 0 (a prompt token) only
 * lists it. Returns -1 when id is new and the list is full. */
int sample_stats_add(sample_stats *s, int32_t id, int generated);
/* The index of id in s->ids, or -1 when it is not listed. */
int sample_stats_find(const sample_stats *s, int32_t id);
void sample_stats_free(sample_stats *s);

/* Turn processed logits into the sampling distribution in place (probabilities summing
 * to 1 over the kept tokens, 0 elsewhere) after temperature, top-k, top-p, min-p.
 * Requires temperature > 0. scratch: vocab ints. */
void sample_probs(float *logits, int vocab, const sample_params *p, int *scratch);

int sample_argmax(const float *logits, int vocab);
/* Draw from a probability vector with uniform u. */
int sample_from_probs(const float *probs, int vocab, double u);

/* log_softmax value of one token, its rank (1 + the ids with a larger logit), and the
 * top-n (ids, logprobs) sorted descending. */
float sample_logprob(const float *logits, int vocab, int token);
int sample_rank(const float *logits, int vocab, int token);
int sample_top_logprobs(const float *logits, int vocab, int n, int32_t *ids, float *lps);

#endif
