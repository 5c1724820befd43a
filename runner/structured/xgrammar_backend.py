"""The structured-output backend on xgrammar: compile, match, and fill token bitmasks.

Plugged into ``raylm.scheduler.structured.manager.StructuredOutputManager`` (which runs
``compile`` on its threads and caches the result by spec). xgrammar imports torch, which
is why this lives in the runner layer and not beside the scheduler. ``validate`` is the
front end's check: it parses a spec without a tokenizer, so a bad schema or regex is a
ValueError (HTTP 400) before the request reaches the engine.

JSON: ``json_object`` is a JSON object (the schema ``{"type": "object"}``, as OpenAI's JSON
mode and vLLM), never a bare array or number. Whitespace between JSON tokens is bounded:
at most ``JSON_MAX_WHITESPACE`` characters in a row (xgrammar's ``max_whitespace_cnt``),
enough for a newline and the indentation of pretty-printed JSON a few levels deep, and too
few for a weak model to spend its whole ``max_tokens`` on blanks (docs/serving.md,
Structured outputs). ``disable_any_whitespace`` allows none at all.

Time: a spec is parsed (the tokenizer-free step, where the slow cases are: a regex
``pattern`` with nested counted repetitions takes seconds) on a thread of its own, which
xgrammar runs without the GIL, and waited for at most a timeout: ``start_check`` for the
server's intake (awaited off its event loop), ``validate`` for the offline one. A spec
that timed out is remembered and refused at once afterwards; so is the engine's compile
(``XgrammarBackend.compile``, with ``ENGINE_COMPILE_TIMEOUT_S``). A thread that timed out
cannot be stopped: it runs to its end, and while ``MAX_RUNAWAY_CHECKS`` of them still
run, new checks are refused rather than queued behind them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from raylm.runner.structured.json_closing import (
    START,
    ClosingVocab,
    State,
    advance,
    pack_bool,
    steer_row,
    utf8_due,
)
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.structured.manager import StructuredOutputGrammar, StructuredOutputManager
from raylm.scheduler.structured.params import StructuredOutputsParams

# Most whitespace characters in a row between JSON tokens (xgrammar 0.2.9's
# ``max_whitespace_cnt``): a newline and 5 spaces, the indentation of pretty-printed JSON
# two levels deep at 2 spaces a level (one at 4). Unbounded, a random-weight model spends
# its max_tokens on blanks (docs/performance.md, Structured outputs, has the counts).
JSON_MAX_WHITESPACE = 6
# The schema of OpenAI's JSON mode (``response_format: {"type": "json_object"}``).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Seconds a spec may take to parse (the intake's default; ``grammar_compile_timeout_s``).
DEFAULT_CHECK_TIMEOUT_S = 10.0
# Seconds the engine waits for a compile against the vocabulary; the request then ends
# with finish_reason "error".
ENGINE_COMPILE_TIMEOUT_S = 60.0
# Timed-out checks still running beyond which new ones are refused at once.
MAX_RUNAWAY_CHECKS = 4
_MEMO_SIZE = 4096


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
    if params.kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if isinstance(params.json, dict):
        return json.dumps(params.json)
    try:
        json.loads(str(params.json))
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    return str(params.json)


def json_whitespace(params: StructuredOutputsParams) -> dict[str, Any]:
    """xgrammar's whitespace keywords for a JSON spec (see the module docstring)."""
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": JSON_MAX_WHITESPACE}


def _compile_error(kind: str, e: Exception) -> ValueError:
    # xgrammar's messages may start with its C++ source location: keep the last line.
    message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return ValueError(f"structured_outputs.{kind} does not compile: {message}")


def _parse(params: StructuredOutputsParams) -> None:
    """Parse the spec into a grammar without a tokenizer; ValueError naming the problem."""
    xgr = _xgr()
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(_schema_text(params), **json_whitespace(params))
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(params.choice or ()))
    except ValueError as e:
        if str(e).startswith("structured_outputs."):
            raise
        raise _compile_error(kind, e) from None
    except Exception as e:  # xgrammar raises RuntimeError with its parser's message
        raise _compile_error(kind, e) from None


class _Memo:
    """What is known of specs already checked, by a digest of their cache key: valid,
    or too slow (an LRU, so a flood of distinct specs cannot grow it without end)."""

    def __init__(self, size: int = _MEMO_SIZE) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._known: OrderedDict[bytes, str] = OrderedDict()  # digest -> "ok" | error
        self.runaway = 0  # timed-out threads still running

    @staticmethod
    def key(params: StructuredOutputsParams) -> bytes:
        return hashlib.sha256(repr((params.cache_key, json_whitespace(params))).encode(
            "utf-8", "surrogatepass")).digest()

    def get(self, key: bytes) -> str | None:
        with self._lock:
            found = self._known.get(key)
            if found is not None:
                self._known.move_to_end(key)
            return found

    def put(self, key: bytes, outcome: str) -> None:
        with self._lock:
            self._known[key] = outcome
            self._known.move_to_end(key)
            while len(self._known) > self._size:
                self._known.popitem(last=False)

    def timed_out(self, key: bytes, message: str) -> None:
        self.put(key, message)
        with self._lock:
            self.runaway += 1

    def runaway_done(self) -> None:
        with self._lock:
            self.runaway -= 1


