"""ModelRunner driven with hand-built SchedulerOutputs: greedy equals transformers'
generate token for token, sync and async; seeded sampling and penalties are identical
with async on or off; logprobs; preemption; requests finished while in flight."""

from __future__ import annotations

import pytest
import torch
from conftest import BLOCK_SIZE, NUM_BLOCKS, hf_greedy, hf_model, make_runner, random_prompts
from step_driver import StepDriver

from raylm.scheduler.core_outputs import CachedRequestData, NewRequestData, SchedulerOutput
from raylm.scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def _drive(path, async_mode, requests, max_num_seqs=8):
    """requests: list of (req_id, prompt, params, add-kwargs). Returns (outputs, runner, driver)."""
    runner = make_runner(path, async_mode, max_num_seqs)
    driver = StepDriver(runner, BLOCK_SIZE, NUM_BLOCKS, async_mode)
    for req_id, prompt, params, kwargs in requests:
        driver.add(req_id, prompt, params, **kwargs)
    return driver.run(), runner, driver


def test_greedy_matches_transformers_generate(any_model_path, async_mode):
    prompts = random_prompts([5, 17, 9, 30], 500)
    extras = [{}, {"skip_steps": {3, 4}}, {}, {"chunk_size": 7}]  # a gap and a chunked prefill
    requests = [(f"r{i}", p, GREEDY, extras[i]) for i, p in enumerate(prompts)]
    outputs, runner, _ = _drive(any_model_path, async_mode, requests)
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(any_model_path, prompt, 10), f"request r{i}"
    stats = runner.async_input_stats
    if async_mode:
        assert stats.slice_copy > 0 and stats.scatter > 0
    else:
        assert stats.slice_copy == stats.scatter == 0


def _decode_step(step_id, req_ids, num_computed, new_blocks=None):
    cached = CachedRequestData(list(req_ids), [list(b) for b in (new_blocks or [[]] * len(req_ids))],
                               list(num_computed), [[] for _ in req_ids])
    return SchedulerOutput(step_id, [], cached, {r: 1 for r in req_ids}, len(req_ids))


def test_async_takes_slice_copy_when_unchanged_and_scatter_when_changed(llama_path):
    prompts = random_prompts([6, 9, 5], 500, seed=3)
    blocks = {"a": list(range(0, 8)), "b": list(range(8, 16)), "c": list(range(16, 24))}
    params = SamplingParams(temperature=0.0, max_tokens=100)

    def new(req_id, prompt):
        return NewRequestData(req_id, prompt, [], params, blocks[req_id], 0, 0)

    runner = make_runner(llama_path, async_mode=True)
    stats = runner.async_input_stats
    outs = []
    so = SchedulerOutput(0, [new("a", prompts[0]), new("b", prompts[1])],
                         CachedRequestData(), {"a": 6, "b": 9}, 15)
    outs.append(runner.execute_model(so))
    assert (stats.slice_copy, stats.scatter) == (0, 0)
    outs.append(runner.execute_model(_decode_step(1, ["a", "b"], [6, 9])))
    outs.append(runner.execute_model(_decode_step(2, ["a", "b"], [7, 10])))
    assert (stats.slice_copy, stats.scatter) == (2, 0)  # unchanged batch, same order
    # A new request joins behind them: a and b are still rows 0..1 -> still a slice.
    so = _decode_step(3, ["a", "b"], [8, 11])
    so.scheduled_new_reqs.append(new("c", prompts[2]))
    so.num_scheduled_tokens["c"] = 5
    so.total_num_scheduled_tokens += 5
    outs.append(runner.execute_model(so))
    assert (stats.slice_copy, stats.scatter) == (3, 0)
    outs.append(runner.execute_model(_decode_step(4, ["a", "b", "c"], [9, 12, 5])))
    assert (stats.slice_copy, stats.scatter) == (4, 0)
    # "a" finishes: "c" moves into row 0, so the batch is reordered -> scatter.
    so = _decode_step(5, ["b", "c"], [13, 6])
    so.finished_req_ids = {"a"}
    outs.append(runner.execute_model(so))
    assert (stats.slice_copy, stats.scatter) == (4, 1)
    outs.append(runner.execute_model(_decode_step(6, ["c", "b"], [7, 14])))
    assert (stats.slice_copy, stats.scatter) == (5, 1)
    tokens = {"a": [], "b": [], "c": []}
    for out in outs:
        out = out.get_output()
        for req_id, i in out.req_id_to_index.items():
            tokens[req_id] += out.sampled_token_ids[i]
            assert -1 not in out.sampled_token_ids[i]
    assert tokens["a"] == hf_greedy(llama_path, prompts[0], 5)
    assert tokens["b"] == hf_greedy(llama_path, prompts[1], 7)
    assert tokens["c"] == hf_greedy(llama_path, prompts[2], 4)


