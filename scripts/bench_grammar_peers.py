#!/usr/bin/env python3
"""Mask time and compile time of llguidance and xgrammar on bench_grammar's documents.

tests/bench_grammar.c (`make bench-grammar`) times specd's own grammar engine; this script
times the two maintained engines on exactly the same work, so that the numbers can be put
side by side (docs/structured-outputs.md, "Other engines"):

- the schema and the three documents (compact, pretty-printed, non-ASCII with escapes) are
  read from tests/bench_grammar.c itself (its SCHEMA and DOCS initializers), not copied;
- each document is tokenized with HF `tokenizers` from the same tokenizer file (a .gguf goes
  through transformers' own GGUF conversion, which reads metadata only; a tokenizer.json or
  a directory is loaded as it is). With --specd BIN the ids are checked against
  `specd tokenize` on the same file: the bench is only comparable if they are equal;
- for every document, 5 times over, a fresh matcher; before every token (and once after
  the last, where the document is complete) the mask is filled into a numpy int32 bitmask,
  timed, then the document's token is checked to be in the mask and consumed (timed
  apart); p50 / p99 / max / mean over all steps, as bench_grammar reports;
- json_object: generic JSON (a schema {"type": "object"}) on the third document;
- compile: from the schema text to a grammar ready to make a matcher, 50 times, p50.
  llguidance: grammar_from_json_schema + LLMatcher(); it builds its lexer lazily, so part
  of its compile cost shows in the first masks. xgrammar: GrammarCompiler.compile_json_schema
  with its cache off (it precomputes token masks per vocabulary, so its compile depends on
  the vocabulary), with 1 thread and with its default max_threads (8).

Calls go to each engine's lowest-level Python entry (llguidance: LLMatcher.
unsafe_compute_mask_ptr on a preallocated buffer; xgrammar: the matcher handle's
fill_next_token_bitmask on a preallocated numpy array, wrapped once as a DLPack tensor), with the
garbage collector off. What a timed call costs in Python alone is printed ("overhead"):
the timer pair around nothing, and a trivial call into each extension.

xgrammar's package declares torch as a dependency and imports it at module level, but its
mask and compile paths are C++ and take any DLPack array: where torch is not installed a
stand-in module satisfies those imports (no tensor of torch is ever made). Install it with
`pip install --no-deps xgrammar apache-tvm-ffi` (pydantic, transformers, numpy are needed).
transformers' GGUF reader is given the same stand-in (it reads metadata only).

  python3 scripts/bench_grammar_peers.py models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      ../shared/fixtures/tokenizers/hf/llama3_1/tokenizer.json --specd build/specd
"""
import argparse
import gc
import json
import os
import re
import sys
import time
from importlib.metadata import version

import numpy as np

REPS = 5


# --- the documents: parsed from tests/bench_grammar.c ---------------------------------

def c_initializer(src, name):
    """The C string literals of `name`'s initializer, one per element (adjacent literals
    concatenated), decoded as C does (\\xHH takes every hex digit that follows)."""
    m = re.search(r"\b%s(\[\])?\s*=\s*(\{)?" % re.escape(name), src)
    if not m:
        raise SystemExit(f"{name} not found in the bench source")
    i, out, cur = m.end(), [], b""
    esc = {"n": b"\n", "t": b"\t", "r": b"\r", '"': b'"', "\\": b"\\", "'": b"'", "/": b"/"}
    while True:
        while src[i].isspace():
            i += 1
        if src.startswith("/*", i):
            i = src.index("*/", i) + 2
        elif src[i] == '"':
            i += 1
            while src[i] != '"':
                if src[i] != "\\":
                    cur += src[i].encode()
                    i += 1
                elif src[i + 1] == "x":
                    j = i + 2
                    while src[j] in "0123456789abcdefABCDEF":
                        j += 1
                    cur += bytes([int(src[i + 2:j], 16)])
                    i = j
                else:
                    cur += esc[src[i + 1]]
                    i += 2
            i += 1
        elif src[i] == ",":
            out.append(cur)
            cur = b""
            i += 1
        elif src[i] in ";}":
            if cur:
                out.append(cur)
            return [x.decode("utf-8") for x in out]
        else:
            raise SystemExit(f"unexpected text in {name}: {src[i:i + 40]!r}")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hfref import hf_tokenizer, specd_ids, torch_stand_in  # noqa: E402



