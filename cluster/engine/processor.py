"""Validate user input and build engine Requests (the input side of the engine client)."""

from __future__ import annotations

import random
import time
from typing import Any

from raylm.cluster.engine.output_processor import ParentRequest
from raylm.cluster.engine.outputs import RequestMetrics
from raylm.scheduler.config.engine_config import ModelConfig
from raylm.scheduler.request import Request, check_prompt
from raylm.scheduler.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        # Seeds for unseeded requests come from the engine seed: runs are reproducible,
        # and a request's randomness never depends on what else is in its batch.
        self._seed_rng = random.Random(model_config.seed)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}.")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt).__name__}.")

    def validate(self, prompt_token_ids: list[int]) -> None:
        """Raises InvalidRequestError (a ValueError). The params validated themselves."""
        check_prompt(prompt_token_ids, self.model_config.max_model_len,
                     self.model_config.vocab_size)

    def make_requests(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[ParentRequest, list[Request]]:
        """One ParentRequest and its n engine Requests (ids ``"{i}_{request_id}"`` when n > 1)."""
        self.validate(prompt_token_ids)
        if params.structured_outputs is not None:
            from raylm.runner.structured.xgrammar_backend import validate

            validate(params.structured_outputs)  # a bad schema fails here, not in the engine
        parent = ParentRequest(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
            params=params, metrics=RequestMetrics(arrival_time=time.monotonic()),
        )
        requests = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            if params.seed is not None:
                seed = params.seed + i  # n samples with one seed must still differ
            else:
                seed = self._seed_rng.getrandbits(63)
            requests.append(Request(
                request_id=child_id, prompt_token_ids=prompt_token_ids,
                sampling_params=params, eos_token_ids=self.model_config.eos_token_ids,
                max_model_len=self.model_config.max_model_len, sampling_seed=seed,
                arrival_time=parent.metrics.arrival_time,
            ))
        return parent, requests
