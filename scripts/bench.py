#!/usr/bin/env python3
"""OpenAI-API load generator: a concurrency sweep against any OpenAI-compatible server
(specd, vLLM, llama.cpp's server, ...).

For each concurrency level it keeps that many streaming requests in flight until
--num-prompts requests have finished, then reports requests/s, output tokens/s, time to
first token (TTFT) and inter-token latency (ITL, the gap between streamed chunks that
carry tokens) at p50/p90/p99, and the speculative acceptance length (AL) when the server
reports usage.spec_decode (specd does). Results go to <out>/bench.json, <out>/bench.md
and <out>/bench.png.

`specd loadgen` is the same load in C (one thread drives a 256-stream level of a GPU
server; no workload files or texts). One client process saturates at some tens of
thousands of streamed tokens/s; --processes N
splits every level's streams and requests over N processes and merges their results into
one report (run the top level with N and 2N: when the figure does not move, the server is
the limit, not the client). Against specd it also prints the server's host cost per
generated token of output processing (from /metrics, host_output_seconds_total).

Prompts are random (seeded): words from a fixed list, or random token ids for servers
without a tokenizer (--prompt-kind tokens, completions endpoint only). Lengths are fixed
or sampled uniformly in [len*(1-r), len*(1+r)] with --range-ratio r. Or they come from a
workload file (--workload FILE, JSON lines {"set", "prompt", "max_tokens"}; --workload-set
picks one set; requests cycle through the file's prompts): scripts/workloads/copy-chat.jsonl
has copy-heavy tasks (summarise, extract, rewrite with small edits) over public-domain
passages and an open-chat set, for speculative decoding. With --save-text every request's
output text goes into bench.json (compare two runs: greedy output must be the same with and
without speculation). The speculative columns (AL, share of decoding steps that verified
drafts) come from usage.spec_decode.

Example:
  python3 scripts/bench.py --base-url http://127.0.0.1:8000 --concurrency 1,4,16,64 \
      --input-len 128 --output-len 128 --num-prompts 64 --out bench-results
Needs: pip install httpx matplotlib
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import httpx

WORDS = ("the of and to in is was for on that by with as at from his an were are which this be "
         "have or had not but first one their its new after who they two her she been other when "
         "there all during into school time may years more most only over city some world would "
         "where later up such used many can state about national out known university united then "
         "made").split()


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def sample_len(rng, n, ratio):
    if ratio <= 0:
        return n
    return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio))))


def load_workload(path, which):
    items = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            obj = json.loads(line)
            if which and obj.get("set") != which:
                continue
            items.append((obj["prompt"], int(obj.get("max_tokens", 128))))
    if not items:
        sys.exit(f"{path}: no prompts{' in set ' + which if which else ''}")
    return items


def make_requests(args):
    rng = random.Random(args.seed)
    if args.workload:
        items = load_workload(args.workload, args.workload_set)
        return [items[i % len(items)] for i in range(args.num_prompts)]
    reqs = []
    for _ in range(args.num_prompts):
        n_in = sample_len(rng, args.input_len, args.range_ratio)
        n_out = sample_len(rng, args.output_len, args.range_ratio)
        if args.prompt_kind == "tokens":
            prompt = [rng.randrange(args.token_low, args.token_high) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        reqs.append((prompt, n_out))
    return reqs


async def one(client, args, prompt, max_tokens):
    body = {"model": args.model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body)
    if args.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    t0 = time.perf_counter()
    first, last, gaps, usage, chunks, err, text = None, None, [], None, 0, None, []
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"].get("message")
                    break
                if obj.get("usage"):
                    usage = obj["usage"]
                if not obj.get("choices"):
                    continue
                c = obj["choices"][0]
                has_tokens = ("text" in c and c["text"] is not None) or \
                             ("delta" in c and (c["delta"].get("content") is not None))
                if c.get("finish_reason") and not (c.get("text") or (c.get("delta") or {}).get("content")):
                    continue  # the finish chunk carries no token
                if not has_tokens or ("delta" in c and c["delta"].get("role") and not c["delta"].get("content")):
                    continue  # chat role chunk
                text.append(c["text"] if "text" in c else c["delta"]["content"])
                now = time.perf_counter()
                chunks += 1
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return {"ok": False, "error": repr(e)}
    if err:
        return {"ok": False, "error": err}
    end = time.perf_counter()
    n_out = usage["completion_tokens"] if usage else chunks
    res = {"ok": True, "ttft": (first - t0) if first else None, "e2e": end - t0, "gaps": gaps,
           "output_tokens": n_out, "prompt_tokens": usage["prompt_tokens"] if usage else None}
    if first and n_out > 1:
        res["tpot"] = (end - first) / (n_out - 1)
    if usage and usage.get("spec_decode"):
        res["spec"] = usage["spec_decode"]
    res["text"] = "".join(text)
    return res


async def share(args, concurrency, reqs):
    """Run reqs with `concurrency` streams in flight; returns (results, start, end) with
    wall-clock times comparable across processes."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results = []
    queue = list(reqs)   # (index, (prompt, max_tokens))
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits, headers=headers) as client:
        async def worker():
            while queue:
                i, (prompt, n_out) = queue.pop(0)
                r = await one(client, args, prompt, n_out)
                r["index"] = i
                results.append(r)

        t0 = time.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        t1 = time.time()
    return results, t0, t1


