"""What a client sends cannot crash the server, and the API key never reaches its log
(issue 34).

- Nesting: a value nested 900 deep in any field of a completions or chat request, or a
  whole body of 100,000 "[", is a 400 naming the field and the limit (it was a 500:
  check_text recursed, and so does json.loads); a value just under the limit is a 200
  or a 400, never a 5xx; a schema given as JSON text is checked too.
- The key: /dashboard?key=KEY is a 303 to /dashboard that sets an HttpOnly, SameSite=
  Lax cookie, which opens the event stream; the access log shows every key=... in
  every URL, accepted or refused, as key=REDACTED.

In process where it can be (the checks, the filter, the app with a fake engine), then a
real server (test_serve.py's Server) with --api-key at --log-level info, whose whole log
is read at the end: no key in it, no traceback, and it still serves.
"""
from __future__ import annotations

import json
import logging

import httpx
import pytest
from fastapi.testclient import TestClient

from nanopaged.dashboard.routes import DashboardServer
from nanopaged.entrypoints.openai import auth
from nanopaged.entrypoints.openai.api_server import build_app
from nanopaged.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from nanopaged.sampling_params import StructuredOutputsParams
from nanopaged.utils.checks import MAX_NESTING_DEPTH, check_json_nesting, check_text

from serve_harness import FakeEngine
from serve_harness import KEY, TINY_ARGS, running_server

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Hello, my name is"}]
BASES = {"/v1/completions": {"prompt": "Hello, my name is", "max_tokens": 1},
         "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 1}}
FIELDS = [(path, f.alias or name) for path, model in (("/v1/completions", CompletionRequest),
                                                      ("/v1/chat/completions", ChatCompletionRequest))
          for name, f in model.model_fields.items()]
# fields no model has: extra="allow" keeps them (and logs their names)
FIELDS += [(path, name) for path in BASES for name in ("metadata", "tools", "tool_choice")]


def nested(depth: int, kind: str = "list"):
    """A value `depth` containers deep: [[[...[1]...]]] or {"a": {"a": ... 1}}."""
    value = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


# -- in process ------------------------------------------------------------------------------

def test_check_text_walks_any_depth_without_recursing_and_refuses_past_the_limit():
    check_text("stop", nested(MAX_NESTING_DEPTH))                          # at the limit: fine
    for value in (nested(5000), nested(5000, "dict"), nested(MAX_NESTING_DEPTH + 1)):
        with pytest.raises(ValueError, match=rf"chat_template_kwargs nests lists / objects at least "
                                             rf"{MAX_NESTING_DEPTH + 1} levels deep, more than the limit of "
                                             rf"{MAX_NESTING_DEPTH}"):
            check_text("chat_template_kwargs", value)
    loop: list = []
    loop.append(loop)                           # a value that holds itself: refused, not a hang
    with pytest.raises(ValueError, match="levels deep"):
        check_text("x", loop)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\] is not valid Unicode"):
        check_text("messages", [{"role": "user", "content": ["ok", "\udfff"]}])
    with pytest.raises(ValueError, match=r"x\.a key is not valid Unicode"):
        check_text("x", {"a": {"k\udfff": 1}})


def test_json_nesting_counts_brackets_outside_strings_and_names_the_key():
    body = json.dumps({"prompt": "[[[{{{" * 1000, "stop": ["]]]"], "x": nested(100)})
    check_json_nesting("the request body", body)             # brackets in strings do not count
    check_json_nesting("b", b'{"p": [' + b"[1]," * 100_000 + b"[1]]}")         # many, but shallow
    deep = json.dumps({"model": "m", "chat_template_kwargs": {"k": nested(900)}})
    with pytest.raises(ValueError, match=r'the request body nests JSON arrays / objects 902 levels deep '
                                         r'\(under its key "chat_template_kwargs"\), more than the limit of 128'):
        check_json_nesting("the request body", deep)
    with pytest.raises(ValueError, match="100000 levels deep, more"):
        check_json_nesting("the request body", b"[" * 100_000)
    with pytest.raises(ValueError, match=r'129 levels deep \(under its key "a\\"\["\)'):
        check_json_nesting("b", json.dumps({"a\"[": nested(128)}))


