"""Overlapped steps, async scheduling and parallel output processing (--overlap,
--async-scheduling, --output-threads) against the serial path (one step at a time, each
committed before the next is queued): the same streamed bytes for many concurrent requests,
nothing past a stop string / stop token / max_tokens ever reaching a client although the
engine runs a step past a stop string (and, with async scheduling, past a stop token),
and the engine's KV back at its baseline afterwards."""
import json

from conftest import SMOL, concurrently, sse_events
from test_load import wait_for

import pytest

QUESTIONS = [[{"role": "user", "content": f"Tell me one fact about the {kind} {name}."}]
             for kind, names in (("city", ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Quito")),
                                 ("planet", ("Mars", "Venus", "Jupiter", "Saturn", "Mercury", "Neptune")),
                                 ("animal", ("otter", "lynx", "heron", "badger", "walrus", "gecko")),
                                 ("river", ("Nile", "Rhine", "Danube", "Volga", "Amazon", "Mekong")))
             for name in names]


def need_smol():
    import os
    if not os.path.exists(SMOL):
        pytest.skip(f"SKIPPED because the text model {SMOL} is absent (run scripts/fetch-model.sh)")


def stream(srv, body):
    """One streamed chat request: (text per choice, finish per choice, logprob tokens per
    choice, usage)."""
    r = srv.post("/v1/chat/completions", dict(body, stream=True, stream_options={"include_usage": True}),
                 timeout=600)
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert events[-1] == "[DONE]"
    n = body.get("n", 1)
    text, finish, toks, usage = [""] * n, [None] * n, [[] for _ in range(n)], None
    for e in events[:-1]:
        j = json.loads(e)
        if not j["choices"]:
            usage = j["usage"]
            continue
        c = j["choices"][0]
        i = c["index"]
        assert finish[i] is None, f"a chunk after the finish of choice {i}: {e}"
        text[i] += c["delta"].get("content") or ""
        if c.get("logprobs"):
            toks[i] += [t["token"] for t in c["logprobs"]["content"]]
        finish[i] = c["finish_reason"] or finish[i]
    return text, finish, toks, usage


def bodies():
    """Greedy requests mixing the features output processing handles."""
    out = []
    for i, q in enumerate(QUESTIONS):
        b = {"messages": q, "max_tokens": 12 + i % 17, "temperature": 0}
        if i % 3 == 0:
            b["logprobs"], b["top_logprobs"] = True, 2
        if i % 4 == 1:
            b["stop"] = [" is", "."]
        if i % 5 == 2:
            b["n"] = 2
        out.append(b)
    return out


def test_overlap_and_parallel_output_stream_the_same_as_serial(server_factory):
    need_smol()
    serial = server_factory(SMOL, "--overlap", "0", "--async-scheduling", "0", "--output-threads", "1",
                            name="serial")
    base = serial.metric("kv_blocks_used")
    want = concurrently(lambda b: stream(serial, b), bodies())
    serial_async = serial.metric("engine_async_steps_total")
    serial.stop()
    fast = server_factory(SMOL, "--overlap", "1", "--output-threads", "4", name="overlap")
    got = concurrently(lambda b: stream(fast, b), bodies())
    for b, w, g in zip(bodies(), want, got):
        assert g == w, (b, w, g)
    # Stop strings cut some of them, so the serial and overlapped runs really differ in
    # when the engine learns of the end; both must have released every block.
    assert any(f == "stop" for w in want for f in w[1])
    # (a choice ended by a stop string leaves the engine one step after its reply)
    assert wait_for(lambda: fast.metric("num_requests_running") == 0, 5)
    assert wait_for(lambda: fast.metric("kv_blocks_used") == base, 5)
    assert fast.metric("host_output_tokens_total") == sum(w[3]["completion_tokens"] for w in want)
    # the serial server queued every step after committing the last; the default one did not
    assert serial_async == 0
    assert fast.metric("engine_async_steps_total") > 0


def test_nothing_past_a_stop_string_reaches_the_client(server_factory):
    need_smol()
    srv = server_factory(SMOL, "--overlap", "1", "--output-threads", "3", name="stopcut")
    base = srv.metric("kv_blocks_used")
    plain = concurrently(lambda q: stream(srv, {"messages": q, "max_tokens": 40, "temperature": 0, "logprobs": True}),
                         QUESTIONS[:12])
    cases = []
    for q, (text, finish, toks, _) in zip(QUESTIONS[:12], plain):
        text, toks = text[0], toks[0]
        # logprobs also list the end-of-turn token, whose text is not streamed
        assert "".join(toks[:-1] if finish == ["stop"] else toks) == text
        if len(text) < 20:
            continue
        stop = text[10:13]
        at = text.index(stop)
        # tokens needed until the stop string is complete: all of them reach the usage count
        m, n_chars = 0, 0
        while n_chars < at + len(stop):
            n_chars += len(toks[m])
            m += 1
        cases.append((q, stop, text[:at], toks[:m]))
    assert len(cases) >= 8
    got = concurrently(lambda c: stream(srv, {"messages": c[0], "max_tokens": 40, "temperature": 0,
                                              "logprobs": True, "stop": [c[1]]}), cases)
    for (q, stop, cut, toks), (text, finish, gtoks, usage) in zip(cases, got):
        assert text == [cut] and finish == ["stop"], (stop, cut, text)
        # the token that completed the stop string is the last one counted or streamed
        assert gtoks[0] == toks, (stop, gtoks, toks)
        assert usage["completion_tokens"] == len(toks), (stop, usage, toks)
    # Sampled choices of one request stop at different steps: the ones that go on keep the
    # job alive while its stopped choices' extra tokens arrive, and must not be streamed.
    runs = concurrently(lambda q: stream(srv, {"messages": q, "max_tokens": 40, "temperature": 1.0, "seed": 3,
                                               "n": 4, "logprobs": True, "stop": ["e"]}), QUESTIONS[:8])
    for text, finish, toks, usage in runs:   # stream() fails on a chunk after a finish
        assert all("e" not in t for t in text), text
        assert usage["completion_tokens"] == sum(len(t) for t in toks)
    assert any(len(set(len(t) for t in toks)) > 1 for _, _, toks, _ in runs)
    assert wait_for(lambda: srv.metric("num_requests_running") == 0, 5)
    assert wait_for(lambda: srv.metric("kv_blocks_used") == base, 5)


def test_max_tokens_and_stop_token_are_exact_with_overlap(server_factory):
    need_smol()
    srv = server_factory(SMOL, "--overlap", "1", "--output-threads", "3", name="exact")
    runs = concurrently(lambda i: stream(srv, {"messages": QUESTIONS[i], "max_tokens": 1 + i, "temperature": 0,
                                               "logprobs": True}), list(range(24)))
    for i, (text, finish, toks, usage) in enumerate(runs):
        assert usage["completion_tokens"] == len(toks[0]) <= 1 + i
        assert finish[0] == ("length" if len(toks[0]) == 1 + i else "stop")
        if finish[0] == "stop":   # ended by the end-of-turn token: nothing after it
            assert len(toks[0]) < 1 + i
    assert any(f[0] == "length" for _, f, _, _ in runs)
