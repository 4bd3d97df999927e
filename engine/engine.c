/* The engine: one step = schedule -> run -> postprocess (see engine.h).
 *
 * Phases of engine_step:
 *   1. the scheduler picks rows and how many tokens each feeds;
 *   2. slot sync: a row that got a (new) slot has its block table and lengths written
 *      into the runner; a row whose table grew has the new block ids appended;
 *   3. with a draft model: the draft catches up on every row (prefill chunks, tokens it
 *      has not seen) and proposes k tokens for each decoding row, one pass per token;
 *   4. one target pass over every row (prefill chunks and k+1 verify tokens);
 *   5. sampling / acceptance, length rollback, prefix-cache commit, finish checks,
 *      events.
 * Requests live here from engine_add until their finish event (or engine_abort). */
#include "engine/engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/err.h"
#include "engine/kv.h"
#include "engine/runner.h"
#include "engine/runner_tp.h"
#include "engine/sample.h"
#include "engine/sched.h"
#include "engine/spec.h"

typedef struct req {
    sched_seq seq;               /* seq.user points back here */
    uint64_t id;
    engine_sampling sp;
    int32_t *lb_ids;
    float *lb_vals;
    sample_params spp;
    uint64_t seed;
    int max_new;                 /* new tokens at most */
    int n_out;                   /* generated so far */
    uint32_t synced_epoch;       /* slot epoch mirrored into the runner */
    int synced_blocks;           /* block-table entries mirrored into the runner */
    int record;                  /* keep the logits that chose the first output token */
    float *first_logits;
    int n_cached;                /* prompt tokens served from the prefix cache */
    int verify_steps, draft_tokens, accepted;
} req;

/* Per-row plan of one step. */
typedef struct {
    req *r;
    int n_new;                   /* target tokens to feed (from the scheduler) */
    int spec;                    /* decoding row that speculates this step */
    int target_logits;           /* 0, 1 or k+1 rows of target logits */
    int logits_off;              /* first target logits row */
    int32_t drafts[ENGINE_MAX_STEP_TOKENS];
} row_plan;

struct engine {
    engine_config cfg;
    model *target;
    model *draft;                /* loaded draft, or NULL */
    model draft_view;            /* --draft-layers: target's first N layers (no ownership) */
    const model *draft_used;     /* draft or &draft_view or NULL */
    tok_tokenizer *tok;
    tmpl_template *tmpl;
    kv_pool *kv;
    sched *sched;
    runner *run;
    int k;                       /* draft tokens per step (0: no speculation) */
    int vocab;
    int32_t eos[MODEL_MAX_EOS + 1];
    int n_eos;

    req **reqs;                  /* live requests (unordered) */
    int n_reqs, cap_reqs;

    /* step buffers, sized at creation: no allocation per token */
    row_plan *plan;
    runner_row *rows;
    int32_t *tokens;
    float *logits;               /* target: (max_batch*(k+1), vocab) */
    float *dlogits;              /* draft:  (max_batch, vocab) */
    float *dprobs;               /* draft distributions (max_batch, k, vocab) */
    float *pprobs;               /* target distributions of one row (k+1, vocab) */
    float *work;                 /* (vocab) */
    int *scratch;                /* (vocab) */
    int32_t *hist;               /* (max_seq_len + k) history with pending drafts */
    int *dec_slots;              /* on-device decode fast path: (max_batch) each */
    int32_t *dec_tokens, *dec_out;
    int32_t *spec_out;           /* (max_batch, k+1) tokens of a runner speculative step */
    int *spec_n;                 /* (max_batch) */
    runner_sampling *dec_sp;
    engine_event *events;
    int cap_events;
    int max_step_tokens;

    /* first-token logits of finished requests added with record=1, until read */
    struct { uint64_t id; float *logits; } rec[16];
    int n_rec;

    int failed;
    engine_stats st;

    /* tensor parallelism (cfg.tp.world_size > 1) */
    tp_children *tp_ch;          /* ranks this process spawned */
    tp_comm *tp;                 /* the group; run->ops is the TP wrapper on rank 0 */
    tp_watchdog *tp_wd;
};

/* ---- configuration ------------------------------------------------------------------- */

void engine_config_defaults(engine_config *c) {
    if (!c->max_seq_len) c->max_seq_len = 4096;
    if (!c->max_batch) c->max_batch = 64;
    if (!c->max_tokens_per_step) c->max_tokens_per_step = 2048;
    if (!c->block_size) c->block_size = 16;
    if (c->mem_fraction <= 0) c->mem_fraction = 0.9;
    if ((c->draft_path || c->draft_layers > 0) && !c->num_draft_tokens) c->num_draft_tokens = 4;
}

