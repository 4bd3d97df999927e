/* Driver for tests/gpu/hf_compare.py: load a HF checkpoint into the CUDA runner, prefill
 * each prompt, then greedy-decode, and write tokens (and logits) to a binary file.
 *
 *   gpu_generate MODEL_DIR PROMPTS.bin STEPS OUT.bin single|batch
 *
 * PROMPTS.bin: int32 n_prompts, then per prompt int32 len and len ids.
 * single: one prompt at a time through forward() (eager), 1 token per step, host argmax;
 *         OUT gets per prompt int32 tokens[STEPS+1] then float logits[STEPS+1][vocab].
 * batch:  all prompts prefilled in one forward, then the decode op (captured graph,
 *         padded to the next captured size, on-device greedy); OUT gets tokens only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cuda/cuda_runner.h"
#include "engine/model/model.h"

#define BS 16

static int argmax(const float *a, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (a[i] > a[b]) b = i;
    return b;
}

static int give_blocks(runner *r, int slot, int max_blocks) {
    int32_t *b = malloc(sizeof(int32_t) * (size_t)max_blocks);
    for (int i = 0; i < max_blocks; i++) b[i] = 1 + slot * max_blocks + i;
    int rc = r->ops->slot_write_blocks(r, slot, 0, b, max_blocks);
    free(b);
    return rc ? rc : r->ops->slot_set_len(r, slot, RUNNER_TARGET, 0);
}

int main(int argc, char **argv) {
    int fp8 = 0, kv_fp8 = 0;   /* --dtype fp8, --kv-cache-dtype fp8 */
    for (int i = 6; i < argc; i++) {
        if (!strcmp(argv[i], "fp8")) fp8 = 1;
        else if (!strcmp(argv[i], "kvfp8")) kv_fp8 = 1;
        else argc = 0;
    }
    if (argc < 6) {
        fprintf(stderr, "usage: gpu_generate MODEL_DIR PROMPTS.bin STEPS OUT.bin single|batch [fp8] [kvfp8]\n");
        return 2;
    }
    char err[512];
    int steps = atoi(argv[3]), batch = !strcmp(argv[5], "batch");
    FILE *pf = fopen(argv[2], "rb");
    if (!pf) { perror(argv[2]); return 1; }
    int np = 0;
    if (fread(&np, 4, 1, pf) != 1 || np < 1 || np > 8) { fprintf(stderr, "bad prompts file\n"); return 1; }
    int len[8], total = 0;
    int32_t *ids[8];
    for (int p = 0; p < np; p++) {
        if (fread(&len[p], 4, 1, pf) != 1) return 1;
        ids[p] = malloc(sizeof(int32_t) * (size_t)len[p]);
        if (fread(ids[p], 4, (size_t)len[p], pf) != (size_t)len[p]) return 1;
        total += len[p];
    }
    fclose(pf);
    model *m = model_load(argv[1], err, sizeof err);
    if (!m) { fprintf(stderr, "model_load: %s\n", err); return 1; }
    int max_seq = 1024, max_blocks = max_seq / BS, V = m->cfg.vocab;
    runner_config cfg = {.num_blocks = 1 + 8 * max_blocks, .block_size = BS, .max_batch = 8,
                         .max_seq_len = max_seq, .max_tokens_per_step = total > 2048 ? total : 2048,
                         .mem_fraction = 0.5, .weights_fp8 = fp8, .kv_fp8 = kv_fp8};
    cuda_runner_opts o = {.world = 1};
    runner *r = runner_cuda_create_ex(m, NULL, &cfg, &o, err, sizeof err);
    if (!r) { fprintf(stderr, "runner: %s\n", err); return 1; }
    FILE *out = fopen(argv[4], "wb");
    float *logits = malloc(sizeof(float) * (size_t)V * (steps + 1) * (batch ? np : 1));
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(steps + 1) * np);
    int rc = 0;
    if (!batch) {
        for (int p = 0; p < np && !rc; p++) {
            if ((rc = give_blocks(r, 0, max_blocks))) break;
            runner_row row = {.slot = 0, .n_new = len[p], .tok_off = 0, .n_logits = 1};
            runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = ids[p],
                              .n_tokens = len[p], .logits = logits};
            if ((rc = runner_forward(r, &b))) break;
            tok[0] = argmax(logits, V);
            for (int j = 1; j <= steps && !rc; j++) {
                runner_row r1 = {.slot = 0, .n_new = 1, .tok_off = 0, .n_logits = 1};
                runner_batch b1 = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &r1,
                                   .tokens = &tok[j - 1], .n_tokens = 1,
                                   .logits = logits + (size_t)j * V};
                rc = runner_forward(r, &b1);
                tok[j] = argmax(logits + (size_t)j * V, V);
            }
            fwrite(tok, 4, (size_t)steps + 1, out);
            fwrite(logits, 4, (size_t)V * (steps + 1), out);
        }
    } else {
        runner_row rows[8];
        int32_t *all = malloc(sizeof(int32_t) * (size_t)total);
        int off = 0, slots[8];
        for (int p = 0; p < np && !rc; p++) {
            rc = give_blocks(r, p, max_blocks);
            rows[p] = (runner_row){.slot = p, .n_new = len[p], .tok_off = off, .n_logits = 1, .logits_off = p};
            memcpy(all + off, ids[p], sizeof(int32_t) * (size_t)len[p]);
            off += len[p];
            slots[p] = p;
        }
        runner_batch b = {.which = RUNNER_TARGET, .n_rows = np, .rows = rows, .tokens = all,
                          .n_tokens = total, .logits = logits};
        if (!rc) rc = runner_forward(r, &b);
        for (int p = 0; p < np; p++) tok[p * (steps + 1)] = argmax(logits + (size_t)p * V, V);
        for (int j = 1; j <= steps && !rc; j++) {
            int32_t in[8], o8[8];
            runner_sampling sp[8] = {{0}};
            for (int p = 0; p < np; p++) in[p] = tok[p * (steps + 1) + j - 1];
            runner_decode_batch d = {.n = np, .slots = slots, .tokens = in, .sp = sp, .out_tokens = o8};
            rc = r->ops->decode(r, &d);
            for (int p = 0; p < np; p++) tok[p * (steps + 1) + j] = o8[p];
        }
        fwrite(tok, 4, (size_t)(steps + 1) * np, out);
        free(all);
    }
    fclose(out);
    if (rc) fprintf(stderr, "gpu_generate: error %d: %s\n", rc, cuda_runner_error(r));
    runner_destroy(r);
    model_free(m);
    free(logits);
    free(tok);
    for (int p = 0; p < np; p++) free(ids[p]);
    return rc ? 1 : 0;
}
