"""POST /v1/messages (Anthropic's Messages API, mapped onto chat) on the real SmolLM2 model
with the official anthropic client: text with a system prompt equal to what chat gives for
the same conversation, the stop reasons (max_tokens, end_turn, stop_sequence with the
string that matched), the streaming events in their order with deltas that add up to the
final message, a forced tool call and its round trip through tool_use / tool_result blocks
(streamed input JSON equal to the non-streamed input), the key as x-api-key, and errors in
the Messages shape naming the field."""
import json

import anthropic
import openai
import pytest
import requests

T0 = {"temperature": 0}   # (sampling fields are no longer arguments of anthropic's client)
TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def client(srv, key="none"):
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0)


def model_id(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none").models.list().data[0].id


def test_text_matches_chat(smol):
    c, m = client(smol), model_id(smol)
    r = c.messages.create(model=m, max_tokens=24, extra_body=T0, system="Answer in one short sentence.",
                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == m
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert 0 < r.usage.output_tokens <= 24
    ch = openai.OpenAI(base_url=smol.url + "/v1", api_key="none").chat.completions.create(
        model=m, max_tokens=24, extra_body=T0,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert ch.choices[0].message.content == r.content[0].text
    assert ch.usage.prompt_tokens == r.usage.input_tokens
    assert r.stop_reason == ("max_tokens" if ch.choices[0].finish_reason == "length" else "end_turn")
    # the same turn as text blocks, and a system prompt as blocks: the same input
    r2 = c.messages.create(model=m, max_tokens=24, extra_body=T0,
                           system=[{"type": "text", "text": "Answer in one short sentence."}],
                           messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}])
    assert r2.content[0].text == r.content[0].text and r2.usage.input_tokens == r.usage.input_tokens
    # max_tokens reached
    short = c.messages.create(model=m, max_tokens=3, extra_body=T0,
                              messages=[{"role": "user", "content": "Tell me a long story."}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_structured_output(smol):
    c, m = client(smol), model_id(smol)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    r = c.messages.create(model=m, max_tokens=80, extra_body=T0, output_config={"format": {"type": "json_schema", "schema": schema}},
                          messages=[{"role": "user", "content": "Give me a city and its population as JSON."}])
    v = json.loads(r.content[0].text)
    assert set(v) == {"city", "population"} and isinstance(v["population"], int) and v["population"] >= 0


def test_stop_sequence(smol):
    c, m = client(smol), model_id(smol)
    full = c.messages.create(model=m, max_tokens=40, extra_body=T0,
                             messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    text = full.content[0].text
    words = [w for w in text.replace(",", " ").split() if len(w) >= 1]
    assert len(words) >= 3
    stop = words[2]   # a piece of text that the same greedy run produces
    cut = c.messages.create(model=m, max_tokens=40, extra_body=T0, stop_sequences=["@@never@@", stop],
                            messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text) and stop not in cut.content[0].text


def test_streamed_events(smol):
    c, m = client(smol), model_id(smol)
    kw = dict(model=m, max_tokens=20, extra_body=T0, messages=[{"role": "user", "content": "Name three colors."}])
    whole = c.messages.create(**kw)
    events = list(c.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == whole.usage.output_tokens
    # the SDK's own accumulation gives the non-streamed message
    with c.messages.stream(**kw) as st:
        final = st.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason


def test_tool_use_round_trip(smol):
    c, m = client(smol), model_id(smol)
    kw = dict(model=m, max_tokens=80, extra_body=T0, tools=TOOLS, tool_choice={"type": "any"},
              messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    r = c.messages.create(**kw)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) >= 1
    use = uses[0]
    assert use.name == "get_weather" and use.id and isinstance(use.input.get("city"), str)
    # streamed: the input JSON deltas add up to the same input
    events = list(c.messages.create(stream=True, **kw))
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert starts and starts[0].content_block.name == "get_weather"
    frags = "".join(e.delta.partial_json for e in events
                    if e.type == "content_block_delta" and e.index == starts[0].index)
    assert json.loads(frags) == use.input
    assert events[-2].delta.stop_reason == "tool_use"
    # a named tool is forced too
    named = c.messages.create(model=m, max_tokens=80, extra_body=T0, tools=TOOLS,
                              tool_choice={"type": "tool", "name": "get_weather"},
                              messages=[{"role": "user", "content": "Weather in Rome?"}])
    assert named.content[0].type == "tool_use" and named.stop_reason == "tool_use" and "city" in named.content[0].input
    # the result goes back as a tool_result block; the model answers in text
    follow = c.messages.create(model=m, max_tokens=40, extra_body=T0, tools=TOOLS, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 degrees and sunny"}]}])
    assert follow.content and follow.content[0].type == "text" and follow.content[0].text
    bare = c.messages.create(model=m, max_tokens=1, extra_body=T0, tools=TOOLS,
                             messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert follow.usage.input_tokens > bare.usage.input_tokens + 10


@pytest.mark.parametrize("body,param_word", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "Hi"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "stop_sequences": "x"}, "stop"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "sometimes"}},
     "tool_choice"),
])
def test_errors_in_messages_shape(smol, body, param_word):
    m = model_id(smol)
    r = requests.post(smol.url + "/v1/messages", json={"model": m, **body}, timeout=30)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param_word in err["error"]["message"]
    if "max_tokens" in body:   # the client raises its own error class for it (it needs max_tokens itself)
        with pytest.raises(anthropic.BadRequestError) as ei:
            client(smol).messages.create(model=m, **body)
        assert ei.value.body == err


def test_unknown_model_is_404(smol):
    with pytest.raises(anthropic.NotFoundError) as ei:
        client(smol).messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert ei.value.body["error"]["type"] == "not_found_error"


def test_key_as_x_api_key(server_factory):
    from conftest import TINY
    srv = server_factory(TINY, "--api-key", "k1", name="msgauth")
    body = {"model": "llama-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    r = requests.post(srv.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert requests.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": "k2"}, timeout=30).status_code == 401
    with pytest.raises(anthropic.AuthenticationError):
        client(srv, key="bad").messages.create(**body)
    ok = requests.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": "k1"}, timeout=30)
    bearer = requests.post(srv.url + "/v1/messages", json=body, headers={"Authorization": "Bearer k1"}, timeout=30)
    assert ok.status_code == bearer.status_code != 401
    assert ok.json()["type"] in ("message", "error") and ok.json().keys() == bearer.json().keys()


def test_count_tokens_equals_usage(smol):
    c, m = client(smol), model_id(smol)
    for extra in ({}, {"tools": TOOLS}, {"system": "Be brief."}):
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        n = c.messages.count_tokens(model=m, messages=msgs, **extra)
        r = c.messages.create(model=m, max_tokens=1, extra_body=T0, messages=msgs, **extra)
        assert n.input_tokens == r.usage.input_tokens > 5
    bad = requests.post(smol.url + "/v1/messages/count_tokens", json={"model": m, "messages": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_models_for_anthropic_clients(smol):
    m = model_id(smol)
    ms = list(client(smol).models.list())
    assert [x.id for x in ms] == [m] and ms[0].type == "model" and ms[0].display_name == m
    assert ms[0].created_at.year >= 2026
    assert client(smol).models.retrieve(m).id == m
    plain = requests.get(smol.url + "/v1/models", timeout=30).json()   # OpenAI's shape without the header
    assert plain["object"] == "list" and "type" not in plain["data"][0] and "has_more" not in plain
