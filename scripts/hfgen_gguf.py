#!/usr/bin/env python3
"""Greedy continuation of a GGUF file by specd (CPU runner) and by HF transformers on the
same file (its own GGUF loader, fp32), compared token by token. A long continuation
checks what only shows past a sliding window (Gemma 3's window layers' pool).

Needs torch, transformers, gguf and accelerate (pip). Prints how many of the generated
ids agree before the first difference and the reference's smallest top-2 logit margin
up to there; exits 1 when a difference comes before a step whose margin is under 1e-3
(a near tie may flip legitimately).

  python3 scripts/hfgen_gguf.py build/specd models/gemma-3-270m-q4_k_m.gguf \\
      --prompt "The history of the Roman Empire begins with" --tokens 700 [-- SPECD_ARGS...]
"""
import argparse
import json
import os
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specd")
    ap.add_argument("gguf")
    ap.add_argument("--prompt", default="The history of the Roman Empire begins with")
    ap.add_argument("--tokens", type=int, default=700)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.dirname(os.path.abspath(a.gguf)), os.path.basename(a.gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    ids = tok(a.prompt, return_tensors="pt").input_ids   # the tokenizer's own BOS rule
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    ref = out.sequences[0, ids.shape[1]:].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    cmd = [a.specd, "generate", "--model", a.gguf, "--prompt-ids", ",".join(map(str, ids[0].tolist())),
           "--max-tokens", str(a.tokens), "--ignore-eos", "--json", *extra]
    got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["output_ids"]
    eq = 0
    while eq < min(len(got), len(ref)) and got[eq] == ref[eq]:
        eq += 1
    low = min(margins[:eq + 1]) if margins else 0.0
    print(f"prompt {ids.shape[1]} tokens; specd {len(got)} / HF {len(ref)} generated; equal for the first {eq}; "
          f"smallest reference margin up to there {low:.4f}")
    if eq < min(len(got), len(ref)) and margins[eq] >= 1e-3:
        print(f"first difference at step {eq}: specd {got[eq]}, HF {ref[eq]} (margin {margins[eq]:.4f})")
        sys.exit(1)


if __name__ == "__main__":
    main()
