/* The tensor-parallel runner: rank 0's ops broadcast and mirrored on every rank (see
 * runner_tp.h and docs/tensor-parallel.md).
 *
 * Each op is a fixed 32-byte header (tp_op) broadcast first, then, when payload_bytes > 0,
 * its variable part in a second broadcast of exactly that size:
 *
 *   op          header fields                     payload
 *   FORWARD     which, n = rows, n_tokens         rows [n][5] int32, tokens [n_tokens] int32
 *   SLOT_WRITE  a = slot, b = first, n            blocks [n] int32
 *   SLOT_WIN    a = slot, b = first, n            blocks [n] int32 (the window pool's table)
 *   SET_LEN     a = slot, which, b = len          -
 *   COPY_BLOCK  a = dst, b = src                  -
 *   DECODE      n                                 slots [n], tokens [n] int32, runner_sampling [n]
 *   SPEC        n, a = k                          slots [n], tokens [n][2] int32, runner_sampling [n]
 *   STOP        -                                 -
 *
 * A worker whose op fails with SPECD_EINVAL / SPECD_ERANGE carries on: those are argument
 * checks made before any collective, so rank 0's copy of the op failed the same way and
 * nothing is out of step. Any other failure ends the worker (rank 0 then sees it gone). */
#include "engine/tp/runner_tp.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/tp/shard.h"

enum { OP_FORWARD = 1, OP_SLOT_WRITE, OP_SET_LEN, OP_COPY_BLOCK, OP_DECODE, OP_SPEC, OP_SLOT_WIN, OP_STOP };

typedef struct {
    int32_t op, which, n, n_tokens, a, b, c;
    uint32_t payload_bytes;
} tp_op;

#define ROW_WORDS 5  /* slot, n_new, tok_off, n_logits, logits_off */
#define CONFIG_WORDS 64
#define CONFIG_MAGIC 0x47435053  /* "SPCG" */

typedef struct {
    runner base;
    runner_ops ops;          /* local's optional ops decide which of ours exist */
    runner *local;
    tp_comm *t;
    char name[48];
    uint8_t *buf;            /* encoded payload */
    size_t cap;
    int failed;              /* a broadcast failed: the group is broken for good */
} tp_runner;

/* Make *p hold at least `need` bytes (grows, keeps nothing). */
static int reserve(void **p, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t n = need > 2 * *cap ? need : 2 * *cap;
    void *q = realloc(*p, n);
    if (!q) return SPECD_ENOMEM;
    *p = q;
    *cap = n;
    return 0;
}

static int is_transport_error(int rc) {
    return rc == SPECD_EIO || rc == SPECD_ETIMEOUT || rc == SPECD_EFORMAT;
}

/* ---- rank 0 --------------------------------------------------------------------------- */

/* Broadcast the header, then the first payload_bytes of r->buf. */
static int send_op(tp_runner *r, tp_op *h, size_t payload_bytes) {
    if (r->failed) return r->failed;
    h->payload_bytes = (uint32_t)payload_bytes;
    int rc = tp_bcast(r->t, h, sizeof *h, RUNNER_TP_STEP_TIMEOUT_MS);
    if (!rc && payload_bytes) rc = tp_bcast(r->t, r->buf, payload_bytes, RUNNER_TP_STEP_TIMEOUT_MS);
    if (rc) {
        r->failed = rc;
        fprintf(stderr, "specd: tensor parallel: %s\n", tp_comm_error(r->t));
    }
    return rc;
}

/* The local op's result; a failed collective inside it breaks the group. */
static int local_done(tp_runner *r, int rc) {
    if (is_transport_error(rc)) {
        r->failed = rc;
        fprintf(stderr, "specd: tensor parallel: %s\n", tp_comm_error(r->t));
    }
    return rc;
}

/* r->buf as room for n int32 (at least one, so that an empty op still has a buffer). */
static int32_t *words(tp_runner *r, size_t n) {
    return reserve((void **)&r->buf, &r->cap, (n ? n : 1) * sizeof(int32_t)) ? NULL : (int32_t *)r->buf;
}

