"""Tool calls and reasoning through the official openai client, on SmolLM2 with chat
templates from the fixtures (its own template knows no tools): tool-result turns with
content null, tool_choice none, reasoning_content split by the prompt's <think> state,
streamed deltas equal to the non-streamed message."""
import json
import os

import jsonschema
import openai
import pytest

from conftest import FIXTURES, SMOL, Server, _need_binary

TEMPLATES = os.path.join(FIXTURES, "chat-templates", "templates")
QWEN25 = os.path.join(TEMPLATES, "Qwen-Qwen2.5-7B-Instruct.jinja")
R1 = os.path.join(TEMPLATES, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# A tool-result turn as the SDK sends it back: the assistant's calls with content None,
# arguments as a JSON string, then the tool's answer.
TOOL_TURN = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"},
]


def _server(*flags, name):
    _need_binary()
    if not os.path.exists(SMOL):
        pytest.skip(f"SKIPPED because the text model {SMOL} is absent (run scripts/fetch-model.sh)")
    s = Server(SMOL, *flags, name=name)
    return s


@pytest.fixture(scope="module")
def qwen():
    """SmolLM2 with Qwen2.5's template (ChatML, which SmolLM2 speaks): hermes tool calls."""
    s = _server("--chat-template", QWEN25, "--reasoning-parser", "qwen3", name="qwen-tools")
    yield s
    assert s.stop() == 0, s.log_text()


@pytest.fixture(scope="module")
def r1():
    """SmolLM2 with DeepSeek-R1's template: the prompt opens <think> when enable_thinking."""
    s = _server("--chat-template", R1, "--reasoning-parser", "deepseek_r1", name="r1")
    yield s
    assert s.stop() == 0, s.log_text()


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def model(srv):
    return client(srv).models.list().data[0].id


