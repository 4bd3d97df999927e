"""Seeds for tests/fuzz/fuzz_gguf.c: tiny GGUF models that specd loads, small enough for
the fuzzer's inputs (320 KiB), so that mutations start from files that get past the header
into the architecture, shape, tensor-type and tokenizer checks.

    python3 tests/fuzz/make_gguf_seeds.py tests/fuzz/corpus_gguf

Models (one layer, hidden 32, 2 heads / 1 KV head of 16, FFN 64, a 300-token vocabulary):
llama with an SPM vocabulary (F32 and F16 matrices, tied embeddings), llama with a GPT-2
style BPE vocabulary and merges (Q8_0 matrices, a chat template), qwen2 (Q4_0 / Q4_1,
biases), gemma3 (BF16, sliding window, q / k norms), and a Q4_K / Q6_K llama with 256-wide
rows. Each is written also with a byte-level BPE pre-tokenizer name from llama.cpp's list
in place of its own where that applies."""
import os
import sys

import numpy as np
import gguf

T = gguf.GGMLQuantizationType
H, D, HEADS, KVH, F = 32, 16, 2, 1, 64


def spm_vocab(w, n):
    toks, scores, types = ["<unk>", "<s>", "</s>"], [0.0] * 3, [2, 3, 3]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    rest = n - len(toks)
    toks += [f"\u2581w{i}" for i in range(rest)]
    scores += (-np.arange(rest, dtype=np.float32)).tolist()
    types += [1] * rest
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)


def bpe_vocab(w, n, pre):
    # byte-level: the 256 byte symbols as GPT-2 maps them, then merges of pairs
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, k = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    syms = [chr(c) for c in cs]
    toks = syms[:]
    merges = []
    for i in range(n - len(toks) - 2):
        a, b = syms[i % 64 + 33], syms[(i * 7) % 64 + 33]
        merges.append(f"{a} {b}")
        toks.append(a + b)
    toks += ["<|bos|>", "<|eos|>"]
    types = [1] * (len(toks) - 2) + [3, 3]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(toks) - 2)
    w.add_eos_token_id(len(toks) - 1)
    w.add_add_bos_token(False)


def put(w, name, a, qtype):
    if qtype in (T.F32,):
        w.add_tensor(name, a.astype(np.float32))
    elif qtype == T.F16:
        w.add_tensor(name, a.astype(np.float16))
    elif qtype == T.BF16:
        u = a.astype(np.float32).view(np.uint32)
        b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        w.add_tensor(name, b, raw_shape=a.shape, raw_dtype=T.BF16)
    elif qtype in (T.Q4_K, T.Q6_K):   # (the package has no K-quant quantizer): random blocks
        rows, cols = a.shape
        size = {T.Q4_K: 144, T.Q6_K: 210}[qtype]
        rng = np.random.default_rng(rows * cols)
        q = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        half = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        for off in ((0, 2) if qtype == T.Q4_K else (208,)):
            q[:, :, off:off + 2] = half
        q = q.reshape(rows, cols // 256 * size)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    else:
        q = gguf.quants.quantize(a.astype(np.float32), qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def model(path, arch, vocab_kind, mtype, hidden=H, ffn=F, n_vocab=300, pre="gpt-2", extra=None):
    rng = np.random.default_rng(len(path))
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KVH)
    w.add_key_length(D if arch != "gemma3" else hidden // HEADS)
    w.add_value_length(D if arch != "gemma3" else hidden // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if extra:
        extra(w)
    if vocab_kind == "spm":
        spm_vocab(w, n_vocab)
    else:
        bpe_vocab(w, n_vocab, pre)
    hd = D if arch != "gemma3" else hidden // HEADS
    q, kv = HEADS * hd, KVH * hd

    def mat(name, rows, cols):   # rows a block type cannot hold stay F16 (as llama.cpp does)
        block = gguf.GGML_QUANT_SIZES[mtype][0]
        put(w, name, rng.uniform(-0.1, 0.1, size=(rows, cols)), mtype if cols % block == 0 else T.F16)

    def vec(name, n):
        put(w, name, rng.uniform(0.9, 1.1, size=n), T.F32)

    mat("token_embd.weight", n_vocab, hidden)
    vec("output_norm.weight", hidden)
    if arch != "gemma3" and vocab_kind != "spm":
        mat("output.weight", n_vocab, hidden)
    p = "blk.0."
    vec(p + "attn_norm.weight", hidden)
    mat(p + "attn_q.weight", q, hidden)
    mat(p + "attn_k.weight", kv, hidden)
    mat(p + "attn_v.weight", kv, hidden)
    if arch == "qwen2":
        vec(p + "attn_q.bias", q)
        vec(p + "attn_k.bias", kv)
        vec(p + "attn_v.bias", kv)
    if arch == "gemma3":
        vec(p + "attn_q_norm.weight", hd)
        vec(p + "attn_k_norm.weight", hd)
    mat(p + "attn_output.weight", hidden, q)
    if arch == "gemma3":
        vec(p + "post_attention_norm.weight", hidden)
    vec(p + "ffn_norm.weight", hidden)
    mat(p + "ffn_gate.weight", ffn, hidden)
    mat(p + "ffn_up.weight", ffn, hidden)
    mat(p + "ffn_down.weight", hidden, ffn)
    if arch == "gemma3":
        vec(p + "post_ffw_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.path.getsize(path)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    tmpl = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    seeds = [
        ("llama_spm_f32.gguf", dict(arch="llama", vocab_kind="spm", mtype=T.F32)),
        ("llama_spm_f16.gguf", dict(arch="llama", vocab_kind="spm", mtype=T.F16)),
        ("llama_bpe_q8_0.gguf", dict(arch="llama", vocab_kind="bpe", mtype=T.Q8_0,
                                     extra=lambda w: w.add_chat_template(tmpl))),
        ("llama_bpe_llama3_q8_0.gguf", dict(arch="llama", vocab_kind="bpe", mtype=T.Q8_0, pre="llama-bpe")),
        ("qwen2_bpe_q4_0.gguf", dict(arch="qwen2", vocab_kind="bpe", mtype=T.Q4_0, pre="qwen2")),
        ("qwen2_bpe_q4_1.gguf", dict(arch="qwen2", vocab_kind="bpe", mtype=T.Q4_1, pre="qwen2")),
        ("gemma3_spm_bf16.gguf", dict(arch="gemma3", vocab_kind="spm", mtype=T.BF16,
                                      extra=lambda w: w.add_sliding_window(16))),
        ("llama_spm_q4_k.gguf", dict(arch="llama", vocab_kind="spm", mtype=T.Q4_K, hidden=256, ffn=256)),
        ("llama_spm_q6_k.gguf", dict(arch="llama", vocab_kind="spm", mtype=T.Q6_K, hidden=256, ffn=256)),
    ]
    for name, kw in seeds:
        path = os.path.join(out, name)
        n = model(path, **kw)
        print(f"make_gguf_seeds: {path} ({n} bytes)")


if __name__ == "__main__":
    main()