static int tpr_forward(runner *base, const runner_batch *b) {
    tp_runner *r = (tp_runner *)base;
    if (b->n_rows < 0 || b->n_tokens < 0) return SPECD_EINVAL;
    size_t nw = (size_t)b->n_rows * ROW_WORDS + (size_t)b->n_tokens;
    int32_t *w = words(r, nw);
    if (!w) return SPECD_ENOMEM;
    for (int i = 0; i < b->n_rows; i++) {
        const runner_row *row = &b->rows[i];
        int32_t *o = w + (size_t)i * ROW_WORDS;
        o[0] = row->slot, o[1] = row->n_new, o[2] = row->tok_off, o[3] = row->n_logits, o[4] = row->logits_off;
    }
    if (b->n_tokens) memcpy(w + (size_t)b->n_rows * ROW_WORDS, b->tokens, sizeof(int32_t) * (size_t)b->n_tokens);
    tp_op h = {.op = OP_FORWARD, .which = b->which, .n = b->n_rows, .n_tokens = b->n_tokens};
    int rc = send_op(r, &h, nw * sizeof(int32_t));
    return rc ? rc : local_done(r, r->local->ops->forward(r->local, b));
}

/* SLOT_WRITE or SLOT_WIN: a block table row (first pool or window pool). */
static int write_table(tp_runner *r, int op, int slot, int first, const int32_t *blocks, int n) {
    if (n < 0) return SPECD_EINVAL;
    int32_t *w = words(r, (size_t)n);
    if (!w) return SPECD_ENOMEM;
    if (n) memcpy(w, blocks, sizeof(int32_t) * (size_t)n);
    tp_op h = {.op = op, .a = slot, .b = first, .n = n};
    int rc = send_op(r, &h, (size_t)n * sizeof(int32_t));
    if (rc) return rc;
    const runner_ops *o = r->local->ops;
    return (op == OP_SLOT_WIN ? o->slot_write_win_blocks : o->slot_write_blocks)(r->local, slot, first, blocks, n);
}

static int tpr_slot_write_blocks(runner *base, int slot, int first, const int32_t *blocks, int n) {
    return write_table((tp_runner *)base, OP_SLOT_WRITE, slot, first, blocks, n);
}

static int tpr_slot_write_win_blocks(runner *base, int slot, int first, const int32_t *blocks, int n) {
    return write_table((tp_runner *)base, OP_SLOT_WIN, slot, first, blocks, n);
}

static int tpr_slot_set_len(runner *base, int slot, int which, int len) {
    tp_runner *r = (tp_runner *)base;
    tp_op h = {.op = OP_SET_LEN, .a = slot, .which = which, .b = len};
    int rc = send_op(r, &h, 0);
    return rc ? rc : r->local->ops->slot_set_len(r->local, slot, which, len);
}

static int tpr_slot_get_len(runner *base, int slot, int which) {
    tp_runner *r = (tp_runner *)base;
    return r->local->ops->slot_get_len(r->local, slot, which);
}

static int tpr_copy_block(runner *base, int dst, int src) {
    tp_runner *r = (tp_runner *)base;
    tp_op h = {.op = OP_COPY_BLOCK, .a = dst, .b = src};
    int rc = send_op(r, &h, 0);
    return rc ? rc : local_done(r, r->local->ops->copy_block(r->local, dst, src));
}

/* slots [n], tokens [n * tok_per_row], sampling [n] into r->buf; returns the byte count. */
static size_t encode_rows(tp_runner *r, int n, const int *slots, const int32_t *tokens, int tok_per_row,
                          const runner_sampling *sp) {
    size_t ints = (size_t)n * (1 + (size_t)tok_per_row), bytes = ints * sizeof(int32_t) + (size_t)n * sizeof *sp;
    if (reserve((void **)&r->buf, &r->cap, bytes)) return 0;
    int32_t *w = (int32_t *)r->buf;
    for (int i = 0; i < n; i++) w[i] = slots[i];
    memcpy(w + n, tokens, sizeof(int32_t) * (size_t)n * (size_t)tok_per_row);
    memcpy(r->buf + ints * sizeof(int32_t), sp, (size_t)n * sizeof *sp);
    return bytes;
}

