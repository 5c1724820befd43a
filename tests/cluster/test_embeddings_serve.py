"""/v1/embeddings on the OpenAI server: the official openai SDK against the real engine in
process (routes on loopback uvicorn). Each vector equals transformers' final-norm hidden
state (the last prompt token's, or the mean over the prompt with ``pooling_type="mean"``),
L2-normalized unless ``normalize`` is false, in base64 (the SDK's default) and in floats;
a LoRA adapter named as the model gives PEFT's; usage counts the prompt tokens. Refusals
name their field. Embeddings run beside streaming completions change neither. With fakes:
a client that leaves aborts every input's engine request, admission counts inputs, the
Serve replica reads ``pooling_type`` from its engine_kwargs, and the PD proxy runs an
embedding on the decode side alone.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest
from test_openai_fakes import FakeEngine, cancel_once_running, running_server

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.serve.handlers.lora_routes import LoRAModules
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.prepared import EMBEDDINGS
from raylm.cluster.serve.openai_api.routes import ModelBackend, build_openai_api
from raylm.cluster.serve.pd.pd_client import PDEngineClient
from raylm.cluster.serve.pd.pd_engines import DecodeEngine, uses_remote_prefill
from raylm.scheduler.pooling_params import PoolingParams
from raylm.scheduler.sampling_params import SamplingParams

MODEL = "tiny"
MAX_MODEL_LEN = 128
ATOL = 1e-5
# 64 prompts as token ids (the tokenizer out of the way), 3 to 39 tokens long.
PROMPTS = [[(7 * i + 31 * k) % 500 + 3 for k in range(3 + (5 * i) % 37)] for i in range(64)]
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(llama_path, lora_adapters):
    """One engine (LoRA on, adapter "first") behind two servers: the default one (last
    token pooling) and one that pools by the mean. Yields (engine, base URL of the first,
    its client, the mean server's client)."""
    engine = AsyncLLM.from_engine_args(llama_path, max_model_len=MAX_MODEL_LEN,
                                       enable_lora=True, max_loras=1)
    loras = LoRAModules(MODEL, engine.input_processor.check_lora, {"first": lora_adapters[0]})
    apps = [build_openai_api({MODEL: ModelBackend.local(s)}) for s in (
        OpenAIServing(engine, MODEL, loras=loras),
        OpenAIServing(engine, MODEL, pooling_type="mean"))]
    try:
        with running_server(apps[0]) as url, running_server(apps[1]) as mean_url:
            yield engine, url, _client(url), _client(mean_url)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server(served):
    return served[1:]


@pytest.fixture(scope="module")
def hidden(llama_path, hf_oracle):
    """token ids -> transformers' final-norm hidden states [T, hidden] (float32)."""
    oracle = hf_oracle(llama_path)
    return lambda ids: oracle.last_hidden_states(ids).numpy()


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _close(got, want) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_vectors_equal_transformers_in_base64_and_floats(server, hidden):
    url, client, _ = server
    prompts = PROMPTS[:3]
    r = client.embeddings.create(model=MODEL, input=prompts)  # the SDK asks for base64
    assert r.object == "list" and r.model == MODEL
    assert [d.index for d in r.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in r.data)
    for d, ids in zip(r.data, prompts, strict=True):
        _close(d.embedding, _unit(hidden(ids)[-1]))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, prompts))

    floats = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    for a, b in zip(floats.data, r.data, strict=True):
        assert np.array_equal(np.float32(a.embedding), np.float32(b.embedding))
    # On the wire: base64 of little-endian float32, the floats' very values.
    raw = httpx.post(f"{url}/v1/embeddings", timeout=60, json={
        "model": MODEL, "input": prompts[0], "encoding_format": "base64"}).json()
    (item,) = raw["data"]
    assert set(raw) == {"object", "data", "model", "usage"}
    assert raw["usage"] == {"prompt_tokens": len(prompts[0]), "total_tokens": len(prompts[0])}
    assert isinstance(item["embedding"], str)
    decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.float32(floats.data[0].embedding))


def test_text_inputs_are_tokenized_as_completions_prompts(server, hidden, llama_path):
    from transformers import AutoTokenizer

    _, client, _ = server
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    # The intake tokenizes a text prompt with the tokenizer's defaults (as /v1/completions).
    ids = [tokenizer(t).input_ids for t in TEXTS]
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])
    _close(one.data[0].embedding, _unit(hidden(ids[0])[-1]))
    both = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    for d, want in zip(both.data, ids, strict=True):
        _close(d.embedding, _unit(hidden(want)[-1]))
    assert both.usage.prompt_tokens == sum(map(len, ids))


