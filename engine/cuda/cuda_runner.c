/* The CUDA runner (runner_cuda_create): bf16 weights and KV on one GPU, cuBLAS GEMMs,
 * kernels/ for the rest, the decode step with on-device sampling captured as CUDA graphs.
 *
 * Start-up order matters: weights, then slot tables and workspace, then the graphs
 * (captured against a one-block scratch pool, since every capture row is a padding row
 * on the dummy slot and lands in block 0; kernels read the pool base from a device cell,
 * so the real pool can be allocated afterwards), then the KV pool from what is left:
 * num_blocks = floor(mem_fraction * free / block_bytes) when cfg.num_blocks == 0.
 *
 * Errors: every CUDA / cuBLAS call is checked with a macro that records file and line;
 * after one, the runner is failed and every op returns SPECD_ECUDA. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cuda/cuda_internal.h"
#include "engine/cuda/cuda_tp.h"
#include "engine/core/err.h"

#define DEC_SPLIT_LEN 64   /* max decode splits = ceil(max_seq_len / 64), capped at 64 */

void cuda_fail(cuda_runner *r, const char *file, int line, const char *what, const char *msg) {
    if (!r->failed)
        snprintf(r->errmsg, sizeof r->errmsg, "%s:%d: %s: %s", file, line, what, msg);
    r->failed = 1;
}

static size_t model_block_elems(const model_config *c, int bs) {
    return 2 * (size_t)c->n_layers * (size_t)c->n_kv_heads * (size_t)bs * (size_t)c->head_dim;
}

size_t runner_cuda_block_bytes(const model *target, const model *draft, int block_size, int kv_fp8) {
    size_t n = model_block_elems(&target->cfg, block_size);
    if (draft) n += model_block_elems(&draft->cfg, block_size);
    return n * (kv_fp8 ? 1 : 2);
}

/* Pool block b's first byte, and the bytes of a block. */
static char *pool_block(const cuda_runner *r, int b) {
    return (char *)r->d_pool + (size_t)b * r->block_elems * (size_t)r->kv_esize;
}
static size_t pool_block_bytes(const cuda_runner *r) { return r->block_elems * (size_t)r->kv_esize; }

/* ---- forward (eager) ---------------------------------------------------------------- */

static int check_batch(cuda_runner *r, const runner_batch *b) {
    const runner_config *cfg = &r->base.cfg;
    if (b->which != RUNNER_TARGET && b->which != RUNNER_DRAFT) return SPECD_EINVAL;
    if (!r->m[b->which].loaded) return SPECD_EINVAL;
    if (b->n_tokens < 0 || b->n_tokens > r->T || b->n_tokens > cfg->max_tokens_per_step)
        return SPECD_ERANGE;
    for (int i = 0; i < b->n_rows; i++) {
        const runner_row *row = &b->rows[i];
        if (row->slot < 0 || row->slot > cfg->max_batch) return SPECD_EINVAL;
        if (row->n_new < 0 || row->tok_off < 0 || row->tok_off + row->n_new > b->n_tokens)
            return SPECD_EINVAL;
        if (row->n_logits != 0 && row->n_logits != 1 && row->n_logits != row->n_new)
            return SPECD_EINVAL;
        if (row->n_logits && (row->logits_off < 0 || !b->logits)) return SPECD_EINVAL;
        if (r->h_len[row->slot * 2 + b->which] + row->n_new > cfg->max_seq_len) return SPECD_ERANGE;
        for (int k = 0; k < i; k++)
            if (b->rows[k].slot == row->slot) return SPECD_EINVAL;
    }
    for (int t = 0; t < b->n_tokens; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= r->m[b->which].c.vocab) return SPECD_EINVAL;
    return 0;
}

/* A forward pass over the batch's rows. Async (runner.forward_async, for the engine's
 * async scheduling): the sampling inputs go to the device before the pass, the tokens of
 * prev_tok are fed from the last queued op's outputs (d_dec_out) on the device, and the
 * outputs come back as a decode step's do (its half of h_dec_out, cuda_wait_queued). */
