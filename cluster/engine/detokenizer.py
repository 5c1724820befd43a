"""Incremental detokenization and stop-string matching for one output sequence."""

from __future__ import annotations

from typing import Any

from raylm.scheduler.sampling_params import SamplingParams

# Tokens decoded again around the read offset: enough context for byte-level BPE and
# SentencePiece to join pieces the way a full decode would.
_INITIAL_CONTEXT = 5


def fast_decoder(tokenizer: Any) -> Any:
    """``tokenizer.decode``, or the Rust tokenizer's own ``decode`` where that returns the
    same text: a Hugging Face fast tokenizer that does no ``clean_up_tokenization_spaces``
    post-processing only adds Python overhead around it, paid twice per token per request
    every step."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is not None and type(backend).__module__.startswith("tokenizers")
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False):
        return backend.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without re-decoding everything.

    Keeps ``prefix_offset``/``read_offset`` into the token list: the text of
    ``tokens[prefix_offset:]`` minus that of ``tokens[prefix_offset:read_offset]`` is the
    new text; an incomplete UTF-8 sequence (U+FFFD at the end) waits for the next token.
    Stop strings are matched on the produced text; ``stop_buffer_length`` characters are
    held back from streaming so a partial stop string is never sent and then taken back.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = 0 if self.include_stop else max((len(s) for s in self.stop), default=1) - 1
        self.detokenize = params.detokenize
        self.token_ids: list[int] = []
        # Start from the prompt's tail so the first output token joins the prompt correctly
        # (a leading space, a byte sequence split across the boundary).
        self._context = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self._context)
        self.output_text = ""
        self._num_sent = 0
        self._decode_ids = fast_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_id: int) -> str | None:
        """Append one token; return the stop string it completed, if any."""
        self.token_ids.append(new_token_id)
        if not self.detokenize:
            return None  # token ids only (no stop strings: SamplingParams rejects them)
        self._context.append(new_token_id)
        prefix_text = self._decode(self._context[self.prefix_offset:self.read_offset])
        full_text = self._decode(self._context[self.prefix_offset:])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return None
        self.output_text += full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._context)
        if not self.stop or len(self.token_ids) < self.min_tokens:
            return None
        return self._check_stop_strings(len(full_text) - len(prefix_text))

    def _check_stop_strings(self, new_chars: int) -> str | None:
        for stop in self.stop:
            # Only a window that includes new text can hold a new match.
            start = max(0, len(self.output_text) - new_chars - len(stop) + 1)
            idx = self.output_text.find(stop, start)
            if idx != -1:
                end = idx + len(stop) if self.include_stop else idx
                self.output_text = self.output_text[:end]
                return stop
        return None

    def get_text(self, finished: bool) -> str:
        """Text safe to show: all of it when finished, else minus the stop-string buffer."""
        if finished or not self.stop_buffer_length:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.stop_buffer_length)]

    def flush(self) -> None:
        """At the end, emit any bytes still waiting for completion (e.g. a lone U+FFFD)."""
        if not self.detokenize:
            return
        full = self._decode(self._context[self.prefix_offset:])
        prefix = self._decode(self._context[self.prefix_offset:self.read_offset])
        if len(full) > len(prefix) and full.startswith(prefix):
            self.output_text += full[len(prefix):]
            self.prefix_offset = self.read_offset = len(self._context)

    def decode_token(self, token_id: int) -> str | None:
        if not self.detokenize:
            return None
        return self._decode_ids([token_id], skip_special_tokens=False)
