"""OpenAI API against llama-tiny (token-id prompts, no tokenizer): shapes, usage,
streaming framing, n/seed, logprobs, operational endpoints."""
import json
import subprocess

import openai
import requests

from conftest import sse_events


def client(srv, key="none"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def greedy_ids(srv, prompt, n_tokens):
    """Token ids generated greedily, read back through logprobs ("token_id:N")."""
    r = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0,
                                     "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    toks = r.json()["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in toks)
    return [int(t.split(":")[1]) for t in toks]


def test_health_ready_version_models(tiny):
    assert requests.get(tiny.url + "/health").json() == {"status": "ok"}
    assert requests.get(tiny.url + "/ready").status_code == 200
    assert "version" in requests.get(tiny.url + "/version").json()
    models = client(tiny).models.list()
    assert [m.id for m in models.data] == ["llama-tiny"]
    assert requests.get(tiny.url + "/v1/models").json()["data"][0]["max_model_len"] == 1024


def test_openai_completion_token_prompt_usage(tiny):
    c = client(tiny).completions.create(model="llama-tiny", prompt=[1, 2, 3, 4], max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert c.object == "text_completion"
    assert c.id.startswith("cmpl-")
    assert c.model == "llama-tiny"
    assert len(c.choices) == 1
    assert c.choices[0].finish_reason == "length"
    assert c.choices[0].text == ""  # no tokenizer: no text
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (4, 5, 9)


def test_openai_stream_with_usage(tiny):
    chunks = list(client(tiny).completions.create(model="llama-tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 3
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices][-1] == "length"
    assert all(c.id == chunks[0].id for c in chunks)


def test_raw_sse_framing_with_curl(tiny):
    body = json.dumps({"prompt": [1, 2], "max_tokens": 3, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}})
    out = subprocess.run(["curl", "-sS", "-N", "-D", "-", tiny.url + "/v1/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, timeout=30, check=True).stdout
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"content-type: text/event-stream" in head.lower()
    events = sse_events(payload)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 3
    finals = [o for o in objs[:-1] if o["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert all(o["usage"] is None for o in objs[:-1])


def test_greedy_is_deterministic_and_matches_stream(tiny):
    a = greedy_ids(tiny, [9, 8, 7, 6], 12)
    b = greedy_ids(tiny, [9, 8, 7, 6], 12)
    assert a == b and len(a) == 12
    r = tiny.post("/v1/completions", {"prompt": [9, 8, 7, 6], "max_tokens": 12, "temperature": 0, "logprobs": 0,
                                      "ignore_eos": True, "stream": True})
    toks = []
    for e in sse_events(r.content)[:-1]:
        lp = json.loads(e)["choices"][0]["logprobs"]
        if lp:
            toks += [int(t.split(":")[1]) for t in lp["tokens"]]
    assert toks == a


def test_n_and_multiple_prompts_and_seeds(tiny):
    r = tiny.post("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "n": 3, "max_tokens": 6, "temperature": 1.0,
                                      "seed": 1234, "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    j = r.json()
    assert [c["index"] for c in j["choices"]] == [0, 1, 2, 3, 4, 5]
    assert j["usage"]["prompt_tokens"] == 5
    assert j["usage"]["completion_tokens"] == 36
    # Same seed -> same samples; choice i uses seed + i, so choices differ from each other.
    r2 = tiny.post("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "n": 3, "max_tokens": 6, "temperature": 1.0,
                                       "seed": 1234, "logprobs": 0, "ignore_eos": True})
    toks = lambda j: [c["logprobs"]["tokens"] for c in j["choices"]]
    assert toks(r2.json()) == toks(j)
    assert len({tuple(t) for t in toks(j)[:3]}) > 1


def test_completion_logprobs_shape(tiny):
    r = tiny.post("/v1/completions", {"prompt": [3, 4], "max_tokens": 3, "temperature": 0, "logprobs": 2,
                                      "ignore_eos": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 3
    for tok, l, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert l <= 0 and len(top) == 2
        assert top[tok] == l  # greedy: the chosen token is the top-1
        assert max(top.values()) == l


def test_max_tokens_beyond_context_is_400(tiny):
    r = tiny.post("/v1/completions", {"prompt": [1] * 1000, "max_tokens": 100})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = tiny.post("/v1/completions", {"prompt": [1] * 1024})
    assert r.status_code == 400


def test_text_prompt_without_tokenizer_is_400(tiny):
    r = tiny.post("/v1/completions", {"prompt": "hello"})
    assert r.status_code == 400
    assert "tokenizer" in r.json()["error"]["message"]
    r = tiny.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400


def test_metrics_content(tiny):
    tiny.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
    text = requests.get(tiny.url + "/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_success_total", "spec_decode_num_drafts_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_acceptance_length", "engine_steps_total", "engine_step_seconds_total",
                 "engine_run_seconds_total", "engine_output_wait_seconds_total"]:
        assert f"# TYPE specd:{name} " in text, name
    # a prompt step and at least one decode step, timed: the runner's part within the step
    steps = {line.split('path="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
             for line in text.splitlines() if line.startswith("specd:engine_steps_total{")}
    assert set(steps) == {"decode", "verify", "speculative", "composed"}
    assert steps["composed"] >= 1 and steps["decode"] + steps["composed"] >= 2
    assert tiny.metric("engine_step_seconds_total") >= tiny.metric("engine_run_seconds_total") > 0
    assert tiny.metric("engine_output_wait_seconds_total") >= 0
    assert tiny.metric("generation_tokens_total") >= 2
    assert tiny.metric("prompt_tokens_total") >= 2
    assert 'specd:request_success_total{finished_reason="length",model_name="llama-tiny"}' in text
    assert "specd:e2e_request_latency_seconds_count" in text


def test_echo_token_prompt_without_tokenizer(tiny):
    r = tiny.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "echo": True, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == ""


def test_spec_decode_usage_and_lossless_greedy(tiny, server_factory):
    from conftest import TINY
    want = greedy_ids(tiny, [11, 12, 13], 21)
    # the cost model off: draft == target never pays on a CPU, and this checks the counters
    srv = server_factory(TINY, "--draft-model", TINY, "--num-draft-tokens", "3", "--spec-cost-model", "false",
                         name="spec")
    r = srv.post("/v1/completions", {"prompt": [11, 12, 13], "max_tokens": 21, "temperature": 0, "logprobs": 0,
                                     "ignore_eos": True})
    j = r.json()
    assert [int(t.split(":")[1]) for t in j["choices"][0]["logprobs"]["tokens"]] == want
    sd = j["usage"]["spec_decode"]
    # Draft == target: every draft token is accepted, AL = k + 1.
    assert sd["accepted_tokens"] == sd["draft_tokens"] == 3 * sd["verify_steps"]
    assert sd["acceptance_length"] == 4.0
    assert srv.metric("spec_decode_acceptance_length") == 4.0
    assert srv.metric("spec_decode_num_drafts_total") == sd["verify_steps"]
    # Streams carry it in the usage chunk too.
    r = srv.post("/v1/completions", {"prompt": [11, 12, 13], "max_tokens": 9, "temperature": 0, "ignore_eos": True,
                                     "stream": True, "stream_options": {"include_usage": True}})
    usage = json.loads(sse_events(r.content)[-2])["usage"]
    assert usage["spec_decode"]["acceptance_length"] == 4.0
    assert "spec_decode" not in tiny.post("/v1/completions", {"prompt": [1], "max_tokens": 2}).json()["usage"]


def composed_steps(srv):
    text = requests.get(srv.url + "/metrics", timeout=5).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith('specd:engine_steps_total{path="composed"'))


def test_max_num_batched_tokens_chunks_prompts(tiny, server_factory):
    from conftest import BIN, TINY
    prompt = [(7 * i) % 500 + 1 for i in range(100)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    # the default budget (2048) takes the 100-token prompt in one step
    before = composed_steps(tiny)
    want = tiny.post("/v1/completions", body).json()["choices"][0]["text"]
    assert composed_steps(tiny) - before == 1
    # 16 tokens a step: the prompt goes in 7 chunks, the output is the same
    srv = server_factory(TINY, "--max-batch", "8", "--max-num-batched-tokens", "16", name="budget16")
    assert srv.post("/v1/completions", body).json()["choices"][0]["text"] == want
    assert composed_steps(srv) == 7
    eff = json.loads(subprocess.run([BIN, "serve", "--model", TINY, "--max-num-batched-tokens", "16",
                                     "--print-config"], capture_output=True, text=True, timeout=30).stdout)
    assert eff["max_num_batched_tokens"] == 16
