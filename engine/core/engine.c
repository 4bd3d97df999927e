/* The engine: configuration, creation and the request table (see engine.h); one step
 * (schedule -> run -> postprocess) is in engine_step.c. Requests live here from
 * engine_add until their finish event (or engine_abort). */
#include "engine/core/engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/engine_internal.h"
#include "engine/core/err.h"
#include "engine/core/threadpool.h"
#ifdef SPECD_HAVE_CUDA
#include "engine/cuda/cuda_runner.h"
#endif

/* ---- configuration ------------------------------------------------------------------- */

void engine_config_defaults(engine_config *c) {
    if (!c->max_seq_len) c->max_seq_len = 4096;
    if (!c->max_batch) c->max_batch = 64;
    if (!c->max_tokens_per_step) c->max_tokens_per_step = 2048;
    if (!c->max_prefill_decoding) c->max_prefill_decoding = 512;
    if (!c->block_size) c->block_size = 16;
    if (c->mem_fraction <= 0) c->mem_fraction = 0.9;
    if ((c->draft_path || c->draft_random_shape || c->draft_layers > 0 || c->spec_ngram) && !c->num_draft_tokens)
        c->num_draft_tokens = 4;
    if (!c->ngram_min) c->ngram_min = 2;
    if (!c->ngram_max) c->ngram_max = c->ngram_min > 4 ? c->ngram_min : 4;
}

void engine_sampling_defaults(engine_sampling *s) {
    memset(s, 0, sizeof *s);
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->repetition_penalty = 1.0f;
    s->max_tokens = 16;
    s->logprobs = -1;
    s->prompt_logprobs = -1;
}

static size_t mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1) break;
    fclose(f);
    return kb * 1024;
}

static size_t weight_bytes_f32(const model *m) {
    const model_config *c = &m->cfg;
    size_t per_layer = (size_t)c->hidden * (c->n_heads + 2 * c->n_kv_heads) * c->head_dim +
                       (size_t)c->n_heads * c->head_dim * c->hidden + 3 * (size_t)c->hidden * c->ffn;
    size_t n = per_layer * c->n_layers + (size_t)c->vocab * c->hidden * (c->tied_embeddings ? 1 : 2);
    return n * sizeof(float);
}

/* ---- creation ------------------------------------------------------------------------ */

/* A random model of a named real shape: made on the device by the CUDA runner, here on
 * the CPU. */
static model *shape_model(const engine_config *c, const char *name, uint64_t seed, char *err, size_t errlen) {
    model_config mc;
    if (model_shape_preset(name, &mc)) {
        specd_errf(err, errlen, SPECD_ENOTFOUND, "unknown shape '%s' (llama-3.1-8b, llama-3.2-1b, "
                   "smollm2-135m, qwen2.5-1.5b, qwen3-1.7b, qwen3-30b-a3b, gemma3-4b)", name);
        return NULL;
    }
    return c->device == ENGINE_DEVICE_CUDA ? model_shape(&mc, err, errlen) : model_random(&mc, seed, err, errlen);
}

static int load_draft(engine *e, char *err, size_t errlen) {
    const engine_config *c = &e->cfg;
    if (!!c->draft_path + !!c->draft_random_shape + (c->draft_layers > 0) + !!c->spec_ngram > 1)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "--draft-model, --draft-shape, --draft-layers and --speculative ngram are "
                          "exclusive: pick one");
    if (c->draft_path || c->draft_random_shape) {
        e->draft = c->draft_path ? model_load(c->draft_path, err, errlen)
                                 : shape_model(c, c->draft_random_shape, 2, err, errlen);
        if (!e->draft) return SPECD_EINVAL;
        if (e->draft->cfg.vocab != e->target->cfg.vocab)
            return specd_errf(err, errlen, SPECD_EINVAL,
                              "draft model %s has a vocabulary of %d tokens, target %d: the draft "
                              "must share the target's tokenizer",
                              c->draft_path ? c->draft_path : c->draft_random_shape, e->draft->cfg.vocab,
                              e->target->cfg.vocab);
        e->draft_used = e->draft;
    } else if (c->draft_layers > 0) {
        if (c->draft_layers >= e->target->cfg.n_layers)
            return specd_errf(err, errlen, SPECD_EINVAL,
                              "--draft-layers %d must be less than the target's %d layers",
                              c->draft_layers, e->target->cfg.n_layers);
        e->draft_view = *e->target;   /* shares the target's tensors; owns nothing */
        e->draft_view.cfg.n_layers = c->draft_layers;
        e->draft_view.priv = NULL;
        e->draft_used = &e->draft_view;
    }
    if (c->spec_ngram) {
        if (c->ngram_min < 1 || c->ngram_max < c->ngram_min || c->ngram_max > NGRAM_MAX_N)
            return specd_errf(err, errlen, SPECD_EINVAL, "--ngram-min %d / --ngram-max %d: need 1 <= min <= "
                              "max <= %d", c->ngram_min, c->ngram_max, NGRAM_MAX_N);
        e->drafter = ENGINE_DRAFTER_NGRAM;
    }
    if (e->draft_used) e->drafter = ENGINE_DRAFTER_MODEL;
    if (e->drafter != ENGINE_DRAFTER_NONE) {
        if (c->num_draft_tokens < 1 || c->num_draft_tokens > ENGINE_MAX_STEP_TOKENS - 1)
            return specd_errf(err, errlen, SPECD_EINVAL, "--num-draft-tokens must be 1..%d",
                              ENGINE_MAX_STEP_TOKENS - 1);
        e->k = c->num_draft_tokens;
    }
    return 0;
}

/* Layers of c that attend through a sliding window (model_layer_window: 0, or the
 * model's one window). */
static int window_layers(const model_config *c) {
    int n = 0;
    for (int l = 0; l < c->n_layers; l++) n += model_layer_window(c, l) > 0;
    return n;
}

