"""`specd serve --warmup`: the start-up passes run before /ready turns 200, say what they
ran, and leave no trace a client could see (counters at zero, no cached KV blocks, the
first request served without a prefix-cache hit); a bad value is refused at start."""
import re
import subprocess
import time

from conftest import BIN, TINY


def test_warmup_runs_and_leaves_nothing(server_factory):
    srv = server_factory(TINY, "--warmup", "on", name="warmup")
    log = srv.log_text()
    m = re.search(r"warm-up: (\d+) passes \(prompts of 1-(\d+) tokens, up to (\d+) decoding together", log)
    assert m, log
    # --max-seq-len 1024 (conftest): prompts 1-8, 12 ... 60 (x1.5), 64 ... 960 (every 64),
    # then 1020; batches 2, 8, 32, 64; one of sampled rows
    assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (8 + 5 + 15 + 1 + 4 + 1, 1020, 64)
    assert log.index("warm-up:") < log.index(" ready")
    for name in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_hit_tokens_total",
                 "kv_blocks_used", "kv_blocks_cached"):
        assert srv.metric(name) == 0, name
    r = srv.post("/v1/completions", {"model": "llama-tiny", "prompt": list(range(3, 40)), "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert srv.metric("prompt_tokens_total") == 37
    assert srv.metric("kv_blocks_cached") > 0   # the gauge sees a request's blocks


def test_warmup_off_and_auto_on_cpu_skip_it(server_factory):
    for extra in (("--warmup", "off"), ()):
        srv = server_factory(TINY, *extra, name="warmup-off")
        assert "warm-up:" not in srv.log_text()


def test_warmup_bad_value_refused():
    p = subprocess.run([BIN, "serve", "--model", TINY, "--warmup", "sometimes"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0
    assert "warmup must be auto, on or off" in p.stderr + p.stdout


def test_ready_says_warming_up_meanwhile():
    """While the passes run, /ready is 503 and /health 200, both saying "warming up"; then
    /ready turns 200. (A context of 4,096 and the default step budget make the ladder run
    up to 2,048-token prompts: about two seconds on the CPU runner.)"""
    import requests
    from conftest import free_port
    port = free_port()
    log = open(f"/tmp/specd-http-warming-{port}.log", "wb")
    p = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", str(port), "--warmup", "on", "--threads", "2",
                          "--max-seq-len", "4096"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    seen, health = set(), set()
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                r = requests.get(url + "/ready", timeout=1)
                seen.add((r.status_code, r.json()["status"]))
                if r.status_code == 200:
                    break
                h = requests.get(url + "/health", timeout=1)
                health.add((h.status_code, h.json()["status"]))
            except requests.RequestException:
                pass
            time.sleep(0.02)
        assert (503, "warming up") in seen, seen
        assert (200, "ready") in seen, seen
        assert (200, "warming up") in health, health
    finally:
        p.terminate()
        p.wait(timeout=30)
        log.close()
