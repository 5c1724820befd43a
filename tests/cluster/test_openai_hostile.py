"""Hostile input and security defaults of the HTTP surface, on the fake engine behind the real
routes and the real intake (uvicorn on loopback, httpx and the openai client): the seven
requests issue 30 found mishandled, every request limit with its status and message, the
fields raylm refuses, the API key on every route, error bodies without paths or frames,
CORS, /openapi.json, /tokenize, /detokenize, /version."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import openai
import pytest
from test_openai_fakes import FakeEngine, running_server

from raylm.cluster.serve.deployment.deployment_config import HTTPServerConfig
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.routes import REQUEST_BODIES, ModelBackend, build_openai_api
from raylm.scheduler.intake import RequestLimits

MODEL = "fake-llama"
KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024
LIMITS = RequestLimits(max_n=8, max_logprobs=5, max_stop_strings=4, max_stop_string_chars=32,
                       max_logit_bias=3, max_structured_output_chars=2000,
                       grammar_compile_timeout_s=0.5)
# A JSON schema that is 90 characters long and takes seconds to parse into a grammar:
# xgrammar expands the nested counted repetitions of its pattern (about 6 s on one core).
SLOW_SCHEMA = {"type": "string",
               "pattern": "^" + "-".join(["([a-z0-9]{1,220}\\.){1,220}"] * 2) + "$"}


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.input_processor.limits = LIMITS
    return engine


@pytest.fixture(scope="module")
def url(engine):
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL))}, {MODEL: KEY},
                           HTTPServerConfig(max_request_body_bytes=BODY_LIMIT, max_json_depth=16))
    with running_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def default_url(tokenizer):
    """A server with every default: no key, 16 MiB bodies, depth 64, the engine's limits."""
    engine = FakeEngine(tokenizer)
    with running_server(build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL))})
                        ) as base:
        yield base


def post(url: str, route: str, body: dict | bytes, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{route}", content=content, timeout=60,
                      headers={"content-type": "application/json", **AUTH, **headers})


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}


# ---- the seven requests of issue 30 -------------------------------------------------------

def test_n_100000_is_refused_at_once(default_url):
    start = time.monotonic()
    err = error_of(post(default_url, "/v1/completions", completion(n=100000)), 400)
    assert time.monotonic() - start < 5
    assert err["param"] == "n"
    assert "n=100000 exceeds this server's limit of 128 completions" in err["message"]


@pytest.mark.parametrize("raw, field", [(b"Infinity", "Infinity"), (b"-Infinity", "-Infinity"),
                                        (b"NaN", "NaN")])
def test_non_finite_temperature_is_a_400(url, raw, field):
    body = b'{"model": "fake-llama", "prompt": "x", "temperature": ' + raw + b"}"
    err = error_of(post(url, "/v1/completions", body), 400)
    assert f"{field} is not a JSON number" in err["message"]