static int tpr_decode(runner *base, const runner_decode_batch *b) {
    tp_runner *r = (tp_runner *)base;
    if (b->n < 1) return SPECD_EINVAL;
    size_t bytes = encode_rows(r, b->n, b->slots, b->tokens, 1, b->sp);
    if (!bytes) return SPECD_ENOMEM;
    tp_op h = {.op = OP_DECODE, .n = b->n};
    int rc = send_op(r, &h, bytes);
    return rc ? rc : local_done(r, r->local->ops->decode(r->local, b));
}

static int tpr_spec_step(runner *base, const runner_spec_batch *b) {
    tp_runner *r = (tp_runner *)base;
    if (b->n < 1) return SPECD_EINVAL;
    size_t bytes = encode_rows(r, b->n, b->slots, b->tokens, 2, b->sp);
    if (!bytes) return SPECD_ENOMEM;
    tp_op h = {.op = OP_SPEC, .n = b->n, .a = b->k};
    int rc = send_op(r, &h, bytes);
    return rc ? rc : local_done(r, r->local->ops->spec_step(r->local, b));
}

static void tpr_destroy(runner *base) {
    tp_runner *r = (tp_runner *)base;
    if (!r) return;
    if (!r->failed) {
        tp_op h = {.op = OP_STOP};
        tp_bcast(r->t, &h, sizeof h, 2000);   /* best effort: a dead worker is not waited for */
    }
    runner_destroy(r->local);
    free(r->buf);
    free(r);
}

static void tpr_abort_group(runner *base) {
    tp_runner *r = (tp_runner *)base;
    r->local->ops->abort_group(r->local);
}

runner *runner_tp_wrap(runner *local, tp_comm *t, char *err, size_t errlen) {
    if (!local || !t || tp_comm_rank(t) != 0) {
        specd_errf(err, errlen, SPECD_EINVAL, "runner_tp_wrap: needs a local runner and rank 0's group");
        return NULL;
    }
    tp_runner *r = calloc(1, sizeof *r);
    if (!r) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    snprintf(r->name, sizeof r->name, "tp%d(%s)", tp_comm_world(t), local->ops->name);
    r->ops = (runner_ops){
        .name = r->name,
        .forward = tpr_forward,
        .slot_write_blocks = tpr_slot_write_blocks,
        .slot_write_win_blocks = local->ops->slot_write_win_blocks ? tpr_slot_write_win_blocks : NULL,
        .slot_set_len = tpr_slot_set_len,
        .slot_get_len = tpr_slot_get_len,
        .copy_block = tpr_copy_block,
        .decode = local->ops->decode ? tpr_decode : NULL,
        .spec_step = local->ops->spec_step ? tpr_spec_step : NULL,
        .abort_group = local->ops->abort_group ? tpr_abort_group : NULL,
        .destroy = tpr_destroy,
    };
    r->base = *local;
    r->base.ops = &r->ops;
    r->base.decode_async = r->base.forward_async = 0;   /* the ranks take their inputs from the host */
    r->local = local;
    r->t = t;
    return &r->base;
}

/* ---- workers -------------------------------------------------------------------------- */

typedef struct {
    runner *local;
    tp_comm *t;
    uint8_t *buf;
    size_t cap;
    runner_row *rows;
    size_t rows_cap;
    float *logits;
    size_t logits_cap;
    int32_t *out_tok;        /* decode / spec outputs, dropped */
    size_t out_tok_cap;
    int *out_n;
    size_t out_n_cap;
    int *slots;
    size_t slots_cap;
    runner_sampling *sp;     /* aligned copy of the payload's sampling parameters */
    size_t sp_cap;
} worker;

