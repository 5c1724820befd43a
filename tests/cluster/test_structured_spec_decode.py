"""Structured outputs with speculative decoding, through the offline engine on
random-weight checkpoints (so validity comes only from the constraint): the grammar cuts
each draft at its first refused token and masks every verified position, so with ngram
drafts (k = 1 and 3) every constrained output is valid and greedy output is the very
output of no speculation, async on and off; unconstrained requests in the batch get their
tokens alone; max_tokens, stop strings and min_tokens act as without speculation; a token
the grammar rejects ends only its request (finish_reason error); with a draft model equal
to the target every draft the grammar keeps is accepted."""

from __future__ import annotations

import contextlib

import pytest
from structured_workload import CHOICES, REGEXES, SCHEMAS, check, wait_for_free_kv

from raylm import LLM, SamplingParams, StructuredOutputsParams
from raylm.runner.structured import xgrammar_backend

ENGINE = dict(max_num_seqs=16, block_size=16, max_model_len=384)
# Prompts that hold text the constraint admits, so prompt lookup proposes drafts the
# grammar keeps (and, further on, drafts it must cut).
ITEMS = [
    ('{"level": 2, "note": "abc"} {"level": 1, "note": "xy"}', {"json": SCHEMAS[2]}),
    ('{"points": [{"x": 3, "ok": true}, {"x": -1, "ok": false}]}', {"json": SCHEMAS[1]}),
    ('{"name": "bo", "age": 7, "role": "user", "address": {"city": "rome", "zip": 12345}, '
     '"tags": ["a"]}', {"json": SCHEMAS[0]}),
    ("call 555-1234 or 555-9876 or 555-", {"regex": REGEXES[1]}),
    ("yes, Anna! no, Bob! yes, Cy! no,", {"regex": REGEXES[2]}),
    ("ann@abc.com bob@xyz.org cy@", {"regex": REGEXES[0]}),
    ("red green blue red green", {"choice": CHOICES[0]}),
    ("positive negative neutral positive", {"choice": CHOICES[1]}),
    ("the river model ray serve", {"json": SCHEMAS[2]}),
    ("quick brown fox", {"regex": REGEXES[1]}),
]
FREE = ["an unconstrained prompt about the river", "the river the river the river"]
# Cut by max_tokens / a stop string inside the constrained text; under ignore_eos the
# grammar's end (its stop token accepted) ends the request.
CUT = [("call 555-1234 or 555-9876 or 555-", {"regex": REGEXES[1]}, {"max_tokens": 3}),
       ('{"level": 2, "note": "abc"}', {"json": SCHEMAS[2]}, {"stop": ['"note"']}),
       ("red green blue red green", {"choice": CHOICES[0]}, {"ignore_eos": True})]
# min_tokens holds a stop token back where the grammar allows it: this prompt's text
# (random weights) reaches the stop token STOP_WORD at its 4th token.
STOP_WORD = " ha"
MIN = [("the river the river the", {"regex": "[a-z ]{1,40}"}, {"min_tokens": n})
       for n in (0, 6)]


def _ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}


def _so(constraint: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(**constraint, disable_any_whitespace="json" in constraint)


def _requests(items=ITEMS, free=FREE, cut=CUT, stop_token_id: int | None = None):
    """Prompts and params; with ``stop_token_id`` the MIN requests follow (stopping there)."""
    cut = list(cut) + [(p, c, {**kw, "stop_token_ids": [stop_token_id]})
                       for p, c, kw in (MIN if stop_token_id is not None else [])]
    prompts = [p for p, _ in items] + list(free) + [p for p, _, _ in cut]
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=_so(c))
              for _, c in items]
    params += [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in free]
    params += [SamplingParams(temperature=0.0, **{"max_tokens": 160, **kw},
                              structured_outputs=_so(c)) for _, c, kw in cut]
    return prompts, params


@contextlib.contextmanager
def _count_drafts():
    """Count the drafts handed to the grammar and those it kept (grammar by grammar)."""
    counts = {"placed": 0, "kept": 0}
    real = xgrammar_backend.XgrammarBackend.build_spec_bitmask

    def spy(self, grammars, drafts):
        rows, kept = real(self, grammars, drafts)
        counts["placed"] += sum(len(d) for d in drafts)
        counts["kept"] += sum(kept)
        return rows, kept

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(xgrammar_backend.XgrammarBackend, "build_spec_bitmask", spy)
        yield counts


def _run(path: str, spec: dict | None, async_scheduling: bool, alone: bool = False):
    llm = LLM(path, async_scheduling=async_scheduling, speculative_config=spec, **ENGINE)
    try:
        with _count_drafts() as counts:
            [stop_id] = llm.get_tokenizer().encode(STOP_WORD, add_special_tokens=False)
            outs = llm.generate(*_requests(stop_token_id=stop_id), use_tqdm=False)
        free = llm.generate(*_requests([], FREE, []), use_tqdm=False) if alone else None
        wait_for_free_kv(llm)
        return outs, free, counts, llm.get_metrics()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def runs(loopy_llama_path):
    """(k, async) -> (outputs, free alone, draft counts, metrics); k None: no speculation."""
    return {(k, a): _run(loopy_llama_path, None if k is None else _ngram(k), a, alone=k == 3)
            for k, a in ((None, True), (3, True), (3, False), (1, True))}


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_every_constrained_output_is_valid_with_speculation(runs):
    for key, (outs, _, counts, metrics) in runs.items():
        for (_, constraint), o in zip(ITEMS, outs, strict=False):
            c = o.outputs[0]
            assert c.finish_reason == "stop", (key, c)
            check(c.text, constraint)
        if key[0] is None:
            continue
        # Drafts were both kept and cut by the grammar, and kept ones accepted.
        assert counts["kept"] > 0 and counts["placed"] > counts["kept"], (key, counts)
        accepted = metrics["raylm:spec_decode_num_accepted_tokens"]
        assert 0 < accepted <= metrics["raylm:spec_decode_num_draft_tokens"], (key, metrics)