def test_number_that_overflows_to_infinity_is_a_400(url):
    body = b'{"model": "fake-llama", "prompt": "x", "top_p": 1e999}'
    err = error_of(post(url, "/v1/completions", body), 400)
    assert err["param"] == "top_p" and "out of range" in err["message"]


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", '{"model": "fake-llama", "prompt": "\\ud800abc"}', "prompt"),
    ("/v1/chat/completions",
     '{"model": "fake-llama", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
     "messages"),
    ("/tokenize", '{"model": "fake-llama", "prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogate_is_a_400_not_an_engine_error(url, route, body, field):
    err = error_of(post(url, route, body.encode()), 400)
    assert err["type"] == "BadRequestError" and err["param"] == field
    assert "lone UTF-16 surrogate" in err["message"] and "TextEncodeInput" not in err["message"]


def test_surrogate_in_offline_prompt_is_refused_by_the_intake(engine):
    from raylm.scheduler.request import InvalidRequestError
    from raylm.scheduler.sampling_params import SamplingParams

    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate"):
        engine.input_processor.process("\ud800abc", SamplingParams())


def test_body_nested_50000_deep_is_openai_json(default_url):
    body = b'{"model": "fake-llama", "prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}"
    err = error_of(post(default_url, "/v1/completions", body), 400)
    assert "nested more than 64 levels deep" in err["message"]


def test_body_nested_past_the_limit_names_where(url):
    deep: dict = {}
    node = deep
    for _ in range(20):
        node["x"] = {}
        node = node["x"]
    err = error_of(post(url, "/v1/completions", completion(chat_template_kwargs=deep)), 400)
    assert "nested more than 16 levels deep at body.chat_template_kwargs.x" in err["message"]
    assert err["param"] == "chat_template_kwargs"


def test_100000_stop_strings_are_refused(url, default_url):
    err = error_of(post(default_url, "/v1/completions", completion(stop=["a"] * 100000)), 400)
    assert err["param"] == "stop"
    assert "stop has 100000 strings, more than the 64 this server allows" in err["message"]
    err = error_of(post(url, "/v1/completions", completion(stop=["a"] * 100000)), 413)
    assert "max_request_body_bytes" in err["message"]  # 600 kB: past this one's body limit
    err = error_of(post(url, "/v1/completions", completion(stop=["a"] * 5)), 400)
    assert err["param"] == "stop" and "stop has 5 strings, more than the 4" in err["message"]
    err = error_of(post(url, "/v1/completions", completion(stop=["b" * 33])), 400)
    assert "a stop string has 33 characters, more than the 32" in err["message"]


@pytest.mark.parametrize("bias, message", [
    ({"abc": 1}, "logit_bias keys must be token ids (decimal integers), got 'abc'"),
    ({"999999999": 1}, "logit_bias token ids [999999999] are outside the vocabulary [0, 512)"),
    ({"-3": 1}, "logit_bias keys must be token ids"),
    ({"1": 1, "2": 1, "3": 1, "4": 1}, "logit_bias has 4 entries, more than the 3"),
])
def test_bad_logit_bias_is_refused(url, engine, bias, message):
    before = len(engine.seen)
    err = error_of(post(url, "/v1/completions", completion(logit_bias=bias)), 400)
    assert err["param"] == "logit_bias" and message in err["message"]
    assert len(engine.seen) == before


def test_logit_bias_reaches_the_engine_clamped(url, engine):
    r = post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "logit_bias": {
        "300": 250, "301": -5.5}, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert engine.seen[-1][1].logit_bias == {300: 100.0, 301: -5.5}


# ---- the other limits ---------------------------------------------------------------------

def test_body_size_is_a_413_from_the_declared_length_or_the_bytes(url):
    big = completion(prompt="word " * (BODY_LIMIT // 5))
    err = error_of(post(url, "/v1/completions", big), 413)
    assert err["type"] == "RequestTooLargeError" and f"the {BODY_LIMIT} this" in err["message"]

    def chunks():  # no Content-Length: refused once the stream passes the limit
        yield b'{"model": "fake-llama", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json", **AUTH})
    error_of(r, 413)


@pytest.mark.parametrize("route, fields, param, message", [
    ("/v1/completions", {"logprobs": 6}, "logprobs", "logprobs=6 exceeds max_logprobs=5"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "logprobs",
     "logprobs=6 exceeds max_logprobs=5"),
    ("/v1/completions", {"n": 9}, "n", "n=9 exceeds this server's limit of 8"),
    ("/v1/completions", {"max_tokens": 10**30}, "max_tokens",
     "less than or equal to 9223372036854775807"),
    ("/v1/completions", {"seed": -(10**30)}, "seed",
     "greater than or equal to -9223372036854775807"),
    ("/v1/completions", {"top_k": 2**64}, "top_k", "less than or equal to 9223372036854775807"),
    ("/v1/completions", {"stop_token_ids": [512]}, "stop_token_ids",
     "stop_token_ids token ids [512] are outside the vocabulary"),
    ("/v1/completions", {"structured_outputs": {"regex": "a" * 2001}}, "structured_outputs",
     "2001 characters, more than the 2000"),
    ("/v1/completions", {"max_tokens": 500}, "max_tokens", "exceeds max_model_len=128"),
    ("/v1/completions", {"prompt": "word " * 200}, "prompt", "max_model_len=128"),
])
def test_request_limits_are_400s_naming_the_field(url, engine, route, fields, param, message):
    body = completion(**fields) if route == "/v1/completions" else {
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
        **fields}
    before = len(engine.seen)
    err = error_of(post(url, route, body), 400)
    assert err["param"] == param and message in err["message"], err
    assert len(engine.seen) == before


def test_slow_grammar_times_out_without_stalling_other_requests(url, engine):
    """The spec's compile runs off the event loop: a plain request answers at once while
    it runs; the slow one is refused after grammar_compile_timeout_s, and at once when it
    comes again."""
    results: dict = {}

    def slow():
        results["slow"] = post(url, "/v1/completions", completion(
            structured_outputs={"json": SLOW_SCHEMA}))

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    r = post(url, "/v1/completions", completion())
    assert r.status_code == 200 and time.monotonic() - start < 2.0
    thread.join(30)
    err = error_of(results["slow"], 400)
    assert "took longer than 0.5 s to compile" in err["message"]
    start = time.monotonic()
    err = error_of(post(url, "/v1/completions", completion(
        structured_outputs={"json": SLOW_SCHEMA})), 400)
    assert "took longer than 0.5 s" in err["message"] and time.monotonic() - start < 1.0


# ---- fields raylm refuses or ignores --------------------------------------------------------

@pytest.mark.parametrize("route, fields, name", [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
])
def test_output_changing_fields_raylm_lacks_are_refused(url, engine, route, fields, name):
    body = completion(**fields) if route == "/v1/completions" else {
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
        **fields}
    before = len(engine.seen)
    err = error_of(post(url, route, body), 400)
    assert name in err["message"] and err["param"] == name, err
    assert len(engine.seen) == before


def test_unknown_fields_are_accepted_and_logged(url, caplog):
    with caplog.at_level(logging.INFO, logger="raylm.cluster.serve.handlers.serving"):
        r = post(url, "/v1/completions", completion(store=True, metadata={"a": "b"},
                                                    brand_new_field=1, best_of=1))
    assert r.status_code == 200, r.text
    logged = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert logged and "brand_new_field" in logged[0] and "store" in logged[0]


# ---- security defaults ----------------------------------------------------------------------

def test_api_key_guards_every_route_but_health(url):
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/models/fake-llama"),
                         ("GET", "/metrics"), ("GET", "/version"), ("GET", "/openapi.json"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/no/such/route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, f"{url}{path}", headers=headers, content=b"{not json")
            err = error_of(r, 401)
            assert err["type"] == "AuthenticationError", (path, headers)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_public_metrics_and_per_model_keys(engine):
    backends = {MODEL: ModelBackend.local(OpenAIServing(engine, MODEL)),
                "other": ModelBackend.local(OpenAIServing(engine, "other"))}
    app = build_openai_api(backends, {MODEL: "k1", "other": "k2"},
                           HTTPServerConfig(public_metrics=True))
    with running_server(app) as base:
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.get(f"{base}/v1/models").status_code == 401
        body = completion()
        assert post(base, "/v1/completions", body, Authorization="Bearer k1").status_code == 200
        err = error_of(post(base, "/v1/completions", body, Authorization="Bearer k2"), 401)
        assert "API key" in err["message"]  # k2 is the other model's key


def test_key_check_compares_every_key_by_digest(engine):
    from starlette.datastructures import Headers

    from raylm.cluster.serve.openai_api.routes import OpenAIRoutes

    routes = OpenAIRoutes({}, {"a": "k1", "b": "k2" * 1000})
    assert all(len(d) == 32 for d in routes._digests.values())  # fixed length: no length leak
    assert routes.authorized(Headers({"authorization": "Bearer k1"}), None)
    assert routes.authorized(Headers({"authorization": "Bearer " + "k2" * 1000}), "b")
    assert not routes.authorized(Headers({"authorization": "Bearer k1"}), "b")
    assert not routes.authorized(Headers({}), None)


class _BrokenBackend:
    def stream(self, route, body):
        async def gen():
            raise RuntimeError("boom in /usr/lib/python3.11/site-packages/raylm/x.py:12\n"
                               'Traceback (most recent call last):\n  File "/work/a.py"')
            yield  # pragma: no cover

        return gen()

    async def model_card(self):
        raise KeyError("/srv/models/secret/config.json")

    async def check_health(self):
        return None

    async def metrics(self):
        return []


def test_error_bodies_carry_no_paths_or_frames():
    with running_server(build_openai_api({MODEL: _BrokenBackend()})) as base:
        for r in (httpx.post(f"{base}/v1/completions", json=completion()),
                  httpx.get(f"{base}/v1/models")):
            err = error_of(r, 500)
            assert "/usr/" not in err["message"] and "/srv/" not in err["message"]
            assert "Traceback" not in err["message"] and "File " not in err["message"]
            assert "<path>" in err["message"]


def test_cors_is_off_by_default_and_follows_the_flags(url, engine):
    r = httpx.get(f"{url}/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL))}, {MODEL: KEY},
                           HTTPServerConfig(allowed_origins=["https://ui.example"],
                                            allowed_methods=["POST"],
                                            allowed_headers=["Authorization", "Content-Type"]))
    with running_server(app) as base:
        pre = httpx.options(f"{base}/v1/completions", headers={
            "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200  # a preflight carries no key
        assert pre.headers["access-control-allow-origin"] == "https://ui.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = post(base, "/v1/completions", completion(), Origin="https://ui.example")
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        r = post(base, "/v1/completions", completion(), Origin="https://evil.example")
        assert "access-control-allow-origin" not in r.headers


# ---- /openapi.json, /tokenize, /detokenize, /version ----------------------------------------

def test_openapi_documents_every_request_body(url):
    spec = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    schemas = spec["components"]["schemas"]
    for route, models in REQUEST_BODIES.items():
        body = spec["paths"][route]["post"]["requestBody"]["content"]["application/json"]
        refs = [body["schema"]] if "$ref" in body["schema"] else body["schema"]["anyOf"]
        assert {r["$ref"].rsplit("/", 1)[1] for r in refs} == {m.__name__ for m in models}
    chat = schemas["ChatCompletionRequest"]
    assert {"messages", "tools", "tool_choice", "logit_bias", "response_format"} <= set(
        chat["properties"])
    assert "ChatMessage" in schemas and "ChatCompletionTool" in schemas


def test_tokenize_detokenize_and_version(url, tokenizer):
    r = post(url, "/tokenize", {"model": MODEL, "prompt": "hello world",
                                "return_token_strs": True}).json()
    ids = tokenizer("hello world").input_ids
    assert r == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                 "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "hi there"}]
    r = post(url, "/tokenize", {"model": MODEL, "messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    assert r["token_strs"] is None
    assert post(url, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {
        "prompt": "hello world"}
    err = error_of(post(url, "/detokenize", {"model": MODEL, "tokens": [5, 512]}), 400)
    assert "tokens [512] are outside the vocabulary" in err["message"]
    error_of(post(url, "/tokenize", {"model": "nope", "prompt": "x"}), 404)
    from raylm import __version__

    assert httpx.get(f"{url}/version", headers=AUTH).json() == {"version": __version__}


def test_replica_that_answers_http_takes_the_app_http_settings(tokenizer):
    """raylm serve's layout (ingress_in_replica): the replica's own app gets the app
    config's http_server and the model's api_key."""
    from raylm.cluster.serve.deployment.app import LLMIngressServer

    server = LLMIngressServer({"model_loading_config": {"model_id": MODEL}, "api_key": KEY},
                              engine_factory=lambda cfg: FakeEngine(tokenizer),
                              http_server={"allowed_origins": ["https://ui.example"],
                                           "max_request_body_bytes": 1000,
                                           "public_metrics": True})
    with running_server(server.__serve_build_asgi_app__()) as base:
        assert httpx.get(f"{base}/metrics").status_code == 200
        error_of(httpx.get(f"{base}/v1/models"), 401)
        error_of(post(base, "/v1/completions", completion(prompt="x" * 2000)), 413)
        r = post(base, "/v1/completions", completion(), Origin="https://ui.example")
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
