"""The offline Python API, vLLM-compatible: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

from raylm.cluster.engine.chat_utils import apply_chat_template
from raylm.cluster.engine.engine_args import EngineArgs
from raylm.cluster.engine.llm_engine import LLMEngine
from raylm.cluster.engine.outputs import EmbeddingRequestOutput, RequestOutput
from raylm.cluster.engine.processor import PromptType
from raylm.scheduler.lora import LoRARequest
from raylm.scheduler.pooling_params import PoolingParams
from raylm.scheduler.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# A progress bar for runs long enough to want one.
_PROGRESS_MIN_PROMPTS = 16


def _release(engine: LLMEngine) -> None:
    """What ``del llm``, garbage collection and interpreter exit run: the engine's worker
    actors, placement group and threads go, as with ``shutdown()``. Never raises (it runs
    from the garbage collector and atexit)."""
    try:
        engine.shutdown()
    except Exception as e:  # noqa: BLE001 - nobody to raise to
        logger.warning("Releasing the engine failed: %r", e)


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request has {len(loras)} entries but there are {num_prompts} "
                         "prompts.")
    return loras


class LLM:
    """An engine for offline batch inference.

    >>> llm = LLM("path/to/hf-model")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str, *, model_resolver: Callable[[], str] | None = None,
                 **engine_kwargs: Any) -> None:
        """``model_resolver``: called on each node that loads the weights, returns that
        node's checkpoint folder (``model`` is this process's; see
        ``ModelConfig.model_resolver``). A Python-API argument, not an engine flag."""
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model, **engine_kwargs),
                                    model_resolver)
        self._ids = itertools.count()
        # Holds the engine, not self: the LLM stays collectable, and the engine is released
        # once, whichever comes first of shutdown(), collection and interpreter exit.
        self._finalizer = weakref.finalize(self, _release, self.llm_engine)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. ``lora_request``:
        one LoRA adapter for every prompt, or a list with one per prompt (None: the base
        model); the engine needs ``enable_lora=True``."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompts)} prompts."
                )
        loras = _per_prompt(lora_request, len(prompts))
        # Only final outputs are read here: build none per step (vLLM's LLM does the same).
        final_only: dict[int, SamplingParams] = {}
        for p in params_list:
            if id(p) not in final_only:
                final_only[id(p)] = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        # Every prompt through the intake before anything is queued: a bad one fails the
        # call cleanly.
        intake = self.llm_engine.input_processor
        validated = [intake.process(prompt, final_only[id(p)], lora_request=lora)
                     for prompt, p, lora in zip(prompts, params_list, loras, strict=True)]
        ids = [str(next(self._ids)) for _ in prompts]
        for request_id, prompt in zip(ids, validated, strict=True):
            self.llm_engine.add_request(request_id, prompt)
        return self._run_engine(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_type: str | None = None,
        normalize: bool = True,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order: the model's last hidden states pooled
        (``pooling_type`` "last" or "mean", default the engine's ``pooling_type``),
        L2-normalized unless ``normalize=False``. They run through the same scheduler as
        generation (scheduler/pooling_params.py)."""
        pooling = PoolingParams(pooling_type or self.llm_engine.engine_args.pooling_type, normalize)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                pooling=pooling)
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [EmbeddingRequestOutput.from_request_output(o) for o in outputs]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or ``chat_template``),
        with ``tools`` (OpenAI's function definitions) when given, then generate."""
        one = bool(messages) and isinstance(messages[0], dict)  # a conversation, not a list
        conversations = cast("list[list[dict[str, Any]]]", [messages] if one else messages)
        prompts: list[PromptType] = []
        for conv in conversations:
            text, token_ids = apply_chat_template(
                self.get_tokenizer(), conv, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                tools=tools)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _run_engine(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm or (use_tqdm is None and len(ids) >= _PROGRESS_MIN_PROMPTS):
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(finished) < len(ids):
                for out in self.llm_engine.step(timeout=1.0):
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id not in finished:
                    self.llm_engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    def get_metrics(self) -> dict[str, Any]:
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
