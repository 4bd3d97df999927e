/* The CUDA runner's speculative step (runner_ops.spec_step; contract in engine/core/runner.h,
 * reference in runner_cpu.c cpu_spec_step), captured as one CUDA graph per padded batch
 * size (the decode graphs' size list, largest first):
 *   draft length = target length - 1 -> draft pass over [second-to-last, last] -> pick d1
 *   -> k-1 one-token draft passes (d2..dk) -> target pass over [last, d1..dk] with logits at
 *   all k+1 positions -> acceptance (greedy prefix or rejection sampling) -> target length
 *   += accepted + 1, draft length = min(L + k, new target length) -> the dummy slot's
 *   lengths zeroed by a captured store.
 * Positions and lengths are read from the device lengths table, so a graph replays for any
 * context. Around the graph, on the stream: the per-step inputs (tokens, slots, prev rows,
 * sampling parameters) from pinned memory to d_sp_in, then for rows that continue a row of
 * the speculative step before (runner_spec_batch.prev_row, async scheduling) their tokens
 * and counters from that step's outputs, still in d_sp_out (k_spec_feed_prev); after it,
 * the outputs to their half of h_sp_out, as a decode step's (cuda_wait_queued). Padding
 * rows use the dummy slot, whose block table points only at block 0.
 *
 * Layout of d_sp_i32 (MB = max_batch, K1 = k + 1), in int32 entries:
 *   tok_slot2[2MB] tok_j2[2MB] row_off2[MB] twos[MB] lrows2[MB] item2_row[2MB] item2_q0[2MB]
 *   tok_slotv[MB*K1] tok_jv[MB*K1] row_offv[MB] kp1[MB] itemv_row[MB*K1] itemv_q0[MB*K1]
 *   vtok[MB*K1] drafts[k*MB]
 * tok_slot2, tok_slotv, vtok and drafts change every step (written on the device); the
 * rest is layout fixed at creation. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cuda/cuda_internal.h"
#include "engine/core/err.h"
#include "engine/core/spec.h"

typedef struct {
    int32_t *tok_slot2, *tok_j2, *row_off2, *twos, *lrows2, *item2_row, *item2_q0;
    int32_t *tok_slotv, *tok_jv, *row_offv, *kp1, *itemv_row, *itemv_q0, *vtok, *drafts;
    int32_t *itemt_row, *itemt_q0;   /* the verify pass's items one per token (verify_as_decode) */
    size_t n;   /* total entries */
} sp_layout;

static sp_layout layout(int32_t *base, int MB, int k) {
    sp_layout l;
    size_t K1 = (size_t)k + 1, o = 0;
    int32_t *b = base;
#define TAKE(f, cnt) (l.f = b ? b + o : NULL, o += (cnt))
    TAKE(tok_slot2, 2 * (size_t)MB); TAKE(tok_j2, 2 * (size_t)MB); TAKE(row_off2, MB);
    TAKE(twos, MB); TAKE(lrows2, MB); TAKE(item2_row, 2 * (size_t)MB); TAKE(item2_q0, 2 * (size_t)MB);
    TAKE(tok_slotv, MB * K1); TAKE(tok_jv, MB * K1); TAKE(row_offv, MB); TAKE(kp1, MB);
    TAKE(itemv_row, MB * K1); TAKE(itemv_q0, MB * K1); TAKE(vtok, MB * K1); TAKE(drafts, (size_t)k * MB);
    TAKE(itemt_row, MB * K1); TAKE(itemt_q0, MB * K1);
#undef TAKE
    l.n = o;
    return l;
}

/* Inputs: tokens[2MB] int32 | slots[MB] int32 | prev[MB] int32 | pad to 16 | params[MB]. */
static size_t in_par_off(int MB) { return cuda_par_off((size_t)MB * 16); }
static size_t in_bytes(int MB) { return cuda_par_block_bytes((size_t)MB * 16, MB); }
static size_t out_bytes(int MB, int k) { return (size_t)MB * (size_t)(k + 2) * 4; }

/* Query tokens per attention item, as cuda_forward chooses them; but a row of a few
 * tokens whose query heads stay under a tensor-core tile (16 rows) gets one item per
 * token, which k_attention runs on its decode kernel: SmolLM2-135M, H200, verify step of
 * one row (ms, k = 1..4 drafts), 0.83 / 1.33 / 1.40 / 1.49 of which attention 0.35 /
 * 0.57 / 0.64 / 0.73 on the tiled kernel (SPECD_DEBUG_SKIP=attn), against 0.58 for a
 * plain decode step with attention 0.13. */
static int attn_qt(const cuda_model *cm, int n_new, int as_decode) {
    int G = cm->H / cm->KVH, cap_rows = cm->D > 128 ? 32 : 64;
    if (G <= 8 && (G * n_new < 16 || as_decode) && (cm->D == 64 || cm->D == 128)) return 1;
    int qt = cap_rows / G < 1 ? 1 : cap_rows / G;
    return qt > n_new ? n_new : qt;
}

/* Whether a verify pass of B rows of K1 tokens may run as a decode step of B rows would,
 * token by token (cuda_tuning.verify_gemv): the GEMV on its FMA form (gemv_fma_only), which
 * sums each token's dot in the order it does at one token, one attention item per token on
 * the decode kernel, and the decode step's key splits (verify_splits). Then a greedy verify
 * emits exactly the plain decode's tokens. Larger passes run on cuBLAS and the tensor-core
 * attention; so do these where that timed faster at capture (r->vf_vd). */
