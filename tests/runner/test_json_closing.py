"""JSON mode within max_tokens: the closer's shortest closing makes every prefix of a JSON
object one complete object, no token lengthens it by more than its growth bound, and a
random walk over the grammar's allowed tokens (a random-weight model at its worst) ends
with a stop token and a whole object within max_tokens, every time."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raylm.runner.structured.json_closing import START, advance, closing, growth_bound

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)
_objects = st.dictionaries(st.text(max_size=4), _values, max_size=4)


def _dump(value, indent, ascii_only) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ascii_only)


@settings(max_examples=150, deadline=None)
@given(_objects, st.sampled_from([None, 0, 2]), st.booleans())
def test_every_prefix_closes_into_an_object(value, indent, ascii_only):
    text = _dump(value, indent, ascii_only).encode()
    state = START
    for i in range(len(text) + 1):
        state = advance(START, text[:i]) if i in (0, len(text)) else advance(state, text[i - 1:i])
        assert state is not None, text[:i]
        try:
            text[:i].decode()
        except UnicodeDecodeError:
            continue  # mid-character: the model finishes it first (steer_row's ``extra``)
        closed = text[:i] + closing(state)
        assert isinstance(json.loads(closed), dict), (text[:i], closing(state))
    assert closing(state) == b""  # the whole object: nothing to add


@settings(max_examples=150, deadline=None)
@given(_objects, st.data())
def test_no_chunk_lengthens_the_closing_beyond_its_bound(value, data):
    text = _dump(value, 1, True).encode()
    cut = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    state = START
    for a, b in zip([0, *cut], [*cut, len(text)], strict=True):
        after = advance(state, text[a:b])
        assert after is not None
        assert len(closing(after)) - len(closing(state)) <= growth_bound(text[a:b]), (
            text[:a], text[a:b])
        state = after


def test_closings_of_the_hard_states():
    cases = {b'{"a': b'":null}', b'{"a"': b":null}", b'{"a":': b"null}", b'{"a":-': b"0}",
             b'{"a":1.': b"0}", b'{"a":1e': b"0}", b'{"a":1e+': b"0}", b'{"a":tr': b"ue}",
             b'{"a":"x\\': b'n"}', b'{"a":"\\u1': b'000"}', b'{"a":[1,': b"null]}",
             b'{"a":1,': b'"":null}', b'{"a":[{': b"}]}", b"": b"{}", b"{}": b""}
    for prefix, expected in cases.items():
        assert closing(advance(START, prefix)) == expected, prefix
    assert advance(START, b"[") is None  # not an object: the closer stops following


@pytest.fixture(scope="module")
def backend(llama_path):
    from transformers import AutoTokenizer

    from raylm.runner.structured import xgrammar_backend as xb

    return xb.XgrammarBackend(AutoTokenizer.from_pretrained(llama_path), 512)


@pytest.mark.parametrize("max_tokens", [4, 12, 60, 200])
def test_random_walks_close_their_object_within_max_tokens(backend, max_tokens):
    from raylm.scheduler.structured.params import StructuredOutputsParams

    compiled = backend.compile(StructuredOutputsParams(json_object=True))
    stop = set(backend.tokenizer_info.stop_token_ids)
    rng = np.random.default_rng(max_tokens)
    walks = 32 if max_tokens <= 60 else 12
    for _ in range(walks):
        grammar = backend.new_grammar(compiled)
        grammar.limit_tokens(max_tokens)
        text, ended = b"", False
        # The stop token too must come before the last slot (the engine checks length
        # first): "{", "}", stop at max_tokens=4.
        for _ in range(max_tokens - 1):
            row = backend.build_bitmask([grammar])[0]
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            allowed = allowed[allowed < 512]
            assert allowed.size, text
            token = int(rng.choice(allowed))  # any allowed token, as likely as any other
            assert grammar.accept_token(token)
            if token in stop:
                ended = True
                break
            text += backend.decoded_vocab[token]
        assert ended and grammar.is_terminated(), (max_tokens, text)
        assert isinstance(json.loads(text), dict), text


def test_room_to_spare_leaves_the_grammar_row_alone(backend):
    """Far from max_tokens the row is the grammar's own: nothing is steered."""
    from raylm.scheduler.structured.params import StructuredOutputsParams

    compiled = backend.compile(StructuredOutputsParams(json_object=True))
    free, limited = backend.new_grammar(compiled), backend.new_grammar(compiled)
    limited.limit_tokens(10_000)
    for token_text in (b"{", b'"'):
        token = backend.decoded_vocab.index(token_text)
        assert free.accept_token(token) and limited.accept_token(token)
    assert np.array_equal(backend.build_bitmask([free])[0],
                          backend.build_bitmask([limited])[0])


@pytest.mark.parametrize("token", [b"n", b"t", b"f", b"-", b"\n  n", b"tr"])
def test_a_literal_or_sign_opening_an_arrays_first_value_is_within_the_bound(token):
    """After "[" the closing needs no value, so a literal's first byte lengthens it by
    the rest of the literal (hypothesis found "n" missing from the bound)."""
    state = advance(START, b'{"a": [')
    after = advance(state, token)
    assert len(closing(after)) - len(closing(state)) <= growth_bound(token)
    assert len(closing(after)) > len(closing(state))
