"""Structured outputs on the scheduler side: grammars compiled off the engine loop.

The EngineCore's loop thread must never wait for a grammar to compile (a large JSON schema
takes seconds), so ``StructuredOutputManager.grammar_init`` only submits the compile to a
thread pool; the request waits in WAITING_FOR_FSM (vLLM's name) until its grammar is ready,
while every other request keeps stepping. Compiled grammars are cached by their spec, and
concurrent requests with the same spec share one compile.

The grammar engine itself (xgrammar) imports torch, so it lives behind the
``StructuredOutputBackend`` protocol (``raylm.runner.structured_output``); this module stays
pure Python. Grammars advance only on settled tokens (``update_from_output``); the
per-step token bitmask is built from their state by ``get_grammar_bitmask``.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from raylm.scheduler.structured.params import StructuredOutputsParams


class StructuredOutputGrammar(Protocol):
    """One request's grammar state (a matcher over a shared compiled grammar)."""

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over ``tokens``; False (state unchanged past the bad one) if rejected."""
        ...

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts; the state is unchanged
        (speculative decoding checks drafts with it)."""
        ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def limit_tokens(self, max_tokens: int) -> None:
        """The request's output may take ``max_tokens`` tokens in all (a grammar that can
        end its text early, JSON mode, closes it within them)."""
        ...


class StructuredOutputBackend(Protocol):
    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile a grammar (slow; runs on the manager's threads). Raises ValueError
        naming the problem when the spec is invalid."""
        ...

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar: ...

    def build_bitmask(self, grammars: list[StructuredOutputGrammar | None]) -> Any:
        """A packed int32 bitmask (numpy, ``[len(grammars), ceil(vocab / 32)]``), bit
        ``t`` of row ``i`` set when grammar ``i`` allows token ``t``; a None row allows all."""
        ...

    def build_spec_bitmask(self, grammars: list[StructuredOutputGrammar | None],
                           drafts: list[list[int]]) -> tuple[Any, list[int]]:
        """Speculative decoding: for each grammar, a row for its state and one after each
        of its drafts it accepts (advanced through them, then rolled back); the drafts
        stop at the first one their row forbids. Returns the rows (grammar by grammar,
        ``1 + kept`` each) and the drafts kept per grammar (None: one row, none kept)."""
        ...


@dataclass
class GrammarOutput:
    """What ``sample_tokens`` needs: the bitmask row of each constrained request.

    With speculative decoding, ``num_draft_tokens[i]`` is how many of request i's drafts
    the grammar kept (the rest are dropped before verification), and it has ``1 +
    num_draft_tokens[i]`` consecutive rows: one per verified position."""

    structured_output_request_ids: list[str]
    grammar_bitmask: Any  # numpy int32 [num rows, ceil(vocab / 32)]
    num_draft_tokens: list[int] | None = None


class StructuredOutputRequest:
    """A request's constraint and, once compiled, its grammar (told the request's
    ``max_tokens``)."""

    def __init__(self, params: StructuredOutputsParams, max_tokens: int | None = None) -> None:
        self.params = params
        self.max_tokens = max_tokens
        self.grammar: StructuredOutputGrammar | None = None
        self.future: Future[StructuredOutputGrammar] | None = None
        self.error: str | None = None

    def is_ready(self) -> bool:
        """True once compiled (or failed: ``error`` says why). Loop thread only."""
        if self.grammar is not None or self.error is not None:
            return True
        if self.future is None or not self.future.done():
            return False
        try:
            self.grammar = self.future.result()
            if self.max_tokens is not None:
                self.grammar.limit_tokens(self.max_tokens)
        except Exception as e:  # noqa: BLE001 - the request ends with finish_reason error
            self.error = f"{type(e).__name__}: {e}"
        self.future = None
        return True


def _default_max_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class StructuredOutputManager:
    """Compiles grammars on a thread pool and builds each step's bitmask.

    ``backend_factory`` is called once, on the pool, at the first constrained request (it
    may load a tokenizer); an engine that never sees one never builds it.
    """

    def __init__(self, backend_factory: Callable[[], StructuredOutputBackend],
                 max_workers: int | None = None, cache_size: int = 256) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}.")
        self._backend_factory = backend_factory
        self._max_workers = max_workers or _default_max_workers()
        self._cache_size = cache_size
        self._pool: ThreadPoolExecutor | None = None
        self._backend: Future[StructuredOutputBackend] | None = None
        self._lock = threading.Lock()
        # Compiled grammars (or their pending compiles) by spec, least recently used first.
        self._compiled: OrderedDict[tuple, Future[Any]] = OrderedDict()
        self.num_compiles = 0  # tests read it: identical specs compile once

    def _get_backend(self) -> StructuredOutputBackend:
        assert self._backend is not None, "grammar_init submits the backend first"
        return self._backend.result()

    def grammar_init(self, so_request: StructuredOutputRequest) -> None:
        """Start compiling (or reuse) the request's grammar; returns at once."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers,
                                            thread_name_prefix="raylm-grammar")
            self._backend = self._pool.submit(self._backend_factory)
        so_request.future = self._pool.submit(self._new_grammar, so_request.params)

    def _new_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        key = params.cache_key
        with self._lock:
            cached = self._compiled.get(key)
            owner = cached is None
            compiled: Future[Any] = Future() if cached is None else cached
            if owner:
                self._compiled[key] = compiled
                while len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        if owner:
            try:
                self.num_compiles += 1
                compiled.set_result(self._get_backend().compile(params))
            except BaseException as e:
                with self._lock:
                    self._compiled.pop(key, None)  # a retry may succeed (or fail again)
                compiled.set_exception(e)
        return self._get_backend().new_grammar(compiled.result())

    def build_bitmask(self, req_ids: list[str], grammars: list[StructuredOutputGrammar | None],
                      drafts: list[list[int]] | None = None) -> GrammarOutput:
        """One row per request; with ``drafts`` (speculative decoding) one per verified
        position, the drafts cut where the grammar stops accepting them."""
        if drafts is None:
            return GrammarOutput(req_ids, self._get_backend().build_bitmask(grammars))
        rows, kept = self._get_backend().build_spec_bitmask(grammars, drafts)
        return GrammarOutput(req_ids, rows, kept)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
