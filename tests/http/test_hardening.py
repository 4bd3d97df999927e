"""Hardening against hostile clients on an open port, each attack bounded in time and
traffic (loopback only), each checking that the attack is handled and that a good
request is served after it: receive deadlines against byte-dripping clients, the
connection cap (503 + Retry-After) and the per-address limit, ambiguous framing (request
smuggling) refused and closed, log lines that cannot be forged, NUL in paths, the Bearer
scheme in any case, --api-key-file, and a request that could never fit."""
import json
import os
import socket
import time

import requests

from conftest import TINY
from test_load import wait_for


def good(srv):
    r = srv.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def rss_kb(srv):
    with open(f"/proc/{srv.proc.pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def settled(srv):
    """KV blocks in use once nothing runs (the metrics follow a reply within a step)."""
    assert wait_for(lambda: srv.metric("num_requests_running") == 0, 5)
    time.sleep(0.2)
    return srv.metric("kv_blocks_used")


def baseline(srv):
    """What an attack must leave as it found: KV blocks in use, and the process's RSS."""
    good(srv)   # warm: the first request's allocations are not the attack's
    return settled(srv), rss_kb(srv)


def back_to(srv, base, slack_kb=16384):
    kv, rss = base
    good(srv)
    assert settled(srv) == kv
    assert rss_kb(srv) <= rss + slack_kb, (rss, rss_kb(srv))


def connect(srv):
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(10)
    return s


def read_all(s, limit=10.0):
    """Everything the server sends until it closes (or `limit` seconds pass)."""
    data, end = b"", time.time() + limit
    while time.time() < end:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        data += chunk
    return data


def closed_by_peer(s, within):
    """True when the server closes the connection within `within` seconds."""
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_dripping_client_is_cut_at_the_receive_deadline(server_factory):
    srv = server_factory(TINY, "--recv-timeout", "2", name="drip")
    base = baseline(srv)
    s = connect(srv)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    good(srv)                            # served while the drip goes on
    t0, cut = time.time(), False
    while time.time() - t0 < 8:          # one header byte every 0.3 s: never idle long
        try:
            s.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        if closed_by_peer(s, 0.3):
            cut = True
            break
    assert cut and time.time() - t0 < 5, "the dripping connection outlived its deadline"
    s.close()
    # an idle kept-alive connection is closed after the same time
    k = connect(srv)
    body = json.dumps({"prompt": [1], "max_tokens": 1}).encode()
    k.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    first = k.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    assert closed_by_peer(k, 6)
    back_to(srv, base)


def test_connection_cap_answers_503_with_retry_after(server_factory):
    srv = server_factory(TINY, "--max-connections", "6", name="cap")
    base = baseline(srv)
    idle = [connect(srv) for _ in range(8)]
    time.sleep(0.3)
    s = connect(srv)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = read_all(s, 5)
    head = reply.split(b"\r\n\r\n")[0].lower()
    assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
    assert b"retry-after: 1" in head and b"connection: close" in head
    s.close()
    for c in idle:
        c.close()
    time.sleep(0.3)
    back_to(srv, base)


def test_per_address_limit(server_factory):
    srv = server_factory(TINY, "--max-connections-per-ip", "3", name="perip")
    base = baseline(srv)
    time.sleep(0.3)                      # the baseline's own connection is gone
    held = [connect(srv) for _ in range(3)]
    for h in held:                       # each one accepted and served (kept alive)
        h.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert h.recv(65536).startswith(b"HTTP/1.1 200")
    extra = connect(srv)
    extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_all(extra, 3) == b""      # refused by the library: closed without a reply
    extra.close()
    for c in held:
        c.close()
    time.sleep(0.3)
    back_to(srv, base)


def smuggle(srv, headers):
    """A POST with the given framing headers and a second request hidden in its body;
    returns everything the server sent before closing."""
    inner = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b"0\r\n\r\n" + inner
    s = connect(srv)
    s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers +
              b"\r\n" + body)
    data = read_all(s, 5)
    s.close()
    return data