static int cuda_forward(runner *base, const runner_batch *b) {
    cuda_runner *r = (cuda_runner *)base;
    if (r->failed) return SPECD_ECUDA;
    const int MB = base->cfg.max_batch;
    if (b->async || b->prev_tok ? !base->forward_async || !b->sp || !b->out_tokens || (b->prepare_sp && !base->async_masks) || r->n_dpend == 2
                                : r->n_dpend != 0)
        return b->async || b->prev_tok ? SPECD_EINVAL : SPECD_ESTATE;
    int rc = check_batch(r, b);
    if (rc || (rc = cuda_upload_slots(r))) return rc;
    r->sp_last_rows = 0;   /* (d_sp_out no longer the latest sampling op's outputs) */
    const int T = r->T, which = b->which, vocab = r->m[which].c.vocab;
    const cuda_model *cm = &r->m[which];
    int32_t *hm = r->h_meta;
    int32_t *tok_slot = hm + META_TOK_SLOT * T, *tok_j = hm + META_TOK_J * T;
    int32_t *row_slot = hm + META_ROW_SLOT * T, *row_off = hm + META_ROW_TOK_OFF * T;
    int32_t *row_n = hm + META_ROW_N_NEW * T, *item_row = hm + META_ITEM_ROW * T;
    int32_t *item_q0 = hm + META_ITEM_Q0 * T, *lrows = hm + META_LOGIT_ROWS * T;

    memcpy(hm + META_TOKENS * T, b->tokens, (size_t)b->n_tokens * sizeof(int32_t));
    if (b->prev_tok) {
        for (int t = 0; t < b->n_tokens; t++)
            if (b->prev_tok[t] >= MB) return SPECD_EINVAL;
        memcpy(hm + META_PREV * T, b->prev_tok, (size_t)b->n_tokens * sizeof(int32_t));
    }
    /* Tokens no row claims go to the dummy slot (null block), never to a live one. */
    for (int t = 0; t < b->n_tokens; t++) {
        tok_slot[t] = r->dummy;
        tok_j[t] = 0;
    }
    int nr = 0, max_new = 0, max_ctx = 1, n_out = 0;
    for (int i = 0; i < b->n_rows; i++) {
        const runner_row *row = &b->rows[i];
        if (row->n_new == 0) continue;
        for (int j = 0; j < row->n_new; j++) {
            tok_slot[row->tok_off + j] = row->slot;
            tok_j[row->tok_off + j] = j;
        }
        for (int j = 0; j < row->n_logits; j++) {
            int o = row->logits_off + j;
            if (o >= T) return SPECD_ERANGE;
            lrows[o] = row->tok_off + row->n_new - row->n_logits + j;
            if (o + 1 > n_out) n_out = o + 1;
        }
        row_slot[nr] = row->slot;
        row_off[nr] = row->tok_off;
        row_n[nr] = row->n_new;
        nr++;
        if (row->n_new > max_new) max_new = row->n_new;
        int ctx = r->h_len[row->slot * 2 + which] + row->n_new;
        if (ctx > max_ctx) max_ctx = ctx;
    }
    /* Items: up to qt query tokens of one row share a block (qt * G <= 64 rows of Q: the
     * tensor-core kernel's four 16-row warp tiles, so each K/V tile serves all of them). */
    int G = cm->H / cm->KVH, cap_rows = cm->D > 128 ? 32 : 64;   /* D 256: the tiled kernel's 32 */
    int qt = cap_rows / G < 1 ? 1 : cap_rows / G;
    if (qt > max_new) qt = max_new > 0 ? max_new : 1;
    int ni = 0;
    for (int i = 0; i < nr; i++)
        for (int q0 = 0; q0 < row_n[i]; q0 += qt) {
            item_row[ni] = i;
            item_q0[ni] = q0;
            ni++;
        }
    /* Split the keys when the items alone would leave most of the GPU idle. */
    int n_splits = 1, split_len = (max_ctx + 63) / 64 * 64;
    long blocks = (long)ni * cm->KVH;
    if (ni > 0 && blocks < 2L * r->n_sm) {
        long want = (2L * r->n_sm + blocks - 1) / blocks;
        long most = (long)(r->ws_tok_splits / (size_t)(b->n_tokens > 0 ? b->n_tokens : 1));
        if (want > most) want = most;
        if (want > (max_ctx + 63) / 64) want = (max_ctx + 63) / 64;
        if (want > 1) {
            split_len = (int)((max_ctx + want - 1) / want + 63) / 64 * 64;
            n_splits = (max_ctx + split_len - 1) / split_len;
        }
    }

    cudaStream_t s = r->stream;
    int want_top = 0;   /* a sampled row wants top logprobs */
    int want_rank = 0;  /* a forced row (prompt position) wants its rank */
    for (int o = 0; b->sp && b->out_ranks && o < n_out; o++) want_rank |= b->sp[o].force;
    if (want_rank && (b->async || !base->forced_tokens)) return SPECD_EINVAL;
    const int async = b->async, half = r->dec_half;
    k_sample_params *par = r->h_fs_par;
    /* async with a callback (constrained rows): the sampling inputs come after the pass is
     * queued, as without async */
    const int late = async && b->prepare_sp;
    if ((late && !base->async_masks) || (async && n_out > MB)) return SPECD_EINVAL;
    if (async && !late) {   /* every input before the pass: the next op may write the staging then */
        for (int o = 0; o < n_out; o++)
            if (b->sp[o].mask) return SPECD_EINVAL;
        if ((rc = cuda_sample_prepare(r, b->sp, n_out, r->d_meta + META_TOKENS * T, lrows, par, &want_top))) return rc;
        want_top = want_top && b->out_top_ids && b->out_top_logprobs;
        if (n_out) CU_CHECK(r, cudaMemcpyAsync(r->d_fs_par, par, (size_t)n_out * sizeof *par, cudaMemcpyHostToDevice, s));
    }
    CU_CHECK(r, cudaMemcpyAsync(r->d_meta, hm, (size_t)META_N * T * sizeof(int32_t),
                                cudaMemcpyHostToDevice, s));
    const int32_t *dm = r->d_meta;
    if (async && !late) CU_CHECK(r, cudaEventRecord(r->ev_in[half], s));
    if (b->prev_tok && b->n_tokens > 0)
        K_CHECK(r, k_feed_prev((int32_t *)dm + META_TOKENS * T, dm + META_PREV * T, r->d_dec_out, b->n_tokens, s));
    if (nr > 0) {
        cuda_pass p = {
            .which = which, .n_tok = b->n_tokens, .n_rows = nr, .tokens = dm + META_TOKENS * T,
            .tok_slot = dm + META_TOK_SLOT * T, .tok_j = dm + META_TOK_J * T,
            .row_slot = dm + META_ROW_SLOT * T, .row_tok_off = dm + META_ROW_TOK_OFF * T,
            .row_n_new = dm + META_ROW_N_NEW * T, .item_row = dm + META_ITEM_ROW * T,
            .item_q0 = dm + META_ITEM_Q0 * T, .n_items = ni, .qt = qt, .n_splits = n_splits,
            .split_len = split_len,
        };
        if ((rc = cuda_enqueue_pass(r, &p))) return rc == SPECD_EUNSUPPORTED ? rc : SPECD_ECUDA;
        int masked = 0;
        const size_t mw = ((size_t)vocab + 31) / 32;
        if (b->sp && (!async || late)) {   /* sample on the device: only token ids (and wanted top logprobs) come back */
            /* the caller's work on sp (grammar masks) runs while the device runs the pass */
            if (b->prepare_sp && (rc = b->prepare_sp(b->prepare_ctx))) {
                cudaStreamSynchronize(s);   /* the pass may still write; nothing is read back */
                return rc;
            }
            if ((rc = cuda_sample_prepare(r, b->sp, n_out, r->d_meta + META_TOKENS * T, lrows, par, &want_top))) return rc;
            want_top = want_top && b->out_top_ids && b->out_top_logprobs;
            for (int o = 0; o < n_out; o++) masked |= b->sp[o].mask != NULL;
            CU_CHECK(r, cudaMemcpyAsync(r->d_fs_par, par, (size_t)n_out * sizeof *par, cudaMemcpyHostToDevice, s));
            if (masked) {   /* grammar masks (one row each at most: n_out <= max_batch then) */
                if (n_out > base->cfg.max_batch) return SPECD_EINVAL;
                for (int o = 0; o < n_out; o++) {
                    r->h_fs_has[o] = b->sp[o].mask != NULL;
                    if (b->sp[o].mask) memcpy(r->h_fs_mask + (size_t)o * mw, b->sp[o].mask, mw * 4);
                }
                CU_CHECK(r, cudaMemcpyAsync(r->d_fs_mask, r->h_fs_mask, (size_t)n_out * mw * 4, cudaMemcpyHostToDevice, s));
                CU_CHECK(r, cudaMemcpyAsync(r->d_fs_has, r->h_fs_has, (size_t)n_out * 4, cudaMemcpyHostToDevice, s));
            }
            if (late) CU_CHECK(r, cudaEventRecord(r->ev_in[half], s));   /* the staging is on its way */
        }
        for (int o = 0; o < n_out; o += r->LR) {
            int cnt = n_out - o < r->LR ? n_out - o : r->LR;
            if (cuda_enqueue_logits(r, which, dm + META_LOGIT_ROWS * T + o, cnt)) return SPECD_ECUDA;
            /* masks inside k_sample where it reports masked rows' logprobs of the logits before
             * the mask (runner.masked_raw_logprobs), else in place before it */
            const int in_sample = masked && b->sp && base->masked_raw_logprobs;
            if (masked && !in_sample)
                K_CHECK(r, k_mask_logits(r->d_logits, cnt, vocab, r->d_fs_mask + (size_t)o * mw, r->d_fs_has + o, s));
            if (b->sp)
                K_CHECK(r, k_sample_masked(r->d_logits, cnt, vocab, (const k_sample_params *)r->d_fs_par + o,
                                           in_sample ? r->d_fs_mask + (size_t)o * mw : NULL, r->d_fs_has + o,
                                           r->d_fs_tok + o, r->d_fs_lp + o, r->d_top_ids + (size_t)o * K_MAX_TOP,
                                           r->d_top_lps + (size_t)o * K_MAX_TOP, want_rank ? r->d_fs_rank + o : NULL,
                                           s));
            else
                CU_CHECK(r, cudaMemcpyAsync(b->logits + (size_t)o * vocab, r->d_logits,
                                            (size_t)cnt * vocab * sizeof(float), cudaMemcpyDeviceToHost, s));
        }
        if (async && n_out) {   /* where the next op's prev reads, and this step's half of h_dec_out */
            int32_t *dout = r->d_dec_out;
            CU_CHECK(r, cudaMemcpyAsync(dout, r->d_fs_tok, (size_t)n_out * 4, cudaMemcpyDeviceToDevice, s));
            CU_CHECK(r, cudaMemcpyAsync(dout + MB, r->d_fs_lp, (size_t)n_out * 4, cudaMemcpyDeviceToDevice, s));
            CU_CHECK(r, cudaMemcpyAsync((int32_t *)r->h_dec_out + (size_t)half * 2 * MB, dout, (size_t)MB * 8,
                                        cudaMemcpyDeviceToHost, s));
            if (want_top) {
                const size_t off = (size_t)half * MB * K_MAX_TOP, tk = (size_t)n_out * K_MAX_TOP;
                CU_CHECK(r, cudaMemcpyAsync(r->h_dec_top_ids + off, r->d_top_ids, tk * sizeof(int32_t),
                                            cudaMemcpyDeviceToHost, s));
                CU_CHECK(r, cudaMemcpyAsync(r->h_dec_top_lps + off, r->d_top_lps, tk * sizeof(float),
                                            cudaMemcpyDeviceToHost, s));
            }
        } else if (b->sp && n_out) {
            CU_CHECK(r, cudaMemcpyAsync(r->h_fs_tok, r->d_fs_tok, (size_t)n_out * 4, cudaMemcpyDeviceToHost, s));
            CU_CHECK(r, cudaMemcpyAsync(r->h_fs_lp, r->d_fs_lp, (size_t)n_out * 4, cudaMemcpyDeviceToHost, s));
            if (want_rank)
                CU_CHECK(r, cudaMemcpyAsync(r->h_fs_rank, r->d_fs_rank, (size_t)n_out * 4, cudaMemcpyDeviceToHost, s));
        }
        if (want_top && !async) {
            const size_t tk = (size_t)n_out * K_MAX_TOP;
            CU_CHECK(r, cudaMemcpyAsync(r->h_top_ids, r->d_top_ids, tk * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
            CU_CHECK(r, cudaMemcpyAsync(r->h_top_lps, r->d_top_lps, tk * sizeof(float), cudaMemcpyDeviceToHost, s));
        }
        K_CHECK(r, k_advance_lens(r->d_lens, dm + META_ROW_SLOT * T, dm + META_ROW_N_NEW * T, nr,
                                  which, r->dummy, s));
        CU_CHECK(r, cudaMemsetAsync(r->d_lens + 2 * r->dummy, 0, 2 * sizeof(int32_t), s));
    }
    if (async) {   /* queued: the mirror moves now, the outputs at cuda_wait_queued */
        CU_CHECK(r, cudaEventRecord(r->ev_out[half], s));
        r->dec_half ^= 1;
        for (int i = 0; i < nr; i++)
            if (row_slot[i] != r->dummy) r->h_len[row_slot[i] * 2 + which] += row_n[i];
        r->h_len[r->dummy * 2] = r->h_len[r->dummy * 2 + 1] = 0;
        return cuda_push_pending(
            r, &(struct cuda_dec_pending){.b = {.n = nr > 0 ? n_out : 0, .out_tokens = b->out_tokens,
                                                .out_logprobs = b->out_logprobs, .out_top_ids = b->out_top_ids,
                                                .out_top_logprobs = b->out_top_logprobs},
                                          .half = half, .want_top = want_top},
            1);
    }
    int rc_sync = cuda_step_sync(r);
    if (rc_sync) return rc_sync;
    if (b->sp && nr > 0) {
        memcpy(b->out_tokens, r->h_fs_tok, (size_t)n_out * sizeof(int32_t));
        if (b->out_logprobs) memcpy(b->out_logprobs, r->h_fs_lp, (size_t)n_out * sizeof(float));
        if (want_rank) memcpy(b->out_ranks, r->h_fs_rank, (size_t)n_out * sizeof(int32_t));
    }
    if (want_top) {   /* K_MAX_TOP == RUNNER_MAX_TOP: the same row stride */
        memcpy(b->out_top_ids, r->h_top_ids, (size_t)n_out * K_MAX_TOP * sizeof(int32_t));
        memcpy(b->out_top_logprobs, r->h_top_lps, (size_t)n_out * K_MAX_TOP * sizeof(float));
    }
    for (int i = 0; i < nr; i++)
        if (row_slot[i] != r->dummy) r->h_len[row_slot[i] * 2 + which] += row_n[i];
    r->h_len[r->dummy * 2] = r->h_len[r->dummy * 2 + 1] = 0;
    return 0;
fail:
    return SPECD_ECUDA;
}

/* ---- slots and blocks --------------------------------------------------------------- */

/* Slot writes stay on the host until the next op uploads them (cuda_upload_slots): the
 * engine writes a row's table and lengths between steps, and a round trip per write
 * (a synchronised copy) cost ~10 us each, 16 of them per step at 256 rows. */
/* A slot's row of host table h_bt (of a pool of nb blocks; dirty rows [*lo, *hi)). */
static int write_row(cuda_runner *r, int32_t *h_bt, int *lo, int *hi, int nb, int slot, int first,
                     const int32_t *blocks, int n) {
    if (r->failed) return SPECD_ECUDA;
    if (!h_bt || slot < 0 || slot > r->base.cfg.max_batch || first < 0 || n < 0 || first + n > r->max_blocks)
        return SPECD_EINVAL;
    int32_t *row = h_bt + (size_t)slot * r->max_blocks;
    for (int i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= nb) return SPECD_EINVAL;
    int rc = cuda_dec_inputs_done(r);   /* a queued decode may still copy the table */
    if (rc) return rc;
    memcpy(row + first, blocks, (size_t)n * sizeof(int32_t));
    if (first == 0)
        for (int i = n; i < r->max_blocks; i++) row[i] = 0;
    if (*hi <= *lo) {
        *lo = slot;
        *hi = slot + 1;
    } else {
        if (slot < *lo) *lo = slot;
        if (slot + 1 > *hi) *hi = slot + 1;
    }
    return 0;
}

static int cuda_slot_write_blocks(runner *base, int slot, int first, const int32_t *blocks, int n) {
    cuda_runner *r = (cuda_runner *)base;
    return write_row(r, r->h_bt, &r->bt_lo, &r->bt_hi, base->cfg.num_blocks, slot, first, blocks, n);
}

static int cuda_slot_write_win_blocks(runner *base, int slot, int first, const int32_t *blocks, int n) {
    cuda_runner *r = (cuda_runner *)base;
    return write_row(r, r->h_bt_win, &r->btw_lo, &r->btw_hi, base->cfg.win_blocks, slot, first, blocks, n);
}

/* Rows [*lo, *hi) of host table h to device table d (queued on the stream). */
static int upload_rows(cuda_runner *r, int32_t *d, const int32_t *h, int *lo, int *hi) {
    if (*hi > *lo) {
        const size_t off = (size_t)*lo * r->max_blocks, n = (size_t)(*hi - *lo) * r->max_blocks;
        CU_CHECK(r, cudaMemcpyAsync(d + off, h + off, n * sizeof(int32_t), cudaMemcpyHostToDevice, r->stream));
        *lo = *hi = 0;
    }
    return 0;
fail:
    return SPECD_ECUDA;
}

static int cuda_slot_set_len(runner *base, int slot, int which, int len) {
    cuda_runner *r = (cuda_runner *)base;
    if (r->failed) return SPECD_ECUDA;
    if (slot < 0 || slot > base->cfg.max_batch || which < 0 || which > 1 || len < 0 ||
        len > base->cfg.max_seq_len)
        return SPECD_EINVAL;
    const int i = slot * 2 + which;
    r->h_len[i] = len;
    if (!r->len_dirty[i]) {
        r->len_dirty[i] = 1;
        r->len_list[r->n_len_dirty++] = i;
    }
    return 0;
}

/* The host mirror: every op advances it as it advances the device's lengths. */
static int cuda_slot_get_len(runner *base, int slot, int which) {
    cuda_runner *r = (cuda_runner *)base;
    if (r->failed) return SPECD_ECUDA;
    if (slot < 0 || slot > base->cfg.max_batch || which < 0 || which > 1) return SPECD_EINVAL;
    return r->h_len[slot * 2 + which];
}

int cuda_upload_slots(cuda_runner *r) {
    int rc = cuda_dec_inputs_done(r);   /* h_len_up may still be on its way */
    if (rc) return rc;
    if (upload_rows(r, r->d_bt, r->h_bt, &r->bt_lo, &r->bt_hi) ||
        (r->h_bt_win && upload_rows(r, r->d_bt_win, r->h_bt_win, &r->btw_lo, &r->btw_hi)))
        return SPECD_ECUDA;
    for (int j = 0; j < r->n_len_dirty; j++) {   /* one by one: the others' device lengths may be ahead */
        const int i = r->len_list[j];
        r->h_len_up[j] = r->h_len[i];
        CU_CHECK(r, cudaMemcpyAsync(r->d_lens + i, r->h_len_up + j, sizeof(int32_t), cudaMemcpyHostToDevice,
                                    r->stream));
        r->len_dirty[i] = 0;
    }
    r->n_len_dirty = 0;
    return 0;
fail:
    return SPECD_ECUDA;
}

static int cuda_copy_block(runner *base, int dst, int src) {
    cuda_runner *r = (cuda_runner *)base;
    if (r->failed) return SPECD_ECUDA;
    int nb = base->cfg.num_blocks;
    if (dst <= 0 || dst >= nb || src < 0 || src >= nb) return SPECD_EINVAL;
    CU_CHECK(r, cudaMemcpyAsync(pool_block(r, dst), pool_block(r, src), pool_block_bytes(r), cudaMemcpyDeviceToDevice,
                                r->stream));
    CU_CHECK(r, cudaStreamSynchronize(r->stream));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* ---- test hooks ---------------------------------------------------------------------- */

size_t cuda_runner_block_bytes(runner *base) { return pool_block_bytes((cuda_runner *)base); }

int cuda_runner_device_len(runner *base, int slot, int which) {
    cuda_runner *r = (cuda_runner *)base;
    if (r->failed) return SPECD_ECUDA;
    if (slot < 0 || slot > base->cfg.max_batch || which < 0 || which > 1) return SPECD_EINVAL;
    int32_t v = 0;
    if (cuda_upload_slots(r)) goto fail;
    CU_CHECK(r, cudaMemcpyAsync(&v, r->d_lens + slot * 2 + which, sizeof v, cudaMemcpyDeviceToHost, r->stream));
    CU_CHECK(r, cudaStreamSynchronize(r->stream));
    return v;
fail:
    return SPECD_ECUDA;
}

int cuda_runner_read_block(runner *base, int block, void *host) {
    cuda_runner *r = (cuda_runner *)base;
    if (block < 0 || block >= base->cfg.num_blocks) return SPECD_EINVAL;
    CU_CHECK(r, cudaMemcpy(host, pool_block(r, block), pool_block_bytes(r), cudaMemcpyDeviceToHost));
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_runner_write_block(runner *base, int block, const void *host) {
    cuda_runner *r = (cuda_runner *)base;
    if (block < 0 || block >= base->cfg.num_blocks) return SPECD_EINVAL;
    CU_CHECK(r, cudaMemcpy(pool_block(r, block), host, pool_block_bytes(r), cudaMemcpyHostToDevice));
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_runner_graph_sizes(runner *base, int *sizes, int max) {
    cuda_runner *r = (cuda_runner *)base;
    int n = r->n_graphs < max ? r->n_graphs : max;
    for (int i = 0; i < n; i++) sizes[i] = r->graph_sizes[i];
    return n;
}

const char *cuda_runner_error(runner *base) { return ((cuda_runner *)base)->errmsg; }

void cuda_runner_memory(runner *base, size_t *weights, size_t *graphs, size_t *kv, size_t *work) {
    cuda_runner *r = (cuda_runner *)base;
    if (weights) *weights = r->m[0].weight_bytes + r->m[1].weight_bytes;
    if (graphs) *graphs = r->graph_bytes;
    if (kv) *kv = (size_t)base->cfg.num_blocks * pool_block_bytes(r);
    if (work) *work = r->work_bytes;
}

/* ---- life cycle ---------------------------------------------------------------------- */

static void cuda_abort_group(runner *base) {
    cuda_runner *r = (cuda_runner *)base;
    if (r->opts.tp) cuda_tp_abort(r->opts.tp);
}

static void cuda_destroy(runner *base) {
    cuda_runner *r = (cuda_runner *)base;
    if (!r) return;
    /* A failed group's stream may wait on a dead peer forever: abort NCCL first. */
    if (r->opts.tp && r->failed) cuda_tp_abort(r->opts.tp);
    if (r->stream) cudaStreamSynchronize(r->stream);
    cuda_destroy_graphs(r);
    cuda_spec_free(r);
    cuda_sample_free(r);
    cuda_model_free(&r->m[0]);
    cuda_model_free(&r->m[1]);
    cuda_fp8_free(r);
    cuda_gemm_free(r);
    void *dev[] = {r->d_bt, r->d_bt_win, r->d_win_pool, r->d_win_pp, r->d_lens, r->d_pool, r->d_pool_pp, r->d_resid, r->d_xb, r->d_f32,
                   r->d_q, r->d_ws_o, r->d_ws_ml, r->d_logits, r->d_lpart, r->d_lgather, r->d_meta, r->d_iota, r->d_zeros,
                   r->d_ones, r->d_dec_in, r->d_dec_out, r->blas_ws, r->d_act, r->d_counts, r->d_xg, r->d_ss,
                   r->d_fs_par, r->d_fs_tok, r->d_fs_lp, r->d_fs_rank, r->d_fs_mask, r->d_fs_has, r->d_qscratch, r->d_moe_lg, r->d_moe_w, r->d_moe_out, r->d_moe_ids,
                   r->d_moe_cnt, r->d_moe_rows, r->d_moe_act, r->d_moe_part};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) cudaFree(dev[i]);
    if (r->h_meta) cudaFreeHost(r->h_meta);
    if (r->h_dec_in) cudaFreeHost(r->h_dec_in);
    if (r->h_dec_out) cudaFreeHost(r->h_dec_out);
    if (r->h_dec_top_ids) cudaFreeHost(r->h_dec_top_ids);
    if (r->h_dec_top_lps) cudaFreeHost(r->h_dec_top_lps);
    for (int h = 0; h < 2; h++) {
        if (r->ev_in[h]) cudaEventDestroy(r->ev_in[h]);
        if (r->ev_out[h]) cudaEventDestroy(r->ev_out[h]);
    }
    if (r->h_fs_par) cudaFreeHost(r->h_fs_par);
    if (r->h_fs_tok) cudaFreeHost(r->h_fs_tok);
    if (r->h_fs_lp) cudaFreeHost(r->h_fs_lp);
    if (r->h_fs_rank) cudaFreeHost(r->h_fs_rank);
    if (r->h_fs_mask) cudaFreeHost(r->h_fs_mask);
    if (r->h_fs_has) cudaFreeHost(r->h_fs_has);
    if (r->blas) cublasDestroy(r->blas);
    if (r->stream) cudaStreamDestroy(r->stream);
    if (r->h_bt) cudaFreeHost(r->h_bt);
    if (r->h_bt_win) cudaFreeHost(r->h_bt_win);
    free(r->in_win);
    if (r->h_len) cudaFreeHost(r->h_len);
    if (r->h_len_up) cudaFreeHost(r->h_len_up);
    free(r->len_dirty);
    free(r->len_list);
    free(r->layer_off);
    free(r->kv_scale);
    cuda_tp_destroy(r->opts.tp);
    free(r);
}

/* The ops every CUDA runner has; spec_step (with a draft model and k > 0) and verify
 * (without one, k > 0) are set in the runner's own copy (cuda_runner.ops). */
static const runner_ops cuda_ops = {
    .name = "cuda",
    .forward = cuda_forward,
    .slot_write_blocks = cuda_slot_write_blocks,
    .slot_write_win_blocks = cuda_slot_write_win_blocks,
    .slot_set_len = cuda_slot_set_len,
    .slot_get_len = cuda_slot_get_len,
    .copy_block = cuda_copy_block,
    .decode = cuda_decode,
    .wait_queued = cuda_wait_queued,
    .abort_group = cuda_abort_group,
    .destroy = cuda_destroy,
};

static int dmalloc(cuda_runner *r, void *pp, size_t bytes) {
    void **p = pp;
    CU_CHECK(r, cudaMalloc(p, bytes ? bytes : 4));
    r->work_bytes += bytes;
    return 0;
fail:
    return SPECD_ECUDA;
}

/* Slot tables, workspace for T tokens of the wider model, static graph inputs. */
static int alloc_work(cuda_runner *r) {
    const runner_config *cfg = &r->base.cfg;
    const int MB = cfg->max_batch, T = r->T;
    size_t hid = 0, xbw = 0, f32w = 0, qd = 0, vocab = 0, heads = 0, ffn = 0, kvh = 0;
    for (int i = 0; i < 2; i++) {
        const cuda_model *cm = &r->m[i];
        if (!cm->loaded) continue;
        size_t h = (size_t)cm->c.hidden, q = (size_t)cm->H * cm->D, F = (size_t)cm->ffn;
        size_t qkv = (size_t)(cm->H + 2 * cm->KVH) * cm->D;
        hid = h > hid ? h : hid;
        qd = q > qd ? q : qd;
        size_t x = h > q ? h : q;
        x = x > F ? x : F;
        xbw = x > xbw ? x : xbw;
        size_t f = qkv > 2 * F ? qkv : 2 * F;
        f = f > h ? f : h;   /* Gemma 3's O / down outputs before their post-norms */
        f32w = f > f32w ? f : f32w;
        vocab = (size_t)cm->c.vocab > vocab ? (size_t)cm->c.vocab : vocab;
        heads = (size_t)cm->H > heads ? (size_t)cm->H : heads;
        ffn = F > ffn ? F : ffn;
        kvh = (size_t)cm->KVH > kvh ? (size_t)cm->KVH : kvh;
        if (cm->c.n_layers > r->ss_layers) r->ss_layers = cm->c.n_layers;
    }
    const size_t n_counts = (size_t)T * kvh;
    size_t ne = 0, nk = 0, mf = 0;   /* mixture of experts: the wider model's sizes */
    for (int i = 0; i < 2; i++)
        if (r->m[i].loaded && r->m[i].c.n_experts) {
            const model_config *mc = &r->m[i].c;
            ne = (size_t)mc->n_experts > ne ? (size_t)mc->n_experts : ne;
            nk = (size_t)mc->n_experts_used > nk ? (size_t)mc->n_experts_used : nk;
            mf = (size_t)mc->moe_ffn > mf ? (size_t)mc->moe_ffn : mf;
        }
    size_t qs = r->m[0].q_scratch > r->m[1].q_scratch ? r->m[0].q_scratch : r->m[1].q_scratch;
    if (qs && dmalloc(r, &r->d_qscratch, qs * 2)) return SPECD_ECUDA;
    r->qscratch_bytes = qs * 2;
    if ((r->m[0].fp8 || r->m[1].fp8) && cuda_fp8_init(r, xbw, f32w, T)) return SPECD_ECUDA;
    /* one-token MoE layers in one launch where asked, on one GPU, and the widths fit */
    int moe_one = 0;
    for (int i = 0; i < 2; i++) {
        cuda_model *cm = &r->m[i];
        const model_config *mc = &cm->c;
        cm->moe_one = cm->loaded && mc->n_experts && r->tune.moe_one && r->opts.world == 1 &&
                      k_moe_decode1_fits(mc->hidden, mc->n_experts, mc->n_experts_used, cm->ffn) == 0;
        moe_one |= cm->moe_one;
    }
    if (moe_one && dmalloc(r, &r->d_moe_part, k_moe_decode1_part_floats(hid) * 4)) return SPECD_ECUDA;
    if (ne && (dmalloc(r, &r->d_moe_lg, (size_t)T * ne * 4) || dmalloc(r, &r->d_moe_w, (size_t)T * nk * 4) ||
               dmalloc(r, &r->d_moe_ids, (size_t)T * nk * 4) || dmalloc(r, &r->d_moe_cnt, (2 * ne + 3) * 4) ||
               dmalloc(r, &r->d_moe_rows, ne * (size_t)T * 4) || dmalloc(r, &r->d_moe_act, (size_t)T * nk * mf * 2) ||
               dmalloc(r, &r->d_moe_out, (size_t)T * nk * hid * 4)))
        return SPECD_ECUDA;
    /* the decode routing's done counter (k_moe_route_buf.done, d_moe_cnt[0]) and
     * k_moe_decode1's barrier counter (d_moe_cnt[2 E + 2]) start at zero; every launch
     * leaves them so */
    if (ne) CU_CHECK(r, cudaMemset(r->d_moe_cnt, 0, (2 * ne + 3) * 4));
    r->d_moe_bar = ne ? (unsigned *)(r->d_moe_cnt + 2 * ne + 2) : NULL;
    size_t slots = (size_t)MB + 1;
    if (dmalloc(r, &r->d_bt, slots * r->max_blocks * 4) || dmalloc(r, &r->d_lens, slots * 2 * 4) ||
        dmalloc(r, &r->d_pool_pp, sizeof(void *)) ||
        dmalloc(r, &r->d_resid, (size_t)T * hid * 4) || dmalloc(r, &r->d_xb, (size_t)T * xbw * 2) ||
        dmalloc(r, &r->d_f32, (size_t)T * f32w * 4) || dmalloc(r, &r->d_q, (size_t)T * qd * 4) ||
        dmalloc(r, &r->d_ws_o, r->ws_tok_splits * qd * 4) ||
        dmalloc(r, &r->d_ws_ml, r->ws_tok_splits * heads * 2 * 4) ||
        dmalloc(r, &r->d_logits, (size_t)r->LR * vocab * 4) ||
        (r->m[0].vocab_parts > 1 && (dmalloc(r, &r->d_lpart, (size_t)r->LR * r->m[0].vocab_rows * 4) ||
                                     dmalloc(r, &r->d_lgather, (size_t)r->LR * vocab * 4))) ||
        dmalloc(r, &r->d_meta, (size_t)META_N * T * 4) || dmalloc(r, &r->d_iota, (size_t)T * 4) ||
        dmalloc(r, &r->d_zeros, (size_t)T * 4) || dmalloc(r, &r->d_ones, (size_t)T * 4) ||
        dmalloc(r, &r->d_dec_in, cuda_dec_in_bytes(MB)) ||
        dmalloc(r, &r->d_dec_out, (size_t)MB * 8) ||
        dmalloc(r, &r->d_fs_par, (size_t)T * sizeof(k_sample_params)) || dmalloc(r, &r->d_fs_tok, (size_t)T * 4) ||
        dmalloc(r, &r->d_fs_lp, (size_t)T * 4) || dmalloc(r, &r->d_fs_rank, (size_t)T * 4) ||
        dmalloc(r, &r->d_fs_mask, (size_t)MB * ((vocab + 31) / 32) * 4) || dmalloc(r, &r->d_fs_has, (size_t)MB * 4) ||
        dmalloc(r, &r->d_act, (size_t)CUDA_GEMV_MAX_ROWS * ffn * 2) ||
        dmalloc(r, &r->d_xg, (size_t)CUDA_GEMV_MAX_ROWS * hid * 2) ||
        dmalloc(r, &r->d_ss, (size_t)2 * r->ss_layers * CUDA_GEMV_MAX_ROWS * sizeof(unsigned long long)) ||
        dmalloc(r, &r->d_counts, n_counts * sizeof(unsigned)))
        return SPECD_ECUDA;
    CU_CHECK(r, cudaMemset(r->d_counts, 0, n_counts * sizeof(unsigned)));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_meta, (size_t)META_N * T * 4));
    CU_CHECK(r, cudaMallocHost(&r->h_dec_in, cuda_dec_in_bytes(MB)));
    CU_CHECK(r, cudaMallocHost(&r->h_dec_out, (size_t)2 * MB * 8));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_dec_top_ids, (size_t)2 * MB * K_MAX_TOP * sizeof(int32_t)));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_dec_top_lps, (size_t)2 * MB * K_MAX_TOP * sizeof(float)));
    for (int h = 0; h < 2; h++) {
        CU_CHECK(r, cudaEventCreateWithFlags(&r->ev_in[h], cudaEventDisableTiming));
        CU_CHECK(r, cudaEventCreateWithFlags(&r->ev_out[h], cudaEventDisableTiming));
    }
    CU_CHECK(r, cudaMallocHost(&r->h_fs_par, (size_t)T * sizeof(k_sample_params)));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_fs_tok, (size_t)T * 4));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_fs_lp, (size_t)T * 4));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_fs_rank, (size_t)T * 4));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_fs_mask, (size_t)MB * ((vocab + 31) / 32) * 4));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_fs_has, (size_t)MB * 4));
    memset(r->h_meta, 0, (size_t)META_N * T * 4);
    CU_CHECK(r, cudaMallocHost((void **)&r->h_bt, slots * r->max_blocks * sizeof(int32_t)));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_len, slots * 2 * sizeof(int)));
    CU_CHECK(r, cudaMallocHost((void **)&r->h_len_up, slots * 2 * sizeof(int32_t)));
    memset(r->h_bt, 0, slots * r->max_blocks * sizeof(int32_t));
    memset(r->h_len, 0, slots * 2 * sizeof(int));
    r->len_dirty = calloc(slots * 2, 1);
    r->len_list = calloc(slots * 2, sizeof(int));
    int32_t *tmp = malloc((size_t)T * 3 * sizeof(int32_t));
    if (!r->len_dirty || !r->len_list || !tmp) {
        free(tmp);
        return SPECD_ENOMEM;
    }
    for (int i = 0; i < T; i++) {
        tmp[i] = i;
        tmp[T + i] = 0;
        tmp[2 * T + i] = 1;
    }
    cudaError_t e1 = cudaMemcpy(r->d_iota, tmp, (size_t)T * 4, cudaMemcpyHostToDevice);
    cudaError_t e2 = cudaMemcpy(r->d_zeros, tmp + T, (size_t)T * 4, cudaMemcpyHostToDevice);
    cudaError_t e3 = cudaMemcpy(r->d_ones, tmp + 2 * T, (size_t)T * 4, cudaMemcpyHostToDevice);
    free(tmp);
    CU_CHECK(r, e1);
    CU_CHECK(r, e2);
    CU_CHECK(r, e3);
    CU_CHECK(r, cudaMemset(r->d_bt, 0, slots * r->max_blocks * 4));
    CU_CHECK(r, cudaMemset(r->d_lens, 0, slots * 2 * 4));
    if (r->base.cfg.win_blocks > 0) {
        if (dmalloc(r, &r->d_bt_win, slots * r->max_blocks * 4) || dmalloc(r, &r->d_win_pp, sizeof(void *)))
            return SPECD_ECUDA;
        CU_CHECK(r, cudaMemset(r->d_bt_win, 0, slots * r->max_blocks * 4));
        CU_CHECK(r, cudaMallocHost((void **)&r->h_bt_win, slots * r->max_blocks * sizeof(int32_t)));
        memset(r->h_bt_win, 0, slots * r->max_blocks * sizeof(int32_t));
    }
    return cuda_sample_alloc(r);
