#!/usr/bin/env python3
"""Decode throughput with and without a grammar, against a running `specd serve`.

    python3 scripts/bench_structured.py http://127.0.0.1:8000 [--streams 1 64] [--tokens 64]

For each stream count B it runs B concurrent chat requests that each generate exactly
--tokens tokens, twice: unconstrained (ignore_eos) and under a grammar that cannot end
before then (guided_regex "[a-z ,.]{1000}", so both produce the same number of tokens),
and prints completion tokens per second of wall time (best of --repeat interleaved runs)
and the ratio; the same for a JSON schema whose document cannot end before then (a string
of at least 1000 characters). A fourth run uses an ordinary JSON schema (documents end
early, so its tok/s is reported, not compared).
docs/structured-outputs.md holds measured numbers."""
import argparse
import json
import threading
import time
import urllib.request


def post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def run(url, streams, extra, tokens):
    out = [0] * streams
    errors = []

    def one(i):
        body = {"messages": [{"role": "user", "content": f"Write about topic number {i}."}],
                "max_tokens": tokens, "temperature": 1.0, "seed": i}
        body.update(extra)
        try:
            out[i] = post(url, body)["usage"]["completion_tokens"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    t0 = time.time()
    th = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    dt = time.time() - t0
    if errors:
        raise SystemExit(errors[0])
    return sum(out), dt


SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "summary": {"type": "string"}}, "required": ["title", "year", "tags", "summary"],
    "additionalProperties": False}


# A document that cannot close within --tokens (a body of at least 1000 characters): as
# many tokens as unconstrained decoding, so its tok/s compares.
LONG = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                         "body": {"type": "string", "minLength": 1000}},
        "required": ["title", "body"], "additionalProperties": False}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, interleaved; the best is kept")
    a = ap.parse_args()
    modes = {"unconstrained": {"ignore_eos": True}, "regex": {"guided_regex": "[a-z ,.]{1000}"},
             "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
             "json_long": {"response_format": {"type": "json_schema", "json_schema": {"name": "y", "schema": LONG}}}}
    for b in a.streams:
        best = {m: 0.0 for m in modes}
        for _ in range(a.repeat):
            for m, extra in modes.items():
                n, t = run(a.url, b, extra, a.tokens)
                best[m] = max(best[m], n / t)
        print(f"streams {b:3d}: unconstrained {best['unconstrained']:8.1f} tok/s, regex {best['regex']:8.1f} tok/s "
              f"= {best['regex'] / best['unconstrained']:.2f}x, json_schema (long body) {best['json_long']:8.1f} tok/s "
              f"= {best['json_long'] / best['unconstrained']:.2f}x, json_schema {best['json_schema']:8.1f} tok/s")


if __name__ == "__main__":
    main()
