"""POST /v1/responses (the Responses API, the OpenAI Agents SDK's default) on the real
SmolLM2 model with the official openai client: text and message input with instructions,
the same text chat gives for the same messages, the streaming events in their order with
deltas that add up to the final text, a forced tool call and its round trip through
function_call / function_call_output items (streamed arguments equal the non-streamed),
and 400s naming what needs server-side state."""
import json

import openai
import pytest

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none")


def model_id(srv):
    return client(srv).models.list().data[0].id


def test_text_response_matches_chat(smol):
    c, m = client(smol), model_id(smol)
    r = c.responses.create(model=m, instructions="Answer in one short sentence.", input="What is the capital of France?",
                           max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == m
    assert r.status in ("completed", "incomplete")
    msg = r.output[0]
    # the item the length limit cut is incomplete too (OpenAI marks both)
    assert msg.type == "message" and msg.role == "assistant" and msg.status == r.status
    assert msg.content[0].type == "output_text" and msg.content[0].text == r.output_text and r.output_text
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 0 < r.usage.output_tokens <= 24
    # the same conversation through chat gives the same text and token counts
    ch = c.chat.completions.create(model=m, messages=[{"role": "system", "content": "Answer in one short sentence."},
                                                      {"role": "user", "content": "What is the capital of France?"}],
                                   max_tokens=24, temperature=0)
    assert ch.choices[0].message.content == r.output_text
    assert ch.usage.prompt_tokens == r.usage.input_tokens
    # message items (a system turn, input_text parts) are the same input as instructions + a string
    r2 = c.responses.create(model=m, input=[
        {"role": "system", "content": "Answer in one short sentence."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
        max_output_tokens=24, temperature=0)
    assert r2.output_text == r.output_text and r2.usage.input_tokens == r.usage.input_tokens
    # max_output_tokens reached: incomplete, saying why
    short = c.responses.create(model=m, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3
    assert [o.status for o in short.output] == ["incomplete"]


def test_streamed_events(smol):
    c, m = client(smol), model_id(smol)
    kw = dict(model=m, input="Name three colors.", max_output_tokens=20, temperature=0)
    whole = c.responses.create(**kw)
    events = list(c.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2
    first_delta = types.index("response.output_text.delta")
    assert set(types[first_delta:first_delta + len(deltas)]) == {"response.output_text.delta"}
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    done = events[-4]
    assert text == done.text == events[-1].response.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    ids = {e.item_id for e in deltas}
    assert ids == {events[-2].item.id}
    assert events[-2].item.status == whole.output[0].status == whole.status


def test_tool_call_round_trip(smol):
    c, m = client(smol), model_id(smol)
    kw = dict(model=m, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required", temperature=0,
              max_output_tokens=80)
    r = c.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert isinstance(args.get("city"), str)
    # streamed: the argument deltas add up to the same arguments
    events = list(c.responses.create(stream=True, **kw))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added and added[0].item.name == "get_weather"
    frags = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                    and e.output_index == added[0].output_index)
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    assert frags == done.arguments == call.arguments
    assert events[-1].type == "response.completed"
    # a named function is forced too
    named = c.responses.create(model=m, input="Weather in Rome?", tools=TOOLS,
                               tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert named.output[0].type == "function_call" and "city" in json.loads(named.output[0].arguments)
    # the result goes back as function_call_output; the model answers in text
    follow = c.responses.create(model=m, tools=TOOLS, temperature=0, max_output_tokens=40, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees and sunny"}])
    assert follow.status in ("completed", "incomplete")
    assert follow.output_text
    # the tool turn reached the prompt: more input tokens than without it
    bare = c.responses.create(model=m, tools=TOOLS, temperature=0, max_output_tokens=1,
                              input=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert follow.usage.input_tokens > bare.usage.input_tokens + 10


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": None}, "input"),
    ({"temperature": 5}, "temperature"),
])
def test_refused_fields_name_themselves(smol, extra, param):
    body = dict({"model": model_id(smol), "input": "hi"}, **extra)
    r = smol.post("/v1/responses", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_store_false_is_accepted(smol):
    r = smol.post("/v1/responses", {"model": model_id(smol), "input": "hi", "store": False, "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["store"] is False


def test_text_format_json_object_constrains(smol):
    c, m = client(smol), model_id(smol)
    r = c.responses.create(model=m, input="Give me a JSON object describing a cat.", max_output_tokens=60,
                           text={"format": {"type": "json_object"}}, temperature=1.0)
    assert isinstance(json.loads(r.output_text), dict)
