"""The OpenAI embeddings request (``/v1/embeddings``, with vLLM's ``normalize`` extra) and
its response.

Each input is one engine request: the prompt runs through the same scheduler and steps as
a generation, with ``SamplingParams.pooling`` (scheduler/pooling_params.py) asking for its
hidden states pooled into one vector; the one token the engine samples is dropped.
``dimensions`` (OpenAI) and ``truncate_prompt_tokens`` (vLLM) change the output and raylm
does not implement them: ``UNSUPPORTED_FIELDS`` refuses them with a 400 naming them.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import field_validator

from raylm.cluster.serve.openai_api.protocol import OpenAIBaseModel, TokenId, as_prompts
from raylm.scheduler.pooling_params import PoolingParams
from raylm.scheduler.sampling_params import SamplingParams


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    # One text, several texts, one prompt as token ids, or several of them.
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    # "base64": the vector's little-endian float32 bytes (what the openai SDK asks for by
    # default, and decodes).
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    # vLLM extra: L2-normalize the vector (None: yes).
    normalize: bool | None = None

    @field_validator("input")
    @classmethod
    def _non_empty_input(cls, v):
        empty = len(v) == 0 or (isinstance(v, list) and any(
            isinstance(p, (str, list)) and len(p) == 0 for p in v))
        if empty:
            raise ValueError("input must not be empty, nor hold an empty text or token list")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The input field as a list of prompts (each text or token ids)."""
        return as_prompts(self.input)

    def structured_outputs_params(self) -> None:
        """No output constraint: the one token an embedding samples is dropped."""
        return None

    def to_sampling_params(self, pooling_type: str) -> SamplingParams:
        """The params of each input: one greedy token (dropped) and the pooled vector,
        pooled the server's way (``pooling_type``)."""
        pooling = PoolingParams(pooling_type, self.normalize is not False)
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                              pooling=pooling)


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as the response carries it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def embedding_response(request: EmbeddingRequest, model: str,
                       pooled: list[list[float]], prompt_lengths: list[int]) -> dict[str, Any]:
    """OpenAI's response: one item per input, in order; usage counts prompt tokens only.
    Built as plain dicts: a pydantic model would validate every float of every vector."""
    tokens = sum(prompt_lengths)
    data = [{"object": "embedding", "index": i,
             "embedding": encode_embedding(v, request.encoding_format)}
            for i, v in enumerate(pooled)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