void engine_sampling_defaults(engine_sampling *s) {
    memset(s, 0, sizeof *s);
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->repetition_penalty = 1.0f;
    s->max_tokens = 16;
    s->logprobs = -1;
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

static int load_draft(engine *e, char *err, size_t errlen) {
    const engine_config *c = &e->cfg;
    if (c->draft_path && c->draft_layers > 0)
        return specd_errf(err, errlen, SPECD_EINVAL,
                          "--draft-model and --draft-layers are exclusive: pick one");
    if (c->draft_path) {
        e->draft = model_load(c->draft_path, err, errlen);
        if (!e->draft) return SPECD_EINVAL;
        if (e->draft->cfg.vocab != e->target->cfg.vocab)
            return specd_errf(err, errlen, SPECD_EINVAL,
                              "draft model %s has a vocabulary of %d tokens, target %d: the draft "
                              "must share the target's tokenizer",
                              c->draft_path, e->draft->cfg.vocab, e->target->cfg.vocab);
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
    if (e->draft_used) {
        if (c->num_draft_tokens < 1 || c->num_draft_tokens > ENGINE_MAX_STEP_TOKENS - 1)
            return specd_errf(err, errlen, SPECD_EINVAL, "--num-draft-tokens must be 1..%d",
                              ENGINE_MAX_STEP_TOKENS - 1);
        e->k = c->num_draft_tokens;
    }
    return 0;
}

static int load_tokenizer(engine *e, char *err, size_t errlen) {
    const char *tp = e->cfg.tokenizer_path ? e->cfg.tokenizer_path : e->cfg.model_path;
    char terr[512] = "";
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
    if (t) {
        e->tmpl = tmpl_parse(t, strlen(t), terr, sizeof terr);
        if (!e->tmpl) fprintf(stderr, "specd: chat template does not parse (%s): chat disabled\n", terr);
    }
    int eos = tok_eos_id(e->tok);
    if (eos >= 0 && e->n_eos < MODEL_MAX_EOS + 1) {
        int dup = 0;
        for (int i = 0; i < e->n_eos; i++) dup |= e->eos[i] == eos;
        if (!dup) e->eos[e->n_eos++] = eos;
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
    size_t bb = runner_cpu_block_bytes(e->target, e->draft_used, bs);
    size_t budget = c->kv_bytes;
    if (!budget) {
        size_t avail = mem_available(), w = weight_bytes_f32(e->target);
        if (e->draft) w += weight_bytes_f32(e->draft);
        budget = avail > w ? (size_t)(c->mem_fraction * (double)(avail - w)) : 0;
        /* more than every slot full at max_seq_len only feeds the prefix cache; cap it */
        size_t cap = (size_t)c->max_batch * (size_t)(min_blocks + 1) * bb;
        if (budget > cap) budget = cap;
    }
    size_t nb = budget / bb;
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

static int alloc_buffers(engine *e) {
    int B = e->cfg.max_batch, K = e->k, V = e->vocab;
    e->max_step_tokens = e->cfg.max_tokens_per_step + B * (K + 1);
    e->plan = calloc((size_t)B, sizeof *e->plan);
    e->rows = calloc((size_t)B, sizeof *e->rows);
    e->tokens = calloc((size_t)e->max_step_tokens, sizeof *e->tokens);
    e->logits = malloc((size_t)B * (K + 1) * V * sizeof(float));
    e->dlogits = K ? malloc((size_t)B * V * sizeof(float)) : NULL;
    e->dprobs = K ? malloc((size_t)B * K * V * sizeof(float)) : NULL;
    e->pprobs = malloc((size_t)(K + 1) * V * sizeof(float));
    e->work = malloc((size_t)V * sizeof(float));
    e->scratch = malloc((size_t)V * sizeof(int));
    e->hist = malloc((size_t)(e->cfg.max_seq_len + K + 1) * sizeof(int32_t));
    e->dec_slots = malloc((size_t)B * sizeof(int));
    e->dec_tokens = malloc((size_t)B * sizeof(int32_t));
    e->dec_out = malloc((size_t)B * sizeof(int32_t));
    e->dec_sp = malloc((size_t)B * sizeof(runner_sampling));
    e->spec_out = malloc((size_t)B * (K + 1) * sizeof(int32_t));
    e->spec_n = malloc((size_t)B * sizeof(int));
    if (!e->dec_slots || !e->dec_tokens || !e->dec_out || !e->dec_sp || !e->spec_out || !e->spec_n)
        return SPECD_ENOMEM;
    e->cap_events = B * 3 + 8;
    e->events = calloc((size_t)e->cap_events, sizeof *e->events);
    e->cap_reqs = 64;
    e->reqs = malloc((size_t)e->cap_reqs * sizeof *e->reqs);
    if (!e->plan || !e->rows || !e->tokens || !e->logits || (K && (!e->dlogits || !e->dprobs)) ||
        !e->pprobs || !e->work || !e->scratch || !e->hist || !e->events || !e->reqs)
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
    if (c->device == ENGINE_DEVICE_CUDA)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "--tensor-parallel-size runs on --device cpu only for now (the CUDA runner's "
                          "NCCL integration is not done: docs/tensor-parallel.md)");
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
        model_config mc;
        if (model_shape_preset(c->random_shape, &mc))
            return specd_errf(err, errlen, SPECD_ENOTFOUND, "unknown shape '%s' (llama-3.1-8b, llama-3.2-1b, "
                              "qwen2.5-1.5b, qwen3-1.7b)", c->random_shape);
        if (!(e->target = model_random(&mc, 1, err, errlen))) return SPECD_EINVAL;
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
        .rope_bf16_freqs = c->rope_bf16_freqs,
    };
    rc.max_tokens_per_step = c->max_tokens_per_step + c->max_batch * (e->k + 1);
    return rc;
}

/* This rank's runner in the group; rank 0 also watches the other ranks. */
static int join_tp(engine *e, runner_config *rc, char *err, size_t errlen) {
    const engine_config *c = &e->cfg;
    if (!(e->run = runner_tp_create(&c->tp, e->target, e->draft_used, rc, &e->tp, err, errlen))) return SPECD_EIO;
    tp_watchdog_stop(e->tp_wd);   /* the start-up one; a death in between is still seen */
    e->tp_wd = NULL;
    if (c->tp.rank == 0 && c->tp_fail &&
        !(e->tp_wd = tp_watchdog_start(e->tp, e->tp_ch, 100, c->tp_fail, c->tp_fail_ctx, err, errlen)))
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

    runner_config rc = make_runner_config(e);
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
    sched_config sc = {.max_batch = c->max_batch, .max_tokens_per_step = c->max_tokens_per_step,
                       .max_seq_len = c->max_seq_len + e->k, .lookahead = e->k};
    if (!(e->sched = sched_create(&sc, e->kv, err, errlen))) goto fail;
    if (alloc_buffers(e)) {
        specd_errf(err, errlen, SPECD_ENOMEM, "out of memory for step buffers");
        goto fail;
    }
    e->st.max_seq_len = c->max_seq_len;
    e->st.max_batch = c->max_batch;
    e->st.num_draft_tokens = e->k;
    if (c->verbose) {
        const model_config *m = &e->target->cfg;
        fprintf(stderr,
                "specd: %s %s: %d layers, hidden %d, heads %d/%d, head_dim %d, vocab %d\n"
                "specd: device %s, KV pool %d blocks x %d tokens = %d tokens, max_seq_len %d, "
                "max_batch %d%s\n",
                m->arch_name, c->model_path, m->n_layers, m->hidden, m->n_heads, m->n_kv_heads,
                m->head_dim, m->vocab, e->run->ops->name, e->run->cfg.num_blocks - 1, c->block_size,
                (e->run->cfg.num_blocks - 1) * c->block_size, c->max_seq_len, c->max_batch,
                e->k ? ", speculative" : "");
        if (c->tp.world_size > 1)
            fprintf(stderr, "specd: tensor parallel over %d CPU ranks (this is rank 0; draft replicated)\n",
                    c->tp.world_size);
        if (e->k)
            fprintf(stderr, "specd: draft %s (%d layers), k = %d\n",
                    c->draft_path ? c->draft_path : "target prefix", e->draft_used->cfg.n_layers, e->k);
    }
    return e;
fail:
    engine_destroy(e);
    return NULL;
}

static void req_free(req *r) {
    if (!r) return;
    kv_seq_destroy(&r->seq.kv);
    free(r->seq.tokens);
    free(r->lb_ids);
    free(r->lb_vals);
    free(r->first_logits);
    free(r);
}

void engine_destroy(engine *e) {
    if (!e) return;
    /* Workers that exit after STOP must not look like failures to the watchdog. */
    tp_watchdog_stop(e->tp_wd);
    for (int i = 0; i < e->n_reqs; i++) {
        if (e->sched) sched_remove(e->sched, &e->reqs[i]->seq);
        req_free(e->reqs[i]);
    }
    free(e->reqs);
    sched_destroy(e->sched);
    kv_pool_destroy(e->kv);
    runner_destroy(e->run);   /* on rank 0 of a group: broadcasts STOP */
    tp_comm_close(e->tp);
    if (e->tp_ch) {
        tp_children_wait(e->tp_ch, 5000);   /* they exit after STOP */
        tp_children_stop(e->tp_ch, 2000);
        tp_children_free(e->tp_ch);
    }
    tmpl_free(e->tmpl);
    tok_free(e->tok);
    model_free(e->draft);
    model_free(e->target);
    free(e->plan);
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
    free(e->dec_tokens);
    free(e->dec_out);
    free(e->dec_sp);
    free(e->spec_out);
    free(e->spec_n);
    free(e->events);
    for (int i = 0; i < e->n_rec; i++) free(e->rec[i].logits);
    free(e);
}

const model_config *engine_model_config(const engine *e) { return &e->target->cfg; }
const tok_tokenizer *engine_tokenizer(const engine *e) { return e->tok; }
const tmpl_template *engine_template(const engine *e) { return e->tmpl; }
const char *engine_device_name(const engine *e) { return e->run->ops->name; }
int engine_has_work(const engine *e) { return e->n_reqs > 0; }

/* ---- requests ------------------------------------------------------------------------ */

static int find_req(const engine *e, uint64_t id) {
    for (int i = 0; i < e->n_reqs; i++)
        if (e->reqs[i]->id == id) return i;
    return -1;
}

static void drop_req(engine *e, req *r) {
    int i = find_req(e, r->id);
    sched_remove(e->sched, &r->seq);
    if (i >= 0) e->reqs[i] = e->reqs[--e->n_reqs];
    req_free(r);
}

int engine_add(engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
               const engine_sampling *sp, char *err, size_t errlen) {
    return engine_add_ex(e, req_id, prompt, n_prompt, sp, 0, err, errlen);
}

int engine_add_ex(engine *e, uint64_t req_id, const int32_t *prompt, int n_prompt,
                  const engine_sampling *sp, int record, char *err, size_t errlen) {
    if (e->failed) return specd_errf(err, errlen, SPECD_ESTATE, "engine failed; restart the server");
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
        sp->logprobs > ENGINE_MAX_TOP_LOGPROBS || sp->n_logit_bias < 0)
        return specd_errf(err, errlen, SPECD_EINVAL, "invalid sampling parameters");
    if (find_req(e, req_id) >= 0)
        return specd_errf(err, errlen, SPECD_EINVAL, "request id %llu already exists",
                          (unsigned long long)req_id);
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
    int max_blocks = (e->cfg.max_seq_len + e->k + e->cfg.block_size - 1) / e->cfg.block_size;
    if (!r->seq.tokens || (sp->n_logit_bias && (!r->lb_ids || !r->lb_vals)) ||
        (record && !r->first_logits) || kv_seq_init(&r->seq.kv, max_blocks)) {
        req_free(r);
        return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
    }
    if (e->n_reqs == e->cap_reqs) {
        req **n = realloc(e->reqs, (size_t)e->cap_reqs * 2 * sizeof *n);
        if (!n) {
            req_free(r);
            return specd_errf(err, errlen, SPECD_ENOMEM, "out of memory");
        }
        e->reqs = n;
        e->cap_reqs *= 2;
    }
    memcpy(r->seq.tokens, prompt, (size_t)n_prompt * sizeof(int32_t));
    if (sp->n_logit_bias) {
        memcpy(r->lb_ids, sp->logit_bias_ids, (size_t)sp->n_logit_bias * sizeof(int32_t));
        memcpy(r->lb_vals, sp->logit_bias_vals, (size_t)sp->n_logit_bias * sizeof(float));
    }
    r->sp.logit_bias_ids = r->lb_ids;
    r->sp.logit_bias_vals = r->lb_vals;
    r->record = record;
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
    int rc = sched_add(e->sched, &r->seq);
    if (rc) {
        req_free(r);
        return specd_errf(err, errlen, rc, "scheduler refused the request: %s", specd_strerror(rc));
    }
    e->reqs[e->n_reqs++] = r;
    e->st.prompt_tokens += (uint64_t)n_prompt;
    return 0;
}

int engine_abort(engine *e, uint64_t req_id) {
    int i = find_req(e, req_id);
    if (i < 0) return SPECD_ENOTFOUND;
    drop_req(e, e->reqs[i]);
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

/* ---- one step -------------------------------------------------------------------------- */

/* Mirror the scheduler's slot decisions into the runner (phase 2). */
static int sync_slot(engine *e, req *r) {
    sched_seq *s = &r->seq;
    runner *run = e->run;
    int rc;
    if (s->slot_epoch != r->synced_epoch || r->synced_blocks == 0) {
        /* new slot (admission or re-admission after preemption): whole row + lengths */
        if ((rc = run->ops->slot_write_blocks(run, s->slot, 0, s->kv.blocks, s->kv.n_blocks))) return rc;
        if ((rc = run->ops->slot_set_len(run, s->slot, RUNNER_TARGET, s->n_computed))) return rc;
        if ((rc = run->ops->slot_set_len(run, s->slot, RUNNER_DRAFT, s->n_computed))) return rc;
        r->synced_epoch = s->slot_epoch;
        r->synced_blocks = s->kv.n_blocks;
        if (r->n_cached == 0 && s->n_computed > 0 && r->n_out == 0) {
            r->n_cached = s->n_computed;
            e->st.prefix_cache_hit_tokens += (uint64_t)s->n_computed;
        }
    } else if (s->kv.n_blocks > r->synced_blocks) {
        if ((rc = run->ops->slot_write_blocks(run, s->slot, r->synced_blocks,
                                              s->kv.blocks + r->synced_blocks,
                                              s->kv.n_blocks - r->synced_blocks)))
            return rc;
        r->synced_blocks = s->kv.n_blocks;
    }
    return 0;
}

/* The array holds 3 * max_batch + 8 events; only mass rejection or failure can exceed
 * that, and then it grows (callers hold an event pointer only until the next call). */
static engine_event *new_event(engine *e, engine_output *out, req *r) {
    if (out->n_events == e->cap_events) {
        engine_event *n = realloc(e->events, sizeof *n * (size_t)e->cap_events * 2);
        if (!n) abort();
        e->events = out->events = n;
        e->cap_events *= 2;
    }
    engine_event *ev = &e->events[out->n_events++];
    memset(ev, 0, sizeof *ev);
    ev->req_id = r->id;
    return ev;
}

static void fill_counts(engine_event *ev, const req *r) {
    ev->n_prompt_tokens = r->seq.n_prompt;
    ev->n_output_tokens = r->n_out;
    ev->n_cached_tokens = r->n_cached;
    ev->spec_verify_steps = r->verify_steps;
    ev->spec_draft_tokens = r->draft_tokens;
    ev->spec_accepted_tokens = r->accepted;
}

static int is_eos(const engine *e, int32_t t) {
    for (int i = 0; i < e->n_eos; i++)
        if (e->eos[i] == t) return 1;
    return 0;
}

/* Record one emitted token (logprobs from the raw target logits). Returns a finish
 * reason when this token ends the request. */
static engine_finish emit_token(engine *e, req *r, engine_event *ev, int32_t t, const float *raw) {
    engine_token *et = &ev->tokens[ev->n_tokens++];
    et->id = t;
    if (raw && r->sp.logprobs >= 0) {
        et->logprob = sample_logprob(raw, e->vocab, t);
        if (r->sp.logprobs > 0)
            et->n_top = sample_top_logprobs(raw, e->vocab, r->sp.logprobs, et->top_ids, et->top_logprobs);
    }
    if (raw && r->record && r->n_out == 0) memcpy(r->first_logits, raw, (size_t)e->vocab * sizeof(float));
    r->seq.tokens[r->seq.n_tokens++] = t;
    r->n_out++;
    e->st.generation_tokens++;
    if (!r->sp.ignore_eos && is_eos(e, t) && r->n_out > r->sp.min_tokens - 1) return ENGINE_FINISH_STOP;
    if (r->n_out >= r->max_new || r->seq.n_tokens >= e->cfg.max_seq_len) return ENGINE_FINISH_LENGTH;
    return ENGINE_RUNNING;
}

/* Processed logits -> token for a non-speculative row (logits are modified). */
static int32_t sample_row(engine *e, req *r, float *logits, const int32_t *hist, int n_hist) {
    r->spp.suppress_eos = r->n_out < r->sp.min_tokens;
    sample_apply_penalties(logits, e->vocab, &r->spp, hist, n_hist, r->seq.n_prompt, e->scratch);
    if (r->sp.temperature <= 0) return sample_argmax(logits, e->vocab);
    sample_probs(logits, e->vocab, &r->spp, e->scratch);
    return sample_from_probs(logits, e->vocab, sample_uniform(r->seed, 2 * (uint64_t)r->n_out));
}


/* Phase 3: the draft catches up on every row and proposes k tokens for speculating rows. */
static int draft_phase(engine *e, int n) {
    runner *run = e->run;
    int nr = 0, nt = 0, no = 0;
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        sched_seq *s = &p->r->seq;
        int dlen = run->ops->slot_get_len(run, s->slot, RUNNER_DRAFT);
        int upto = p->spec ? s->n_tokens : s->n_computed + p->n_new;
        if (upto <= dlen) continue;
        runner_row *row = &e->rows[nr++];
        *row = (runner_row){.slot = s->slot, .n_new = upto - dlen, .tok_off = nt,
                            .n_logits = p->spec ? 1 : 0, .logits_off = p->spec ? no : 0};
        memcpy(e->tokens + nt, s->tokens + dlen, (size_t)(upto - dlen) * sizeof(int32_t));
        nt += upto - dlen;
        if (p->spec) p->logits_off = no++;   /* draft logits row of this plan row */
    }
    runner_batch b = {.which = RUNNER_DRAFT, .n_rows = nr, .rows = e->rows, .tokens = e->tokens,
                      .n_tokens = nt, .logits = e->dlogits};
    int rc = nr ? runner_forward(run, &b) : 0;
    for (int j = 0; rc == 0 && j < e->k; j++) {
        /* pick draft token j for each speculating row, then feed it (except the last) */
        nr = 0;
        for (int i = 0; i < n; i++) {
            row_plan *p = &e->plan[i];
            if (!p->spec) continue;
            req *r = p->r;
            float *lg = e->dlogits + (size_t)p->logits_off * e->vocab;
            int32_t d;
            /* the history the target will see at this position: tokens + earlier drafts */
            int nh = r->seq.n_tokens;
            memcpy(e->hist, r->seq.tokens, (size_t)nh * sizeof(int32_t));
            memcpy(e->hist + nh, p->drafts, (size_t)j * sizeof(int32_t));
            r->spp.suppress_eos = r->n_out + j < r->sp.min_tokens;
            sample_apply_penalties(lg, e->vocab, &r->spp, e->hist, nh + j, r->seq.n_prompt, e->scratch);
            if (r->sp.temperature <= 0) {
                d = sample_argmax(lg, e->vocab);
            } else {
                float *q = e->dprobs + ((size_t)i * e->k + j) * e->vocab;
                memcpy(q, lg, (size_t)e->vocab * sizeof(float));
                sample_probs(q, e->vocab, &r->spp, e->scratch);
                d = sample_from_probs(q, e->vocab, sample_uniform(r->seed ^ SPEC_SALT_DRAFT, (uint64_t)r->n_out + j));
            }
            p->drafts[j] = d;
            if (j + 1 < e->k) {
                e->rows[nr] = (runner_row){.slot = r->seq.slot, .n_new = 1, .tok_off = nr,
                                           .n_logits = 1, .logits_off = p->logits_off};
                e->tokens[nr++] = d;
            }
        }
        if (j + 1 < e->k && nr) {
            /* logits rows are addressed by logits_off; keep the rows in plan order */
            b = (runner_batch){.which = RUNNER_DRAFT, .n_rows = nr, .rows = e->rows,
                               .tokens = e->tokens, .n_tokens = nr, .logits = e->dlogits};
            rc = runner_forward(run, &b);
        }
    }
    return rc;
}

/* Speculation counters of one verify step of one row (per request and engine-wide). */
static void count_verify(engine *e, req *r, int accepted) {
    r->verify_steps++;
    r->draft_tokens += e->k;
    r->accepted += accepted;
    e->st.spec_drafts++;
    e->st.spec_draft_tokens += (uint64_t)e->k;
    e->st.spec_accepted_tokens += (uint64_t)accepted;
    for (int j = 0; j < accepted; j++) e->st.spec_accepted_per_pos[j]++;
}

/* Phase 5 for a speculating row: acceptance, rollback, events. */
static engine_finish accept_row(engine *e, row_plan *p, engine_event *ev) {
    req *r = p->r;
    sched_seq *s = &r->seq;
    int k = e->k, V = e->vocab;
    float *L = e->logits + (size_t)p->logits_off * V;   /* (k+1, V) raw target logits */
    int32_t out[ENGINE_MAX_STEP_TOKENS];
    int m;
    /* processed target distributions at each position, history including earlier drafts */
    int nh = s->n_tokens;
    memcpy(e->hist, s->tokens, (size_t)nh * sizeof(int32_t));
    memcpy(e->hist + nh, p->drafts, (size_t)k * sizeof(int32_t));
    for (int j = 0; j <= k; j++) {
        float *pj = e->pprobs + (size_t)j * V;
        memcpy(pj, L + (size_t)j * V, (size_t)V * sizeof(float));
        r->spp.suppress_eos = r->n_out + j < r->sp.min_tokens;
        sample_apply_penalties(pj, V, &r->spp, e->hist, nh + j, s->n_prompt, e->scratch);
        if (r->sp.temperature > 0) sample_probs(pj, V, &r->spp, e->scratch);
    }
    if (r->sp.temperature <= 0) {
        m = spec_accept_greedy(e->pprobs, V, p->drafts, k, out);
    } else {
        double ua[ENGINE_MAX_STEP_TOKENS];
        for (int j = 0; j < k; j++) ua[j] = sample_uniform(r->seed ^ SPEC_SALT_ACCEPT, (uint64_t)r->n_out + j);
        int i = (int)(p - e->plan);
        m = spec_accept_sample(e->pprobs, e->dprobs + (size_t)i * k * V, V, p->drafts, k, ua,
                               sample_uniform(r->seed, 2 * (uint64_t)r->n_out), e->work, 0, out);
    }
    int acc = m - 1;
    count_verify(e, r, acc);
    /* KV now holds the fed token and the accepted drafts; the emitted last token is not in
     * it yet. The draft saw the fed tokens and drafts 1..k-1. */
    int new_len = s->n_computed + 1 + acc;
    int dlen = e->run->ops->slot_get_len(e->run, s->slot, RUNNER_DRAFT);
    e->run->ops->slot_set_len(e->run, s->slot, RUNNER_TARGET, new_len);
    e->run->ops->slot_set_len(e->run, s->slot, RUNNER_DRAFT, dlen < new_len ? dlen : new_len);
    s->n_computed = new_len;
    engine_finish f = ENGINE_RUNNING;
    for (int j = 0; j < m && f == ENGINE_RUNNING; j++) f = emit_token(e, r, ev, out[j], L + (size_t)j * V);
    return f;
}

/* Whether this step can use the runner's on-device decode (a captured graph on CUDA):
 * every row decodes one token and needs nothing the device sampler lacks (penalties,
 * logit bias, logprobs, min_tokens, recorded logits are host features). */
static int device_decode_ok(const engine *e, int n) {
    if (!e->run->ops->decode || e->k > 0 || n == 0) return 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        const req *r = p->r;
        const sched_seq *s = &r->seq;
        if (p->n_new != 1 || s->n_tokens - s->n_computed != 1 || r->record || r->sp.logprobs >= 0 ||
            r->sp.n_logit_bias || r->sp.presence_penalty != 0 || r->sp.frequency_penalty != 0 ||
            r->sp.repetition_penalty != 1.0f || r->n_out < r->sp.min_tokens)
            return 0;
    }
    return 1;
}

