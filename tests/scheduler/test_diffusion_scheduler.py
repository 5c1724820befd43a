"""The diffusion schedulers' ledger (scheduler/diffusion_scheduler.py, docs/architecture.md
§23), step by step with hand-made runner outputs: a step samples no token, a canvas of L
placeholders is booked per denoising step, committed canvases are encoded by the next step,
steps that follow the end of a canvas are discarded, and aborts and preemptions mid-canvas
leave no block behind."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.scheduler.config.speculative_config import SpeculativeConfig
from raylm.scheduler.core_outputs import ModelRunnerOutput, SchedulerOutput
from raylm.scheduler.diffusion_scheduler import DiffusionAsyncScheduler, DiffusionScheduler
from raylm.scheduler.request import InvalidRequestError, Request, RequestStatus
from raylm.scheduler.sampling_params import SamplingParams

L = 4
EOS = 2


def _config(async_scheduling: bool, max_steps: int = 3, **cache: object) -> EngineConfig:
    hf = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "canvas_length": L,
          "text_config": {"vocab_size": 100, "eos_token_id": EOS, "num_hidden_layers": 2,
                          "max_position_embeddings": 64}}
    folder = tempfile.mkdtemp(prefix="fake-diffusion")  # the denoising loop's settings
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"max_denoising_steps": max_steps, "t_min": None}, f)
    model = ModelConfig(model=folder, hf_config=hf)
    assert model.diffusion_config.max_denoising_steps == max_steps
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=4, **cache),  # type: ignore[arg-type]
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                         async_scheduling=async_scheduling),
        parallel_config=ParallelConfig())


def _scheduler(async_scheduling: bool, num_blocks: int = 32, max_steps: int = 3,
               **cache: object) -> DiffusionScheduler:
    cls = DiffusionAsyncScheduler if async_scheduling else DiffusionScheduler
    return cls(_config(async_scheduling, max_steps, **cache), num_blocks)


def _request(rid: str, prompt: list[int], max_tokens: int = 8, **params: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(rid, prompt, sp, frozenset({EOS}), 64, sampling_seed=0)


def _returned(so: SchedulerOutput, commits: dict[str, list[int]]) -> ModelRunnerOutput:
    """The runner's answer: the committed canvas of the requests in ``commits``."""
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[commits.get(r, []) for r in ids])


def test_config_sampled_tokens_per_step_is_zero_and_what_it_cannot_run_is_refused():
    config = _config(False)
    assert config.model_config.num_sampled_tokens_per_step == 0
    assert config.model_config.vocab_size == 100 and config.model_config.max_model_len == 64
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(model_config=config.model_config, cache_config=CacheConfig(),
                     scheduler_config=SchedulerConfig(), parallel_config=ParallelConfig(),
                     speculative_config=SpeculativeConfig("ngram", 2))
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineConfig(model_config=config.model_config, cache_config=CacheConfig(),
                     scheduler_config=SchedulerConfig(),
                     parallel_config=ParallelConfig(tensor_parallel_size=2))


def test_async_books_the_canvas_width_per_step_and_no_bonus_token():
    s = _scheduler(True)
    req = _request("a", [5, 6, 7, 8, 9])
    s.add_request(req)
    first = s.schedule()  # the prompt, then its first canvas at positions 5..8
    assert first.num_scheduled_tokens == {"a": 5 + L}
    assert first.scheduled_spec_decode_tokens == {"a": [-1] * L}
    assert first.new_canvases == {"a": 0}
    assert req.num_output_placeholders == L  # the canvas alone: no bonus token
    assert req.num_computed_tokens == 5  # canvas positions are never computed
    second = s.schedule()  # step 1 in flight: the same canvas's next step, same positions
    assert second.num_scheduled_tokens == {"a": L} and second.new_canvases == {}
    assert second.scheduled_cached_reqs.num_computed_tokens == [5]
    assert req.num_output_placeholders == 2 * L
    s.update_from_output(first, _returned(first, {}))  # not ended yet
    assert req.num_output_placeholders == L and req.output_token_ids == []
    canvas = [11, 12, 13, 14]
    s.update_from_output(second, _returned(second, {"a": canvas}))
    assert req.num_output_placeholders == 0 and req.output_token_ids == canvas
    third = s.schedule()  # encode the committed canvas, then the next canvas after it
    assert third.num_scheduled_tokens == {"a": 2 * L}
    assert third.scheduled_cached_reqs.num_computed_tokens == [5]
    assert third.new_canvases == {"a": 2}  # the previous canvas took two steps
    assert req.num_computed_tokens == 5 + L and req.num_output_placeholders == L
    s.update_from_output(third, _returned(third, {"a": [21, 22, 23, 24]}))
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.output_token_ids == canvas + [21, 22, 23, 24]
    s.check_integrity(no_steps_in_flight=True)


