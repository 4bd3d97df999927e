"""`specd serve` configuration from the outside: --print-config, precedence, errors."""
import json
import os
import subprocess

from conftest import BIN, TINY


def run(*args, env=None, input=None):
    e = dict(os.environ)
    for k in list(e):
        if k.startswith("SPECD_") and k not in ("SPECD_BIN", "SPECD_FIXTURES", "SPECD_TEST_MODEL"):
            del e[k]
    e.update(env or {})
    return subprocess.run([BIN, "serve", *args], capture_output=True, text=True, env=e, timeout=30)


def test_print_config_precedence(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"port": 1111, "max_batch": 3, "max_seq_len": 512, "api_keys": ["f"]}))
    r = run("--config", str(cfg), "--port", "3333", "--print-config", env={"SPECD_PORT": "2222", "SPECD_MAX_BATCH": "5"})
    assert r.returncode == 0, r.stderr
    eff = json.loads(r.stdout)
    assert eff["port"] == 3333 and eff["max_batch"] == 5 and eff["max_seq_len"] == 512
    assert eff["api_keys"] == ["<redacted>"]
    assert eff["host"] == "127.0.0.1"


def test_config_errors_exit_2(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"port": 1, "no_such_key": 2}))
    r = run("--config", str(cfg), "--model", TINY)
    assert r.returncode == 2 and "no_such_key" in r.stderr
    assert run("--model", TINY, "--port", "http").returncode == 2
    assert run("--bogus").returncode == 2
    assert run().returncode == 2  # no model
    r = run("--model", TINY, "--dtype", "int3")
    assert r.returncode == 2 and "dtype must be auto, bf16, gguf or fp8" in r.stderr
    assert run("--help").returncode == 0