/* The window when every layer of the model attends through the same sliding window
 * (Mistral), else 0 (full layers, as Gemma 3 has, need the whole context). */
static int all_layers_slide(const model_config *c) {
    return window_layers(c) == c->n_layers ? c->sliding_window : 0;
}

/* The window of a target whose layers mix sliding windows and full attention (Gemma 3),
 * when those layers get a window pool of their own: else 0. A draft's window layers join
 * them there (Gemma 3 270M drafting for a larger Gemma 3), so the pool keeps the wider of
 * the two windows. Both runners take it (the CUDA runner's test_gpu_runner
 * test_window_pool_matches_one_pool passed on an H100, 2026-12-05); a CPU tensor-parallel
 * group mirrors both tables to every rank, a CUDA one keeps one pool (runner_cuda_create
 * refuses a window pool there). */
static int mixed_window(const engine_config *ec, const model_config *c, const model_config *d) {
    const int n_win = window_layers(c);
    if (ec->keep_window_kv || (ec->device == ENGINE_DEVICE_CUDA && ec->tp.world_size > 1) || n_win == 0 ||
        n_win == c->n_layers)
        return 0;
    return d && window_layers(d) && d->sliding_window > c->sliding_window ? d->sliding_window : c->sliding_window;
}

/* Blocks of the window pool (with its null block) for `slots` slots: each slot's window
 * with the margin kv_window_drop_upto keeps, its draft lookahead and the block being
 * filled, plus one step's prompt chunks. */
static int window_pool_blocks(const engine *e, int window, int slots) {
    const engine_config *c = &e->cfg;
    int bs = c->block_size, per_seq = (window + 2 + e->k + bs - 1) / bs + 2;
    return slots * per_seq + (c->max_tokens_per_step + bs - 1) / bs + 2;
}

/* A whole file as a NUL-terminated string (NULL on error). */
static char *read_text_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (n >= 0 && n < (1L << 26) && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1))) {
        if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
            free(buf);
            buf = NULL;
        } else {
            buf[n] = 0;
            *len = (size_t)n;
        }
    }
    fclose(f);
    return buf;
}

/* Add a token id to the stop set once (ignoring -1 and a full set). */
static void add_stop_id(engine *e, int id) {
    if (id < 0 || e->n_eos >= (int)(sizeof e->eos / sizeof e->eos[0])) return;
    for (int i = 0; i < e->n_eos; i++)
        if (e->eos[i] == id) return;
    e->eos[e->n_eos++] = id;
}

static int load_tokenizer(engine *e, char *err, size_t errlen) {
    const char *tp = e->cfg.tokenizer_path ? e->cfg.tokenizer_path : e->cfg.model_path;
    char terr[512] = "";
    if (e->cfg.random_shape && !e->cfg.tokenizer_path) return 0;   /* token ids only */
    e->tok = tok_load(tp, terr, sizeof terr);
    if (!e->tok) {
        if (e->cfg.tokenizer_path)
            return specd_errf(err, errlen, SPECD_EINVAL, "tokenizer %s: %s", tp, terr);
        if (e->cfg.verbose)
            fprintf(stderr, "specd: no tokenizer for %s (%s): token ids only\n", tp, terr);
        return 0;
    }
    if (tok_vocab_size(e->tok) > e->vocab && e->cfg.verbose)
        fprintf(stderr, "specd: tokenizer has %d ids, model %d: larger ids are rejected\n",
                tok_vocab_size(e->tok), e->vocab);
    const char *t = tok_chat_template(e->tok);
    if (e->cfg.chat_template_path) {   /* the user's file: an error in it is fatal */
        size_t n = 0;
        char *text = read_text_file(e->cfg.chat_template_path, &n);
        if (!text)
            return specd_errf(err, errlen, SPECD_ENOTFOUND, "--chat-template %s: cannot read it",
                              e->cfg.chat_template_path);
        e->tmpl = tmpl_parse(text, n, terr, sizeof terr);
        free(text);
        if (!e->tmpl)
            return specd_errf(err, errlen, SPECD_EFORMAT, "--chat-template %s: %s", e->cfg.chat_template_path, terr);
    } else if (t) {
        e->tmpl = tmpl_parse(t, strlen(t), terr, sizeof terr);
        if (!e->tmpl) fprintf(stderr, "specd: chat template does not parse (%s): chat disabled\n", terr);
    }
    add_stop_id(e, tok_eos_id(e->tok));
    /* A chat model stops at its end-of-turn token; GGUF files name it in eot_token_id
     * (read by the model loader), but many converters leave it out (Gemma 3's, ...).
     * The families' end-of-turn tokens, when the vocabulary has them as special tokens. */
    static const char *const eot[] = {"<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>"};
    for (size_t i = 0; i < sizeof eot / sizeof eot[0]; i++) {
        int id = tok_token_id(e->tok, eot[i], strlen(eot[i]));
        if (id >= 0 && id < e->vocab && tok_is_special(e->tok, id)) add_stop_id(e, id);
    }
    return 0;
}

