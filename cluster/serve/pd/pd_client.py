"""PDEngineClient: the EngineClient a PD proxy serves the OpenAI API with.

Each request is prefilled by a prefill engine (which keeps the prompt's KV) and then run
by a decode engine that pulls that KV and streams every output token (an embedding, or
a request for several samples or prompt logprobs, runs whole on the decode engine:
``uses_remote_prefill``). The proxy holds no model: only the tokenizer and the intake. Failures, by where they happen:
- the prefill engine fails or its replica dies: the decode engine prefills locally (the
  client sees no error; ``num_local_prefill_fallbacks`` counts them);
- the decode engine's pull fails (the prefill replica died meanwhile): the decode engine
  recomputes the prompt (the connector's failed-load roll-back);
- the client leaves: closing the stream aborts the request on the engine running it, and
  KV a prefill holds for a decode that never started is released at once.
Backends are duck-typed (``pd_engines.PrefillEngine`` / ``DecodeEngine`` in process, or
``pd_app``'s adapters of their Serve deployment handles).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import InputProcessor, ValidatedPrompt
from raylm.cluster.serve.pd.pd_engines import uses_remote_prefill
from raylm.scheduler.config.engine_config import ModelConfig

logger = logging.getLogger(__name__)

STATS_REFRESH_S = 1.0


class PDEngineClient:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, prefill: Any,
                 decode: Any) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(model_config, tokenizer)
        self.prefill = prefill
        self.decode = decode
        self.num_local_prefill_fallbacks = 0
        self._sides: dict[str, dict[str, Any]] = {}
        self._stats_task: asyncio.Task | None = None

    async def generate(self, prompt: ValidatedPrompt,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        self._start_stats()
        kv_transfer_params = None
        if uses_remote_prefill(prompt.params):
            kv_transfer_params = await self._prefill(request_id, prompt)
        started = False
        try:
            async for out in self.decode.generate(request_id, prompt, kv_transfer_params):
                started = True
                yield out
        finally:
            if kv_transfer_params is not None and not started:
                # The decode engine may never pull it (the client left, the decode engine
                # refused): free the held blocks now (a second release is a no-op).
                task = asyncio.ensure_future(self._release(request_id))
                task.add_done_callback(lambda t: t.exception())

    async def _prefill(self, request_id: str, prompt: ValidatedPrompt
                       ) -> dict[str, Any] | None:
        try:
            return await self.prefill.prefill(request_id, prompt)
        except asyncio.CancelledError:
            raise  # the client left: the prefill engine aborts the request itself
        except Exception as e:  # noqa: BLE001 - any prefill failure: prefill locally
            self.num_local_prefill_fallbacks += 1
            logger.warning("prefill of %s failed (%s: %s); the decode engine prefills it",
                           request_id, type(e).__name__, str(e)[:300])
            return None

    async def _release(self, request_id: str) -> None:
        try:
            await self.prefill.release([request_id])
        except Exception as e:  # noqa: BLE001 - the prefill side's timeout frees it then
            logger.info("release of %s on the prefill side failed: %s", request_id, e)

    async def check_health(self) -> None:
        await self.decode.check_health()
        await self.prefill.check_health()

    # ---- stats: both sides', refreshed in the background (scrapes are synchronous) ----
    def _start_stats(self) -> None:
        if self._stats_task is None:
            self._stats_task = asyncio.ensure_future(self._refresh_stats())

    async def _refresh_stats(self) -> None:
        while True:
            sides = await asyncio.gather(self.decode.get_stats(), self.prefill.get_stats(),
                                         return_exceptions=True)
            # A side restarting keeps its last stats.
            for name, got in zip(("decode", "prefill"), sides, strict=True):
                if isinstance(got, BaseException):
                    logger.debug("PD stats of the %s side: %r", name, got)
                else:
                    self._sides[name] = got
            await asyncio.sleep(STATS_REFRESH_S)

    def get_stats(self) -> dict[str, Any]:
        return merge_pd_stats(self._sides.get("decode", {}), self._sides.get("prefill", {}),
                              self.num_local_prefill_fallbacks)

    def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()


def merge_pd_stats(decode: dict[str, Any], prefill: dict[str, Any],
                   fallbacks: int) -> dict[str, Any]:
    """The decode engine's stats (it serves the tokens), with both sides' KV-connector
    series summed and the prefill side's running and waiting requests added."""
    out = dict(decode)
    for key in ("num_requests_running", "num_requests_waiting"):
        out[key] = decode.get(key, 0) + prefill.get(key, 0)
    kv = dict(decode.get("kv_connector") or {})
    for key, value in (prefill.get("kv_connector") or {}).items():
        kv[key] = kv.get(key, 0) + value
    kv["raylm:pd_num_local_prefill_fallbacks"] = fallbacks
    out["kv_connector"] = kv
    return out
