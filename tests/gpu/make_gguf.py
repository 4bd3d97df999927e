"""Write a GGUF of a real model shape with random weights (BF16 matrices, F32 norms), so
specd and llama.cpp read the very same file in side-by-side benchmarks.

    python3 tests/gpu/make_gguf.py --shape gemma3-270m OUT.gguf [--seed N]

Shapes: gemma3-270m (Gemma 3 270M: 18 layers, hidden 640, 4 heads / 1 KV head of 256,
window 512 on five layers of six, vocabulary 262144), llama-3.2-1b (16 layers, hidden 2048,
32 heads / 8 KV heads of 64, FFN 8192, tied embeddings) and llama-3.1-8b (32 layers, hidden
4096, 32 / 8 heads of 128, FFN 14336), both with the 128256-token vocabulary size and
without Llama 3's rope scaling (random weights: only the shapes matter), and
qwen3-30b-a3b (`qwen3moe`: 48 layers, hidden 2048, 32 / 4 heads of 128 with q/k norms,
128 experts of 768 with 8 used and their weights renormalised, vocabulary 151936; 61 GB).
Matrices are slices of one random pool (fast for 8B; every matrix still differs), made
and written one at a time, so memory holds one tensor however large the file. The vocabulary is a synthetic
SentencePiece-style one (control tokens, 256 byte tokens, pieces) so that tokenizer
loading works in both engines; prompts are token ids. Norms are stored as llama.cpp's
converter stores Gemma's: 1 + w.
"""
import argparse

import numpy as np
import gguf

SHAPES = {
    "gemma3-270m": dict(arch="gemma3", layers=18, hidden=640, heads=4, kv_heads=1, head_dim=256,
                        ffn=2048, vocab=262144, window=512, eps=1e-6, theta=1e6, ctx=32768),
    "llama-3.2-1b": dict(arch="llama", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64,
                         ffn=8192, vocab=128256, eps=1e-5, theta=5e5, ctx=131072, tied=True),
    "llama-3.1-8b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                         ffn=14336, vocab=128256, eps=1e-5, theta=5e5, ctx=131072, tied=False),
    "qwen3-30b-a3b": dict(arch="qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                          ffn=6144, vocab=151936, eps=1e-6, theta=1e6, ctx=40960, tied=False,
                          experts=128, used=8, moe_ffn=768),
}


def bf16(a):
    """float32 array -> uint16 bf16 bits (round to nearest even)."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma3-270m", choices=sorted(SHAPES))
    ap.add_argument("--vocab", type=int, help="vocabulary size other than the shape's")
    ap.add_argument("--layers", type=int, help="layer count other than the shape's")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("out")
    a = ap.parse_args()
    s = dict(SHAPES[a.shape])
    if a.vocab:
        s["vocab"] = a.vocab
    if a.layers:
        s["layers"] = a.layers
    rng = np.random.default_rng(a.seed)
    arch, H, D, V = s["arch"], s["hidden"], s["head_dim"], s["vocab"]
    w = gguf.GGUFWriter(a.out, arch)
    w.add_context_length(s["ctx"])
    w.add_embedding_length(H)
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_freq_base(s["theta"])
    gemma, moe = arch == "gemma3", "experts" in s
    if gemma:
        w.add_sliding_window(s["window"])
    if moe:
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["used"])
        w.add_expert_feed_forward_length(s["moe_ffn"])
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(D)
    # vocabulary: <pad> <eos> <bos> <unk>, 256 byte tokens, then pieces
    toks, scores, types = ["<pad>", "<eos>", "<bos>", "<unk>"], [0.0] * 4, [3, 3, 3, 2]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    n = V - len(toks)
    toks += [f"\u2581p{i}" for i in range(n)]
    scores += (-np.arange(n, dtype=np.float32) / n).tolist()
    types += [1] * n
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)

    pool = bf16(rng.uniform(-0.02 * 3 ** 0.5, 0.02 * 3 ** 0.5, size=1 << 25))
    pool = np.concatenate([pool, pool])

    # Tensors are declared first and made one at a time while the file is written.
    todo = []

    def mat(name, *shape):
        todo.append((name, shape, "mat"))
        w.add_tensor_info(name, shape, np.dtype(np.uint16), 2 * int(np.prod(shape)),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)

    def norm(name, n):
        todo.append((name, (n,), "norm"))
        w.add_tensor_info(name, (n,), np.dtype(np.float32), 4 * n)

    def make(shape, kind):
        if kind == "norm":
            return rng.uniform(0.8, 1.2, size=shape).astype(np.float32)
        parts, left = [], int(np.prod(shape))
        while left:     # random slices of the pool, up to its size each
            k = min(left, pool.size // 2)
            o = int(rng.integers(0, pool.size // 2))
            parts.append(pool[o:o + k])
            left -= k
        return (np.concatenate(parts) if len(parts) > 1 else parts[0].copy()).reshape(shape)

    mat("token_embd.weight", V, H)
    norm("output_norm.weight", H)
    if not gemma and not s["tied"]:
        mat("output.weight", V, H)
    q, kv, F = s["heads"] * D, s["kv_heads"] * D, s["ffn"]
    for l in range(s["layers"]):
        p = f"blk.{l}."
        norm(p + "attn_norm.weight", H)
        mat(p + "attn_q.weight", q, H)
        mat(p + "attn_k.weight", kv, H)
        mat(p + "attn_v.weight", kv, H)
        if gemma or moe:
            norm(p + "attn_q_norm.weight", D)
            norm(p + "attn_k_norm.weight", D)
        mat(p + "attn_output.weight", H, q)
        if gemma:
            norm(p + "post_attention_norm.weight", H)
        norm(p + "ffn_norm.weight", H)
        if moe:
            E, MF = s["experts"], s["moe_ffn"]
            mat(p + "ffn_gate_inp.weight", E, H)
            mat(p + "ffn_gate_exps.weight", E, MF, H)
            mat(p + "ffn_up_exps.weight", E, MF, H)
            mat(p + "ffn_down_exps.weight", E, H, MF)
        else:
            mat(p + "ffn_gate.weight", F, H)
            mat(p + "ffn_up.weight", F, H)
            mat(p + "ffn_down.weight", H, F)
        if gemma:
            norm(p + "post_ffw_norm.weight", H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in todo:
        w.write_tensor_data(make(shape, kind))
    w.close()
    print(f"make_gguf: wrote {a.out} ({a.shape})")


if __name__ == "__main__":
    main()