static int size_pool(engine *e, runner_config *rc, char *err, size_t errlen) {
    const engine_config *c = &e->cfg;
    int bs = c->block_size;
    int min_blocks = (c->max_seq_len + e->k + bs - 1) / bs;
    if (c->device == ENGINE_DEVICE_CUDA) {
        rc->num_blocks = 0;   /* the CUDA runner measures what is left after weights + graphs
                               * (capped by kv_bytes when given) */
        return 0;
    }
    int fp8 = c->kv_dtype == ENGINE_KV_FP8;
    size_t bb = runner_cpu_block_bytes(e->target, e->draft_used, bs, fp8, rc->win_blocks ? RUNNER_POOL_MAIN : RUNNER_POOL_ALL);
    size_t wb = runner_cpu_block_bytes(e->target, e->draft_used, bs, fp8, RUNNER_POOL_WINDOW);
    size_t budget = c->kv_bytes;
    if (!budget) {
        size_t avail = mem_available(), w = weight_bytes_f32(e->target);
        if (e->draft) w += weight_bytes_f32(e->draft);
        budget = avail > w ? (size_t)(c->mem_fraction * (double)(avail - w)) : 0;
    }
    if (rc->win_blocks) rc->win_blocks = runner_window_pool_fit(rc, wb, (double)budget);
    size_t win = (size_t)rc->win_blocks * wb;
    /* without a given budget, more than every slot full at max_seq_len only feeds the
     * prefix cache: cap the first pool there */
    size_t nb = budget > win ? (budget - win) / bb : 0;
    if (!c->kv_bytes && nb > (size_t)c->max_batch * (size_t)(min_blocks + 1))
        nb = (size_t)c->max_batch * (size_t)(min_blocks + 1);
    if (nb < (size_t)min_blocks)
        return specd_errf(err, errlen, SPECD_ENOSPACE,
                          "KV budget of %zu bytes holds %zu blocks of %d tokens (%zu bytes each), "
                          "but one sequence of --max-seq-len %d needs %d: lower --max-seq-len or "
                          "raise --kv-cache-bytes / --mem-fraction",
                          budget, nb, bs, bb, c->max_seq_len, min_blocks);
    if (nb > (size_t)1 << 30) nb = (size_t)1 << 30;
    rc->num_blocks = (int)nb + 1;   /* + the null block */
    return 0;
}


static int dec_outs_alloc(dec_outs *d, int rows) {
    d->tok = malloc((size_t)rows * sizeof(int32_t));
    d->lp = malloc((size_t)rows * sizeof(float));
    d->top_ids = malloc((size_t)rows * RUNNER_MAX_TOP * sizeof(int32_t));
    d->top_lp = malloc((size_t)rows * RUNNER_MAX_TOP * sizeof(float));
    d->rank = malloc((size_t)rows * sizeof(int32_t));
    return d->tok && d->lp && d->top_ids && d->top_lp && d->rank ? 0 : SPECD_ENOMEM;
}

static void dec_outs_free(dec_outs *d) {
    free(d->tok);
    free(d->lp);
    free(d->top_ids);
    free(d->top_lp);
    free(d->rank);
}
static int alloc_buffers(engine *e) {
    int B = e->cfg.max_batch, K = e->k, V = e->vocab;
    e->max_step_tokens = e->cfg.max_tokens_per_step + B * (K + 1);
    e->plan = calloc((size_t)B, sizeof *e->plan);
    e->res = calloc((size_t)B, sizeof *e->res);
    e->rows = calloc((size_t)B, sizeof *e->rows);
    e->tokens = calloc((size_t)e->max_step_tokens, sizeof *e->tokens);
    e->logits = malloc((size_t)B * (K + 1) * V * sizeof(float));
    int model = e->drafter == ENGINE_DRAFTER_MODEL;   /* prompt lookup has no draft logits */
    e->dlogits = model ? malloc((size_t)B * V * sizeof(float)) : NULL;
    e->dprobs = model ? malloc((size_t)B * K * V * sizeof(float)) : NULL;
    e->cand_row = malloc((size_t)B * sizeof(int));
    e->cand_avail = malloc((size_t)B * sizeof(int));
    e->cand_k = malloc((size_t)B * sizeof(int));
    e->cand_alpha = malloc((size_t)B * sizeof(float));
    e->cands = malloc((size_t)B * (K + 1) * sizeof *e->cands);
    e->pprobs = malloc((size_t)(K + 1) * V * sizeof(float));
    e->work = malloc((size_t)V * sizeof(float));
    e->scratch = malloc((size_t)V * sizeof(int));
    e->hist = malloc((size_t)(e->cfg.max_seq_len + K + 1) * sizeof(int32_t));
    e->dec_slots = malloc((size_t)B * sizeof(int));
    e->dec_prev = malloc((size_t)e->max_step_tokens * sizeof(int));
    /* the composed step's sampling rows: one per row or k + 1 per speculating row, and a
     * prompt chunk's positions whose logprobs are wanted (ENGINE_PROMPT_LOGIT_ROWS beyond
     * the rows at most) */
    const int SR = B * (K + 1) + ENGINE_PROMPT_LOGIT_ROWS;
    int outs_ok = dec_outs_alloc(&e->dec, SR) == 0;
    for (int i = 0; i < 2; i++) {
        e->pend[i].plan = malloc((size_t)B * sizeof *e->pend[i].plan);
        e->pend[i].res = malloc((size_t)B * sizeof *e->pend[i].res);
        e->pend[i].dead = calloc((size_t)B, sizeof *e->pend[i].dead);
        e->pend[i].spec_out = malloc((size_t)B * (K + 1) * sizeof(int32_t));
        e->pend[i].spec_n = malloc((size_t)B * sizeof(int));
        outs_ok = outs_ok && e->pend[i].plan && e->pend[i].res && e->pend[i].dead && e->pend[i].spec_out &&
                  e->pend[i].spec_n && dec_outs_alloc(&e->pend[i].o, B) == 0;
    }
    e->dec_sp = malloc((size_t)SR * sizeof(runner_sampling));
    e->spec_out = malloc((size_t)B * (K + 1) * sizeof(int32_t));
    e->spec_n = malloc((size_t)B * sizeof(int));
    e->spec_nd = malloc((size_t)B * sizeof(int));
    e->mask = malloc(vocab_mask_words(V) * sizeof *e->mask);
    e->msave = matcher_saved_new();
    e->row_masks = malloc((size_t)B * vocab_mask_words(V) * sizeof *e->row_masks);
    e->mask_rows = malloc((size_t)B * sizeof(int));
    e->mask_res = malloc((size_t)SR * sizeof(int));
    if (!e->mask || !e->msave || !e->row_masks || !e->mask_rows || !e->mask_res || !e->dec_slots || !outs_ok || !e->dec_prev || !e->dec_sp || !e->spec_out || !e->spec_n || !e->spec_nd)
        return SPECD_ENOMEM;
    for (int i = 0; i < 2; i++) {
        e->cap_events[i] = B * 3 + 8;
        e->events[i] = calloc((size_t)e->cap_events[i], sizeof *e->events[i]);
    }
    e->cap_reqs = 64;
    e->reqs = malloc((size_t)e->cap_reqs * sizeof *e->reqs);
    if (!e->cand_row || !e->cand_avail || !e->cand_k || !e->cand_alpha || !e->cands) return SPECD_ENOMEM;
    if (!e->plan || !e->res || !e->rows || !e->tokens || !e->logits || (model && (!e->dlogits || !e->dprobs)) ||
        !e->pprobs || !e->work || !e->scratch || !e->hist || !e->events[0] || !e->events[1] || !e->reqs)
        return SPECD_ENOMEM;
    return 0;
}

