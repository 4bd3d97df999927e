/* The runner's step operation (runner.h, "the step operation"): one step of mixed rows,
 * run by whichever of the runner's ops fits it, with what each op samples decided in one
 * place (runner_takes). */
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/core/runner.h"
#include "engine/core/spec.h"

/* The verify op's inputs and outputs, and the decode op's per-row arrays. */
struct runner_step_scratch {
    int *slots, *prev, *nd, *vout_n;        /* [max_batch + 1] */
    int32_t *tokens;                         /* [max_batch + 1] */
    int32_t *vtok, *vout;                    /* [verify rows * (verify_max_k + 1)] */
    runner_sampling *vsp;                    /* [verify rows] */
};

void runner_destroy(runner *r) {
    if (!r) return;
    struct runner_step_scratch *s = r->step_scratch;
    if (s) {
        free(s->slots);
        free(s->prev);
        free(s->nd);
        free(s->vout_n);
        free(s->tokens);
        free(s->vtok);
        free(s->vout);
        free(s->vsp);
        free(s);
    }
    r->ops->destroy(r);
}

static struct runner_step_scratch *scratch(runner *r) {
    if (r->step_scratch) return r->step_scratch;
    struct runner_step_scratch *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    const size_t B = (size_t)r->cfg.max_batch + 1, VB = r->ops->verify ? (size_t)r->verify_max_rows : 0;
    const size_t VK = r->ops->verify ? (size_t)r->verify_max_k + 1 : 0;
    s->slots = malloc(B * sizeof(int));
    s->prev = malloc(B * sizeof(int));
    s->nd = malloc(B * sizeof(int));
    s->vout_n = malloc(B * sizeof(int));
    s->tokens = malloc(B * sizeof(int32_t));
    s->vtok = malloc((VB * VK + 1) * sizeof(int32_t));
    s->vout = malloc((VB * VK + 1) * sizeof(int32_t));
    s->vsp = malloc((VB + 1) * sizeof(runner_sampling));
    r->step_scratch = s;   /* (freed by runner_destroy, also when incomplete) */
    if (!s->slots || !s->prev || !s->nd || !s->vout_n || !s->tokens || !s->vtok || !s->vout || !s->vsp) return NULL;
    return s;
}

/* Logit adjustments or top logprobs: what the runner applies where runner.sample_adjusts. */
static int adjusted(const runner_sampling *sp) {
    return sp->n_logit_bias > 0 || sp->n_suppress > 0 || sp->n_top > 0 || sp->stats_fed ||
           sp->presence_penalty != 0 || sp->frequency_penalty != 0 ||
           (sp->repetition_penalty != 0 && sp->repetition_penalty != 1.0f);
}

int runner_ops_taking(const runner *r, const runner_sampling *sp, int async) {
    const int masked = sp->mask != NULL, adj = adjusted(sp);
    int ops = 0;
    /* the verify op: acceptance of drafts with the filters and the seed only */
    if (r->ops->verify && !async && !adj && !masked && !sp->logprob && !sp->force &&
        (sp->temperature <= 0 || r->verify_samples))
        ops |= 1 << RUNNER_OP_VERIFY;
    /* the decode op and the forward pass sample alike, with what the runner applies */
    if ((adj && !r->sample_adjusts) || (sp->stats_fed && !r->async_stats) || (masked && async && !r->async_masks) ||
        /* a masked row's logprobs are of its logits before the mask only where the runner says so */
        (masked && (sp->logprob || sp->n_top) && !r->masked_raw_logprobs))
        return ops;
    if (r->ops->decode && !sp->force && (!async || r->decode_async) && (!masked || r->decode_masks))
        ops |= 1 << RUNNER_OP_DECODE;
    if (r->forward_samples && (!sp->force || (!async && r->forced_tokens)) && (!async || r->forward_async) &&
        (!masked || r->forward_masks))
        ops |= 1 << RUNNER_OP_FORWARD;
    return ops;
}

int runner_takes(const runner *r, int op, const runner_sampling *sp, int async) {
    return op > RUNNER_OP_NONE && (runner_ops_taking(r, sp, async) >> op & 1);
}

