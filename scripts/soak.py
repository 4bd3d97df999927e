#!/usr/bin/env python3
"""Soak test for `specd serve` on loopback.

Starts the server itself (CPU runner by default), runs a bounded number of concurrent
clients that issue a mix of requests for --minutes:

  complete      POST /v1/completions, non-streaming (token-id prompts, or text when the
                model has a tokenizer)
  stream        POST /v1/completions, stream=true (+ stream_options.include_usage)
  chat          POST /v1/chat/completions, non-streaming   (only with a tokenizer)
  chat_stream   POST /v1/chat/completions, stream=true      (only with a tokenizer)
  cancel        a streaming request the client closes after 1-3 events
  bad           an invalid body (expects a 4xx with an OpenAI error object)

Every response is checked: non-streaming -> 200 with well-formed choices / usage, or a
proper {"error": {...}} body; streaming -> every event is `data: <json>\\n\\n`, finish
reasons arrive, `data: [DONE]` comes last. The server's RSS (VmRSS of /proc/PID/status) and
/metrics are sampled every --sample-s seconds (10). At the end it asserts:

  - RSS flat: after warm-up, the median of the last quarter of samples is within
    max(10 %, 20 MB) of the median of the first quarter;
  - every request ended with a complete response or a proper error (no transport
    errors, truncated streams or malformed bodies);
  - /metrics KV usage is back to 0 and nothing is running / waiting once idle;
  - /health is 200, a last request still succeeds, and the server was alive throughout.

With --proxy the traffic goes through HAProxy (docs/haproxy.cfg) in front of two
replicas, and two more kinds join the mix:

  stall         a stream whose client reads nothing for 3-6 s (a tiny receive buffer),
                then drops the connection (the server pauses it, then frees it)
  slow          a stream read in small pieces with pauses, to its end

RSS is then sampled for both replicas and every check applies to each.

Prints a summary and writes JSON (--json). Exit status 0 when every assertion holds.
Only loopback addresses are used. Python stdlib + requests.

  scripts/soak.py --bin /tmp/specd-soak --minutes 30
  scripts/soak.py --model ../shared/fixtures/models/llama-tiny --minutes 2
  scripts/soak.py --model ../shared/fixtures/models/llama-tiny --proxy --minutes 30
"""
import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import requests

HOST = "127.0.0.1"
DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE_MODEL = os.path.join(os.environ.get("SPECD_FIXTURES", "../shared/fixtures"), "models/llama-tiny")


def free_port():
    s = socket.socket()
    s.bind((HOST, 0))
    p = s.getsockname()[1]
    s.close()
    return p


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(" ", 1)
        if len(parts) != 2:
            continue
        name, val = parts
        try:
            out[name] = float(val)
        except ValueError:
            pass
    return out


def metric(m, name):
    """specd:NAME or specd:NAME{model_name=...} (first match)."""
    for k, v in m.items():
        if k == "specd:" + name or k.startswith("specd:" + name + "{"):
            return v
    return None


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}        # kind -> outcome -> n
        self.latency = {}       # kind -> [s]
        self.failures = []      # first failures, with detail
        self.n_failures = 0
        self.tokens = 0

    def record(self, kind, outcome, secs, ok, detail=None, tokens=0):
        with self.lock:
            self.counts.setdefault(kind, {}).setdefault(outcome, 0)
            self.counts[kind][outcome] += 1
            self.latency.setdefault(kind, []).append(secs)
            self.tokens += tokens
            if not ok:
                self.n_failures += 1
                if len(self.failures) < 50:
                    self.failures.append({"kind": kind, "outcome": outcome, "detail": str(detail)[:500],
                                          "t": time.time()})


def is_error_body(body):
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("message"), str) and isinstance(body["error"].get("type"), str))


def parse_sse(raw):
    """Split a complete SSE body into payloads; raise ValueError on a framing problem."""
    if not raw.endswith(b"\n\n"):
        raise ValueError("stream does not end with a blank line: %r" % raw[-80:])
    events = raw[:-2].split(b"\n\n")
    payloads = []
    for ev in events:
        if not ev.startswith(b"data: "):
            raise ValueError("event without 'data: ': %r" % ev[:80])
        if b"\n" in ev or b"\r" in ev:
            raise ValueError("raw newline inside an event: %r" % ev[:80])
        payloads.append(ev[6:])
    if payloads.count(b"[DONE]") != 1 or payloads[-1] != b"[DONE]":
        raise ValueError("[DONE] not exactly once and last")
    return [json.loads(p) for p in payloads[:-1]]


