/* The engine's speculation policy (prefix engine_spec_): which decoding rows draft how many
 * tokens in a step, for both drafters (a draft model: all speculating rows draft k; prompt
 * lookup: each row drafts what its n-gram index proposes), each request's acceptance
 * estimate and back-off, and the cost model measured at creation (spec_cost.h).
 *
 * A request's acceptance rate is estimated per draft position tried (a draft is tried
 * only when every earlier one stood): an exponentially decayed count of accepted over
 * tried drafts, starting from 1 of 2. With prompt lookup a row whose whole draft fails
 * skips lookup for 1, 2, 4 .. 32 steps (reset by any accepted draft), so open chat, where
 * matches are rare and wrong, costs almost nothing; a step in which no row would draft
 * is queued in flight like a plain one (engine_spec_ngram_idle). With a runner's verify op
 * (the CUDA graphs), a step the op does not take (rows with logprobs, logit adjustments,
 * penalties, min_tokens or grammars, or prompt chunks beside them) drafts through the
 * composed path, priced by its own table (cost_fwd). Drafts the cost model declines are
 * still tried now and then (SPEC_PROBE_EVERY; a draft model's probes back off up to
 * SPEC_PROBE_MAX, are spaced so that they cost at most 0.5% of the plain steps between
 * them by the cost table, leave out steps with prompt chunks, and take the rows whose
 * draft has least to catch up on), or an estimate that fell could never rise. A draft
 * model only runs when its row speculates or feeds a prompt chunk; plain steps leave it
 * behind and the next speculating step catches it up (engine_step.c). */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "engine/core/engine_internal.h"
#include "engine/core/err.h"

#define SPEC_DECAY 0.7f          /* weight of a request's past in its acceptance estimate */
#define SPEC_GLOBAL_DECAY 0.95f  /* the same over all requests (draft-model decisions) */
#define SPEC_BACKOFF_MAX 32      /* steps a failing prompt-lookup row skips at most */
/* A draft model's probes (whole speculative steps, and the draft's catch-up on the tokens
 * it skipped) back off: each declined probe doubles the interval, up to this many steps. */
#define SPEC_PROBE_MAX 1024

const char *engine_spec_drafter_name(const engine *e) {
    return e->drafter == ENGINE_DRAFTER_NGRAM ? "ngram" : e->drafter == ENGINE_DRAFTER_MODEL ? "draft_model" : "none";
}

int engine_spec_req_init(const engine *e, req *r, int capacity) {
    r->acc_s = 1;
    r->acc_t = 2;
    if (e->drafter != ENGINE_DRAFTER_NGRAM) return 0;
    r->ng = ngram_create(e->cfg.ngram_min, e->cfg.ngram_max, capacity);
    return r->ng ? 0 : SPECD_ENOMEM;
}

void engine_spec_observe(engine *e, req *r, int k, int accepted) {
    int tried = accepted + (accepted < k);
    r->acc_s = SPEC_DECAY * r->acc_s + (float)accepted;
    r->acc_t = SPEC_DECAY * r->acc_t + (float)tried;
    e->acc_s = SPEC_GLOBAL_DECAY * e->acc_s + (float)accepted;
    e->acc_t = SPEC_GLOBAL_DECAY * e->acc_t + (float)tried;
    if (e->drafter != ENGINE_DRAFTER_NGRAM) return;
    if (accepted > 0) {
        r->fails = 0;
    } else {
        int skip = 1 << (r->fails < 5 ? r->fails : 5);
        r->skip = skip < SPEC_BACKOFF_MAX ? skip : SPEC_BACKOFF_MAX;
        r->fails++;
    }
}

/* Drafts a prompt-lookup row may propose: k, less near the end of its block table, its
 * context, or its output limit (m emitted tokens need m - 1 drafts). */
static int ngram_room(const engine *e, const req *r) {
    const sched_seq *s = &r->seq;
    int room = e->k;
    int kv = s->kv.n_blocks * e->cfg.block_size - s->n_tokens, out = r->max_new - r->n_out - 1;
    if (kv < room) room = kv;
    if (out < room) room = out;
    if (e->cfg.max_seq_len - s->n_tokens < room) room = e->cfg.max_seq_len - s->n_tokens;
    return room > 0 ? room : 0;
}

