"""The structured-output backend on xgrammar: compile, match, and fill token bitmasks.

Plugged into ``raylm.scheduler.structured.manager.StructuredOutputManager`` (which runs
``compile`` on its threads and caches the result by spec). xgrammar imports torch, which
is why this lives in the runner layer and not beside the scheduler. ``validate`` is the
front end's check: it parses a spec without a tokenizer, so a bad schema or regex is a
ValueError (HTTP 400) before the request reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.structured.manager import StructuredOutputManager
from raylm.scheduler.structured.params import StructuredOutputsParams


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


# Bytes that JSON text never holds raw (RFC 8259: control characters inside strings must
# be escaped; tab is legal only as whitespace, which spaces and newlines cover).
_JSON_FORBIDDEN_BYTES = frozenset(range(0x20)) - {0x0A, 0x0D}
# Bytes that valid UTF-8 never holds, and, after a lead byte, the first continuation bytes
# that would make an overlong form, a surrogate or a code point past U+10FFFF. xgrammar
# matches code points leniently (it accepted encoded surrogates from a random-weight
# model), and such bytes make text no JSON parser or regex engine accepts.
_NEVER_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
_BAD_AFTER_LEAD = {0xE0: range(0x80, 0xA0), 0xED: range(0xA0, 0xC0),
                   0xF0: range(0x80, 0x90), 0xF4: range(0x90, 0xC0)}


def _pack(allowed: np.ndarray, num_words: int) -> np.ndarray:
    """[V] bool -> [num_words] int32, bit t % 32 of word t // 32 (xgrammar's layout)."""
    bits = np.zeros(num_words * 32, dtype=bool)
    bits[:allowed.size] = allowed
    return (bits.reshape(num_words, 32).astype(np.int64) << np.arange(32)).sum(1).astype(
        np.uint32).view(np.int32)