def test_deep_chat_template_kwargs_are_a_value_error_offline_too():
    """The issue's case, where LLM.chat and the REPL meet it: check_text recursed."""
    from nanopaged.engine.processor import check_chat_template_kwargs
    with pytest.raises(ValueError, match="chat_template_kwargs nests lists / objects at least 129 levels"):
        check_chat_template_kwargs({"enable_thinking": nested(900, "dict")})


def test_a_schema_as_deep_json_text_is_a_value_error_not_a_recursion_error():
    from nanopaged.structured_output.manager import validate
    for depth in (900, 100_000):
        with pytest.raises(ValueError, match=rf"StructuredOutputsParams.json nests JSON arrays / objects "
                                             rf"{depth} levels deep"):
            validate(StructuredOutputsParams(json="[" * depth + "]" * depth))
    with pytest.raises(ValueError, match="StructuredOutputsParams.json nests lists / objects"):
        StructuredOutputsParams(json=nested(900, "dict"))


def test_redact_url_hides_every_secret_looking_parameter():
    r = auth.redact_url
    assert r("/v1/models?key=K") == "/v1/models?key=REDACTED"
    assert r("/dashboard?a=1&key=K&b=2") == "/dashboard?a=1&key=REDACTED&b=2"
    assert r("/x?api_key=K&API-KEY=K&token=K&access_token=K&k%65y=K&key") == \
        "/x?api_key=REDACTED&API-KEY=REDACTED&token=REDACTED&access_token=REDACTED&k%65y=REDACTED&key=REDACTED"
    assert r("/x?monkey=1&keys=2&page=3") == "/x?monkey=1&keys=2&page=3"
    assert r("/v1/models") == "/v1/models"
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', (
        "127.0.0.1:5", "GET", "/dashboard/events?key=sk-secret", "1.1", 200), None)
    assert auth.RedactSecrets().filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "GET /dashboard/events?key=REDACTED HTTP/1.1" 200'


def test_the_dashboard_trades_the_key_once_for_a_cookie():
    app = build_app(FakeEngine(), "m", api_key=KEY)
    with TestClient(app) as client:
        r = client.get(f"/dashboard?view=1&key={KEY}", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/dashboard?view=1"
    cookie = r.headers["set-cookie"]
    attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")}
    assert {"httponly", "path", "samesite"} <= attrs and "Path=/dashboard" in cookie, cookie
    assert "samesite=lax" in cookie.lower() and KEY not in cookie, cookie
    value = cookie.split(";")[0].split("=", 1)[1]
    assert value == auth.cookie_value(KEY, DashboardServer.cookie)
    with TestClient(app) as client:             # a fresh client each time: no cookie jar between
        get = lambda path, cookie=None, **kw: client.get(  # noqa: E731
            path, headers={"Cookie": f"{DashboardServer.cookie}={cookie}"} if cookie else {}, **kw)
        # (the stream never ends: that the cookie opens it is tested on a real server below)
        assert get("/dashboard", value).status_code == 200
        for path in ("/dashboard", "/dashboard/events"):
            assert get(path).status_code == 401, path
            assert get(path, "0" * 64).status_code == 401, path
        # the key goes in the URL of the page only; the cookie opens nothing but the dashboard
        assert get(f"/dashboard/events?key={KEY}").status_code == 401
        assert get("/v1/models", value).status_code == 401
        assert get(f"/v1/models?key={KEY}").status_code == 401
        assert get("/dashboard?key=wrong", follow_redirects=False).status_code == 401
        assert client.get("/dashboard", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# -- a real server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir, "--api-key", KEY, *TINY_ARGS, "--log-level", "info") as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def _post_raw(http, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, field", FIELDS, ids=[f"{'chat' if 'chat' in p else 'cmpl'}-{f}" for p, f in FIELDS])
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_value_900_deep_in_any_field_is_a_400_naming_it(http, path, field, kind):
    r = http.post(path, json={**BASES[path], field: nested(900, kind)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert f'"{field}"' in err["message"] and "the limit of 128" in err["message"], err["message"]
    # just under the limit (the body 127 deep) the field's own checks answer: never a 5xx
    r = http.post(path, json={**BASES[path], field: nested(MAX_NESTING_DEPTH - 2, kind)})
    assert r.status_code in (200, 400), r.text


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_chat_template_kwargs_900_deep_is_a_400_and_just_under_the_limit_is_used(http, kind):
    """Field case C77 (nested 900 deep): the issue's request (a 500 RecursionError from
    check_text), and a value the walk
    takes whole and hands to the template: a 200."""
    chat = BASES["/v1/chat/completions"]
    r = http.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"enable_thinking": nested(900, kind)}})
    assert r.status_code == 400 and '"chat_template_kwargs"' in r.json()["error"]["message"], r.text
    kwargs = {"x": nested(MAX_NESTING_DEPTH - 3, kind)}                  # the body: 128 deep
    r = http.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [b"[" * 100_000, b"[" * 900 + b"]" * 900, b'{"a":' * 900 + b"1" + b"}" * 900,
                                  b'{"prompt": "hi", "x": ' + b"[" * 100_000],
                         ids=["100000-open", "900-list", "900-object", "100000-under-a-key"])