/* Prompt lookup verified by the runner's verify op (the CUDA runner's graphs). */
static int ngram_verifies(const engine *e) {
    return e->drafter == ENGINE_DRAFTER_NGRAM && e->run->ops->verify;
}

int engine_spec_ngram_fwd(const engine *e) {
    return ngram_verifies(e) && e->run->forward_samples && (e->cost.n_b == 0 || e->cost_fwd.n_b > 0);
}

/* The table a prompt-lookup choice uses: mode 1 (the verify op) the verify op's, mode -1
 * (the composed path) cost_fwd where the runner has a verify op, else the one table. */
static const spec_cost *ngram_table(const engine *e, int mode) {
    return mode < 0 && ngram_verifies(e) ? &e->cost_fwd : &e->cost;
}

int engine_spec_never(const engine *e, int n) {
    if (e->k == 0 || (ngram_verifies(e) && n > e->run->verify_max_rows)) return 1;
    if (e->drafter != ENGINE_DRAFTER_MODEL || e->cost.n_b == 0) return 0;
    /* engine_spec_plan's test for a draft model: not even drafts that all stand would pay
     * at this many rows (then it neither speculates nor probes) */
    const double plain = n / spec_cost_step(&e->cost, n, 0);
    return n * (1 + e->k) / spec_cost_spec_step(&e->cost, n, n * e->k) <= plain;
}

/* The prompt-lookup choice over the nd candidate rows in cand_* (drafts available and
 * acceptance) beside `extra` prompt tokens, into cand_k; returns how many rows draft.
 * verify 1: the runner's verify op takes the step, every row padded to the step's deepest
 * draft, so the choice is one depth cap k for the step (row j drafts min(avail, k)), the
 * one with the most expected tokens per second where that beats the plain step by
 * SPEC_COST_MIN_GAIN (spec_cost_uniform_k); verify 0: nothing drafts (the op would not
 * take the step, nor the composed path); verify -1: the composed path (no verify op, or
 * one that does not take the step: its own table, cost_fwd), each row's drafts by their
 * expected gain (spec_cost_choose). Without a cost model every available draft goes. A declined row
 * still probes one draft every SPEC_PROBE_EVERY declines where one that stands would pay;
 * count 0 (a peek) leaves the decline counts as they are. */
static int ngram_choose(engine *e, int nd, int extra, int verify, int count) {
    const spec_cost *c = ngram_table(e, verify);
    int K = 0, best_k = 0, total = 0;
    for (int j = 0; j < nd; j++) {
        e->cand_k[j] = verify == 0 ? 0 : e->cand_avail[j];
        if (e->cand_avail[j] > K) K = e->cand_avail[j];
    }
    if (verify == 0 || c->n_b == 0 || K == 0) {
        for (int j = 0; j < nd; j++) total += e->cand_k[j] > 0;
        return total;
    }
    int probe_pays;
    if (verify > 0) {
        best_k = spec_cost_uniform_k(c, nd, e->cand_avail, e->cand_alpha);
        for (int j = 0; j < nd; j++) e->cand_k[j] = e->cand_avail[j] < best_k ? e->cand_avail[j] : best_k;
        probe_pays = best_k == 0 && (nd + 1) / spec_cost_spec_step(c, nd, nd) > nd / spec_cost_step(c, nd, 0);
    } else {
        spec_cost_choose(c, nd, extra, e->cand_avail, e->cand_alpha, e->cand_k, e->cands);
        int any = 0;
        for (int j = 0; j < nd; j++) any |= e->cand_k[j] > 0;
        probe_pays = any || (nd + 1) / spec_cost_spec_step(c, nd, extra + 1) > nd / spec_cost_step(c, nd, extra);
    }
    for (int j = 0; j < nd; j++) {
        req *r = e->plan[e->cand_row[j]].r;
        if (probe_pays && e->cand_k[j] == 0 && e->cand_avail[j] > 0) {
            if ((r->declined + 1) % SPEC_PROBE_EVERY == 0) e->cand_k[j] = 1;
            if (count) r->declined++;
        }
        total += e->cand_k[j] > 0;
    }
    return total;
}

/* Declined steps before a draft model's next probe: the current back-off, and at least
 * so many that a probe's extra time over a plain step stays within SPEC_PROBE_SHARE of the
 * plain steps between probes. A probe is a composed step (the draft's catch-up pass and
 * draft pass, an eager verify), so its time is taken as the table's first measured draft
 * length for every row (k[1]; on the GPU k = 2), not a linear share of it: a share
 * (one draft per row) put an 8B-shape probe at batch 1 ~86 steps apart on an H100, where
 * the probe cost ~2% of a 128-token run (0.975-0.979x of plain). */