/* Checks, and for tensor parallelism the launch of this node's other ranks (before the
 * model is loaded, so that they load it in parallel). */
static int check_config(engine *e, char *err, size_t errlen) {
    engine_config *c = &e->cfg;
    engine_config_defaults(c);
    if (!c->model_path && !c->random_shape)
        return specd_errf(err, errlen, SPECD_EINVAL, "no model given (--model PATH)");
    if (c->max_seq_len < 2 || c->max_batch < 1 || c->block_size < 1 || c->max_tokens_per_step < 1)
        return specd_errf(err, errlen, SPECD_EINVAL, "invalid limits: max_seq_len %d, max_batch %d, block_size %d",
                          c->max_seq_len, c->max_batch, c->block_size);
#ifndef SPECD_HAVE_CUDA
    if (c->device == ENGINE_DEVICE_CUDA)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED, "this build has no CUDA support (built without nvcc)");
#endif
    if (c->tp.world_size <= 1) return 0;
    if (c->tp.nnodes < 1)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "--tensor-parallel-size: this command does not start tensor-parallel ranks yet "
                          "(it must call cli_engine_tp, as specd generate and specd bench do)");
    if (tp_config_check(&c->tp, err, errlen)) return SPECD_EINVAL;
    if (c->tp_spawn_argv && tp_nproc_per_node(&c->tp) > 1 &&
        !(e->tp_ch = tp_spawn_local(&c->tp, NULL, c->tp_spawn_argv, err, errlen)))
        return SPECD_EIO;
    /* Until the group is joined, watch the spawned ranks alone: one that dies while
     * loading must not leave rank 0 waiting out the rendezvous timeout. */
    if (e->tp_ch && c->tp.rank == 0 && c->tp_fail &&
        !(e->tp_wd = tp_watchdog_start(NULL, e->tp_ch, 100, c->tp_fail, c->tp_fail_ctx, err, errlen)))
        return SPECD_EIO;
    return 0;
}

static int load_target(engine *e, char *err, size_t errlen) {
    engine_config *c = &e->cfg;
    if (c->random_shape) {
        /* On CUDA the runner fills the weights on the device (no host copy of an 8B shape);
         * on the CPU they are made here. Both are deterministic from the seed. */
        if (!(e->target = shape_model(c, c->random_shape, 1, err, errlen))) return SPECD_EINVAL;
        c->model_path = c->random_shape;
    } else if (!(e->target = model_load(c->model_path, err, errlen))) {
        return SPECD_EINVAL;
    }
    e->vocab = e->target->cfg.vocab;
    for (int i = 0; i < e->target->cfg.n_eos; i++) e->eos[e->n_eos++] = e->target->cfg.eos_ids[i];
    /* The runtime context limit is ours; max_position_embeddings only caps it. */
    if (e->target->cfg.max_pos > 0 && c->max_seq_len > e->target->cfg.max_pos)
        c->max_seq_len = (int)e->target->cfg.max_pos;
    if (c->max_tokens_per_step < c->max_batch) c->max_tokens_per_step = c->max_batch;
    return load_draft(e, err, errlen);
}

static runner_config make_runner_config(const engine *e) {
    const engine_config *c = &e->cfg;
    runner_config rc = {
        .block_size = c->block_size, .max_batch = c->max_batch, .max_seq_len = c->max_seq_len + e->k,
        .threads = c->threads, .mem_fraction = c->mem_fraction, .kv_bytes = c->kv_bytes,
        .num_draft_tokens = e->k,
        .rope_bf16_freqs = c->rope_bf16_freqs, .cpu_verify = c->cpu_verify,
        .weights_gguf = c->weights_dtype == ENGINE_WEIGHTS_GGUF ? 1 : c->weights_dtype == ENGINE_WEIGHTS_AUTO ? -1 : 0,
        .weights_fp8 = c->weights_dtype == ENGINE_WEIGHTS_FP8 ? 1 : c->weights_dtype == ENGINE_WEIGHTS_BF16 ? -1 : 0,
        .kv_fp8 = c->kv_dtype == ENGINE_KV_FP8,
        .random_weights_seed = c->random_shape && c->device == ENGINE_DEVICE_CUDA ? 1 : 0,
    };
    rc.max_tokens_per_step = c->max_tokens_per_step + c->max_batch * (e->k + 1);
    return rc;
}

/* Rank 0's watchdog saw a rank die: release a step stuck in a collective (NCCL abort, so
 * the step fails and the requests get their errors), then the caller's handler. */
static void on_group_fail(void *ctx, const char *why) {
    engine *e = ctx;
    /* the caller's handler first: the abort may block (ncclCommAbort) */
    if (e->cfg.tp_fail) e->cfg.tp_fail(e->cfg.tp_fail_ctx, why);
    if (e->run && e->run->ops->abort_group) e->run->ops->abort_group(e->run);
}

