#!/usr/bin/env python3
"""Tokenizer throughput: specd vs HF `tokenizers`, same text, same run.

Builds ~10 MB of text (seeded): the fixture test strings shuffled together with generated
prose, code, numbers and multilingual lines. For each tokenizer.json it encodes the whole
text once with specd (`specd tokenize --text-file F --json`) and with HF's
Tokenizer.encode (one string, add_special_tokens=False), checks the ids are identical, then
times both (best of --reps; specd through its hidden `tokenize --bench N` so process start
and tokenizer loading are not counted, HF likewise timing encode only) and prints MB/s and
the ratio. GGUF vocabularies are timed for specd only (no HF file to compare with).

Measured 2025-11-30 on the 2-core dev VM (shared, load average 5-7, so absolute numbers
are noisy; both sides ran in the same run), 10 MB, best of 3, HF tokenizers 0.23.3:
  qwen3     one 10 MB string: ids identical  specd 20.1 MB/s  HF 0.67 MB/s  30x
  qwen3     4564 docs ~2 kB:  ids identical  specd 20.8 MB/s  HF 1.68 MB/s  12x
  llama3_1  one 10 MB string: ids identical  specd 31.9 MB/s  HF 0.73 MB/s  44x
  llama3_1  4564 docs ~2 kB:  ids identical  specd 16.7 MB/s  HF 1.45 MB/s  12x
  GGUF (specd only, whole / per document): gpt-2 29/29, llama-bpe 35/23, qwen2 32/26,
  llama-spm 39/19, phi-3 30/24 MB/s.

usage: scripts/bench_tokenizer.py [--specd build/specd] [--mb 10] [--reps 3] [--seed 0]
needs: pip install tokenizers
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.environ.get("SPECD_FIXTURES", os.path.join(ROOT, "..", "shared", "fixtures"))
TOK = os.path.join(FIX, "tokenizers")

WORDS = ("the of and to in is that for it as with was on be by at this are from or have an "
         "they which one you had not but what all were when we there can been has more if "
         "will would who so no model token server request batch cache block draft verify "
         "accept latency throughput memory kernel graph stream decode prefill schedule "
         "naïve café façade über Straße coöperate résumé").split()
MULTI = ["日本語のテキストと中文文本、そして한국어 문장도 있습니다。",
         "Русский текст с числами 12345 и знаками — «кавычки».",
         "Ελληνικά γράμματα και αριθμοί 3.14159.",
         "العربية نص قصير مع أرقام ١٢٣",
         "हिन्दी में एक वाक्य।",
         "Emoji 🦙🚀👩‍👩‍👧‍👦 🇺🇸 ✅ 😁",
         "ภาษาไทยไม่มีช่องว่างระหว่างคำ"]
CODE = ["def f(x):\n    return x ** 2  # square\n",
        "for (int i = 0; i < n; i++) { sum += a[i] * b[i]; }\n",
        '{"key": [1, 2, {"n": null}], "url": "https://example.com/path?q=1&x=y#frag"}\n',
        "    if err != nil {\n\t\treturn fmt.Errorf(\"open %s: %w\", path, err)\n\t}\n"]


def fixture_strings():
    out = []
    with open(os.path.join(TOK, "gguf", "ggml-vocab-gpt-2.gguf.inp"), encoding="utf-8") as f:
        out += [s for s in f.read().split("\n__ggml_vocab_test__\n") if s]
    for name in ("qwen3", "llama3_1"):
        with open(os.path.join(TOK, "hf", name, "golden.json"), encoding="utf-8") as f:
            out += [c["text"] for c in json.load(f)["cases"] if c["text"]]
    # special-token text is split out by both; keep it, it is part of real prompts
    return out


def build_text(mb, seed):
    rnd = random.Random(seed)
    fixtures = fixture_strings()
    parts, size, target = [], 0, int(mb * 1e6)
    while size < target:
        r = rnd.random()
        if r < 0.6:
            n = rnd.randint(5, 40)
            s = " ".join(rnd.choice(WORDS) for _ in range(n))
            s = s[0].upper() + s[1:] + rnd.choice([". ", ", ", "! ", "? ", ".\n", ".\n\n"])
        elif r < 0.75:
            s = rnd.choice(fixtures) + rnd.choice([" ", "\n"])
        elif r < 0.85:
            s = rnd.choice(CODE)
        elif r < 0.95:
            s = rnd.choice(MULTI) + " "
        else:
            s = " ".join(str(rnd.randint(0, 10 ** rnd.randint(1, 9))) for _ in range(5)) + "\n"
        parts.append(s)
        size += len(s.encode())
    return "".join(parts)


def specd_ids(specd, tok, path):
    r = subprocess.run([specd, "tokenize", "--tokenizer", tok, "--text-file", path, "--json"],
                       capture_output=True, check=True)
    return json.loads(r.stdout)["ids"]


def specd_mbps(specd, tok, path, reps, chunk=0):
    cmd = [specd, "tokenize", "--tokenizer", tok, "--text-file", path, "--bench", str(reps)]
    if chunk:
        cmd += ["--bench-chunk", str(chunk)]
    r = subprocess.run(cmd, capture_output=True, check=True)
    return json.loads(r.stdout)


def chunks(data, size):
    """Documents of about `size` bytes, each cut after a newline (as specd --bench-chunk)."""
    out, pos = [], 0
    while pos < len(data):
        end = len(data)
        if pos + size < len(data):
            nl = data.find(b"\n", pos + size)
            end = nl + 1 if nl >= 0 else len(data)
        out.append(data[pos:end].decode())
        pos = end
    return out


def ids_hash(seq_of_ids):
    h = 0
    for ids in seq_of_ids:
        for i in ids:
            h = (h * 1000003 + i + 1) % (1 << 64)
    return h


def hf_best(fn, reps):
    best = 1e30
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--specd", default=os.path.join(ROOT, "build", "specd"))
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=2000, help="document size for the per-document run")
    a = ap.parse_args()
    try:
        from tokenizers import Tokenizer
        import tokenizers
    except ImportError:
        sys.exit("bench_tokenizer: pip install tokenizers")

    text = build_text(a.mb, a.seed)
    data = text.encode()
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(data)
        path = f.name
    print(f"text: {len(data) / 1e6:.2f} MB, seed {a.seed}; HF tokenizers {tokenizers.__version__}, "
          f"single-string encode")
    ok = True
    try:
        for name in ("qwen3", "llama3_1"):
            tj = os.path.join(TOK, "hf", name, "tokenizer.json")
            hf = Tokenizer.from_file(tj)
            want = hf.encode(text, add_special_tokens=False).ids
            got = specd_ids(a.specd, os.path.join(TOK, "hf", name), path)
            same = got == want
            if not same:
                ok = False
                k = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                         min(len(got), len(want)))
                print(f"  {name}: ids DIFFER at {k} (specd {len(got)} ids, HF {len(want)})")
            hf_mbps = len(data) / 1e6 / hf_best(lambda: hf.encode(text, add_special_tokens=False),
                                                 a.reps)
            sp = specd_mbps(a.specd, os.path.join(TOK, "hf", name), path, a.reps)
            print(f"  {name:9s} one {len(data) / 1e6:.0f} MB string: ids "
                  f"{'identical' if same else 'DIFFERENT'} ({len(want)} tokens)  "
                  f"specd {sp['mb_per_s']:7.2f} MB/s  HF {hf_mbps:7.2f} MB/s  "
                  f"ratio {sp['mb_per_s'] / hf_mbps:.2f}x")
            # documents of prompt size, one encode call each (HF: one thread, no batch)
            docs = chunks(data, a.chunk)
            hf_ids = [hf.encode(d, add_special_tokens=False).ids for d in docs]
            hf_mbps = len(data) / 1e6 / hf_best(
                lambda: [hf.encode(d, add_special_tokens=False) for d in docs], a.reps)
            sp = specd_mbps(a.specd, os.path.join(TOK, "hf", name), path, a.reps, a.chunk)
            same = sp["hash"] == ids_hash(hf_ids) and sp["count"] == sum(map(len, hf_ids))
            ok = ok and same
            print(f"  {name:9s} {len(docs)} docs of ~{a.chunk} B: ids "
                  f"{'identical' if same else 'DIFFERENT'} (hash)  "
                  f"specd {sp['mb_per_s']:7.2f} MB/s  HF {hf_mbps:7.2f} MB/s  "
                  f"ratio {sp['mb_per_s'] / hf_mbps:.2f}x")
        for name in ("gpt-2", "llama-bpe", "qwen2", "llama-spm", "phi-3"):
            g = os.path.join(TOK, "gguf", f"ggml-vocab-{name}.gguf")
            sp = specd_mbps(a.specd, g, path, a.reps)
            sc = specd_mbps(a.specd, g, path, a.reps, a.chunk)
            print(f"  gguf {name:9s} specd {sp['mb_per_s']:7.2f} MB/s whole, "
                  f"{sc['mb_per_s']:7.2f} MB/s per document ({sp['count']} tokens)")
    finally:
        os.unlink(path)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
