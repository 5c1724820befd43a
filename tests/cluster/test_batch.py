"""Batch rows (OpenAI Batch format) through the serving code path, on the fake engine: what
one ``raylm batch`` replica runs."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_openai_fakes import FakeEngine

from raylm.cluster.batch.rows import BatchRunner, reject_row
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.scheduler.sampling_params import SamplingParams

MODEL = "fake-llama"


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


def row(custom_id, url="/v1/completions", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def run(engine, lines, **kw):
    runner = BatchRunner(OpenAIServing(engine, MODEL), model_aliases=("/models/llama",), **kw)
    rows = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    results = asyncio.run(runner.run_rows(rows))
    return results, [json.loads(r.text) for r in results]


def test_rows_in_order_with_row_level_errors(tokenizer):
    engine = FakeEngine(tokenizer, delay_s=0.001)
    lines = [
        row("a", model=MODEL, prompt="hello world", max_tokens=5),
        row("b", url="/v1/chat/completions", model=MODEL,
            messages=[{"role": "user", "content": "hi"}], max_tokens=3),
        "{this is not json",
        row("c", model=MODEL, prompt="x", temperature=-1),
        row("d", url="/v1/embeddings", model=MODEL, input="x"),
        row("e", model="other-model", prompt="x"),
        row("f", model=MODEL, prompt="x", stream=True),
        "",
        row("g", model="/models/llama", prompt="alias", max_tokens=2),
        row("h", prompt="no model field", max_tokens=2, n=2),
    ]
    results, out = run(engine, lines)
    assert len(results) == 9 and sum(not r.ok for r in results) == 5
    assert [o["custom_id"] for o in out] == ["a", "b", None, "c", "d", "e", "f", "g", "h"]
    status = {o["custom_id"]: o["response"]["status_code"] for o in out}
    assert status == {"a": 200, "b": 200, None: 400, "c": 400, "d": 400, "e": 404, "f": 400,
                      "g": 200, "h": 200}
    assert [r.status for r in results] == [o["response"]["status_code"] for o in out]
    assert results[0].completion_tokens == 5 and results[2].completion_tokens == 0
    a = out[0]["response"]["body"]
    ids = tokenizer("hello world").input_ids
    assert a["choices"][0]["text"] == engine.expected_text(ids, SamplingParams(max_tokens=5))
    assert a["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5,
                          "total_tokens": len(ids) + 5}
    assert out[1]["response"]["body"]["object"] == "chat.completion"
    assert len(out[8]["response"]["body"]["choices"]) == 2
    for o in out:
        assert o["id"].startswith("batch_req-") and o["response"]["request_id"]
        if o["response"]["status_code"] == 200:
            assert o["error"] is None
        else:
            body_err = o["response"]["body"]["error"]
            assert o["error"]["message"] == body_err["message"] and body_err["message"]
    assert "temperature" in out[3]["error"]["message"]
    assert "/v1/embeddings" in out[4]["error"]["message"]


def test_concurrency_is_bounded_and_all_rows_finish(tokenizer):
    engine = FakeEngine(tokenizer, delay_s=0.002)
    peak = 0
    original = engine.generate

    async def spy(*args, **kwargs):
        nonlocal peak
        peak = max(peak, len(engine.running) + 1)
        async for out in original(*args, **kwargs):
            yield out

    engine.generate = spy
    lines = [row(str(i), model=MODEL, prompt=f"row {i}", max_tokens=4) for i in range(40)]
    results, out = run(engine, lines, max_concurrency=8)
    assert all(r.ok for r in results) and [o["custom_id"] for o in out] == [str(i) for i in range(40)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 4 for o in out)
    assert 1 < peak <= 8


def test_engine_death_is_reported(tokenizer):
    engine = FakeEngine(tokenizer)
    runner = BatchRunner(OpenAIServing(engine, MODEL))
    assert asyncio.run(runner.engine_error()) is None
    engine.die("EngineCore actor died: OOM")
    results = asyncio.run(runner.run_rows([(i + 1, row(str(i), model=MODEL, prompt="x"))
                                           for i in range(3)]))
    assert [r.status for r in results] == [500, 500, 500]
    assert all("OOM" in json.loads(r.text)["error"]["message"] for r in results)
    assert "OOM" in asyncio.run(runner.engine_error())


@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "custom_id"),
    (json.dumps({"custom_id": 7, "url": "/v1/completions", "body": {}}), "custom_id"),
    (json.dumps(["a list"]), "JSON object"),
])
def test_rows_without_a_usable_custom_id_are_rejected_without_an_engine(line, why):
    result = reject_row(line, 3)
    out = json.loads(result.text)
    assert result.status == 400 and out["response"]["status_code"] == 400
    assert "line 3" in out["error"]["message"] and why in out["error"]["message"]
