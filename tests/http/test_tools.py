"""Tool calls and reasoning through the official openai client, on SmolLM2 with chat
templates from the fixtures (its own template knows no tools): tool-result turns with
content null, tool_choice none, reasoning_content split by the prompt's <think> state,
streamed deltas equal to the non-streamed message."""
import os

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
