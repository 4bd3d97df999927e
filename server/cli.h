/* Small helpers shared by the subcommands' argument parsing (prefix cli_). */
#ifndef SPECD_CLI_H
#define SPECD_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "engine/core/engine.h"

/* Parse "1,2,3" into a malloc'd int32 array; returns count or -1 on a malformed list. */
int cli_parse_ids(const char *s, int32_t **out);
/* Strict numeric parsing: the whole string must be a number in range. 0 ok, -1 bad. */
int cli_int(const char *s, long lo, long hi, int *out);
int cli_float(const char *s, double lo, double hi, float *out);
int cli_u64(const char *s, uint64_t *out);
/* Seconds on the monotonic clock (for timing a subcommand's work). */
double cli_now_s(void);
/* Read a whole file (NUL-terminated, malloc'd); NULL on error. */
char *cli_read_file(const char *path, size_t *len);

/* Engine options shared by generate and bench: --model, --tokenizer, --draft-model,
 * --draft-layers, --num-draft-tokens, --device, --max-seq-len, --max-batch,
 * --kv-cache-bytes, --threads, --block-size, --no-prefix-cache. On a match consumes the
 * option (and its value: *i advances) and returns 1; 0 if not an engine option; -1 on
 * a bad value (message printed). */
int cli_engine_opt(engine_config *c, int argc, char **argv, int *i);
/* --speculative VALUE: "ngram" (prompt-lookup drafts) or "none". 0 ok, -1 bad. */
int cli_speculative(const char *v, int *ngram);
/* --dtype auto | bf16 | gguf | fp8 -> ENGINE_WEIGHTS_*; -1 if none of them. */
int cli_dtype(const char *v, int *dtype);
/* --kv-cache-dtype auto | bf16 | fp8 | fp8_e4m3 -> ENGINE_KV_*; -1 if none of them. */
int cli_kv_dtype(const char *v, int *kv);
/* After parsing: complete the tensor-parallel options (c->tp) from the flags and, in a
 * spawned worker, from SPECD_TP_*; a process started by hand with
 * --tensor-parallel-size N > 1 gets tp_spawn_argv = main_argv (it starts its node's other
 * ranks). Returns 1 when this process is a worker rank (run engine_tp_worker_run instead
 * of the command), 0 otherwise, -1 on a bad value (message printed). */
int cli_engine_tp(engine_config *c, char **main_argv);
/* The tensor-parallel start of a subcommand, after its options are parsed: on a worker
 * rank, runs the worker loop to its end and returns 1 with the process exit code in
 * *exit_code (also on a usage error: exit code 2); on rank 0 (or without TP) installs the
 * rank-failure handler (message, then exit 1 within 2 s) and returns 0. main_argv is
 * main()'s argv, which spawned workers re-execute. */
int cli_tp_enter(engine_config *c, char **main_argv, int *exit_code);
#define CLI_ENGINE_HELP \
    "  --model PATH            HF checkpoint directory or .gguf file (or --shape)\n" \
    "  --tokenizer PATH        tokenizer.json / directory / .gguf (default: from --model)\n" \
    "  --chat-template FILE    Jinja chat template instead of the model's own\n" \
    "  --draft-model PATH      draft model for speculative decoding\n" \
    "  --draft-layers N        self-speculation: draft = target's first N layers\n" \
    "  --num-draft-tokens K    draft tokens per step, at most (default 4)\n" \
    "  --speculative ngram     prompt-lookup drafts: the tokens that followed the longest\n" \
    "                          earlier match of a request's last tokens in its own prompt\n" \
    "                          and output (no draft model; pays when output copies input)\n" \
    "  --ngram-min N, --ngram-max N  n-gram lengths matched (default 2, 4)\n" \
    "  --spec-always           speculate whenever drafts exist (skip the start-up cost model\n" \
    "                          that turns drafts off where they would not pay)\n" \
    "  --device cpu|cuda       runner (default cpu)\n" \
    "  --dtype auto|bf16|gguf|fp8  weights on the GPU. A quantized GGUF: gguf keeps its Q8_0,\n" \
    "                          Q4_0, Q4_1, Q4_K, Q5_K and Q6_K projections in their blocks (less\n" \
    "                          memory; as fast at batch 1), bf16 dequantizes them at load\n" \
    "                          (faster from batch 8);\n" \
    "                          auto (default) keeps them when bf16 would take over half the GPU.\n" \
    "                          fp8 quantizes the dense projections to FP8 E4M3 at load (a scale\n" \
    "                          per output row; activations per token): half the bytes of bf16,\n" \
    "                          FP8 tensor cores. An FP8 checkpoint stays FP8 (bf16: dequantized)\n" \
    "  --quantization fp8      the same as --dtype fp8\n" \
    "  --kv-cache-dtype auto|fp8  KV cache elements: auto (default) bf16 on the GPU, fp32 on\n" \
    "                          the CPU; fp8 (or fp8_e4m3) E4M3 with a per-layer K and V scale\n" \
    "                          (the checkpoint's k_scale / v_scale, else 1): twice the tokens\n" \
    "  --max-seq-len N         context limit per sequence (default 4096)\n" \
    "  --max-batch N           running sequences at most (default 64)\n" \
    "  --max-num-batched-tokens N  tokens one step feeds at most, decode rows and prompt\n" \
    "                          chunks together (default 2048, at least --max-batch)\n" \
    "  --max-prefill-decoding N  prompt tokens a step feeds at most while sequences are\n" \
    "                          decoding (default 512; -1: only the budget above): bounds how\n" \
    "                          much a burst of prompts lengthens decode steps\n" \
    "  --async-scheduling 0|1  queue the next decode step before committing the running one\n" \
    "                          (default 1; 0: one step at a time)\n" \
    "  --kv-cache-bytes N      KV pool budget in bytes (default: from free memory)\n" \
    "  --threads N             CPU runner threads (default: all cores)\n" \
    "  --block-size N          tokens per KV block (default 16)\n" \
    "  --no-prefix-cache       disable prefix caching\n" \
    "  --keep-window-kv        keep KV blocks a sliding window has left behind (by default\n" \
    "                          released: every layer's when every layer slides, as in Mistral;\n" \
    "                          the window layers' own pool when full layers are mixed in, as in\n" \
    "                          Gemma 3, except under CUDA tensor parallelism)\n" \
    "  --rope-bf16-freqs       round rotary frequencies to bf16 (reproduces references whose\n" \
    "                          rotary buffer was cast to bf16; off by default, as HF computes them)\n" \
    "  --tensor-parallel-size N  split the model over N processes, one per GPU with --device\n" \
    "                          cuda (NCCL); this one is rank 0 and starts the others\n" \
    "  --shape NAME            random weights of a real shape instead of --model:\n" \
    "                          llama-3.1-8b, llama-3.2-1b, smollm2-135m, qwen2.5-1.5b, qwen3-1.7b,\n" \
    "                          qwen3-30b-a3b, gemma3-4b\n" \
    "                          (seeded; with --device cuda made on the GPU, a TP shard is its\n" \
    "                          slice; the MoE shape is CUDA only)\n" \
    "  --draft-shape NAME      a random draft of a real shape (same vocabulary as the target)\n" \
    "  --nnodes M, --node-rank K, --master-addr A, --master-port P\n" \
    "                          several hosts: run the same command on each (default 1, 0,\n" \
    "                          127.0.0.1, 29533)\n"

#endif