def share_in_process(job):
    args, concurrency, reqs, barrier_at = job
    while time.time() < barrier_at:   # every process starts its streams at the same moment
        time.sleep(0.001)
    return asyncio.run(share(args, concurrency, reqs))


def run_level(args, concurrency, reqs):
    """All processes' results and the wall time from the first start to the last end."""
    n = max(1, min(args.processes, concurrency))
    if n == 1:
        results, t0, t1 = asyncio.run(share(args, concurrency, list(enumerate(reqs))))
        return results, t1 - t0
    import multiprocessing
    jobs = []
    start = time.time() + 1.0 + 0.05 * n
    for p in range(n):
        conc = concurrency // n + (1 if p < concurrency % n else 0)
        jobs.append((args, conc, list(enumerate(reqs))[p::n], start))
    with multiprocessing.get_context("fork").Pool(n) as pool:
        parts = pool.map(share_in_process, jobs)
    results = [r for part in parts for r in part[0]]
    return results, max(p[2] for p in parts) - min(p[1] for p in parts)


def host_output(args):
    """specd's (seconds, tokens) of output processing so far, or None for other servers."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        text = httpx.get(args.base_url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return None
    vals = {}
    for line in text.splitlines():
        for name in ("host_output_seconds_total", "host_output_tokens_total"):
            if line.startswith(f"specd:{name}{{"):
                vals[name] = float(line.rsplit(" ", 1)[1])
    if len(vals) != 2:
        return None
    return vals["host_output_seconds_total"], vals["host_output_tokens_total"]


def level(args, concurrency, reqs):
    h0 = host_output(args)
    results, wall = run_level(args, concurrency, reqs)
    h1 = host_output(args)
    ok = [r for r in results if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if "tpot" in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    row = {"concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok),
           "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
           "output_tokens": out_tokens}
    for name, xs in (("ttft", ttft), ("itl", gaps), ("tpot", tpot), ("e2e", [r["e2e"] for r in ok])):
        for p in (50, 90, 99):
            row[f"{name}_p{p}_ms"] = None if not xs else 1000 * percentile(xs, p)
        row[f"{name}_mean_ms"] = None if not xs else 1000 * statistics.fmean(xs)
    spec = [r["spec"] for r in ok if "spec" in r]
    if spec:
        acc = sum(s["accepted_tokens"] for s in spec)
        steps = sum(s["verify_steps"] for s in spec)
        row["acceptance_length"] = 1 + acc / steps if steps else None
        dec = sum(s.get("decode_steps", 0) for s in spec)
        if dec:
            row["speculated_share"] = steps / dec
        row["draft_tokens"] = sum(s["draft_tokens"] for s in spec)
        row["accepted_tokens"] = acc
    if h0 and h1 and h1[1] > h0[1]:
        row["host_us_per_token"] = 1e6 * (h1[0] - h0[0]) / (h1[1] - h0[1])
    row["processes"] = max(1, min(args.processes, concurrency))
    errors = [r["error"] for r in results if not r["ok"]]
    if errors:
        row["first_error"] = errors[0]
    if args.save_text:
        row["texts"] = [r.get("text") for r in sorted(results, key=lambda r: r["index"])]
    return row


def fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(rows, args):
    lines = [f"Server {args.base_url}, model `{args.model}`, endpoint {args.endpoint}, input {args.input_len} / output "
             f"{args.output_len} tokens (range ratio {args.range_ratio}), {args.num_prompts} requests per level, "
             f"seed {args.seed}.", "",
             "| conc | req/s | out tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p50 ms | AL | spec share "
             "| host us/tok | procs | failed |",
             "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {fmt(r['requests_per_s'], 2)} | {fmt(r['output_tokens_per_s'])} | "
                     f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p90_ms'])} / {fmt(r['ttft_p99_ms'])} | "
                     f"{fmt(r['itl_p50_ms'])} / {fmt(r['itl_p90_ms'])} / {fmt(r['itl_p99_ms'])} | "
                     f"{fmt(r['tpot_p50_ms'])} | {fmt(r.get('acceptance_length'), 2)} | "
                     f"{fmt(r.get('speculated_share'), 2)} | "
                     f"{fmt(r.get('host_us_per_token'), 2)} | {r['processes']} | {r['failed']} |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    conc = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(conc, [r["output_tokens_per_s"] for r in rows], "o-")
    ax[0].set_title("output tokens/s")
    for p in (50, 90, 99):
        ax[1].plot(conc, [r[f"ttft_p{p}_ms"] or 0 for r in rows], "o-", label=f"p{p}")
        ax[2].plot(conc, [r[f"itl_p{p}_ms"] or 0 for r in rows], "o-", label=f"p{p}")
    ax[1].set_title("TTFT (ms)")
    ax[2].set_title("inter-token latency (ms)")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency")
        a.grid(True, alpha=0.3)
    ax[1].legend()
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="default: the first id of GET /v1/models")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="0 = fixed lengths")
    ap.add_argument("--prompt-kind", choices=["words", "tokens"], default="words")
    ap.add_argument("--token-low", type=int, default=10)
    ap.add_argument("--token-high", type=int, default=1000)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let EOS end outputs early (by default outputs run to their length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra-body", type=json.loads, default={},
                    help='JSON object merged into every request, e.g. \'{"presence_penalty": 0.5}\'')
    ap.add_argument("--processes", type=int, default=1,
                    help="client processes per level (streams and requests split evenly; one merged report)")
    ap.add_argument("--no-plot", action="store_true", help="skip bench.png (no matplotlib needed)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--workload", help="JSON lines {set, prompt, max_tokens} instead of random prompts")
    ap.add_argument("--workload-set", help="only the prompts of this set (e.g. copy, chat)")
    ap.add_argument("--save-text", action="store_true", help="keep every request's output text in bench.json")
    args = ap.parse_args()
    if args.prompt_kind == "tokens" and args.endpoint == "chat":
        ap.error("--prompt-kind tokens needs --endpoint completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if not args.model:
        args.model = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    reqs = make_requests(args)
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        row = level(args, c, reqs)
        rows.append(row)
        print(f"concurrency {c}: {row['requests_per_s']:.2f} req/s, {row['output_tokens_per_s']:.1f} tok/s, "
              f"TTFT p50 {fmt(row['ttft_p50_ms'])} ms, ITL p50/p99 {fmt(row['itl_p50_ms'])}/{fmt(row['itl_p99_ms'])} ms, "
              f"host {fmt(row.get('host_us_per_token'), 2)} us/tok, failed {row['failed']}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"args": vars(args), "results": rows}, f, indent=2)
    md = markdown(rows, args)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    if not args.no_plot:
        plot(rows, os.path.join(args.out, "bench.png"))
    print(md)
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