/* This rank's runner in the group; rank 0 also watches the other ranks. */
static int join_tp(engine *e, runner_config *rc, char *err, size_t errlen) {
    const engine_config *c = &e->cfg;
    const runner_tp_backend *be = NULL;   /* the CPU runner */
#ifdef SPECD_HAVE_CUDA
    if (c->device == ENGINE_DEVICE_CUDA) be = &runner_cuda_tp_backend;
#endif
    if (!(e->run = runner_tp_create(&c->tp, be, e->target, e->draft_used, rc, &e->tp, err, errlen)))
        return SPECD_EIO;
    tp_watchdog_stop(e->tp_wd);   /* the start-up one; a death in between is still seen */
    e->tp_wd = NULL;
    if (c->tp.rank == 0 && c->tp_fail &&
        !(e->tp_wd = tp_watchdog_start(e->tp, e->tp_ch, 100, on_group_fail, e, err, errlen)))
        return SPECD_EIO;
    return 0;
}

int engine_tp_worker_run(const engine_config *cfg, char *err, size_t errlen) {
    if (cfg->tp.world_size < 2 || cfg->tp.rank < 1)
        return specd_errf(err, errlen, SPECD_EINVAL, "engine_tp_worker_run: rank %d of %d is not a worker",
                          cfg->tp.rank, cfg->tp.world_size);
    engine *e = calloc(1, sizeof *e);
    if (!e) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    e->cfg = *cfg;
    int rc = check_config(e, err, errlen);
    if (!rc) rc = load_target(e, err, errlen);
    runner_config r = make_runner_config(e);   /* sizes come from rank 0 */
    if (!rc) rc = join_tp(e, &r, err, errlen);
    if (!rc) rc = runner_tp_worker_run(e->run, e->tp, err, errlen);
    engine_destroy(e);
    return rc;
}

engine *engine_create(const engine_config *cfg_in, char *err, size_t errlen) {
    engine *e = calloc(1, sizeof *e);
    if (!e) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        return NULL;
    }
    e->cfg = *cfg_in;
    engine_config *c = &e->cfg;
    if (c->tp.world_size > 1 && c->tp.rank != 0) {
        specd_errf(err, errlen, SPECD_EINVAL, "tensor-parallel rank %d is a worker: engine_tp_worker_run",
                   c->tp.rank);
        goto fail;
    }
    if (check_config(e, err, errlen) || load_target(e, err, errlen)) goto fail;
    if (load_tokenizer(e, err, errlen)) goto fail;
    /* after load_tokenizer: the eos list is complete */
    if (e->tok && !(e->vtrie = vocab_trie_build(e->tok, e->vocab, e->eos, e->n_eos, err, errlen))) goto fail;
    e->max_tok_bytes = e->vtrie ? vocab_trie_max_bytes(e->vtrie) : 0;
    if (e->vtrie) {   /* grammar masks between steps: half the cores, at most 8 (1: inline) */
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        int nt = e->cfg.grammar_threads > 0 ? e->cfg.grammar_threads : nc >= 4 ? (int)(nc / 2 < 8 ? nc / 2 : 8) : 1;
        if (!(e->mask_pool = tp_create(nt))) {
            specd_errf(err, errlen, SPECD_ENOMEM, "out of memory for the grammar mask threads");
            goto fail;
        }
    }

    runner_config rc = make_runner_config(e);
    const model_config *dc = e->draft_used ? &e->draft_used->cfg : NULL;
    e->win_window = mixed_window(c, &e->target->cfg, dc);
    if (e->win_window) {
        rc.win_blocks = window_pool_blocks(e, e->win_window, c->max_batch);
        rc.win_min_blocks = window_pool_blocks(e, e->win_window, 1);
        e->win_layers = window_layers(&e->target->cfg) + (dc ? window_layers(dc) : 0);
    }
    if (size_pool(e, &rc, err, errlen)) goto fail;
    if (c->tp.world_size > 1) {
        if (join_tp(e, &rc, err, errlen)) goto fail;
    } else if (c->device == ENGINE_DEVICE_CUDA) {
#ifdef SPECD_HAVE_CUDA
        e->run = runner_cuda_create(e->target, e->draft_used, &rc, err, errlen);
#endif
    } else {
        e->run = runner_cpu_create(e->target, e->draft_used, &rc, err, errlen);
    }
    if (!e->run) goto fail;

    kv_pool_config kc = {.num_blocks = e->run->cfg.num_blocks, .block_size = c->block_size,
                         .enable_prefix_cache = !c->disable_prefix_cache};
    if (!(e->kv = kv_pool_create(&kc, err, errlen))) goto fail;
    if (e->win_window) {
        if (!e->run->ops->slot_write_win_blocks) {
            specd_errf(err, errlen, SPECD_EUNSUPPORTED, "%s runner has no window pool", e->run->ops->name);
            goto fail;
        }
        kc.num_blocks = e->run->cfg.win_blocks;
        if (!(e->win_kv = kv_pool_create(&kc, err, errlen))) goto fail;
    }
    e->window_release = c->keep_window_kv ? 0 : all_layers_slide(&e->target->cfg);
    if (e->draft_used && all_layers_slide(&e->draft_used->cfg) != e->window_release) e->window_release = 0;
    sched_config sc = {.max_batch = c->max_batch, .max_tokens_per_step = c->max_tokens_per_step,
                       .max_seq_len = c->max_seq_len + e->k, .lookahead = e->k,
                       .max_logit_tokens = ENGINE_PROMPT_LOGIT_ROWS, .win = e->win_kv, .window = e->win_window,
                       .max_prefill_decoding = c->max_prefill_decoding > 0 ? c->max_prefill_decoding : 0};
    if (!(e->sched = sched_create(&sc, e->kv, err, errlen))) goto fail;
    if (alloc_buffers(e)) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory for step buffers");
        goto fail;
    }
    e->st.max_seq_len = c->max_seq_len;
    e->st.max_batch = c->max_batch;
    e->st.num_draft_tokens = e->k;
    e->st.spec_drafter = engine_spec_drafter_name(e);
    e->acc_s = 1;
    e->acc_t = 2;
    e->probe_every = SPEC_PROBE_EVERY;
    if (c->verbose) {
        const model_config *m = &e->target->cfg;
        fprintf(stderr,
                "specd: %s %s: %d layers, hidden %d, heads %d/%d, head_dim %d, vocab %d\n"
                "specd: device %s, KV pool (%s) %d blocks x %d tokens = %d tokens, max_seq_len %d, "
                "max_batch %d%s\n",
                m->arch_name, c->model_path, m->n_layers, m->hidden, m->n_heads, m->n_kv_heads,
                m->head_dim, m->vocab, e->run->ops->name,
                c->kv_dtype == ENGINE_KV_FP8 ? "fp8" : c->device == ENGINE_DEVICE_CUDA ? "bf16" : "fp32",
                e->run->cfg.num_blocks - 1, c->block_size,
                (e->run->cfg.num_blocks - 1) * c->block_size, c->max_seq_len, c->max_batch,
                e->k ? ", speculative" : "");
        if (c->tp.world_size > 1)
            fprintf(stderr, "specd: tensor parallel over %d %s ranks (this is rank 0)\n", c->tp.world_size,
                    c->device == ENGINE_DEVICE_CUDA ? "GPU" : "CPU");
        if (e->drafter == ENGINE_DRAFTER_NGRAM)
            fprintf(stderr, "specd: prompt-lookup drafts: %d..%d-gram matches, k <= %d\n", c->ngram_min,
                    c->ngram_max, e->k);
        else if (e->k)
            fprintf(stderr, "specd: draft %s (%d layers), k = %d\n",
                    c->draft_path ? c->draft_path : c->draft_random_shape ? c->draft_random_shape : "target prefix",
                    e->draft_used->cfg.n_layers, e->k);
    }
    /* Speculation that costs more than it saves is turned off per step by the cost model
     * (not with tensor parallelism: the timing passes would need the workers' part). */
    if (e->k && !c->spec_always && c->tp.world_size <= 1 && engine_spec_measure(e, err, errlen)) goto fail;
    return e;
