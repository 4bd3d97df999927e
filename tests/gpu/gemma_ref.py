"""Make a small Gemma 3 checkpoint whose norm weights are not zero, with HF transformers'
golden outputs, for the CPU golden test (tests/test_golden.c reads tests/data/models/).

The shared fixture gemma3-tiny has every norm weight at 0 (HF's initialisation), so the
four norms of a Gemma 3 layer are interchangeable there and a loader that swapped two of
them would still pass. This model perturbs every norm (and uses a window of 16 with
prompts up to 100 tokens, a full layer every third); its golden.json has the fixtures'
format: for each prompt the fp32 logits at the last position, all positions for one
prompt, the greedy continuation and the top-1/top-2 margins. The reference computes in
fp32 on the bf16 weights, with fp32 rotary frequencies.

    python3 tests/gpu/gemma_ref.py OUT_DIR      (needs torch and transformers)
"""
import json, os, sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(20261201)
cfg = AutoConfig.for_model(
    "gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
    sliding_window=16, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    query_pre_attn_scalar=24, rms_norm_eps=1e-6, tie_word_embeddings=True,
    bos_token_id=2, eos_token_id=1, pad_token_id=0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:   # Gemma scales by (1 + w): w in [-0.5, 0.5], a different draw per norm
            p.uniform_(-0.5, 0.5)
model = model.to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)

ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
# (loaded in fp32: rotary frequencies and the embedding scale are fp32, as specd's)
gen = torch.Generator().manual_seed(7)
prompts = []
for n in (1, 7, 16, 33, 64, 100):
    prompts.append(torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist())
res = {"config": "see config.json", "prompts": []}
for p in prompts:
    ids = torch.tensor([p])
    with torch.no_grad():
        logits = ref(ids).logits[0].float()
        toks, margins, seq = [], [], list(p)
        for _ in range(16):
            lg = ref(torch.tensor([seq])).logits[0, -1].float()
            top = torch.topk(lg, 2)
            toks.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            seq.append(toks[-1])
    e = {"prompt": p, "last_logits": logits[-1].tolist(), "greedy": toks, "margins": margins}
    if len(p) == 33:
        e["all_logits"] = logits.tolist()
    res["prompts"].append(e)
with open(os.path.join(out, "golden.json"), "w") as f:
    json.dump(res, f)
print("gemma_ref: wrote", out, "params", sum(p.numel() for p in model.parameters()))