def test_greedy_constrained_output_equals_no_speculation(runs):
    ref = _tokens(runs[None, True][0])
    for key, (outs, _, _, _) in runs.items():
        assert _tokens(outs) == ref, key
    # max_tokens, stop strings and the grammar's end cut the constrained text where they
    # cut without drafts.
    for key, (outs, _, _, _) in runs.items():
        length, stop, end, first, held = (o.outputs[0] for o in outs[-len(CUT) - len(MIN):])
        assert length.finish_reason == "length" and len(length.token_ids) == 3, key
        assert stop.finish_reason == "stop" and stop.stop_reason == '"note"', key
        assert stop.text.startswith('{"level": ') and '"note"' not in stop.text, key
        assert end.finish_reason == "stop" and end.text in CHOICES[0], key
        assert first.finish_reason == "stop" and len(first.token_ids) == 4, (key, first)
        assert first.stop_reason == first.token_ids[-1], (key, first)
        assert held.finish_reason == "stop" and len(held.token_ids) >= 6, (key, held)
        assert held.token_ids[:3] == first.token_ids[:3], (key, held)
        assert first.token_ids[-1] not in held.token_ids[:6], (key, held)
        for c in (first, held):  # the regex admits every prefix of its texts
            check(c.text, MIN[0][1])


def test_unconstrained_requests_in_the_batch_get_their_tokens_alone(runs):
    n = len(ITEMS)
    outs, alone, _, _ = runs[3, True]
    assert _tokens(outs[n:n + len(FREE)]) == _tokens(alone)
    assert _tokens(runs[None, True][0][n:n + len(FREE)]) == _tokens(alone)
    assert all(len(t) == 24 for t in _tokens(alone))


def test_rejected_token_finishes_only_its_request_with_error(loopy_llama_path, monkeypatch):
    real = xgrammar_backend.XgrammarGrammar.accept_tokens
    seen: dict[int, int] = {}

    def accept_then_reject(self, tokens):
        # A grammar/tokenizer mismatch stand-in: a regex request's third settled token.
        seen[id(self)] = seen.get(id(self), 0) + len(tokens)
        return real(self, tokens) and not (self.is_json is False and self.reject
                                           and seen[id(self)] >= 3)

    real_new = xgrammar_backend.XgrammarBackend.new_grammar

    def new_grammar(self, compiled):
        g = real_new(self, compiled)
        g.reject = compiled[0] is self.compiled_regex
        return g

    real_compile = xgrammar_backend.XgrammarBackend.compile

    def compile_(self, params):
        compiled = real_compile(self, params)
        if params.regex == REGEXES[1]:
            self.compiled_regex = compiled[0]
        return compiled

    monkeypatch.setattr(xgrammar_backend.XgrammarGrammar, "accept_tokens", accept_then_reject)
    monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "new_grammar", new_grammar)
    monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "compile", compile_)
    monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "compiled_regex", None, raising=False)
    items = [ITEMS[3], ITEMS[0], ITEMS[6]]
    llm = LLM(loopy_llama_path, async_scheduling=True, speculative_config=_ngram(3), **ENGINE)
    try:
        outs = llm.generate(*_requests(items, FREE[:1], []), use_tqdm=False)
        bad, *good = (o.outputs[0] for o in outs)
        assert bad.finish_reason == "error" and len(bad.token_ids) == 3, bad
        for (_, constraint), c in zip(items[1:], good, strict=False):
            assert c.finish_reason == "stop", c
            check(c.text, constraint)
        assert len(good[-1].token_ids) == 24
        wait_for_free_kv(llm)
        # The engine is unharmed.
        again = llm.generate(*_requests(items[1:2], [], []), use_tqdm=False)
        assert again[0].outputs[0].token_ids == good[0].token_ids
    finally:
        llm.shutdown()


def test_draft_model_equal_to_target_accepts_every_draft_the_grammar_keeps(llama_path):
    spec = {"method": "draft_model", "model": llama_path, "num_speculative_tokens": 3}
    plain, _, _, _ = _run(llama_path, None, True)
    outs, _, counts, metrics = _run(llama_path, spec, True)
    assert _tokens(outs) == _tokens(plain)
    for (_, constraint), o in zip(ITEMS, outs, strict=False):
        check(o.outputs[0].text, constraint)
    # The draft model drafts unconstrained: the grammar cuts some drafts; every draft it
    # keeps is the target's masked argmax, so verification accepts it.
    assert counts["placed"] > counts["kept"] > 0, counts
    assert (metrics["raylm:spec_decode_num_accepted_tokens"]
            == metrics["raylm:spec_decode_num_draft_tokens"]), metrics
