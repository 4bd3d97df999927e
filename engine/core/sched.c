/* Continuous-batching scheduler (see sched.h for the step, ordering and rejection rules).
 *
 * Two intrusive queues through sched_seq.prev/next (waiting FCFS, running in arrival
 * order), a stack of free slots, and the batch arrays, all sized at create so a step
 * allocates nothing. The scheduler never touches the runner: it only decides who feeds
 * which tokens and keeps the block tables big enough. */
#include "engine/core/sched.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"

typedef struct {
    sched_seq *head, *tail;
    int n;
} seq_list;

struct sched {
    sched_config cfg;
    kv_pool *kv;
    int pool_blocks;         /* allocatable blocks: all but the null block */
    seq_list waiting, running;
    int *free_slots;         /* [max_batch] stack of free slot ids */
    int n_free_slots;
    sched_seq **slot_owner;  /* [max_batch] for sched_check */
    uint64_t next_arrival;
    /* batch storage handed out by sched_schedule */
    sched_seq **b_seqs, **b_preempted, **b_rejected;
    int *b_new;
};

/* ---- intrusive lists ---------------------------------------------------------------- */

static int list_holds(const seq_list *l, const sched_seq *q) {
    return q->prev != NULL || l->head == q;
}

static void list_remove(seq_list *l, sched_seq *q) {
    if (q->prev) q->prev->next = q->next; else l->head = q->next;
    if (q->next) q->next->prev = q->prev; else l->tail = q->prev;
    q->prev = q->next = NULL;
    l->n--;
}

static void list_push_tail(seq_list *l, sched_seq *q) {
    q->next = NULL;
    q->prev = l->tail;
    if (l->tail) l->tail->next = q; else l->head = q;
    l->tail = q;
    l->n++;
}

static void list_push_head(seq_list *l, sched_seq *q) {
    q->prev = NULL;
    q->next = l->head;
    if (l->head) l->head->prev = q; else l->tail = q;
    l->head = q;
    l->n++;
}

/* ---- create / destroy --------------------------------------------------------------- */

sched *sched_create(const sched_config *cfg, kv_pool *kv, char *err, size_t errlen) {
    sched *s = NULL;
    if (!cfg || !kv || cfg->max_batch < 1 || cfg->max_tokens_per_step < 1 ||
        cfg->max_seq_len < 1 || cfg->lookahead < 0 || (cfg->win && (cfg->window < 1 ||
        kv_block_size(cfg->win) != kv_block_size(kv)))) {
        specd_errf(err, errlen, SPECD_EINVAL,
                   "sched_create: need a kv pool, max_batch >= 1, max_tokens_per_step >= 1, "
                   "max_seq_len >= 1, lookahead >= 0, a window pool with a window and the same block size");
        return NULL;
    }
    s = calloc(1, sizeof(*s));
    if (!s) goto fail;
    s->cfg = *cfg;
    s->kv = kv;
    s->pool_blocks = kv_num_blocks(kv) - 1;
    size_t mb = (size_t)cfg->max_batch;
    s->free_slots = malloc(mb * sizeof(*s->free_slots));
    s->slot_owner = calloc(mb, sizeof(*s->slot_owner));
    s->b_seqs = malloc(mb * sizeof(*s->b_seqs));
    s->b_preempted = malloc(mb * sizeof(*s->b_preempted));
    s->b_rejected = malloc(mb * sizeof(*s->b_rejected));
    s->b_new = malloc(mb * sizeof(*s->b_new));
    if (!s->free_slots || !s->slot_owner || !s->b_seqs || !s->b_preempted || !s->b_rejected ||
        !s->b_new)
        goto fail;
    /* Pushed high to low so slot 0 is handed out first. */
    for (int i = cfg->max_batch - 1; i >= 0; i--) s->free_slots[s->n_free_slots++] = i;
    return s;
fail:
    sched_destroy(s);
    specd_errf(err, errlen, SPECD_ENOMEM, "sched_create: out of memory (max_batch %d)",
               cfg->max_batch);
    return NULL;
}

