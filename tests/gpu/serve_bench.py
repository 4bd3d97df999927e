#!/usr/bin/env python3
"""HTTP serving throughput against the engine's own decode rate, on one GPU.

For each model: `specd bench` gives the engine's decode tok/s at each batch (128 prompt,
128 generated tokens); then `specd serve` runs under `specd loadgen` (or scripts/bench.py
with --client python; streaming, the same lengths, ignore_eos, a fresh seed per run) at
the same numbers of streams, for each server variant:
  new      this build, default settings (overlapped steps, async scheduling, parallel
           output processing)
  sync     this build with --async-scheduling 0 (each step committed before the next is
           queued); its engine figures are measured with the same setting
  serial   this build with --overlap 0 --async-scheduling 0 --output-threads 1 (the old
           serving path's shape)
  base     an earlier binary (--base-bin), when given; only for file models (--model)
  http8    this build with 8 HTTP threads instead of 4
  tokN     this build with --max-num-batched-tokens N (default 2048)
  hostsample  this build with SPECD_CUDA_NO_FORWARD_SAMPLING=1 (composed steps copy
           logits to the host and sample there); its engine figures are measured with
           the same setting
and prints HTTP out tok/s beside the engine figure, their ratio, ITL p99 against the
step time, TTFT p50/p99 and the host cost per generated token. At the top level it also
runs the client with twice the threads (processes), to show the client is not the limit.

  python3 tests/gpu/serve_bench.py --bin build/specd --smol M.gguf [--base-bin B] --out DIR
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "scripts", "bench.py")
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import serverproc  # noqa: E402


DEVICE = "cuda"


def engine_rates(bin_, model_args, batches, out, env=None, extra=()):
    cmd = [bin_, "bench", "--device", DEVICE, *model_args, "--batch", ",".join(map(str, batches)),
           "--prompt-len", "128", "--gen", "128", "--max-batch", str(max(batches)), "--max-seq-len", "512",
           "--json", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    with open(out, "w") as f:
        f.write(p.stdout + p.stderr)
    rates = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            j = json.loads(line)
            rates[j["batch"]] = j
    return rates


def serve(bin_, model_args, extra, port, log, env=None):
    cmd = [bin_, "serve", "--device", DEVICE, *model_args, "--port", str(port), "--max-batch", "256",
           "--max-seq-len", "512", "--max-queued", "4096", "--log-level", "warn", *extra]
    return serverproc.start(cmd, port, log=log, env=env)


RUNS = [0]


def client(how, bin_, port, endpoint, kind, conc, n, procs, out):
    """One level: `specd loadgen` with `procs` threads, or scripts/bench.py with `procs`
    processes. Every run gets its own seed: the same prompts again would find their prefill
    in the server's prefix cache (until 2026-12-05 every bench.py run here had seed 0, so a
    level's second run, with more client processes, was partly a cache hit)."""
    RUNS[0] += 1
    if how == "loadgen":
        os.makedirs(out, exist_ok=True)
        cmd = [bin_, "loadgen", "--url", f"http://127.0.0.1:{port}", "--endpoint", endpoint,
               "--concurrency", str(conc), "--num-prompts", str(n), "--input-len", "128", "--output-len", "128",
               "--threads", str(procs), "--seed", str(RUNS[0]), "--out", os.path.join(out, "bench.json")]
        if kind == "tokens":
            cmd += ["--prompt-kind", "tokens", "--token-range", "100,30000"]
    else:
        cmd = [sys.executable, BENCH, "--base-url", f"http://127.0.0.1:{port}", "--endpoint", endpoint,
               "--concurrency", str(conc), "--num-prompts", str(n), "--input-len", "128", "--output-len", "128",
               "--processes", str(procs), "--seed", str(RUNS[0]), "--no-plot", "--out", out]
        if kind == "tokens":
            cmd += ["--prompt-kind", "tokens", "--token-low", "100", "--token-high", "30000"]
    subprocess.run(cmd, capture_output=True, timeout=600)
    return json.load(open(os.path.join(out, "bench.json")))["results"][0]


