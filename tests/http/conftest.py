"""Black-box HTTP tests of `specd serve`: fixtures that start a real server.

Environment:
  SPECD_BIN       the binary (default: <repo>/build/specd)
  SPECD_FIXTURES  test fixtures (default: <repo>/../shared/fixtures)
  SPECD_TEST_MODEL     the text model (default: <repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf);
                  tests that need it are skipped, saying so, only when the file is absent.
  SPECD_TEST_DEVICE    the servers' --device (default cpu; cuda runs a test file on a GPU).
"""
import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SPECD_BIN", os.path.join(REPO, "build", "specd"))
FIXTURES = os.path.abspath(os.environ.get("SPECD_FIXTURES", os.path.join(REPO, "..", "shared", "fixtures")))
TINY = os.path.join(FIXTURES, "models", "llama-tiny")
SMOL = os.environ.get("SPECD_TEST_MODEL", os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
DEVICE = os.environ.get("SPECD_TEST_DEVICE", "cpu")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `specd serve` process on a free loopback port."""

    def __init__(self, model, *extra, env=None, name="srv"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/specd-http-{name}-{self.port}.log"
        self.log = open(self.log_path, "wb")
        args = [BIN, "serve", "--model", model, "--port", str(self.port), "--device", DEVICE,
                "--max-seq-len", "1024", "--max-batch", "64", "--threads", "2", *extra]
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self.wait_ready()

    def wait_ready(self, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specd exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if requests.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise RuntimeError("specd not ready in time:\n" + self.log_text())

    def log_text(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def post(self, path, body=None, raw=None, headers=None, timeout=60):
        data = raw if raw is not None else json.dumps(body)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        return requests.post(self.url + path, data=data, headers=h, timeout=timeout)

    def metric(self, name):
        """Value of an unlabelled-by-reason metric line `specd:<name>{model_name=...} v`."""
        text = requests.get(self.url + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("specd:" + name + "{") and "finished_reason" not in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def _need_binary():
    if not os.path.exists(BIN):
        pytest.fail(f"{BIN} does not exist: build it first (make)")


@pytest.fixture(scope="session")
def tiny():
    """llama-tiny (vocab 1024, no tokenizer): token-id prompts only."""
    _need_binary()
    s = Server(TINY, name="tiny")
    yield s
    assert s.stop() == 0, s.log_text()


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct GGUF: tokenizer and chat template from its metadata."""
    _need_binary()
    if not os.path.exists(SMOL):
        pytest.skip(f"SKIPPED because the text model {SMOL} is absent (run scripts/fetch-model.sh)")
    s = Server(SMOL, name="smol")
    yield s
    assert s.stop() == 0, s.log_text()


@pytest.fixture
def server_factory():
    """Start extra servers with custom flags; stopped at the end of the test."""
    _need_binary()
    started = []

    def make(model=TINY, *extra, **kw):
        s = Server(model, *extra, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop(signal.SIGKILL) if s.proc.poll() is None else s.log.close()


def sse_events(raw: bytes):
    """Split a raw SSE body into the payloads of its `data:` events, checking framing."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-80:]!r}"
    out = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"bad SSE event {block!r}"
        assert "\n" not in block, f"multi-line SSE event {block!r}"
        out.append(block[len("data: "):])
    return out


def concurrently(fn, items, timeout=600):
    """fn(item) for every item, each on its own thread; results in order; fails with the
    first errors if any call raised."""
    got, errors = [None] * len(items), []

    def run(i):
        try:
            got[i] = fn(items[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors[:3]
    return got
