"""Experts spread over DP ranks (enable_expert_parallel, DP=2, TP=PP=1) on Ray: every
sparse layer gathers both ranks' tokens, each rank runs its 4 of 8 experts, and a rank
without a forward of its own in a wave step joins the collectives with an empty pass.
Tokens equal transformers'; and the four ways such ranks are known to hang each finish
within DEADLINE_S: (1) a step that schedules nothing on one rank (an abort) while the other
works, (2) one rank with every request, the other only running dummy passes, (3) async
scheduling, whose steps that only collect a result run no forward, (4) speculation
running into max_model_len."""

from __future__ import annotations

import pytest
from dp_drive import Collector, prompts, request, wait_paused

from raylm.actors.ray_engine_core_client import RayEngineCoreClient
from raylm.cluster.engine.engine_args import EngineArgs
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.scheduler.core_outputs import FinishReason

pytestmark = pytest.mark.ray

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    yield ray_local


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    """Qwen2-MoE: 8 experts, top 2, a gated shared expert; layers 0 and 2 sparse."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("moe-dp")), CheckpointSpec(
        architecture="Qwen2MoeForCausalLM", num_hidden_layers=3, mlp_only_layers=(1,),
        norm_topk_prob=False, max_position_embeddings=MAX_MODEL_LEN, seed=37))


def _client(path: str, async_scheduling: bool, **extra) -> RayEngineCoreClient:
    config = EngineArgs(
        model=path, block_size=4, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=16,
        async_scheduling=async_scheduling, data_parallel_size=2, enable_expert_parallel=True,
        **extra).create_engine_config()
    return RayEngineCoreClient(config)


@pytest.fixture(scope="module")
def async_client(moe_path):
    """Async scheduling with ngram speculation: the scenarios share one engine."""
    client = _client(moe_path, True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    yield client
    client.shutdown()


def _add(client: RayEngineCoreClient, rid: str, prompt: list[int], max_tokens: int) -> int:
    """Add a request; the DP rank it was routed to."""
    before = client.get_dp_state()["routed"]
    client.add_request(request(client.config, rid, prompt, max_tokens))
    after = client.get_dp_state()["routed"]
    return next(r for r in range(2) if after[r] > before[r])


def _experts_per_rank(client: RayEngineCoreClient) -> list[set[str]]:
    metrics = client.get_metrics()["dp_ranks"]
    return [{key for key in m if key.startswith("raylm:moe_expert_tokens{")} for m in metrics]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_experts_over_dp_ranks_equal_transformers_under_preemption_and_chunking(
        moe_path, hf_oracle, async_scheduling):
    client = _client(moe_path, async_scheduling)
    try:
        config = client.config
        batch = prompts(8, seed=1)
        lengths = [10 + i % 5 for i in range(8)]
        col = Collector(client)
        for i, (p, n) in enumerate(zip(batch, lengths, strict=True)):
            client.add_request(request(config, f"r{i}", p, n))
        col.until_finished([f"r{i}" for i in range(8)])
        hf = hf_oracle(moe_path)
        for i, (p, n) in enumerate(zip(batch, lengths, strict=True)):
            assert col.tokens[f"r{i}"] == hf.greedy(p, n), f"r{i}"
        state = wait_paused(client)
        assert min(state["routed"]) >= 3, state
        logs = [(r["num_waves_completed"], r["num_steps"], r["num_collectives"])
                for r in state["ranks"]]
        assert logs[0] == logs[1], logs  # lockstep
        metrics = client.get_metrics()
        assert metrics["raylm:num_preemptions"] > 0, metrics
        # Rank r holds experts 4r..4r+3 of each sparse layer; together all 8.
        held = _experts_per_rank(client)
        for rank, keys in enumerate(held):
            assert keys == {f'raylm:moe_expert_tokens{{layer="{layer}",expert="{e}"}}'
                            for layer in (0, 2) for e in range(4 * rank, 4 * rank + 4)}
    finally:
        client.shutdown()


def test_one_rank_with_every_request_the_other_running_dummy_passes(async_client, moe_path,
                                                                    hf_oracle):
    """Scenario 2: requests one at a time go to the least-loaded rank; a long one keeps
    rank 0 busy while rank 1 has nothing, so rank 1 only joins the collectives."""
    client = async_client
    col = Collector(client)
    before = [r["num_dummy_steps"] for r in client.get_dp_state()["ranks"]]
    prompt = prompts(1, seed=2)[0]
    client.add_request(request(client.config, "only", prompt, 40))
    col.until_finished(["only"])
    assert col.tokens["only"] == hf_oracle(moe_path).greedy(prompt, 40)
    state = wait_paused(client)
    routed = state["routed"]
    ranks = state["ranks"]
    idle = 1 - routed.index(max(routed))
    assert ranks[idle]["num_dummy_steps"] - before[idle] >= 20, (before, ranks)


def test_an_abort_on_one_rank_while_the_other_works(async_client, moe_path, hf_oracle):
    """Scenario 1: the aborting rank's step schedules no token (only the abort); its wave
    step still joins the collectives, so the busy rank's forward goes on. Requests are
    added until one lands on the other rank (routing follows load and free KV)."""
    client = async_client
    col = Collector(client)
    batch = prompts(6, seed=3)
    busy_rank = _add(client, "busy", batch[0], 50)
    others = []
    for i, p in enumerate(batch[1:]):
        others.append(f"a{i}")
        if _add(client, f"a{i}", p, 50) != busy_rank:
            break
    else:
        pytest.fail("every request was routed to one rank")
    victim = others[-1]
    while len(col.tokens.get(victim, ())) < 3:
        col.read(timeout=1.0)
    client.abort_requests([victim])
    col.until_finished(["busy", *others])
    assert col.finish[victim] == FinishReason.ABORT
    assert col.tokens["busy"] == hf_oracle(moe_path).greedy(batch[0], 50)
    assert wait_paused(client)["unfinished"] == [0, 0]


def test_speculation_into_max_model_len_on_both_ranks(async_client, moe_path, hf_oracle):
    """Scenarios 3 and 4: async steps that only collect a result run no forward of their
    own, and near max_model_len the drafts shrink to what fits; both ranks stop at the
    limit, with tokens equal to transformers'."""
    client = async_client
    col = Collector(client)
    phrase = [11, 12, 13, 14, 15, 16]
    repeat = [phrase * 5, [40, 41] + phrase * 4, [7] + phrase * 4, [8, 9, 10] + phrase * 3]
    ranks = {_add(client, f"s{i}", p, MAX_MODEL_LEN) for i, p in enumerate(repeat)}
    assert ranks == {0, 1}
    col.until_finished([f"s{i}" for i in range(len(repeat))])
    hf = hf_oracle(moe_path)
    for i, p in enumerate(repeat):
        assert col.finish[f"s{i}"] == FinishReason.LENGTH
        assert len(p) + len(col.tokens[f"s{i}"]) == MAX_MODEL_LEN
        assert col.tokens[f"s{i}"] == hf.greedy(p, MAX_MODEL_LEN - len(p)), f"s{i}"
    state = wait_paused(client)
    assert client.get_metrics()["raylm:spec_decode_num_draft_tokens"] > 0
    assert all(r["num_dummy_steps"] > 0 for r in state["ranks"]), state
    logs = [(r["num_waves_completed"], r["num_steps"], r["num_collectives"])
            for r in state["ranks"]]
    assert logs[0] == logs[1], logs


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["dp2xtp2", "dp2xpp2"])
def test_experts_over_dp_and_tp_ranks_or_stages_equal_transformers(tmp_path_factory, hf_oracle,
                                                                    tp, pp):
    """EP = DP x TP with each DP rank's model in worker actors: DeepSeek-V3 (latent
    attention, 8 experts on layers 1 and 2) at DP=2 x TP=2, each (DP, TP) rank 2 experts
    whole, its TP peers the rest; and at DP=2 x PP=2, each stage's workers in a group of
    their own across the DP ranks. Async; a long request alone on one rank at the end, so
    the other's workers run dummy passes through the step stream."""
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("mla-dp")), CheckpointSpec(
        architecture="DeepseekV3ForCausalLM", num_hidden_layers=3,
        max_position_embeddings=MAX_MODEL_LEN, seed=46))
    client = _client(path, True, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        batch = prompts(6, seed=4)
        lengths = [8 + i % 4 for i in range(6)]
        col = Collector(client)
        for i, (p, n) in enumerate(zip(batch, lengths, strict=True)):
            client.add_request(request(client.config, f"r{i}", p, n))
        col.until_finished([f"r{i}" for i in range(6)])
        hf = hf_oracle(path)
        for i, (p, n) in enumerate(zip(batch, lengths, strict=True)):
            assert col.tokens[f"r{i}"] == hf.greedy(p, n), f"r{i}"
        before = [r["num_dummy_steps"] for r in wait_paused(client)["ranks"]]
        lone = prompts(1, seed=5)[0]
        rank = _add(client, "lone", lone, 30)
        col.until_finished(["lone"])
        assert col.tokens["lone"] == hf.greedy(lone, 30)
        state = wait_paused(client)
        assert state["ranks"][1 - rank]["num_dummy_steps"] - before[1 - rank] >= 10, state
        logs = [(r["num_waves_completed"], r["num_steps"], r["num_collectives"])
                for r in state["ranks"]]
        assert logs[0] == logs[1], logs  # lockstep
        # DP rank r's workers hold experts 4r..4r+3 of each sparse layer between them.
        held = _experts_per_rank(client)
        for r, keys in enumerate(held):
            assert keys == {f'raylm:moe_expert_tokens{{layer="{layer}",expert="{e}"}}'
                            for layer in (1, 2) for e in range(4 * r, 4 * r + 4)}
    finally:
        client.shutdown()
