"""JSON mode within ``max_tokens``: the shortest text that closes a JSON prefix, and the
steering that leaves a request enough tokens to write it (docs/serving.md, Structured
outputs).

A JSON-mode request (``json_object``) is any object, so its strings, arrays and nesting
have no end the grammar could force: a weak model that seldom writes a closing quote runs
out of ``max_tokens`` mid-string and returns text no parser reads. ``JsonCloser`` follows
the output byte by byte (pure Python, a tuple state cheap to keep per token for rollback)
and knows the shortest closing of what is open: a string's quote, a pending escape, a
number's missing digit, the rest of a literal, ``null`` for a value a key still waits for,
then each open container's bracket. ``steer_row`` narrows a bitmask row as the budget
nears that length: first it drops the tokens that could lengthen the closing beyond what
is left (``growth_bound``), then, with exactly enough left, it allows only tokens that
spell the closing, and the stop token once the object is whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The state: (open containers, "o" or "a" each, innermost last; mode; detail).
# Modes: root (before the object), done (the object closed), value (a value expected),
# obj_first (after "{"), obj_key (after "," in an object), colon (after a key), after
# (after a value), arr_first (after "["), str (in a string; detail "k" a key, "v" a value,
# then "\\" after a backslash, or "u" plus the hex digits still due), num (detail: the
# number's part), lit (detail: the literal's remaining bytes).
State = tuple[str, str, str]
START: State = ("", "root", "")
_WS = b" \t\n\r"
_NUM_NEEDS_DIGIT = ("sign", "dot", "exp", "exp_sign")
_NULL = b"null"
# The most one byte can lengthen the closing in any state (an upper bound, state-free);
# a UTF-8 lead byte adds the continuation bytes it calls for (``utf8_due``).
# A literal or a sign opening an array's first value: "n" -> "ull", "t" -> "rue",
# "f" -> "alse", "-" -> a digit (after "[" the closing needs no value before them).
_BYTE_GROWTH = {ord(","): 7, ord('"'): 6, ord("u"): 3, ord("{"): 1, ord("["): 1,
                ord("\\"): 1, ord("."): 1, ord("e"): 1, ord("E"): 1,
                ord("n"): 3, ord("t"): 3, ord("f"): 4, ord("-"): 1,
                **{b: 1 for b in range(0xC0, 0xE0)}, **{b: 2 for b in range(0xE0, 0xF0)},
                **{b: 3 for b in range(0xF0, 0x100)}}


def growth_bound(token_bytes: bytes) -> int:
    """How much more the text can need after this token (its closing, plus the bytes
    of an unfinished character), from any state."""
    return sum(_BYTE_GROWTH.get(b, 0) for b in token_bytes)


def utf8_due(due: int, data: bytes) -> int:
    """Continuation bytes the text still owes its last character after ``data``, given
    ``due`` before it."""
    for b in data:
        due = 3 if b >= 0xF0 else 2 if b >= 0xE0 else 1 if b >= 0xC0 else (
            max(due - 1, 0) if b >= 0x80 else 0)
    return due


def _after_value(stack: str) -> State:
    return (stack, "after", "") if stack else ("", "done", "")


def _start_value(stack: str, b: int) -> State | None:
    """A value's first byte; None if no value starts with it."""
    if b == ord("{"):
        return (stack + "o", "obj_first", "")
    if b == ord("["):
        return (stack + "a", "arr_first", "")
    if b == ord('"'):
        return (stack, "str", "v")
    if b == ord("-"):
        return (stack, "num", "sign")
    if ord("0") <= b <= ord("9"):
        return (stack, "num", "int")
    for literal in (b"true", b"false", b"null"):
        if b == literal[0]:
            return (stack, "lit", literal[1:].decode())
    return None


def _close_container(stack: str, b: int) -> State | None:
    if stack and b == (ord("}") if stack[-1] == "o" else ord("]")):
        return _after_value(stack[:-1])
    return None


def _step(state: State, b: int) -> State | None:
    """The state after one byte; None when the byte is not JSON there (the grammar
    would not have accepted it: the closer stops following)."""
    stack, mode, detail = state
    if mode == "str":
        kind, rest = detail[0], detail[1:]
        if rest == "\\":
            return (stack, mode, kind + ("u4" if b == ord("u") else ""))
        if rest.startswith("u"):
            due = int(rest[1:]) - 1
            return (stack, mode, kind + (f"u{due}" if due else ""))
        if b == ord("\\"):
            return (stack, mode, kind + "\\")
        if b == ord('"'):
            return (stack, "colon", "") if kind == "k" else _after_value(stack)
        return state
    if mode == "num":
        digit = ord("0") <= b <= ord("9")
        if detail in ("sign", "int") and digit:
            return (stack, mode, "int")
        if detail in ("dot", "frac") and digit:
            return (stack, mode, "frac")
        if detail in ("exp", "exp_sign", "exp_digits") and digit:
            return (stack, mode, "exp_digits")
        if detail == "exp" and b in (ord("+"), ord("-")):
            return (stack, mode, "exp_sign")
        if detail == "int" and b == ord("."):
            return (stack, mode, "dot")
        if detail in ("int", "frac") and b in (ord("e"), ord("E")):
            return (stack, mode, "exp")
        if detail in _NUM_NEEDS_DIGIT:
            return None
        return _step(_after_value(stack), b)  # the number ended: the byte is the next one
    if mode == "lit":
        if detail and b == ord(detail[0]):
            return (stack, mode, detail[1:]) if len(detail) > 1 else _after_value(stack)
        return None
    if b in _WS:
        return state
    if mode in ("root", "done"):
        return ("o", "obj_first", "") if mode == "root" and b == ord("{") else None
    if mode == "value":
        return _start_value(stack, b)
    if mode == "arr_first":
        return _close_container(stack, b) or _start_value(stack, b)
    if mode in ("obj_first", "obj_key"):
        if b == ord('"'):
            return (stack, "str", "k")
        return _close_container(stack, b) if mode == "obj_first" else None
    if mode == "colon":
        return (stack, "value", "") if b == ord(":") else None
    # after a value
    if b == ord(","):
        return (stack, "obj_key" if stack[-1] == "o" else "value", "")
    return _close_container(stack, b)


