"""API pieces real clients rely on: CORS for browser apps (--allowed-origins, preflight),
X-Request-Id accepted or made, returned and logged, HEAD on the probes,
GET /v1/models/{id} (openai's models.retrieve), and fields specd does not implement
refused with a 400 naming them instead of silently ignored."""
import json

import openai
import pytest
import requests

from conftest import TINY

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def srv(request):
    from conftest import Server
    s = Server(TINY, "--allowed-origins", f"{ORIGIN},https://other.example", "--api-key", "k", name="gaps")
    yield s
    s.stop()


AUTH = {"Authorization": "Bearer k"}


def test_cors_preflight_and_request(srv):
    pre = requests.options(srv.url + "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, timeout=5)
    assert pre.status_code == 204                         # no key needed for a preflight
    assert pre.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    r = srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}, headers=dict(AUTH, Origin=ORIGIN))
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN and r.headers["Vary"] == "Origin"
    # errors carry the headers too, so a browser app can read them
    r = srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    # an origin not in the list gets no CORS headers (the browser then refuses)
    bad = requests.options(srv.url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}, timeout=5)
    assert bad.status_code == 204 and "Access-Control-Allow-Origin" not in bad.headers
    r = srv.post("/v1/completions", {"prompt": [1], "max_tokens": 1}, headers=dict(AUTH, Origin="https://evil.example"))
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    # streaming too
    with requests.post(srv.url + "/v1/completions", json={"prompt": [1], "max_tokens": 3, "stream": True},
                       headers=dict(AUTH, Origin=ORIGIN), stream=True, timeout=30) as s:
        assert s.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert b"[DONE]" in s.content


def test_no_cors_without_allowed_origins(server_factory):
    s = server_factory(TINY, name="nocors")
    pre = requests.options(s.url + "/v1/chat/completions", headers={"Origin": ORIGIN,
                                                                     "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and "Access-Control-Allow-Origin" not in pre.headers
    assert requests.options(s.url + "/nope", timeout=5).status_code == 404


def test_request_id_returned_and_logged(srv):
    r = srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}, headers=dict(AUTH, **{"X-Request-Id": "trace-42.a"}))
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "trace-42.a"
    made = srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}, headers=AUTH).headers["X-Request-Id"]
    assert made.startswith("req-") and len(made) > 8
    odd = srv.post("/v1/completions", {"prompt": [1], "max_tokens": 1},
                   headers=dict(AUTH, **{"X-Request-Id": "has space"})).headers["X-Request-Id"]
    assert odd.startswith("req-")                          # not echoed into headers and logs
    assert requests.get(srv.url + "/health", timeout=5).headers["X-Request-Id"].startswith("req-")
    assert "rid=trace-42.a" in srv.log_text()


def test_head_on_probes(srv):
    for path in ("/health", "/ready", "/version", "/metrics"):
        r = requests.head(srv.url + path, timeout=5)
        assert r.status_code == 200, path
        assert r.content == b""
    r = requests.post(srv.url + "/health", timeout=5)
    assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD"


def test_models_retrieve(srv):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    name = c.models.list().data[0].id
    m = c.models.retrieve(name)
    assert m.id == name and m.object == "model" and m.owned_by == "specd"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("field,value", [
    ("best_of", 3),
    ("continue_final_message", True), ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}), ("tool_choice", "sometimes"),
    ("parallel_tool_calls", "yes"),
])
def test_unimplemented_fields_are_400_naming_them(srv, field, value):
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                          field: value}, headers=AUTH)
    # llama-tiny has no chat template: the field must be refused before the template is
    assert r.status_code == 400, (field, r.status_code, r.text)
    assert r.json()["error"]["param"] == field


def test_accepted_values_still_work(srv):
    for body in ({"best_of": 1}, {"best_of": 2, "n": 2}, {"tool_choice": "auto"}, {"tool_choice": "none"},
                 {"parallel_tool_calls": False}, {"continue_final_message": False}):
        r = srv.post("/v1/completions", dict({"prompt": [1, 2], "max_tokens": 1}, **body), headers=AUTH)
        assert r.status_code == 200, (body, r.text)