#define SPEC_PROBE_SHARE 0.005
static int probe_spacing(const engine *e, int nd, int extra) {
    const double plain = spec_cost_step(&e->cost, nd, extra);
    const int k1 = e->cost.n_k > 1 ? e->cost.k[1] : 1;
    const double floor = (spec_cost_spec_step(&e->cost, nd, extra + nd * k1) - plain) / (SPEC_PROBE_SHARE * plain);
    if (floor >= SPEC_PROBE_MAX) return SPEC_PROBE_MAX;
    return floor > e->probe_every ? (int)floor + 1 : e->probe_every;
}

/* A draft-model probe's rows: one draft each for the rows that may draft (cand_avail)
 * whose draft is least behind, while the tokens it must catch up on (it skipped them in
 * plain steps) stay within SPEC_PROBE_CATCHUP, and at least one row. The catch-up is a draft pass over those tokens:
 * probing every row after a long run of plain steps cost about as much as the probe's
 * verify (8B shape with a 1B-shape draft that is never right, batch 8, on an H100: 0.963x
 * of plain with every row probing), while one row's acceptance is enough to tell whether
 * to look again. */
#define SPEC_PROBE_CATCHUP 64
static void probe_rows(engine *e, int nd) {
    runner *run = e->run;
    int budget = SPEC_PROBE_CATCHUP, taken = 0;
    for (int j = 0; j < nd; j++) e->cand_k[j] = 0;
    while (taken < nd) {
        int best = -1, best_lag = 0;
        for (int j = 0; j < nd; j++) {
            if (e->cand_k[j] || e->cand_avail[j] <= 0) continue;
            const sched_seq *s = &e->plan[e->cand_row[j]].r->seq;
            int lag = s->n_tokens - run->ops->slot_get_len(run, s->slot, RUNNER_DRAFT);
            if (best < 0 || lag < best_lag) best = j, best_lag = lag;
        }
        if (best < 0 || (taken > 0 && best_lag > budget)) break;
        e->cand_k[best] = 1;
        budget -= best_lag;
        taken++;
    }
}

/* A draft model's choice for a step of nd decoding rows beside `extra` prompt tokens: one k
 * for every row (the draft passes are shared), all or nothing, and only for a gain beyond
 * SPEC_COST_MIN_GAIN (spec_cost_draft_pays); else decline, or probe where drafts that all
 * stood would pay (never at batch sizes whose verify costs more than k plain steps: on a
 * GPU, a large batch), no prompt chunk rides along (a probe would turn the ramp-up's mixed
 * steps into composed ones) and probe_spacing declines have passed since the last probe,
 * each probe coming twice as late unless speculation resumes. peek: a step about to go
 * in flight without engine_spec_plan (engine_spec_skip) counts its decline, and a probe or
 * speculation changes nothing (the plan will choose it). */
enum { MODEL_SPEC, MODEL_DECLINE, MODEL_PROBE };
static int model_choice(engine *e, int nd, int extra, int peek) {
    const double a = e->acc_s / e->acc_t;
    const double plain = nd / spec_cost_step(&e->cost, nd, extra);
    const double best = nd * (1 + e->k) / spec_cost_spec_step(&e->cost, nd, extra + nd * e->k);
    if (spec_cost_draft_pays(&e->cost, nd, extra, e->k, a)) {
        if (!peek) e->probe_every = SPEC_PROBE_EVERY;
        return MODEL_SPEC;
    }
    if (best <= plain || extra > 0) return MODEL_DECLINE;
    if (e->declined + 1 < probe_spacing(e, nd, extra)) {
        e->declined++;
        return MODEL_DECLINE;
    }
    if (!peek) {
        e->declined = 0;
        if (e->probe_every < SPEC_PROBE_MAX) e->probe_every *= 2;
    }
    return MODEL_PROBE;
}

int engine_spec_chain(const engine *e, int n) {
    if (e->drafter != ENGINE_DRAFTER_MODEL || e->k == 0) return 0;
    return e->cost.n_b == 0 || spec_cost_draft_pays(&e->cost, n, 0, e->k, e->acc_s / e->acc_t);
}

