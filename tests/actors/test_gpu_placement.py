"""GPU placement on a cluster of nodes that declare GPUs (this machine has none; the ranks
run on CPU with RAYLM_ALLOW_CPU_FALLBACK=1): each pipeline stage's TP group lands on one
node, PP stages may not, and TP ranks follow their GPU ids."""

from __future__ import annotations

import pytest

from raylm.actors.engine_core_actor import model_in_rank_actor, rank_config
from raylm.actors.ray_engine_core_client import rank_bundles
from raylm.actors.ray_executor import rank_order
from raylm.scheduler.config.engine_config import ParallelConfig, dp_rank_bundles, stage_bundles


def test_one_bundle_per_stage_holds_its_tp_group():
    assert stage_bundles(2, 2, {"GPU": 1.0}) == [{"GPU": 2.0}, {"GPU": 2.0}]
    assert stage_bundles(4, 1, {"CPU": 1.0}) == [{"CPU": 4.0}]
    assert dp_rank_bundles(2, 2, {"CPU": 1.0}, {"GPU": 1.0}) == [
        {"CPU": 1.0}, {"GPU": 2.0}, {"GPU": 2.0}]
    assert dp_rank_bundles(1, 1, {"CPU": 1.0}, {"GPU": 1.0}) == [{"GPU": 1.0}]


@pytest.mark.parametrize(("dp", "tp", "pp", "bundles", "in_actor"), [
    # One engine: the EngineCore's own bundle, then its stages, TP = PP = 1 included.
    (1, 1, 1, [{"CPU": 1.0}, {"GPU": 1.0}], False),
    (1, 2, 2, [{"CPU": 1.0}, {"GPU": 2.0}, {"GPU": 2.0}], False),
    # A DP rank with TP = PP = 1 runs the model in its actor: one bundle, the device's.
    (2, 1, 1, [{"GPU": 1.0}], True),
    (2, 2, 1, [{"CPU": 1.0}, {"GPU": 2.0}], False),
])
def test_rank_layout_by_data_parallel_size(dp, tp, pp, bundles, in_actor):
    pc = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                        data_parallel_size=dp, distributed_executor_backend="ray")
    assert rank_bundles(pc, {"CPU": 1.0}, {"GPU": 1.0}) == bundles
    assert model_in_rank_actor(pc) is in_actor


def test_rank_config_drops_dp_and_keeps_a_lone_engine_as_is(llama_path):
    from raylm.cluster.engine.engine_args import EngineArgs

    one = EngineArgs(model=llama_path, distributed_executor_backend="ray").create_engine_config()
    assert rank_config(one) is one
    two = EngineArgs(model=llama_path, data_parallel_size=2).create_engine_config()
    pc = rank_config(two).parallel_config
    assert (pc.data_parallel_size, pc.distributed_executor_backend) == (1, "uni")
    tp2 = EngineArgs(model=llama_path, data_parallel_size=2,
                     tensor_parallel_size=2).create_engine_config()
    assert rank_config(tp2).parallel_config.distributed_executor_backend == "ray"


def test_ranks_of_a_stage_follow_their_gpu_ids():
    infos = [{"node_id": "a", "gpu_ids": ["3"]}, {"node_id": "a", "gpu_ids": ["1"]},
             {"node_id": "b", "gpu_ids": ["0"]}, {"node_id": "b", "gpu_ids": ["10"]},
             {"node_id": "b", "gpu_ids": ["2"]}, {"node_id": "b", "gpu_ids": ["1"]}]
    # TP=2: stages {0,1}, {2,3}, {4,5} keep their members; inside each, by GPU id (10 > 2).
    assert rank_order(infos, 2) == [1, 0, 2, 3, 5, 4]
    assert rank_order(infos, 1) == list(range(6))
    cpu = [{"node_id": "a", "gpu_ids": []}] * 4
    assert rank_order(cpu, 2) == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def three_nodes(ray_gpu_nodes):
    """A head without GPUs and two nodes of 3 GPUs each: TP=2 x PP=2 needs 4, so one rank
    per bundle (as before) would pack 3 ranks on one node and split a TP group."""
    yield ray_gpu_nodes.cluster


@pytest.mark.ray
@pytest.mark.slow
def test_tp_groups_share_a_node_and_pp_stages_spread(three_nodes, llama_path, monkeypatch):
    from raylm import LLM, SamplingParams

    monkeypatch.setenv("RAYLM_ALLOW_CPU_FALLBACK", "1")
    with LLM(llama_path, tensor_parallel_size=2, pipeline_parallel_size=2, num_kv_blocks=16,
             max_num_seqs=2) as llm:
        infos = llm.llm_engine.core.info["worker_infos"]
        out = llm.generate([[5, 9, 33]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3
    nodes = [info["node_id"] for info in infos]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], nodes  # each TP group on one node
    assert nodes[0] != nodes[2], nodes  # 4 GPUs do not fit one 3-GPU node
    assert all(info["assigned_resources"].get("GPU") == 1.0 for info in infos), infos
    for stage in (infos[:2], infos[2:]):  # TP rank order follows the GPU ids
        ids = [int(info["gpu_ids"][0]) for info in stage]
        assert ids == sorted(ids) and len(set(ids)) == 2, ids
