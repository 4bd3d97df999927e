/* When speculation pays (prefix spec_cost_): a table of measured step times on this
 * device and the choice of draft lengths that maximises expected output tokens per second.
 * Pure logic (the engine measures the table, see engine_spec.c), so tests drive it with
 * made-up times.
 *
 * The model: a step of B decoding rows that feeds X draft tokens in all (plus prefill
 * tokens, counted as draft tokens of the same cost) takes t(B, X / B) seconds, measured
 * at a few batch sizes and uniform draft lengths and interpolated linearly in both (and
 * extrapolated from the last two points past the largest); a step that speculates also
 * pays the host work it exposes where plain steps run in flight (host[], below). A row
 * whose recent drafts were accepted at rate a (per draft position tried) gains a^j
 * expected tokens from its j-th draft (all earlier ones must stand). The step's value is (decoding rows + expected
 * accepted drafts) / t: drafts are taken best gain first while the value grows, so a row
 * whose drafts fail, or a batch where verify tokens cost as much as the rows they would
 * save, drafts nothing and runs as plain decode. */
#ifndef SPECD_SPEC_COST_H
#define SPECD_SPEC_COST_H

#define SPEC_COST_MAX_B 16
#define SPEC_COST_MAX_K 8

typedef struct {
    int n_b, n_k;
    int b[SPEC_COST_MAX_B];          /* batch sizes measured, ascending */
    int k[SPEC_COST_MAX_K];          /* draft lengths measured, ascending, k[0] = 0 */
    double t[SPEC_COST_MAX_B][SPEC_COST_MAX_K];   /* seconds per step */
    /* Correction of the draft tokens' cost per measured batch size, learned from the
     * steps that did speculate (spec_cost_observe): what start-up timing misses (host
     * acceptance over full logits, mixed steps) scales the verify part. 0 = 1 (none yet). */
    double scale[SPEC_COST_MAX_B];
    /* Seconds of the engine's own host work per step (schedule, commit, emit, launch) per
     * measured batch size, learned from every step (spec_cost_observe_host) where plain
     * steps run in flight and hide it; 0 where nothing is hidden, and where speculating
     * steps go in flight too (a draft model's, chained: engine_spec_host). Otherwise a
     * speculating step runs synchronously (prompt lookup's drafts follow from the token
     * before), so such work is exposed: SPEC_COST_HOST_STEPS times it is added to every
     * speculating step's time, never to a plain one's. */
    double host[SPEC_COST_MAX_B];
} spec_cost;

/* Seconds of a step of `rows` decoding rows feeding `extra` draft (or prefill) tokens:
 * the plain step, plus the draft tokens' part times the learned scale. */
double spec_cost_step(const spec_cost *c, int rows, int extra);

/* A speculating step of `rows` rows and `extra` draft/prefill tokens took `seconds`:
 * move the nearest batch size's scale toward what it would have needed (decayed, at most
 * 1.3x up or 0.85x down per observation; the scale stays within [0.25, 50]). */
void spec_cost_observe(spec_cost *c, int rows, int extra, double seconds);

/* Host steps a speculating step exposes: the commit of the step in flight before it (its
 * lookups need that step's tokens), its own schedule, lookups and commit, and the schedule
 * and launch of the step after it, which has nothing in flight to hide under: about two
 * steps' host work, where a plain step in flight exposes none. */
#define SPEC_COST_HOST_STEPS 2.0

/* Seconds of a speculating step: spec_cost_step plus SPEC_COST_HOST_STEPS times the host
 * time of the nearest measured batch size (c->host). */
double spec_cost_spec_step(const spec_cost *c, int rows, int extra);

/* A step of `rows` rows took `seconds` of host work: move the nearest batch size's
 * c->host toward it (decayed; an observation counts at most 0.1 s). Returns the new
 * estimate. */
double spec_cost_observe_host(spec_cost *c, int rows, double seconds);

/* Scratch for spec_cost_choose: room for rows * max_k candidates. */
typedef struct {
    float gain;
    int row, j;
} spec_cost_cand;

/* Draft lengths for one step: rows decoding rows, `extra` tokens fed besides them
 * (prefill); row i may draft up to avail[i] tokens and is accepted at rate alpha[i].
 * Writes k_out[i] (0..avail[i]) and returns the total drafted. cand: scratch of
 * sum(avail) entries. Drafting at all must promise SPEC_COST_MIN_GAIN more tokens per
 * second than the plain step: the acceptance rates and step times are estimates, and a
 * predicted gain of a percent or two is within their noise (chat traffic measured
 * 0.87-1.08x of plain where the model predicted a small gain). */
#define SPEC_COST_MIN_GAIN 0.03
int spec_cost_choose(const spec_cost *c, int rows, int extra, const int *avail, const float *alpha,
                     int *k_out, spec_cost_cand *cand);

/* Expected drafts standing of k tried at per-position acceptance a: a + a^2 + .. + a^k. */
double spec_cost_expected(double a, int k);

/* Prompt lookup through a verify op that pads every row to the step's deepest draft: the
 * depth cap k (row i drafts min(avail[i], k)) that gives the most expected tokens per
 * second, 0 unless it beats the plain step of `rows` rows by SPEC_COST_MIN_GAIN. */
int spec_cost_uniform_k(const spec_cost *c, int rows, const int *avail, const float *alpha);

/* Whether a draft model's k drafts on each of `rows` rows (and `extra` tokens besides),
 * standing at rate a, beat the plain step by SPEC_COST_MIN_GAIN. */
int spec_cost_draft_pays(const spec_cost *c, int rows, int extra, int k, double a);

/* Smallest acceptance rate (in steps of 0.05) at which a batch of `rows` rows, each able to
 * draft max_k tokens, drafts anything (the gain above included); 1.05 if none (for the
 * start-up report). */
double spec_cost_break_even(const spec_cost *c, int rows, int max_k, spec_cost_cand *cand, int *k_out,
                            int *avail, float *alpha);

#endif