def collect(stream):
    """Rebuild a message from streamed chunks: content, reasoning_content, tool_calls by
    index (id, name from the first delta of a call, arguments concatenated)."""
    content, reasoning, calls, finish = "", "", [], None
    for ch in stream:
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            if tc.index == len(calls):
                assert tc.id and tc.type == "function" and tc.function.name
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
            assert tc.index < len(calls)
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return content, reasoning, calls, finish


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_tool_result_turn_with_null_content_completes(request, which):
    srv = request.getfixturevalue(which)
    c = client(srv)
    m = model(srv)
    r = c.chat.completions.create(model=m, messages=TOOL_TURN, tools=[WEATHER], max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.completion_tokens > 0
    text = r.choices[0].message.content or ""
    streamed = collect(c.chat.completions.create(model=m, messages=TOOL_TURN, tools=[WEATHER], max_tokens=12,
                                                 temperature=0, stream=True))
    assert streamed[0] == text


def test_qwen_template_renders_the_call_and_its_result(qwen):
    """The assistant's call is rendered from the decoded arguments, the tool answer as a
    tool_response: the prompt grows by both (compared through usage.prompt_tokens)."""
    c = client(qwen)
    m = model(qwen)
    base = c.chat.completions.create(model=m, messages=TOOL_TURN[:1], tools=[WEATHER], max_tokens=1)
    full = c.chat.completions.create(model=m, messages=TOOL_TURN, tools=[WEATHER], max_tokens=1)
    # "<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>" and
    # "<tool_response>\n{"temp_c": 18}\n</tool_response>" with their turn markers: > 30 tokens
    assert full.usage.prompt_tokens - base.usage.prompt_tokens > 30


def test_tool_choice_none_does_not_offer_the_tools(qwen):
    c = client(qwen)
    m = model(qwen)
    msgs = [{"role": "user", "content": "Hi"}]
    plain = c.chat.completions.create(model=m, messages=msgs, max_tokens=1).usage.prompt_tokens
    auto = c.chat.completions.create(model=m, messages=msgs, tools=[WEATHER], max_tokens=1).usage.prompt_tokens
    none = c.chat.completions.create(model=m, messages=msgs, tools=[WEATHER], tool_choice="none",
                                     max_tokens=1).usage.prompt_tokens
    assert auto > plain + 50   # the tools block of Qwen's system prompt
    assert none == plain


def test_reasoning_split_follows_the_prompt(r1):
    """R1's template opens <think> in the prompt when enable_thinking is true: the output
    is reasoning (no </think> from this small model: all of it); otherwise content."""
    c = client(r1)
    m = model(r1)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    think = c.chat.completions.create(model=m, messages=msgs, max_tokens=16, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = think.choices[0].message
    assert msg.content is None
    assert msg.reasoning_content and msg.reasoning_content == msg.reasoning_content.strip()
    s = collect(c.chat.completions.create(model=m, messages=msgs, max_tokens=16, temperature=0, stream=True,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
    assert s[:3] == ("", msg.reasoning_content, [])
    plain = c.chat.completions.create(model=m, messages=msgs, max_tokens=16, temperature=0)
    assert plain.choices[0].message.reasoning_content is None
    assert plain.choices[0].message.content
    s = collect(c.chat.completions.create(model=m, messages=msgs, max_tokens=16, temperature=0, stream=True))
    assert s[:3] == (plain.choices[0].message.content, "", [])


# ---- tool_choice required / a named function: held to valid calls by constrained decoding ----

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}, "hour24": {"type": "boolean"}},
                       "required": ["tz", "hour24"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def assert_valid_calls(calls, names=None):
    """Every call names a declared tool and its arguments validate against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for c in calls:
        assert c["name"] in (names or schemas), c
        jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])


def message_calls(msg):
    return [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in msg.tool_calls or []]


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_tool_choice_required_gives_a_valid_call_streamed_and_not(request, which):
    srv = request.getfixturevalue(which)
    c = client(srv)
    m = model(srv)
    kw = dict(model=m, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=120, temperature=0)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    calls = message_calls(ch.message)
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert_valid_calls(calls)
    content, reasoning, streamed, finish = collect(c.chat.completions.create(stream=True, **kw))
    assert (content, finish) == ("", "tool_calls")
    assert [(x["name"], x["arguments"]) for x in streamed] == [(x["name"], x["arguments"]) for x in calls]


def test_tool_choice_required_sampled_calls_all_validate(qwen):
    c = client(qwen)
    r = c.chat.completions.create(model=model(qwen), messages=ASK, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=120, temperature=1.0, n=4, seed=7)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls"
        assert_valid_calls(message_calls(ch.message))


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_is_called_streamed_and_not(qwen, name):
    c = client(qwen)
    kw = dict(model=model(qwen), messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
              tool_choice={"type": "function", "function": {"name": name}})
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "stop"   # as OpenAI answers a forced function
    calls = message_calls(ch.message)
    assert [x["name"] for x in calls] == [name]
    assert_valid_calls(calls, [name])
    content, _, streamed, finish = collect(c.chat.completions.create(stream=True, **kw))
    assert (content, finish) == ("", "stop")
    assert [(x["name"], x["arguments"]) for x in streamed] == [(x["name"], x["arguments"]) for x in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_call_result_answer(qwen, stream):
    """tools -> tool_calls -> the tool's result sent back after the assistant turn as the
    SDK returns it (content None) -> a final answer, streamed and not."""
    c = client(qwen)
    m = model(qwen)
    msgs = list(ASK)
    kw = dict(model=m, tools=TOOLS, max_tokens=120, temperature=0, parallel_tool_calls=False)
    if stream:
        content, _, calls, finish = collect(c.chat.completions.create(messages=msgs, tool_choice="required",
                                                                      stream=True, **kw))
        assistant = {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": x["id"], "type": "function", "function": {"name": x["name"], "arguments": x["arguments"]}}
            for x in calls]}
    else:
        r = c.chat.completions.create(messages=msgs, tool_choice="required", **kw)
        finish, calls = r.choices[0].finish_reason, message_calls(r.choices[0].message)
        assistant = r.choices[0].message.model_dump(exclude_none=True)
        assistant["content"] = None   # as the SDK's message object carries it
    assert finish == "tool_calls"
    assert_valid_calls(calls)
    msgs.append(assistant)
    for x in calls:
        msgs.append({"role": "tool", "tool_call_id": x["id"], "content": "{\"temp_c\": 18, \"time\": \"12:00\"}"})
    if stream:
        content, _, more, finish = collect(c.chat.completions.create(messages=msgs, stream=True, **kw))
    else:
        r = c.chat.completions.create(messages=msgs, **kw)
        content, more, finish = r.choices[0].message.content, message_calls(r.choices[0].message), \
            r.choices[0].finish_reason
    assert finish in ("stop", "length", "tool_calls")
    assert content or more   # an answer (or, from a small model, another call)


def test_auto_calls_reasoning_and_text_streamed_equal_non_streamed(qwen):
    """tool_choice auto on output in the model's own formats (reasoning, text, two hermes
    calls), made certain by a regex constraint: the parsers split it, and the streamed
    deltas rebuild exactly the non-streamed message."""
    c = client(qwen)
    rx = (r'<think>\nThe user wants the weather\.\n</think>\n\nLet me check\.\n'
          r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n'
          r'</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "Europe/Paris", "hour24": true\}\}'
          r'\n</tool_call>')
    kw = dict(model=model(qwen), messages=ASK, tools=TOOLS, max_tokens=150, temperature=0,
              extra_body={"structured_outputs": {"regex": rx}})
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me check."
    assert ch.message.reasoning_content == "The user wants the weather."
    calls = message_calls(ch.message)
    assert [x["name"] for x in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["arguments"]) == {"tz": "Europe/Paris", "hour24": True}
    assert_valid_calls(calls)
    content, reasoning, streamed, finish = collect(c.chat.completions.create(stream=True, **kw))
    assert (content, reasoning, finish) == (ch.message.content, ch.message.reasoning_content, "tool_calls")
    assert [(x["name"], x["arguments"]) for x in streamed] == [(x["name"], x["arguments"]) for x in calls]
    assert len({x["id"] for x in streamed + calls}) == 4   # fresh ids per call


def test_forced_call_is_not_taken_for_reasoning(r1):
    """R1's prompt opens <think>, but output held to a grammar from its first token is the
    call, not reasoning."""
    c = client(r1)
    mode = {"type": "function", "function": {"name": "set_mode", "parameters": {
        "type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}}, "required": ["mode"]}}}
    r = c.chat.completions.create(model=model(r1), messages=ASK, tools=[mode], tool_choice="required",
                                  max_tokens=60, temperature=0,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.reasoning_content is None and ch.message.content is None
    calls = message_calls(ch.message)
    assert calls and all(x["name"] == "set_mode" and json.loads(x["arguments"])["mode"] in ("fast", "slow")
                         for x in calls)
