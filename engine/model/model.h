/* Model description and weights (prefix model_), independent of the file format and of
 * the runner. A loaded model is a config plus a set of tensor views into the mapped
 * file(s); each runner converts views into its own storage (fp32 on the CPU, bf16 on the
 * GPU) with tensor_to_f32 / tensor_to_bf16, which also dequantize GGUF blocks and undo
 * GGUF's Q/K row permutation.
 *
 * Shapes are row-major, outermost first, as in PyTorch: a Linear weight is [out, in]. */
#ifndef SPECD_MODEL_H
#define SPECD_MODEL_H

#include <stddef.h>
#include <stdint.h>

/* Families. Mistral loads as LLAMA (same math; its window is sliding_window). Phi-3's
 * fused qkv_proj / gate_up_proj are split into the plain views at load, so runners see a
 * llama-shaped layer. */
typedef enum {
    MODEL_ARCH_LLAMA = 0, MODEL_ARCH_QWEN2, MODEL_ARCH_QWEN3, MODEL_ARCH_PHI3,
    MODEL_ARCH_MIXTRAL, MODEL_ARCH_QWEN3MOE, MODEL_ARCH_GEMMA3,
} model_arch;
typedef enum { ROPE_DEFAULT = 0, ROPE_LLAMA3, ROPE_LINEAR } rope_kind;
typedef enum { ACT_SILU = 0, ACT_GELU_TANH } ffn_act;

#define MODEL_MAX_EOS 8
#define MODEL_MAX_LAYERS 512
#define MODEL_MAX_EXPERTS 512

typedef struct {
    model_arch arch;
    char arch_name[64];      /* "LlamaForCausalLM", "llama" (GGUF), ... for messages */
    int n_layers;
    int hidden;              /* d_model */
    int n_heads;
    int n_kv_heads;
    int head_dim;            /* may differ from hidden / n_heads (Qwen3) */
    int ffn;                 /* intermediate size */
    int vocab;
    float rms_eps;
    float rope_theta;
    rope_kind rope_type;
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_orig_max_pos;   /* llama3: original_max_position_embeddings */
    int tied_embeddings;     /* lm_head == token embedding */
    int qkv_bias;            /* Qwen2 */
    int qk_norm;             /* Qwen3 per-head RMSNorm on q and k */
    int sliding_window;      /* > 0: the layers marked in layer_swa attend to the last W
                              * positions only (the query's own included: keys p with
                              * pos - p < W); 0: none */
    uint8_t layer_swa[MODEL_MAX_LAYERS]; /* 1: layer l is a sliding-window layer (Mistral:
                              * all; Gemma 3: its layer_types); see model_layer_window */
    float rope_local_theta;  /* sliding layers' rotary base when it differs (Gemma 3: 10k,
                              * default rotary, no scaling); 0: the layers share rope_theta */
    ffn_act act;             /* gate activation of the gated MLP */
    int norm_plus_one;       /* RMSNorm scales by (1 + w), as Gemma stores its norms (HF);
                              * GGUF files of Gemma hold 1 + w already (0 there) */
    int sandwich_norms;      /* Gemma 3: post_attn_norm / post_ffn_norm on the sublayer
                              * outputs before each residual add */
    float embed_scale;       /* embeddings are multiplied by this (Gemma: sqrt(hidden)); 0: 1 */
    float attn_scale;        /* softmax scale of q.k; 0: 1/sqrt(head_dim) */
    /* Mixture of experts (n_experts > 0): every layer's MLP is n_experts gated MLPs of
     * moe_ffn rows; the router's softmax over all experts picks the top n_experts_used,
     * whose weights are renormalised to sum 1 when moe_norm_topk (Mixtral always). */
    int n_experts, n_experts_used, moe_ffn, moe_norm_topk;
    int64_t max_pos;         /* max_position_embeddings: informational, never used to size */
    /* An FP8 checkpoint (quantization_config: quant_method fp8, fbgemm_fp8 or
     * compressed-tensors float-quantized): its projections are TDT_F8_E4M3 views; the
     * block of weight_block_size (0 0: per tensor or per channel). Activation scales
     * (input_scale) are not read: the runners quantize activations per token as they go. */
    int fp8;
    int fp8_block[2];
    int bos_id;              /* -1 if none */
    int eos_ids[MODEL_MAX_EOS];
    int n_eos;
} model_config;