void sched_destroy(sched *s) {
    if (!s) return;
    free(s->free_slots);
    free(s->slot_owner);
    free(s->b_seqs);
    free(s->b_preempted);
    free(s->b_rejected);
    free(s->b_new);
    free(s);
}

/* ---- slots and state changes -------------------------------------------------------- */

static void slot_take(sched *s, sched_seq *q) {
    q->slot = s->free_slots[--s->n_free_slots];
    q->slot_epoch++;
    s->slot_owner[q->slot] = q;
}

static void slot_give_back(sched *s, sched_seq *q) {
    if (q->slot < 0) return;
    s->slot_owner[q->slot] = NULL;
    s->free_slots[s->n_free_slots++] = q->slot;
    q->slot = -1;
}

/* Tokens of table capacity: the hard ceiling of what a sequence can ever hold. */
static int table_tokens(const sched *s, const sched_seq *q) {
    int64_t t = (int64_t)q->kv.cap * kv_block_size(s->kv);
    if (t > s->cfg.max_seq_len + (int64_t)s->cfg.lookahead)
        t = s->cfg.max_seq_len + (int64_t)s->cfg.lookahead;
    return (int)t;
}

/* KV tokens to reserve before feeding n_new tokens from n_computed. Returns 0, or the
 * reject code when the sequence can never be given that much. */
static int target_tokens(const sched *s, const sched_seq *q, int n_computed, int n_new,
                         int *target) {
    int limit = table_tokens(s, q);
    int t = n_computed + n_new;
    if (t > limit || t > s->cfg.max_seq_len) return SPECD_ERANGE;
    /* Decoding (prompt computed): room for the draft's lookahead tokens too. */
    if (n_computed >= q->n_prompt) t = t + s->cfg.lookahead > limit ? limit : t + s->cfg.lookahead;
    if (kv_blocks_for(s->kv, t) > s->pool_blocks) return SPECD_ENOSPACE;
    *target = t;
    return 0;
}

/* Both tables' blocks back to their pools. */
static void release_kv(sched *s, sched_seq *q) {
    kv_seq_release(s->kv, &q->kv);
    if (s->cfg.win) kv_seq_release(s->cfg.win, &q->kvw);
}

/* Both tables hold at least t tokens (all or nothing per table). */
static int reserve_kv(sched *s, sched_seq *q, int t) {
    int rc = kv_seq_reserve(s->kv, &q->kv, t);
    if (rc == 0 && s->cfg.win) rc = kv_seq_reserve(s->cfg.win, &q->kvw, t);
    return rc;
}

static void reject(sched *s, seq_list *from, sched_seq *q, int code, sched_batch *out) {
    list_remove(from, q);
    slot_give_back(s, q);
    release_kv(s, q);
    q->state = SEQ_REJECTED;
    q->reject_code = code;
    out->rejected[out->n_rejected++] = q;
}

/* Recompute-style preemption: drop all KV (still cached for a later prefix hit) and go
 * back to the waiting head, ahead of everyone who arrived later. */
static void preempt(sched *s, sched_seq *q, sched_batch *out) {
    list_remove(&s->running, q);
    slot_give_back(s, q);
    release_kv(s, q);
    q->n_computed = 0;
    q->state = SEQ_WAITING;
    q->n_preemptions++;
    list_push_head(&s->waiting, q);
    out->preempted[out->n_preempted++] = q;
}

static void batch_add(sched_batch *out, sched_seq *q, int n_new) {
    out->seqs[out->n] = q;
    out->n_new[out->n] = n_new;
    out->n++;
}

/* ---- public API --------------------------------------------------------------------- */