int engine_spec_skip(engine *e, int n) {
    if (e->drafter != ENGINE_DRAFTER_MODEL || e->cost.n_b == 0 || e->k == 0) return 0;
    if (model_choice(e, n, 0, 1) != MODEL_DECLINE) return 0;
    e->st.spec_rows_decoding += (uint64_t)n;
    e->st.spec_steps_decoding++;
    return 1;
}

/* How many of a constrained row's n drafts its grammar takes in a row (the matcher is
 * walked ahead and put back). */
static int grammar_prefix(engine *e, req *r, const int32_t *drafts, int n) {
    matcher_save(r->m, e->msave);
    int ok = 0;
    while (ok < n && matcher_accept_token(r->m, drafts[ok]) == 0) ok++;
    matcher_restore(r->m, e->msave);
    return ok;
}

/* Row p's prompt-lookup drafts after its first `known` tokens, into p->drafts. */
static int ngram_lookup(engine *e, row_plan *p, int known) {
    req *r = p->r;
    ngram_update(r->ng, r->seq.tokens, known);
    return ngram_draft(r->ng, r->seq.tokens, known, ngram_room(e, r), p->drafts, NULL);
}

int engine_spec_ngram_idle(engine *e, int n, int verify) {
    if (e->drafter != ENGINE_DRAFTER_NGRAM) return 0;
    int nd = 0, extra = 0;
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        req *r = p->r;
        if (!row_decodes(p)) {
            extra += p->n_new;
            continue;
        }
        /* Its lookup on the tokens it knows. With a step in flight the last one is not
         * known yet: a match on the tokens before it also predicts that token, which
         * stands about as often as a draft does, so its drafts are priced at the square of
         * the row's acceptance (and a row whose lookup finds nothing counts as drafting
         * nothing, even one that copied a step ago: on open chat at 64 streams, taking
         * such rows as drafting sent 12-18% of all steps to the plan synchronously only to
         * find no drafts there; H100, tests/gpu/BENCH.md). (A constrained row's drafts are
         * not walked through its grammar here: its matcher may still wait for the step in
         * flight's token; more drafts only send the step to the plan.) */
        float a = r->acc_s / r->acc_t;
        int avail = 0;
        if (verify != 0 && r->skip == 0 && row_may_speculate(e, p)) {
            avail = ngram_lookup(e, p, r->seq.n_tokens - r->pend_tok);
            if (r->pend_tok) a *= a;
        }
        e->cand_row[nd] = i;
        e->cand_avail[nd] = avail;
        e->cand_alpha[nd] = a;
        nd++;
    }
    if (nd > 0 && ngram_choose(e, nd, extra, verify, 0) > 0) return 0;
    /* the plan's bookkeeping of a step without drafts */
    if (nd > 0) ngram_choose(e, nd, extra, verify, 1);
    for (int j = 0; j < nd; j++) {
        row_plan *p = &e->plan[e->cand_row[j]];
        if (p->r->skip > 0 && row_may_speculate(e, p)) p->r->skip--;
    }
    return 1;
}

void engine_spec_plan(engine *e, int n) {
    int nd = 0, extra = 0, total = 0;
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        req *r = p->r;
        const sched_seq *s = &r->seq;
        if (!row_decodes(p)) {
            extra += p->n_new;   /* prefill chunk */
            p->spec = 0;
            continue;
        }
        r->decode_steps++;
        e->cand_row[nd] = i;
        int avail = 0;
        if (p->spec && e->drafter == ENGINE_DRAFTER_MODEL) {
            avail = e->k;
        } else if (p->spec && r->skip > 0) {
            r->skip--;
        } else if (p->spec && (!ngram_verifies(e) || e->step_verify || e->step_fwd)) {
            /* (a step neither the runner's verify op nor the composed path takes drafts
             * nothing: no lookup; the index catches up on the tokens the next time) */
            avail = ngram_lookup(e, p, s->n_tokens);
            if (r->m) avail = grammar_prefix(e, r, p->drafts, avail);
        }
        e->cand_avail[nd] = avail;
        e->cand_alpha[nd] = r->acc_s / r->acc_t;
        e->cand_k[nd] = avail;
        nd++;
    }
    if (nd == 0) {
        e->step_spec = 0;
        return;
    }
    e->st.spec_rows_decoding += (uint64_t)nd;
    e->st.spec_steps_decoding++;
    if (e->cost.n_b > 0 && e->drafter == ENGINE_DRAFTER_MODEL) {
        const int choice = model_choice(e, nd, extra, 0);
        if (choice == MODEL_DECLINE)
            for (int j = 0; j < nd; j++) e->cand_k[j] = 0;
        else if (choice == MODEL_PROBE)
            probe_rows(e, nd);
    } else if (e->drafter == ENGINE_DRAFTER_NGRAM) {
        ngram_choose(e, nd, extra, engine_spec_ngram_mode(e, e->step_verify, e->step_fwd), 1);
    }
    for (int j = 0; j < nd; j++) {
        e->plan[e->cand_row[j]].spec = e->cand_k[j];
        total += e->cand_k[j] > 0;
    }
    e->step_spec = total;
    e->spec_rows = nd;
    e->spec_extra = extra;
    int kmax = 0;
    for (int j = 0; j < nd; j++) {
        e->spec_extra += e->cand_k[j];
        if (e->cand_k[j] > kmax) kmax = e->cand_k[j];
    }
    if (e->step_verify) e->spec_extra = nd * kmax;   /* every row is padded to the deepest */
    if (total) e->st.spec_steps_speculated++;
    if (total && e->step_fwd) e->st.spec_steps_fwd++;
}