_memo = _Memo()


def _timeout_message(params: StructuredOutputsParams, timeout_s: float) -> str:
    return (f"structured_outputs.{params.kind} took longer than {timeout_s:g} s to compile "
            "(grammar_compile_timeout_s); simplify it (nested counted repetitions such as "
            "(x{1,200}){1,200} expand into very large grammars).")


class _Check:
    """``fn`` on a thread of its own; ``future`` gets its result or exception.

    A waiter that gives up calls ``timed_out``; if the thread then ends later, it tells
    the memo (one runaway fewer) instead of recording its outcome, so a spec that timed
    out stays refused."""

    def __init__(self, fn: Callable[[], Any], key: bytes, memo_outcome: bool) -> None:
        self.key = key
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()
        self._lock = threading.Lock()
        self._ended = self._abandoned = False
        self._fn, self._memo_outcome = fn, memo_outcome
        # Not a daemon: the interpreter's exit waits for a runaway compile to end (a daemon
        # thread stopped inside xgrammar's C++ code aborts the process).
        threading.Thread(target=self._run, name="raylm-grammar-check", daemon=False).start()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            result = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            error = e
        with self._lock:
            self._ended, late = True, self._abandoned
        if late:
            _memo.runaway_done()
        elif self._memo_outcome and (error is None or isinstance(error, ValueError)):
            _memo.put(self.key, "ok" if error is None else str(error))
        if error is None:
            self.future.set_result(result)
        else:
            self.future.set_exception(error)

    def timed_out(self, params: StructuredOutputsParams, timeout_s: float) -> ValueError:
        """The waiter gives up: from now on the spec is refused. The error to raise."""
        message = _timeout_message(params, timeout_s)
        with self._lock:
            if not self._ended:
                self._abandoned = True
                _memo.timed_out(self.key, message)
        return ValueError(message)


def _resolved(outcome: str) -> Future:
    future: Future = Future()
    if outcome == "ok":
        future.set_result(None)
    else:
        future.set_exception(ValueError(outcome))
    return future


def start_check(params: StructuredOutputsParams) -> tuple[Future, _Check | None]:
    """Start checking that ``params`` compiles: a Future of None or its ValueError, and
    the running check (None when the outcome is known at once: a spec seen before, or
    the compiler busy with runaways). Wait with a timeout, then ``check.timed_out``."""
    key = _memo.key(params)
    known = _memo.get(key)
    if known is not None:
        return _resolved(known), None
    if _memo.runaway >= MAX_RUNAWAY_CHECKS:
        return _resolved(
            "structured outputs are refused for now: earlier specs that took too long to "
            "compile still occupy the grammar compiler; retry later."), None
    check = _Check(lambda: _parse(params), key, memo_outcome=True)
    return check.future, check


def validate(params: StructuredOutputsParams,
             timeout_s: float = DEFAULT_CHECK_TIMEOUT_S) -> None:
    """Raise ValueError naming the problem if the constraint cannot compile, or does not
    within ``timeout_s`` (blocks the calling thread; the server awaits ``start_check``)."""
    future, check = start_check(params)
    try:
        future.result(timeout=timeout_s)
    except TimeoutError:
        assert check is not None
        raise check.timed_out(params, timeout_s) from None


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


