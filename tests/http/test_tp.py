"""Tensor parallelism through `specd serve --tensor-parallel-size 2` (CPU runner): rank 0
serves HTTP and starts its worker rank itself; greedy output equals the single-process
server's; a worker killed mid-stream gives the client an error event and makes the server
exit non-zero, promptly, leaving no process behind."""
import json
import os
import signal
import subprocess
import time

import requests

from conftest import TINY, Server, free_port

BODY = {"prompt": [[5, 17, 200, 3, 999, 45], [1, 2, 3, 4, 5, 6, 7, 8]], "max_tokens": 24,
        "temperature": 0, "ignore_eos": True, "logprobs": 1}


def tokens(srv):
    r = srv.post("/v1/completions", BODY)
    assert r.status_code == 200, r.text
    return [c["logprobs"]["tokens"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def children_of(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def start_stream(srv):
    """The server's one worker and the lines of a long stream that has started."""
    workers = children_of(srv.proc.pid)
    assert len(workers) == 1
    r = requests.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 900,
                      "ignore_eos": True, "temperature": 0, "stream": True}, stream=True, timeout=60)
    assert r.status_code == 200
    lines = r.iter_lines()
    first = next(l for l in lines if l)                 # the stream is running
    assert first.startswith(b"data: {")
    return workers, lines


def test_tp2_serves_the_same_tokens_as_tp1(server_factory):
    one = server_factory(TINY, name="tp1")
    two = server_factory(TINY, "--tensor-parallel-size", "2", "--master-port", str(free_port()), name="tp2")
    assert len(children_of(two.proc.pid)) == 1          # rank 0 started its worker
    assert len(children_of(one.proc.pid)) == 0
    t1, t2 = tokens(one), tokens(two)
    assert len(t1) == 2 and len(t1[0]) == 24
    assert t1 == t2


def test_tp2_worker_killed_mid_stream(server_factory):
    srv = server_factory(TINY, "--tensor-parallel-size", "2", "--master-port", str(free_port()), name="tpkill")
    workers, lines = start_stream(srv)
    t0 = time.time()
    os.kill(workers[0], signal.SIGKILL)
    events = [l for l in lines if l]
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2][len(b"data: "):])
    assert "error" in err and err["error"]["type"] == "server_error"
    srv.proc.wait(timeout=15)                           # the server leaves by itself
    assert srv.proc.returncode != 0
    assert time.time() - t0 < 15
    assert "tensor parallel" in srv.log_text()


def test_tp2_worker_hung_mid_stream(server_factory):
    # A worker that hangs (SIGSTOP: alive, its socket open, so no watchdog failure): the step
    # fails at the step timeout, the client gets an error event, the server exits non-zero.
    srv = server_factory(TINY, "--tensor-parallel-size", "2", "--master-port", str(free_port()),
                         env={"SPECD_TP_STEP_TIMEOUT_MS": "1500"}, name="tphang")
    workers, lines = start_stream(srv)
    t0 = time.time()
    os.kill(workers[0], signal.SIGSTOP)
    try:
        events = [l for l in lines if l]
        assert events[-1] == b"data: [DONE]"
        err = json.loads(events[-2][len(b"data: "):])
        assert "error" in err and err["error"]["type"] == "server_error"
        srv.proc.wait(timeout=20)
        took = time.time() - t0
        assert srv.proc.returncode != 0
        assert 1.0 < took < 20, took                       # the 1.5 s step timeout, not a hang
        log = srv.log_text()
        assert "timed out" in log or "connection lost" in log
        assert "tensor-parallel group failed: exiting" in log
    finally:
        try:
            os.kill(workers[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