def test_normalize_false_and_mean_pooling(server, hidden):
    _, client, mean_client = server
    ids = PROMPTS[5]
    states = hidden(ids)
    raw = client.embeddings.create(model=MODEL, input=ids, extra_body={"normalize": False})
    _close(raw.data[0].embedding, states[-1])
    assert abs(np.linalg.norm(raw.data[0].embedding) - 1) > 1e-2
    null = client.embeddings.create(model=MODEL, input=ids, extra_body={"normalize": None})
    _close(null.data[0].embedding, _unit(states[-1]))

    mean = mean_client.embeddings.create(model=MODEL, input=[ids, PROMPTS[6]])
    _close(mean.data[0].embedding, _unit(states.mean(axis=0)))
    _close(mean.data[1].embedding, _unit(hidden(PROMPTS[6]).mean(axis=0)))
    mean_raw = mean_client.embeddings.create(model=MODEL, input=ids,
                                             extra_body={"normalize": False})
    _close(mean_raw.data[0].embedding, states.mean(axis=0))


def test_a_lora_adapter_named_as_the_model_gives_pefts_vector(server, hidden, llama_path,
                                                             lora_adapters):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, client, _ = server
    ids = PROMPTS[7]
    base = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, lora_adapters[0]).eval()  # unmerged
    with torch.inference_mode():
        want = peft.get_base_model().model(torch.tensor([ids])).last_hidden_state[0, -1]
    r = client.embeddings.create(model="first", input=ids)
    assert r.model == "first"
    _close(r.data[0].embedding, _unit(want.numpy()))
    assert not np.allclose(r.data[0].embedding, _unit(hidden(ids)[-1]), atol=1e-3)


@pytest.mark.parametrize(("body", "param"), [
    ({"dimensions": 8}, "dimensions"),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [1] * MAX_MODEL_LEN}, "input"),  # no room within max_model_len
    ({"input": [[1, 2], [100_000]]}, "input"),  # outside the vocabulary
    ({"encoding_format": "bytes"}, "encoding_format"),
    ({"normalize": "sometimes"}, "normalize"),
])
def test_refusals_name_their_field(server, body, param):
    url = server[0]
    r = httpx.post(f"{url}/v1/embeddings", timeout=60,
                   json={"model": MODEL, "input": [1, 2, 3], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split("_")[0] in error["message"], error
    if body.get("input") == [1] * MAX_MODEL_LEN:
        assert f"max_model_len={MAX_MODEL_LEN}" in error["message"]


def test_sdk_errors_and_accepted_fields(server):
    _, client, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=[1, 2, 3], dimensions=8)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input=[1, 2, 3])
    # OpenAI's fields that ask for nothing raylm lacks: accepted.
    r = client.embeddings.create(model=MODEL, input=[1, 2, 3], user="u-1",
                                 extra_body={"dimensions": None})
    assert len(r.data) == 1


