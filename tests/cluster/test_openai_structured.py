"""Structured outputs over HTTP: the OpenAI app (the one Ray Serve runs) on loopback
uvicorn, the real AsyncLLM on a random-weight llama, the official openai client.
response_format json_schema and json_object on chat and completions, vLLM's
structured_outputs extra body (json, regex, choice, grammar), streaming and not; bad
schemas, regexes and unknown fields are 400s naming the problem."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from structured_workload import FLAG, PERSON, POINTS
from test_openai_fakes import real_engine_client

MODEL = "tiny-struct"


@pytest.fixture(scope="module")
def client(llama_path):
    with real_engine_client(llama_path, MODEL, max_num_seqs=16) as client:
        yield client


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


POINTS_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "points", "schema": POINTS, "strict": True}}


def _many(client, bodies: list[dict]) -> list[tuple[str, str]]:
    """(text, finish_reason) of concurrent chat requests through the async openai client."""
    async def main():
        async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused",
                                      max_retries=0, timeout=300) as aclient:
            rs = await asyncio.gather(*(aclient.chat.completions.create(**b) for b in bodies))
        return [(r.choices[0].message.content, r.choices[0].finish_reason) for r in rs]

    return asyncio.run(main())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_never_runs_out_of_tokens_on_whitespace(client, temperature):
    """32 requests on the random model, whose JSON is the grammar's alone: with whitespace
    runs bounded (JSON_MAX_WHITESPACE) every one is a complete object within 200 tokens
    (unbounded, 12 of these 32 ran out on blanks)."""
    bodies = [dict(model=MODEL, max_tokens=200, temperature=temperature, seed=i,
                   response_format=POINTS_FORMAT,
                   messages=[{"role": "user", "content": f"request {i}: give me json"}])
              for i in range(32)]
    for text, finish in _many(client, bodies):
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), POINTS)


def test_json_mode_is_an_object(client):
    """response_format json_object and structured_outputs json_object: a JSON object, never
    an array or a scalar (xgrammar's builtin JSON grammar allowed both), and a whole one
    within max_tokens. Free-form strings end only when the model writes a quote, which
    the random model rarely does (1 token of its 512 holds one): before the closer
    (json_closing) most of these requests ran out of tokens mid-string."""
    bodies = [dict(model=MODEL, max_tokens=200, temperature=t, seed=i,
                   messages=[{"role": "user", "content": f"request {i}: json please"}],
                   **({"response_format": {"type": "json_object"}} if i % 2 else
                      {"extra_body": {"structured_outputs": {"json_object": True}}}))
              for i in range(16) for t in (0.0, 1.0)]
    results = _many(client, bodies)
    assert len(results) == 32
    for text, finish in results:
        assert finish == "stop", (text, finish)
        assert isinstance(json.loads(text), dict), text
    # The closer steers only the last few tokens: most objects are long (when written,
    # the median was 402 characters; a request the closer cut short would be "{}").
    lengths = sorted(len(text) for text, _ in results)
    assert lengths[len(lengths) // 2] > 100, lengths