def test_penalties_are_identical_async_and_sync(qwen2_path):
    prompts = random_prompts([7, 12, 4], 500, seed=4)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=12),
        SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7,
                       max_tokens=12),
        SamplingParams(temperature=1.0, seed=9, repetition_penalty=1.2,
                       frequency_penalty=0.5, max_tokens=12),
    ]
    requests = [(f"r{i}", p, params[i], {"skip_steps": {5}} if i == 1 else {})
                for i, p in enumerate(prompts)]
    sync, _, _ = _drive(qwen2_path, False, requests)
    async_, _, _ = _drive(qwen2_path, True, requests)
    assert async_ == sync
    # The repetition penalty is HF's: the greedy request equals generate(repetition_penalty).
    assert sync["r0"] == hf_greedy(qwen2_path, prompts[0], 12, repetition_penalty=1.8)
    assert sync["r0"] != hf_greedy(qwen2_path, prompts[0], 12)  # the penalty did something
    # Presence/frequency penalties: no repeats beyond what the penalty allows.
    unpenalised, _, _ = _drive(qwen2_path, False, [("x", prompts[1], GREEDY.clone(max_tokens=12), {})])
    assert sync["r1"] != unpenalised["x"]


def test_seeded_sampling_is_identical_async_sync_and_alone(llama_mha_tied_path):
    prompts = random_prompts([6, 11, 8], 500, seed=5)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, top_p=0.9, top_k=40)
              for i in range(3)]
    requests = [(f"r{i}", p, params[i], {}) for i, p in enumerate(prompts)]
    sync, _, _ = _drive(llama_mha_tied_path, False, requests)
    async_, _, _ = _drive(llama_mha_tied_path, True, requests)
    alone, _, _ = _drive(llama_mha_tied_path, True, [requests[1]])
    assert async_ == sync
    assert alone["r1"] == sync["r1"]
    assert len({tuple(v) for v in sync.values()}) == 3


def test_logprobs_match_transformers(llama_path, async_mode):
    prompt = random_prompts([9], 500, seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    _, _, driver = _drive(llama_path, async_mode, [("r", prompt, params, {})])
    req = driver.requests["r"]
    assert len(req.logprobs) == 5
    ids = prompt + req.outputs
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(llama_path)(torch.tensor([ids])).logits[0], -1)
    for k, lists in enumerate(req.logprobs):
        row = ref[len(prompt) - 1 + k]
        token_ids, logprobs = lists.token_ids[0], lists.logprobs[0]
        assert token_ids[0] == req.outputs[k] and len(token_ids) == 4
        assert token_ids[1:] == row.topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor(logprobs), row[token_ids], atol=1e-4, rtol=0)
        assert lists.sampled_token_ranks == [1]  # greedy picks the top token


def test_min_tokens_bans_stop_tokens_until_reached(llama_path, async_mode):
    prompt = random_prompts([8], 500, seed=7)[0]
    free = hf_greedy(llama_path, prompt, 4)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3,
                            stop_token_ids=[free[1]])
    outputs, _, _ = _drive(llama_path, async_mode, [("r", prompt, params, {})])
    assert outputs["r"][0] == free[0] and outputs["r"][1] != free[1]