static int verify_as_decode(const cuda_runner *r, int B, int K1) {
    const cuda_model *cm = &r->m[0];
    return r->tune.verify_gemv && !r->tune.no_gemv && B <= r->tune.gemv_rows && B * K1 <= CUDA_GEMV_MAX_ROWS &&
           attn_qt(cm, K1, 1) == 1;   /* (the decode kernel takes the model's heads) */
}

/* The kernels' tuning with the bf16 GEMV held on its FMA form at every token count (on), or
 * as configured: the FMA form sums each token's dot in the same order whatever the pass's
 * token count, where the tensor-core form (3..8 tokens by default) sums it otherwise. The
 * choice is made on the host at launch, so a captured graph keeps it. */
static void gemv_fma_only(const cuda_runner *r, int on) {
    k_tuning t = r->tune.k;
    if (on) t.gemv_tc_min = CUDA_GEMV_MAX_ROWS + 1;
    k_set_tuning(&t);
}

/* Key splits so that items x KV heads x splits is about two waves; the kernel divides each
 * item's actual context (read on the device) over them. */
static int splits_for(const cuda_runner *r, int which, int n_items, int n_tok) {
    long blocks = (long)n_items * r->m[which].KVH;
    long n = (2L * r->n_sm + blocks - 1) / blocks;
    if (n > r->dec_splits) n = r->dec_splits;
    if (n * n_tok > (long)r->ws_tok_splits) n = (long)r->ws_tok_splits / n_tok;
    return n < 1 ? 1 : (int)n;
}

/* Key splits of a verify pass of B rows, K1 tokens each, in ni items of qt query tokens.
 * Run as a decode step (vd, each token an item of its own on the decode kernel), its keys
 * split as a decode step of B rows splits them, so a token's attention is the same
 * partition of the same keys, merged in the same order, as when plain decoding reaches it;
 * otherwise enough splits for its items. */
static int verify_splits(const cuda_runner *r, int which, int qt, int B, int ni, int K1, int vd) {
    if (vd && qt == 1 && !r->tune.verify_item_splits) return splits_for(r, which, B, B * K1);
    return splits_for(r, which, ni, B * K1);
}

/* The target's pass over B rows of K1 tokens (row i's at i * K1) and the logits of every
 * position into `logits`; vd: as a decode step would run it (verify_as_decode). */
typedef struct {
    const int32_t *tokens, *tok_slot, *tok_j, *row_off, *kp1, *slots;
    const int32_t *item_row, *item_q0;     /* items of attn_qt(K1) tokens */
    const int32_t *itemt_row, *itemt_q0;   /* items of one token */
} verify_in;

static int verify_pass(cuda_runner *r, int B, int K1, int vd, const verify_in *v, float *logits) {
    const int qt = attn_qt(&r->m[0], K1, vd), ni = B * ((K1 + qt - 1) / qt);
    cuda_pass p = {
        .which = RUNNER_TARGET, .n_tok = B * K1, .n_rows = B, .tokens = v->tokens, .tok_slot = v->tok_slot,
        .tok_j = v->tok_j, .row_slot = v->slots, .row_tok_off = v->row_off, .row_n_new = v->kp1,
        .item_row = qt == 1 ? v->itemt_row : v->item_row, .item_q0 = qt == 1 ? v->itemt_q0 : v->item_q0,
        .n_items = ni, .qt = qt, .n_splits = verify_splits(r, RUNNER_TARGET, qt, B, ni, K1, vd), .split_len = 0,
        .gemv_rows = vd ? B * K1 : 0,
    };
    if (vd) gemv_fma_only(r, 1);
    int rc = cuda_enqueue_pass(r, &p);
    if (!rc) rc = cuda_enqueue_logits_out(r, RUNNER_TARGET, NULL, B * K1, logits);
    if (vd) gemv_fma_only(r, 0);
    return rc;
}

/* The fixed layout of a pass of MB rows feeding K1 tokens each, qt query tokens per
 * attention item: token j of row i at i * K1, row offsets, lengths, and the items. */
static void fill_items(int MB, int K1, int qt, int32_t *item_row, int32_t *item_q0) {
    const int ipr = (K1 + qt - 1) / qt;
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < ipr; c++) {
            item_row[i * ipr + c] = i;
            item_q0[i * ipr + c] = c * qt;
        }
}

static void fill_rows_layout(int MB, int K1, int qt, int32_t *tok_j, int32_t *row_off, int32_t *n_new,
                             int32_t *item_row, int32_t *item_q0) {
    for (int i = 0; i < MB; i++) {
        for (int j = 0; j < K1; j++) tok_j[i * K1 + j] = j;
        row_off[i] = i * K1;
        n_new[i] = K1;
    }
    fill_items(MB, K1, qt, item_row, item_q0);
}

static void cuda_verify_free(cuda_runner *r);