int runner_spec_takes(const runner *r, const runner_sampling *sp) {
    return r->ops->spec_step && !adjusted(sp) && !sp->mask && !sp->logprob && !sp->force;
}

static int drafts_of(const runner_step_batch *sb, int i) { return sb->n_drafts ? sb->n_drafts[i] : 0; }

int runner_step_verifies(const runner *r, int n, const int *slots, const runner_sampling *sp, int k) {
    if (!r->ops->verify || n < 1 || n > r->verify_max_rows) return 0;
    const int K = k < r->verify_max_k ? k : r->verify_max_k;
    if (K < 1) return 0;
    for (int i = 0; i < n; i++)
        if (!runner_takes(r, RUNNER_OP_VERIFY, &sp[i], 0) ||
            r->ops->slot_get_len((runner *)r, slots[i], RUNNER_TARGET) + K + 1 > r->cfg.max_seq_len)
            return 0;
    return 1;
}

/* Whether op takes every sampling row of b. */
static int takes_all(const runner *r, int op, const runner_batch *b, int n_out) {
    for (int o = 0; o < n_out; o++)
        if (!runner_takes(r, op, &b->sp[o], b->async)) return 0;
    return 1;
}

static int plan(const runner *r, const runner_step_batch *sb) {
    const runner_batch *b = &sb->b;
    if (!b->sp) return RUNNER_OP_FORWARD;
    int decode = b->n_rows > 0, verify = !b->async, drafts = 0, kmax = 0, o = 0;
    for (int i = 0; i < b->n_rows; i++) {
        const runner_row *row = &b->rows[i];
        const int nd = drafts_of(sb, i);
        if (row->logits_off != o || nd < 0 || (nd > 0 && (row->n_new != nd + 1 || row->n_logits != nd + 1)))
            return RUNNER_OP_NONE;   /* not the layout runner_step takes */
        decode &= row->n_new == 1 && row->n_logits == 1;
        verify &= row->n_new == nd + 1 && row->n_logits == nd + 1;
        drafts |= nd > 0;
        kmax = nd > kmax ? nd : kmax;
        o += row->n_logits;
    }
    if (drafts && b->async) return RUNNER_OP_NONE;
    if (decode && !drafts && takes_all(r, RUNNER_OP_DECODE, b, o)) return RUNNER_OP_DECODE;
    if (verify && drafts && b->n_rows <= r->verify_max_rows && kmax <= r->verify_max_k) {
        /* (position 0's sampling stands for the row's: later ones differ in counter,
         * statistics and eos suppression only, which the op derives or does not apply;
         * every row is padded to the deepest draft, and the padding is fed) */
        for (int i = 0; i < b->n_rows && verify; i++)
            verify = runner_takes(r, RUNNER_OP_VERIFY, &b->sp[b->rows[i].logits_off], 0) &&
                     r->ops->slot_get_len((runner *)r, b->rows[i].slot, RUNNER_TARGET) + kmax + 1 <= r->cfg.max_seq_len;
        if (verify) return RUNNER_OP_VERIFY;
    }
    return takes_all(r, RUNNER_OP_FORWARD, b, o) ? RUNNER_OP_FORWARD : RUNNER_OP_NONE;
}

int runner_step_plan(const runner *r, runner_step_batch *sb) { return sb->op = plan(r, sb); }

/* The decode op over rows of one token each (logits row i is row i). */
static int run_decode(runner *r, struct runner_step_scratch *s, const runner_batch *b) {
    int any_prev = 0;
    for (int i = 0; i < b->n_rows; i++) {
        const int t = b->rows[i].tok_off;
        s->slots[i] = b->rows[i].slot;
        s->tokens[i] = b->tokens[t];
        s->prev[i] = b->prev_tok ? b->prev_tok[t] : -1;
        any_prev |= s->prev[i] >= 0;
    }
    runner_decode_batch db = {.n = b->n_rows, .slots = s->slots, .tokens = s->tokens, .sp = b->sp,
                              .out_tokens = b->out_tokens, .out_logprobs = b->out_logprobs,
                              .out_top_ids = b->out_top_ids, .out_top_logprobs = b->out_top_logprobs,
                              .prepare_sp = b->prepare_sp, .prepare_ctx = b->prepare_ctx, .async = b->async,
                              .prev_row = any_prev ? s->prev : NULL};
    return r->ops->decode(r, &db);
}

