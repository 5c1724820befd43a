"""A diffusion language model behind the OpenAI server (the app `raylm serve` runs, on
loopback uvicorn, the real engine in process) and the official openai client: a seeded
completion equals the offline engine's text, a stream delivers one chunk per committed
canvas, chat answers, and a sampling field the denoising loop cannot honour is a 400
naming it."""

from __future__ import annotations

import openai
import pytest
from test_openai_fakes import running_server

from raylm import LLM, SamplingParams
from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.routes import ModelBackend, build_openai_api
from raylm.runner.loading.diffusion_checkpoint import write_random_diffusion_checkpoint

MODEL = "dgemma"
L = 4
ARGS = dict(dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_diffusion_checkpoint(
        str(tmp_path_factory.mktemp("dgemma")), canvas_length=L, vocab_size=320,
        with_tokenizer=True, generation={"max_denoising_steps": 4})


@pytest.fixture(scope="module")
def client(checkpoint):
    engine = AsyncLLM.from_engine_args(checkpoint, **ARGS)
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL))})
    try:
        with running_server(app) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    finally:
        engine.shutdown()


def test_completions_equal_the_offline_engine_and_stream_by_canvas(client, checkpoint):
    with LLM(checkpoint, **ARGS) as llm:
        offline = llm.generate(["the quick brown fox"],
                               SamplingParams(seed=5, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    served = client.completions.create(model=MODEL, prompt="the quick brown fox",
                                       max_tokens=12, seed=5, extra_body={"ignore_eos": True})
    assert served.choices[0].text == offline.text
    assert served.usage.completion_tokens == 12 and served.choices[0].finish_reason == "length"
    chunks = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=12, seed=5, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].text]
    assert "".join(chunks) == offline.text
    assert 1 < len(chunks) <= 12 // L  # a chunk per committed canvas (an empty one skipped)
    # A stop string inside a canvas ends the text before it.
    stop = offline.text[len(offline.text) // 2:][:3]
    cut = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12,
                                    seed=5, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == offline.text[:offline.text.index(stop)]


def test_chat_answers_and_unsupported_fields_are_a_400(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, seed=1,
        extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0.2)
    assert err.value.body["param"] == "temperature"
    assert "denoising loop" in err.value.body["message"]