@pytest.mark.parametrize("path", list(BASES))
def test_a_whole_body_nested_deep_is_a_400(http, path, body):
    r = _post_raw(http, path, body)
    assert r.status_code == 400, r.text
    assert "levels deep" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", list(BASES))
def test_a_schema_in_json_text_nested_deep_is_a_400(http, path):
    for deep in ("[" * 900 + "]" * 900, "[" * 100_000):
        r = http.post(path, json={**BASES[path], "guided_json": deep})
        assert r.status_code == 400 and "StructuredOutputsParams.json nests" in r.text, r.text
        r = http.post(path, json={**BASES[path], "structured_outputs": {"json": deep}})
        assert r.status_code == 400 and "StructuredOutputsParams.json nests" in r.text, r.text


def test_a_text_part_that_is_not_a_str_is_a_400_saying_so(http):
    for text in (["x"], {"a": nested(50)}):
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}], "max_tokens": 1})
        assert r.status_code == 400 and "text content part's text must be a str" in r.text, r.text


def test_the_dashboard_cookie_flow_through_a_real_server(server):
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=True) as browser:   # as a browser
        r = browser.get("/dashboard", params={"key": KEY})
        assert r.status_code == 200 and "<html" in r.text and r.url.query == b""
        assert [h.status_code for h in r.history] == [303]
        assert DashboardServer.cookie in browser.cookies and KEY not in r.history[0].headers["set-cookie"]
        with browser.stream("GET", "/dashboard/events") as events:          # the cookie opens it
            assert events.status_code == 200
            lines = events.iter_lines()
            assert next(lines) == ": nanopaged dashboard"
            assert any(line.startswith("data: {") for line in lines)
    with httpx.Client(base_url=server.url, timeout=30) as stranger:
        assert stranger.get("/dashboard/events").status_code == 401
        assert stranger.get("/dashboard").status_code == 401


def test_zz_the_key_never_reaches_the_log_and_the_server_still_serves(server, http):
    """Field case C70 (the key in the log: with --api-key K at --log-level info, after
    /dashboard?key=K and /v1/models?key=K, K appears nowhere in the server's output).
    Last: reads the log of every test above, then asks more of its own."""
    no_auth = httpx.Client(base_url=server.url, timeout=30)
    with no_auth:
        assert no_auth.get("/v1/models", params={"key": KEY}).status_code == 401
        assert no_auth.get("/v1/models", params={"api_key": KEY}).status_code == 401
        assert no_auth.get(f"/v1/models?k%65y={KEY}").status_code == 401
        assert no_auth.get("/dashboard", params={"key": KEY + "x"}).status_code == 401
        assert no_auth.get("/dashboard/events", params={"key": KEY}).status_code == 401
        assert no_auth.get("/dashboard/static/dashboard.js", params={"key": KEY}).status_code == 200
        assert no_auth.get("/dashboard", params={"key": KEY}).status_code == 303
        assert no_auth.post("/v1/completions", params={"key": KEY}, json=BASES["/v1/completions"]).status_code == 401
    r = http.post("/v1/completions", json={"prompt": "Hello, my name is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert http.get("/health").status_code == 200
    server.log.seek(0)
    log = server.log.read()
    assert '"GET /dashboard?key=REDACTED HTTP/1.1" 303' in log        # the access log is on, and filtered
    assert '"GET /v1/models?key=REDACTED HTTP/1.1" 401' in log
    assert KEY not in log
    assert "Traceback" not in log and "RecursionError" not in log and " 500 " not in log
