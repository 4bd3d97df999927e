"""HF transformers baseline for tests/gpu/bench_decode.c: the same workloads (random bf16
weights of the Llama-3.1-8B and Llama-3.2-1B shapes, static KV cache, greedy) in the same
device session, then a table of specd / HF ratios when given bench_decode's JSON lines.

  python3 tests/gpu/bench_hf.py [--specd bench_specd.jsonl] [--shapes a,b]

Decode time per step = (generate(N) - generate(1)) / (N - 1), which removes the prefill;
prefill = one forward over a 4096-token prompt (best of 3 after a warm-up).
"""
import argparse, json, sys, time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         tie_word_embeddings=False, factor=8.0),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         tie_word_embeddings=True, factor=32.0),
}
CTX = 512


def build(name):
    s = dict(SHAPES[name])
    factor = s.pop("factor")
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=factor, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)
    try:
        cfg = AutoConfig.for_model("llama", vocab_size=128256, rms_norm_eps=1e-5,
                                   max_position_embeddings=131072, rope_parameters=rope, **s)
    except TypeError:
        cfg = AutoConfig.for_model("llama", vocab_size=128256, rms_norm_eps=1e-5,
                                   max_position_embeddings=131072, **s)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return m.eval()


def timed(fn, reps=1):
    best = 1e30
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def gen(m, ids, n):
    # Eager forward over the static cache: transformers would otherwise torch.compile the
    # step for each new batch size, which is minutes of device time per shape.
    try:
        return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          cache_implementation="static", pad_token_id=0, disable_compile=True)
    except (TypeError, ValueError):
        return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          cache_implementation="static", pad_token_id=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specd", default=None)
    ap.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b")
    args = ap.parse_args()
    res = []
    print(json.dumps({"hf": True, "torch": torch.__version__, "device": torch.cuda.get_device_name()}), flush=True)
    for name in args.shapes.split(","):
        m = build(name)
        V = m.config.vocab_size
        with torch.no_grad():
            for b, n in ((1, 65), (8, 17), (32, 17), (64, 17), (128, 17), (256, 17)):
                ids = torch.randint(0, V, (b, CTX), device="cuda")
                gen(m, ids, 2)                         # warm-up (cache allocation)
                gen(m, ids, n)
                t1 = timed(lambda: gen(m, ids, 1))
                tn = timed(lambda: gen(m, ids, n))
                step = (tn - t1) / (n - 1)
                r = {"shape": name, "bench": "decode_tps", "batch": b, "ctx": CTX,
                     "tokens_per_s": b / step, "ms_per_step": step * 1e3}
                if b == 1:
                    res.append({"shape": name, "bench": "decode_b1", "ms_per_token": step * 1e3})
                    print(json.dumps(res[-1]), flush=True)
                res.append(r)
                print(json.dumps(r), flush=True)
                torch.cuda.empty_cache()
            ids = torch.randint(0, V, (1, 4096), device="cuda")
            m(ids, use_cache=False, logits_to_keep=1)
            t = timed(lambda: m(ids, use_cache=False, logits_to_keep=1), reps=3)
            res.append({"shape": name, "bench": "prefill", "tokens": 4096, "tokens_per_s": 4096 / t, "ms": t * 1e3})
            print(json.dumps(res[-1]), flush=True)
        del m
        torch.cuda.empty_cache()
    if args.specd:
        sp = [json.loads(l) for l in open(args.specd) if l.startswith("{")]
        def find(rows, r):
            for x in rows:
                if x.get("shape") == r["shape"] and x.get("bench") == r["bench"] and x.get("batch") == r.get("batch"):
                    return x
        print("\nshape          bench        batch     specd        HF    specd/HF")
        for r in res:
            s = find(sp, r)
            if not s:
                continue
            key = "ms_per_token" if r["bench"] == "decode_b1" else "tokens_per_s"
            ratio = r[key] / s[key] if key == "ms_per_token" else s[key] / r[key]
            unit = "ms/tok" if key == "ms_per_token" else "tok/s"
            print(f"{r['shape']:<14} {r['bench']:<12} {str(r.get('batch', '')):>5} {s[key]:>9.2f} {r[key]:>9.2f}  {ratio:6.2f}x  ({unit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
