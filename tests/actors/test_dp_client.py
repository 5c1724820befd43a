"""Data parallelism on Ray: DP=2 rank actors running the tiny Llama, against transformers
and the single-process engine (sync and async, forced preemption, chunked prefill); DP=2
x TP=2; very uneven load with least-loaded routing, wave end and a new wave; shared
prefixes routed to the rank that holds them, a hot one spilling over; a bad request; a
killed rank; the offline LLM with data_parallel_size=2."""

from __future__ import annotations

import time

import pytest
import ray
from dp_drive import DEADLINE_S, Collector
from dp_drive import prompts as _prompts
from dp_drive import request as _request
from dp_drive import wait_paused as _wait_paused
from engine_drive import run_until_idle

from raylm.actors.ray_engine_core_client import RayEngineCoreClient
from raylm.cluster.engine.engine_args import EngineArgs
from raylm.runner.uniproc_executor import UniProcExecutor
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import FinishReason

pytestmark = pytest.mark.ray



@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    yield ray_local


def _config(model: str, dp: int = 2, async_scheduling: bool | None = None,
            num_kv_blocks: int | None = 128, max_num_batched_tokens: int = 2048,
            tp: int = 1) -> EngineConfig:
    return EngineArgs(
        model=model, block_size=8, num_kv_blocks=num_kv_blocks, max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
        data_parallel_size=dp, tensor_parallel_size=tp,
        distributed_executor_backend="ray" if dp * tp > 1 else "uni").create_engine_config()


@pytest.fixture(scope="module")
def reference(llama_path, hf_oracle):
    """Greedy tokens of 8 prompts from transformers and from the single-process engine."""
    prompts = _prompts(8)
    max_tokens = [12 + (i * 5) % 9 for i in range(8)]
    hf = [hf_oracle(llama_path).greedy(p, m) for p, m in zip(prompts, max_tokens)]
    config = _config(llama_path, dp=1)
    core = EngineCore(config, UniProcExecutor(config))
    try:
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            core.add_request(_request(config, f"r{i}", p, m))
        single: dict[str, list[int]] = {}
        for out in run_until_idle(core):
            single.setdefault(out.request_id, []).extend(out.new_token_ids)
    finally:
        core.shutdown()
    return prompts, max_tokens, hf, single


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_dp2_greedy_matches_hf_and_single_process_under_preemption_and_chunking(
        llama_path, reference, async_scheduling):
    prompts, max_tokens, hf, single = reference
    # 10 blocks of 8 tokens per rank for 4 requests of up to 50 tokens: preemption;
    # a 16-token budget for prompts of 10-30 tokens: chunked prefill.
    config = _config(llama_path, async_scheduling=async_scheduling, num_kv_blocks=10,
                     max_num_batched_tokens=16)
    client = RayEngineCoreClient(config)
    try:
        assert [i["async_scheduling"] for i in client.rank_infos] == [async_scheduling] * 2
        col = Collector(client)
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            client.add_request(_request(config, f"r{i}", p, m))
        col.until_finished([f"r{i}" for i in range(8)])
        for i in range(8):
            assert col.tokens[f"r{i}"] == hf[i] == single[f"r{i}"], f"r{i}"
            assert col.finish[f"r{i}"] == FinishReason.LENGTH
        state = _wait_paused(client)
        metrics = client.get_metrics()
        # A burst without shared prefixes: the rank with more free KV first, never 3 ahead
        # (the routing threshold is 2); each rank served the requests routed to it.
        assert sum(state["routed"]) == 8 and min(state["routed"]) >= 3, state
        assert state["unfinished"] == [0, 0]
        assert [m["raylm:request_success"] for m in metrics["dp_ranks"]] == state["routed"]
        assert metrics["raylm:request_success"] == 8
        assert metrics["raylm:num_preemptions"] > 0, metrics
        assert metrics["raylm:generation_tokens"] == sum(max_tokens)
        assert metrics["raylm:dp_num_waves"] >= 1
        logs = [(r["num_waves_completed"], r["num_steps"], r["num_collectives"])
                for r in state["ranks"]]
        assert logs[0] == logs[1], logs  # lockstep: same steps and collectives on both
    finally:
        client.shutdown()


