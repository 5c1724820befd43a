"""Structured outputs through the offline engine, random-weight checkpoints (so validity
comes only from the constraint): 64 concurrent constrained requests all finish valid with
async scheduling; greedy output is identical with async on and off; unconstrained
requests in a mixed batch get exactly their tokens alone; bad specs are ValueErrors
before the engine; a token the grammar rejects ends only its request."""

from __future__ import annotations

import pytest
from structured_workload import check, wait_for_free_kv, workload

from raylm import LLM, SamplingParams, StructuredOutputsParams

N = 64
ENGINE = dict(max_num_seqs=N, block_size=16, max_model_len=512)


def _params(constraint: dict) -> SamplingParams:
    so = StructuredOutputsParams(**constraint, disable_any_whitespace="json" in constraint)
    return SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=so)


def _run(llm: LLM, items, free_prompts=()):
    prompts = [p for p, _ in items] + list(free_prompts)
    params = [_params(c) for _, c in items] + [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in free_prompts]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def results(llama_path):
    items = workload(N)
    free = [f"free prompt number {i} about the river" for i in range(6)]
    out = {}
    for async_scheduling in (True, False):
        llm = LLM(llama_path, async_scheduling=async_scheduling, **ENGINE)
        try:
            mixed = _run(llm, items, free)
            alone = _run(llm, [], free) if async_scheduling else None
            wait_for_free_kv(llm)
        finally:
            llm.shutdown()
        out[async_scheduling] = (mixed, alone)
    return items, out


def test_64_concurrent_constrained_requests_are_valid(results):
    items, out = results
    mixed, _ = out[True]
    failures = []
    for (_, constraint), o in zip(items, mixed, strict=False):
        c = o.outputs[0]
        try:
            assert c.finish_reason == "stop", c.finish_reason
            check(c.text, constraint)
        except Exception as e:  # noqa: BLE001 - collect them all
            failures.append((constraint, c.text, c.finish_reason, repr(e)))
    assert not failures, failures[:5]


def test_async_on_off_identical_and_mixed_batch(results):
    _, out = results
    on, alone = out[True]
    off, _ = out[False]
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    # The unconstrained requests of the mixed batch got exactly their tokens alone.
    free = on[N:]
    assert [o.outputs[0].token_ids for o in free] == [o.outputs[0].token_ids for o in alone]
    assert all(len(o.outputs[0].token_ids) == 24 for o in free)


def test_bad_specs_are_value_errors(llama_path):
    llm = LLM(llama_path, **ENGINE)
    try:
        bad = [({"json": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}},
                "frobnicate"),
               ({"json": "{not json"}, "not valid JSON"),
               ({"regex": "a(b"}, "regex"),
               ({"grammar": "root ::= "}, "grammar")]
        for constraint, needle in bad:
            with pytest.raises(ValueError, match=needle):
                llm.generate(["hi"], SamplingParams(
                    structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
        # The engine is unharmed.
        ok = llm.generate(["hi"], _params({"choice": ["a", "b"]}), use_tqdm=False)
        assert ok[0].outputs[0].text in ("a", "b")
    finally:
        llm.shutdown()


def test_rejected_token_finishes_with_error(llama_path, monkeypatch):
    from raylm.runner.structured import xgrammar_backend

    real = xgrammar_backend.XgrammarGrammar.accept_tokens
    seen: dict[int, int] = {}

    def accept_then_reject(self, tokens):
        # A grammar/tokenizer mismatch stand-in: the third token of a regex request fails.
        seen[id(self)] = seen.get(id(self), 0) + len(tokens)
        return real(self, tokens) and not (self.reject and seen[id(self)] >= 3)

    monkeypatch.setattr(xgrammar_backend.XgrammarGrammar, "accept_tokens", accept_then_reject)
    monkeypatch.setattr(xgrammar_backend.XgrammarGrammar, "reject", False, raising=False)
    llm = LLM(llama_path, **ENGINE)
    try:
        manager = llm.llm_engine.core.engine_core.scheduler.structured_output_manager
        backend = manager._get_backend() if manager._backend else None
        assert backend is None  # built lazily at the first constrained request
        real_new = xgrammar_backend.XgrammarBackend.new_grammar

        def new_grammar(self, compiled):
            g = real_new(self, compiled)
            g.reject = compiled is self._reject_compiled
            return g

        items = [("a", {"regex": r"[a-z]{5,9}"}), ("b", {"choice": ["one", "two"]})]
        monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "new_grammar", new_grammar)
        monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "_reject_compiled", None,
                            raising=False)
        real_compile = xgrammar_backend.XgrammarBackend.compile

        def compile_(self, params):
            compiled = real_compile(self, params)
            if params.kind == "regex":
                xgrammar_backend.XgrammarBackend._reject_compiled = compiled
            return compiled

        monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "compile", compile_)
        outs = _run(llm, items, ["free one"])
        assert outs[0].outputs[0].finish_reason == "error"
        assert len(outs[0].outputs[0].token_ids) == 3
        assert outs[1].outputs[0].finish_reason == "stop"
        assert outs[1].outputs[0].text in ("one", "two")
        assert len(outs[2].outputs[0].token_ids) == 24
        wait_for_free_kv(llm)
    finally:
        llm.shutdown()