fail:
    return SPECD_ECUDA;
}

static int set_pool(cuda_runner *r, uint16_t *pool, uint16_t *win_pool) {
    CU_CHECK(r, cudaMemcpy(r->d_pool_pp, &pool, sizeof pool, cudaMemcpyHostToDevice));
    if (r->d_win_pp) CU_CHECK(r, cudaMemcpy(r->d_win_pp, &win_pool, sizeof win_pool, cudaMemcpyHostToDevice));
    return 0;
fail:
    return SPECD_ECUDA;
}

/* The minimum of *v over the ranks (an NCCL min all-reduce, then a wait with a deadline). */
static int agree_min(cuda_runner *r, int *v) {
    int32_t *d = NULL, h = *v;
    int rc = SPECD_ECUDA;
    CU_CHECK(r, cudaMalloc((void **)&d, sizeof h));
    CU_CHECK(r, cudaMemcpy(d, &h, sizeof h, cudaMemcpyHostToDevice));
    if (cuda_tp_all_reduce_min_i32(r->opts.tp, d, 1, r->stream)) {
        cuda_fail(r, __FILE__, __LINE__, "agreeing on the KV pool size", cuda_tp_error(r->opts.tp));
        goto fail;
    }
    if (cuda_step_sync(r)) goto fail;
    CU_CHECK(r, cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
    *v = h;
    rc = 0;
fail:
    if (d) cudaFree(d);
    return rc;
}

/* ---- switches --------------------------------------------------------------------------- */

static int env_flag(const char *name, int dflt) {
    const char *e = getenv(name);
    return e && *e ? atoi(e) : dflt;
}

void cuda_tuning_read(cuda_tuning *t, int world) {
    memset(t, 0, sizeof *t);
    t->no_fuse = env_flag("SPECD_CUDA_NO_FUSE", 0);
    t->no_fuse_norm = env_flag("SPECD_CUDA_NO_FUSE_NORM", 0);
    t->no_gemv = env_flag("SPECD_CUDA_NO_GEMV", 0);
    t->gemv_rows = env_flag("SPECD_CUDA_GEMV_ROWS", CUDA_GEMV_DEFAULT_ROWS);
    if (t->gemv_rows < 1 || t->gemv_rows > CUDA_GEMV_MAX_ROWS) t->gemv_rows = CUDA_GEMV_DEFAULT_ROWS;
    /* GGUF projections of gemm_q_min..gemm_q_rows tokens on the tensor-core GEMM over the
     * blocks (k_gemm_q) instead of dequantize + cuBLAS. -1 (the default): 17..64 tokens for
     * K-quant matrices (Q4_K, Q5_K, Q6_K) whose sides are both >= 4096, none for smaller ones
     * or other types (its Q8_0 form took 2.3x dequantize + cuBLAS's time at the 8B gate shape
     * and 64 tokens in test_gpu_gemv's report). Measured on an H100
     * (specd bench, Q4_K_M files, 2026-12-05): 8B shape at batch 32 / 64 2,877 / 4,967
     * decode tok/s against 2,213 / 4,249, at 96 / 128 no gain or a loss; 1B shape (2048
     * hidden) at 32 / 64 11,034 / 20,286 against 12,653 / 23,564 */
    t->gemm_q_rows = env_flag("SPECD_CUDA_GEMM_Q_ROWS", -1);
    t->gemm_q_min = env_flag("SPECD_CUDA_GEMM_Q_MIN", K_GEMV_QTC_MAX_N + 1);
    if (t->gemm_q_min < 1) t->gemm_q_min = K_GEMV_QTC_MAX_N + 1;
    t->lm_head_bf16 = env_flag("SPECD_CUDA_LM_HEAD_BF16", 0);
    /* Q4_K / Q5_K projections of 8..16 tokens on the tensor-core GEMV (kernels/gemv_q.cu
     * k_gemv_qtc) instead of k_gemv_q (up to 8) or dequantize + cuBLAS. Measured on an H100
     * (test_gpu_gemv "*gemv_qtc*", 8B shapes, 2026-12-05): Q4_K gate at 8 tokens 50.8 us
     * against k_gemv_q's 64.6, at 16 58.5 against dequantize + cuBLAS's 114.2; below 8 tokens
     * k_gemv_q is faster (n 1: 18.3 against 46.6), and for Q6_K k_gemv_q / dequantize +
     * cuBLAS win at every count (SPECD_CUDA_GEMVQ_TC_Q6K=1 sends it there anyway) */
    t->gemvq_tc = env_flag("SPECD_CUDA_GEMVQ_TC", K_GEMV_QTC_MAX_N);
    if (t->gemvq_tc > K_GEMV_QTC_MAX_N) t->gemvq_tc = K_GEMV_QTC_MAX_N;
    t->gemvq_tc_min = env_flag("SPECD_CUDA_GEMVQ_TC_MIN", K_GEMV_MAX_N);
    t->gemvq_tc_q6k = env_flag("SPECD_CUDA_GEMVQ_TC_Q6K", 0);
    /* Q8_0 on k_gemv_qtc (two mmas per 16 codes, a nibble each) is correct but slower than
     * k_gemv_q up to 8 tokens and no faster than dequantize + cuBLAS at 16 (H100,
     * test_gpu_gemv "*gemv_qtc_speed*", 2026-12-05: 8B gate at 8 tokens 90.8 against 63.7 us,
     * 8B down 119.1 against 79.8; at 16 108.6 / 141.3 against 112.2 / 111.6), so it is off
     * unless SPECD_CUDA_GEMVQ_TC_Q8=1 */
    t->gemvq_tc_q8 = env_flag("SPECD_CUDA_GEMVQ_TC_Q8", 0);
    /* Q8_0 / Q4_0 / Q4_1 GEMV passes of SPECD_CUDA_GEMVQ_I8=N (default 1) or more tokens (up
     * to 8) with the activations rounded to int8 per 32 elements and integer dot products
     * (kernels/gemv_q.cu k_gemv_qi8), as llama.cpp's quantized GEMVs do; 0: k_gemv_q's bf16
     * activations throughout. Measured on an H100 (test_gpu_gemv "*qi8_speed*", 8B shapes,
     * 2026-12-05): Q8_0 at 8 tokens 1.58-1.92x k_gemv_q's speed, at 1 token 0.93-1.15x;
     * Q4_0 / Q4_1 at 8 tokens 2.0-2.4x, at 1 0.97-1.10x; 8B Q8_0 decode (specd bench) at
     * batch 8 785 -> 1,266 tok/s, at batch 1 224 -> 237 */
    t->gemvq_i8 = env_flag("SPECD_CUDA_GEMVQ_I8", 1);
    /* the same for the K-quants (SPECD_CUDA_GEMVQ_I8_K=N, default 1; 0: bf16 activations).
     * H200, 2026-12-05: k_gemv_qi8 against k_gemv_q on the 8B shapes (test_gpu_gemv
     * "*qi8_speed*") Q4_K 1.05-1.18x at 1 token, 1.17-1.69x at 2-8; Q5_K 1.15-1.30x /
     * 1.09-1.85x; Q6_K 0.92-1.04x at 1 token (0.83x on the 1B down), 1.01-1.74x at 2-8. Decode
     * (specd bench, Q4_K_M files): 8B 309.5 -> 351.0 tok/s at batch 1, 1,127 -> 1,272 at 8;
     * 1B 1,252 -> 1,296 and 5,141 -> 6,030; 64 and 256 unchanged */
    t->gemvq_i8_k = env_flag("SPECD_CUDA_GEMVQ_I8_K", 1);
    /* Q8_0 passes of 9 .. SPECD_CUDA_GEMM_QI8_ROWS (default 64) tokens over matrices of both
     * sides >= 4096 on the int8 tensor-core GEMM (kernels/gemm_q.cu k_gemm_qi8; the
     * activations rounded as k_gemv_qi8 rounds them); 0: dequantize + cuBLAS. H100,
     * 2026-12-05 (test_gpu_gemv "*gemm_q_speed*"): 8B shapes at 16 / 64 tokens 1.0-1.5x
     * dequantize + cuBLAS's speed, at 128 and 256 0.4-0.8x; 8B Q8_0 decode at batch 64
     * 4,154 -> 5,026 tok/s; on the 1B shape (2048 wide) batch 64 lost (21,321 -> 19,893),
     * hence the 4096 */
    t->gemm_qi8_rows = env_flag("SPECD_CUDA_GEMM_QI8_ROWS", 64);
    /* attention writes its output's int8 rounding where the O projection runs on k_gemv_qi8
     * (k_attn_work.x8: no k_quant_x8 launch between them); 0: the separate launch */
    t->attn_x8 = env_flag("SPECD_CUDA_ATTN_X8", 1);
    /* the O projection's weights asked of L2 by a batch-1-2 decode attention, up to this
     * percentage of the L2 (cuda_step.c o_l2_prefetch; 0: none; not yet run on a GPU) */
    t->attn_l2pf = env_flag("SPECD_CUDA_ATTN_L2PF", 0);
    if (t->attn_l2pf < 0 || t->attn_l2pf > 100) t->attn_l2pf = 0;
    /* a one-token MoE routing asks L2 for its picks' first gate and up rows, this many KB
     * of each (0: none; not yet run on a GPU) */
    t->moe_l2pf = env_flag("SPECD_CUDA_MOE_L2PF", 0);
    if (t->moe_l2pf < 0 || t->moe_l2pf > (1 << 20)) t->moe_l2pf = 0;
    /* a one-token MoE layer in one launch (kernels/moe.cu k_moe_decode1; one GPU; not yet
     * run on a GPU, so off). Its grid barriers need every block resident at once: a block
     * for each SM the device reports (where one cannot be, under an MPS limit on active
     * threads say, the kernel traps after seconds and the step fails) */
    t->moe_one = env_flag("SPECD_CUDA_MOE_ONE", 0);
    /* FP8 GEMM passes of at least N tokens (SPECD_CUDA_FP8_CHAIN=N, default 64; 0: none)
     * chained without quantize / rescale launches between them (cuda_step.c fp8_chain; the
     * same bits). H100, 8B shape, specd bench, 2026-12-06: decode at 256 rows +5.0%, at 64
     * +0.2%, at 16 -1% (its per-row kernels are 16 blocks); prefill +9-10% */
    t->fp8_chain = env_flag("SPECD_CUDA_FP8_CHAIN", 64);
    t->fp8_fast_accum = env_flag("SPECD_CUDA_FP8_FAST_ACCUM", 0);
    t->fp8_tune = env_flag("SPECD_CUDA_FP8_TUNE", 1);
    t->fixed_splits = env_flag("SPECD_CUDA_FIXED_SPLITS", 0);
    t->gemm_band = env_flag("SPECD_CUDA_GEMM_BAND", 0);   /* (off: tests/gpu/BENCH.md, twenty-fourth session) */
    t->verify_item_splits = env_flag("SPECD_CUDA_VERIFY_ITEM_SPLITS", 0);
    t->verify_gemv = env_flag("SPECD_CUDA_VERIFY_GEMV", 1);
    t->spec_async = env_flag("SPECD_CUDA_SPEC_ASYNC", 1);
    t->no_forward_sampling = env_flag("SPECD_CUDA_NO_FORWARD_SAMPLING", 0);
    t->tp_vocab_split = env_flag("SPECD_TP_VOCAB_SPLIT", 1);
    t->tp_shard_draft = env_flag("SPECD_TP_SHARD_DRAFT", 0);
    t->tp_unrun_layers = world > 1 && env_flag("SPECD_CUDA_TP_UNRUN_LAYERS", 0);
    t->k = k_tuning_default;
    t->k.pdl = env_flag("SPECD_CUDA_PDL", t->k.pdl);
    t->k.attn_pdl = env_flag("SPECD_ATTN_PDL", t->k.attn_pdl);
    t->k.attn_simt = env_flag("SPECD_ATTN_SIMT", 0);
    t->k.attn_tiled = env_flag("SPECD_ATTN_TILED", 0);
    t->k.attn_dec = env_flag("SPECD_ATTN_DEC", t->k.attn_dec);
    t->k.gemvq_rows = env_flag("SPECD_CUDA_GEMVQ_ROWS", t->k.gemvq_rows);
    t->k.gemvq_split = env_flag("SPECD_CUDA_GEMVQ_SPLIT", t->k.gemvq_split);
    t->k.gemvq_rows_q6k = env_flag("SPECD_CUDA_GEMVQ_ROWS_Q6K", t->k.gemvq_rows_q6k);
    t->k.gemvq_stream = env_flag("SPECD_CUDA_GEMVQ_STREAM", t->k.gemvq_stream);
    t->k.gemvq_tc_split = env_flag("SPECD_CUDA_GEMVQ_TC_SPLIT", t->k.gemvq_tc_split);
    t->k.gemm_qi8_bps = env_flag("SPECD_CUDA_GEMM_QI8_BPS", t->k.gemm_qi8_bps);
    t->k.sample_hist = env_flag("SPECD_SAMPLE_HIST", t->k.sample_hist);
    t->k.gemv_tc_min = env_flag("SPECD_CUDA_GEMV_TC_MIN", t->k.gemv_tc_min);
    t->k.moe_r1 = env_flag("SPECD_MOE_R1", t->k.moe_r1);
    t->k.sample_vec = env_flag("SPECD_SAMPLE_VEC", t->k.sample_vec);
    t->k.attn_rope = env_flag("SPECD_ATTN_ROPE", t->k.attn_rope);
    t->k.moe_tcv = env_flag("SPECD_MOE_TCV", t->k.moe_tcv);
    t->k.attn_dec_pipe = env_flag("SPECD_ATTN_DEC_PIPE", t->k.attn_dec_pipe);
    if (t->k.gemv_tc_min < 1) t->k.gemv_tc_min = 1;
    t->profile_step = env_flag("SPECD_CUDA_PROFILE_STEP", 0);
    if (t->k.attn_dec < 0 || (t->k.attn_dec > 2 && t->k.attn_dec < 6) || t->k.attn_dec > 8)
        t->k.attn_dec = k_tuning_default.attn_dec;   /* 3-5: retired forms */
    if (t->k.attn_pdl < 0 || t->k.attn_pdl > 2) t->k.attn_pdl = k_tuning_default.attn_pdl;
#ifdef SPECD_DEBUG
    /* SPECD_DEBUG_SKIP=norm,qkv,attn,o,gu,down,moe leaves those stages of every layer out:
     * wrong results, only to time what each stage costs inside the captured step */
    const char *e = getenv("SPECD_DEBUG_SKIP");
    const char *names[] = {"norm", "qkv", "attn", "o", "gu", "down", "moe"};
    for (int i = 0; e && i < 7; i++) {
        size_t n = strlen(names[i]);
        for (const char *p = e; (p = strstr(p, names[i])); p += n)
            if ((p == e || p[-1] == ',') && (p[n] == ',' || !p[n])) t->dbg_skip |= 1 << i;
    }
    if (t->dbg_skip)
        fprintf(stderr, "cuda runner: SPECD_DEBUG_SKIP=%s: results are WRONG (only for timing the stages)\n", e);
    t->tp_skip_allreduce = world > 1 && env_flag("SPECD_DEBUG_TP_SKIP_ALLREDUCE", 0);
    if (t->tp_skip_allreduce)
        fprintf(stderr, "cuda runner: SPECD_DEBUG_TP_SKIP_ALLREDUCE: the all-reduces are left out, results are "
                        "WRONG (only for timing what the rest of a step costs)\n");
    t->skip_dummy_reset = env_flag("SPECD_DEBUG_SKIP_DUMMY_RESET", 0);
    if (t->skip_dummy_reset)
        fprintf(stderr, "cuda runner: SPECD_DEBUG_SKIP_DUMMY_RESET: spec graphs do NOT reset the dummy slot\n");
#else
    (void)world;
#endif
}

runner *runner_cuda_create_ex(const model *target, const model *draft, const runner_config *cfg,
                              const cuda_runner_opts *opts, char *err, size_t errlen) {
    cuda_runner *r = calloc(1, sizeof *r);
    uint16_t *scratch = NULL;
    if (!r) {
        specd_errf(err, errlen, SPECD_ENOMEM, "cuda runner: out of memory");
        return NULL;
    }
    r->ops = cuda_ops;
    r->base.ops = &r->ops;
    r->base.cfg = *cfg;
    r->base.target = target;
    r->base.draft = draft;
    r->base.vocab = target->cfg.vocab;
    if (opts) r->opts = *opts;
    if (r->opts.world < 1) r->opts.world = 1;
    runner_config *c = &r->base.cfg;
    if (c->block_size < 1 || c->max_batch < 1 || c->max_seq_len < 1 || c->max_tokens_per_step < 1 ||
        c->num_blocks < 0 || c->win_blocks < 0 || c->win_blocks == 1 || (c->win_blocks > 0 && r->opts.world > 1)) {
        specd_errf(err, errlen, SPECD_EINVAL,
                   "cuda runner: invalid config (block_size %d, max_batch %d, max_seq_len %d, "
                   "max_tokens_per_step %d)", c->block_size, c->max_batch, c->max_seq_len,
                   c->max_tokens_per_step);
        goto fail_free;
    }
    if (draft && draft->cfg.vocab != target->cfg.vocab) {
        specd_errf(err, errlen, SPECD_EINVAL, "cuda runner: draft vocab %d != target vocab %d",
                   draft->cfg.vocab, target->cfg.vocab);
        goto fail_free;
    }
    if (r->opts.world > 1 && (!r->opts.tp || cuda_tp_world(r->opts.tp) != r->opts.world ||
                              cuda_tp_rank(r->opts.tp) != r->opts.rank)) {
        specd_errf(err, errlen, SPECD_EINVAL, "cuda runner: rank %d of %d needs that rank's NCCL communicator",
                   r->opts.rank, r->opts.world);
        goto fail_free;
    }
    if (c->random_weights_seed) {
        r->opts.random_weights = 1;
        r->opts.seed = c->random_weights_seed;
    }
    if (c->mem_fraction <= 0 || c->mem_fraction > 1) c->mem_fraction = 0.9;
    cuda_tuning_read(&r->tune, r->opts.world);
    k_set_tuning(&r->tune.k);
    r->tune.fp8_weights = c->weights_fp8;
    if (c->weights_fp8 > 0 && r->opts.world > 1) {
        specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                   "cuda runner: --dtype fp8 with tensor parallelism is not supported yet (one GPU only)");
        goto fail_free;
    }
    /* composed steps sample on the device (one GPU: ranks would each need the params) */
    r->base.forward_samples = r->opts.world == 1 && !r->tune.no_forward_sampling;
    r->base.forward_masks = r->base.forward_samples;
    /* the draft model's forward passes sampling too (test_gpu_runner
     * "*draft_matches_its_logits*", H100, 2026-12-06) */
    r->base.draft_samples = r->base.forward_samples;
    r->base.decode_masks = r->opts.world == 1;   /* split decode graphs (cuda_step.c) */
    r->base.decode_async = r->opts.world == 1;   /* ranks of a group step together: no queue */
    r->base.forward_async = r->opts.world == 1;
    r->base.async_device = r->base.decode_async;   /* (queued ops run on the device while the host goes on) */
    /* logit adjustments and top logprobs in k_sample (one GPU: runner_sampling's lists are
     * pointers that a tensor-parallel group does not ship to its other ranks) */
    r->base.sample_adjusts = r->opts.world == 1;
    /* k_sample counts the token a row is fed (k_sample_params.fed), so penalised rows are
     * queued in flight like any other (test_gpu_kernels test_sample_counts_fed_token and
     * test_gpu_runner test_async_rows_count_the_fed_token passed on an H100, 2026-12-05) */
    r->base.async_stats = r->base.sample_adjusts;
    /* async decode / forward with a mask callback: constrained rows queued in flight
     * (decode_masked, cuda_forward's late inputs; test_gpu_runner
     * test_async_masked_decode_waits_in_callback passed on an H100, 2026-12-05) */
    r->base.async_masks = r->base.forward_masks && r->base.decode_masks;
    /* prompt positions as forced rows of k_sample (prompt logprobs without their logits on
     * the host): test_gpu_runner test_prompt_logprobs_forced_match_host passed on an H100
     * (2026-12-05), and test_gpu_kernels test_sample_forced_rows_match_host once its reuse
     * of consumed adjustment entries was fixed */
    r->base.forced_tokens = r->base.forward_samples;
    /* k_sample_masked: the grammar mask inside the sampling kernel, after the row's
     * log-sum-exp and top logprobs of its logits as they came, so constrained rows that
     * want logprobs stay on the device (test_gpu_kernels
     * test_sample_masked_rows_report_raw_logprobs passed on an H100, 2026-12-05: tokens and
     * logits as k_mask_logits + k_sample, raw logprobs exact) */
    r->base.masked_raw_logprobs = r->base.forward_masks;
    if (c->max_batch > 1024) {
        specd_errf(err, errlen, SPECD_ERANGE, "cuda runner: max_batch %d > 1024", c->max_batch);
        goto fail_free;
    }
    if (r->opts.world > 1 && !r->tune.tp_unrun_layers && (target->cfg.n_experts || target->cfg.sandwich_norms)) {
        specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                   "cuda runner: tensor parallelism for %s (%s) has not run on GPUs yet: use "
                   "--tensor-parallel-size 1 (or --device cpu, where it is tested)", target->path,
                   target->cfg.n_experts ? "experts" : "Gemma 3 layers");
        goto fail_free;
    }
    for (const model *mm = target; mm; mm = mm == target ? draft : NULL) {
        const model_config *mc = &mm->cfg;
        /* a tensor-parallel rank holds 1/world of each expert's rows (the target's; the
         * draft's too where the draft is sharded) */
        const int w = mm == target || r->tune.tp_shard_draft ? r->opts.world : 1;
        if (mc->n_experts && (mc->n_experts > 512 || mc->n_experts_used > 16 || mc->moe_ffn % (8 * w) ||
                              mc->hidden % 8)) {
            specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                       "cuda runner: %s: %d experts, %d per token, of width %d over %d rank(s) (at most 512 experts "
                       "and 16 per token, widths per rank multiples of 8)", mm->path, mc->n_experts,
                       mc->n_experts_used, mc->moe_ffn, w);
            goto fail_free;
        }
    }

    CU_CHECK(r, cudaSetDevice(c->device));
    struct cudaDeviceProp prop;
    CU_CHECK(r, cudaGetDeviceProperties(&prop, c->device));
    r->n_sm = prop.multiProcessorCount;
    r->l2_bytes = prop.l2CacheSize > 0 ? (size_t)prop.l2CacheSize : 0;
    if (r->opts.world <= 1 && c->weights_gguf != 0) {   /* --dtype: see runner_config.weights_gguf */
        size_t free_b = 0, total_b = 0;
        const model_config *mc = &target->cfg;
        double bf16 = 2.0 * ((double)mc->hidden * (mc->n_heads + 2 * mc->n_kv_heads) * mc->head_dim +
                             (double)mc->n_heads * mc->head_dim * mc->hidden + 3.0 * mc->hidden * mc->ffn) * mc->n_layers +
                      2.0 * (double)mc->vocab * mc->hidden * (mc->tied_embeddings ? 1 : 2);
        if (c->weights_gguf > 0) r->tune.quant_weights = 1;
        else if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
            r->tune.quant_weights = bf16 > 0.5 * (double)total_b;
    }
    CU_CHECK(r, cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
    BLAS_CHECK(r, cublasCreate(&r->blas));
    BLAS_CHECK(r, cublasSetStream(r->blas, r->stream));
    /* A fixed workspace keeps cuBLAS from allocating inside graph capture. */
    r->blas_ws_bytes = (size_t)32 << 20;
    CU_CHECK(r, cudaMalloc(&r->blas_ws, r->blas_ws_bytes));
    BLAS_CHECK(r, cublasSetWorkspace(r->blas, r->blas_ws, r->blas_ws_bytes));
    if (cuda_gemm_init(r)) goto fail;

    r->m[0].pool_layer0 = 0;
    /* lm_head split by vocabulary across the ranks unless tune.tp_vocab_split is off (then
     * replicated); the draft replicated unless tune.tp_shard_draft. Both measured:
     * docs/tensor-parallel.md. */
    if (r->opts.world > 1) r->m[0].vocab_parts = r->tune.tp_vocab_split ? r->opts.world : 1;
    if (cuda_model_load(r, &r->m[0], target, r->opts.rank, r->opts.world, err, errlen)) goto fail_free;
    r->m[0].pool_layer0 = 0;
    if (draft) {
        r->m[1].pool_layer0 = target->cfg.n_layers;
        /* The draft is replicated on every rank (docs/tensor-parallel.md): its passes need
         * no collectives, and small drafts often do not split (llama-draft: 1 KV head). */
        if (cuda_model_load(r, &r->m[1], draft, r->tune.tp_shard_draft ? r->opts.rank : 0, r->tune.tp_shard_draft ? r->opts.world : 1,
                            err, errlen))
            goto fail_free;
        r->m[1].pool_layer0 = target->cfg.n_layers;
    }

    /* Pool geometry: per block, every target layer then every draft layer (with a window
     * pool, its blocks hold the window layers and the first pool's the others). */
    r->n_pool_layers = target->cfg.n_layers + (draft ? draft->cfg.n_layers : 0);
    r->layer_off = calloc((size_t)r->n_pool_layers, sizeof(size_t));
    r->kv_scale = calloc((size_t)r->n_pool_layers * 2, sizeof(float));
    r->in_win = calloc((size_t)r->n_pool_layers, 1);
    if (!r->layer_off || !r->kv_scale || !r->in_win) goto oom;
    r->kv_esize = c->kv_fp8 ? 1 : 2;
    size_t off = 0, woff = 0;
    for (int l = 0; l < r->n_pool_layers; l++) {
        const int is_draft = l >= target->cfg.n_layers;
        const cuda_model *cm = &r->m[is_draft];
        const model_layer *ly = &(is_draft ? draft : target)->layers[is_draft ? l - target->cfg.n_layers : l];
        size_t *o = (r->in_win[l] = (unsigned char)runner_layer_in_window_pool(
                         &target->cfg, draft ? &draft->cfg : NULL, c->win_blocks > 0, l))
                        ? &woff : &off;
        r->layer_off[l] = *o;
        *o += 2 * (size_t)cm->KVH * c->block_size * cm->D;
        r->kv_scale[2 * l] = ly->k_scale > 0 ? ly->k_scale : 1.0f;
        r->kv_scale[2 * l + 1] = ly->v_scale > 0 ? ly->v_scale : 1.0f;
    }
    r->block_elems = off;
    r->win_block_elems = woff;

    r->max_blocks = (c->max_seq_len + c->block_size - 1) / c->block_size;
    r->dummy = c->max_batch;
    r->T = c->max_tokens_per_step > c->max_batch ? c->max_tokens_per_step : c->max_batch;
    /* The speculative step's verify pass feeds max_batch * (k + 1) tokens. */
    int spec_k = draft && c->num_draft_tokens > 0 ? c->num_draft_tokens : 0;
    if (spec_k > 16) {
        specd_errf(err, errlen, SPECD_ERANGE, "cuda runner: num_draft_tokens %d > 16", spec_k);
        goto fail_free;
    }
    if (spec_k && r->T < c->max_batch * (spec_k + 1)) r->T = c->max_batch * (spec_k + 1);
    /* Without a draft, k > 0 asks for verify steps of outside drafts (prompt lookup). */
    int vf_k = !draft && c->num_draft_tokens > 0 ? c->num_draft_tokens : 0;
    int vf_mb = c->max_batch < CUDA_VERIFY_MAX_ROWS ? c->max_batch : CUDA_VERIFY_MAX_ROWS;
    if (vf_k > 16) {
        specd_errf(err, errlen, SPECD_ERANGE, "cuda runner: num_draft_tokens %d > 16", vf_k);
        goto fail_free;
    }
    if (vf_k && r->T < vf_mb * (vf_k + 1)) r->T = vf_mb * (vf_k + 1);
    r->LR = c->max_batch > 256 ? c->max_batch : (r->T < 256 ? r->T : 256);
    r->dec_split_len = DEC_SPLIT_LEN;
    r->dec_splits = (c->max_seq_len + DEC_SPLIT_LEN - 1) / DEC_SPLIT_LEN;
    if (r->dec_splits > 32) r->dec_splits = 32;   /* the attention's in-kernel merge stages <= 32 */
    r->gemv_rows_now = r->tune.gemv_rows;
    /* Decode uses about B + 2*SMs/KVH (token, split) pairs; eager passes fit under this. */
    r->ws_tok_splits = (size_t)4 * (c->max_batch > 64 ? c->max_batch : 64) + 2 * (size_t)r->n_sm;
    if (alloc_work(r)) goto cuda_err;
    if (spec_k) {
        int rc = cuda_spec_alloc(r, spec_k);
        if (rc == SPECD_ENOMEM) goto oom;
        if (rc) goto cuda_err;
        r->ops.spec_step = cuda_spec_step;
        r->base.spec_async = r->opts.world == 1 && r->tune.spec_async;   /* (one GPU, as decode_async) */
    }
    if (vf_k) {
        int rc = cuda_verify_alloc(r, vf_k);
        if (rc == SPECD_ENOMEM) goto oom;
        if (rc) goto cuda_err;
        r->ops.verify = cuda_verify;
        r->base.verify_max_k = vf_k;
        r->base.verify_max_rows = r->vf_mb;
        /* sampled rows: k_verify_accept's point-mass rule by the target's own draws
         * (test_gpu_runner "*verify_graph_sampled*", H100, 2026-12-06) */
        r->base.verify_samples = 1;
    }

    /* Graphs, against a one-block scratch pool (capture rows all use the dummy slot), which
     * stands in for the window pool too. */
    size_t win_block_bytes = r->win_block_elems * (size_t)r->kv_esize;
    size_t scratch_bytes = pool_block_bytes(r) > win_block_bytes ? pool_block_bytes(r) : win_block_bytes;
    CU_CHECK(r, cudaMalloc((void **)&scratch, scratch_bytes));
    CU_CHECK(r, cudaMemset(scratch, 0, scratch_bytes));
    if (set_pool(r, scratch, scratch)) goto cuda_err;
    size_t free0 = 0, free1 = 0, total = 0;
    CU_CHECK(r, cudaDeviceSynchronize());
    CU_CHECK(r, cudaMemGetInfo(&free0, &total));
    if (!r->opts.no_graphs && cuda_capture_graphs(r, err, errlen)) goto fail_free;
    if (!r->opts.no_graphs && r->sp_k && cuda_spec_capture(r, err, errlen)) goto fail_free;
    if (!r->opts.no_graphs && r->vf_k && cuda_verify_capture(r, err, errlen)) goto fail_free;
    CU_CHECK(r, cudaMemGetInfo(&free1, &total));
    r->graph_bytes = free0 > free1 ? free0 - free1 : 0;
    if (set_pool(r, NULL, NULL)) goto cuda_err;
    cudaFree(scratch);
    scratch = NULL;

    /* KV pools from what is left: the window pool's share first (runner_window_pool_fit;
     * a given budget holds both pools), the first pool from the rest. */
    size_t block_bytes = pool_block_bytes(r);
    double budget = c->mem_fraction * (double)free1;
    if (c->kv_bytes && (double)c->kv_bytes < budget) budget = (double)c->kv_bytes;
    if (c->win_blocks) c->win_blocks = runner_window_pool_fit(c, win_block_bytes, budget);
    size_t win_bytes = (size_t)c->win_blocks * win_block_bytes;
    if (c->num_blocks == 0) {
        double left = c->mem_fraction * (double)free1 - (double)win_bytes;
        size_t nb = left > 0 ? (size_t)floor(left / (double)block_bytes) : 0;
        if (c->kv_bytes) {
            size_t cap = (c->kv_bytes > win_bytes ? c->kv_bytes - win_bytes : 0) / block_bytes + 1;
            if (nb > cap) nb = cap;
        }
        if (nb > ((size_t)1 << 30)) nb = (size_t)1 << 30;
        c->num_blocks = (int)nb;
        /* Block ids are global: every rank takes the smallest count any rank can hold. */
        if (r->opts.world > 1 && agree_min(r, &c->num_blocks)) goto cuda_err;
    }
    if (c->num_blocks < r->max_blocks + 1) {
        specd_errf(err, errlen, SPECD_ENOSPACE,
                   "cuda runner: KV pool of %d blocks (%zu bytes each, %.2f GiB free after "
                   "weights and graphs) cannot hold one sequence of max_seq_len %d (%d blocks + "
                   "the null block): lower --max-seq-len or --max-batch, or raise --mem-fraction / --kv-cache-bytes",
                   c->num_blocks, block_bytes, (double)free1 / (1 << 30), c->max_seq_len, r->max_blocks);
        goto fail_free;
    }
    CU_CHECK(r, cudaMalloc((void **)&r->d_pool, (size_t)c->num_blocks * block_bytes));
    CU_CHECK(r, cudaMemset(r->d_pool, 0, (size_t)c->num_blocks * block_bytes));
    if (win_bytes) {
        CU_CHECK(r, cudaMalloc((void **)&r->d_win_pool, win_bytes));
        CU_CHECK(r, cudaMemset(r->d_win_pool, 0, win_bytes));
    }
    if (set_pool(r, r->d_pool, r->d_win_pool)) goto cuda_err;
    r->base.kv_block_bytes[0] = block_bytes;
    r->base.kv_block_bytes[1] = win_block_bytes;
    CU_CHECK(r, cudaDeviceSynchronize());

    if (!r->opts.quiet) {
        char gs[512] = "";
        size_t n = 0;
        for (int i = 0; i < r->n_graphs && n + 8 < sizeof gs; i++)
            n += (size_t)snprintf(gs + n, sizeof gs - n, "%s%d", i ? "," : "", r->graph_sizes[i]);
        if (r->sp_k)
            n += (size_t)snprintf(gs + n, sizeof gs - n, "; speculative k=%d sizes ", r->sp_k);
        for (int i = 0; i < r->sp_n_graphs && n + 8 < sizeof gs; i++)
            n += (size_t)snprintf(gs + n, sizeof gs - n, "%s%d", i ? "," : "", r->sp_graph_sizes[i]);
        char wdesc[128] = "";
        if (win_bytes)
            snprintf(wdesc, sizeof wdesc, " + window layers' pool %d blocks (%.2f GiB)", c->win_blocks,
                     (double)win_bytes / (1 << 30));
        if (r->vf_k && n + 64 < sizeof gs)
            n += (size_t)snprintf(gs + n, sizeof gs - n, "; verify k=1..%d rows<=%d: %d graphs", r->vf_k,
                                  r->vf_mb, r->vf_n_graphs);
        fprintf(stderr,
                "cuda runner: %s, %d SMs: weights %.2f GiB%s, workspace %.2f GiB, graphs %.3f GiB, "
                "KV %s %d blocks x %d tokens = %lld tokens (%.2f GiB)%s, max batch %d, max seq %d, "
                "captured decode sizes [%s]\n",
                prop.name, r->n_sm, (double)(r->m[0].weight_bytes + r->m[1].weight_bytes) / (1 << 30),
                r->m[0].q_scratch || r->m[1].q_scratch ? " (GGUF quantized projections kept in their blocks)"
                : r->m[0].fp8 || r->m[1].fp8        ? " (FP8 E4M3 projections)"
                                                    : "",
                (double)r->work_bytes / (1 << 30), (double)r->graph_bytes / (1 << 30),
                r->kv_esize == 1 ? "fp8" : "bf16", c->num_blocks,
                c->block_size, (long long)c->num_blocks * c->block_size,
                (double)c->num_blocks * block_bytes / (1 << 30), wdesc, c->max_batch, c->max_seq_len,
                r->n_graphs ? gs : "none (eager)");
        if (r->vf_k && r->vf_vd_ms[1][1][0] > 0.f) {   /* verify_as_decode at one row, as timed */
            char vs[256];
            size_t m = 0;
            for (int k = 1; k <= r->vf_k && k < CUDA_GEMV_MAX_ROWS && m + 48 < sizeof vs; k++)
                if (r->vf_vd_ms[1][k][0] > 0.f)
                    m += (size_t)snprintf(vs + m, sizeof vs - m, "%s k%d %.2f/%.2f%s", k > 1 ? "," : "", k,
                                          (double)r->vf_vd_ms[1][k][1], (double)r->vf_vd_ms[1][k][0],
                                          r->vf_vd[1][k] ? " exact" : "");
            fprintf(stderr, "cuda runner: verify step of 1 row, ms as decode steps / on cuBLAS:%s\n", vs);
        }
    }
    return &r->base;

oom:
    specd_errf(err, errlen, SPECD_ENOMEM, "cuda runner: out of host memory");
    goto fail_free;
fail:
cuda_err:
    specd_errf(err, errlen, SPECD_ECUDA, "cuda runner: %s", r->errmsg[0] ? r->errmsg : "CUDA error");
fail_free:
    if (scratch) cudaFree(scratch);
    cuda_destroy(&r->base);
    return NULL;
}