class XgrammarGrammar:
    """One request's matcher. ``is_json``: its bitmask rows also drop raw control
    characters (xgrammar 0.2's rule for length-bounded strings lets them through)."""

    def __init__(self, matcher: Any, is_json: bool, decoded_vocab: list[bytes]) -> None:
        self.matcher = matcher
        self.is_json = is_json
        self._decoded_vocab = decoded_vocab
        # Last byte of the accepted text after each accepted token (a UTF-8 lead byte
        # constrains the next token); kept per token so a rollback restores it.
        self._last_bytes: list[int] = []

    def accept_token(self, token: int) -> bool:
        if not self.matcher.accept_token(token):
            return False
        last = self._last_bytes[-1] if self._last_bytes else 0
        if token < len(self._decoded_vocab) and self._decoded_vocab[token]:
            last = self._decoded_vocab[token][-1]
        self._last_bytes.append(last)
        return True

    @property
    def pending_lead_byte(self) -> int:
        return self._last_bytes[-1] if self._last_bytes else 0

    def accept_tokens(self, tokens: list[int]) -> bool:
        return all(self.accept_token(t) for t in tokens)

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
            del self._last_bytes[len(self._last_bytes) - num_tokens:]

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
        self.decoded_vocab = list(self.tokenizer_info.decoded_vocab[:vocab_size])
        self._valid_utf8 = self._mask(lambda b: not any(x in _NEVER_UTF8 for x in b))
        self._json_allowed = self._mask(lambda b: not any(x in _JSON_FORBIDDEN_BYTES for x in b))
        stop = np.zeros(vocab_size, dtype=bool)
        stop[list(self.tokenizer_info.stop_token_ids)] = True
        self._stop_only = _pack(stop, (vocab_size + 31) // 32)
        self._after_lead = {lead: self._mask(lambda b, bad=bad: not b or b[0] not in bad)
                            for lead, bad in _BAD_AFTER_LEAD.items()}

    def _mask(self, ok: Any) -> np.ndarray:
        """Packed row allowing the tokens whose bytes satisfy ``ok`` (stop tokens always)."""
        allowed = np.array([ok(b) for b in self.decoded_vocab]
                           + [True] * (self.vocab_size - len(self.decoded_vocab)), dtype=bool)
        allowed[list(self.tokenizer_info.stop_token_ids)] = True
        return _pack(allowed, (self.vocab_size + 31) // 32)

    def compile(self, params: StructuredOutputsParams) -> tuple[Any, bool]:
        """(compiled grammar, whether its output is JSON)."""
        c = self.compiler
        kind = params.kind
        try:
            if kind == "json":
                return c.compile_json_schema(
                    _schema_text(params), any_whitespace=not params.disable_any_whitespace), True
            if kind == "json_object":
                return c.compile_builtin_json_grammar(), True
            if kind == "regex":
                return c.compile_regex(params.regex), False
            if kind == "choice":
                return c.compile_grammar(choice_grammar(params.choice or ())), False
            return c.compile_grammar(params.grammar), False
        except Exception as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {e}") from None

    def new_grammar(self, compiled: tuple[Any, bool]) -> XgrammarGrammar:
        grammar, is_json = compiled
        return XgrammarGrammar(_xgr().GrammarMatcher(grammar), is_json, self.decoded_vocab)

    def build_bitmask(self, grammars: list[XgrammarGrammar | None]) -> np.ndarray:
        return self.build_spec_bitmask(grammars, [[] for _ in grammars])[0]

    def build_spec_bitmask(self, grammars: list[XgrammarGrammar | None],
                           drafts: list[list[int]]) -> tuple[np.ndarray, list[int]]:
        """Rows for verifying drafts: for each grammar, a row for its state, then one for
        the state after each draft it accepts, the matcher advanced through the drafts
        and rolled back after. The drafts stop at the first token its row forbids (the
        grammar, or the UTF-8 / JSON rules below). Returns the rows (``sum(1 + kept)``
        of them, grammar by grammar) and the drafts kept per grammar; a None grammar
        gets one all-allowed row and keeps none."""
        assert len(drafts) == len(grammars), (len(drafts), len(grammars))
        total = sum(1 + len(d) for d in drafts)
        bitmask = _xgr().allocate_token_bitmask(total, self.vocab_size)  # all allowed
        rows = bitmask.numpy()  # the tensor's memory: rows see what the matcher fills
        r = 0
        kept: list[int] = []
        for grammar, draft in zip(grammars, drafts, strict=True):
            n = 0
            while grammar is not None:
                self._fill_row(grammar, bitmask, rows, r)
                if n == len(draft) or not _allows(rows[r], draft[n]):
                    break
                r += 1
                accepted = grammar.accept_token(draft[n])
                assert accepted, f"draft token {draft[n]} is in its row but the matcher refused it"
                n += 1
            if grammar is not None:
                grammar.rollback(n)
            kept.append(n)
            r += 1
        return rows[:r].copy(), kept

    def _fill_row(self, grammar: XgrammarGrammar, bitmask: Any, rows: np.ndarray,
                  r: int) -> None:
        if grammar.is_terminated():
            # After a stop token (a draft's): the text is complete. The matcher has no
            # next-token mask there; only another stop token keeps the row valid.
            rows[r] = self._stop_only
            return
        grammar.matcher.fill_next_token_bitmask(bitmask, r)
        rows[r] &= self._valid_utf8
        if grammar.is_json:
            rows[r] &= self._json_allowed
        after = self._after_lead.get(grammar.pending_lead_byte)
        if after is not None:
            rows[r] &= after


def _allows(row: np.ndarray, token: int) -> bool:
    return token >= 0 and token < row.size * 32 and bool(
        (int(row[token // 32]) >> (token % 32)) & 1)


def make_structured_output_manager(config: EngineConfig) -> StructuredOutputManager:
    """The EngineCore's manager; its backend (tokenizer + xgrammar) is built on first use."""
    mc = config.model_config

    def factory() -> XgrammarBackend:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model)
        return XgrammarBackend(tokenizer, mc.vocab_size)

    return StructuredOutputManager(factory)