def test_ambiguous_framing_is_400_and_closed(server_factory):
    srv = server_factory(TINY, name="smuggle")
    base = baseline(srv)
    for headers in (b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % 43,
                    b"Content-Length: 5\r\nContent-Length: 43\r\n",
                    b"Transfer-Encoding: gzip, chunked\r\n"):
        data = smuggle(srv, headers)
        assert data.startswith(b"HTTP/1.1 400"), (headers, data[:200])
        assert data.count(b"HTTP/1.1 ") == 1, "the smuggled request was answered"
        assert b"connection: close" in data.split(b"\r\n\r\n")[0].lower()
        good(srv)
    back_to(srv, base)


def test_log_lines_cannot_be_forged(server_factory):
    srv = server_factory(TINY, name="logforge")
    requests.get(srv.url + "/v1/models%0d%0a2026-01-01T00:00:00.000Z info  FORGED", timeout=5)
    requests.get(srv.url + "/v1/x%ff%fe", timeout=5)
    good(srv)
    srv.stop()
    lines = srv.log_text().splitlines()
    assert not any(l.startswith("2026-01-01") or "FORGED" in l and "\\x0d\\x0a" not in l for l in lines)
    assert any("\\x0d\\x0a2026-01-01" in l for l in lines)
    assert any("/v1/x\\xff\\xfe" in l for l in lines)

    js = server_factory(TINY, "--log-json", name="logjson")
    requests.get(js.url + "/v1/x%ff%0a", timeout=5)
    good(js)
    js.stop()
    recs = [json.loads(l) for l in js.log_text().splitlines() if l.startswith("{")]
    paths = [r.get("path") for r in recs if r.get("msg") == "request"]
    assert "/v1/x\\xff\\x0a" in paths, paths      # the line is there, escaped, valid JSON


def test_nul_in_path_matches_no_route(server_factory):
    srv = server_factory(TINY, name="nul")
    assert requests.get(srv.url + "/v1/models%00.json", timeout=5).status_code == 404
    assert requests.get(srv.url + "/v1/%6dodels", timeout=5).status_code == 200   # %HH still decoded
    good(srv)


def test_bearer_scheme_any_case_and_key_file(server_factory, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\n\n  file-key-1  \nfile-key-2\n")
    srv = server_factory(TINY, "--api-key", "flag-key", "--api-key-file", str(keys), name="keys")
    body = {"prompt": [1, 2], "max_tokens": 1}
    for auth, want in (("bearer flag-key", 200), ("BEARER file-key-1", 200), ("Bearer file-key-2", 200),
                       ("Bearer # team keys", 401), ("Bearer FILE-KEY-1", 401), ("Basic file-key-1", 401)):
        r = srv.post("/v1/completions", body, headers={"Authorization": auth})
        assert r.status_code == want, (auth, r.status_code)
    with open(f"/proc/{srv.proc.pid}/cmdline", "rb") as f:
        assert b"file-key-1" not in f.read()


def test_request_that_can_never_fit_is_400_not_429(server_factory):
    srv = server_factory(TINY, "--max-batch", "2", "--max-queued", "2", name="neverfit")
    r = srv.post("/v1/completions", {"prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 1, "n": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n" and "max_batch + max_queued" in r.json()["error"]["message"]
    # A request that fills every seat, then the next one sent on its reply: the seats are
    # given back before the reply goes out, so the second is never refused (429).
    for _ in range(30):
        r = srv.post("/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 1, "n": 2})
        assert r.status_code == 200, r.text
        good(srv)


def test_half_closed_stream_gets_its_whole_reply(server_factory):
    srv = server_factory(TINY, name="halfclose")
    base = baseline(srv)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 300, "ignore_eos": True, "stream": True}).encode()
    s = connect(srv)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    s.shutdown(socket.SHUT_WR)            # done sending; still reading
    data = read_all(s, 30)
    s.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert b"data: [DONE]" in data
    assert data.count(b'"finish_reason":"length"') == 1
    back_to(srv, base)
