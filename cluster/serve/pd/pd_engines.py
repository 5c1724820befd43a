"""The two engines of prefill/decode disaggregation, as a Serve replica (or a test) holds
them: each wraps an ``AsyncLLM`` whose KV connector is the RayKVConnector.

The prefill engine runs a prompt with ``max_tokens=1`` (its first token is computed and
dropped: the decode engine recomputes the last prompt token from the pulled KV and
samples it again, so every output token comes from one engine) and returns the
``kv_transfer_params`` that let a decode engine pull the blocks it holds. The decode
engine runs the request as the client sent it, its prompt's KV pulled from the prefill
engine. Prompts arrive validated by the proxy's intake, so neither validates again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import ValidatedPrompt
from raylm.scheduler.sampling_params import RequestOutputKind, SamplingParams

PREFILL_KV = {"kv_connector": "RayKVConnector", "kv_role": "kv_producer"}
DECODE_KV = {"kv_connector": "RayKVConnector", "kv_role": "kv_consumer"}


def uses_remote_prefill(params: SamplingParams) -> bool:
    """Requests a decode engine can take over: one sample, no prompt logprobs (a pulled
    position is never computed on the decode side, so it has no logprob), no embedding
    (pooling reads the hidden states of the prompt's positions, which a pulled KV does not
    carry: the decode engine runs an embedding's whole prompt itself)."""
    return params.n == 1 and params.prompt_logprobs is None and params.pooling is None


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The prefill side's params: the prompt's KV and one greedy token, nothing else."""
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY,
                          extra_args={"kv_transfer_params": {"do_remote_decode": True}})


class _EngineSide:
    """What both sides answer besides their own job (stats, health, shutdown)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # AsyncLLM

    async def get_stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.engine.get_stats)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def shutdown(self) -> None:
        self.engine.shutdown()


class PrefillEngine(_EngineSide):
    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        config = engine.engine_config
        self.engine_id = str(config.kv_transfer_config.engine_id)
        self.tp_size = config.parallel_config.tensor_parallel_size

    async def prefill(self, request_id: str, prompt: ValidatedPrompt) -> dict[str, Any]:
        """Compute the prompt's KV; its blocks stay held for a decode engine (until it
        pulls them, ``release``, or the connector's ``abort_timeout_s``)."""
        prompt = ValidatedPrompt(None, prompt.prompt_token_ids, prefill_params(prompt.params))
        last = None
        async for out in self.engine.generate(prompt, request_id):
            last = out
        reason = last.outputs[0].finish_reason if last is not None else None
        if reason not in ("length", "stop"):
            raise RuntimeError(f"prefill of {request_id} ended with {reason!r}")
        return {"do_remote_prefill": True, "remote_engine_id": self.engine_id,
                "remote_request_id": request_id, "remote_tp_size": self.tp_size}

    async def release(self, request_ids: list[str]) -> None:
        """Free held blocks no decode engine will pull (its client left first)."""
        await self.engine.release_kv(request_ids)


class DecodeEngine(_EngineSide):
    def generate(self, request_id: str, prompt: ValidatedPrompt,
                 kv_transfer_params: dict[str, Any] | None) -> AsyncIterator[RequestOutput]:
        """The request as sent; with ``kv_transfer_params`` its prompt's KV is pulled from
        the prefill engine, without it computed here (a local prefill)."""
        if kv_transfer_params is not None:
            params = prompt.params
            extra = dict(params.extra_args or {}, kv_transfer_params=kv_transfer_params)
            prompt = ValidatedPrompt(prompt.prompt, prompt.prompt_token_ids,
                                     params.clone(extra_args=extra))
        return self.engine.generate(prompt, request_id)