int cuda_spec_alloc(cuda_runner *r, int k) {
    const int MB = r->base.cfg.max_batch, K1 = k + 1, V = r->m[0].c.vocab;
    sp_layout l = layout(NULL, MB, k);
    int32_t *h = calloc(l.n, sizeof(int32_t));
    if (!h) return SPECD_ENOMEM;
    sp_layout hl = layout(h, MB, k);
    fill_rows_layout(MB, 2, attn_qt(&r->m[1], 2, 0), hl.tok_j2, hl.row_off2, hl.twos, hl.item2_row, hl.item2_q0);
    for (int i = 0; i < MB; i++) hl.lrows2[i] = 2 * i + 1;
    fill_rows_layout(MB, K1, attn_qt(&r->m[0], K1, 0), hl.tok_jv, hl.row_offv, hl.kp1, hl.itemv_row, hl.itemv_q0);
    fill_items(MB, K1, 1, hl.itemt_row, hl.itemt_q0);
    size_t tl = (size_t)MB * K1 * V * sizeof(float), q = (size_t)k * MB * V * sizeof(float);
    CU_CHECK(r, cudaMalloc((void **)&r->d_sp_i32, l.n * sizeof(int32_t)));
    CU_CHECK(r, cudaMemcpy(r->d_sp_i32, h, l.n * sizeof(int32_t), cudaMemcpyHostToDevice));
    CU_CHECK(r, cudaMalloc((void **)&r->d_sp_tl, tl));
    CU_CHECK(r, cudaMalloc((void **)&r->d_sp_q, q));
    CU_CHECK(r, cudaMemset(r->d_sp_q, 0, q));
    CU_CHECK(r, cudaMalloc(&r->d_sp_in, in_bytes(MB)));
    CU_CHECK(r, cudaMalloc(&r->d_sp_out, out_bytes(MB, k)));
    CU_CHECK(r, cudaMallocHost(&r->h_sp_in, in_bytes(MB)));
    CU_CHECK(r, cudaMallocHost(&r->h_sp_out, 2 * out_bytes(MB, k)));
    memset(r->h_sp_in, 0, in_bytes(MB));
    r->sp_pslots = malloc(2 * (size_t)MB * sizeof(int));
    if (!r->sp_pslots) {
        free(h);
        return SPECD_ENOMEM;
    }
    r->work_bytes += l.n * sizeof(int32_t) + tl + q + in_bytes(MB) + out_bytes(MB, k);
    r->sp_k = k;
    free(h);
    return 0;
fail:
    free(h);
    return SPECD_ECUDA;
}

void cuda_spec_free(cuda_runner *r) {
    for (int i = 0; i < r->sp_n_graphs; i++) cudaGraphExecDestroy(r->sp_graphs[i]);
    r->sp_n_graphs = 0;
    void *dev[] = {r->d_sp_i32, r->d_sp_tl, r->d_sp_q, r->d_sp_in, r->d_sp_out};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) cudaFree(dev[i]);
    if (r->h_sp_in) cudaFreeHost(r->h_sp_in);
    if (r->h_sp_out) cudaFreeHost(r->h_sp_out);
    free(r->sp_pslots);
    r->sp_pslots = NULL;
    r->sp_last_rows = 0;
    r->d_sp_i32 = NULL;
    r->d_sp_tl = r->d_sp_q = NULL;
    r->d_sp_in = r->d_sp_out = r->h_sp_in = r->h_sp_out = NULL;
    r->sp_k = 0;
    cuda_verify_free(r);
}

