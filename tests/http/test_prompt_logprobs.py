"""Prompt logprobs on the real SmolLM2 model with the official openai client: the request
lm-eval-harness sends for loglikelihood (prompt = context + continuation, echo, logprobs 1,
max_tokens 0) gives the prompt's tokens with their logprobs (the first null) and text
offsets, and the continuation's logprobs equal those a greedy request reports when it
generates the same tokens. max_tokens 0 without echo is an empty completion ("length"),
as vLLM answers. vLLM's prompt_logprobs field gives its per-token dicts."""
import math

import openai
import pytest


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none")


def model_id(srv):
    return client(srv).models.list().data[0].id


CONTEXT = "The capital of France is"


def tokenize(srv, text):
    r = srv.post("/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_loglikelihood_request_matches_greedy_logprobs(smol):
    c, m = client(smol), model_id(smol)
    # what the model itself continues with, and the logprobs it reports for those tokens
    gen = c.completions.create(model=m, prompt=CONTEXT, max_tokens=2, temperature=0, logprobs=1)
    cont = gen.choices[0].text
    gen_lp = gen.choices[0].logprobs.token_logprobs
    assert len(gen_lp) == 2 and cont
    # lm-eval: context + continuation, echo, logprobs 1, max_tokens 0
    ll = c.completions.create(model=m, prompt=CONTEXT + cont, max_tokens=0, temperature=0, echo=True, logprobs=1)
    ch = ll.choices[0]
    assert ch.text == CONTEXT + cont
    assert ch.finish_reason == "length"
    assert ll.usage.completion_tokens == 0
    lp = ch.logprobs
    ids = tokenize(smol, CONTEXT + cont)
    n = len(ids)
    assert ll.usage.prompt_tokens == n
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    # text offsets: each token starts where the text before it ends
    assert lp.text_offset[0] == 0
    assert "".join(lp.tokens) == CONTEXT + cont
    for i in range(1, n):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1].encode()) or \
            lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    # the continuation part equals what the greedy request reported for the same tokens
    # (the tokenization of context + continuation splits where generation did)
    assert lp.tokens[-2:] == gen.choices[0].logprobs.tokens
    for got, want in zip(lp.token_logprobs[-2:], gen_lp):
        assert got == pytest.approx(want, abs=1e-5)
    # greedy tokens are the most likely: each top-1 entry is the token itself
    for i in range(n - 2, n):
        top = lp.top_logprobs[i]
        assert len(top) == 1
        assert list(top.values())[0] == pytest.approx(lp.token_logprobs[i], abs=1e-4)
    # logprobs 0 (lm-eval's other spelling): the same numbers, no top entries
    ll0 = c.completions.create(model=m, prompt=CONTEXT + cont, max_tokens=0, echo=True, logprobs=0)
    lp0 = ll0.choices[0].logprobs
    assert lp0.token_logprobs[0] is None
    for a, b in zip(lp0.token_logprobs[1:], lp.token_logprobs[1:]):
        assert a == pytest.approx(b, abs=1e-4)
    assert all(t == {} for t in lp0.top_logprobs[1:])


def test_echo_logprobs_then_generated_tokens(smol):
    c, m = client(smol), model_id(smol)
    r = c.completions.create(model=m, prompt=CONTEXT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n = len(tokenize(smol, CONTEXT))
    assert len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert r.choices[0].text.startswith(CONTEXT)
    # generated tokens' offsets continue after the echoed prompt
    assert lp.text_offset[n] == len(CONTEXT)
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    # streamed: the echo chunk carries the prompt's logprobs, then the tokens follow
    chunks = list(c.completions.create(model=m, prompt=CONTEXT, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2, stream=True))
    toks, lps = [], []
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.tokens
            lps += ch.choices[0].logprobs.token_logprobs
    assert toks == lp.tokens
    assert lps[0] is None
    for a, b in zip(lps[1:], lp.token_logprobs[1:]):
        assert a == pytest.approx(b, abs=1e-4)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text


def test_max_tokens_zero_without_echo_is_empty(smol):
    c, m = client(smol), model_id(smol)
    r = c.completions.create(model=m, prompt=CONTEXT, max_tokens=0)
    assert r.choices[0].text == ""
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(tokenize(smol, CONTEXT))
    # chat has no such request: a 400 naming max_tokens
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert ei.value.body["param"] == "max_tokens"


def test_vllm_prompt_logprobs_field(smol):
    m = model_id(smol)
    r = smol.post("/v1/completions", {"model": m, "prompt": CONTEXT, "max_tokens": 1, "temperature": 0,
                                      "prompt_logprobs": 2, "logprobs": 0, "echo": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    pl, ids = ch["prompt_logprobs"], tokenize(smol, CONTEXT)
    assert len(pl) == len(ids) and pl[0] is None
    echo_lp = ch["logprobs"]["token_logprobs"]
    for i in range(1, len(ids)):
        entry = pl[i]
        me = entry[str(ids[i])]
        assert me["logprob"] == pytest.approx(echo_lp[i], abs=1e-4)
        assert me["rank"] >= 1 and isinstance(me["decoded_token"], str)
        assert {1, 2} <= {v["rank"] for v in entry.values()}   # the top 2 are always there
        assert 2 <= len(entry) <= 3
        best = max(v["logprob"] for v in entry.values())
        assert math.isclose(best, [v["logprob"] for v in entry.values() if v["rank"] == 1][0])
    # streaming is refused, naming the field
    bad = smol.post("/v1/completions", {"model": m, "prompt": CONTEXT, "prompt_logprobs": 1, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
