#!/usr/bin/env python3
"""The chosen token's logprob on the device: the same greedy completion (Llama-3.2-1B
shape, random weights) with logprobs 0 (decode graphs and forward sampling return it) and
logprobs 1 (top logprobs: host sampling) must give equal tokens and logprobs; prints both
latencies.  python3 tests/gpu/logprobs_check.py build/specd"""
import json, sys, time, subprocess, requests
b = sys.argv[1]; port = 8401
p = subprocess.Popen([b, "serve", "--device", "cuda", "--shape", "llama-3.2-1b", "--port", str(port), "--max-batch", "64", "--max-seq-len", "512", "--log-level", "warn"])
for _ in range(600):
    try:
        if requests.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200: break
    except Exception: pass
    time.sleep(0.25)
def run(lp):
    body = {"prompt": [11, 22, 33, 44, 55], "max_tokens": 64, "ignore_eos": True, "temperature": 0, "logprobs": lp}
    t0 = time.time(); r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body).json(); dt = time.time() - t0
    c = r["choices"][0]["logprobs"]
    return c["tokens"], c["token_logprobs"], dt
t0, l0, d0 = run(0)   # chosen-token logprobs: device path (graphs)
t1, l1, d1 = run(1)   # top logprobs: host path
ok = t0 == t1 and max(abs(a - b) for a, b in zip(l0, l1)) < 1e-3
print("tokens equal:", t0 == t1, "| max |logprob diff|: %.2e" % max(abs(a - b) for a, b in zip(l0, l1)),
      "| 64 tokens: logprobs 0 %.1f ms, logprobs 1 %.1f ms" % (d0 * 1e3, d1 * 1e3))
p.terminate(); p.wait(30)
sys.exit(0 if ok else 1)