static int apply_forward(worker *w, const tp_op *h) {
    size_t need = ((size_t)h->n * ROW_WORDS + (size_t)h->n_tokens) * sizeof(int32_t);
    if (h->n < 0 || h->n_tokens < 0 || h->payload_bytes != need) return SPECD_EFORMAT;
    if (reserve((void **)&w->rows, &w->rows_cap, (size_t)(h->n + 1) * sizeof(runner_row))) return SPECD_ENOMEM;
    const int32_t *in = (const int32_t *)w->buf;
    size_t n_out = 0;
    for (int i = 0; i < h->n; i++) {
        const int32_t *o = in + (size_t)i * ROW_WORDS;
        w->rows[i] = (runner_row){.slot = o[0], .n_new = o[1], .tok_off = o[2], .n_logits = o[3], .logits_off = o[4]};
        if (o[3] > 0 && o[4] >= 0 && (size_t)(o[3] + o[4]) > n_out) n_out = (size_t)(o[3] + o[4]);
    }
    size_t lbytes = (n_out ? n_out : 1) * (size_t)w->local->vocab * sizeof(float);
    if (reserve((void **)&w->logits, &w->logits_cap, lbytes)) return SPECD_ENOMEM;
    runner_batch b = {.which = h->which, .n_rows = h->n, .rows = w->rows,
                      .tokens = in + (size_t)h->n * ROW_WORDS, .n_tokens = h->n_tokens, .logits = w->logits};
    return w->local->ops->forward(w->local, &b);
}

/* DECODE and SPEC: slots, tokens, sampling as encode_rows wrote them. */
static int apply_rows(worker *w, const tp_op *h) {
    int n = h->n, per_row = h->op == OP_SPEC ? 2 : 1, k = h->op == OP_SPEC ? h->a : 0;
    size_t ints = (size_t)(n > 0 ? n : 0) * (1 + (size_t)per_row);
    if (n < 1 || k < 0 || k > 64 || h->payload_bytes != ints * sizeof(int32_t) + (size_t)n * sizeof(runner_sampling))
        return SPECD_EFORMAT;
    if (reserve((void **)&w->out_tok, &w->out_tok_cap, (size_t)n * (size_t)(k + 1) * sizeof(int32_t)) ||
        reserve((void **)&w->out_n, &w->out_n_cap, (size_t)n * sizeof(int)) ||
        reserve((void **)&w->slots, &w->slots_cap, (size_t)n * sizeof(int)) ||
        reserve((void **)&w->sp, &w->sp_cap, (size_t)n * sizeof(runner_sampling)))
        return SPECD_ENOMEM;
    const int32_t *in = (const int32_t *)w->buf;
    int *slots = w->slots;
    runner_sampling *sp = w->sp;
    for (int i = 0; i < n; i++) slots[i] = in[i];
    memcpy(sp, w->buf + ints * sizeof(int32_t), (size_t)n * sizeof *sp);
    int rc;
    if (h->op == OP_SPEC) {
        runner_spec_batch sb = {.n = n, .k = k, .slots = slots, .tokens = in + n, .sp = sp,
                                .out_tokens = w->out_tok, .out_n = w->out_n};
        rc = w->local->ops->spec_step ? w->local->ops->spec_step(w->local, &sb) : SPECD_EUNSUPPORTED;
    } else {
        runner_decode_batch db = {.n = n, .slots = slots, .tokens = in + n, .sp = sp, .out_tokens = w->out_tok};
        rc = w->local->ops->decode ? w->local->ops->decode(w->local, &db) : SPECD_EUNSUPPORTED;
    }
    return rc;
}