fail:
    engine_destroy(e);
    return NULL;
}

static void req_free(req *r) {
    if (!r) return;
    kv_seq_destroy(&r->seq.kv);
    kv_seq_destroy(&r->seq.kvw);
    free(r->seq.tokens);
    free(r->lb_ids);
    free(r->lb_vals);
    sample_stats_free(&r->stats);
    free(r->first_logits);
    free(r->pl);
    matcher_free(r->m);
    matcher_saved_free(r->msave);
    ngram_destroy(r->ng);
    free(r);
}

void engine_destroy(engine *e) {
    if (!e) return;
    /* Workers that exit after STOP must not look like failures to the watchdog. */
    tp_watchdog_stop(e->tp_wd);
    if (e->run) engine_step_drain(e);
    for (int i = 0; i < e->n_reqs; i++) {
        if (e->sched) sched_remove(e->sched, &e->reqs[i]->seq);
        req_free(e->reqs[i]);
    }
    free(e->reqs);
    sched_destroy(e->sched);
    kv_pool_destroy(e->kv);
    kv_pool_destroy(e->win_kv);
    runner_destroy(e->run);   /* on rank 0 of a group: broadcasts STOP */
    tp_comm_close(e->tp);
    if (e->tp_ch) {
        /* After STOP healthy workers exit; a failed group's may be dead or hung: no wait */
        if (!e->failed) tp_children_wait(e->tp_ch, 5000);
        tp_children_stop(e->tp_ch, e->failed ? 200 : 2000);
        tp_children_free(e->tp_ch);
    }
    tmpl_free(e->tmpl);
    vocab_trie_free(e->vtrie);
    free(e->mask);
    matcher_saved_free(e->msave);
    free(e->row_masks);
    free(e->mask_rows);
    free(e->mask_res);
    tp_destroy(e->mask_pool);
    tok_free(e->tok);
    model_free(e->draft);
    model_free(e->target);
    free(e->plan);
    free(e->res);
    free(e->rows);
    free(e->tokens);
    free(e->logits);
    free(e->dlogits);
    free(e->dprobs);
    free(e->pprobs);
    free(e->work);
    free(e->scratch);
    free(e->hist);
    free(e->dec_slots);
    free(e->dec_prev);
    dec_outs_free(&e->dec);
    for (int i = 0; i < 2; i++) {
        free(e->pend[i].plan);
        free(e->pend[i].res);
        free(e->pend[i].dead);
        free(e->pend[i].spec_out);
        free(e->pend[i].spec_n);
        dec_outs_free(&e->pend[i].o);
    }
    free(e->dec_sp);
    free(e->pos_ids);
    free(e->pos_counts);
    free(e->spec_out);
    free(e->spec_n);
    free(e->spec_nd);
    free(e->cand_row);
    free(e->cand_avail);
    free(e->cand_k);
    free(e->cand_alpha);
    free(e->cands);
    free(e->events[0]);
    free(e->events[1]);
    for (int b = 0; b < 2; b++) {
        for (int i = 0; i < e->n_pl_keep[b]; i++) free(e->pl_keep[b][i]);
        free(e->pl_keep[b]);
    }
    for (int i = 0; i < e->n_rec; i++) free(e->rec[i].logits);
    free(e);
}