def requests_for(conc):
    """Four waves of requests per stream above 16 streams, so the figure is a steady state
    (staggered arrivals, prefill mixed into decode steps) and not one burst."""
    return {1: 24, 16: 64}.get(conc, 4 * conc)


def scrape(port):
    """The server's counters as {name or name{path}: value}."""
    vals = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if not line.startswith("specd:"):
            continue
        name, _, v = line.rpartition(" ")
        key = name.split("{")[0][6:]
        if 'path="' in name:
            key += "." + name.split('path="')[1].split('"')[0]
        try:
            vals[key] = float(v)
        except ValueError:
            pass
    return vals


def engine_view(m0, m1, wall):
    """Where the engine thread's time went while the client ran: steps by path, mean step
    time, the runner's share, waits for output processing, decoding rows per step."""
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)
    steps = sum(d("engine_steps_total." + p) for p in ("decode", "verify", "speculative", "composed"))
    dec_steps = d("spec_decode_num_decode_steps_total")
    return {"steps": int(steps), "steps_composed": int(d("engine_steps_total.composed")),
            "step_ms": 1e3 * d("engine_step_seconds_total") / steps if steps else None,
            "run_ms": 1e3 * d("engine_run_seconds_total") / steps if steps else None,
            "busy": d("engine_step_seconds_total") / wall if wall else None,
            "out_wait": d("engine_output_wait_seconds_total") / wall if wall else None,
            "rows_per_step": d("spec_decode_num_decode_rows_total") / dec_steps if dec_steps else None,
            "prompt_tok": int(d("prompt_tokens_total"))}


