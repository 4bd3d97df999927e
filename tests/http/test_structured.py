"""Structured outputs (constrained decoding) on the real SmolLM2 model through the official
openai client: chat.completions.parse(PydanticModel) gives a schema-valid object in 50 of
50 sampled requests at temperature 1; json_object output always parses; regex, choice and
GBNF constraints hold; streaming works under a constraint; a schema that does not compile
is a 400 naming the field."""
import json
import re
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, Field

from conftest import concurrently


def oc(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)


def model_id(srv):
    return oc(srv).models.list().data[0].id


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int
    city: str = Field(max_length=24)
    hobbies: list[Annotated[str, Field(max_length=24)]] = Field(max_length=3)
    employed: bool


ASK = [{"role": "user", "content": "Invent a person: their name, age, city, up to three hobbies and whether "
                                   "they are employed. Answer in JSON."}]


def test_parse_pydantic_50_of_50_at_temperature_1(smol):
    c, mid = oc(smol), model_id(smol)

    def one(i):
        try:
            r = c.chat.completions.parse(model=mid, messages=ASK, response_format=Person, temperature=1.0,
                                         max_tokens=400, seed=1000 + i)
        except openai.LengthFinishReasonError as e:   # say what the model wrote
            raise AssertionError(f"seed {1000 + i}: {e.completion.choices[0].message.content!r}") from e
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        p = ch.message.parsed
        assert isinstance(p, Person), ch.message.content
        assert len(p.name) <= 24 and len(p.city) <= 24 and len(p.hobbies) <= 3
        # the text itself is the JSON the model wrote, valid under the schema
        Person.model_validate_json(ch.message.content)
        return ch.message.content

    docs = concurrently(one, list(range(50)))
    assert len(docs) == 50
    assert len(set(docs)) > 10   # sampled, not one answer repeated


def test_json_object_always_parses(smol):
    c, mid = oc(smol), model_id(smol)
    msgs = [{"role": "user", "content": "Describe a cat as a JSON object."}]

    def one(i):
        r = c.chat.completions.create(model=mid, messages=msgs, response_format={"type": "json_object"},
                                      temperature=1.0, max_tokens=512, seed=i)
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch.message.content
        v = json.loads(ch.message.content)
        assert isinstance(v, dict)
        return v

    assert len(concurrently(one, list(range(12)))) == 12


def test_documents_close_within_a_small_max_tokens(smol):
    # the model would write far more than 16 tokens; near the end only tokens after which
    # the document can still close in the tokens left are allowed, so it always parses
    c, mid = oc(smol), model_id(smol)
    msgs = [{"role": "user", "content": "Describe three cats in detail as a JSON object."}]

    def one(i):
        r = c.chat.completions.create(model=mid, messages=msgs, response_format={"type": "json_object"},
                                      temperature=1.0, max_tokens=16, seed=100 + i)
        assert r.usage.completion_tokens <= 16
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
        return r.usage.completion_tokens

    used = concurrently(one, list(range(8)))
    assert max(used) >= 12   # the budget was used, not a short answer by chance


def test_regex_and_choice_hold(smol):
    c, mid = oc(smol), model_id(smol)
    msgs = [{"role": "user", "content": "What is the phone number of the office?"}]
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    for i in range(4):
        r = c.chat.completions.create(model=mid, messages=msgs, temperature=1.0, max_tokens=40, seed=i,
                                      extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    # completions endpoint, vLLM's structured_outputs spelling
    r = c.completions.create(model=mid, prompt="Call me at", max_tokens=40, temperature=1.0,
                             extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    labels = ["positive", "negative", "neutral"]
    msgs = [{"role": "user", "content": "Sentiment of: 'I love this phone'"}]
    seen = set()
    for i in range(6):
        r = c.chat.completions.create(model=mid, messages=msgs, temperature=1.0, max_tokens=10, seed=i,
                                      extra_body={"guided_choice": labels})
        assert r.choices[0].message.content in labels
        seen.add(r.choices[0].message.content)
    r = c.chat.completions.create(model=mid, messages=msgs, temperature=1.0, max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": labels}})
    assert r.choices[0].message.content in labels


def test_gbnf_grammar_and_json_schema_llama_cpp_fields(smol):
    c, mid = oc(smol), model_id(smol)
    g = 'root ::= "The answer is " ("yes" | "no") "."\n'
    r = c.chat.completions.create(model=mid, messages=[{"role": "user", "content": "Is water wet?"}],
                                  temperature=1.0, max_tokens=20, extra_body={"grammar": g})
    assert re.fullmatch(r"The answer is (yes|no)\.", r.choices[0].message.content)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = c.chat.completions.create(model=mid, messages=[{"role": "user", "content": "Pick a number."}],
                                  temperature=1.0, max_tokens=40, extra_body={"json_schema": schema})
    assert isinstance(json.loads(r.choices[0].message.content)["n"], int)


def test_streaming_under_a_schema(smol):
    c, mid = oc(smol), model_id(smol)
    schema = dict(Person.model_json_schema(), additionalProperties=False)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}}
    text, finish = "", None
    for ch in c.chat.completions.create(model=mid, messages=ASK, response_format=rf, temperature=1.0,
                                        max_tokens=400, seed=7, stream=True):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    assert finish == "stop"
    Person.model_validate_json(text)
    # the same request not streamed gives the same text (seeded)
    r = c.chat.completions.create(model=mid, messages=ASK, response_format=rf, temperature=1.0, max_tokens=400,
                                  seed=7)
    assert r.choices[0].message.content == text


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}}}}}, "response_format"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"grammar": "root ::= undefined-rule"}, "grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_field(smol, extra, param):
    c, mid = oc(smol), model_id(smol)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=mid, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                  extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