const model_config *engine_model_config(const engine *e) { return &e->target->cfg; }
const tok_tokenizer *engine_tokenizer(const engine *e) { return e->tok; }
const tmpl_template *engine_template(const engine *e) { return e->tmpl; }
int engine_max_token_bytes(const engine *e) { return e->max_tok_bytes; }
const char *engine_device_name(const engine *e) { return e->run->ops->name; }
int engine_has_work(const engine *e) { return e->n_reqs > e->n_paused || e->pend[0].n || e->pend[1].n; }

/* ---- requests ------------------------------------------------------------------------ */

static int find_req(const engine *e, uint64_t id) {
    for (int i = 0; i < e->n_reqs; i++)
        if (e->reqs[i]->id == id) return i;
    return -1;
}

void engine_req_drop(engine *e, req *r) {
    int i = find_req(e, r->id);
    if (r->seq.paused) e->n_paused--;
    engine_step_forget(e, r);
    sched_remove(e->sched, &r->seq);
    if (i >= 0) e->reqs[i] = e->reqs[--e->n_reqs];
    req_free(r);
}

int engine_add(engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
               const engine_sampling *sp, char *err, size_t errlen) {
    return engine_add_ex(e, req_id, prompt, n_prompt, sp, 0, err, errlen);
}

static int prepare(const engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
                   const engine_sampling *sp, int record, req **out, char *err, size_t errlen) {
    if (n_prompt < 1) return specd_errf(err, errlen, SPECD_ERANGE, "prompt is empty");
    if (n_prompt + 1 > e->cfg.max_seq_len)
        return specd_errf(err, errlen, SPECD_ERANGE,
                          "prompt of %d tokens leaves no room to generate within max_seq_len %d",
                          n_prompt, e->cfg.max_seq_len);
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= e->vocab)
            return specd_errf(err, errlen, SPECD_EINVAL, "token id %d at position %d is outside the "
                              "vocabulary (0..%d)", prompt[i], i, e->vocab - 1);
    if (sp->temperature < 0 || sp->top_p <= 0 || sp->top_p > 1 || sp->top_k < 0 || sp->min_p < 0 ||
        sp->min_p > 1 || sp->repetition_penalty <= 0 || sp->max_tokens < 0 ||
        sp->logprobs > ENGINE_MAX_TOP_LOGPROBS || sp->prompt_logprobs > ENGINE_MAX_TOP_LOGPROBS ||
        sp->n_logit_bias < 0)
        return specd_errf(err, errlen, SPECD_EINVAL, "invalid sampling parameters");
    req *r = calloc(1, sizeof *r);
    if (!r) return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    r->id = req_id;
    r->sp = *sp;
    r->max_new = sp->max_tokens;
    if (r->max_new > e->cfg.max_seq_len - n_prompt) r->max_new = e->cfg.max_seq_len - n_prompt;
    int cap = n_prompt + r->max_new + e->k + 2;
    r->seq.tokens = malloc((size_t)cap * sizeof(int32_t));
    if (sp->n_logit_bias) {
        r->lb_ids = malloc((size_t)sp->n_logit_bias * sizeof(int32_t));
        r->lb_vals = malloc((size_t)sp->n_logit_bias * sizeof(float));
    }
    if (record) r->first_logits = malloc((size_t)e->vocab * sizeof(float));
    if (sp->prompt_logprobs >= 0) r->pl = calloc((size_t)n_prompt, sizeof *r->pl);
    int max_blocks = (e->cfg.max_seq_len + e->k + e->cfg.block_size - 1) / e->cfg.block_size;
    if (!r->seq.tokens || (sp->n_logit_bias && (!r->lb_ids || !r->lb_vals)) ||
        (record && !r->first_logits) || (sp->prompt_logprobs >= 0 && !r->pl) || kv_seq_init(&r->seq.kv, max_blocks) ||
        (e->win_kv && kv_seq_init(&r->seq.kvw, max_blocks)) ||
        engine_spec_req_init(e, r, cap)) {
        req_free(r);
        return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    }
    memcpy(r->seq.tokens, prompt, (size_t)n_prompt * sizeof(int32_t));
    if (sp->n_logit_bias) {
        memcpy(r->lb_ids, sp->logit_bias_ids, (size_t)sp->n_logit_bias * sizeof(int32_t));
        memcpy(r->lb_vals, sp->logit_bias_vals, (size_t)sp->n_logit_bias * sizeof(float));
    }
    r->sp.logit_bias_ids = r->lb_ids;
    r->sp.logit_bias_vals = r->lb_vals;
    r->sp.grammar = NULL;   /* the matcher holds the request's reference */
    if (sp->grammar) {
        if (!e->vtrie) {
            req_free(r);
            return specd_errf(err, errlen, SPECD_EINVAL, "constrained decoding needs the model's tokenizer");
        }
        if (!(r->m = matcher_new(sp->grammar, e->vtrie)) ||
            (e->drafter == ENGINE_DRAFTER_NGRAM && !(r->msave = matcher_saved_new()))) {
            req_free(r);
            return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        }
    }
    r->record = record;
    if (r->pl) {   /* token ids now; logprobs as the prompt's chunks are computed */
        for (int i = 0; i < n_prompt; i++) r->pl[i] = (engine_token){.id = prompt[i], .logprob = NAN};
        r->seq.all_logits = 1;
    }
    r->seq.id = req_id;
    r->seq.n_tokens = n_prompt;
    r->seq.n_prompt = n_prompt;
    r->seq.slot = -1;
    r->seq.user = r;
    r->seed = sp->has_seed ? sp->seed : (req_id * 0x9e3779b97f4a7c15ULL) ^ (uint64_t)(uintptr_t)r;
    r->spp = (sample_params){
        .temperature = sp->temperature, .top_p = sp->top_p, .top_k = sp->top_k, .min_p = sp->min_p,
        .presence_penalty = sp->presence_penalty, .frequency_penalty = sp->frequency_penalty,
        .repetition_penalty = sp->repetition_penalty, .n_logit_bias = sp->n_logit_bias,
        .logit_bias_ids = r->lb_ids, .logit_bias_vals = r->lb_vals, .eos_ids = e->eos,
        .n_eos = e->n_eos,
    };
    /* A penalised request keeps its token statistics for the runners' on-device penalties;
     * the repetition penalty covers the prompt too. */
    int rep = sp->repetition_penalty != 1.0f;
    if (rep || sp->presence_penalty != 0 || sp->frequency_penalty != 0) {
        int cap = (rep ? n_prompt : 0) + r->max_new;
        if (sample_stats_init(&r->stats, cap < e->vocab ? cap : e->vocab)) {
            req_free(r);
            return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        }
        for (int i = 0; rep && i < n_prompt; i++) sample_stats_add(&r->stats, prompt[i], 0);
    }
    *out = r;
    return 0;
}