def test_dtype_reaches_the_config(tmp_path):
    assert json.loads(run("--model", TINY, "--print-config").stdout)["dtype"] == "auto"
    r = run("--model", TINY, "--dtype", "gguf", "--print-config")
    assert r.returncode == 0 and json.loads(r.stdout)["dtype"] == "gguf"
    r = subprocess.run([BIN, "generate", "--model", TINY, "--dtype", "fp4", "--prompt-ids", "1,2"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "bad value for --dtype" in r.stderr


def test_fp8_flags(tmp_path):
    # --dtype fp8 and vLLM's spelling --quantization fp8 set the same key; other values fail
    for flag in ("--dtype", "--quantization"):
        r = run("--model", TINY, flag, "fp8", "--print-config")
        assert r.returncode == 0 and json.loads(r.stdout)["dtype"] == "fp8"
    r = run("--model", TINY, "--quantization", "awq")
    assert r.returncode == 2 and "dtype must be auto, bf16, gguf or fp8" in r.stderr
    # the CPU runner serves it: its weights rounded per row as FP8 holds them
    r = subprocess.run([BIN, "generate", "--model", TINY, "--quantization", "fp8", "--prompt-ids", "1,2,3",
                        "--max-tokens", "4", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r8 = subprocess.run([BIN, "generate", "--model", TINY, "--prompt-ids", "1,2,3", "--max-tokens", "4",
                         "--json", "--logits"], capture_output=True, text=True, timeout=60)
    rq = subprocess.run([BIN, "generate", "--model", TINY, "--dtype", "fp8", "--prompt-ids", "1,2,3",
                         "--max-tokens", "4", "--json", "--logits"], capture_output=True, text=True, timeout=60)
    assert r8.returncode == 0 and rq.returncode == 0
    l16, l8 = json.loads(r8.stdout)["last_logits"], json.loads(rq.stdout)["last_logits"]
    assert len(l16) == len(l8) and l16 != l8   # the rounding reaches the logits
    assert max(abs(a - b) for a, b in zip(l16, l8)) < 0.25 * max(abs(a) for a in l16)


def test_kv_cache_dtype_flag(tmp_path):
    # --kv-cache-dtype fp8 (or vLLM's fp8_e4m3) reaches the config and the runner; others fail
    for v in ("fp8", "fp8_e4m3"):
        r = run("--model", TINY, "--kv-cache-dtype", v, "--print-config")
        assert r.returncode == 0 and json.loads(r.stdout)["kv_cache_dtype"] == v
    r = run("--model", TINY, "--kv-cache-dtype", "int4")
    assert r.returncode == 2 and "kv_cache_dtype must be auto, bf16, fp8 or fp8_e4m3" in r.stderr
    out = {}
    for kv in ("auto", "fp8"):
        r = subprocess.run([BIN, "generate", "--model", TINY, "--kv-cache-dtype", kv, "--prompt-ids", "1,2,3,4,5,6",
                            "--max-tokens", "4", "--json", "--logits"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[kv] = json.loads(r.stdout)["last_logits"]
    assert out["auto"] != out["fp8"]   # the cache's rounding reaches the logits, by a bounded amount
    assert max(abs(a - b) for a, b in zip(out["auto"], out["fp8"])) < 0.25 * max(abs(a) for a in out["auto"])


def test_example_config_file_loads(tmp_path):
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    r = run("--config", os.path.join(repo, "config", "specd.json"), "--print-config")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["port"] == 8000


def test_json_logs_one_line_per_request(server_factory):
    srv = server_factory(TINY, "--log-json", name="jsonlog")
    srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
    srv.stop()
    raw = [l for l in srv.log_text().splitlines() if l.strip()]
    lines = [json.loads(l) for l in raw]  # every line is JSON, engine start-up included
    reqs = [l for l in lines if l.get("msg") == "request"]
    assert len(reqs) == 1
    assert reqs[0]["status"] == 200 and reqs[0]["prompt_tokens"] == 2 and reqs[0]["output_tokens"] == 2
    assert reqs[0]["id"].startswith("cmpl-") and reqs[0]["ttft_s"] >= 0


def test_served_model_name_and_body_limit_flags(server_factory):
    import requests
    srv = server_factory(TINY, "--served-model-name", "team/tiny-v1", "--max-body-bytes", "2048", name="named")
    assert requests.get(srv.url + "/v1/models").json()["data"][0]["id"] == "team/tiny-v1"
    assert srv.post("/v1/completions", {"model": "team/tiny-v1", "prompt": [1], "max_tokens": 1}).status_code == 200
    r = srv.post("/v1/completions", {"model": "llama-tiny", "prompt": [1], "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert srv.post("/v1/completions", {"prompt": [1] * 300, "max_tokens": 1}).status_code == 200  # < 2 KiB
    assert srv.post("/v1/completions", {"prompt": [1] * 700, "max_tokens": 1}).status_code == 413  # > 2 KiB
    assert 'model_name="team/tiny-v1"' in requests.get(srv.url + "/metrics").text


def test_bench_sampling_options():
    # `specd bench` measures sampled decoding and logprobs too (greedy by default)
    def bench(*a):
        return subprocess.run([BIN, "bench", "--model", TINY, "--batch", "2", "--prompt-len", "8", "--gen", "8",
                               "--json", *a], capture_output=True, text=True, timeout=120)
    for args, want in (((), (0, 1, 0, -1)),
                       (("--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--top-logprobs", "2"),
                        (0.8, 0.9, 40, 2))):
        r = bench(*args)
        assert r.returncode == 0, r.stderr
        row = json.loads(r.stdout.splitlines()[-1])
        assert (row["temperature"], row["top_p"], row["top_k"], row["top_logprobs"]) == want
        assert row["decode_tok_s"] > 0 and row["batch"] == 2
    for bad in (("--top-p", "0"), ("--top-logprobs", "21"), ("--temperature", "-1"), ("--warmup", "-1"),
                ("--gen", "2")):
        r = bench(*bad)
        assert r.returncode == 2 and "bad value" in r.stderr


def test_bench_runs_do_not_share_prompts():
    # every run (the warm-ups included) has prompts of its own: none is served from the
    # prefix cache an earlier run filled, which would inflate its prefill figure
    for warm in ("0", "1"):
        r = subprocess.run([BIN, "bench", "--model", TINY, "--batch", "1,2,2", "--prompt-len", "40", "--gen", "4",
                            "--warmup", warm, "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
        assert [row["batch"] for row in rows] == [1, 2, 2]
        assert [row["prefix_cache_hit_tokens"] for row in rows] == [0, 0, 0]
