"""Property test: random arrivals, aborts, tiny KV pools and EOS positions through the
EngineCore loops (async mostly), with the ledger invariants checked after every step."""

from __future__ import annotations

import random
import tempfile

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_fake_executor import (
    EOS,
    FakeExecutor,
    expected_stream,
    make_config,
    make_request,
    prompt_tokens,
    write_draft_model_config,
)

from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core_outputs import FinishReason

BLOCK = 4

request_st = st.tuples(
    st.integers(0, 12),  # arrival step
    st.integers(1, 24),  # prompt length
    st.integers(1, 18),  # max_tokens
    st.one_of(st.none(), st.integers(0, 17)),  # EOS at this output index
    st.booleans(),  # starts with the shared prefix (prefix-cache hits)
    st.one_of(st.none(), st.none(), st.integers(0, 15)),  # abort this long after arrival
)


@st.composite
def scenarios(draw):
    return {
        "async": draw(st.sampled_from([True, True, False])),
        "pp": draw(st.sampled_from([1, 1, 2])),
        "num_blocks": draw(st.integers(8, 30)),
        "budget": draw(st.integers(4, 32)),
        "max_num_seqs": draw(st.integers(1, 8)),
        "caching": draw(st.sampled_from([True, True, False])),
        "requests": draw(st.lists(request_st, min_size=3, max_size=14)),
        "seed": draw(st.integers(0, 2**16)),
        # Speculative decoding: k drafts per decode; the fake worker proposes and accepts
        # random counts of them (or all).
        "k": draw(st.sampled_from([0, 0, 1, 3])),
        "accept_all": draw(st.booleans()),
        # method draft_model: without PP every step books k KV slots ahead.
        "draft_model": draw(st.booleans()),
    }


def _record_fences(engine: EngineCore, executor: FakeExecutor) -> dict[int, set[int]]:
    """Block ids each submitted step may write, captured at submission (= schedule) time."""
    fenced: dict[int, set[int]] = {}
    submit = executor.execute_model
    kv = engine.scheduler.kv_cache_manager

    def execute_model(so, non_block=False):
        fenced[so.step_id] = {b for rid in so.num_scheduled_tokens for b in kv.get_block_ids(rid)}
        return submit(so, non_block)

    executor.execute_model = execute_model
    return fenced


def _check_step(engine: EngineCore, fenced: dict[int, set[int]]) -> None:
    sched = engine.scheduler
    sched.check_integrity()
    pool = sched.kv_cache_manager.block_pool
    in_flight_steps = [step.scheduler_output for step in engine.batch_queue]
    for so in in_flight_steps:  # §3 rule 5: nothing an in-flight step writes is free
        early = [b for b in fenced[so.step_id] if pool.is_free(b)]
        assert not early, f"blocks {early} free while step {so.step_id} is in flight"
    in_flight: dict[str, int] = {}
    for so in in_flight_steps:
        for rid, n in so.num_scheduled_tokens.items():
            in_flight[rid] = in_flight.get(rid, 0) + n
    idle = not engine.batch_queue
    for rid, r in sched.requests.items():
        assert r.num_output_placeholders >= 0, r
        assert r.num_in_flight_tokens == in_flight.get(rid, 0), (r, in_flight.get(rid))
        if idle:
            assert r.num_output_placeholders == 0 and r.num_stale_output_tokens == 0, r


def drive(engine: EngineCore, executor: FakeExecutor, fenced: dict[int, set[int]],
          arrivals: dict[int, list], aborts: dict[int, list[str]], rng: random.Random
          ) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Step until drained: requests arrive and aborts come at their steps, the device
    sometimes finishes a step early; the invariants are checked after every step.
    Returns each request's delivered tokens and final outputs."""
    reqs = [r.request_id for rs in arrivals.values() for r in rs]
    delivered: dict[str, list[int]] = {rid: [] for rid in reqs}
    finals: dict[str, list] = {rid: [] for rid in reqs}
    last_arrival = max(arrivals, default=0)
    step = 0
    while step <= last_arrival or engine.has_work():
        for r in arrivals.get(step, ()):
            engine.add_request(r)
        if aborts.get(step):
            engine.abort_requests(aborts[step])
        if rng.random() < 0.3:
            executor.resolve_next()  # the device finishes early; the engine sees it later
        out, _ = engine.step_fn()
        for o in out.outputs if out is not None else ():
            assert not finals[o.request_id], f"{o.request_id}: output after its final one"
            delivered[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id].append(o)
        _check_step(engine, fenced)
        step += 1
        assert step < 5000, "engine did not drain"
    return delivered, finals