int engine_spec_ngram_mode(const engine *e, int verify, int fwd) {
    if (!ngram_verifies(e)) return -1;
    return verify ? 1 : fwd ? -1 : 0;
}

void engine_spec_observe_step(engine *e, double seconds) {
    spec_cost_observe(e->step_fwd ? &e->cost_fwd : &e->cost, e->spec_rows, e->spec_extra, seconds);
}

void engine_spec_host(engine *e, int rows, double host) {
    if (e->cost.n_b == 0 || e->k == 0 || !e->run->async_device || e->cfg.sync_scheduling || engine_spec_async_ok(e))
        return;
    e->st.spec_host_seconds = spec_cost_observe_host(&e->cost, rows, host);
    if (e->cost_fwd.n_b) spec_cost_observe_host(&e->cost_fwd, rows, host);
}

/* ---- the cost model ------------------------------------------------------------------ */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Whether a prompt-lookup step of B rows with k drafts runs as the runner's verify op
 * (and so is timed as one). */
static int verify_times(const engine *e, int B, int k) {
    return ngram_verifies(e) && B <= e->run->verify_max_rows && k <= e->run->verify_max_k;
}

/* Seconds of one pass of `which` over B rows (slots 0..B-1, free at creation, so their
 * block tables point at the null block and every write lands there) of k+1 tokens each
 * after ctx tokens of context, with k+1 logits rows each (a verify), or for k = 0 the
 * plain decode path: the runner's decode op, or a forward that samples where it can.
 * fwd: a verify through the composed path even where the verify op would take it (a
 * forward sampling every logits row on the device). */
static int time_pass(engine *e, int which, int B, int k, int ctx, int fwd, double *sec) {
    runner *run = e->run;
    int rc = 0, plain = k == 0 && which == RUNNER_TARGET;
    for (int i = 0; i < B; i++) {
        if ((rc = run->ops->slot_set_len(run, i, which, ctx))) return rc;
        e->rows[i] = (runner_row){.slot = i, .n_new = k + 1, .tok_off = i * (k + 1),
                                  .n_logits = which == RUNNER_DRAFT ? 1 : k + 1,
                                  .logits_off = which == RUNNER_DRAFT ? i : i * (k + 1)};
        for (int j = 0; j <= k; j++) e->tokens[i * (k + 1) + j] = (int32_t)((i * 31 + j * 7 + 1) % e->vocab);
        e->dec_slots[i] = i;
        e->dec_sp[i] = (runner_sampling){.temperature = 0, .top_p = 1};
    }
    runner_batch b = {.which = which, .n_rows = B, .rows = e->rows, .tokens = e->tokens,
                      .n_tokens = B * (k + 1), .logits = which == RUNNER_DRAFT ? e->dlogits : e->logits};
    double t0 = now_s();
    if (k > 0 && !fwd && verify_times(e, B, k)) {
        for (int i = 0; i < B; i++) e->spec_nd[i] = k;
        runner_verify_batch vb = {.n = B, .k = k, .slots = e->dec_slots, .tokens = e->tokens, .n_drafts = e->spec_nd,
                                  .sp = e->dec_sp, .out_tokens = e->spec_out, .out_n = e->spec_n};
        rc = run->ops->verify(run, &vb);
    } else if (plain && run->ops->decode) {
        runner_decode_batch db = {.n = B, .slots = e->dec_slots, .tokens = e->tokens, .sp = e->dec_sp,
                                  .out_tokens = e->dec.tok, .out_logprobs = e->dec.lp};
        rc = run->ops->decode(run, &db);
    } else {
        if ((plain || fwd) && run->forward_samples) {
            for (int o = B; o < B * (k + 1); o++) e->dec_sp[o] = e->dec_sp[0];   /* (fwd: every row) */
            b.sp = e->dec_sp;
            b.out_tokens = e->dec.tok;
            b.out_logprobs = e->dec.lp;
        }
        rc = runner_forward(run, &b);
    }
    *sec = now_s() - t0;
    for (int i = 0; i < B; i++) run->ops->slot_set_len(run, i, which, 0);
    return rc;
}

