"""The serve app reads a replica's KV pool size from the engine itself (``num_kv_blocks``,
the KVPoolSized protocol); an engine that does not say gives None, not a guess."""

from __future__ import annotations

import asyncio

from raylm import LLM
from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.serve.deployment.app import kv_pool_blocks


def test_an_in_process_engine_reports_its_configured_pool(llama_path):
    with LLM(llama_path, num_kv_blocks=40) as llm:
        assert llm.llm_engine.num_kv_blocks == 40
        assert kv_pool_blocks(llm.llm_engine) == 40


def test_the_async_engine_reports_the_same_pool(llama_path):
    async def main() -> int | None:
        engine = AsyncLLM.from_engine_args(llama_path, num_kv_blocks=24)
        try:
            return kv_pool_blocks(engine)
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == 24


def test_an_engine_that_does_not_say_gives_none():
    class CustomEngine:  # a custom engine factory's engine: no num_kv_blocks
        def shutdown(self) -> None:
            pass

    assert kv_pool_blocks(CustomEngine()) is None
