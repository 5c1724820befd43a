"""The intake: a user's prompt in, a ValidatedPrompt out, then the engine's Requests.

``InputProcessor.process`` tokenizes a text prompt (token ids never meet the tokenizer) and
runs ``validate_prompt`` on it, each exactly once per request; the HTTP server, the offline
``LLM`` and ``AsyncLLM`` all come through here, and nothing after it checks the prompt again.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raylm.cluster.engine.output_processor import ParentRequest
from raylm.cluster.engine.outputs import RequestMetrics
from raylm.scheduler.config.engine_config import ModelConfig
from raylm.scheduler.config.lora_config import LoRAConfig
from raylm.scheduler.intake import RequestLimits, structured_output_chars, validate_prompt
from raylm.scheduler.lora import LoRARequest
from raylm.scheduler.request import InvalidRequestError, Request
from raylm.scheduler.sampling_params import SamplingParams
from raylm.scheduler.structured.params import StructuredOutputsParams

PromptType = str | dict[str, Any] | list[int]
# Params, or a function of the prompt's length in tokens that builds them (the HTTP API's
# default max_tokens is whatever room the prompt leaves).
ParamsSource = SamplingParams | Callable[[int], SamplingParams]


@dataclass(frozen=True)
class ValidatedPrompt:
    """A prompt that went through ``InputProcessor.process``: its text (None when it came
    as token ids), its token ids, and the params it was validated with."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None  # its adapter, checked (None: the base model)


def check_text(text: str, field: str = "prompt") -> None:
    """Text the tokenizer can encode: valid Unicode (JSON lets a client send a lone UTF-16
    surrogate such as "\\ud800", which no UTF-8 tokenizer takes); InvalidRequestError
    naming ``field`` otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{field} is not valid Unicode: it holds a lone UTF-16 surrogate "
            f"(\\u{ord(text[e.start]):04x}) at character {e.start}; send UTF-8 text.",
            field) from None


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any,
                 limits: RequestLimits | None = None,
                 lora_config: LoRAConfig | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.limits = limits or RequestLimits()
        self.lora_config = lora_config
        self._loras: dict[int, LoRARequest] = {}  # adapters checked, by id
        # Seeds for unseeded requests come from the engine seed: runs are reproducible,
        # and a request's randomness never depends on what else is in its batch.
        self._seed_rng = random.Random(model_config.seed)

    def process(self, prompt: PromptType, params: ParamsSource, *,
                strict_max_tokens: bool = False,
                lora_request: LoRARequest | None = None) -> ValidatedPrompt:
        """Tokenize (text only) and validate, once each. Raises InvalidRequestError (a
        ValueError) for input the client must fix; ``params`` built from the prompt's
        length raise their own ValueError. ``strict_max_tokens``: see ``validate_prompt``.
        ``lora_request``: the adapter to run with, its files checked (``check_lora``)."""
        if lora_request is not None:
            self.check_lora(lora_request)
        text, token_ids = self._tokenize(prompt)
        if not isinstance(params, SamplingParams):
            params = params(len(token_ids))
        validate_prompt(token_ids, params, max_model_len=self.model_config.max_model_len,
                        vocab_size=self.model_config.vocab_size,
                        strict_max_tokens=strict_max_tokens,
                        check_structured_outputs=self._compile_structured_outputs,
                        limits=self.limits)
        return ValidatedPrompt(text, token_ids, params, lora_request)

    def check_lora(self, lora: LoRARequest) -> None:
        """A LoRA adapter this engine can run: LoRA on, an id that names one adapter
        only, files that fit the model and ``max_lora_rank`` (read once per adapter).
        InvalidRequestError naming what is wrong."""
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got "
                                      f"{type(lora).__name__}.", "lora_request")
        if self.lora_config is None:
            raise InvalidRequestError(f"LoRA adapter {lora.lora_name!r} requested, but this "
                                      "engine runs without LoRA (enable_lora=False).",
                                      "lora_request")
        known = self._loras.get(lora.lora_int_id)
        if known == lora:
            return
        if known is not None:
            raise InvalidRequestError(
                f"lora_int_id {lora.lora_int_id} already names adapter {known.lora_name!r} "
                f"at {known.lora_path!r}; one id must always name the same adapter.",
                "lora_request")
        from raylm.runner.lora.peft import check_adapter

        try:
            check_adapter(lora.lora_path, self.model_config.hf_config,
                          self.lora_config.max_lora_rank)
        except ValueError as e:
            raise InvalidRequestError(str(e), "lora_request") from None
        self._loras[lora.lora_int_id] = lora

    def _compile_structured_outputs(self, params: StructuredOutputsParams) -> None:
        # xgrammar imports torch: loaded on the first constrained request only. A spec
        # ``precheck_structured_outputs`` saw resolves at once.
        from raylm.runner.structured.xgrammar_backend import validate

        validate(params, self.limits.grammar_compile_timeout_s)

    async def precheck_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """The compile check of ``process``, awaited off the event loop (the server runs
        it first, so ``process`` then finds the spec known): a spec that does not compile
        within ``grammar_compile_timeout_s`` is refused, and other requests never wait
        for it. InvalidRequestError naming the problem."""
        from raylm.runner.structured.xgrammar_backend import start_check

        chars, most = structured_output_chars(params), self.limits.max_structured_output_chars
        if chars > most:
            raise InvalidRequestError(
                f"the structured-output spec has {chars} characters, more than the {most} "
                "this server compiles (max_structured_output_chars).", "structured_outputs")
        timeout = self.limits.grammar_compile_timeout_s
        future, check = start_check(params)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            assert check is not None
            raise InvalidRequestError(str(check.timed_out(params, timeout))) from None
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            check_text(prompt)
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}.")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt).__name__}.")

    def make_requests(self, request_id: str, prompt: ValidatedPrompt
                      ) -> tuple[ParentRequest, list[Request]]:
        """One ParentRequest and its n engine Requests (ids ``"{i}_{request_id}"`` when n > 1)."""
        params, prompt_token_ids = prompt.params, prompt.prompt_token_ids
        parent = ParentRequest(
            request_id=request_id, prompt=prompt.prompt, prompt_token_ids=prompt_token_ids,
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
                arrival_time=parent.metrics.arrival_time, lora_request=prompt.lora_request,
            ))
        return parent, requests