class XgrammarGrammar:
    """One request's matcher. ``is_json``: its bitmask rows also drop raw control
    characters (xgrammar 0.2's rule for length-bounded strings lets them through).
    ``closes_json`` (JSON mode): the text is followed so that it can close within the
    request's ``max_tokens`` (``json_closing``)."""

    def __init__(self, matcher: Any, is_json: bool, decoded_vocab: list[bytes],
                 closes_json: bool = False) -> None:
        self.matcher = matcher
        self.is_json = is_json
        self._decoded_vocab = decoded_vocab
        # Last byte of the accepted text after each accepted token (a UTF-8 lead byte
        # constrains the next token); kept per token so a rollback restores it.
        self._last_bytes: list[int] = []
        # JSON mode: the closer's state before any token, then after each accepted one.
        self._closer: list[State | None] | None = [START] if closes_json else None
        self._due: list[int] = [0]  # JSON mode: ``utf8_due`` before and after each token
        self.max_tokens: int | None = None

    def limit_tokens(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    @property
    def closes_json(self) -> bool:
        return self._closer is not None

    @property
    def closer_state(self) -> State | None:
        return None if self._closer is None else self._closer[-1]

    @property
    def utf8_due(self) -> int:
        return self._due[-1]

    @property
    def tokens_left(self) -> int | None:
        """Output tokens still allowed after those accepted (None: no limit known)."""
        return None if self.max_tokens is None else self.max_tokens - len(self._last_bytes)

    def accept_token(self, token: int) -> bool:
        if not self.matcher.accept_token(token):
            return False
        last = self._last_bytes[-1] if self._last_bytes else 0
        data = self._decoded_vocab[token] if token < len(self._decoded_vocab) else b""
        if data:
            last = data[-1]
        self._last_bytes.append(last)
        if self._closer is not None:
            state = self._closer[-1]
            self._closer.append(state if self.matcher.is_terminated() else advance(state, data))
            self._due.append(utf8_due(self._due[-1], data))
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
            if self._closer is not None:
                del self._closer[len(self._closer) - num_tokens:]
                del self._due[len(self._due) - num_tokens:]

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int,
                 compile_timeout_s: float = ENGINE_COMPILE_TIMEOUT_S) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # The manager caches compiled grammars by spec; one thread per compile here.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1,
                                            cache_enabled=False)
        self.decoded_vocab = list(self.tokenizer_info.decoded_vocab[:vocab_size])
        self._valid_utf8 = self._mask(lambda b: not any(x in _NEVER_UTF8 for x in b))
        self._json_allowed = self._mask(lambda b: not any(x in _JSON_FORBIDDEN_BYTES for x in b))
        stop = np.zeros(vocab_size, dtype=bool)
        stop[list(self.tokenizer_info.stop_token_ids)] = True
        self._stop_only = pack_bool(stop, (vocab_size + 31) // 32)
        self._closing_vocab: ClosingVocab | None = None  # built for the first JSON mode
        self._after_lead = {lead: self._mask(lambda b, bad=bad: not b or b[0] not in bad)
                            for lead, bad in _BAD_AFTER_LEAD.items()}

    def _mask(self, ok: Any) -> np.ndarray:
        """Packed row allowing the tokens whose bytes satisfy ``ok`` (stop tokens always)."""
        allowed = np.array([ok(b) for b in self.decoded_vocab]
                           + [True] * (self.vocab_size - len(self.decoded_vocab)), dtype=bool)
        allowed[list(self.tokenizer_info.stop_token_ids)] = True
        return pack_bool(allowed, (self.vocab_size + 31) // 32)

    def compile(self, params: StructuredOutputsParams) -> tuple[Any, bool, bool]:
        """(compiled grammar, whether its output is JSON, whether it is JSON mode, which
        closes within max_tokens: ``json_closing``). Waits at most
        ``compile_timeout_s``; a spec that timed out is refused at once afterwards."""
        key = _memo.key(params)
        known = _memo.get(key)
        if known is not None and known != "ok":
            raise ValueError(known)
        check = _Check(lambda: self._compile(params), key, memo_outcome=False)
        try:
            return check.future.result(timeout=self.compile_timeout_s)
        except TimeoutError:
            raise check.timed_out(params, self.compile_timeout_s) from None

    def _compile(self, params: StructuredOutputsParams) -> tuple[Any, bool, bool]:
        c = self.compiler
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                return c.compile_json_schema(_schema_text(params), **json_whitespace(
                    params)), True, kind == "json_object"
            if kind == "regex":
                return c.compile_regex(params.regex), False, False
            if kind == "choice":
                return c.compile_grammar(choice_grammar(params.choice or ())), False, False
            return c.compile_grammar(params.grammar), False, False
        except Exception as e:
            raise _compile_error(kind, e) from None

    def new_grammar(self, compiled: tuple[Any, bool, bool]) -> XgrammarGrammar:
        grammar, is_json, closes_json = compiled
        if closes_json and self._closing_vocab is None:
            self._closing_vocab = ClosingVocab(self.decoded_vocab, self.vocab_size,
                                               self.tokenizer_info.special_token_ids,
                                               self.tokenizer_info.stop_token_ids)
        return XgrammarGrammar(_xgr().GrammarMatcher(grammar), is_json, self.decoded_vocab,
                               closes_json)

    def build_bitmask(self, grammars: list[StructuredOutputGrammar | None]) -> np.ndarray:
        return self.build_spec_bitmask(grammars, [[] for _ in grammars])[0]

    def build_spec_bitmask(self, grammars: list[StructuredOutputGrammar | None],
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
        for any_grammar, draft in zip(grammars, drafts, strict=True):
            grammar = _own_grammar(any_grammar)
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
        left = grammar.tokens_left
        if grammar.closes_json and left is not None and self._closing_vocab is not None:
            # One token less: the engine checks length before the stop token (as vLLM),
            # so a stop token in the last slot still ends the request "length".
            steer_row(rows[r], grammar.closer_state, left - 1, self._closing_vocab,
                      extra=grammar.utf8_due)


def _own_grammar(grammar: StructuredOutputGrammar | None) -> XgrammarGrammar | None:
    """A grammar handed back by the manager: one this backend's new_grammar made."""
    if grammar is not None and not isinstance(grammar, XgrammarGrammar):
        raise TypeError(f"XgrammarBackend got a {type(grammar).__name__}, not its own grammar.")
    return grammar


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