def test_dp2_tp2_ranks_run_their_own_worker_groups(llama_path, reference):
    prompts, max_tokens, hf, _ = reference
    config = _config(llama_path, tp=2, num_kv_blocks=64)
    # Per rank: the EngineCore actor and two TP workers in the rank's own placement group.
    client = RayEngineCoreClient(config, cpus_per_rank=0.5, cpus_per_worker=0.5)
    try:
        assert [i["executor"] for i in client.rank_infos] == ["RayExecutor"] * 2
        col = Collector(client)
        ids = [f"r{i}" for i in range(4)]
        # Requests that outlive their routing, so least-loaded routing alternates whatever
        # the load; each is compared with transformers over its reference length, then aborted.
        for rid, p in zip(ids, prompts):
            client.add_request(_request(config, rid, p, 400))  # 400 steps; fits 64 blocks of 8
        routed = client.get_dp_state()["routed"]
        assert sum(routed) == 4 and min(routed) >= 1, routed
        deadline = time.monotonic() + DEADLINE_S
        while not all(len(col.tokens.get(rid, ())) >= m for rid, m in zip(ids, max_tokens)):
            assert time.monotonic() < deadline, {r: len(col.tokens.get(r, ())) for r in ids}
            col.read(timeout=1.0)
        client.abort_requests(ids)
        col.until_finished(ids)
        assert [col.tokens[rid][:m] for rid, m in zip(ids, max_tokens)] == hf[:4]
        assert _wait_paused(client)["unfinished"] == [0, 0]
    finally:
        client.shutdown()


def test_uneven_load_routes_least_loaded_ends_wave_and_serves_a_new_wave(llama_path, hf_oracle):
    config = _config(llama_path)
    hf = hf_oracle(llama_path)
    client = RayEngineCoreClient(config)
    try:
        col = Collector(client)
        long_prompt = _prompts(1, seed=7)[0]
        long_max = config.model_config.max_model_len - len(long_prompt)
        client.add_request(_request(config, "long", long_prompt, long_max))  # rank 0, stays busy
        shorts = _prompts(10, seed=8, lo=3, hi=12)
        # One at a time: rank 0 always has the long request, rank 1 nothing, so every
        # short one goes to rank 1 while rank 0 works (and rank 1 idles in between).
        for i, p in enumerate(shorts):
            client.add_request(_request(config, f"s{i}", p, 3))
            col.until_finished([f"s{i}"])
        assert client.get_dp_state()["routed"] == [1, 10]
        client.abort_requests(["long"])
        col.until_finished(["long"])
        assert col.finish["long"] == FinishReason.ABORT
        n = len(col.tokens["long"])
        assert 0 < n < long_max and col.tokens["long"] == hf.greedy(long_prompt, n)
        for i, p in enumerate(shorts):
            assert col.tokens[f"s{i}"] == hf.greedy(p, 3), f"s{i}"
        state = first_pause = _wait_paused(client)
        waves = state["ranks"][0]["num_waves_completed"]
        assert waves >= 1 and state["unfinished"] == [0, 0]
        metrics = client.get_metrics()
        assert [m["raylm:request_success"] for m in metrics["dp_ranks"]] == [1, 10]

        # Every rank is paused: a new burst starts the next wave on both. Requests too long
        # to finish while the burst is routed, so no rank gets more than 3 of the 4 (the
        # routing threshold is 2: the one with more free KV first, then the other).
        burst = _prompts(4, seed=9)
        burst_ids = [f"n{i}" for i in range(4)]
        for rid, p in zip(burst_ids, burst):
            client.add_request(_request(config, rid, p, config.model_config.max_model_len - len(p)))
        routed = client.get_dp_state()["routed"]
        assert sum(routed) == 15 and routed[0] >= 2 and routed[1] >= 11, routed
        deadline = time.monotonic() + DEADLINE_S
        while not all(len(col.tokens.get(rid, ())) >= 6 for rid in burst_ids):
            assert time.monotonic() < deadline, {r: len(col.tokens.get(r, ())) for r in burst_ids}
            col.read(timeout=1.0)
        client.abort_requests(burst_ids)
        col.until_finished(burst_ids)
        for rid, p in zip(burst_ids, burst):
            assert col.finish[rid] == FinishReason.ABORT, rid
            assert col.tokens[rid] == hf.greedy(p, len(col.tokens[rid])), rid
        state = _wait_paused(client)
        assert all(r["num_waves_completed"] > waves for r in state["ranks"]), state
        assert state["coordinator"]["num_waves_completed"] == state["ranks"][0]["num_waves_completed"]
        # Every step and collective since the first pause belongs to a completed wave: a wave
        # of c collectives is (c - 1) * interval + 1 steps. Nothing ran while paused.
        interval = config.parallel_config.dp_sync_interval
        for before, after in zip(first_pause["ranks"], state["ranks"]):
            k = after["num_waves_completed"] - before["num_waves_completed"]
            c = after["num_collectives"] - before["num_collectives"]
            assert after["num_steps"] - before["num_steps"] == (c - k) * interval + k, (before, after)
    finally:
        client.shutdown()


