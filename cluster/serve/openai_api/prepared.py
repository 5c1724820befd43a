"""An OpenAI API call after the intake: what the engine runs and what the answer needs.

``serving`` builds these and ``responses`` formats from them; both import this module and
``serving`` imports ``responses``, so the dependency runs one way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raylm.cluster.engine.processor import ValidatedPrompt
from raylm.cluster.serve.openai_api.chat_protocol import ChatCompletionRequest
from raylm.cluster.serve.openai_api.embedding_protocol import EmbeddingRequest
from raylm.cluster.serve.openai_api.protocol import CompletionRequest

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"


@dataclass
class EngineRequest:
    """One prompt of an API call, as the engine receives it."""

    request_id: str
    inputs: ValidatedPrompt


@dataclass
class PreparedRequest:
    """An API call after validation: what to run and how to answer."""

    kind: str  # COMPLETIONS, CHAT_COMPLETIONS or EMBEDDINGS
    request: CompletionRequest | ChatCompletionRequest | EmbeddingRequest
    response_id: str
    created: int
    model: str
    engine_requests: list[EngineRequest]
    # Chat: a new ChatOutputParser per choice (content, reasoning, tool calls).
    output_parser: Callable[[], Any] | None = None