/* Storage type of a tensor view. Quantized types are GGUF's block formats. */
typedef enum {
    TDT_F32 = 0, TDT_F16, TDT_BF16, TDT_Q8_0, TDT_Q4_0, TDT_Q4_1, TDT_Q4_K, TDT_Q6_K,
    TDT_Q5_0, TDT_Q5_1, TDT_Q5_K,
    TDT_F8_E4M3,             /* FP8 checkpoints: one byte per element times a scale (below) */
} tensor_dtype;

typedef struct {
    const void *data;        /* NULL: tensor absent (e.g. no bias) */
    tensor_dtype dtype;
    int ndim;                /* 1 or 2 */
    int64_t shape[2];        /* [rows, cols] for 2-D, [n] for 1-D */
    /* GGUF permutes the rows of Q and K for llama-family models (it interleaves the
     * rotary halves). When unpermute_heads > 0, logical row r of the result comes from
     * the stored row given by undoing that permutation with this many heads. */
    int unpermute_heads;
    /* TDT_F8_E4M3: element (r, c) is e4m3(r, c) * scale[((r + scale_row0) / scale_block[0])
     * * scale_cols + c / scale_block[1]], the scales F32 or BF16 (scale_dtype): per tensor
     * (the block is the whole matrix), per output row (block [1, cols]) or per 128 x 128
     * block (DeepSeek-style weight_scale_inv). scale_row0 > 0 in a view of a fused
     * tensor's rows that starts inside a block. */
    const void *scale;
    tensor_dtype scale_dtype;
    int64_t scale_block[2], scale_cols, scale_row0;
} tensor_view;

typedef struct {
    tensor_view attn_norm;   /* [hidden] */
    tensor_view wq;          /* [n_heads*head_dim, hidden] */
    tensor_view wk;          /* [n_kv_heads*head_dim, hidden] */
    tensor_view wv;          /* [n_kv_heads*head_dim, hidden] */
    tensor_view bq, bk, bv;  /* [out] (Qwen2 only; data NULL otherwise) */
    tensor_view q_norm;      /* [head_dim] (Qwen3 only) */
    tensor_view k_norm;      /* [head_dim] (Qwen3 only) */
    tensor_view wo;          /* [hidden, n_heads*head_dim] */
    tensor_view ffn_norm;    /* [hidden] */
    tensor_view w_gate;      /* [ffn, hidden] */
    tensor_view w_up;        /* [ffn, hidden] */
    tensor_view w_down;      /* [hidden, ffn] */
    /* sandwich_norms (Gemma 3): norms of the attention and MLP outputs */
    tensor_view post_attn_norm, post_ffn_norm;   /* [hidden] */
    /* n_experts > 0: the router and each expert's gated MLP (w_gate/w_up/w_down empty) */
    tensor_view router;      /* [n_experts, hidden] */
    tensor_view *exp_gate, *exp_up;   /* [n_experts] views of [moe_ffn, hidden] */
    tensor_view *exp_down;   /* [n_experts] views of [hidden, moe_ffn] */
    /* An FP8 KV cache's per-tensor scales from the checkpoint (self_attn.k_scale and
     * v_scale, or one kv_scale for both, as FP8 checkpoints with a kv_cache_scheme hold
     * them): the cache stores x / scale. 0: none given (the runners then use 1). */
    float k_scale, v_scale;
} model_layer;