runner *runner_cuda_create(const model *target, const model *draft, const runner_config *cfg,
                           char *err, size_t errlen) {
    return runner_cuda_create_ex(target, draft, cfg, NULL, err, errlen);
}

/* ---- tensor parallelism (runner_tp_create's backend) --------------------------------- */

static int tp_unique_id(uint8_t uid[TP_UID_BYTES], char *err, size_t errlen) {
    return cuda_tp_get_unique_id(uid, err, errlen);
}

static runner *tp_create(const tp_config *tp, const uint8_t uid[TP_UID_BYTES], const model *target,
                         const model *draft, const runner_config *rc, char *err, size_t errlen) {
    runner_config c = *rc;
    c.device = tp->local_rank;   /* one GPU per process: local rank k drives GPU k */
    cuda_tp *t = cuda_tp_create(uid, tp->rank, tp->world_size, c.device, tp->timeout_ms, err, errlen);
    if (!t) return NULL;
    cuda_runner_opts o = {.rank = tp->rank, .world = tp->world_size, .tp = t, .quiet = tp->rank != 0};
    return runner_cuda_create_ex(target, draft, &c, &o, err, errlen);
}

const runner_tp_backend runner_cuda_tp_backend = {.name = "cuda", .unique_id = tp_unique_id, .create = tp_create};
