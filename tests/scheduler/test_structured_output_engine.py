"""Structured outputs in the EngineCore against the fake executor (docs/architecture.md §3,
rule 7): grammars compile off the loop (WAITING_FOR_FSM) while other requests step;
grammars advance only on settled tokens; a step whose constrained request still has a
token in flight sends its sampling only after that token is applied; a rejected token
ends only that request (finish_reason error); sync and async give the same tokens."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
from engine_drive import run_until_idle
from sched_fake_executor import FakeExecutor, collect, expected_stream, make_config, make_request

from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core_outputs import FinishReason
from raylm.scheduler.request import RequestStatus
from raylm.scheduler.structured.manager import GrammarOutput, StructuredOutputManager
from raylm.scheduler.structured.params import StructuredOutputsParams


class FakeGrammar:
    def __init__(self, reject_at: int | None) -> None:
        self.accepted: list[int] = []
        self.reject_at = reject_at
        self.max_tokens: int | None = None

    def accept_tokens(self, tokens: list[int]) -> bool:
        for t in tokens:
            if self.reject_at is not None and len(self.accepted) == self.reject_at:
                return False
            self.accepted.append(t)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return list(tokens)

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def is_terminated(self) -> bool:
        return False

    def limit_tokens(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


class FakeBackend:
    """``regex`` is the spec; "reject:N" rejects the N-th token; compiles wait on ``gate``."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.grammars: list[FakeGrammar] = []

    def compile(self, params: StructuredOutputsParams) -> int | None:
        assert self.gate.wait(timeout=30), "test never opened the compile gate"
        spec = params.regex or ""
        return int(spec.split(":")[1]) if spec.startswith("reject:") else None

    def new_grammar(self, compiled: int | None) -> FakeGrammar:
        self.grammars.append(FakeGrammar(compiled))
        return self.grammars[-1]

    def build_bitmask(self, grammars: list) -> list[int]:
        return [-1 if g is None else len(g.accepted) for g in grammars]  # seen per row


class GrammarExecutor(FakeExecutor):
    """Holds a constrained step's output until its sample_tokens; checks, at that moment,
    that every grammar has seen all its request's earlier tokens."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.engine: EngineCore | None = None
        self._held: Future | None = None
        self.num_samplings = 0
        self.num_deferred = 0

    def execute_model(self, scheduler_output, non_block: bool = False):
        fut = super().execute_model(scheduler_output, non_block=True)
        if not scheduler_output.structured_output_request_ids:
            return fut if non_block else fut.result()
        assert self._held is None, "a step before this one was never sampled"
        self.num_deferred += scheduler_output.pending_structured_output_tokens
        self._held = fut
        done: Future = Future()
        done.set_result(None)
        return done

    def sample_tokens(self, grammar_output: GrammarOutput, non_block: bool = False):
        assert self._held is not None, "sample_tokens without a deferred step"
        self.num_samplings += 1
        scheduler = self.engine.scheduler
        for rid, seen in zip(grammar_output.structured_output_request_ids,
                             grammar_output.grammar_bitmask, strict=True):
            request = scheduler.requests.get(rid)
            if request is None or request.is_finished():
                continue
            assert seen == request.num_output_tokens, (
                f"{rid}: bitmask built after {seen} tokens, request has {request.num_output_tokens}")
        fut, self._held = self._held, None
        return fut if non_block else fut.result()


def _engine(async_scheduling: bool, gate: threading.Event):
    config = make_config(async_scheduling=async_scheduling, max_num_seqs=8)
    executor = GrammarExecutor()
    backend = FakeBackend(gate)
    manager = StructuredOutputManager(lambda: backend, max_workers=1)
    engine = EngineCore(config, executor, manager)
    executor.engine = engine
    return engine, executor, backend, manager


def _constrained(rid: str, spec: str = "any", **kw):
    return make_request(rid, 5, max_tokens=10, structured_outputs=StructuredOutputsParams(
        regex=spec), **kw)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_compile_off_loop_then_constrained_tokens(async_scheduling):
    gate = threading.Event()
    engine, executor, backend, manager = _engine(async_scheduling, gate)
    free = [make_request(f"f{i}", 4 + i, max_tokens=6) for i in range(3)]
    held = [_constrained("c0"), _constrained("c1"), _constrained("c2", "reject:4")]
    for r in free + held:
        engine.add_request(r)
    assert all(r.status == RequestStatus.WAITING_FOR_FSM for r in held)
    outputs = []
    for _ in range(200):  # the free requests finish while every grammar still compiles
        step_outputs, _ = engine.step_fn()
        outputs += step_outputs.outputs if step_outputs else []
        if all(r.is_finished() for r in free):
            break
    assert all(r.is_finished() for r in free)
    assert all(r.status == RequestStatus.WAITING_FOR_FSM for r in held)
    gate.set()
    outputs += run_until_idle(engine)
    tokens, finals = collect(outputs)
    for r in free + held[:2]:
        assert tokens[r.request_id] == expected_stream(r), r.request_id
    # Identical specs compiled once; each request got its own matcher over it.
    assert manager.num_compiles == 2 and len(backend.grammars) == 3
    for r, g in zip(held[:2], backend.grammars[:2], strict=True):
        assert g.accepted == expected_stream(r)  # settled tokens only, in order
        assert g.max_tokens == 10  # told the request's budget (JSON mode closes within it)
    # The rejected token ends that request only, with finish_reason error.
    assert [o.finish_reason for o in finals["c2"]] == [FinishReason.ERROR]
    assert tokens["c2"] == expected_stream(held[2])[:5]
    assert executor.num_samplings > 0
    assert executor.num_deferred > 0 if async_scheduling else executor.num_deferred == 0
    engine.scheduler.check_integrity(no_steps_in_flight=True)
    engine.shutdown()


def test_the_grammar_budget_is_the_requests_max_tokens_unless_min_tokens():
    assert _constrained("a").structured_output_request.max_tokens == 10
    # Prompt room caps max_tokens: the budget is what the request may really use.
    assert make_request("b", 5, max_tokens=400, max_model_len=64, structured_outputs=(
        StructuredOutputsParams(regex="x"))).structured_output_request.max_tokens == 59
    # min_tokens masks the stop token for a while: no closing that might need it early.
    assert _constrained("c", min_tokens=2).structured_output_request.max_tokens is None


def test_abort_while_compiling_and_no_manager():
    gate = threading.Event()
    engine, _, _, _ = _engine(True, gate)
    engine.add_request(_constrained("c0"))
    engine.abort_requests(["c0"])
    step_outputs, _ = engine.step_fn()
    assert [o.finish_reason for o in step_outputs.outputs] == [FinishReason.ABORT]
    gate.set()
    engine.scheduler.check_integrity(no_steps_in_flight=True)
    engine.shutdown()
    bare = EngineCore(make_config(async_scheduling=True), FakeExecutor())
    with pytest.raises(ValueError, match="structured outputs"):
        bare.add_request(_constrained("c1"))


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice="yes")
    p = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert p.cache_key == StructuredOutputsParams(json='{"a":2,"b":1}').cache_key
