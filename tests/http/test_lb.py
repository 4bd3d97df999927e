"""A real load balancer in front: HAProxy (Debian package, installed by scripts/setup.sh)
with docs/haproxy.cfg before two `specd serve` replicas (CPU runner, llama-tiny), each
with its own served model name so a chunk tells which replica produced it. Streams pass
through token by token; SIGTERM on one replica (with --drain-grace) under load fails no
request (/ready turns 503 at once while it still serves, the proxy's check takes it out,
then it drains and exits 0); SIGKILL on one
replica mid-stream fails only that replica's streams, and new requests go to the other."""
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import requests

from conftest import REPO, TINY, free_port

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


class Proxy:
    def __init__(self, a, b):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, LB_BIND=f"127.0.0.1:{self.port}", SPECD_A=f"127.0.0.1:{a.port}",
                   SPECD_B=f"127.0.0.1:{b.port}")
        self.log_path = f"/tmp/specd-haproxy-{self.port}.log"
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", os.path.join(REPO, "docs", "haproxy.cfg")], env=env,
                                     stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def cluster(server_factory):
    if not os.path.exists(HAPROXY):
        pytest.fail("haproxy is not installed (scripts/setup.sh installs it)")
    a = server_factory(TINY, "--served-model-name", "replica-a", "--max-seq-len", "8192", "--drain-timeout", "30",
                       "--drain-grace", "1.5", name="lb-a")
    b = server_factory(TINY, "--served-model-name", "replica-b", "--max-seq-len", "8192", name="lb-b")
    p = Proxy(a, b)
    # up when both replicas have answered through it
    seen, deadline = set(), time.time() + 30
    while seen != {"replica-a", "replica-b"} and time.time() < deadline:
        r = stream(p, 2)
        if r["model"]:
            seen.add(r["model"])
        else:
            time.sleep(0.1)   # the proxy is still starting
    assert seen == {"replica-a", "replica-b"}, seen
    yield a, b, p
    p.stop()


def stream(p, n_tokens, timeout=60, out=None):
    """One streamed completion through the proxy: model (replica), tokens, [DONE] seen,
    arrival time of every event, and an error text if the stream broke. With out (a dict),
    filled in as the events arrive, so another thread can watch the stream's progress."""
    if out is None:
        out = {}
    out.update({"model": None, "tokens": 0, "done": False, "times": [], "error": None})
    t0 = time.time()
    try:
        with requests.post(p.url + "/v1/completions", stream=True, timeout=timeout,
                           json={"prompt": [1, 2, 3, 4], "max_tokens": n_tokens, "ignore_eos": True,
                                 "stream": True, "logprobs": 0}) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                out["times"].append(time.time() - t0)
                if line == b"data: [DONE]":
                    out["done"] = True
                    continue
                c = json.loads(line[6:])
                out["model"] = c["model"]
                if c["choices"] and c["choices"][0].get("logprobs"):
                    out["tokens"] += len(c["choices"][0]["logprobs"]["tokens"])
    except requests.RequestException as e:
        out["error"] = repr(e)
    return out


def ok(r, n):
    return r["error"] is None and r["done"] and r["tokens"] == n


def test_streams_pass_through_token_by_token(cluster):
    a, b, p = cluster
    r = stream(p, 1500)
    assert ok(r, 1500), r["error"]
    times = r["times"]
    # events arrive spread over the stream, not in one burst at its end
    assert len(times) > 1000
    assert times[len(times) // 2] - times[0] > 0.25 * (times[-1] - times[0]) > 0


def test_sigterm_drains_one_replica_under_load_with_no_failed_request(cluster):
    a, b, p = cluster
    results, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            results.append((time.time(), stream(p, 40)))

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    t_term = time.time()
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(30) == 0
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(60)
    failed = [r for _, r in results if not ok(r, 40)]
    print(f"drain under load: {len(results)} streams, {len(failed)} failed; before SIGTERM "
          f"a={sum(r['model'] == 'replica-a' for t, r in results if t < t_term)} "
          f"b={sum(r['model'] == 'replica-b' for t, r in results if t < t_term)}; after "
          f"a={sum(r['model'] == 'replica-a' for t, r in results if t >= t_term)} "
          f"b={sum(r['model'] == 'replica-b' for t, r in results if t >= t_term)}")
    assert not failed, [(r["error"], r["model"], r["tokens"]) for r in failed[:5]]
    before = {r["model"] for t, r in results if t < t_term}
    after = {r["model"] for t, r in results if t > t_term + 1.0}
    assert before == {"replica-a", "replica-b"}, before
    assert after == {"replica-b"}, after
    assert len(results) > 40


def test_sigkill_fails_only_that_replicas_streams(cluster):
    a, b, p = cluster
    got = [{"model": None} for _ in range(6)]
    threads = [threading.Thread(target=stream, args=(p, 6000), kwargs={"out": got[i]}) for i in range(6)]
    for t in threads:
        t.start()
    # wait until streams of both replicas have reached their clients (a request that is
    # running may not have sent its first chunk yet: killed then, its client never learns
    # which replica had it)
    deadline = time.time() + 20
    while time.time() < deadline:
        seen = {o["model"] for o in got}
        if "replica-a" in seen and "replica-b" in seen:
            break
        time.sleep(0.02)
    b.proc.kill()
    for t in threads:
        t.join(120)
    on_a = [r for r in got if r["model"] == "replica-a"]
    on_b = [r for r in got if r["model"] == "replica-b"]
    assert on_a and on_b, [r["model"] for r in got]
    print(f"kill: {len(on_a)} streams on a completed {[r['tokens'] for r in on_a]}, {len(on_b)} on b cut at "
          f"{[r['tokens'] for r in on_b]} tokens ({[r['error'] for r in on_b][:1]})")
    assert all(ok(r, 6000) for r in on_a), [r["error"] for r in on_a]
    assert all(not r["done"] for r in on_b)     # cut: the client can tell it is incomplete
    after = [stream(p, 5) for _ in range(10)]
    assert all(ok(r, 5) and r["model"] == "replica-a" for r in after), after