static int device_decode(engine *e, int n, engine_output *out) {
    for (int i = 0; i < n; i++) {
        const req *r = e->plan[i].r;
        e->dec_slots[i] = r->seq.slot;
        e->dec_tokens[i] = r->seq.tokens[r->seq.n_computed];
        e->dec_sp[i] = (runner_sampling){.temperature = r->sp.temperature, .top_p = r->sp.top_p,
                                         .min_p = r->sp.min_p, .top_k = r->sp.top_k,
                                         .seed = r->seed, .counter = (uint64_t)r->n_out};
    }
    runner_decode_batch db = {.n = n, .slots = e->dec_slots, .tokens = e->dec_tokens, .sp = e->dec_sp,
                              .out_tokens = e->dec_out, .out_logprobs = NULL};
    int rc = e->run->ops->decode(e->run, &db);
    if (rc) return rc;
    for (int i = 0; i < n; i++) {
        req *r = e->plan[i].r;
        sched_seq *s = &r->seq;
        s->n_computed += 1;
        engine_event *ev = new_event(e, out, r);
        engine_finish f = emit_token(e, r, ev, e->dec_out[i], NULL);
        kv_seq_commit(e->kv, &s->kv, s->tokens, s->n_computed);
        ev->finish = f;
        fill_counts(ev, r);
        if (f != ENGINE_RUNNING) drop_req(e, r);
    }
    return 0;
}