_DRAFT_MODEL_DIR = write_draft_model_config(tempfile.mkdtemp(prefix="raylm-fake-draft-"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_engine_loop_invariants(sc):
    config = make_config(async_scheduling=sc["async"], block_size=BLOCK,
                         num_kv_blocks=sc["num_blocks"], max_num_batched_tokens=sc["budget"],
                         max_num_seqs=sc["max_num_seqs"], enable_prefix_caching=sc["caching"],
                         pipeline_parallel_size=sc["pp"], num_spec_tokens=sc["k"],
                         draft_model_dir=_DRAFT_MODEL_DIR if sc["draft_model"] else None)
    lookahead = config.num_lookahead_tokens
    if lookahead:
        event("draft slots booked ahead")
    eos_at: dict[str, int] = {}
    spec_rng = None if sc["accept_all"] else random.Random(sc["seed"] + 1)
    executor = FakeExecutor(num_blocks=sc["num_blocks"], block_size=BLOCK, eos_at=eos_at,
                            spec_rng=spec_rng)
    engine = EngineCore(config, executor)
    fenced = _record_fences(engine, executor)
    rng = random.Random(sc["seed"])
    shared = prompt_tokens("shared", 9)
    arrivals, aborts = {}, {}
    for i, (arrive, plen, max_tokens, eos, use_shared, abort_after) in enumerate(sc["requests"]):
        rid = f"r{i}"
        prompt = (shared if use_shared else []) + prompt_tokens(rid, plen)
        # Fit the pool (else add_request rightly refuses it).
        room = sc["num_blocks"] * BLOCK - lookahead  # the draft slots must fit too
        max_tokens = max(1, min(max_tokens, room - len(prompt)))
        if max_tokens + len(prompt) > 256 or len(prompt) >= room:
            continue
        req = make_request(rid, prompt, max_tokens=max_tokens, ignore_eos=eos is None)
        if eos is not None:
            eos_at[rid] = eos
        arrivals.setdefault(arrive, []).append(req)
        if abort_after is not None:
            aborts.setdefault(arrive + abort_after, []).append(rid)
    reqs = {r.request_id: r for rs in arrivals.values() for r in rs}

    delivered, finals = drive(engine, executor, fenced, arrivals, aborts, rng)
    for rid, r in reqs.items():
        assert len(finals[rid]) == 1, (rid, finals[rid])
        final = finals[rid][0]
        eos = eos_at.get(rid)
        want = expected_stream(r, eos)
        if eos is not None and eos < r.max_tokens - 1:
            want = want[:eos + 1]
        got = delivered[rid]
        assert got == want[:len(got)], (rid, got, want)  # once each, in position order
        if final.finish_reason == FinishReason.ABORT:
            continue
        assert got == want, (rid, got, want)
        stopped_by_eos = eos is not None and eos < r.max_tokens - 1
        assert final.finish_reason == (FinishReason.STOP if stopped_by_eos else FinishReason.LENGTH)
        assert got[-1] == EOS or not stopped_by_eos
    metrics = engine.get_metrics()
    event(f"preempted: {metrics['raylm:num_preemptions'] > 0}")
    event(f"prefix hits: {metrics['raylm:prefix_cache_hits'] > 0}")
    event(f"drafts accepted: {sum(executor.runner.num_accepted.values()) > 0}")
    event(f"aborted: {any(f[0].finish_reason == FinishReason.ABORT for f in finals.values())}")
    engine.scheduler.check_integrity(no_steps_in_flight=True)
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