def advance(state: State | None, data: bytes) -> State | None:
    """The state after ``data``; None once the text is not JSON (then never again)."""
    for b in data:
        if state is None:
            return None
        state = _step(state, b)
    return state


def closing(state: State) -> bytes:
    """The shortest bytes that make the text one complete JSON object."""
    stack, mode, detail = state
    head = b""
    if mode == "root":
        return b"{}"
    if mode == "str":
        rest = detail[1:]
        head = (b"n" if rest == "\\" else b"0" * int(rest[1:]) if rest else b"") + b'"'
        if detail[0] == "k":
            head += b":" + _NULL
    elif mode == "num":
        head = b"0" if detail in _NUM_NEEDS_DIGIT else b""
    elif mode == "lit":
        head = detail.encode()
    elif mode == "value":
        head = _NULL
    elif mode == "colon":
        head = b":" + _NULL
    elif mode == "obj_key":
        head = b'"":' + _NULL
    return head + bytes(ord("}") if c == "o" else ord("]") for c in reversed(stack))


class ClosingVocab:
    """The tokenizer's side of steering: each token's bytes by id, the ids of each
    byte string, and each token's ``growth_bound``."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int,
                 special_ids: Sequence[int], stop_ids: Sequence[int]) -> None:
        special = set(special_ids) | set(stop_ids)
        self.by_bytes: dict[bytes, int] = {}
        growth = np.zeros(vocab_size, dtype=np.int32)
        for i, data in enumerate(decoded_vocab[:vocab_size]):
            if i in special or not data:
                growth[i] = np.iinfo(np.int32).max  # never picked while steering
                continue
            self.by_bytes.setdefault(bytes(data), i)
            growth[i] = growth_bound(data)
        growth[len(decoded_vocab):] = np.iinfo(np.int32).max
        growth[list(stop_ids)] = 0  # stopping never lengthens anything
        self.stop_ids = list(stop_ids)
        self.growth = growth
        self.max_growth = int(growth[growth < np.iinfo(np.int32).max].max(initial=0))
        self.max_len = max((len(b) for b in self.by_bytes), default=0)

    def spelling(self, text: bytes) -> list[int]:
        """The tokens whose bytes are a non-empty prefix of ``text``."""
        found = (self.by_bytes.get(text[:k]) for k in range(1, min(len(text), self.max_len) + 1))
        return [t for t in found if t is not None]


def _bits(tokens: Sequence[int], num_words: int) -> np.ndarray:
    row = np.zeros(num_words, dtype=np.uint32)
    for t in tokens:
        row[t // 32] |= np.uint32(1 << (t % 32))
    return row.view(np.int32)


def pack_bool(allowed: np.ndarray, num_words: int) -> np.ndarray:
    """[V] bool -> [num_words] int32, bit t % 32 of word t // 32 (xgrammar's layout)."""
    bits = np.zeros(num_words * 32, dtype=bool)
    bits[:allowed.size] = allowed
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32).view(np.int32)


def steer_row(row: np.ndarray, state: State | None, tokens_left: int,
              vocab: ClosingVocab, extra: int = 0) -> None:
    """Narrow ``row`` (a packed bitmask row, the grammar's mask) in place so the text can
    still close within ``tokens_left`` tokens, the stop token included, and ``extra``
    tokens more (the bytes of an unfinished character, ``utf8_due``). Leaves it as it is while there is room, when
    the closer lost track (``state`` None), or when every narrowing would empty it."""
    if state is None:
        return
    text = closing(state)
    slack = tokens_left - 2 - len(text) - extra  # to spare after this token, closing, stop
    if slack >= vocab.max_growth:
        return
    choices = [pack_bool(vocab.growth <= slack, row.size)] if slack >= 0 else []
    # Exactly enough left: spell the closing, then stop; failing that (a character to
    # finish first), tokens that cannot lengthen the closing.
    choices.append(_bits(vocab.spelling(text) if text else vocab.stop_ids, row.size))
    choices.append(pack_bool(vocab.growth <= 0, row.size))
    for allowed in choices:
        narrowed = row & allowed
        if narrowed.any():
            row[:] = narrowed
            return