int sched_add(sched *s, sched_seq *q) {
    if (q->n_tokens < 1 || q->n_prompt < 1 || q->n_prompt > q->n_tokens || q->kv.n_blocks != 0 ||
        q->kvw.n_blocks != 0 || !q->tokens || (s->cfg.win && q->kvw.cap < q->kv.cap))
        return SPECD_EINVAL;
    if (q->n_tokens > s->cfg.max_seq_len || q->n_tokens > table_tokens(s, q)) return SPECD_ERANGE;
    if (kv_blocks_for(s->kv, q->n_tokens) > s->pool_blocks) return SPECD_ENOSPACE;
    q->n_computed = 0;
    q->n_cached_tokens = 0;
    q->n_preemptions = 0;
    q->reject_code = 0;
    q->slot = -1;
    q->state = SEQ_WAITING;
    q->arrival = s->next_arrival++;
    q->prev = q->next = NULL;
    list_push_tail(&s->waiting, q);
    return 0;
}

void sched_remove(sched *s, sched_seq *q) {
    if (q->state == SEQ_WAITING && list_holds(&s->waiting, q)) list_remove(&s->waiting, q);
    else if (q->state == SEQ_RUNNING && list_holds(&s->running, q)) list_remove(&s->running, q);
    slot_give_back(s, q);
    release_kv(s, q);
    q->state = SEQ_FINISHED;
}

/* A prompt chunk of an all_logits sequence from n_computed: n_new capped by what is left
 * of the step's logits budget (*logit_left, taken). */
static int cap_logits(const sched_seq *q, int n_computed, int n_new, int *logit_left) {
    if (!q->all_logits || n_computed >= q->n_prompt) return n_new;
    if (n_new > *logit_left) n_new = *logit_left;
    *logit_left -= n_new;
    return n_new;
}

/* Prompt tokens this step may feed: max_prefill_decoding when a running sequence is past
 * its prompt (it decodes in this step, or its token is still on the way), else no bound
 * but the budget. */
static int prefill_allowance(const sched *s) {
    if (s->cfg.max_prefill_decoding <= 0) return INT_MAX;
    for (const sched_seq *q = s->running.head; q; q = q->next)
        if (!q->paused && q->n_computed >= q->n_prompt) return s->cfg.max_prefill_decoding;
    return INT_MAX;
}

/* Phase 1: the running sequences, oldest first. Returns the budget left. */
static int schedule_running(sched *s, sched_batch *out, int budget, int *logit_left, int *prefill_left) {
    sched_seq *q = s->running.head;
    while (q && budget > 0) {
        int remaining = q->n_tokens - q->n_computed;
        if (remaining <= 0 || q->paused) { q = q->next; continue; }   /* waits for its token / client */
        int n_new = remaining < budget ? remaining : budget, target = 0;
        const int prompt = q->n_computed < q->n_prompt;
        if (prompt && *prefill_left == 0) { q = q->next; continue; }   /* its chunk waits for the next step */
        if (prompt && n_new > *prefill_left) n_new = *prefill_left;
        if (q->all_logits && q->n_computed < q->n_prompt && *logit_left == 0) { q = q->next; continue; }
        n_new = cap_logits(q, q->n_computed, n_new, logit_left);
        int rc = target_tokens(s, q, q->n_computed, n_new, &target);
        if (rc) {
            sched_seq *nq = q->next;
            reject(s, &s->running, q, rc, out);
            q = nq;
            continue;
        }
        while (reserve_kv(s, q, target) != 0) {
            /* Out of blocks: the newest running sequence (the tail, never one already in
             * this batch) gives its blocks back. That may be q itself. */
            sched_seq *victim = s->running.tail;
            preempt(s, victim, out);
            if (victim == q) break;
        }
        if (q->state != SEQ_RUNNING) break;   /* q was the tail: nobody left after it */
        batch_add(out, q, n_new);
        budget -= n_new;
        if (prompt) *prefill_left -= n_new;
        q = q->next;
    }
    return budget;
}