# --- statistics ------------------------------------------------------------------------

def stats(us):
    v = np.sort(np.asarray(us, dtype=np.float64))
    n = len(v)
    pick = lambda p: v[int(p * (n - 1) + 0.5)]   # bench_grammar's percentile
    return {"steps": n, "p50": pick(0.5), "p99": pick(0.99), "max": v[-1], "mean": v.mean()}


def line(what, s):
    print(f"  {what:<40} steps {s['steps']:5d}  p50 {s['p50']:8.1f} us  p99 {s['p99']:8.1f} us  "
          f"max {s['max']:8.1f} us  mean {s['mean']:8.1f} us", flush=True)


def bit(mask, t):
    return (int(mask[t >> 5]) >> (t & 31)) & 1


# --- engines ---------------------------------------------------------------------------

class LLGuidance:
    name = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.version = version("llguidance")
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf)
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.n_vocab = self.tok.vocab_size
        self.eos = self.tok.eos_token

    def grammar(self, schema):
        # \\u escapes of printable characters: valid JSON (the third document has one),
        # which llguidance refuses unless told
        return self.llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"json_allow_general_unicode_escapes": True})

    def compile(self, schema):
        m = self.llg.LLMatcher(self.tok, self.grammar(schema))
        if m.is_error():
            raise SystemExit("llguidance: " + m.get_error())
        return m

    def matcher(self, schema_grammar):
        return self.llg.LLMatcher(self.tok, schema_grammar)

    def prepare(self, schema):   # what matcher() takes
        return self.grammar(schema)

    def filler(self, m, mask):
        ptr, nbytes, f = mask.ctypes.data, mask.nbytes, m.unsafe_compute_mask_ptr
        return lambda: f(ptr, nbytes)

    def consumer(self, m):
        return m.consume_token

    def trivial(self, m):
        return m.is_error


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf):
        import xgrammar as xgr
        self.xgr = xgr
        self.version = version("xgrammar")
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.n_vocab = self.info.vocab_size
        self.eos = self.info.stop_token_ids[0]
        self.compilers = {}

    def compiler(self, threads):
        if threads not in self.compilers:
            kw = {} if threads is None else {"max_threads": threads}
            self.compilers[threads] = self.xgr.GrammarCompiler(self.info, cache_enabled=False, **kw)
        return self.compilers[threads]

    def compile(self, schema, threads=1):
        # strict_mode (the default) reads a schema without additionalProperties as false;
        # bench_grammar's schema says false itself, json_object must take any object
        strict = json.loads(schema) != {"type": "object"}
        return self.compiler(threads).compile_json_schema(schema, strict_mode=strict)

    def prepare(self, schema):
        return self.compile(schema)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def filler(self, m, mask):
        # the numpy array wrapped once (DLPack, same memory), not converted on every call
        import tvm_ffi
        arr, f = tvm_ffi.from_dlpack(mask.reshape(1, -1)), m._handle.fill_next_token_bitmask
        return lambda: f(arr, 0, False)

    def consumer(self, m):
        return m.accept_token

    def trivial(self, m):
        return m._handle.is_terminated


