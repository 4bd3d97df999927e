"""Concurrency, cancellation and shutdown: 64 concurrent streams, abandoned streams free
their KV at once, SIGTERM drains."""
import json
import signal
import socket
import threading
import time

import requests

from conftest import TINY, concurrently, sse_events

PROMPTS = [[(7 * i + j) % 1000 + 1 for j in range(3 + i % 11)] for i in range(64)]


def stream_ids(srv, prompt, n_tokens):
    r = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "logprobs": 0,
                                     "ignore_eos": True, "stream": True}, timeout=300)
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert events[-1] == "[DONE]"
    ids, finish = [], None
    for e in events[:-1]:
        c = json.loads(e)["choices"][0]
        if c["logprobs"]:
            ids += [int(t.split(":")[1]) for t in c["logprobs"]["tokens"]]
        finish = c["finish_reason"] or finish
    assert finish == "length"
    return ids


def test_64_concurrent_streams_match_solo_greedy(tiny):
    solo = [stream_ids(tiny, p, 24) for p in PROMPTS]
    got = concurrently(lambda p: stream_ids(tiny, p, 24), PROMPTS, timeout=300)
    assert all(len(g) == 24 for g in got)
    assert got == solo


def open_and_abandon(srv, prompt):
    """Start a stream, read its first bytes, then drop the connection."""
    body = json.dumps({"prompt": prompt, "max_tokens": 900, "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    s.settimeout(30)
    data = b""
    while b"data: " not in data:
        chunk = s.recv(4096)
        assert chunk, "server closed the stream early"
        data += chunk
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    s.close()


def wait_for(pred, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_50_abandoned_streams_free_kv(server_factory):
    srv = server_factory(TINY, "--max-seq-len", "1024", name="abandon")
    base = srv.metric("kv_blocks_used")
    assert srv.metric("num_requests_running") == 0
    for i in range(50):
        open_and_abandon(srv, [i + 1, i + 2, i + 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])
    # Each stream would run for 900 tokens; cancellation must end them well before that.
    assert wait_for(lambda: srv.metric("num_requests_running") == 0 and srv.metric("num_requests_waiting") == 0)
    assert wait_for(lambda: srv.metric("kv_blocks_used") == base), (base, srv.metric("kv_blocks_used"))
    text = requests.get(srv.url + "/metrics").text
    aborted = [l for l in text.splitlines() if 'finished_reason="abort"' in l]
    assert float(aborted[0].rsplit(" ", 1)[1]) == 50
    gen = srv.metric("generation_tokens_total")
    assert gen < 50 * 900 / 2, gen
    r = srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200


def test_sigterm_drains_in_flight_then_exits_zero(server_factory):
    srv = server_factory(TINY, "--max-seq-len", "8192", "--drain-timeout", "60", name="drain")
    result = {}

    def long_stream():
        r = srv.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True,
                                         "stream": True, "temperature": 0}, timeout=120)
        result["status"] = r.status_code
        result["events"] = sse_events(r.content)

    t = threading.Thread(target=long_stream)
    t.start()
    assert wait_for(lambda: srv.metric("num_requests_running") == 1, 10)
    srv.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: requests.get(srv.url + "/ready").status_code == 503, 5)
    r = srv.post("/v1/completions", {"prompt": [1], "max_tokens": 1})
    assert r.status_code == 503
    assert r.json()["error"]["message"]
    t.join(120)
    assert result["status"] == 200
    assert result["events"][-1] == "[DONE]"
    last = json.loads(result["events"][-2])
    assert last["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(30) == 0


def test_drain_timeout_ends_stragglers_and_second_signal_exits_now(server_factory):
    srv = server_factory(TINY, "--max-seq-len", "60000", "--drain-timeout", "0.5", name="drain2")
    result = {}

    def long_stream():
        r = srv.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 50000, "ignore_eos": True,
                                         "stream": True}, timeout=120)
        result["events"] = sse_events(r.content)

    t = threading.Thread(target=long_stream)
    t.start()
    assert wait_for(lambda: srv.metric("num_requests_running") == 1, 10)
    t0 = time.time()
    srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert result["events"][-1] == "[DONE]"
    assert "error" in json.loads(result["events"][-2])
    assert srv.proc.wait(30) == 0
    assert time.time() - t0 < 10

    srv2 = server_factory(TINY, "--max-seq-len", "60000", "--drain-timeout", "600", name="drain3")
    def doomed():
        try:
            srv2.post("/v1/completions", {"prompt": [1], "max_tokens": 50000, "ignore_eos": True, "stream": True},
                      timeout=120)
        except requests.RequestException:
            pass  # the process exits under it: that is the point

    t = threading.Thread(target=doomed)
    t.start()
    assert wait_for(lambda: srv2.metric("num_requests_running") == 1, 10)
    srv2.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert srv2.proc.poll() is None  # still draining
    srv2.proc.send_signal(signal.SIGTERM)
    assert srv2.proc.wait(10) == 1
    t.join(30)


def test_abandoned_non_streaming_and_queued_requests_are_cancelled(server_factory):
    srv = server_factory(TINY, "--max-seq-len", "60000", "--max-batch", "2", name="abandon2")
    base = srv.metric("kv_blocks_used")
    socks = []
    for i in range(6):  # 2 run, 4 wait in the queue; none would finish for a long time
        body = json.dumps({"prompt": [i + 1, 2, 3], "max_tokens": 50000, "ignore_eos": True,
                           "stream": i % 2 == 0}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        socks.append(s)
    assert wait_for(lambda: srv.metric("num_requests_running") == 2 and srv.metric("num_requests_waiting") == 4, 10)
    for s in socks:
        s.close()
    assert wait_for(lambda: srv.metric("num_requests_running") == 0 and srv.metric("num_requests_waiting") == 0, 5)
    assert wait_for(lambda: srv.metric("kv_blocks_used") == base, 5)
    text = requests.get(srv.url + "/metrics").text
    aborted = [l for l in text.splitlines() if 'finished_reason="abort"' in l]
    assert float(aborted[0].rsplit(" ", 1)[1]) == 6
    assert srv.post("/v1/completions", {"prompt": [1], "max_tokens": 2}).status_code == 200