def e2e(e):
    """The engine's own rate for the same shape with its prefill counted: every stream's
    128 prompt tokens at the prefill rate, then 128 tokens at the decode rate."""
    if not e.get("decode_tok_s") or not e.get("prefill_tok_s"):
        return None
    b, plen, gen = e["batch"], e["prompt_len"], e["gen"]
    return b * gen / (b * plen / e["prefill_tok_s"] + b * (gen - 1) / e["decode_tok_s"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/specd")
    ap.add_argument("--base-bin")
    ap.add_argument("--smol")
    ap.add_argument("--models", default="smol,1b,8b")
    ap.add_argument("--variants", default="new,serial,base")
    ap.add_argument("--client", choices=["loadgen", "python"], default="loadgen",
                    help="`specd loadgen` (threads) or scripts/bench.py (processes)")
    ap.add_argument("--procs", type=int, default=8,
                    help="client threads (loadgen) or processes (python) at the larger levels")
    ap.add_argument("--procs-from", type=int, default=64,
                    help="streams from which the client runs in --procs processes (fewer: one)")
    ap.add_argument("--out", default="serve-bench")
    ap.add_argument("--levels", help="streams, comma separated (default: per model)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    os.makedirs(a.out, exist_ok=True)
    configs = {"smol": (["--model", a.smol or ""], "chat", "words", [1, 16, 64, 256]),
               "1b": (["--shape", "llama-3.2-1b"], "completions", "tokens", [1, 16, 64, 256]),
               "8b": (["--shape", "llama-3.1-8b"], "completions", "tokens", [64, 256])}
    rows = []
    port = 8300
    for name in a.models.split(","):
        model_args, endpoint, kind, levels = configs[name]
        if a.levels:
            levels = [int(x) for x in a.levels.split(",")]
        base_rates = engine_rates(a.bin, model_args, levels, os.path.join(a.out, f"engine_{name}.txt"))
        for variant in a.variants.split(","):
            bin_, extra, env, rates = a.bin, [], None, base_rates
            if variant == "hostsample":
                env = dict(os.environ, SPECD_CUDA_NO_FORWARD_SAMPLING="1")
                rates = engine_rates(a.bin, model_args, levels, os.path.join(a.out, f"engine_{name}_host.txt"), env)
            if variant == "sync":
                extra = ["--async-scheduling", "0"]
                rates = engine_rates(a.bin, model_args, levels, os.path.join(a.out, f"engine_{name}_sync.txt"),
                                     extra=extra)
            if variant == "serial":
                extra = ["--overlap", "0", "--async-scheduling", "0", "--output-threads", "1"]
            elif variant == "http8":
                extra = ["--http-threads", "8"]
            elif variant.startswith("tok"):   # tokN: --max-num-batched-tokens N
                extra = ["--max-num-batched-tokens", variant[3:]]
            elif variant == "base":
                if not a.base_bin or model_args[0] != "--model":
                    continue
                bin_ = a.base_bin
            port += 1
            srv = serve(bin_, model_args, extra, port, os.path.join(a.out, f"serve_{name}_{variant}.log"), env)
            try:
                runs = [(c, min(a.procs, c) if c >= a.procs_from else 1) for c in levels]
                if variant == "new":
                    runs.append((levels[-1], 2 * a.procs))
                for conc, procs in runs:
                    m0, t0 = scrape(port), time.time()
                    r = client(a.client, a.bin, port, endpoint, kind, conc, requests_for(conc), procs,
                               os.path.join(a.out, f"b_{name}_{variant}_{conc}_{procs}"))
                    ev = engine_view(m0, scrape(port), time.time() - t0)
                    e = rates.get(conc, {})
                    eng = e.get("decode_tok_s")
                    step = e.get("ms_per_step")
                    row = {"model": name, "variant": variant, "streams": conc, "procs": procs,
                           "http_tok_s": r["output_tokens_per_s"], "engine_tok_s": eng,
                           "ratio": r["output_tokens_per_s"] / eng if eng else None, "step_ms": step,
                           "engine_e2e_tok_s": e2e(e),
                           "ratio_e2e": r["output_tokens_per_s"] / e2e(e) if e2e(e) else None, **ev,
                           "engine_prefill_tok_s": e.get("prefill_tok_s"),
                           "itl_p50_ms": r["itl_p50_ms"], "itl_p99_ms": r["itl_p99_ms"],
                           "ttft_p50_ms": r["ttft_p50_ms"], "ttft_p99_ms": r["ttft_p99_ms"],
                           "host_us_per_token": r.get("host_us_per_token"), "failed": r["failed"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                srv.send_signal(signal.SIGTERM)
                try:
                    srv.wait(30)
                except subprocess.TimeoutExpired:
                    srv.kill()
    with open(os.path.join(a.out, "serve_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    f = lambda v, nd=1: "-" if v is None else f"{v:.{nd}f}"
    print("\n| model | variant | streams | procs | HTTP out tok/s | engine tok/s | ratio | engine e2e tok/s "
          "| ratio e2e | step ms | ITL p50/p99 ms | TTFT p50/p99 ms | host us/tok | failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['variant']} | {r['streams']} | {r['procs']} | {f(r['http_tok_s'])} | "
              f"{f(r['engine_tok_s'])} | {f(r['ratio'], 3)} | {f(r['engine_e2e_tok_s'])} | {f(r['ratio_e2e'], 3)} | "
              f"{f(r['step_ms'], 2)} | {f(r['itl_p50_ms'], 2)} / {f(r['itl_p99_ms'], 2)} | "
              f"{f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | {f(r['host_us_per_token'], 2)} | {r['failed']} |")
    print("\nEngine thread while the client ran (from /metrics): steps (composed), mean step and runner ms, "
          "busy share, share waiting for output processing, decoding rows per step, prompt tokens")
    print("| model | variant | streams | steps (composed) | step ms | run ms | busy | out wait | rows/step | prompt tok |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['variant']} | {r['streams']} | {r['steps']} ({r['steps_composed']}) | "
              f"{f(r['step_ms'], 3)} | {f(r['run_ms'], 3)} | {f(r['busy'], 2)} | {f(r['out_wait'], 2)} | "
              f"{f(r['rows_per_step'], 1)} | {r['prompt_tok']} |")


if __name__ == "__main__":
    main()
