"""The prefix router's view of a request: its prompt as the replica will see it (the chat
rendered with the model's template, text tokenized with the model's tokenizer), hashed in
KV blocks (docs/architecture.md §14).

Token ids, not text: the router's mirror then counts what the engine caches, in its units
(blocks of ``block_size`` tokens, the KV pool's size in blocks), and a rendered chat
matches exactly where the engine's cache would. The price is a tokenizer in the router's
process (loaded once, in a thread, from the same source the replicas load) and one
tokenization per request there (about 1 ms for a 1500-token chat with a fast tokenizer);
until the tokenizer is loaded, or for a body it cannot read, the router routes by load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from raylm.actors.prefix_affinity import prompt_block_hashes
from raylm.cluster.engine.chat_utils import apply_chat_template
from raylm.cluster.serve.openai_api.chat_protocol import ChatCompletionRequest
from raylm.cluster.serve.openai_api.prepared import CHAT_COMPLETIONS, COMPLETIONS
from raylm.cluster.serve.openai_api.protocol import CompletionRequest

logger = logging.getLogger(__name__)


class PromptHasher:
    """``hashes(route, body)``: the block hashes of the request's (first) prompt, or None."""

    def __init__(self, llm_config: Mapping[str, Any], *, load: bool = True,
                 tokenizer: Any = None) -> None:
        """``llm_config``: the model's LLMConfig as a dict; ``tokenizer``: one to use at
        once (tests) instead of loading the model's in a thread."""
        from raylm.cluster.serve.deployment.config import LLMConfig

        config = LLMConfig.model_validate(dict(llm_config))
        ek = config.engine_kwargs
        self.model_id = config.model_id
        self.block_size: int = ek.block_size
        self.enabled: bool = ek.enable_prefix_caching
        # LoRA adapters a replica keeps loaded (its host LRU): the router's adapter memory.
        self.adapters_per_replica: int = (
            (ek.max_cpu_loras or ek.max_loras) if ek.enable_lora else 0)
        self._tokenizer = tokenizer
        self._ready = threading.Event()
        if tokenizer is not None:
            self._ready.set()
        elif load and self.enabled:
            threading.Thread(target=self._load, args=(config,), daemon=True,
                             name="raylm-router-tokenizer").start()

    def _load(self, config: Any) -> None:
        from raylm.cluster.engine.engine_setup import load_tokenizer

        try:
            source = config.engine_kwargs.tokenizer or config.model_loading_config.resolve_model_source()
            self._tokenizer = load_tokenizer(source)
            self._ready.set()
        except Exception:  # routing by load is still correct, only slower
            logger.exception("the prefix router could not load %r's tokenizer; it routes "
                             "by load only", config.model_id)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def hashes(self, route: str, body: Any) -> list[int] | None:
        if not self.enabled or not self._ready.is_set() or not isinstance(body, Mapping):
            return None
        try:
            token_ids = self._token_ids(route, body)
        except Exception as e:  # the replica answers the client's error; route by load
            logger.debug("prefix router: no prompt from %s: %r", route, e)
            return None
        if token_ids is None:
            return None
        # Another served name than the model's (an adapter) keys blocks of its own.
        return prompt_block_hashes(token_ids, self.block_size, self.adapter(body))

    def adapter(self, body: Any) -> str | None:
        """The LoRA adapter the request names (any served name but the base model's), or
        None."""
        if not isinstance(body, Mapping):
            return None
        model = body.get("model")
        if not isinstance(model, str) or model == self.model_id:
            return None
        base, sep, name = model.partition(":")  # base:adapter names the same adapter
        return name if sep and base == self.model_id else model

    def _token_ids(self, route: str, body: Mapping[str, Any]) -> list[int] | None:
        tok = self._tokenizer
        if route == CHAT_COMPLETIONS:
            chat = ChatCompletionRequest.model_validate(body)
            return apply_chat_template(
                tok, chat.conversation(), tools=chat.tool_definitions(),
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                chat_template=chat.chat_template,
                chat_template_kwargs=chat.chat_template_kwargs)[1]
        if route == COMPLETIONS:
            prompt = CompletionRequest.model_validate(body).prompts()[0]
            return prompt if isinstance(prompt, list) else list(tok(prompt).input_ids)
        return None