/* The whole step for B rows (live rows then padding rows), enqueued on the stream. */
static int spec_enqueue(cuda_runner *r, int B) {
    const int MB = r->base.cfg.max_batch, k = r->sp_k, K1 = k + 1, V = r->m[0].c.vocab;
    const int dummy = r->dummy;
    sp_layout l = layout(r->d_sp_i32, MB, k);
    int32_t *tokens = r->d_sp_in, *slots = tokens + 2 * MB;
    const k_sample_params *par = (const k_sample_params *)((char *)r->d_sp_in + in_par_off(MB));
    int32_t *out_tok = r->d_sp_out, *out_n = out_tok + (size_t)MB * K1;
    cudaStream_t s = r->stream;
    int rc;

    K_CHECK(r, k_spec_prep(r->d_lens, slots, B, k, dummy, l.tok_slot2, l.tok_slotv, s));

    /* 1. draft over [second-to-last, last] at L-1, L; logits of the last -> d1 */
    int qt2 = attn_qt(&r->m[1], 2, 0), ni2 = B * ((2 + qt2 - 1) / qt2);
    cuda_pass p = {
        .which = RUNNER_DRAFT, .n_tok = 2 * B, .n_rows = B, .tokens = tokens,
        .tok_slot = l.tok_slot2, .tok_j = l.tok_j2, .row_slot = slots, .row_tok_off = l.row_off2,
        .row_n_new = l.twos, .item_row = l.item2_row, .item_q0 = l.item2_q0, .n_items = ni2,
        .qt = qt2, .n_splits = splits_for(r, RUNNER_DRAFT, ni2, 2 * B), .split_len = 0,
    };
    if ((rc = cuda_enqueue_pass(r, &p))) return rc;
    if ((rc = cuda_enqueue_logits_out(r, RUNNER_DRAFT, l.lrows2, B, r->d_logits))) return rc;
    K_CHECK(r, k_probs(r->d_logits, r->d_sp_q, B, V, par, 1, s));
    K_CHECK(r, k_spec_draft_pick(r->d_logits, r->d_sp_q, B, V, par, 0, SPEC_SALT_DRAFT, l.drafts, s));
    K_CHECK(r, k_advance_lens(r->d_lens, slots, l.twos, B, RUNNER_DRAFT, dummy, s));

    /* 2. k-1 one-token draft passes */
    for (int j = 1; j < k; j++) {
        float *q = r->d_sp_q + (size_t)j * MB * V;
        p = (cuda_pass){
            .which = RUNNER_DRAFT, .n_tok = B, .n_rows = B, .tokens = l.drafts + (size_t)(j - 1) * MB,
            .tok_slot = slots, .tok_j = r->d_zeros, .row_slot = slots, .row_tok_off = r->d_iota,
            .row_n_new = r->d_ones, .item_row = r->d_iota, .item_q0 = r->d_zeros, .n_items = B,
            .qt = 1, .n_splits = splits_for(r, RUNNER_DRAFT, B, B), .split_len = 0,
        };
        if ((rc = cuda_enqueue_pass(r, &p))) return rc;
        if ((rc = cuda_enqueue_logits_out(r, RUNNER_DRAFT, NULL, B, r->d_logits))) return rc;
        K_CHECK(r, k_probs(r->d_logits, q, B, V, par, 1, s));
        K_CHECK(r, k_spec_draft_pick(r->d_logits, q, B, V, par, j, SPEC_SALT_DRAFT,
                                     l.drafts + (size_t)j * MB, s));
        K_CHECK(r, k_advance_lens(r->d_lens, slots, r->d_ones, B, RUNNER_DRAFT, dummy, s));
    }

    /* 3. target verify over [last, d1..dk] at L..L+k, logits at every position */
    K_CHECK(r, k_spec_verify_tokens(tokens, l.drafts, B, k, MB, l.vtok, s));
    const verify_in vin = {.tokens = l.vtok, .tok_slot = l.tok_slotv, .tok_j = l.tok_jv, .row_off = l.row_offv,
                           .kp1 = l.kp1, .slots = slots, .item_row = l.itemv_row, .item_q0 = l.itemv_q0,
                           .itemt_row = l.itemt_row, .itemt_q0 = l.itemt_q0};
    /* (as a decode step only where forced: this step's forms are not timed) */
    if ((rc = verify_pass(r, B, K1, r->tune.verify_gemv == 2 && verify_as_decode(r, B, K1), &vin, r->d_sp_tl)))
        return rc;
    K_CHECK(r, k_probs(r->d_sp_tl, r->d_sp_tl, B * K1, V, par, K1, s));

    /* 4-5. acceptance and the length advance, then the dummy reset */
    K_CHECK(r, k_spec_accept(r->d_sp_tl, r->d_sp_q, B, V, k, MB, l.drafts, MB, par, slots, dummy,
                             SPEC_SALT_ACCEPT, r->d_lens, out_tok, out_n, s));
    if (!r->tune.skip_dummy_reset)
        CU_CHECK(r, cudaMemsetAsync(r->d_lens + 2 * dummy, 0, 2 * sizeof(int32_t), s));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* Pinned inputs: n live rows, then padding rows on the dummy slot. */
static void fill_in(cuda_runner *r, const runner_spec_batch *b, int B) {
    const int MB = r->base.cfg.max_batch;
    int32_t *tokens = r->h_sp_in, *slots = tokens + 2 * MB, *prev = tokens + 3 * MB;
    k_sample_params *par = (k_sample_params *)((char *)r->h_sp_in + in_par_off(MB));
    int n = b ? b->n : 0;
    for (int i = 0; i < B; i++) {
        k_sample_params q = {0};
        if (i < n) {
            prev[i] = b->prev_row ? b->prev_row[i] : -1;
            tokens[2 * i] = prev[i] >= 0 ? 0 : b->tokens[2 * i];
            tokens[2 * i + 1] = prev[i] >= 0 ? 0 : b->tokens[2 * i + 1];
            slots[i] = b->slots[i];
            if (b->sp) q = cuda_sample_params(&b->sp[i]);
        } else {
            tokens[2 * i] = tokens[2 * i + 1] = 0;
            prev[i] = -1;
            slots[i] = r->dummy;
        }
        par[i] = q;
    }
}

/* The inputs to the device, then the tokens and counters of rows that continue the step
 * before (any: its outputs and fed tokens are still in d_sp_out and vtok). */
static int put_in(cuda_runner *r, int B, int any_prev) {
    const int MB = r->base.cfg.max_batch, K1 = r->sp_k + 1;
    int32_t *tokens = r->d_sp_in, *prev = tokens + 3 * MB;
    k_sample_params *par = (k_sample_params *)((char *)r->d_sp_in + in_par_off(MB));
    const int32_t *out_tok = r->d_sp_out, *out_n = out_tok + (size_t)MB * K1;
    CU_CHECK(r, cudaMemcpyAsync(r->d_sp_in, r->h_sp_in, in_bytes(MB), cudaMemcpyHostToDevice, r->stream));
    if (any_prev)
        K_CHECK(r, k_spec_feed_prev(tokens, par, prev, out_tok, out_n, layout(r->d_sp_i32, MB, r->sp_k).vtok, K1, B,
                                    r->stream));
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_spec_capture(cuda_runner *r, char *err, size_t errlen) {
    int sizes[64], n = 0;
    cuda_graph_size_list(r->base.cfg.max_batch, sizes, &n);
    for (int i = 0; i < n; i++) {
        int B = sizes[i], rc;
        cudaGraph_t g = NULL;
        if (B * (r->sp_k + 1) > r->T) continue;
        fill_in(r, NULL, B);
        if ((rc = put_in(r, B, 0))) goto fail;
        /* One eager run first: module loading and cuBLAS heuristics happen outside capture. */
        if ((rc = spec_enqueue(r, B))) goto fail;
        if ((rc = cuda_step_sync(r))) goto fail;
        CU_CHECK(r, cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeThreadLocal));
        rc = spec_enqueue(r, B);
        cudaError_t e = cudaStreamEndCapture(r->stream, &g);
        if (rc) goto fail;
        CU_CHECK(r, e);
        e = cudaGraphInstantiate(&r->sp_graphs[r->sp_n_graphs], g, 0);
        cudaGraphDestroy(g);
        CU_CHECK(r, e);
        r->sp_graph_sizes[r->sp_n_graphs++] = B;
        CU_CHECK(r, cudaGraphLaunch(r->sp_graphs[r->sp_n_graphs - 1], r->stream));
        if ((rc = cuda_step_sync(r))) goto fail;
    }
    return 0;
fail:
    return specd_errf(err, errlen, SPECD_ECUDA, "cuda runner: capturing speculative graphs: %s",
                      r->errmsg);
}

/* The op (runner.h): inputs, the graph of the smallest captured size that holds the rows
 * (or the eager step), outputs to this step's half of h_sp_out; queued like a decode step
 * (cuda_dec_pending, at most two), completed by cuda_wait_queued (cuda_spec_wait), which
 * advances the length mirror then: a row that continues the step before (prev_row) has its
 * mirror one step behind until then, so its context is checked at the most that step can
 * have added. */
int cuda_spec_step(runner *base, const runner_spec_batch *b) {
    cuda_runner *r = (cuda_runner *)base;
    const runner_config *cfg = &base->cfg;
    if (r->failed) return SPECD_ECUDA;
    if (!r->sp_k || !b || b->n < 1 || b->n > cfg->max_batch || b->k != r->sp_k || !b->slots ||
        !b->tokens || !b->out_tokens || !b->out_n)
        return SPECD_EINVAL;
    if (b->async ? !base->spec_async || r->n_dpend == 2 : r->n_dpend != 0) return SPECD_ESTATE;
    const int k = r->sp_k, K1 = k + 1, MB = cfg->max_batch, V = r->m[0].c.vocab;
    int any_prev = 0, spec_pending = 0;
    for (int q = 0; q < r->n_dpend; q++) spec_pending += r->dpend[(r->dpend_head + q) & 1].spec_n != NULL;
    for (int i = 0; i < b->n; i++) {
        int s = b->slots[i];
        const int pr = b->prev_row ? b->prev_row[i] : -1;
        if (s < 0 || s >= MB || pr >= r->sp_last_rows) return SPECD_EINVAL;
        for (int j = 0; j < 2 && pr < 0; j++)
            if (b->tokens[2 * i + j] < 0 || b->tokens[2 * i + j] >= V) return SPECD_EINVAL;
        int L = r->h_len[s * 2] + (pr >= 0 ? spec_pending * K1 : 0);
        if ((pr < 0 && L < 1) || L + k + 1 > cfg->max_seq_len) return SPECD_ERANGE;
        for (int j = 0; j < i; j++)
            if (b->slots[j] == s) return SPECD_EINVAL;
        any_prev |= pr >= 0;
    }
    int gi = -1;   /* smallest captured size >= n (sizes are largest first) */
    for (int i = 0; i < r->sp_n_graphs; i++)
        if (r->sp_graph_sizes[i] >= b->n) gi = i;
    int B = gi >= 0 ? r->sp_graph_sizes[gi] : b->n, rc;
    cudaStream_t s = r->stream;
    if ((rc = cuda_upload_slots(r))) return rc;   /* (after the last queued op's inputs are in) */
    const int half = r->dec_half;
    fill_in(r, b, B);
    if ((rc = put_in(r, B, any_prev))) return rc;
    CU_CHECK(r, cudaEventRecord(r->ev_in[half], s));
    if (gi >= 0) {
        CU_CHECK(r, cudaGraphLaunch(r->sp_graphs[gi], s));
    } else if (spec_enqueue(r, B)) {
        goto fail;
    }
    CU_CHECK(r, cudaMemcpyAsync((char *)r->h_sp_out + (size_t)half * out_bytes(MB, k), r->d_sp_out, out_bytes(MB, k),
                                cudaMemcpyDeviceToHost, s));
    CU_CHECK(r, cudaEventRecord(r->ev_out[half], s));
    r->dec_half ^= 1;
    r->sp_last_rows = b->n;
    memcpy(r->sp_pslots + (size_t)half * MB, b->slots, (size_t)b->n * sizeof(int));
    return cuda_push_pending(
        r, &(struct cuda_dec_pending){.b = {.n = b->n, .out_tokens = b->out_tokens}, .half = half, .spec_n = b->out_n},
        b->async);
fail:
    return SPECD_ECUDA;
}

int cuda_spec_wait(cuda_runner *r, const struct cuda_dec_pending *p) {
    const int k = r->sp_k, K1 = k + 1, MB = r->base.cfg.max_batch;
    CU_CHECK(r, cudaEventSynchronize(r->ev_out[p->half]));
    const int32_t *tok = (const int32_t *)((const char *)r->h_sp_out + (size_t)p->half * out_bytes(MB, k));
    const int32_t *cnt = tok + (size_t)MB * K1;
    const int *slots = r->sp_pslots + (size_t)p->half * MB;
    for (int i = 0; i < p->b.n; i++) {
        int m = cnt[i], s = slots[i], L = r->h_len[s * 2];
        if (m < 1 || m > K1) {
            char msg[64];
            snprintf(msg, sizeof msg, "row %d emitted %d tokens (k = %d)", i, m, k);
            cuda_fail(r, __FILE__, __LINE__, "speculative acceptance", msg);
            return SPECD_ECUDA;
        }
        memcpy(p->b.out_tokens + (size_t)i * K1, tok + (size_t)i * K1, sizeof(int32_t) * (size_t)K1);
        p->spec_n[i] = m;
        r->h_len[s * 2] = L + m;
        r->h_len[s * 2 + 1] = L + k < L + m ? L + k : L + m;
    }
    if (!r->tune.skip_dummy_reset) r->h_len[2 * r->dummy] = r->h_len[2 * r->dummy + 1] = 0;
    return 0;
fail:
    return SPECD_ECUDA;
}

/* ---- verify of drafts proposed outside the runner (prompt lookup) ----------------------
 * One target pass over [last, d1..dk] per row, then k_verify_accept (point-mass drafts) and
 * the length advance, then the dummy reset and the outputs to pinned memory: captured per
 * (padded batch size <= vf_mb, k in 1..vf_k), so a row's cost is that of the longest
 * draft in its step (padding drafts are computed, never accepted).
 *
 * d_vf_i32: for each k, the pass's fixed layout over vf_mb rows of K1 = k + 1 tokens
 *   tok_j[vf_mb*K1] row_off[vf_mb] kp1[vf_mb] item_row[vf_mb*K1] item_q0[vf_mb*K1]
 *   itemt_row[vf_mb*K1] itemt_q0[vf_mb*K1] (one item per token)
 * then tok_slot[vf_mb*(vf_k+1)] (written on the device every step). */

typedef struct {
    int32_t *tok_j, *row_off, *kp1, *item_row, *item_q0;
    int32_t *itemt_row, *itemt_q0;   /* items one per token (verify_as_decode) */
} vf_layout;

static size_t vf_layout_n(int MB, int K1) { return (size_t)MB * K1 * 5 + 2 * (size_t)MB; }

/* Layout of k (1..vf_k) inside base (NULL: offsets only); *end: entries through it. */
static vf_layout vf_lay(int32_t *base, int MB, int k, size_t *end) {
    size_t o = 0;
    for (int j = 1; j < k; j++) o += vf_layout_n(MB, j + 1);
    size_t K1 = (size_t)k + 1;
    vf_layout l;
#define TAKE(f, cnt) (l.f = base ? base + o : NULL, o += (cnt))
    TAKE(tok_j, MB * K1); TAKE(row_off, MB); TAKE(kp1, MB); TAKE(item_row, MB * K1); TAKE(item_q0, MB * K1);
    TAKE(itemt_row, MB * K1); TAKE(itemt_q0, MB * K1);
#undef TAKE
    if (end) *end = o;
    return l;
}

/* Inputs: tokens[MB*(kmax+1)] | slots[MB] | n_drafts[MB] | pad to 16 | params[MB]. */
static size_t vf_par_off(int MB, int kmax) { return cuda_par_off((size_t)MB * (kmax + 3) * 4); }
static size_t vf_in_bytes(int MB, int kmax) { return cuda_par_block_bytes((size_t)MB * (kmax + 3) * 4, MB); }
static size_t vf_out_bytes(int MB, int kmax) { return (size_t)MB * (size_t)(kmax + 2) * 4; }

int cuda_verify_alloc(cuda_runner *r, int kmax) {
    const int MB = r->base.cfg.max_batch < CUDA_VERIFY_MAX_ROWS ? r->base.cfg.max_batch : CUDA_VERIFY_MAX_ROWS;
    const int V = r->m[0].c.vocab;
    size_t n_lay = 0;
    vf_lay(NULL, MB, kmax, &n_lay);
    size_t n = n_lay + (size_t)MB * (kmax + 1);
    int32_t *h = calloc(n, sizeof(int32_t));
    if (!h) return SPECD_ENOMEM;
    for (int k = 1; k <= kmax; k++) {
        vf_layout l = vf_lay(h, MB, k, NULL);
        fill_rows_layout(MB, k + 1, attn_qt(&r->m[0], k + 1, 0), l.tok_j, l.row_off, l.kp1, l.item_row, l.item_q0);
        fill_items(MB, k + 1, 1, l.itemt_row, l.itemt_q0);
    }
    size_t tl = (size_t)MB * (kmax + 1) * V * sizeof(float);
    CU_CHECK(r, cudaMalloc((void **)&r->d_vf_i32, n * sizeof(int32_t)));
    CU_CHECK(r, cudaMemcpy(r->d_vf_i32, h, n * sizeof(int32_t), cudaMemcpyHostToDevice));
    CU_CHECK(r, cudaMalloc((void **)&r->d_vf_tl, tl));
    CU_CHECK(r, cudaMalloc(&r->d_vf_in, vf_in_bytes(MB, kmax)));
    CU_CHECK(r, cudaMalloc(&r->d_vf_out, vf_out_bytes(MB, kmax)));
    CU_CHECK(r, cudaMallocHost(&r->h_vf_in, vf_in_bytes(MB, kmax)));
    CU_CHECK(r, cudaMallocHost(&r->h_vf_out, vf_out_bytes(MB, kmax)));
    memset(r->h_vf_in, 0, vf_in_bytes(MB, kmax));
    r->work_bytes += n * sizeof(int32_t) + tl + vf_in_bytes(MB, kmax) + vf_out_bytes(MB, kmax);
    r->vf_k = kmax;
    r->vf_mb = MB;
    free(h);
    return 0;
fail:
    free(h);
    return SPECD_ECUDA;
}

static void cuda_verify_free(cuda_runner *r) {
    for (int i = 0; i < r->vf_n_graphs; i++) cudaGraphExecDestroy(r->vf_graphs[i]);
    r->vf_n_graphs = 0;
    if (r->d_vf_i32) cudaFree(r->d_vf_i32);
    if (r->d_vf_tl) cudaFree(r->d_vf_tl);
    if (r->d_vf_in) cudaFree(r->d_vf_in);
    if (r->d_vf_out) cudaFree(r->d_vf_out);
    if (r->h_vf_in) cudaFreeHost(r->h_vf_in);
    if (r->h_vf_out) cudaFreeHost(r->h_vf_out);
    r->d_vf_i32 = NULL;
    r->d_vf_tl = NULL;
    r->d_vf_in = r->d_vf_out = r->h_vf_in = r->h_vf_out = NULL;
    r->vf_k = 0;
}

/* The verify step for B rows (live then padding) of k drafts each, enqueued on the stream;
 * vd: as a decode step would run it (verify_as_decode, which must hold). */
static int verify_enqueue(cuda_runner *r, int B, int k, int vd) {
    const int MB = r->vf_mb, K1 = k + 1, V = r->m[0].c.vocab, dummy = r->dummy;
    size_t n_lay = 0;
    vf_layout l = vf_lay(r->d_vf_i32, MB, k, NULL);
    vf_lay(NULL, MB, r->vf_k, &n_lay);
    int32_t *tok_slot = r->d_vf_i32 + n_lay;
    int32_t *tokens = r->d_vf_in, *slots = tokens + (size_t)MB * (r->vf_k + 1), *nd = slots + MB;
    const k_sample_params *par = (const k_sample_params *)((char *)r->d_vf_in + vf_par_off(MB, r->vf_k));
    int32_t *out_tok = r->d_vf_out, *out_n = out_tok + (size_t)MB * (r->vf_k + 1);
    cudaStream_t s = r->stream;
    int rc;

    CU_CHECK(r, cudaMemcpyAsync(r->d_vf_in, r->h_vf_in, vf_in_bytes(MB, r->vf_k), cudaMemcpyHostToDevice, s));
    K_CHECK(r, k_verify_prep(slots, B, K1, tok_slot, s));
    const verify_in vin = {.tokens = tokens, .tok_slot = tok_slot, .tok_j = l.tok_j, .row_off = l.row_off,
                           .kp1 = l.kp1, .slots = slots, .item_row = l.item_row, .item_q0 = l.item_q0,
                           .itemt_row = l.itemt_row, .itemt_q0 = l.itemt_q0};
    if ((rc = verify_pass(r, B, K1, vd, &vin, r->d_vf_tl))) return rc;
    K_CHECK(r, k_probs(r->d_vf_tl, r->d_vf_tl, B * K1, V, par, K1, s));
    K_CHECK(r, k_verify_accept(r->d_vf_tl, B, V, K1, tokens, nd, par, slots, dummy, r->d_lens, out_tok, out_n, s));
    if (!r->tune.skip_dummy_reset)
        CU_CHECK(r, cudaMemsetAsync(r->d_lens + 2 * dummy, 0, 2 * sizeof(int32_t), s));
    CU_CHECK(r, cudaMemcpyAsync(r->h_vf_out, r->d_vf_out, vf_out_bytes(MB, r->vf_k), cudaMemcpyDeviceToHost, s));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* Pinned inputs of a step of k drafts: n live rows (row i's tokens at i * (k + 1)), then
 * padding rows on the dummy slot. */
static void verify_fill_in(cuda_runner *r, const runner_verify_batch *b, int B, int k) {
    const int MB = r->vf_mb, K1 = k + 1;
    int32_t *tokens = r->h_vf_in, *slots = tokens + (size_t)MB * (r->vf_k + 1), *nd = slots + MB;
    k_sample_params *par = (k_sample_params *)((char *)r->h_vf_in + vf_par_off(MB, r->vf_k));
    int n = b ? b->n : 0;
    for (int i = 0; i < B; i++) {
        k_sample_params q = {0};
        if (i < n) {
            memcpy(tokens + (size_t)i * K1, b->tokens + (size_t)i * K1, sizeof(int32_t) * (size_t)K1);
            slots[i] = b->slots[i];
            nd[i] = b->n_drafts[i];
            if (b->sp) q = cuda_sample_params(&b->sp[i]);
        } else {
            memset(tokens + (size_t)i * K1, 0, sizeof(int32_t) * (size_t)K1);
            slots[i] = r->dummy;
            nd[i] = 0;
        }
        par[i] = q;
    }
}

/* Whether the verify step of B rows of k drafts runs as a decode step (r->vf_vd). */
static int verify_vd(const cuda_runner *r, int B, int k) {
    return verify_as_decode(r, B, k + 1) && (r->tune.verify_gemv == 2 || r->vf_vd[B][k]);
}

/* ms of a captured graph of the step (the mean of 5 launches after one). */
static int graph_ms(cuda_runner *r, cudaGraphExec_t ge, float *ms) {
    cudaEvent_t a = NULL, b = NULL;
    int rc = SPECD_ECUDA;
    if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) goto out;
    if (cudaGraphLaunch(ge, r->stream) != cudaSuccess || cudaEventRecord(a, r->stream) != cudaSuccess) goto out;
    for (int i = 0; i < 5; i++)
        if (cudaGraphLaunch(ge, r->stream) != cudaSuccess) goto out;
    if (cudaEventRecord(b, r->stream) != cudaSuccess || cudaEventSynchronize(b) != cudaSuccess ||
        cudaEventElapsedTime(ms, a, b) != cudaSuccess)
        goto out;
    *ms /= 5.f;
    rc = 0;
out:
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    return rc;
}

/* One verify step captured: eager first (outside capture), then the graph, run once. */
static int verify_graph(cuda_runner *r, int B, int k, int vd, cudaGraphExec_t *out) {
    cudaGraph_t g = NULL;
    int rc;
    verify_fill_in(r, NULL, B, k);
    if ((rc = verify_enqueue(r, B, k, vd)) || (rc = cuda_step_sync(r))) return rc;
    CU_CHECK(r, cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeThreadLocal));
    rc = verify_enqueue(r, B, k, vd);
    cudaError_t e = cudaStreamEndCapture(r->stream, &g);
    if (rc) return rc;
    CU_CHECK(r, e);
    e = cudaGraphInstantiate(out, g, 0);
    cudaGraphDestroy(g);
    CU_CHECK(r, e);
    CU_CHECK(r, cudaGraphLaunch(*out, r->stream));
    return cuda_step_sync(r);
fail:
    return SPECD_ECUDA;
}

int cuda_verify_capture(cuda_runner *r, char *err, size_t errlen) {
    int sizes[64], n = 0;
    cuda_graph_size_list(r->vf_mb, sizes, &n);
    memset(r->vf_vd, 0, sizeof r->vf_vd);
    for (int k = 1; k <= r->vf_k; k++) {
        for (int i = 0; i < n && r->vf_n_graphs < 256; i++) {
            int B = sizes[i], rc;
            cudaGraphExec_t *slot = &r->vf_graphs[r->vf_n_graphs];
            int vd = verify_as_decode(r, B, k + 1);
            if (vd && r->tune.verify_gemv == 1) {   /* both forms captured and timed; the faster kept */
                cudaGraphExec_t alt = NULL;
                float ms[2];
                if ((rc = verify_graph(r, B, k, 0, slot)) || (rc = verify_graph(r, B, k, 1, &alt))) {
                    if (alt) cudaGraphExecDestroy(alt);
                    goto fail;
                }
                if (graph_ms(r, *slot, &ms[0]) || graph_ms(r, alt, &ms[1])) {
                    cudaGraphExecDestroy(alt);
                    goto fail;
                }
                r->vf_vd_ms[B][k][0] = ms[0];
                r->vf_vd_ms[B][k][1] = ms[1];
                vd = ms[1] <= 1.03f * ms[0];
                if (vd) {
                    cudaGraphExecDestroy(*slot);
                    *slot = alt;
                } else {
                    cudaGraphExecDestroy(alt);
                }
            } else if ((rc = verify_graph(r, B, k, vd, slot))) {
                goto fail;
            }
            if (B <= CUDA_GEMV_MAX_ROWS && k < CUDA_GEMV_MAX_ROWS) r->vf_vd[B][k] = (unsigned char)vd;
            r->vf_graph_b[r->vf_n_graphs] = B;
            r->vf_graph_k[r->vf_n_graphs++] = k;
        }
    }
    return 0;
fail:
    return specd_errf(err, errlen, SPECD_ECUDA, "cuda runner: capturing verify graphs: %s", r->errmsg);
}

int cuda_verify(runner *base, const runner_verify_batch *b) {
    cuda_runner *r = (cuda_runner *)base;
    const runner_config *cfg = &base->cfg;
    if (r->failed) return SPECD_ECUDA;
    if (!r->vf_k || !b || b->n < 1 || b->n > r->vf_mb || b->k < 1 || b->k > r->vf_k || !b->slots ||
        !b->tokens || !b->n_drafts || !b->out_tokens || !b->out_n)
        return SPECD_EINVAL;
    const int k = b->k, K1 = k + 1, V = r->m[0].c.vocab;
    for (int i = 0; i < b->n; i++) {
        int s = b->slots[i];
        if (s < 0 || s >= cfg->max_batch || b->n_drafts[i] < 0 || b->n_drafts[i] > k) return SPECD_EINVAL;
        for (int j = 0; j < K1; j++)
            if (b->tokens[(size_t)i * K1 + j] < 0 || b->tokens[(size_t)i * K1 + j] >= V) return SPECD_EINVAL;
        if (r->h_len[s * 2] + K1 > cfg->max_seq_len) return SPECD_ERANGE;
        for (int j = 0; j < i; j++)
            if (b->slots[j] == s) return SPECD_EINVAL;
    }
    int gi = -1;   /* smallest captured size >= n for this k (sizes are largest first) */
    for (int i = 0; i < r->vf_n_graphs; i++)
        if (r->vf_graph_k[i] == k && r->vf_graph_b[i] >= b->n) gi = i;
    int B = gi >= 0 ? r->vf_graph_b[gi] : b->n;
    verify_fill_in(r, b, B, k);
    if (cuda_upload_slots(r)) goto fail;
    if (gi >= 0) {
        CU_CHECK(r, cudaGraphLaunch(r->vf_graphs[gi], r->stream));
    } else if (verify_enqueue(r, B, k, verify_vd(r, B, k))) {
        goto fail;
    }
    int rc = cuda_step_sync(r);
    if (rc) return rc;
    const int32_t *tok = r->h_vf_out, *cnt = tok + (size_t)r->vf_mb * (r->vf_k + 1);
    for (int i = 0; i < b->n; i++) {
        int m = cnt[i], s = b->slots[i];
        if (m < 1 || m > b->n_drafts[i] + 1) {
            char msg[64];
            snprintf(msg, sizeof msg, "row %d emitted %d tokens (%d drafts)", i, m, b->n_drafts[i]);
            cuda_fail(r, __FILE__, __LINE__, "verify acceptance", msg);
            return SPECD_ECUDA;
        }
        memcpy(b->out_tokens + (size_t)i * K1, tok + (size_t)i * K1, sizeof(int32_t) * (size_t)K1);
        b->out_n[i] = m;
        r->h_len[s * 2] += m;
    }
    if (!r->tune.skip_dummy_reset) r->h_len[2 * r->dummy] = r->h_len[2 * r->dummy + 1] = 0;
    return 0;
fail:
    return SPECD_ECUDA;
}