/* Whether the whole step can be one runner speculative step (one graph on CUDA): every
 * row speculates, has at least two tokens, and needs no host-side sampling feature. */
static int runner_spec_ok(const engine *e, int n) {
    if (!e->run->ops->spec_step || e->k == 0 || n == 0) return 0;
    for (int i = 0; i < n; i++) {
        const row_plan *p = &e->plan[i];
        const req *r = p->r;
        if (!p->spec || r->seq.n_tokens < 2 || r->record || r->sp.logprobs >= 0 || r->sp.n_logit_bias ||
            r->sp.presence_penalty != 0 || r->sp.frequency_penalty != 0 ||
            r->sp.repetition_penalty != 1.0f || r->n_out < r->sp.min_tokens)
            return 0;
    }
    return 1;
}

static int runner_spec(engine *e, int n, engine_output *out) {
    int k = e->k;
    for (int i = 0; i < n; i++) {
        const req *r = e->plan[i].r;
        const sched_seq *s = &r->seq;
        e->dec_slots[i] = s->slot;
        e->tokens[2 * i] = s->tokens[s->n_tokens - 2];
        e->tokens[2 * i + 1] = s->tokens[s->n_tokens - 1];
        e->dec_sp[i] = (runner_sampling){.temperature = r->sp.temperature, .top_p = r->sp.top_p,
                                         .min_p = r->sp.min_p, .top_k = r->sp.top_k,
                                         .seed = r->seed, .counter = (uint64_t)r->n_out};
    }
    int32_t *out_tok = e->spec_out;
    int *out_n = e->spec_n;
    runner_spec_batch sb = {.n = n, .k = k, .slots = e->dec_slots, .tokens = e->tokens, .sp = e->dec_sp,
                            .out_tokens = out_tok, .out_n = out_n};
    int rc = e->run->ops->spec_step(e->run, &sb);
    if (rc) return rc;
    for (int i = 0; i < n; i++) {
        req *r = e->plan[i].r;
        sched_seq *s = &r->seq;
        int m = out_n[i], L = s->n_computed;
        count_verify(e, r, m - 1);
        s->n_computed = L + m;
        engine_event *ev = new_event(e, out, r);
        engine_finish f = ENGINE_RUNNING;
        for (int j = 0; j < m && f == ENGINE_RUNNING; j++) f = emit_token(e, r, ev, out_tok[i * (k + 1) + j], NULL);
        int dlen = L + k < L + m ? L + k : L + m;
        kv_seq_commit(e->kv, &s->kv, s->tokens, dlen < s->n_computed ? dlen : s->n_computed);
        ev->finish = f;
        fill_counts(ev, r);
        if (f != ENGINE_RUNNING) drop_req(e, r);
    }
    return 0;
}