def test_embeddings_beside_streaming_completions_change_neither(server):
    _, client, _ = server
    completion_prompts = [[(11 * i + 3 * k) % 400 + 20 for k in range(4 + i % 9)]
                          for i in range(32)]
    alone = client.completions.create(model=MODEL, prompt=completion_prompts, max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
    want_texts = [c.text for c in sorted(alone.choices, key=lambda c: c.index)]
    want_vectors = [client.embeddings.create(model=MODEL, input=ids).data[0].embedding
                    for ids in PROMPTS]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused",
                                     max_retries=0, timeout=120)

        async def stream(ids):
            chunks = await aclient.completions.create(
                model=MODEL, prompt=ids, max_tokens=16, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        async def embed(ids):
            return (await aclient.embeddings.create(model=MODEL, input=ids)).data[0].embedding

        try:
            return await asyncio.gather(asyncio.gather(*map(stream, completion_prompts)),
                                        asyncio.gather(*map(embed, PROMPTS)))
        finally:
            await aclient.close()

    texts, vectors = asyncio.run(run())
    assert texts == want_texts
    for got, want in zip(vectors, want_vectors, strict=True):
        _close(got, np.float32(want))


def test_openapi_documents_the_route(server):
    schema = httpx.get(f"{server[0]}/openapi.json", timeout=60).json()
    body = schema["paths"]["/v1/embeddings"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/EmbeddingRequest"
    props = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert {"input", "model", "encoding_format", "user", "normalize"} <= set(props)


# ---- with fakes: aborts, admission, the Serve replica, the PD proxy ---------------------

@pytest.fixture(scope="module")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


class _PoolingFake(FakeEngine):
    """The fake engine with a vector on each final output: (prompt length, 1 if the
    params ask for mean pooling, 1 if normalized)."""

    async def generate(self, prompt, request_id):
        pooling = prompt.params.pooling
        async for out in super().generate(prompt, request_id):
            if out.finished and pooling is not None:
                out.pooled = [float(len(prompt.prompt_token_ids)),
                              float(pooling.pooling_type == "mean"), float(pooling.normalize)]
            yield out


def test_a_client_that_leaves_aborts_every_input(tokenizer):
    slow = FakeEngine(tokenizer, delay_s=60)
    serving = OpenAIServing(slow, MODEL)
    asyncio.run(cancel_once_running(
        serving.handle(EMBEDDINGS, {"model": MODEL, "input": [[5, 6, 7], [8, 9], [10]]}),
        lambda: len(slow.running) == 3))
    assert slow.running == set() and len(slow.aborted) == 3 and serving.num_pending == 0
    assert all(p.pooling == PoolingParams() and p.max_tokens == 1 for _, p in slow.seen)


def test_admission_counts_inputs_and_no_vector_is_a_500(tokenizer):
    from raylm.cluster.serve.openai_api.errors import OpenAIError

    serving = OpenAIServing(FakeEngine(tokenizer), MODEL, max_pending_requests=2)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(serving.handle(EMBEDDINGS, {"input": [[1], [2], [3]]}))
    assert (e.value.status_code, e.value.param) == (400, "input")
    with pytest.raises(OpenAIError) as e:  # the engine finished without a vector
        asyncio.run(serving.handle(EMBEDDINGS, {"input": [[1], [2]]}))
    assert e.value.status_code == 500 and "no embedding" in e.value.message
    assert serving.num_pending == 0


def test_the_serve_replica_reads_pooling_type_from_engine_kwargs(tokenizer):
    from raylm.cluster.serve.deployment.app import LLMServer

    config = {"model_loading_config": {"model_id": MODEL},
              "engine_kwargs": {"pooling_type": "mean"}}
    server = LLMServer(config, engine_factory=lambda cfg: _PoolingFake(tokenizer))
    assert server.serving.pooling_type == "mean"

    async def call(body):
        return [item async for item in server.handle(EMBEDDINGS, body)]

    ((kind, status, body),) = asyncio.run(call({"model": MODEL, "input": [[1, 2, 3], [4]],
                                                "normalize": False,
                                                "encoding_format": "float"}))
    assert (kind, status) == ("json", 200)
    assert [d["embedding"] for d in body["data"]] == [[3.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    with pytest.raises(ValueError, match="pooling_type"):
        OpenAIServing(_PoolingFake(tokenizer), MODEL, pooling_type="max")


class _NoPrefill:
    """A prefill side that records being asked (an embedding never should be)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def prefill(self, request_id, prompt):
        self.calls.append(request_id)
        raise RuntimeError("no prefill here")

    async def release(self, request_ids):
        pass

    async def get_stats(self):
        return {}

    async def check_health(self):
        pass


def test_the_pd_proxy_runs_embeddings_on_the_decode_engine(served, hidden):
    engine = served[0]
    embedding = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                               pooling=PoolingParams())
    assert not uses_remote_prefill(embedding) and uses_remote_prefill(SamplingParams())
    prefill = _NoPrefill()
    proxy = PDEngineClient(engine.model_config, engine.tokenizer, prefill,
                           DecodeEngine(engine))
    serving = OpenAIServing(proxy, MODEL)
    try:
        body = asyncio.run(serving.handle(EMBEDDINGS, {"model": MODEL, "input": PROMPTS[:2],
                                                       "encoding_format": "float"}))
    finally:
        proxy.shutdown()
    assert prefill.calls == []
    for d, ids in zip(body["data"], PROMPTS[:2], strict=True):
        _close(d["embedding"], _unit(hidden(ids)[-1]))
