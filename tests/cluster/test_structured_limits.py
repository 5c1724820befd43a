"""The xgrammar backend's bounds: JSON mode is an object, whitespace runs between JSON tokens
are bounded (disable_any_whitespace allows none), and a spec that compiles too slowly is
refused, at the intake and in the engine, and then refused at once."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from raylm.runner.structured import xgrammar_backend as xb
from raylm.scheduler.structured.params import StructuredOutputsParams

# Seconds to parse (nested counted repetitions in a pattern); see test_openai_hostile.py.
SLOW = {"type": "string", "pattern": "^" + "-".join(["([a-z0-9]{1,210}\\.){1,210}"] * 2) + "$"}


@pytest.fixture(scope="module")
def backend(llama_path):
    return xb.XgrammarBackend(AutoTokenizer.from_pretrained(llama_path), 512,
                              compile_timeout_s=0.5)


def _allowed(backend, grammar) -> set[int]:
    row = backend.build_bitmask([grammar])[0]
    return {t for t in range(512) if (int(row[t // 32]) >> (t % 32)) & 1}


def _single_char_token(backend, char: str) -> int:
    return next(t for t, b in enumerate(backend.decoded_vocab) if b == char.encode())


def test_json_object_is_an_object(backend):
    grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(json_object=True)))
    allowed = _allowed(backend, grammar)
    assert _single_char_token(backend, "{") in allowed
    assert _single_char_token(backend, "[") not in allowed  # no bare array (the old grammar)
    assert not {_single_char_token(backend, c) for c in "0t\""} & allowed


@pytest.mark.parametrize("spec", [{"json_object": True},
                                  {"json": {"type": "object", "properties": {
                                      "a": {"type": "integer"}}}}])
def test_whitespace_runs_are_bounded(backend, spec):
    space = _single_char_token(backend, " ")
    grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(**spec)))
    assert grammar.accept_token(_single_char_token(backend, "{"))
    for _ in range(xb.JSON_MAX_WHITESPACE):
        assert space in _allowed(backend, grammar)
        assert grammar.accept_token(space)
    assert space not in _allowed(backend, grammar)
    compact = backend.new_grammar(backend.compile(StructuredOutputsParams(
        **spec, disable_any_whitespace=True)))
    assert compact.accept_token(_single_char_token(backend, "{"))
    assert space not in _allowed(backend, compact)


def test_pretty_printing_two_levels_deep_still_fits(backend):
    import json

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]}
    text = json.dumps({"a": {"b": 1}}, indent=2)  # runs of up to "\n" + 4 spaces
    grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(json=schema)))
    assert grammar.matcher.accept_string(text)
    deeper = json.dumps({"a": {"b": 1}}, indent=4)  # "\n" + 8 spaces: past the bound
    grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(json=schema)))
    assert not grammar.matcher.accept_string(deeper)


def test_slow_spec_times_out_and_is_then_refused_at_once(backend):
    params = StructuredOutputsParams(json=SLOW)
    start = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 0.25 s to compile"):
        xb.validate(params, timeout_s=0.25)
    assert time.monotonic() - start < 2
    start = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 0.25 s"):
        backend.compile(params)  # the engine's compile: refused without trying again
    assert time.monotonic() - start < 0.5


def test_engine_compile_has_its_own_timeout(backend):
    # A spec the intake never saw (offline callers skip nothing, but the engine must
    # protect itself too): its compile against the vocabulary gives up after 0.5 s.
    params = StructuredOutputsParams(json={**SLOW, "minLength": 3})
    start = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 0.5 s to compile"):
        backend.compile(params)
    assert time.monotonic() - start < 2


def test_valid_specs_are_remembered(backend):
    params = StructuredOutputsParams(regex=r"[a-z]{3}-\d{2}")
    xb.validate(params)
    future, check = xb.start_check(params)
    assert check is None and future.done() and future.result() is None
    bad = StructuredOutputsParams(regex="a(b")
    with pytest.raises(ValueError, match="regex does not compile"):
        xb.validate(bad)
    future, check = xb.start_check(bad)
    assert check is None and isinstance(future.exception(), ValueError)