/* The verify op: each row's last token and drafts, padded to the deepest with copies of
 * the token before (computed, never accepted); its tokens back into the logits rows. */
static int run_verify(runner *r, struct runner_step_scratch *s, runner_step_batch *sb) {
    const runner_batch *b = &sb->b;
    int k = 0;
    for (int i = 0; i < b->n_rows; i++) k = drafts_of(sb, i) > k ? drafts_of(sb, i) : k;
    const int K1 = k + 1;
    for (int i = 0; i < b->n_rows; i++) {
        const runner_row *row = &b->rows[i];
        int32_t *t = s->vtok + (size_t)i * K1;
        s->nd[i] = drafts_of(sb, i);
        memcpy(t, b->tokens + row->tok_off, (size_t)(s->nd[i] + 1) * sizeof *t);
        for (int j = s->nd[i] + 1; j < K1; j++) t[j] = t[j - 1];
        s->slots[i] = row->slot;
        s->vsp[i] = b->sp[row->logits_off];
    }
    runner_verify_batch vb = {.n = b->n_rows, .k = k, .slots = s->slots, .tokens = s->vtok, .n_drafts = s->nd,
                              .sp = s->vsp, .out_tokens = s->vout, .out_n = s->vout_n};
    int rc = r->ops->verify(r, &vb);
    for (int i = 0; rc == 0 && i < b->n_rows; i++) {
        const int m = s->vout_n[i];
        memcpy(b->out_tokens + b->rows[i].logits_off, s->vout + (size_t)i * K1, (size_t)m * sizeof(int32_t));
        if (sb->out_n) sb->out_n[i] = m;
    }
    return rc;
}

/* After a forward pass that sampled every position: each verify row's drafts stand while
 * they equal the sampled tokens, and its length goes back to what stands. */
static int settle_forward(runner *r, runner_step_batch *sb) {
    const runner_batch *b = &sb->b;
    for (int i = 0; i < b->n_rows && sb->out_n; i++) {
        const runner_row *row = &b->rows[i];
        const int nd = drafts_of(sb, i), off = row->logits_off;
        if (nd == 0) {   /* a row that samples its next token, or a prompt chunk */
            sb->out_n[i] = row->n_logits && !b->sp[off + row->n_logits - 1].force;
            continue;
        }
        int32_t acc[RUNNER_STEP_MAX_K + 1];
        const int m = spec_accept_draws(b->out_tokens + off, b->tokens + row->tok_off + 1, nd, acc);
        sb->out_n[i] = m;
        const int len = r->ops->slot_get_len(r, row->slot, RUNNER_TARGET);
        int rc = r->ops->slot_set_len(r, row->slot, RUNNER_TARGET, len - (nd + 1 - m));
        if (rc) return rc;
    }
    return 0;
}

int runner_step(runner *r, runner_step_batch *sb) {
    runner_batch *b = &sb->b;
    const int op = sb->op ? sb->op : runner_step_plan(r, sb);
    if (op == RUNNER_OP_NONE || b->which != RUNNER_TARGET) return SPECD_EINVAL;
    for (int i = 0; sb->n_drafts && i < b->n_rows; i++)
        if (sb->n_drafts[i] > RUNNER_STEP_MAX_K) return SPECD_EINVAL;
    for (int i = 0; sb->n_drafts && i < b->n_rows; i++)
        if (sb->n_drafts[i] > RUNNER_STEP_MAX_K || (sb->n_drafts[i] > 0 && b->sp && !sb->out_n)) return SPECD_EINVAL;
    struct runner_step_scratch *s = op == RUNNER_OP_FORWARD ? NULL : scratch(r);
    if (op != RUNNER_OP_FORWARD && !s) return SPECD_ENOMEM;
    if (op == RUNNER_OP_VERIFY) return run_verify(r, s, sb);
    int rc = op == RUNNER_OP_DECODE ? run_decode(r, s, b) : runner_forward(r, b);
    if (rc || !b->sp) return rc;
    return settle_forward(r, sb);
}