static int apply(worker *w, const tp_op *h) {
    runner *l = w->local;
    switch (h->op) {
    case OP_FORWARD: return apply_forward(w, h);
    case OP_SLOT_WRITE:
    case OP_SLOT_WIN:
        if (h->n < 0 || h->payload_bytes != (size_t)h->n * sizeof(int32_t)) return SPECD_EFORMAT;
        if (h->op == OP_SLOT_WIN && !l->ops->slot_write_win_blocks) return SPECD_EFORMAT;
        return (h->op == OP_SLOT_WIN ? l->ops->slot_write_win_blocks : l->ops->slot_write_blocks)(
            l, h->a, h->b, (const int32_t *)w->buf, h->n);
    case OP_SET_LEN: return l->ops->slot_set_len(l, h->a, h->which, h->b);
    case OP_COPY_BLOCK: return l->ops->copy_block(l, h->a, h->b);
    case OP_DECODE:
    case OP_SPEC: return apply_rows(w, h);
    default: return SPECD_EFORMAT;
    }
}

static const char *op_name(int op) {
    static const char *const names[] = {"?", "forward", "slot_write_blocks", "slot_set_len", "copy_block",
                                        "decode", "spec_step", "slot_write_win_blocks", "stop"};
    return op >= 1 && op <= OP_STOP ? names[op] : names[0];
}

int runner_tp_worker_run(runner *local, tp_comm *t, char *err, size_t errlen) {
    if (!local || !t || tp_comm_rank(t) == 0)
        return specd_errf(err, errlen, SPECD_EINVAL, "runner_tp_worker_run: needs a worker rank's group");
    worker w = {.local = local, .t = t};
    int rank = tp_comm_rank(t), rc;
    for (;;) {
        tp_op h;
        if ((rc = tp_bcast(t, &h, sizeof h, -1))) {
            specd_errf(err, errlen, rc, "%s", tp_comm_error(t));
            break;
        }
        if (h.op == OP_STOP) break;
        if ((rc = reserve((void **)&w.buf, &w.cap, h.payload_bytes ? h.payload_bytes : 1)) ||
            (h.payload_bytes && (rc = tp_bcast(t, w.buf, h.payload_bytes, RUNNER_TP_STEP_TIMEOUT_MS)))) {
            specd_errf(err, errlen, rc, "rank %d: %s payload: %s", rank, op_name(h.op),
                       rc == SPECD_ENOMEM ? "out of memory" : tp_comm_error(t));
            break;
        }
        rc = apply(&w, &h);
        if (rc == SPECD_EINVAL || rc == SPECD_ERANGE) continue;   /* rank 0 saw the same */
        if (rc) {
            specd_errf(err, errlen, rc, "rank %d: %s failed: %s%s%s", rank, op_name(h.op), specd_strerror(rc),
                       is_transport_error(rc) ? ": " : "", is_transport_error(rc) ? tp_comm_error(t) : "");
            break;
        }
    }
    free(w.buf);
    free(w.rows);
    free(w.logits);
    free(w.out_tok);
    free(w.out_n);
    free(w.slots);
    free(w.sp);
    return rc;
}

int runner_tp_allreduce(void *ctx, float *buf, size_t n) {
    return tp_allreduce_sum_f32(ctx, buf, n, RUNNER_TP_STEP_TIMEOUT_MS);
}

/* ---- start-up agreement ---------------------------------------------------------------- */

