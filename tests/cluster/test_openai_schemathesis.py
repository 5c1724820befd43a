"""schemathesis fuzzes every route of the server from its own /openapi.json (the request
models the routes parse their bodies with), against the real AsyncLLM on the random llama
through uvicorn on loopback: bounded examples per route, and its not_a_server_error check
(no 5xx, no dropped connection). The engine is small enough (64 tokens of context) that
every generated request finishes quickly."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from test_openai_fakes import running_server

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.routes import ModelBackend, build_openai_api

MODEL = "fuzz-llama"
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 30  # per route and method


@pytest.fixture(scope="module")
def base_url(llama_path):
    engine = AsyncLLM.from_engine_args(llama_path, max_model_len=64, max_num_seqs=8, max_n=4,
                                       max_logprobs=5, grammar_compile_timeout_s=2.0)
    serving = OpenAIServing(engine, MODEL, max_pending_requests=64,
                            tool_call_parser="hermes", reasoning_parser="qwen3")
    app = build_openai_api({MODEL: ModelBackend.local(serving)}, {MODEL: KEY})
    try:
        with running_server(app) as base:
            yield base
    finally:
        assert engine.dead_error is None, engine.dead_error  # nothing the fuzz sent killed it
        engine.shutdown()


# The operations, from the schema the routes declare (the same for every server).
SCHEMA = schemathesis.openapi.from_dict(build_openai_api({}).openapi())
OPERATIONS = {f"{op.method.upper()} {op.path}": op
              for op in (result.ok() for result in SCHEMA.get_all_operations())}


# A body can break its schema; a GET has nothing a client could send invalid.
CASES = [(name, mode) for name in sorted(OPERATIONS)
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or name.startswith("POST")]


@pytest.mark.parametrize("operation, mode", CASES,
                         ids=[f"{n}-{m.value}" for n, m in CASES])
def test_no_route_answers_5xx_or_drops_the_connection(base_url, operation, mode):
    """Bodies, paths and queries generated from the schema (valid ones, and ones that break
    it): whatever the status, never a 5xx and never a cut connection."""
    op = OPERATIONS[operation]

    @given(case=op.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        case.call_and_validate(base_url=base_url, headers=AUTH, checks=[not_a_server_error],
                               timeout=60)

    run()


def test_every_route_is_fuzzed():
    assert set(OPERATIONS) == {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings",
        "POST /tokenize", "POST /detokenize", "POST /v1/load_lora_adapter",
        "POST /v1/unload_lora_adapter", "GET /v1/models", "GET /v1/models/{model_id}", "GET /health",
        "GET /metrics", "GET /version"}