/* Phase 2: admit waiting sequences FCFS. */
static void schedule_waiting(sched *s, sched_batch *out, int budget, int logit_left, int prefill_left) {
    int bs = kv_block_size(s->kv);
    if (prefill_left < budget) budget = prefill_left;   /* every admitted row feeds prompt tokens */
    while (s->waiting.head && budget > 0 && s->n_free_slots > 0) {
        sched_seq *q = s->waiting.head;
        int evictable = 0, target = 0;
        /* prompt logits need every prompt position computed: no hit */
        int hit = q->all_logits ? 0 : kv_prefix_lookup(s->kv, q->tokens, q->n_tokens, q->kv.cap, &evictable);
        int evictable_win = 0;
        if (s->cfg.win && hit > 0) {
            /* the window pool must hold the hit's last window too; a shorter hit then */
            int h = kv_prefix_lookup_window(s->cfg.win, q->tokens, hit / bs, s->cfg.window, &evictable_win);
            if (h < hit) hit = kv_prefix_lookup(s->kv, q->tokens, h + 1, q->kv.cap, &evictable);
        }
        int remaining = q->n_tokens - hit;
        int n_new = remaining < budget ? remaining : budget;
        if (q->all_logits && hit < q->n_prompt && logit_left == 0) break;   /* FCFS: wait */
        n_new = cap_logits(q, hit, n_new, &logit_left);
        int rc = target_tokens(s, q, hit, n_new, &target);
        /* The whole sequence must fit one day, not just this chunk. */
        if (rc == 0 && kv_blocks_for(s->kv, q->n_tokens) > s->pool_blocks) rc = SPECD_ENOSPACE;
        if (rc) {
            if (out->n_rejected == s->cfg.max_batch) break;   /* report the rest next step */
            reject(s, &s->waiting, q, rc, out);
            continue;
        }
        /* Hit blocks that sit on the free list stop being allocatable once taken. */
        int need = kv_blocks_for(s->kv, target) - hit / bs;
        if (need > kv_num_free(s->kv) - evictable) break;   /* FCFS: nobody jumps ahead */
        if (s->cfg.win && need > kv_num_free(s->cfg.win) - evictable_win) break;
        int got = q->all_logits ? 0 : kv_seq_match_prefix(s->kv, &q->kv, q->tokens, hit + 1);
        if (got == hit && s->cfg.win && hit > 0) got = kv_seq_match_window(s->cfg.win, &q->kvw, q->tokens, hit, s->cfg.window);
        if (got != hit || reserve_kv(s, q, target) != 0) {
            release_kv(s, q);   /* cannot happen: lookup and match agree */
            break;
        }
        list_remove(&s->waiting, q);
        list_push_tail(&s->running, q);
        q->state = SEQ_RUNNING;
        q->n_computed = hit;
        q->n_cached_tokens = hit;
        slot_take(s, q);
        batch_add(out, q, n_new);
        budget -= n_new;
    }
}

int sched_schedule(sched *s, sched_batch *out) {
    memset(out, 0, sizeof(*out));
    out->seqs = s->b_seqs;
    out->n_new = s->b_new;
    out->preempted = s->b_preempted;
    out->rejected = s->b_rejected;
    int logit_left = s->cfg.max_logit_tokens, prefill_left = prefill_allowance(s);
    int budget = schedule_running(s, out, s->cfg.max_tokens_per_step, &logit_left, &prefill_left);
    /* After a preemption the pool is tight: admitting newcomers would only get them
     * preempted again (thrashing), so wait for blocks to come back. */
    if (out->n_preempted == 0) schedule_waiting(s, out, budget, logit_left, prefill_left);
    return 0;
}

int sched_lookahead_room(const sched *s, const sched_seq *q, int n_new) {
    if (q->n_computed < q->n_prompt) return 0;
    int room = q->kv.n_blocks * kv_block_size(s->kv) - (q->n_computed + n_new);
    if (room > s->cfg.lookahead) room = s->cfg.lookahead;
    return room > 0 ? room : 0;
}

int sched_num_running(const sched *s) { return s->running.n; }
int sched_num_waiting(const sched *s) { return s->waiting.n; }