/* The fastest of a few passes (fewer for large ones: start-up time). */
static int time_best(engine *e, int which, int B, int k, int ctx, int fwd, double *best) {
    int reps = B * (k + 1) <= 64 ? 3 : 1, rc;
    *best = 1e30;
    for (int i = 0; i < reps; i++) {
        double t;
        if ((rc = time_pass(e, which, B, k, ctx, fwd, &t))) return rc;
        if (t < *best) *best = t;
    }
    return 0;
}

/* The smallest acceptance rate at which a batch of B rows speculates (1.05: never). */
static double break_even(engine *e, int B) {
    const spec_cost *c = &e->cost;
    if (e->drafter != ENGINE_DRAFTER_MODEL && !ngram_verifies(e))
        return spec_cost_break_even(c, B, e->k, e->cands, e->cand_k, e->cand_avail, e->cand_alpha);
    /* one depth for every row: k for a draft model, the best of 1..k for verify steps
     * (the decisions engine_spec_plan takes, margin included) */
    for (int s = 0; s <= 20; s++) {
        const double a = 0.05 * s;
        if (e->drafter == ENGINE_DRAFTER_MODEL) {
            if (spec_cost_draft_pays(c, B, 0, e->k, a)) return a;
            continue;
        }
        for (int i = 0; i < B; i++) {
            e->cand_avail[i] = e->k;
            e->cand_alpha[i] = (float)a;
        }
        if (spec_cost_uniform_k(c, B, e->cand_avail, e->cand_alpha) > 0) return a;
    }
    return 1.05;
}

/* One row of the start-up report: the table's step times at B rows for each measured k,
 * a note, and the acceptance from which it speculates (a > 1: never). */
static void report_row(const spec_cost *c, int B, const char *note, double a) {
    char line[512];
    int o = snprintf(line, sizeof line, "specd:   B %4d:", B);
    for (int kj = 0; kj < c->n_k && o < (int)sizeof line - 48; kj++)
        o += snprintf(line + o, sizeof line - (size_t)o, "  k%d %.2f", c->k[kj],
                      1e3 * spec_cost_step(c, B, B * c->k[kj]));
    if (a > 1) fprintf(stderr, "%s%s  -> never speculates\n", line, note);
    else fprintf(stderr, "%s%s  -> speculates from acceptance %.2f\n", line, note, a);
}

static void report(engine *e) {
    const spec_cost *c = &e->cost;
    fprintf(stderr, "specd: speculation cost model (%s drafts; ms per step of B rows, k drafts per row):\n",
            engine_spec_drafter_name(e));
    for (int bi = 0; bi <= c->n_b; bi++) {
        const int B = bi < c->n_b ? c->b[bi] : e->cfg.max_batch;
        if (bi == c->n_b && c->b[c->n_b - 1] == B) break;
        if (bi == c->n_b && ngram_verifies(e)) {
            fprintf(stderr, "specd:   B > %d: never speculates (the runner's verify takes %d rows)\n",
                    c->b[c->n_b - 1], e->run->verify_max_rows);
            break;
        }
        report_row(c, B, bi == c->n_b ? " (extrapolated)" : "", break_even(e, B));
    }
    const spec_cost *f = &e->cost_fwd;
    if (f->n_b == 0) return;
    fprintf(stderr, "specd: composed steps (rows the verify op does not take: logprobs, logit adjustments, "
                    "penalties, min_tokens, grammars, prompt chunks; ms, k drafts per row):\n");
    for (int bi = 0; bi < f->n_b; bi++)
        report_row(f, f->b[bi], "",
                   spec_cost_break_even(f, f->b[bi], e->k, e->cands, e->cand_k, e->cand_avail, e->cand_alpha));
}

