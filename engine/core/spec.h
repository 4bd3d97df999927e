/* Speculative acceptance on the host (prefix spec_): given the target's distributions at
 * the k+1 verified positions and the draft's at the k proposed ones, decide which draft
 * tokens stand and what token follows. Pure functions, shared by the CPU path and by
 * tests that check the CUDA kernels' decisions.
 *
 * Greedy (temperature 0): accept the longest prefix where the target's argmax equals the
 * draft token, then emit the target's argmax at the first mismatch (or the bonus token
 * after all k). Sampling: accept draft token d_i with probability min(1, p_i(d)/q_i(d));
 * on the first rejection draw from the normalised residual max(0, p_i - q_i); after k
 * acceptances draw the bonus from p_k. The emitted tokens are then distributed exactly
 * as the target's own samples (Leviathan et al. / Chen et al.). */
#ifndef SPECD_SPEC_H
#define SPECD_SPEC_H

#include <stdint.h>

/* Salts of the counter-based random streams of a speculative step, shared by every
 * implementation so that the same seed draws the same uniforms: drafts use
 * uniform(seed ^ SPEC_SALT_DRAFT, counter + j), accept tests uniform(seed ^
 * SPEC_SALT_ACCEPT, counter + j), and the final draw uniform(seed, 2 * counter), the
 * stream plain sampling uses for the same output position. (Point-mass drafts take no
 * accept uniforms: spec_accept_point.) */
#define SPEC_SALT_DRAFT 0x5bd1e9955bd1e995ULL
#define SPEC_SALT_ACCEPT 0x2545f4914f6cdd1dULL

/* Greedy. target_logits: (k+1, vocab). drafts: (k). out: (k+1). Returns tokens emitted
 * (accepted + 1). */
int spec_accept_greedy(const float *target_logits, int vocab, const int32_t *drafts, int k,
                       int32_t *out);

/* Sampling. p: (k+1, vocab) target probabilities; q: (k, vocab) draft probabilities the
 * drafts were drawn from; u_accept: (k) uniforms for the accept tests; u_resample: one
 * uniform for the final draw. residual: vocab floats of scratch. skip_accept_test (tests
 * only) accepts every draft, which makes the output follow q instead of p. */
int spec_accept_sample(const float *p, const float *q, int vocab, const int32_t *drafts, int k,
                       const double *u_accept, double u_resample, float *residual,
                       int skip_accept_test, int32_t *out);

/* Sampling with a deterministic drafter (prompt lookup): the target draws its own token
 * x_j from p_j at every position j <= k with uniform u[j] (the uniform plain sampling
 * draws that output position with: uniform(seed, 2 * (counter + j))); draft d_j stands
 * while x_j == d_j, and the first x_j that differs (or x_k after k that stand) is emitted
 * and ends the step. This is the rejection rule of a point-mass proposal (q_j(d_j) = 1) in
 * one coupling: d_j stands with probability p_j(d_j), and a rejected position emits a draw
 * from p_j conditioned on differing from d_j, which is the residual max(0, p_j - q_j)
 * renormalised. Every emitted token is the target's own draw, so a seeded request emits
 * the tokens it would emit without speculation (greedy rows: spec_accept_greedy, the same
 * rule with x_j the argmax). p: (k+1, vocab) target probabilities; u: (k+1). */
int spec_accept_point(const float *p, int vocab, const int32_t *drafts, int k, const double *u, int32_t *out);

/* u[0..k] for spec_accept_point: uniform(seed, 2 * (counter + j)). */
void spec_point_uniforms(uint64_t seed, uint64_t counter, int k, double *u);

/* The same rule over draws already made (a runner that sampled every position): x (k+1)
 * the target's tokens, drafts (k). out: (k+1). Returns accepted + 1. */
int spec_accept_draws(const int32_t *x, const int32_t *drafts, int k, int32_t *out);

#endif