def test_preempted_request_resumes_from_confirmed_outputs(llama_path):
    prompt = random_prompts([10], 500, seed=8)[0]
    expected = hf_greedy(llama_path, prompt, 8)
    runner = make_runner(llama_path, async_mode=True)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    blocks = list(range(40, 44))
    step0 = runner.execute_model(SchedulerOutput(
        0, [NewRequestData("r", prompt, [], params, blocks, 0, 0)], CachedRequestData(),
        {"r": 10}, 10))
    step1 = runner.execute_model(_decode_step(1, ["r"], [10]))
    first = step0.get_output().sampled_token_ids[0]
    # Preempted while step 1 is in flight; its result is stale for the scheduler.
    step2 = runner.execute_model(SchedulerOutput(2, [], CachedRequestData(), {}, 0,
                                                 preempted_req_ids={"r"}))
    assert step2.req_ids == [] and "r" not in runner.requests
    assert step1.get_output().sampled_token_ids[0] == [expected[1]]
    # Resumed on fresh blocks with the one confirmed output; recompute all 11 tokens.
    so = SchedulerOutput(3, [NewRequestData("r", prompt, first, params, list(range(7, 10)), 0, 0)],
                         CachedRequestData(), {"r": 11}, 11)
    outs = [runner.execute_model(so)]
    for k in range(5):
        outs.append(runner.execute_model(_decode_step(4 + k, ["r"], [11 + k],
                                                      [[20]] if k == 0 else None)))
    tokens = first + [t for o in outs for t in o.get_output().sampled_token_ids[0]]
    assert tokens == expected[:7]
    assert runner.async_input_stats.scatter == 0  # the resumed request never read step 1's ids


def test_request_finished_while_its_step_is_in_flight(llama_path):
    prompts = random_prompts([6, 8], 500, seed=9)
    runner = make_runner(llama_path, async_mode=True)
    driver = StepDriver(runner, BLOCK_SIZE, NUM_BLOCKS, True)
    driver.add("a", prompts[0], SamplingParams(temperature=0.0, max_tokens=50))
    driver.add("b", prompts[1], SamplingParams(temperature=0.0, max_tokens=8))
    pending = []
    for _ in range(3):
        so = driver.schedule()
        pending.append((so, runner.execute_model(so)))
    driver.update(pending[0][0], pending[0][1].get_output())
    driver.abort("a")  # step 1 and 2 still in flight with "a" in them
    for so, out in pending[1:]:
        out = out.get_output()
        assert "a" in out.req_id_to_index
        driver.update(so, out)
    result = driver.run()
    assert "a" not in runner.requests
    assert result["b"] == hf_greedy(llama_path, prompts[1], 8)


def test_empty_step_and_bad_diffs(llama_path):
    runner = make_runner(llama_path, async_mode=False)
    empty = runner.execute_model(SchedulerOutput(0, [], CachedRequestData(), {}, 0))
    assert empty.req_ids == [] and empty.sampled_token_ids == []
    with pytest.raises(ValueError, match="'ghost'"):
        runner.execute_model(_decode_step(1, ["ghost"], [3]))
    prompt = random_prompts([5], 500)[0]
    so = SchedulerOutput(2, [NewRequestData("r", prompt, [], GREEDY, [0, 1], 0, 0)],
                         CachedRequestData(), {"r": 6}, 6)
    with pytest.raises(ValueError, match="only 5 tokens are known"):
        runner.execute_model(so)


def test_non_final_chunks_return_no_token(llama_path, async_mode):
    prompt = random_prompts([12], 500, seed=10)[0]
    runner = make_runner(llama_path, async_mode)
    new = NewRequestData("r", prompt, [], GREEDY, [3, 4, 5, 6], 0, 0)
    out = runner.execute_model(SchedulerOutput(0, [new], CachedRequestData(), {"r": 5}, 5))
    out = out.get_output() if async_mode else out
    assert out.sampled_token_ids == [[]]
    cached = CachedRequestData(["r"], [[]], [5], [[]])
    out = runner.execute_model(SchedulerOutput(1, [], cached, {"r": 7}, 7))
    out = out.get_output() if async_mode else out
    assert out.sampled_token_ids == [hf_greedy(llama_path, prompt, 1)]