static int submit(engine *e, req *r, char *err, size_t errlen) {
    int rc = SPECD_ENOMEM;
    if (e->failed) {
        rc = specd_errf(err, errlen, SPECD_ESTATE, "engine failed; restart the server");
        goto fail;
    }
    if (find_req(e, r->id) >= 0) {
        rc = specd_errf(err, errlen, SPECD_EINVAL, "request id %llu already exists", (unsigned long long)r->id);
        goto fail;
    }
    if (e->n_reqs == e->cap_reqs) {
        req **n = realloc(e->reqs, (size_t)e->cap_reqs * 2 * sizeof *n);
        if (!n) {
            rc = specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
            goto fail;
        }
        e->reqs = n;
        e->cap_reqs *= 2;
    }
    if (r->pl && !e->pl_logit_rows) {
        /* the first request for prompt logprobs: room for the prompt positions' logits */
        size_t rows = (size_t)e->cfg.max_batch * (size_t)(e->k + 1) + ENGINE_PROMPT_LOGIT_ROWS;
        float *n = realloc(e->logits, rows * (size_t)e->vocab * sizeof(float));
        if (!n) {
            rc = specd_errf(err, errlen, SPECD_ENOMEM, "out of memory for prompt logits");
            goto fail;
        }
        e->logits = n;
        e->pl_logit_rows = ENGINE_PROMPT_LOGIT_ROWS;
    }
    if ((rc = sched_add(e->sched, &r->seq))) {
        rc = specd_errf(err, errlen, rc, "scheduler refused the request: %s", specd_strerror(rc));
        goto fail;
    }
    e->reqs[e->n_reqs++] = r;
    e->st.prompt_tokens += (uint64_t)r->seq.n_prompt;
    return 0;
fail:
    req_free(r);
    return rc;
}

int engine_add_ex(engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
                  const engine_sampling *sp, int record, char *err, size_t errlen) {
    req *r;
    int rc = prepare(e, req_id, prompt, n_prompt, sp, record, &r, err, errlen);
    return rc ? rc : submit(e, r, err, errlen);
}

int engine_prepare(const engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
                   const engine_sampling *sp, engine_pending **out, char *err, size_t errlen) {
    return prepare(e, req_id, prompt, n_prompt, sp, 0, out, err, errlen);
}

int engine_submit(engine *e, engine_pending *p, char *err, size_t errlen) { return submit(e, p, err, errlen); }

void engine_pending_free(engine_pending *p) {
    if (p) req_free(p);
}

int engine_pause(engine *e, uint64_t req_id, int paused) {
    int i = find_req(e, req_id);
    if (i < 0) return SPECD_ENOTFOUND;
    req *r = e->reqs[i];
    paused = !!paused;
    if (r->seq.paused != paused) e->n_paused += paused ? 1 : -1;
    r->seq.paused = paused;
    return 0;
}

int engine_abort(engine *e, uint64_t req_id) {
    int i = find_req(e, req_id);
    if (i < 0) return SPECD_ENOTFOUND;
    engine_req_drop(e, e->reqs[i]);
    return 0;
}

int engine_first_logits(engine *e, uint64_t req_id, float *dst) {
    for (int j = 0; j < e->n_rec; j++) {
        if (e->rec[j].id != req_id) continue;
        memcpy(dst, e->rec[j].logits, (size_t)e->vocab * sizeof(float));
        free(e->rec[j].logits);
        e->rec[j] = e->rec[--e->n_rec];
        return 0;
    }
    int i = find_req(e, req_id);
    if (i < 0 || !e->reqs[i]->record || e->reqs[i]->n_out == 0) return SPECD_ENOTFOUND;
    memcpy(dst, e->reqs[i]->first_logits, (size_t)e->vocab * sizeof(float));
    return 0;
}

void engine_get_stats(const engine *e, engine_stats *st) {
    *st = e->st;
    st->running = sched_num_running(e->sched);
    st->waiting = sched_num_waiting(e->sched);
    st->paused = e->n_paused;
    st->kv_blocks_total = kv_num_blocks(e->kv) - 1;
    st->kv_blocks_used = kv_num_used(e->kv);
    st->kv_blocks_free = kv_num_free(e->kv);
    st->kv_blocks_cached = kv_num_cached(e->kv);
    st->kv_win_layers = e->win_layers;
    st->kv_layers = e->target->cfg.n_layers + (e->draft_used ? e->draft_used->cfg.n_layers : 0) - e->win_layers;
    if (e->win_kv) {
        st->kv_win_blocks_total = kv_num_blocks(e->win_kv) - 1;
        st->kv_win_blocks_used = kv_num_used(e->win_kv);
    }
    st->kv_bytes_used = (double)st->kv_blocks_used * (double)e->run->kv_block_bytes[0] +
                        (double)st->kv_win_blocks_used * (double)e->run->kv_block_bytes[1];
}