def test_shared_prefixes_stay_on_their_rank_and_a_hot_one_spills(llama_path):
    config = _config(llama_path)  # blocks of 8 tokens
    client = RayEngineCoreClient(config)
    try:
        col = Collector(client)
        prefixes = {p: [3 + (p * 31 + j) % 500 for j in range(32)] for p in (1, 2)}
        for i in range(3):  # one at a time: the ranks' loads stay balanced
            for p, prefix in prefixes.items():
                client.add_request(_request(config, f"p{p}-{i}", prefix + [7 + i] * 3, 2))
                col.until_finished([f"p{p}-{i}"])
        hits = [m["raylm:prefix_cache_hits"] for m in client.get_metrics()["dp_ranks"]]
        # Each repeat found its whole 32-token prefix: it went to its prefix's rank.
        assert sum(hits) == 2 * 2 * 32, hits
        assert client.get_dp_state()["decisions"]["prefix_match"] == 4
        # Ten at once with prefix 1: its rank takes them until it runs 3 ahead (the
        # balancer's threshold is 2), then the other rank gets its share.
        before = client.get_dp_state()["routed"]
        hot = [f"h{i}" for i in range(10)]
        for i, rid in enumerate(hot):
            client.add_request(_request(config, rid, prefixes[1] + [40 + i] * 3, 24))
        state = client.get_dp_state()
        share = [after - b for after, b in zip(state["routed"], before)]
        assert min(share) >= 1 and state["decisions"]["least_loaded"] >= 1, state
        col.until_finished(hot)
    finally:
        client.shutdown()


def test_bad_request_is_value_error_and_a_killed_rank_is_engine_dead(llama_path):
    config = _config(llama_path, num_kv_blocks=64)
    client = RayEngineCoreClient(config, dp_sync_timeout_s=20.0)
    try:
        # 100 + 900 tokens need 125 blocks of 8; a rank holds 64.
        with pytest.raises(ValueError, match="KV blocks"):
            client.add_request(_request(config, "huge", [5] * 100, 900))
        assert client.get_dp_state()["unfinished"] == [0, 0]
        col = Collector(client)
        for i, p in enumerate(_prompts(2, seed=3)):
            client.add_request(_request(config, f"k{i}", p, 400))
        col_deadline = time.monotonic() + DEADLINE_S
        while not all(col.tokens.get(f"k{i}") for i in range(2)):
            assert time.monotonic() < col_deadline
            out = client.get_output(timeout=1.0)
            for o in out.outputs if out is not None else []:
                col.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        # A killed rank surfaces as EngineDeadError (its poller, or the peer's DP
        # all-reduce), never as a hang.
        ray.kill(client.ranks[1])
        with pytest.raises(EngineDeadError):
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:
                client.get_output(timeout=1.0)
        with pytest.raises(EngineDeadError):
            client.check_health()
        with pytest.raises(EngineDeadError):
            client.add_request(_request(config, "late", [5, 6, 7], 2))
    finally:
        client.shutdown()


def test_llm_with_data_parallel_size_2(llama_path, hf_oracle):
    from raylm import SamplingParams as UserSamplingParams
    from raylm.cluster.engine.llm import LLM

    llm = LLM(llama_path, data_parallel_size=2, num_kv_blocks=128, block_size=8)
    try:
        assert isinstance(llm.llm_engine.core, RayEngineCoreClient)
        prompts = _prompts(4, seed=11)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            UserSamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        hf = hf_oracle(llama_path)
        for p, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == hf.greedy(p, 8)
        routed = llm.get_metrics()["dp_routed_requests"]
        assert sum(routed) == 4 and min(routed) >= 1, routed
    finally:
        llm.llm_engine.shutdown()
