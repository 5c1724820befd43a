"""LoRA adapters on the OpenAI server, the official openai SDK against the real engine in
process (routes on loopback uvicorn): each adapter by name (and as ``base:adapter``) gives
transformers + PEFT's greedy text; /v1/models lists adapters with their parent;
/v1/load_lora_adapter and /v1/unload_lora_adapter at run time, only from under the
allowed root; an unknown adapter is a 404, a path outside the root a 400."""

from __future__ import annotations

import os
import types

import httpx
import openai
import pytest
from test_openai_fakes import running_server

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.serve.handlers.lora_routes import LoRAModules
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.routes import ModelBackend, build_openai_api

MODEL = "tiny"
PROMPT = [17, 230, 41, 99, 5]


@pytest.fixture(scope="module")
def server(llama_path, lora_adapters):
    engine = AsyncLLM.from_engine_args(llama_path, enable_lora=True, max_loras=2)
    root = os.path.dirname(lora_adapters[0])
    kwargs = types.SimpleNamespace(enable_lora=True, allowed_lora_root=root,
                                   lora_modules=[f"first={lora_adapters[0]}"])
    loras = LoRAModules.from_engine_kwargs(kwargs, MODEL, engine)
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL, loras=loras))})
    try:
        with running_server(app) as url:
            yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                     timeout=120)
    finally:
        engine.shutdown()