def test_async_holds_a_canvas_whose_last_step_is_in_flight_and_discards_steps_after_its_end():
    s = _scheduler(True, max_steps=2)
    s.add_request(_request("a", [5, 6, 7, 8], max_tokens=4))
    steps = [s.schedule() for _ in range(3)]
    # prompt and canvas, its second step: with both in flight the canvas is sure to end.
    assert [so.total_num_scheduled_tokens for so in steps] == [4 + L, L, 0]
    # Adaptive stopping ended the canvas at its first step: the second was a no-op.
    out = s.update_from_output(steps[0], _returned(steps[0], {"a": [9, 9, EOS, 9]}))
    assert out.outputs[0].new_token_ids == [9, 9, EOS] and out.outputs[0].finish_reason
    s.update_from_output(steps[1], _returned(steps[1], {}))
    s.check_integrity(no_steps_in_flight=True)

    s = _scheduler(True, max_steps=3)
    req = _request("b", [5, 6, 7, 8], max_tokens=8)
    s.add_request(req)
    steps = [s.schedule() for _ in range(2)]
    s.update_from_output(steps[0], _returned(steps[0], {"b": [1, 1, 1, 1]}))
    nxt = s.schedule()  # steps[1] (a no-op now) in flight: the next canvas starts
    assert nxt.new_canvases == {"b": 1} and nxt.num_scheduled_tokens == {"b": 2 * L}
    s.update_from_output(steps[1], _returned(steps[1], {}))
    assert s.step_settler.num_discarded_steps == 1
    assert req.num_output_placeholders == L and req.output_token_ids == [1] * L
    s.update_from_output(nxt, _returned(nxt, {"b": [3, 3, 3, 3]}))
    s.check_integrity(no_steps_in_flight=True)


def test_sync_books_no_placeholders_and_starts_each_canvas_after_its_commit():
    s = _scheduler(False)
    req = _request("a", [5, 6, 7], max_tokens=6)  # two canvases, the second cut at 6
    s.add_request(req)
    seen = []
    commits = iter([[], [11, 12, 13, 14], [], [], [15, 16, 17, 18]])  # a step each
    while s.has_unfinished_requests():
        so = s.schedule()
        seen.append((so.total_num_scheduled_tokens, dict(so.new_canvases)))
        assert req.num_output_placeholders == 0
        assert so.scheduled_spec_decode_tokens == {"a": [-1] * L}
        s.update_from_output(so, _returned(so, {"a": next(commits)}))
    # prompt + canvas 1 (2 steps); encode + canvas 2 (3 steps, the last at max)
    assert seen == [(3 + L, {"a": 0}), (L, {}), (2 * L, {"a": 2}), (L, {}), (L, {})]
    assert req.output_token_ids == [11, 12, 13, 14, 15, 16]  # max_tokens cuts the canvas
    s.check_integrity(no_steps_in_flight=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborts_and_preemption_mid_canvas_leave_no_block(async_scheduling):
    # 6 blocks of 4: two requests of 8 prompt tokens and a canvas need 3 each; the
    # second canvas of one preempts the other.
    s = _scheduler(async_scheduling, num_blocks=6, max_steps=2)
    a, b = _request("a", list(range(10, 18))), _request("b", list(range(30, 38)))
    for r in (a, b):
        s.add_request(r)
    # Each step in flight, with what the runner returns for it: every canvas ends at its
    # second (last) step, "a" committing 1s, "b" 3s.
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    steps: dict[str, int] = {}  # each request's steps of its current canvas

    preempted = aborted = False
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for r in so.scheduled_spec_decode_tokens:
            steps[r] = 1 if r in so.new_canvases else steps[r] + 1
        in_flight.append((so, _returned(so, {r: [1 if r == "a" else 3] * L
                                             for r in so.scheduled_spec_decode_tokens
                                             if steps[r] == 2})))
        if len(in_flight) == (2 if async_scheduling else 1) or so.is_empty:
            s.update_from_output(*in_flight.pop(0))
        preempted |= b.num_preemptions > 0 or a.num_preemptions > 0
        if preempted and not aborted and "b" in s.requests and b.status == RequestStatus.RUNNING:
            s.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # mid-canvas, in flight
            aborted = True
    for done in in_flight:
        s.update_from_output(*done)
    assert preempted and aborted and a.is_finished() and b.is_finished()
    assert a.output_token_ids == [1] * 8
    s.kv_cache_manager.on_step_processed(10 ** 6)
    s.check_integrity(no_steps_in_flight=True)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 6


def test_prefix_caching_indexes_encoded_blocks_only():
    s = _scheduler(False, num_blocks=16)
    req = _request("a", [5, 6, 7, 8], max_tokens=8)
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, _returned(so, {}))
    canvas = s.schedule()
    s.update_from_output(canvas, _returned(canvas, {"a": [11, 12, 13, 14]}))
    # The canvas's block holds decoder KV until the encoder rewrites it: not cached yet.
    assert s.kv_cache_manager.num_cached_block["a"] == 1
    encode = s.schedule()
    s.update_from_output(encode, _returned(encode, {}))
    assert s.kv_cache_manager.num_cached_block["a"] == 2
    # A new request whose prompt is that prompt and canvas hits both blocks but the last
    # token (recomputed).
    s.add_request(_request("b", [5, 6, 7, 8, 11, 12, 13, 14, 9]))
    hit = s.schedule()
    assert hit.scheduled_new_reqs[0].num_computed_tokens == 8


def test_requests_it_cannot_serve_are_refused_by_name():
    s = _scheduler(False)
    with pytest.raises(InvalidRequestError, match="temperature"):
        s.add_request(_request("t", [1, 2], temperature=0.5))
    with pytest.raises(InvalidRequestError, match="logprobs"):
        s.add_request(_request("l", [1, 2], logprobs=2))
    # 50 + 4 canvases of 4 = 66 > 64, though 50 + 14 fits.
    with pytest.raises(ValueError, match="4 canvases of 4"):
        s.add_request(_request("m", list(range(50)), max_tokens=14))
    assert not s.requests
