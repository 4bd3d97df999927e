"""Text in and out with a real tokenizer and chat template: SmolLM2-135M-Instruct (GGUF),
through the official openai client; and llama-tiny paired with a foreign --tokenizer."""
import json
import threading

import openai
import pytest
import requests

from conftest import FIXTURES, TINY, sse_events

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def oc(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def model_id(srv):
    return requests.get(srv.url + "/v1/models").json()["data"][0]["id"]


def test_chat_non_stream_and_stream_agree(smol):
    c = oc(smol)
    full = c.chat.completions.create(model=model_id(smol), messages=QUESTION, max_tokens=24, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    msg = full.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert full.choices[0].finish_reason in ("stop", "length")
    n_prompt = smol.post("/tokenize", {"messages": QUESTION}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens
    chunks = list(c.chat.completions.create(model=model_id(smol), messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_text_stream_matches_and_echo(smol):
    c = oc(smol)
    prompt = "The three primary colors are"
    full = c.completions.create(model=model_id(smol), prompt=prompt, max_tokens=20, temperature=0)
    text = full.choices[0].text
    assert len(text) > 0
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=model_id(smol), prompt=prompt, max_tokens=20, temperature=0, stream=True) if ch.choices)
    assert streamed == text
    echoed = c.completions.create(model=model_id(smol), prompt=prompt, max_tokens=20, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + text


def test_stop_strings_cut_and_hold_back(smol):
    c = oc(smol)
    prompt = "Count from one to twenty in words: one, two, three,"
    base = c.completions.create(model=model_id(smol), prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    assert len(base) > 12, base
    stop = base[6:10]
    cut = base[:base.index(stop)]
    r = c.completions.create(model=model_id(smol), prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\u00e9t\u00e9"])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model=model_id(smol), prompt=prompt, max_tokens=40, temperature=0,
                                         stop=[stop], stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == cut
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == "stop"
    # The stop string never leaks, even partially, into any chunk.
    assert all(stop not in ch.choices[0].text for ch in streamed if ch.choices)


def test_multibyte_text_streams_whole_characters(smol):
    msgs = [{"role": "user", "content": "Write the word 'café' and the Japanese word for cat (猫) three times."}]
    body = {"model": model_id(smol), "messages": msgs, "max_tokens": 40, "temperature": 0}
    full = smol.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    r = smol.post("/v1/chat/completions", dict(body, stream=True))
    pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in sse_events(r.content)[:-1]]
    assert "".join(p or "" for p in pieces) == full
    assert "\ufffd" not in full


def test_chat_logprobs_shape(smol):
    r = oc(smol).chat.completions.create(model=model_id(smol), messages=QUESTION, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == max(t.logprob for t in item.top_logprobs)
        assert item.top_logprobs[0].token == item.token  # greedy picks the top-1


def test_tokenize_detokenize_roundtrip(smol):
    text = "Hello, world! Ünïcödé 猫"
    t = smol.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert t["count"] == len(t["tokens"]) > 0
    assert smol.post("/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == text
    assert smol.post("/detokenize", {"tokens": [10 ** 7]}).status_code == 400


def test_n_choices_with_seed_are_reproducible(smol):
    body = {"model": model_id(smol), "messages": QUESTION, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    a = smol.post("/v1/chat/completions", body).json()
    b = smol.post("/v1/chat/completions", body).json()
    texts = lambda j: [c["message"]["content"] for c in j["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert texts(a) == texts(b)


def test_64_concurrent_chat_streams_match_solo(smol):
    questions = [[{"role": "user", "content": f"Name a {kind} that starts with the letter {ch}."}]
                 for kind in ("fruit", "city", "animal", "color") for ch in "ABCDEFGHIJKLMNOP"]

    def run(msgs):
        r = smol.post("/v1/chat/completions", {"model": model_id(smol), "messages": msgs, "max_tokens": 8,
                                               "temperature": 0, "stream": True}, timeout=300)
        return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in sse_events(r.content)[:-1])

    solo = [run(q) for q in questions]
    got = [None] * len(questions)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, run(questions[i]))) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == solo


def test_foreign_tokenizer_ids_beyond_model_vocab_are_400(server_factory):
    srv = server_factory(TINY, "--tokenizer", f"{FIXTURES}/tokenizers/hf/qwen3", name="qwen3tok")
    r = srv.post("/v1/completions", {"prompt": "hello world", "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    # /tokenize reports what the tokenizer says, even ids the model cannot take.
    toks = srv.post("/tokenize", {"prompt": "hello world"}).json()["tokens"]
    assert max(toks) >= 1024
    # Text whose ids all fit works and comes back as text.
    r = srv.post("/v1/completions", {"prompt": "a b c", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert isinstance(r.json()["choices"][0]["text"], str)


def test_streamed_n_choices_match_non_streamed(smol):
    body = {"model": model_id(smol), "messages": QUESTION, "max_tokens": 10, "temperature": 0.8, "seed": 11, "n": 2}
    full = smol.post("/v1/chat/completions", body).json()
    r = smol.post("/v1/chat/completions", dict(body, stream=True))
    texts, finishes, roles = {}, {}, {}
    for e in sse_events(r.content)[:-1]:
        c = json.loads(e)["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        if c["delta"].get("role"):
            roles[c["index"]] = c["delta"]["role"]
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c["index"]: c["message"]["content"] for c in full["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in full["choices"]}


def test_ready_is_503_while_loading(smol):
    """The HTTP side is up before the model: /ready and generation answer 503 "loading"
    while /health is 200. (Uses the SmolLM2 GGUF, whose load takes long enough to see.)"""
    import subprocess
    import time
    from conftest import BIN, SMOL, free_port
    port = free_port()
    p = subprocess.Popen([BIN, "serve", "--model", SMOL, "--port", str(port), "--log-level", "warn"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen_loading = seen_ready = False
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not seen_ready:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/ready", timeout=1)
            except requests.RequestException:
                time.sleep(0.005)
                continue
            if r.status_code == 503:
                assert r.json() == {"status": "loading"}
                seen_loading = True
                # Loading may finish between these requests: each answer must be the
                # loading one or the loaded one, never an error or a hang.
                h = requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
                assert h.status_code == 200 and h.json()["status"] in ("loading", "ok")
                g = requests.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=60)
                assert g.status_code in (503, 200)
                if g.status_code == 503:
                    assert "loading" in g.json()["error"]["message"]
            elif r.status_code == 200:
                seen_ready = True
    finally:
        p.terminate()
        p.wait(30)
    assert seen_loading and seen_ready
