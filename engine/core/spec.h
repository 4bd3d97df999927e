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
 * stream plain sampling uses for the same output position. */
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

/* Sampling with a deterministic drafter (prompt lookup): the proposal is a point mass on
 * each draft token, so q_i(d) = 1 and the rule above becomes: accept d_i with probability
 * p_i(d_i); on the first rejection draw from p_i with d_i removed and renormalised (the
 * residual max(0, p_i - q_i)); after k acceptances draw the bonus from p_k. p: (k+1,
 * vocab) target probabilities, modified (a rejected draft's entry is zeroed). */
int spec_accept_point(float *p, int vocab, const int32_t *drafts, int k, const double *u_accept,
                      double u_resample, int32_t *out);

#endif
