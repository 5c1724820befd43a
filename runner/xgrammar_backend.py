"""The structured-output backend on xgrammar: compile, match, and fill token bitmasks.

Plugged into ``raylm.scheduler.structured_output.StructuredOutputManager`` (which runs
``compile`` on its threads and caches the result by spec). xgrammar imports torch, which
is why this lives in the runner layer and not beside the scheduler. ``validate`` is the
front end's check: it parses a spec without a tokenizer, so a bad schema or regex is a
ValueError (HTTP 400) before the request reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from raylm.scheduler.engine_config import EngineConfig
from raylm.scheduler.structured_output import StructuredOutputManager
from raylm.scheduler.structured_output_params import StructuredOutputsParams


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose only sentences are the choices."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _schema_text(params: StructuredOutputsParams) -> str:
    if isinstance(params.json, dict):
        return json.dumps(params.json)
    try:
        json.loads(str(params.json))
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    return str(params.json)


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem if the constraint cannot compile."""
    xgr = _xgr()
    kind = params.kind
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(_schema_text(params),
                                         any_whitespace=not params.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(params.choice or ()))
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError with its parser's message
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"structured_outputs.{kind} does not compile: {message}") from None


class XgrammarGrammar:
    """One request's matcher."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, tokens: list[int]) -> bool:
        return all(self.matcher.accept_token(t) for t in tokens)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted = 0
        for t in tokens:
            if not self.matcher.accept_token(t):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return list(tokens[:accepted])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # The manager caches compiled grammars by spec; one thread per compile here.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1,
                                            cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        c = self.compiler
        kind = params.kind
        try:
            if kind == "json":
                return c.compile_json_schema(_schema_text(params),
                                             any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(params.choice or ()))
            return c.compile_grammar(params.grammar)
        except Exception as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {e}") from None

    def new_grammar(self, compiled: Any) -> XgrammarGrammar:
        return XgrammarGrammar(_xgr().GrammarMatcher(compiled))

    def build_bitmask(self, grammars: list[XgrammarGrammar | None]) -> np.ndarray:
        bitmask = _xgr().allocate_token_bitmask(len(grammars), self.vocab_size)  # all allowed
        for i, grammar in enumerate(grammars):
            if grammar is not None:
                grammar.matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask.numpy()


def make_structured_output_manager(config: EngineConfig) -> StructuredOutputManager:
    """The EngineCore's manager; its backend (tokenizer + xgrammar) is built on first use."""
    mc = config.model_config

    def factory() -> XgrammarBackend:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model)
        return XgrammarBackend(tokenizer, mc.vocab_size)

    return StructuredOutputManager(factory)
