"""A stream whose backend fails after the first SSE line (a replica or its node died
mid-generation) ends with an SSE error event in OpenAI's error shape, over real HTTP; the
connection is not cut mid-chunk. A failure after ``data: [DONE]`` (the replica died before
its generator's end reached the ingress: the chaos soak met it) adds nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
from test_openai_fakes import running_server

from raylm.cluster.serve.openai_api.routes import build_openai_api


class _DiesMidStream:
    def __init__(self, after_done: bool = False) -> None:
        self.after_done = after_done

    async def stream(self, route: str, body: dict[str, Any]):
        yield 'data: {"choices": [{"text": "a"}]}\n\n'
        yield 'data: {"choices": [{"text": "b"}]}\n\n'
        if self.after_done:
            yield 'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
        raise RuntimeError("ActorDiedError: the replica's node died")

    async def model_card(self) -> dict[str, Any]:
        return {"id": "m", "object": "model"}

    async def check_health(self) -> None:
        return None

    async def metrics(self) -> list[Any]:
        return []


def test_failure_after_the_first_line_is_an_sse_error_event():
    with running_server(build_openai_api({"m": _DiesMidStream()})) as url:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"model": "m", "prompt": "x", "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    error = json.loads(events[2])["error"]
    assert error["code"] == 500 and "the replica's node died" in error["message"], error
    assert len(events) == 3


def test_failure_after_done_leaves_the_finished_stream_as_it_was():
    with running_server(build_openai_api({"m": _DiesMidStream(after_done=True)})) as url:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"model": "m", "prompt": "x", "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 4, events
    assert not any("error" in e for e in events), events