def _text(client, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.model == model
    return r.choices[0].text


def _peft_text(peft_oracle, tokenizer, adapter) -> str:
    return tokenizer.decode(peft_oracle.greedy(adapter, PROMPT, 8))


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


def test_adapters_by_name_equal_peft(server, lora_adapters, peft_oracle, tokenizer):
    _, client = server
    base = _text(client, MODEL)
    assert base == _peft_text(peft_oracle, tokenizer, None)
    first = _text(client, "first")
    assert first == _peft_text(peft_oracle, tokenizer, lora_adapters[0]) != base
    assert _text(client, f"{MODEL}:first") == first
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {MODEL, "first"} and cards["first"].parent == MODEL
    assert client.models.retrieve("first").root == lora_adapters[0]
    chat = client.chat.completions.create(model="first", max_tokens=3, messages=[
        {"role": "user", "content": "hello"}])
    assert chat.model == "first" and chat.choices[0].message.content is not None


def test_unknown_adapters_are_404(server):
    _, client = server
    for model in ("nope", f"{MODEL}:nope", "other:first"):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_load_and_unload_at_run_time(server, lora_adapters, peft_oracle, tokenizer,
                                     llama_path):
    url, client = server
    post = httpx.Client(base_url=url, timeout=60).post
    r = post("/v1/load_lora_adapter", json={"lora_name": "second",
                                            "lora_path": lora_adapters[3]})
    assert r.status_code == 200, r.text
    assert _text(client, "second") == _peft_text(peft_oracle, tokenizer, lora_adapters[3])
    assert "second" in {m.id for m in client.models.list().data}
    # Relative to the root, and a second name for the same folder.
    r = post("/v1/load_lora_adapter", json={"lora_name": "third",
                                            "lora_path": os.path.basename(lora_adapters[1])})
    assert r.status_code == 200, r.text
    assert _text(client, "third") == _peft_text(peft_oracle, tokenizer, lora_adapters[1])
    r = post("/v1/load_lora_adapter", json={"lora_name": "second",
                                            "lora_path": lora_adapters[3]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    assert post("/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _text(client, "second")
    r = post("/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    # Loaded again: a new id, the same weights.
    r = post("/v1/load_lora_adapter", json={"lora_name": "second",
                                            "lora_path": lora_adapters[3]})
    assert r.status_code == 200, r.text
    assert _text(client, "second") == _peft_text(peft_oracle, tokenizer, lora_adapters[3])


def test_an_adapter_of_the_root_loads_when_a_request_names_it(server, lora_adapters,
                                                             peft_oracle, tokenizer):
    _, client = server
    name = os.path.basename(lora_adapters[2])  # a folder of the root, never loaded
    assert name not in {m.id for m in client.models.list().data}
    assert _text(client, f"{MODEL}:{name}") == _peft_text(peft_oracle, tokenizer,
                                                          lora_adapters[2])
    assert client.models.retrieve(name).parent == MODEL
    for model in (f"{name}/..", "..", f"../{name}", ".hidden"):  # nothing outside a folder
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2)


@pytest.mark.parametrize("body", [
    {"lora_name": "outside", "lora_path": "/etc"},
    {"lora_name": "outside", "lora_path": "../"},
    {"lora_name": "bad:name", "lora_path": "adapter0"},
    {"lora_name": "x"},  # no path
])
def test_load_refusals_are_400(server, body, llama_path):
    url, _ = server
    if body.get("lora_path") == "/etc":
        body = {**body, "lora_path": llama_path}  # a real folder, outside the root
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("lora_path", "lora_name")


def test_runtime_loading_is_off_without_a_root(llama_path, lora_adapters):
    engine = types.SimpleNamespace(input_processor=types.SimpleNamespace(
        check_lora=lambda lora: None))
    kwargs = types.SimpleNamespace(enable_lora=True, allowed_lora_root=None, lora_modules=None)
    loras = LoRAModules.from_engine_kwargs(kwargs, MODEL, engine)
    with pytest.raises(Exception, match="off on this server") as e:
        loras.check_runtime_loading()
    assert e.value.status_code == 400
    assert LoRAModules.from_engine_kwargs(types.SimpleNamespace(enable_lora=False), MODEL,
                                          engine) is None
    for root in ("s3://bucket/adapters", lora_adapters[0] + "/adapter_config.json"):
        with pytest.raises(ValueError, match="not a folder"):
            LoRAModules.from_engine_kwargs(types.SimpleNamespace(
                enable_lora=True, allowed_lora_root=root, lora_modules=None), MODEL, engine)


def test_serve_flags_reach_the_replicas_engine_kwargs(lora_adapters):
    from raylm.cluster.cli import build_llm_config, build_parser

    root = os.path.dirname(lora_adapters[0])
    args = build_parser().parse_args(
        ["serve", "demo-random", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
         "--lora-modules", f"a={lora_adapters[0]}", f"b={lora_adapters[1]}",
         "--allowed-lora-root", root])
    ek = build_llm_config(args).engine_kwargs
    assert (ek.enable_lora, ek.max_loras, ek.max_lora_rank, ek.allowed_lora_root) == \
        (True, 3, 8, root)
    assert ek.lora_modules == [f"a={lora_adapters[0]}", f"b={lora_adapters[1]}"]
    bad = build_parser().parse_args(["serve", "demo-random", "--enable-lora",
                                     "--lora-modules", "no-equals-sign"])
    with pytest.raises(ValueError, match="no-equals-sign"):
        build_llm_config(bad).engine_args()


def test_adapters_on_s3_by_uri_and_by_name_from_an_s3_root(llama_path, lora_adapters,
                                                           peft_oracle, tokenizer, moto_s3,
                                                           tmp_path, monkeypatch):
    """A moto S3 server: an adapter given by URI at start, another loaded by name from an
    S3 root on its first request; each fetched once into this node's cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(cache))
    for i in (0, 2):
        for name in os.listdir(lora_adapters[i]):
            with open(os.path.join(lora_adapters[i], name), "rb") as f:
                moto_s3.put_object(Bucket="raylm-test", Key=f"adapters/a{i}/{name}",
                                   Body=f.read())
    root = "s3://raylm-test/adapters"
    engine = AsyncLLM.from_engine_args(llama_path, enable_lora=True, max_loras=2)
    kwargs = types.SimpleNamespace(enable_lora=True, allowed_lora_root=root + "/",
                                   lora_modules=[f"s3first={root}/a0"])
    loras = LoRAModules.from_engine_kwargs(kwargs, MODEL, engine)
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL, loras=loras))})
    try:
        with running_server(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                   timeout=120)
            assert _text(client, "s3first") == _peft_text(peft_oracle, tokenizer,
                                                          lora_adapters[0])
            assert _text(client, "a2") == _peft_text(peft_oracle, tokenizer, lora_adapters[2])
            assert client.models.retrieve("a2").root == f"{root}/a2"
            with pytest.raises(openai.NotFoundError):
                _text(client, "a9")  # no such folder under the root
            post = httpx.Client(base_url=url, timeout=60).post
            for path in ("s3://other-bucket/a0", "../a0", "/a0", "gs://raylm-test/adapters/a0"):
                r = post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
                assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", path
            r = post("/v1/load_lora_adapter", json={"lora_name": "again",
                                                    "lora_path": f"{root}/a2"})
            assert r.status_code == 200, r.text
            assert _text(client, "again") == _text(client, "a2")
        assert len(os.listdir(cache / "lora")) == 2  # one copy per URI on this node
    finally:
        engine.shutdown()