/* Seconds the start-up timing may take before larger batches are left to extrapolation
 * (a GPU measures every size in milliseconds; a small CPU stops after a few). */
#define SPEC_MEASURE_BUDGET_S 2.0

int engine_spec_measure(engine *e, char *err, size_t errlen) {
    spec_cost *c = &e->cost;
    memset(c, 0, sizeof *c);
    int B = e->cfg.max_batch, K = e->k, rc;
    /* a verify op is timed up to the rows it takes; larger steps never draft */
    if (ngram_verifies(e) && B > e->run->verify_max_rows)
        B = e->run->verify_max_rows;
    int sizes[SPEC_COST_MAX_B], n_sizes = 0;
    for (int b = 1; b < B && n_sizes < SPEC_COST_MAX_B - 1; b *= 2) sizes[n_sizes++] = b;
    sizes[n_sizes++] = B;
    /* 0, K/2 and K drafts per row: the step time is close to linear in between. Not for
     * the verify graphs: a step of up to CUDA's GEMV rows tokens (at the default 2, one row
     * with one draft) runs the fused GEMV forms, more run cuBLAS, so every depth is timed
     * (up to the table's width, K last). */
    c->k[c->n_k++] = 0;
    if (ngram_verifies(e)) {
        for (int k = 1; k <= K && c->n_k < SPEC_COST_MAX_K; k++) c->k[c->n_k++] = k;
        c->k[c->n_k - 1] = K;
    } else {
        if (K / 2 >= 1 && K / 2 < K) c->k[c->n_k++] = K / 2;
        c->k[c->n_k++] = K;
    }
    int ctx = e->cfg.max_seq_len - K - 2 < 256 ? e->cfg.max_seq_len - K - 2 : 256;
    if (ctx < 0) ctx = 0;
    double warm, t_start = now_s();
    if ((rc = time_pass(e, RUNNER_TARGET, 1, 0, ctx, 0, &warm))) goto fail;
    for (int bi = 0; bi < n_sizes && (bi < 3 || now_s() - t_start < SPEC_MEASURE_BUDGET_S); bi++) {
        c->b[c->n_b++] = sizes[bi];
        double dpass = 0;
        if (e->drafter == ENGINE_DRAFTER_MODEL && (rc = time_best(e, RUNNER_DRAFT, c->b[bi], 0, ctx, 0, &dpass)))
            goto fail;
        for (int kj = 0; kj < c->n_k; kj++) {
            double t;
            if ((rc = time_best(e, RUNNER_TARGET, c->b[bi], c->k[kj], ctx, 0, &t))) goto fail;
            /* a draft model also pays its k proposing passes; a plain step leaves it behind */
            c->t[bi][kj] = t + dpass * c->k[kj];
        }
    }
    /* the composed path's verify steps (rows the verify op does not take): the same batch
     * sizes, the plain step as measured, 0 / K/2 / K drafts (they are not padded) */
    memset(&e->cost_fwd, 0, sizeof e->cost_fwd);
    if (ngram_verifies(e) && e->run->forward_samples) {
        spec_cost *f = &e->cost_fwd;
        f->k[f->n_k++] = 0;
        if (K / 2 >= 1 && K / 2 < K) f->k[f->n_k++] = K / 2;
        f->k[f->n_k++] = K;
        for (int bi = 0; bi < c->n_b; bi++) {
            f->b[bi] = c->b[bi];
            f->t[bi][0] = c->t[bi][0];
            for (int kj = 1; kj < f->n_k; kj++)
                if ((rc = time_best(e, RUNNER_TARGET, f->b[bi], f->k[kj], ctx, 1, &f->t[bi][kj]))) goto fail;
        }
        f->n_b = c->n_b;
    }
    if (e->cfg.verbose) report(e);
    return 0;
fail:
    c->n_b = 0;
    e->cost_fwd.n_b = 0;
    return specd_errf(err, errlen, rc, "speculation cost model: a timing pass failed: %s", specd_strerror(rc));
}