class _Pipeline:
    """Two PP stages in one process: stage 0 hands its IntermediateTensors to stage 1.
    Under async scheduling the last stage's sampled ids are handed back to stage 0 the way
    the PP layer's broadcast will (here with no stagger: the stages run back to back)."""

    def __init__(self, path: str, async_mode: bool) -> None:
        from conftest import engine_config

        from raylm.parallel.context import ParallelContext
        from raylm.runner.model_runner import ModelRunner

        self.stages = []
        for rank in range(2):
            ctx = ParallelContext(tp_rank=0, tp_size=1, pp_rank=rank, pp_size=2, dp_rank=0,
                                  device=torch.device("cpu"))
            runner = ModelRunner(engine_config(path, async_mode), ctx)
            runner.load_model()
            runner.initialize_kv_cache(NUM_BLOCKS)
            self.stages.append(runner)

    def execute_model(self, so):
        first, last = self.stages
        intermediate = first.execute_model(so)
        if so.total_num_scheduled_tokens == 0:
            return last.execute_model(so)
        out = last.execute_model(so, intermediate)
        first.input_batch.prev_sampled_token_ids = last.input_batch.prev_sampled_token_ids
        return out


def test_two_pipeline_stages_generate_like_transformers(llama_path, async_mode):
    pipeline = _Pipeline(llama_path, async_mode)
    driver = StepDriver(pipeline, BLOCK_SIZE, NUM_BLOCKS, async_mode,
                        send_token_ids=not async_mode)
    prompts = random_prompts([6, 11], 500, seed=12)
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, GREEDY, chunk_size=4 if i else 1 << 30)
    outputs = driver.run()
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(llama_path, p, 10)
    # Stage 0 never samples: in sync mode it learns the ids from the scheduler; in async
    # mode it books placeholders (its inputs come from the last stage's device tensor).
    first, last = pipeline.stages
    alive = [r for r in outputs if r in first.requests]  # finished ones were dropped
    assert alive
    for req_id in alive:
        tokens = outputs[req_id]
        history = first.requests[req_id].output_token_ids
        sampled = last.requests[req_id].output_token_ids
        if async_mode:
            # The sampling stage's history settles its -1 placeholders on demand (when a
            # penalty needs them, or once the async copy has landed): every settled entry
            # must be the real token, whether or not the last copy has landed yet.
            assert len(sampled) == len(tokens)
            assert all(s in (-1, t) for s, t in zip(sampled, tokens)), (sampled, tokens)
            assert sampled[:-1] == tokens[:-1]
        else:
            assert sampled == tokens
        # The last output is never an input, so sync stage 0 learns all but that one.
        assert history == ([-1] * 10 if async_mode else tokens[:9])


def test_scheduler_sent_token_ids_do_not_duplicate_sampled_ones(llama_path):
    """Sync PP sends the ids among each step's inputs to every rank; the sampling rank
    already has them and must not append them twice."""
    prompts = random_prompts([7, 5], 500, seed=13)
    runner = make_runner(llama_path, async_mode=False)
    driver = StepDriver(runner, BLOCK_SIZE, NUM_BLOCKS, False, send_token_ids=True)
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, GREEDY)
    outputs = driver.run()
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(llama_path, p, 10)
        assert runner.requests[f"r{i}"].output_token_ids == outputs[f"r{i}"]


def test_a_scheduled_stranger_is_named_even_when_counts_match(llama_path):
    runner = make_runner(llama_path, async_mode=False)
    prompt = random_prompts([5], 500)[0]
    runner.execute_model(SchedulerOutput(
        0, [NewRequestData("known", prompt, [], GREEDY, [0, 1], 0, 0)], CachedRequestData(),
        {"known": 5}, 5))
    with pytest.raises(ValueError, match="'stranger' is scheduled but unknown"):
        runner.execute_model(SchedulerOutput(1, [], CachedRequestData(), {"stranger": 1}, 1))