static int list_fill(const seq_list *l, sched_seq **out, int cap) {
    int n = 0;
    for (sched_seq *q = l->head; q && n < cap; q = q->next) out[n++] = q;
    return n;
}

int sched_running(const sched *s, sched_seq **out, int cap) { return list_fill(&s->running, out, cap); }
int sched_waiting(const sched *s, sched_seq **out, int cap) { return list_fill(&s->waiting, out, cap); }

/* ---- invariant check ---------------------------------------------------------------- */

static int check_list(const sched *s, const seq_list *l, sched_state st, uint64_t *last_arrival,
                      int *first, char *err, size_t errlen) {
    const char *name = st == SEQ_RUNNING ? "running" : "waiting";
    int n = 0;
    const sched_seq *prev = NULL;
    for (const sched_seq *q = l->head; q; prev = q, q = q->next) {
        if (++n > l->n)
            return specd_errf(err, errlen, SPECD_ESTATE, "sched_check: %s list longer than %d", name, l->n);
        if (q->prev != prev || q->state != st)
            return specd_errf(err, errlen, SPECD_ESTATE,
                              "sched_check: seq %llu in %s list: bad link or state %d",
                              (unsigned long long)q->id, name, (int)q->state);
        if (!*first && q->arrival <= *last_arrival)
            return specd_errf(err, errlen, SPECD_ESTATE,
                              "sched_check: seq %llu out of arrival order in %s list",
                              (unsigned long long)q->id, name);
        *first = 0;
        *last_arrival = q->arrival;
        if (q->n_computed < 0 || q->n_computed > q->n_tokens)
            return specd_errf(err, errlen, SPECD_ESTATE, "sched_check: seq %llu n_computed %d of %d",
                              (unsigned long long)q->id, q->n_computed, q->n_tokens);
        if (st == SEQ_RUNNING) {
            if (q->slot < 0 || q->slot >= s->cfg.max_batch || s->slot_owner[q->slot] != q)
                return specd_errf(err, errlen, SPECD_ESTATE, "sched_check: seq %llu holds bad slot %d",
                                  (unsigned long long)q->id, q->slot);
        } else if (q->slot != -1 || q->kv.n_blocks != 0 || q->kvw.n_blocks != 0 || q->n_computed != 0) {
            return specd_errf(err, errlen, SPECD_ESTATE,
                              "sched_check: waiting seq %llu holds slot %d / %d blocks / %d computed",
                              (unsigned long long)q->id, q->slot, q->kv.n_blocks, q->n_computed);
        }
    }
    if (n != l->n || l->tail != prev)
        return specd_errf(err, errlen, SPECD_ESTATE, "sched_check: %s list count %d / tail mismatch (%d)",
                          name, l->n, n);
    return 0;
}

int sched_check(const sched *s, char *err, size_t errlen) {
    uint64_t last = 0;
    int first = 1, rc;
    if ((rc = check_list(s, &s->running, SEQ_RUNNING, &last, &first, err, errlen))) return rc;
    if ((rc = check_list(s, &s->waiting, SEQ_WAITING, &last, &first, err, errlen))) return rc;
    if (s->running.n + s->n_free_slots != s->cfg.max_batch)
        return specd_errf(err, errlen, SPECD_ESTATE, "sched_check: %d running + %d free slots != %d",
                          s->running.n, s->n_free_slots, s->cfg.max_batch);
    for (int i = 0; i < s->n_free_slots; i++) {
        int sl = s->free_slots[i];
        if (sl < 0 || sl >= s->cfg.max_batch || s->slot_owner[sl])
            return specd_errf(err, errlen, SPECD_ESTATE, "sched_check: free slot %d is owned", sl);
        for (int j = 0; j < i; j++)
            if (s->free_slots[j] == sl)
                return specd_errf(err, errlen, SPECD_ESTATE, "sched_check: slot %d free twice", sl);
    }
    return 0;
}
