"""Structured outputs over HTTP: the OpenAI app (the one Ray Serve runs) on loopback
uvicorn, the real AsyncLLM on a random-weight llama, the official openai client.
response_format json_schema and json_object on chat and completions, vLLM's
structured_outputs extra body (json, regex, choice, grammar), streaming and not; bad
schemas, regexes and unknown fields are 400s naming the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from structured_workload import FLAG, PERSON
from test_openai_fakes import running_server

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.serve.routes import LocalBackend, build_openai_api
from raylm.cluster.serve.serving import OpenAIServing

MODEL = "tiny-struct"


@pytest.fixture(scope="module")
def client(llama_path):
    engine = AsyncLLM.from_engine_args(llama_path, max_num_seqs=16)
    app = build_openai_api({MODEL: LocalBackend(OpenAIServing(engine, MODEL))})
    try:
        with running_server(app) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    finally:
        engine.shutdown()


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_response_format_json_schema_and_object(client, stream):
    for fmt, schema in ((_schema_format(FLAG), FLAG), ({"type": "json_object"}, None)):
        body = dict(model=MODEL, messages=[{"role": "user", "content": "give me json"}],
                    max_tokens=300, temperature=0, response_format=fmt)
        if stream:
            chunks = list(client.chat.completions.create(**body, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.chat.completions.create(**body)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", (text, finish)
        value = json.loads(text)
        if schema is not None:
            jsonschema.validate(value, schema)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_completions_structured_outputs_extra_body(client, stream):
    cases = [({"json": PERSON, "disable_any_whitespace": True},
              lambda t: jsonschema.validate(json.loads(t), PERSON)),
             ({"regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t) or 1 / 0),
             ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta") or 1 / 0),
             ({"grammar": 'root ::= "x" ("y" | "z")'}, lambda t: t in ("xy", "xz") or 1 / 0)]
    for so, ok in cases:
        body = dict(model=MODEL, prompt="the model says", max_tokens=200, temperature=0,
                    extra_body={"structured_outputs": so})
        if stream:
            chunks = list(client.completions.create(**body, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.completions.create(**body)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert finish == "stop", (so, text, finish)
        ok(text)
    # response_format works on completions too. Whitespace between JSON tokens is free by
    # default (as vLLM); a random-weight model may spend every token on it for some prompts.
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=300,
                                  temperature=0, extra_body={"response_format":
                                                             _schema_format(FLAG)})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), FLAG)


def test_bad_structured_outputs_are_400(client):
    bad = [
        ({"response_format": _schema_format({"type": "object", "properties": {
            "a": {"type": "frobnicate"}}})}, "frobnicate"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
        ({"structured_outputs": {"json": "{oops"}}, "not valid JSON"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "cannot both"),
    ]
    for extra, needle in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=5,
                                           messages=[{"role": "user", "content": "hi"}],
                                           extra_body=extra)
        assert err.value.status_code == 400
        assert needle in str(err.value), (needle, str(err.value))
    # The server is unharmed.
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["ok"]}})
    assert r.choices[0].text == "ok"
