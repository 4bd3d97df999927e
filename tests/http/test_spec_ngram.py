"""Prompt-lookup speculation (--speculative ngram) through the API with the official openai
client on SmolLM2: a copy-heavy request gives the same greedy text as the plain server and
reports its drafts in usage.spec_decode; a seeded sampled request with a penalty and
logprobs gives the same text and logprobs too (each verified position draws what plain
decoding draws there); a mixed batch (copy tasks and open chat at once) stays the same too;
/metrics names the drafter and counts the speculating steps."""
import json
import os

import openai
import requests

from conftest import REPO, SMOL, concurrently

WORKLOAD = os.path.join(REPO, "scripts", "workloads", "copy-chat.jsonl")


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)


def model_id(srv):
    return requests.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def workload(which):
    with open(WORKLOAD) as f:
        items = [json.loads(line) for line in f if line.strip() and not line.startswith("#")]
    return [it["prompt"] for it in items if it["set"] == which]


def chat(srv, prompt, max_tokens=96):
    r = client(srv).chat.completions.create(model=model_id(srv), messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_ngram_copy_request_matches_plain_greedy_and_reports_drafts(smol, server_factory):
    # the cost model off: this test is about the drafts, not about when they pay on this CPU
    spec = server_factory(SMOL, "--speculative", "ngram", "--spec-cost-model", "false", name="smol-ngram")
    prompt = workload("copy")[0]
    assert prompt.startswith("Repeat the following text exactly")
    want, plain_usage = chat(smol, prompt)
    got, usage = chat(spec, prompt)
    assert got == want
    assert usage.completion_tokens == plain_usage.completion_tokens
    sd = usage.model_extra["spec_decode"]
    assert sd["drafter"] == "ngram"
    assert sd["verify_steps"] > 0
    # the answer copies the passage: most drafts stand (AL 4.7 of 5 when measured)
    assert sd["accepted_tokens"] > 0.5 * sd["draft_tokens"]
    assert sd["acceptance_length"] > 2.5
    assert 0 < sd["speculated_share"] <= 1
    assert sd["decode_steps"] >= sd["verify_steps"]
    text = requests.get(spec.url + "/metrics", timeout=5).text
    assert 'specd:spec_decode_drafter{kind="ngram"' in text
    assert spec.metric("spec_decode_num_speculated_steps_total") > 0
    assert spec.metric("spec_decode_num_accepted_tokens_total") == sd["accepted_tokens"]


def test_ngram_mixed_batch_of_copy_and_chat_matches_plain(smol, server_factory):
    spec = server_factory(SMOL, "--speculative", "ngram", name="smol-ngram-cost")   # cost model on
    prompts = workload("copy")[:3] + workload("chat")[:3]
    want = concurrently(lambda p: chat(smol, p, 64)[0], prompts)
    got = concurrently(lambda p: chat(spec, p, 64), prompts)
    assert [g[0] for g in got] == want
    for g in got:
        assert g[1].model_extra["spec_decode"]["drafter"] == "ngram"


def test_ngram_seeded_request_with_penalty_and_logprobs_matches_plain(smol, server_factory):
    spec = server_factory(SMOL, "--speculative", "ngram", "--spec-cost-model", "false", name="smol-ngram")
    prompt = workload("copy")[0]

    def ask(srv):
        r = client(srv).chat.completions.create(
            model=model_id(srv), messages=[{"role": "user", "content": prompt}], max_tokens=96, temperature=0.4,
            seed=1234, frequency_penalty=0.05, logprobs=True, top_logprobs=3)
        c = r.choices[0]
        return c.message.content, c.logprobs.content, r.usage

    want_text, want_lp, _ = ask(smol)
    got_text, got_lp, usage = ask(spec)
    assert got_text == want_text
    assert [t.token for t in got_lp] == [t.token for t in want_lp]
    assert [[x.token for x in t.top_logprobs] for t in got_lp] == [[x.token for x in t.top_logprobs] for t in want_lp]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got_lp, want_lp)) < 1e-3
    sd = usage.model_extra["spec_decode"]
    assert sd["verify_steps"] > 0 and sd["accepted_tokens"] > 0
