#!/usr/bin/env python3
"""Prompt lookup on constrained rows: greedy requests that copy a passage, with and without
a loose regex constraint, against `specd serve` without and with --speculative ngram.
Prints output tok/s per case, drafts accepted, and whether the constrained texts are the
same with and without speculation (greedy is lossless).

  python3 scripts/bench_spec_grammar.py [--bin build/specd] [--model M] [--device cpu] [--reps 3]
"""
import argparse
import time

import httpx

import serverproc

# Written for this benchmark (no source text).
PASSAGES = [
    "the river ran low that summer, and the children walked along its bed collecting smooth stones, "
    "counting the fish that hid in the shallow pools under the willow roots",
    "every morning the baker lit the oven before dawn, kneaded the dough on the long wooden table, "
    "and left the first loaves to cool by the open window facing the square",
    "the old map showed three roads leading north from the village, one along the coast, one through "
    "the forest, and one over the hills where the shepherds kept their flocks",
    "she wrote the letter twice, once in pencil and once in ink, folded it into a narrow envelope, "
    "and carried it to the post office at the end of the market street",
]
REGEX = "[a-z ,.]{1,400}"


def serve(a, port, ngram):
    cmd = [a.bin, "serve", "--model", a.model, "--device", a.device, "--port", str(port), "--log-level", "warn"]
    if ngram:
        cmd += ["--speculative", "ngram"]
    return serverproc.start(cmd, port, timeout_s=120)


def run(port, constrained, reps):
    toks, secs, texts, drafted, accepted = 0, 0.0, [], 0, 0
    for rep in range(reps):
        for t in PASSAGES:
            body = {"messages": [{"role": "user", "content": f"Repeat this passage exactly, in lower case:\n{t}"}],
                    "max_tokens": 80, "temperature": 0}
            if constrained:
                body["structured_outputs"] = {"regex": REGEX}
            t0 = time.time()
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600).json()
            secs += time.time() - t0
            toks += r["usage"]["completion_tokens"]
            sd = r["usage"].get("spec_decode") or {}
            drafted += sd.get("draft_tokens", 0)
            accepted += sd.get("accepted_tokens", 0)
            if rep == 0:
                texts.append(r["choices"][0]["message"]["content"])
    return toks / secs, texts, drafted, accepted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/specd")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--port", type=int, default=8441)
    a = ap.parse_args()
    res = {}
    for ngram in (0, 1):
        p = serve(a, a.port + ngram, ngram)
        try:
            for c in (0, 1):
                res[(ngram, c)] = r = run(a.port + ngram, c, a.reps)
                print(f"{'ngram' if ngram else 'plain'} {'regex' if c else 'free '}: {r[0]:.1f} tok/s, "
                      f"{r[3]} of {r[2]} drafts accepted", flush=True)
        finally:
            p.terminate()
            p.wait()
    print(f"regex {REGEX}: ngram / plain {res[(1, 1)][0] / res[(0, 1)][0]:.2f}x; "
          f"free: {res[(1, 0)][0] / res[(0, 0)][0]:.2f}x; constrained texts equal: {res[(1, 1)][1] == res[(0, 1)][1]}")


if __name__ == "__main__":
    main()
