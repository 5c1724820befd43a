"""LLMEngine: the offline ``LLM``'s synchronous engine client.

Input processor, EngineCore client, output processor, all driven by the caller's thread:
``add_request`` queues, ``step`` waits for the next outputs. The serving ``AsyncLLM`` is
its sibling over the same EngineCore client, with the outputs read by an asyncio task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raylm.cluster.engine.engine_args import EngineArgs
from raylm.cluster.engine.engine_setup import EngineClientBase
from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import PromptType, ValidatedPrompt
from raylm.scheduler.sampling_params import SamplingParams


class LLMEngine(EngineClientBase):
    def __init__(self, engine_args: EngineArgs,
                 model_resolver: Callable[[], str] | None = None) -> None:
        """``model_resolver``: see ``EngineClientBase``."""
        super().__init__(engine_args, model_resolver)

    def add_request(self, request_id: str, prompt: PromptType | ValidatedPrompt,
                    params: SamplingParams | None = None) -> None:
        """Queue one request. A ValidatedPrompt (with its own params) went through the
        intake already; any other prompt goes through it here, with ``params``."""
        if not isinstance(prompt, ValidatedPrompt):
            if params is None:
                raise TypeError("add_request needs params for a prompt that is not a "
                                "ValidatedPrompt.")
            prompt = self.input_processor.process(prompt, params)
        elif params is not None:
            raise TypeError("a ValidatedPrompt carries its own params; pass none.")
        parent, requests = self.input_processor.make_requests(request_id, prompt)
        self.output_processor.add_request(parent, [r.request_id for r in requests])
        try:
            for r in requests:
                self.core.add_request(r)
        except Exception:
            self.abort_request(request_id)
            raise

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        child_ids = self.output_processor.child_ids(request_id)
        final = self.output_processor.abort_request(request_id, error)
        if child_ids:
            self.core.abort_requests(child_ids)
        return final

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Wait for the next engine outputs (up to ``timeout``) and turn them into RequestOutputs."""
        engine_outputs = self.core.get_output(timeout=timeout)
        if engine_outputs is None:
            return []
        outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def get_metrics(self) -> dict[str, Any]:
        return self.core.get_metrics()

    @property
    def num_kv_blocks(self) -> int | None:
        """The KV pool in blocks (every DP rank's); None while not known."""
        return self.core.num_kv_blocks

    def shutdown(self) -> None:
        self.core.shutdown()