class Client(threading.Thread):
    def __init__(self, idx, base, deadline, stats, cfg):
        super().__init__(daemon=True)
        self.rng = random.Random(idx * 7919 + 1)
        self.base = base
        self.deadline = deadline
        self.stats = stats
        self.cfg = cfg
        self.sess = requests.Session()

    def prompt(self):
        if self.cfg["chat"] and self.rng.random() < 0.5:
            words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "today"]
            return " ".join(self.rng.choice(words) for _ in range(self.rng.randint(1, 24)))
        n = self.rng.randint(1, 48)
        return [self.rng.randrange(3, self.cfg["vocab_ids"]) for _ in range(n)]

    def sampling(self, body):
        r = self.rng.random()
        if r < 0.4:
            body["temperature"] = 0
        elif r < 0.8:
            body.update(temperature=0.8, top_p=0.95, top_k=40, seed=self.rng.randrange(1 << 30))
        else:
            body.update(temperature=1.0, min_p=0.05)
        if self.rng.random() < 0.2:
            body["stop"] = ["\n\n", "the"]
        if self.rng.random() < 0.15:
            body["n"] = 2
        if self.rng.random() < 0.1:
            body["logprobs"] = 2 if "prompt" in body else True
        return body

    def run(self):
        kinds = ["complete", "stream", "cancel", "bad"]
        weights = [3, 3, 2, 0.5]
        if self.cfg.get("proxy"):
            kinds += ["stall", "slow"]
            weights += [0.3, 0.5]
        if self.cfg["chat"]:
            kinds += ["chat", "chat_stream"]
            weights += [2, 2]
        while time.time() < self.deadline:
            kind = self.rng.choices(kinds, weights)[0]
            t0 = time.time()
            try:
                outcome, ok, detail, toks = getattr(self, "do_" + kind)()
            except requests.RequestException as e:
                outcome, ok, detail, toks = "transport_error", False, repr(e), 0
            except Exception as e:  # malformed JSON etc.
                outcome, ok, detail, toks = "malformed", False, repr(e), 0
            self.stats.record(kind, outcome, time.time() - t0, ok, detail, toks)

    # ---- request kinds -----------------------------------------------------------------

    def completion_body(self, stream):
        body = {"model": self.cfg["model_name"], "prompt": self.prompt(),
                "max_tokens": self.rng.randint(1, self.cfg["max_tokens"])}
        if stream:
            body["stream"] = True
            if self.rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        return self.sampling(body)

    def chat_body(self, stream):
        msgs = [{"role": "user", "content": self.prompt() if False else
                 "Say something about %s." % self.rng.choice(["cats", "rain", "trains", "tea", "C"])}]
        if self.rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "You are brief."})
        body = {"model": self.cfg["model_name"], "messages": msgs,
                "max_tokens": self.rng.randint(1, self.cfg["max_tokens"])}
        if stream:
            body["stream"] = True
            if self.rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        body = self.sampling(body)
        if body.get("logprobs") is True:
            body["top_logprobs"] = 2
        elif "logprobs" in body:
            body["logprobs"] = True
        return body

    def check_whole(self, r, body, chat):
        if r.status_code != 200:
            j = r.json()
            if is_error_body(j):
                return ("error_%d" % r.status_code, r.status_code in (429, 503), j["error"]["message"], 0)
            return ("bad_error_body", False, r.text[:200], 0)
        j = r.json()
        n = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                                and body["prompt"] and isinstance(body["prompt"][0], list) else 1)
        ch = j.get("choices")
        if not isinstance(ch, list) or len(ch) != n:
            return ("bad_choices", False, j, 0)
        for c in ch:
            if c.get("finish_reason") not in ("stop", "length"):
                return ("bad_finish", False, c, 0)
            text = c["message"]["content"] if chat else c["text"]
            if not isinstance(text, str):
                return ("bad_text", False, c, 0)
        u = j.get("usage") or {}
        if u.get("completion_tokens", -1) < 0 or u.get("completion_tokens", 0) > n * body["max_tokens"]:
            return ("bad_usage", False, u, 0)
        return ("ok", True, None, u["completion_tokens"])

    def check_stream(self, r, body, chat):
        if r.status_code != 200:
            j = r.json()
            if is_error_body(j):
                return ("error_%d" % r.status_code, r.status_code in (429, 503), j["error"]["message"], 0)
            return ("bad_error_body", False, r.text[:200], 0)
        if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return ("bad_content_type", False, r.headers.get("Content-Type"), 0)
        raw = b"".join(r.iter_content(chunk_size=None))
        try:
            chunks = parse_sse(raw)
        except ValueError as e:
            return ("bad_framing", False, e, 0)
        n = body.get("n", 1)
        finished = set()
        usage = None
        for c in chunks:
            if "error" in c:
                return ("stream_error", False, c, 0)
            for ch in c.get("choices", []):
                if ch.get("finish_reason"):
                    finished.add(ch["index"])
            if c.get("usage"):
                usage = c["usage"]
        if len(finished) != n:
            return ("missing_finish", False, "finished %s of %d" % (sorted(finished), n), 0)
        if body.get("stream_options", {}).get("include_usage") and not usage:
            return ("missing_usage", False, chunks[-1:], 0)
        return ("ok", True, None, usage["completion_tokens"] if usage else 0)

    def do_complete(self):
        body = self.completion_body(False)
        r = self.sess.post(self.base + "/v1/completions", json=body, timeout=600)
        return self.check_whole(r, body, False)

    def do_chat(self):
        body = self.chat_body(False)
        r = self.sess.post(self.base + "/v1/chat/completions", json=body, timeout=600)
        return self.check_whole(r, body, True)

    def do_stream(self):
        body = self.completion_body(True)
        with self.sess.post(self.base + "/v1/completions", json=body, stream=True, timeout=600) as r:
            return self.check_stream(r, body, False)

    def do_chat_stream(self):
        body = self.chat_body(True)
        with self.sess.post(self.base + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
            return self.check_stream(r, body, True)

    def do_cancel(self):
        chat = self.cfg["chat"] and self.rng.random() < 0.5
        body = self.chat_body(True) if chat else self.completion_body(True)
        body["max_tokens"] = self.cfg["max_tokens"] * 4
        body.pop("stop", None)
        body["ignore_eos"] = True
        want = self.rng.randint(1, 3)
        url = self.base + ("/v1/chat/completions" if chat else "/v1/completions")
        # A fresh connection: closing it is how the client cancels.
        r = requests.post(url, json=body, stream=True, timeout=600)
        try:
            if r.status_code != 200:
                j = r.json()
                return ("error_%d" % r.status_code, is_error_body(j) and r.status_code in (429, 503), j, 0)
            buf = b""
            for part in r.raw.stream(256, decode_content=False):
                buf += part
                if buf.count(b"\n\n") >= want:
                    break
            if b"data: [DONE]\n\n" in buf:
                return ("completed_before_cancel", True, None, 0)
            if not buf.startswith(b"data: "):
                return ("bad_framing", False, buf[:100], 0)
            return ("cancelled", True, None, 0)
        finally:
            r.close()

    def raw_stream(self, rcvbuf):
        body = self.completion_body(True)
        body["max_tokens"] = self.cfg["max_tokens"] * 8
        body["ignore_eos"] = True
        body.pop("stop", None)
        data = json.dumps(body).encode()
        host, port = self.base.split("//")[1].split(":")
        sk = socket.socket()
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sk.connect((host, int(port)))
        sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        return sk

    def do_stall(self):
        sk = self.raw_stream(4096)
        time.sleep(self.rng.uniform(3, 6))
        sk.close()
        return ("stalled_then_dropped", True, None, 0)

    def do_slow(self):
        sk = self.raw_stream(4096)
        sk.settimeout(120)
        buf = b""
        try:
            while True:
                part = sk.recv(512)
                if not part:
                    break
                buf += part
                time.sleep(0.01)
        finally:
            sk.close()
        if not buf.startswith(b"HTTP/1.1 200"):
            return ("slow_status", False, buf[:120], 0)
        if b"data: [DONE]" not in buf:
            return ("slow_truncated", False, buf[-120:], 0)
        return ("ok", True, None, 0)

    def do_bad(self):
        bad = self.rng.choice([
            (b"{not json", 400),
            (json.dumps({"model": self.cfg["model_name"], "prompt": [1, 2], "temperature": 9}).encode(), 400),
            (json.dumps({"model": "no-such-model", "prompt": [1, 2]}).encode(), 404),
            (json.dumps({"prompt": [self.cfg["vocab_ids"] * 1000]}).encode(), 400),
            (json.dumps({"prompt": [1], "max_tokens": 10 ** 9}).encode(), 400),
        ])
        r = self.sess.post(self.base + "/v1/completions", data=bad[0],
                           headers={"Content-Type": "application/json"}, timeout=60)
        try:
            j = r.json()
        except ValueError:
            return ("bad_error_body", False, r.text[:200], 0)
        if r.status_code == bad[1] and is_error_body(j):
            return ("proper_error", True, None, 0)
        return ("unexpected_%d" % r.status_code, False, r.text[:200], 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/specd")
    ap.add_argument("--model", default=None, help="default: %s if present, else %s" % (DEFAULT_MODEL, FIXTURE_MODEL))
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--port", type=int, default=0, help="0 = a free loopback port")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--warmup-s", type=float, default=None, help="default: min(120, 10%% of the run)")
    ap.add_argument("--threads", type=int, default=0, help="specd --threads")
    ap.add_argument("--json", default=None, help="output file (default /tmp/soak-<time>.json)")
    ap.add_argument("--server-log", default=None)
    ap.add_argument("--extra", default="", help="extra specd serve arguments")
    ap.add_argument("--proxy", action="store_true", help="two replicas behind HAProxy (docs/haproxy.cfg)")
    a = ap.parse_args()

    model = a.model or (DEFAULT_MODEL if os.path.exists(DEFAULT_MODEL) else FIXTURE_MODEL)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_json = a.json or "/tmp/soak-%s.json" % stamp
    log_path = a.server_log or "/tmp/soak-%s-server.log" % stamp
    duration = a.minutes * 60
    warmup = a.warmup_s if a.warmup_s is not None else min(120.0, duration * 0.1)

    # One server, or (--proxy) two replicas behind HAProxy; checks run on every replica.
    replicas = []
    for r in range(2 if a.proxy else 1):
        port = (a.port if not a.proxy else 0) or free_port()
        lp = log_path if not a.proxy else log_path.replace(".log", "-%s.log" % "ab"[r])
        cmd = [a.bin, "serve", "--model", model, "--host", HOST, "--port", str(port), "--device", "cpu",
               "--threads", str(a.threads), "--log-level", "warn"] + a.extra.split()
        if a.proxy:
            cmd += ["--max-connections-per-ip", "0"]
        logf = open(lp, "wb")
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        replicas.append({"proc": proc, "base": "http://%s:%d" % (HOST, port), "port": port, "log": lp, "logf": logf,
                         "cmd": cmd})
        print("soak: %s (pid %d), log %s" % (" ".join(cmd), proc.pid, lp), flush=True)
    t_start = time.time()
    for rep in replicas:
        while True:
            if rep["proc"].poll() is not None:
                sys.exit("soak: server exited with %s before becoming ready (see %s)" % (rep["proc"].returncode,
                                                                                      rep["log"]))
            try:
                if requests.get(rep["base"] + "/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() - t_start > 300:
                rep["proc"].kill()
                sys.exit("soak: server not ready after 300 s")
            time.sleep(0.5)
    proxy = None
    base = replicas[0]["base"]
    if a.proxy:
        pport = free_port()
        env = dict(os.environ, LB_BIND="%s:%d" % (HOST, pport), SPECD_A="%s:%d" % (HOST, replicas[0]["port"]),
                   SPECD_B="%s:%d" % (HOST, replicas[1]["port"]))
        cfg_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "haproxy.cfg")
        proxy = subprocess.Popen(["haproxy", "-db", "-f", cfg_path], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.STDOUT)
        base = "http://%s:%d" % (HOST, pport)
        for _ in range(100):
            try:
                if requests.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.1)
    print("soak: ready after %.1f s (traffic to %s)" % (time.time() - t_start, base), flush=True)

    models = requests.get(base + "/v1/models", timeout=10).json()
    model_name = models["data"][0]["id"]
    chat = requests.post(base + "/tokenize", json={"prompt": "hi"}, timeout=10).status_code == 200
    vocab_ids = 100
    cfgp = os.path.join(model, "config.json")
    if os.path.isfile(cfgp):
        vocab_ids = min(vocab_ids, json.load(open(cfgp)).get("vocab_size", vocab_ids))
    cfg = {"model_name": model_name, "chat": chat, "vocab_ids": vocab_ids, "max_tokens": a.max_tokens,
           "proxy": a.proxy}
    print("soak: model %s, chat/text prompts %s, %d clients, %.1f min" % (model_name, chat, a.clients, a.minutes),
          flush=True)

    stats = Stats()
    deadline = time.time() + duration
    clients = [Client(i, base, deadline, stats, cfg) for i in range(a.clients)]
    series = []  # {t, rss_kb, running, waiting, kv_used, kv_perc}
    alive = {"ok": True}
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            s = {"t": round(time.time() - t_start, 1), "rss_kb": rss_kb(replicas[0]["proc"].pid),
                 "rss_kb_all": [rss_kb(rep["proc"].pid) for rep in replicas]}
            try:
                m = parse_metrics(requests.get(replicas[0]["base"] + "/metrics", timeout=10).text)
                s.update(running=metric(m, "num_requests_running"), waiting=metric(m, "num_requests_waiting"),
                         kv_used=metric(m, "kv_blocks_used"), kv_perc=metric(m, "kv_cache_usage_perc"),
                         paused=metric(m, "num_requests_paused"), unread=metric(m, "stream_unread_bytes"))
            except requests.RequestException as e:
                s["metrics_error"] = repr(e)
            if any(rep["proc"].poll() is not None for rep in replicas):
                alive["ok"] = False
            series.append(s)
            with stats.lock:
                done = sum(sum(v.values()) for v in stats.counts.values())
                nf = stats.n_failures
            print("soak: t=%6.0fs rss=%s MB reqs=%d failures=%d running=%s kv_used=%s paused=%s" %
                  (s["t"], "/".join("%.1f" % (x / 1024) if x else "?" for x in s["rss_kb_all"]), done, nf,
                   s.get("running"), s.get("kv_used"), s.get("paused")), flush=True)
            stop.wait(a.sample_s)

    smp = threading.Thread(target=sampler, daemon=True)
    smp.start()
    t_load = time.time()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    load_s = time.time() - t_load
    stop.set()
    smp.join()

    # ---- idle checks (every replica) ----
    idle_all = []
    for rep in replicas:
        idle = {}
        t_idle = time.time()
        while time.time() - t_idle < 120:
            try:
                m = parse_metrics(requests.get(rep["base"] + "/metrics", timeout=10).text)
                idle = {"running": metric(m, "num_requests_running"), "waiting": metric(m, "num_requests_waiting"),
                        "kv_used": metric(m, "kv_blocks_used"), "kv_total": metric(m, "kv_blocks_total"),
                        "kv_perc": metric(m, "kv_cache_usage_perc"), "unread": metric(m, "stream_unread_bytes"),
                        "requests_rejected": {k: v for k, v in m.items() if "rejected" in k or "error" in k}}
                if idle["running"] == 0 and idle["waiting"] == 0 and idle["kv_used"] == 0:
                    break
            except requests.RequestException as e:
                idle["error"] = repr(e)
            time.sleep(1)
        idle["settle_s"] = round(time.time() - t_idle, 1)
        idle_all.append(idle)
    health = None
    final_ok = False
    try:
        health = max(requests.get(rep["base"] + "/health", timeout=10).status_code for rep in replicas)
        body = {"model": model_name, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        r = requests.post(base + "/v1/completions", json=body, timeout=120)
        final_ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    except requests.RequestException:
        pass
    rss_end = rss_kb(replicas[0]["proc"].pid)
    alive_end = all(rep["proc"].poll() is None for rep in replicas)
    idle = idle_all[0]

    # ---- RSS flatness (every replica) ----
    rss_flat, rss_all = None, []
    for i, rep in enumerate(replicas):
        post = [s["rss_kb_all"][i] for s in series if s["t"] >= warmup and s["rss_kb_all"][i]]
        q = max(1, len(post) // 4)
        r_i = {"n_samples": len(series), "n_post_warmup": len(post), "warmup_s": warmup,
               "first_kb": series[0]["rss_kb_all"][i] if series else None,
               "max_kb": max((s["rss_kb_all"][i] or 0) for s in series) if series else None,
               "end_kb": rss_kb(rep["proc"].pid)}
        if len(post) >= 4:
            fq, lq = statistics.median(post[:q]), statistics.median(post[-q:])
            r_i.update(first_quarter_median_kb=fq, last_quarter_median_kb=lq, growth_kb=lq - fq,
                       allowed_kb=max(0.10 * fq, 20 * 1024))
            flat = lq - fq <= max(0.10 * fq, 20 * 1024)
            rss_flat = flat if rss_flat is None else (rss_flat and flat)
        rss_all.append(r_i)
    rss = rss_all[0]

    checks = {
        "rss_flat": rss_flat,
        "all_requests_complete_or_proper_error": stats.n_failures == 0,
        "kv_idle_zero": all(i.get("kv_used") == 0 and i.get("kv_perc") == 0 for i in idle_all),
        "nothing_running_when_idle": all(i.get("running") == 0 and i.get("waiting") == 0 for i in idle_all),
        "no_output_buffered_when_idle": all(i.get("unread") in (0, None) for i in idle_all),
        "healthy_at_end": health == 200 and final_ok and alive_end and alive["ok"],
    }
    total = sum(sum(v.values()) for v in stats.counts.values())
    lat = {k: {"n": len(v), "p50_s": round(statistics.median(v), 3),
               "p99_s": round(sorted(v)[int(0.99 * (len(v) - 1))], 3), "max_s": round(max(v), 3)}
           for k, v in stats.latency.items()}
    result = {
        "command": [rep["cmd"] for rep in replicas], "proxy": a.proxy, "model": model, "model_name": model_name, "chat": chat, "clients": a.clients,
        "minutes": a.minutes, "load_s": round(load_s, 1), "requests_total": total,
        "requests_per_s": round(total / load_s, 2) if load_s else None, "completion_tokens": stats.tokens,
        "counts": stats.counts, "latency": lat, "failures": stats.failures, "n_failures": stats.n_failures,
        "idle": idle_all, "health": health, "final_request_ok": final_ok, "rss": rss_all, "rss_series": series,
        "checks": checks, "pass": all(v is not False for v in checks.values()), "server_log": log_path,
    }

    if proxy:
        proxy.terminate()
        proxy.wait(10)
    result["server_exit"] = []
    for rep in replicas:
        rep["proc"].send_signal(signal.SIGTERM)
        try:
            result["server_exit"].append(rep["proc"].wait(timeout=60))
        except subprocess.TimeoutExpired:
            rep["proc"].kill()
            result["server_exit"].append("killed after 60 s")
        rep["logf"].close()
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)

    print("\n==== soak summary (%s, %.1f min of load, %d clients) ====" % (model_name, load_s / 60, a.clients))
    print("requests: %d (%.2f/s), completion tokens %d" % (total, result["requests_per_s"] or 0, stats.tokens))
    for k in sorted(stats.counts):
        print("  %-12s %s  p50 %.2fs p99 %.2fs" % (k, dict(sorted(stats.counts[k].items())), lat[k]["p50_s"], lat[k]["p99_s"]))
    print("failures: %d%s" % (stats.n_failures, "" if not stats.failures else " (first: %s)" % stats.failures[0]))
    for i, r_i in enumerate(rss_all):
        print("rss[%d]: first %s KB, max %s KB, end %s KB; post-warm-up first-quarter median %s KB, last-quarter median %s KB"
              % (i, r_i["first_kb"], r_i["max_kb"], r_i["end_kb"], r_i.get("first_quarter_median_kb"),
                 r_i.get("last_quarter_median_kb")))
    for i, idl in enumerate(idle_all):
        print("idle[%d]: %s" % (i, {k: v for k, v in idl.items() if k != "requests_rejected"}))
    print("health %s, final request ok %s, server exit %s" % (health, final_ok, result["server_exit"]))
    for k, v in checks.items():
        print("  %-40s %s" % (k, "PASS" if v else ("n/a" if v is None else "FAIL")))
    print("result: %s  (json: %s)" % ("PASS" if result["pass"] else "FAIL", out_json))
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