typedef struct model {
    model_config cfg;
    tensor_view tok_embd;    /* [vocab, hidden] */
    tensor_view out_norm;    /* [hidden] */
    tensor_view lm_head;     /* [vocab, hidden]; same data as tok_embd when tied */
    model_layer *layers;     /* [n_layers] */
    char path[4096];         /* what was opened (directory or .gguf) */
    int is_gguf;
    void *priv;              /* loader-owned: mappings, gguf handle, buffers */
} model;

/* Load a model from a HF checkpoint directory (config.json + model.safetensors or a
 * sharded model.safetensors.index.json; generation_config.json read if present) or a
 * .gguf file. Validates every tensor's presence, dtype and shape against the config.
 * On failure returns NULL with a message naming the file and the problem. */
model *model_load(const char *path, char *err, size_t errlen);
void model_free(model *m);

/* Build a model with random weights in memory (fp32 views owned by the model), for
 * tests and benchmarks of real shapes. Config fields not needed are zero. */
model *model_random(const model_config *cfg, uint64_t seed, char *err, size_t errlen);
/* A model of `cfg`'s shape with no tensors (every view empty): for runners that make
 * their own weights (runner_config.random_weights_seed on the CUDA runner), so that an
 * 8B shape costs no host memory. Free with model_free. */
model *model_shape(const model_config *cfg, char *err, size_t errlen);

/* Elements of a view (rows*cols or n). */
int64_t tensor_numel(const tensor_view *t);
/* Convert a whole view to fp32 / bf16 (dst holds numel elements); dequantizes and
 * applies unpermute_heads. Returns 0 or a negative code. */
int tensor_to_f32(const tensor_view *t, float *dst);
int tensor_to_bf16(const tensor_view *t, uint16_t *dst);
/* A 2-D view's ggml type id (GGUF's block formats; 0 F32, 1 F16, 30 BF16, ...; -1 for FP8) and the
 * stored bytes of its logical rows [row0, row0 + nrows) in order, Q/K permutation undone
 * (rows are whole blocks): what a kernel that reads quantized weights in place takes. */
int tensor_ggml_type(const tensor_view *t);
int tensor_rows_raw(const tensor_view *t, int64_t row0, int64_t nrows, void *dst, size_t *row_bytes);
/* An FP8 view whose scales are per tensor or per row: each logical row's scale into
 * scale[0, rows) (what a kernel reading the bytes in place multiplies by). SPECD_EINVAL
 * for any other view (block scales: convert with tensor_to_bf16 instead). */
int tensor_fp8_row_scales(const tensor_view *t, float *scale);

/* Rotary inverse frequencies (head_dim/2 floats) as transformers computes them in fp32,
 * llama3-scaled if the config says so. round_to_bf16 rounds them to bf16, as happens to
 * transformers' rotary buffer when a model is cast to bf16 as a whole and back (the
 * fixtures' reference outputs carry that rounding; its effect grows with position). */
void model_rope_inv_freq(const model_config *c, int round_to_bf16, float *inv);

/* The sliding window of layer l (0: full attention). */
static inline int model_layer_window(const model_config *c, int l) {
    return c->sliding_window > 0 && c->layer_swa[l] ? c->sliding_window : 0;
}

/* Rotary inverse frequencies of layer l: model_rope_inv_freq, or for a sliding layer of a
 * model with rope_local_theta, the default rotary at that base. */
void model_rope_inv_freq_layer(const model_config *c, int layer, int round_to_bf16, float *inv);

/* Bytes of KV cache per token for all layers of this model (k and v, given element size). */
size_t model_kv_bytes_per_token(const model_config *c, size_t elem_size);

/* Fill `c` with a named real shape for random-weight benchmarks: "llama-3.1-8b",
 * "llama-3.2-1b", "qwen2.5-1.5b", "qwen3-1.7b", and for the CUDA runner only
 * "qwen3-30b-a3b" (mixture of experts) and "gemma3-4b" (sandwich norms; sliding-window
 * layers). Returns 0 or SPECD_ENOTFOUND. */
int model_shape_preset(const char *name, model_config *c);

#endif
