"""Backpressure: a stream whose client stops reading pauses its sequences at the per-stream
cap (KV kept, no steps) while other streams run on; it resumes when the client reads again
and loses nothing; a client that stays stalled is ended after --stall-timeout and its KV
and buffered output are freed."""
import json
import socket
import threading
import time

from conftest import TINY, sse_events
from test_load import stream_ids, wait_for

CAP = 65536
# 8 choices with 20 top logprobs each: ~12 KB of SSE per step, so the kernel's socket
# buffers (up to 4 MiB on loopback) fill within a few hundred steps.
BODY = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 3000, "ignore_eos": True, "stream": True, "logprobs": 20,
        "n": 8, "temperature": 0}


def open_unread(srv, body):
    """Send a streaming request on a socket with a tiny receive buffer and read nothing."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def test_stalled_reader_pauses_under_its_cap_and_is_ended(server_factory):
    srv = server_factory(TINY, "--max-seq-len", "8192", "--stream-buffer-bytes", str(CAP),
                         "--stall-timeout", "4", name="stall")
    base = srv.metric("kv_blocks_used")
    s = open_unread(srv, BODY)
    assert wait_for(lambda: srv.metric("num_requests_paused") == 8, 60)
    time.sleep(0.3)   # a step already running when the pause was decided may still add a token
    gen = srv.metric("generation_tokens_total")
    assert gen < 8 * BODY["max_tokens"]
    # bounded: the cap plus the chunks of the step that crossed it (and one overlapped step)
    assert srv.metric("stream_unread_bytes") <= CAP + 2 * 16384
    # everyone else keeps being served while it is paused
    got = [None] * 6
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, stream_ids(srv, [i + 7, 8, 9], 40)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None and len(g) == 40 for g in got)
    assert srv.metric("num_requests_paused") == 8
    assert srv.metric("generation_tokens_total") == gen + 6 * 40   # the paused ones made none
    # stalled past the timeout: ended, KV and its buffered output freed
    assert wait_for(lambda: srv.metric("num_requests_running") == 0, 15)
    assert wait_for(lambda: srv.metric("kv_blocks_used") == base, 5)
    assert srv.metric("num_requests_paused") == 0
    assert srv.metric("stream_unread_bytes") == 0
    assert "read nothing for" in srv.log_text()
    s.close()


def test_paused_stream_resumes_and_loses_nothing(server_factory):
    srv = server_factory(TINY, "--max-seq-len", "8192", "--stream-buffer-bytes", str(CAP),
                         "--stall-timeout", "0", name="resume")
    body = dict(BODY, max_tokens=1500)
    s = open_unread(srv, body)
    assert wait_for(lambda: srv.metric("num_requests_paused") == 8, 60)
    time.sleep(1.0)
    assert srv.metric("num_requests_paused") == 8   # stall_timeout 0: it waits for its client
    s.settimeout(60)
    raw = b""
    while not raw.endswith(b"0\r\n\r\n"):   # end of the chunked body
        chunk = s.recv(1 << 16)
        assert chunk, "connection closed early"
        raw += chunk
    s.close()
    head, _, body_chunked = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    payload, rest = b"", body_chunked
    while True:   # de-chunk
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        payload, rest = payload + rest[:n], rest[n + 2:]
    events = sse_events(payload)
    assert events[-1] == "[DONE]"
    tokens = [0] * 8
    for e in events[:-1]:
        c = json.loads(e)["choices"][0]
        if c.get("logprobs"):
            tokens[c["index"]] += len(c["logprobs"]["tokens"])
    assert tokens == [body["max_tokens"]] * 8
    assert srv.metric("num_requests_paused") == 0
