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


def test_loadgen_open_loop(tiny, tmp_path):
    """--request-rate: arrivals on a Poisson schedule (20 at 50/s take ~0.4 s where the closed
    loop needs a few tens of ms), onto at most `concurrency` streams; with one stream and
    arrivals far faster than it serves, requests wait in the client."""
    p, doc = loadgen(tiny, tmp_path, "--concurrency", "4", "--num-prompts", "20", "--input-len", "8",
                     "--output-len", "6", "--token-range", "5,900", "--request-rate", "50", "--seed", "7")
    assert p.returncode == 0, p.stdout + p.stderr
    r = doc["results"][0]
    assert (r["requests"], r["failed"], r["output_tokens"]) == (20, 0, 120), r
    assert r["request_rate"] == 50 and r["wall_s"] > 0.15
    assert r["queue_wait_p50_ms"] is not None
    p, doc = loadgen(tiny, tmp_path, "--concurrency", "1", "--num-prompts", "20", "--input-len", "8",
                     "--output-len", "6", "--token-range", "5,900", "--request-rate", "5000", "--seed", "8")
    assert p.returncode == 0, p.stdout + p.stderr
    r = doc["results"][0]
    assert (r["requests"], r["failed"], r["output_tokens"]) == (20, 0, 120), r
    assert r["queue_wait_p99_ms"] > 1


def test_loadgen_usage_errors(tmp_path):
    for bad in (["--concurrency", "0"], ["--url", "ftp://x"], ["--endpoint", "embeddings"], ["--threads", "0"],
                ["--request-rate", "-1"]):
        p = subprocess.run([BIN, "loadgen", *bad], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, (bad, p.stdout, p.stderr)
    p = subprocess.run([BIN, "loadgen", "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "--concurrency" in p.stdout
    assert "loadgen" in subprocess.run([BIN, "--help"], capture_output=True, text=True).stdout


class _OtherServer:
    """A stand-in for another OpenAI-compatible server's framing: SSE lines ending in CRLF,
    `data:` without a space, the body cut into 7-byte chunks (events and even the chunk
    framing's lines split across reads), and every third response closing its connection."""

    def __init__(self):
        import http.server
        import threading

        outer = self
        self.requests = 0

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                body = b'{"object":"list","data":[{"id":"other-model","object":"model"}]}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests += 1
                close = outer.requests % 3 == 0
                n = req["max_tokens"]
                events = []
                for i in range(n):
                    events.append({"choices": [{"index": 0, "text": f"w{i} ", "finish_reason": None}]})
                events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
                body = b"".join(b"data:" + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b"data: [DONE]\r\n\r\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                if close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                for i in range(0, len(body), 7):
                    part = body[i:i + 7]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_loadgen_parses_other_servers_streams(tmp_path):
    srv = _OtherServer()
    try:
        p, doc = loadgen(srv, tmp_path, "--concurrency", "3", "--num-prompts", "9", "--output-len", "5",
                         "--threads", "2")
    finally:
        srv.httpd.shutdown()
    assert p.returncode == 0, p.stdout + p.stderr
    assert doc["model"] == "other-model"
    r = doc["results"][0]
    assert (r["requests"], r["failed"], r["output_tokens"]) == (9, 0, 45), r
    assert srv.requests == 9
    assert r["itl_p50_ms"] is not None and r["ttft_p50_ms"] > 0
    assert "host_us_per_token" not in r   # not specd: no /metrics
