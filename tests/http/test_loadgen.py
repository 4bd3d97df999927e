"""`specd loadgen`, the C load generator (issue #14 point 5), against a real server: every
request and every generated token counted (the server's own counters agree), the
latency percentiles present, both endpoints, and failures reported as failures (exit 1)."""
import json
import os
import subprocess

from conftest import BIN


def loadgen(srv, tmp_path, *args):
    out = tmp_path / "lg.json"
    p = subprocess.run([BIN, "loadgen", "--url", srv.url, "--out", str(out), *args],
                       capture_output=True, text=True, timeout=300)
    return p, (json.loads(out.read_text()) if out.exists() else None)


def test_loadgen_counts_every_request_and_token(tiny, tmp_path):
    before = tiny.metric("generation_tokens_total")
    p, doc = loadgen(tiny, tmp_path, "--concurrency", "1,8", "--num-prompts", "16", "--input-len", "12",
                     "--output-len", "10", "--token-range", "5,900", "--threads", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = doc["results"]
    assert [r["concurrency"] for r in rows] == [1, 8]
    for r in rows:
        assert (r["requests"], r["failed"], r["output_tokens"]) == (16, 0, 160), r
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["host_us_per_token"] > 0
    assert rows[1]["threads"] == 2 and rows[0]["threads"] == 1
    # the server generated exactly what the client counted
    assert tiny.metric("generation_tokens_total") - before == 320
    assert "| 8 | 2 | 16 | 0 |" in p.stdout


def test_loadgen_chat_with_words(smol, tmp_path):
    p, doc = loadgen(smol, tmp_path, "--endpoint", "chat", "--concurrency", "4", "--num-prompts", "8",
                     "--input-len", "20", "--output-len", "8")
    assert p.returncode == 0, p.stdout + p.stderr
    r = doc["results"][0]
    assert (r["requests"], r["failed"], r["output_tokens"]) == (8, 0, 64), r
    assert r["ttft_p50_ms"] > 0
    assert doc["endpoint"] == "chat" and doc["model"]


def test_loadgen_reports_failed_requests(tiny, tmp_path):
    p, doc = loadgen(tiny, tmp_path, "--model", "no-such-model", "--concurrency", "2", "--num-prompts", "4")
    assert p.returncode == 1
    r = doc["results"][0]
    assert (r["requests"], r["failed"], r["output_tokens"]) == (4, 4, 0)
    assert "HTTP 404" in r["first_error"]
    # a prompt over the context limit: 400, counted as failed, the server keeps serving
    p, doc = loadgen(tiny, tmp_path, "--concurrency", "2", "--num-prompts", "2", "--input-len", "5000")
    assert p.returncode == 1 and "HTTP 400" in doc["results"][0]["first_error"]
    p, doc = loadgen(tiny, tmp_path, "--concurrency", "2", "--num-prompts", "2", "--output-len", "3")
    assert p.returncode == 0 and doc["results"][0]["output_tokens"] == 6


def test_loadgen_usage_errors(tmp_path):
    for bad in (["--concurrency", "0"], ["--url", "ftp://x"], ["--endpoint", "embeddings"], ["--threads", "0"]):
        p = subprocess.run([BIN, "loadgen", *bad], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, (bad, p.stdout, p.stderr)
    p = subprocess.run([BIN, "loadgen", "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "--concurrency" in p.stdout
    assert "loadgen" in subprocess.run([BIN, "--help"], capture_output=True, text=True).stdout