int runner_tp_share_config(tp_comm *t, runner_config *rc, const int32_t *model_sig, int n_sig,
                           int timeout_ms, char *err, size_t errlen) {
    enum { N_SIZES = 9, HDR = 2 };
    if (n_sig < 0 || HDR + N_SIZES + n_sig > CONFIG_WORDS)
        return specd_errf(err, errlen, SPECD_EINVAL, "runner_tp_share_config: %d signature words", n_sig);
    int32_t m[CONFIG_WORDS] = {0};
    int rank = tp_comm_rank(t);
    if (rank == 0) {
        int32_t sizes[N_SIZES] = {rc->num_blocks, rc->block_size, rc->max_batch, rc->max_seq_len,
                                  rc->max_tokens_per_step, rc->num_draft_tokens, rc->rope_bf16_freqs,
                                  rc->win_blocks, rc->win_min_blocks};
        m[0] = CONFIG_MAGIC;
        m[1] = n_sig;
        memcpy(m + HDR, sizes, sizeof sizes);
        memcpy(m + HDR + N_SIZES, model_sig, sizeof(int32_t) * (size_t)n_sig);
    }
    int r = tp_bcast(t, m, sizeof m, timeout_ms);
    if (r) return specd_errf(err, errlen, r, "tensor parallel start-up: %s", tp_comm_error(t));
    if (rank == 0) return 0;
    if (m[0] != CONFIG_MAGIC || m[1] != n_sig)
        return specd_errf(err, errlen, SPECD_EFORMAT, "rank %d: rank 0 sent a malformed start-up message", rank);
    for (int i = 0; i < n_sig; i++)
        if (m[HDR + N_SIZES + i] != model_sig[i])
            return specd_errf(err, errlen, SPECD_EINVAL,
                              "rank %d: its model differs from rank 0's (signature word %d: %d here, %d on "
                              "rank 0): every rank must load the same model and draft",
                              rank, i, model_sig[i], m[HDR + N_SIZES + i]);
    const int32_t *s = m + HDR;
    rc->num_blocks = s[0], rc->block_size = s[1], rc->max_batch = s[2], rc->max_seq_len = s[3];
    rc->max_tokens_per_step = s[4], rc->num_draft_tokens = s[5], rc->rope_bf16_freqs = s[6];
    rc->win_blocks = s[7], rc->win_min_blocks = s[8];
    return 0;
}

/* ---- start-up --------------------------------------------------------------------------- */

static int model_sig(const model *target, const model *draft, int32_t *s) {
    const model_config *t = &target->cfg;
    int n = 0;
    s[n++] = t->n_layers, s[n++] = t->hidden, s[n++] = t->n_heads, s[n++] = t->n_kv_heads;
    s[n++] = t->head_dim, s[n++] = t->ffn, s[n++] = t->vocab;
    s[n++] = draft ? draft->cfg.n_layers : 0, s[n++] = draft ? draft->cfg.hidden : 0;
    s[n++] = draft ? draft->cfg.n_heads : 0, s[n++] = draft ? draft->cfg.ffn : 0;
    s[n++] = t->n_experts, s[n++] = t->moe_ffn, s[n++] = t->sliding_window;
    return n;
}

runner *runner_tp_create(const tp_config *tp, const runner_tp_backend *be, const model *target,
                         const model *draft, runner_config *rc, tp_comm **comm, char *err, size_t errlen) {
    uint8_t uid[TP_UID_BYTES] = {0};   /* no NCCL on the CPU: the id is unused */
    int32_t sig[16];
    *comm = NULL;
    if (shard_check(&target->cfg, tp->world_size, err, errlen)) return NULL;
    if (be && be->unique_id && tp->rank == 0 && be->unique_id(uid, err, errlen)) return NULL;
    tp_comm *t = tp_rendezvous(tp, uid, err, errlen);
    if (!t) return NULL;
    if (runner_tp_share_config(t, rc, sig, model_sig(target, draft, sig), tp->timeout_ms, err, errlen)) {
        tp_comm_close(t);
        return NULL;
    }
    rc->tp_rank = tp->rank;
    rc->tp_world = tp->world_size;
    runner *local;
    if (be) {
        local = be->create(tp, uid, target, draft, rc, err, errlen);
    } else {
        rc->allreduce = runner_tp_allreduce;
        rc->allreduce_ctx = t;
        local = runner_cpu_create(target, draft, rc, err, errlen);
    }
    runner *r = local;
    if (local && tp->rank == 0 && !(r = runner_tp_wrap(local, t, err, errlen))) runner_destroy(local);
    if (!r) {
        tp_comm_close(t);   /* the other ranks see us go and fail too */
        return NULL;
    }
    *comm = t;
    return r;
}
