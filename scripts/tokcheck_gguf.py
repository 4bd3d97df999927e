#!/usr/bin/env python3
"""Compare specd's tokenizer on a GGUF file with HF's on the same file.

HF's side is transformers' own GGUF conversion (AutoTokenizer.from_pretrained(dir,
gguf_file=...)); it reads metadata only, so torch is not needed: a stand-in module
satisfies its imports. The strings are every text of the shared fixtures' tokenizer
goldens and llama.cpp vocabulary tests, plus chat-turn and whitespace cases.

The reference is only as good as that conversion: for SentencePiece vocabularies (Gemma,
Llama 2) it rebuilds the model's own tokenizer; for byte-level BPE it applies a generic
pre-tokenizer (SmolLM2's file then differs on "4 ½", which its original tokenizer.json,
splitting every numeric character, tokenizes as specd does).

  python3 scripts/tokcheck_gguf.py build/specd models/gemma-3-270m-q4_k_m.gguf
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hfref import hf_tokenizer, specd_ids, torch_stand_in  # noqa: E402


def strings(fixtures):
    out = []
    for name in ("qwen3", "llama3_1"):
        for c in json.load(open(f"{fixtures}/tokenizers/hf/{name}/golden.json"))["cases"]:
            out.append(c["text"])
    for f in ("gguf/ggml-vocab-llama-spm.gguf.inp", "gguf/ggml-vocab-phi-3.gguf.inp"):
        out += open(f"{fixtures}/tokenizers/{f}", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    out += ["<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
            "<bos>text after bos", "tabs\t\tand   runs    of     spaces", "ünïcödé — “quotes” … ‘single’"]
    seen = set()
    return [s for s in out if not (s in seen or seen.add(s))]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    specd, gguf = sys.argv[1], sys.argv[2]
    fixtures = os.environ.get("SPECD_FIXTURES", "../shared/fixtures")
    torch_stand_in()
    tok = hf_tokenizer(gguf)
    texts = strings(fixtures)
    same, diffs = 0, []
    for t in texts:
        ref = tok.encode(t, add_special_tokens=False)
        try:
            ids, err = specd_ids(specd, gguf, t), ""
        except Exception as e:   # specd failed on it: a difference, reported
            ids, err = None, str(e)
        if ids == ref:
            same += 1
        else:
            diffs.append((t, ref, ids, err))
    print(f"{os.path.basename(gguf)}: {type(tok).__name__}, vocabulary {len(tok)}: "
          f"{same} of {len(texts)} strings tokenized as HF does")
    for t, ref, ids, err in diffs[:10]:
        print(f"  differs: {t[:60]!r}\n    HF    {ref[:16]}\n    specd {ids and ids[:16]} {err}")
    sys.exit(0 if not diffs else 1)


if __name__ == "__main__":
    main()