def run_docs(eng, prepared, docs_ids, reps):
    mask = np.zeros((eng.n_vocab + 31) // 32, dtype=np.int32)
    fill_us, take_us = [], []
    clock = time.perf_counter_ns
    for _ in range(reps):
        for d, ids in enumerate(docs_ids):
            m = eng.matcher(prepared)
            fill, take = eng.filler(m, mask), eng.consumer(m)
            for i in range(len(ids) + 1):
                t0 = clock()
                fill()
                fill_us.append((clock() - t0) / 1e3)
                if i == len(ids):
                    if not bit(mask, eng.eos):
                        raise SystemExit(f"{eng.name}: document {d} complete but eos not allowed")
                    break
                t = ids[i]
                if not bit(mask, t):
                    raise SystemExit(f"{eng.name}: document {d}: token {t} (#{i}) not in the mask")
                t0 = clock()
                ok = take(t)
                take_us.append((clock() - t0) / 1e3)
                if not ok:
                    raise SystemExit(f"{eng.name}: document {d}: token {t} (#{i}) rejected")
    return stats(fill_us), stats(take_us)


def overhead(eng, prepared):
    clock = time.perf_counter_ns
    m = eng.matcher(prepared)
    f = eng.trivial(m)
    empty, call = [], []
    for _ in range(20000):
        t0 = clock()
        empty.append((clock() - t0) / 1e3)
        t0 = clock()
        f()
        call.append((clock() - t0) / 1e3)
    return stats(empty), stats(call)


def compile_times(eng, schema, n, **kw):
    us = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        eng.compile(schema, **kw)
        us.append((time.perf_counter_ns() - t0) / 1e3)
    return stats(us)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tokenizers", nargs="+", help=".gguf, tokenizer.json or tokenizer directory")
    ap.add_argument("--bench-src", default="tests/bench_grammar.c", help="where SCHEMA and DOCS are read")
    ap.add_argument("--specd", help="specd binary: check the ids against `specd tokenize`")
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--compiles", type=int, default=50)
    a = ap.parse_args()

    src = open(a.bench_src, encoding="utf-8").read()
    schema = c_initializer(src, "SCHEMA")[0]
    docs = c_initializer(src, "DOCS")
    for d in docs:
        json.loads(d)
    json_object = '{"type": "object"}'
    stood_in = torch_stand_in()
    engines = a.engines.split(",")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}; "
          f"torch {'absent (stand-in module)' if stood_in else 'installed'}; {os.cpu_count()} cpus")
    print(f"schema {len(schema)} bytes, documents {[len(d.encode()) for d in docs]} bytes; "
          f"{REPS} passes; gc off while timing")
    summary = []
    for path in a.tokenizers:
        hf = hf_tokenizer(path)
        ids = [hf.encode(d, add_special_tokens=False) for d in docs]
        same = ""
        if a.specd:
            same = all(specd_ids(a.specd, path, d) == x for d, x in zip(docs, ids))
            same = ", same ids as specd tokenize" if same else ", IDS DIFFER FROM specd tokenize"
        print(f"{path}: vocab {len(hf)}, tokens per document {[len(x) for x in ids]}{same}", flush=True)
        for name in engines:
            eng = {"llguidance": LLGuidance, "xgrammar": XGrammar}[name](hf)
            print(f" {name} {eng.version}: tokenizer set up in {eng.setup_ms:.0f} ms", flush=True)
            gc.collect()
            gc.disable()
            try:
                if name == "xgrammar":
                    c1 = compile_times(eng, schema, a.compiles, threads=1)
                    cd = compile_times(eng, schema, a.compiles, threads=None)
                    print(f"  schema compile: p50 {c1['p50']:.0f} us, max {c1['max']:.0f} us (1 thread); "
                          f"p50 {cd['p50']:.0f} us (default threads)")
                else:
                    c1 = compile_times(eng, schema, a.compiles)
                    print(f"  schema compile: p50 {c1['p50']:.0f} us, max {c1['max']:.0f} us")
                prep = eng.prepare(schema)
                fs, ts = run_docs(eng, prep, ids, REPS)
                fj, _ = run_docs(eng, eng.prepare(json_object), ids[2:], REPS)
                oe, oc = overhead(eng, prep)
            finally:
                gc.enable()
            line("json_schema, mask per token", fs)
            line("json_object, mask per token", fj)
            line("json_schema, consume token (not in mask)", ts)
            print(f"  overhead: timer pair p50 {oe['p50']:.2f} us; trivial call p50 {oc['p50']:.2f} us "
                  f"(in the mask numbers)", flush=True)
            summary.append((name, len(hf), fs, c1))
    print("\nengine      vocab   mask p50   mask p99  mask mean   compile p50")
    for name, v, fs, c in summary:
        print(f"{name:<10} {v:6d} {fs['p50']:8.1f} us {fs['p99']:8.1f} us {fs['mean']:8.1f} us "
              f"{c['p50'] / 1e3:9.2f} ms")


if __name__ == "__main__":
    main()