static void fail_all(engine *e, engine_output *out) {
    e->failed = 1;
    e->st.failed = 1;
    while (e->n_reqs > 0) {
        req *r = e->reqs[e->n_reqs - 1];
        engine_event *ev = new_event(e, out, r);
        ev->finish = ENGINE_FINISH_ERROR;
        fill_counts(ev, r);
        drop_req(e, r);
    }
}

/* Keep a finished request's first-token logits for engine_first_logits (oldest dropped). */
static void record_finished_logits(engine *e, req *r) {
    if (!r->record || r->n_out == 0) return;
    if (e->n_rec == (int)(sizeof e->rec / sizeof e->rec[0])) {
        free(e->rec[0].logits);
        memmove(e->rec, e->rec + 1, sizeof e->rec[0] * (size_t)--e->n_rec);
    }
    e->rec[e->n_rec].id = r->id;
    e->rec[e->n_rec++].logits = r->first_logits;
    r->first_logits = NULL;
}

int engine_step(engine *e, engine_output *out) {
    out->n_events = 0;
    out->events = e->events;
    out->n_scheduled_tokens = 0;
    if (e->failed) return SPECD_ESTATE;
    sched_batch sb;
    int rc = sched_schedule(e->sched, &sb);
    if (rc) goto fail;
    e->st.preemptions += (uint64_t)sb.n_preempted;
    /* Sequences that can never fit (already out of the queues, KV and slot freed). */
    for (int i = 0; i < sb.n_rejected; i++) {
        req *r = sb.rejected[i]->user;
        engine_event *ev = new_event(e, out, r);
        ev->finish = ENGINE_FINISH_ERROR;
        fill_counts(ev, r);
        fprintf(stderr, "specd: request %llu rejected by the scheduler: %s\n",
                (unsigned long long)r->id, specd_strerror(sb.rejected[i]->reject_code));
        drop_req(e, r);
    }
    int n = sb.n, V = e->vocab;

    /* Phases 1-2: plan rows, sync slots. */
    for (int i = 0; i < n; i++) {
        req *r = sb.seqs[i]->user;
        row_plan *p = &e->plan[i];
        memset(p, 0, sizeof *p);
        p->r = r;
        p->n_new = sb.n_new[i];
        if ((rc = sync_slot(e, r))) goto fail;
        sched_seq *s = &r->seq;
        p->spec = e->k > 0 && p->n_new == 1 && s->n_tokens - s->n_computed == 1 &&
                  s->n_tokens + e->k <= e->cfg.max_seq_len && r->max_new - r->n_out > 1 &&
                  s->kv.n_blocks * e->cfg.block_size >= s->n_tokens + e->k;
        out->n_scheduled_tokens += p->n_new;
    }
    if (device_decode_ok(e, n)) {
        if ((rc = device_decode(e, n, out))) goto fail;
        e->st.steps_device_decode++;
        return 0;
    }
    if (runner_spec_ok(e, n)) {
        if ((rc = runner_spec(e, n, out))) goto fail;
        e->st.steps_runner_spec++;
        return 0;
    }
    if (n) e->st.steps_composed++;
    /* Phase 3: draft. */
    if (e->k > 0 && n > 0 && (rc = draft_phase(e, n))) goto fail;

    /* Phase 4: one target pass. */
    int nt = 0, no = 0;
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        sched_seq *s = &p->r->seq;
        runner_row *row = &e->rows[i];
        *row = (runner_row){.slot = s->slot, .tok_off = nt};
        if (p->spec) {
            e->tokens[nt] = s->tokens[s->n_computed];
            memcpy(e->tokens + nt + 1, p->drafts, (size_t)e->k * sizeof(int32_t));
            row->n_new = row->n_logits = e->k + 1;
        } else {
            memcpy(e->tokens + nt, s->tokens + s->n_computed, (size_t)p->n_new * sizeof(int32_t));
            row->n_new = p->n_new;
            row->n_logits = s->n_computed + p->n_new == s->n_tokens ? 1 : 0;
        }
        row->logits_off = no;
        p->logits_off = no;
        p->target_logits = row->n_logits;
        no += row->n_logits;
        nt += row->n_new;
    }
    runner_batch tb = {.which = RUNNER_TARGET, .n_rows = n, .rows = e->rows, .tokens = e->tokens,
                       .n_tokens = nt, .logits = e->logits};
    if (n && (rc = runner_forward(e->run, &tb))) goto fail;

    /* Phase 5: sample / accept, commit, finish. */
    for (int i = 0; i < n; i++) {
        row_plan *p = &e->plan[i];
        req *r = p->r;
        sched_seq *s = &r->seq;
        engine_finish f = ENGINE_RUNNING;
        engine_event *ev = NULL;
        if (p->spec) {
            ev = new_event(e, out, r);
            f = accept_row(e, p, ev);
        } else {
            s->n_computed += p->n_new;
            if (p->target_logits) {
                float *lg = e->logits + (size_t)p->logits_off * V;
                memcpy(e->work, lg, (size_t)V * sizeof(float));
                int32_t t = sample_row(e, r, e->work, s->tokens, s->n_tokens);
                ev = new_event(e, out, r);
                f = emit_token(e, r, ev, t, lg);
            }
        }
        int dlen = e->k ? e->run->ops->slot_get_len(e->run, s->slot, RUNNER_DRAFT) : s->n_computed;
        kv_seq_commit(e->kv, &s->kv, s->tokens, dlen < s->n_computed ? dlen : s->n_computed);
        if (ev) {
            ev->finish = f;
            fill_counts(ev, r);
        }
        if (f != ENGINE_RUNNING) {
            record_finished_logits(e, r);
            drop_req(e, r);
        }
    }
    return 0;
fail:
    fprintf(stderr, "specd: engine step failed: %s\n", specd_strerror(rc));
    fail_all(e, out);
    return rc;
}

void engine_get_stats(const engine *e, engine_stats *st) {
    *st = e->st;
    st->running = sched_num_running(e->sched);
    st->waiting = sched_num_waiting(e->sched);
    st->kv_blocks_total = kv_num_blocks(e->kv) - 1;
    st->kv_blocks_used = kv_num_used(e->kv);
    st->kv_blocks_free = kv_num_free(e->kv);
}
