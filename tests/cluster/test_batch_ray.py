"""Batch runs on Ray Data with real engine replicas, on a two-node Ray cluster on this
machine: one replica per node, a replica killed mid-run loses nothing, a rerun after an
interrupted run runs only the missing rows (counted), input and output on S3 (a local moto
server)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from raylm.cluster.batch.job import BatchJobConfig, run_batch_job
from raylm.cluster.serve.deployment.config import LLMConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny"
MAX_TOKENS = 6
N = 12


def prompts(n: int) -> list[str]:
    return [f"row {i} says" + " hello" * (i % 3) for i in range(n)]


def input_text(n: int) -> str:
    rows = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS,
                                 "temperature": 0, "ignore_eos": True}})
            for i, p in enumerate(prompts(n))]
    return "\n".join(rows[:2] + ["{not json"] + rows[2:]) + "\n"


def llm_config(path: str) -> LLMConfig:
    return LLMConfig.model_validate({"model_loading_config": {"model_id": MODEL,
                                                              "model_source": path}})


def expected_texts(path: str, n: int) -> dict[str, str]:
    """The single in-process engine's greedy answers: the reference for every replica."""
    from raylm.cluster.engine.llm import LLM
    from raylm.scheduler.sampling_params import SamplingParams

    with LLM(path) as llm:
        outs = llm.generate(prompts(n), SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)
    return {f"r{i}": o.outputs[0].text for i, o in enumerate(outs)}


@pytest.fixture(scope="module")
def expected(llama_path) -> dict[str, str]:
    return expected_texts(llama_path, N)


def check_output(lines: list[str], expected: dict[str, str]) -> None:
    """Every row exactly once, in input order, with the reference text; the bad line is a 400."""
    out = [json.loads(ln) for ln in lines]
    ids = [o["custom_id"] for o in out]
    assert ids == list(expected)[:2] + [None] + list(expected)[2:], ids
    for o in out:
        if o["custom_id"] is None:
            assert o["response"]["status_code"] == 400
            continue
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200, o
        assert body["choices"][0]["text"] == expected[o["custom_id"]], o["custom_id"]
        assert body["usage"]["completion_tokens"] == MAX_TOKENS


@pytest.fixture(scope="module")
def two_nodes(ray_two_nodes):
    """The node ids of a two-node cluster; the test process is its driver."""
    # One CPU per node and one per replica: two replicas can only sit one on each node.
    cluster = ray_two_nodes.cluster
    yield {node.node_id for node in cluster.list_all_nodes()}


def test_two_replicas_one_per_node_and_a_killed_replica_loses_nothing(two_nodes, llama_path,
                                                                       expected, tmp_path):
    (tmp_path / "in.jsonl").write_text(input_text(N))
    config = BatchJobConfig(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                            llm_config(llama_path), min_replicas=2, max_replicas=2,
                            batch_size=2, max_concurrency=4, progress=False)
    killed: dict[str, str] = {}
    after_kill: list[tuple[int, str]] = []

    def kill_first_replica(cols):
        if killed:
            after_kill.extend(zip(map(int, cols["line_no"]), map(str, cols["replica"])))
            return
        replica = str(cols["replica"][0])
        os.kill(int(replica.rsplit(":", 1)[1]), signal.SIGKILL)  # as the OOM killer would
        killed["replica"] = replica

    from ray.util import placement_group_table

    groups_before = set(placement_group_table())
    result = run_batch_job(config, on_results=kill_first_replica)
    groups = {k: v for k, v in placement_group_table().items() if k not in groups_before}
    # A group per replica actor Ray Data started (a restarted actor keeps its own), all
    # removed at the end.
    assert len(groups) >= 2 and all(v["name"].startswith("raylm-batch-") and
                                    v["state"] == "REMOVED" for v in groups.values()), groups

    nodes = {r.rsplit(":", 1)[0] for r in result.replicas}
    assert nodes == two_nodes, (nodes, two_nodes)
    # The killed replica held batches (two in flight per replica). Ray Data retries them on
    # whichever actor of the pool is free: the survivor on the other node or the killed
    # actor's restart (a new process on the same node, its placement group is there). Either
    # way rows kept coming from a live process, and check_output below finds every row once.
    _, pid = killed["replica"].rsplit(":", 1)
    assert any(not r.endswith(f":{pid}") for _, r in after_kill), after_kill
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
    check_output((tmp_path / "out.jsonl").read_text().splitlines(), expected)
    assert result.num_run == N + 1 and result.num_errors == 1
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len({json.loads(ln)["custom_id"] for ln in lines}) == len(lines)


class Interrupted(Exception):
    pass


def test_rerun_after_an_interrupted_run_runs_only_the_missing_rows(two_nodes, llama_path,
                                                                   expected, tmp_path):
    n = N
    (tmp_path / "in.jsonl").write_text(input_text(n))
    config = BatchJobConfig(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                            llm_config(llama_path), batch_size=2, max_concurrency=2,
                            progress=False)

    def interrupt(cols):
        raise Interrupted(f"stopped after {len(cols['line_no'])} rows")

    with pytest.raises(Interrupted):
        run_batch_job(config, on_results=interrupt)
    parts = tmp_path / "out.jsonl.parts"
    stored = [ln for p in sorted(parts.iterdir()) for ln in p.read_text().splitlines()]
    stored_ids = {json.loads(ln)["custom_id"] for ln in stored}
    assert not (tmp_path / "out.jsonl").exists() and 3 <= len(stored) < n + 1, stored_ids

    ran: list[int] = []
    result = run_batch_job(config, on_results=lambda cols: ran.extend(cols["line_no"]))
    missing = (n + 1) - len(stored)
    # Only the missing rows reached an engine, each once, and each generated its tokens.
    assert len(ran) == len(set(ran)) == missing == result.num_run
    assert result.num_resumed == len(stored)
    assert result.completion_tokens == missing * MAX_TOKENS
    check_output((tmp_path / "out.jsonl").read_text().splitlines(), expected)
    assert not parts.exists()
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def test_input_and_output_on_s3(two_nodes, llama_path, expected, moto_s3):
    n = 6
    moto_s3.put_object(Bucket="raylm-test", Key="jobs/in.jsonl", Body=input_text(n).encode())
    config = BatchJobConfig("s3://raylm-test/jobs/in.jsonl", "s3://raylm-test/jobs/out.jsonl",
                            llm_config(llama_path), batch_size=4, progress=False)
    result = run_batch_job(config)
    assert result.output_uri == "s3://raylm-test/jobs/out.jsonl" and result.num_run == n + 1
    body = moto_s3.get_object(Bucket="raylm-test", Key="jobs/out.jsonl")["Body"].read()
    check_output(body.decode().splitlines(), {k: expected[k] for k in list(expected)[:n]})
    keys = [o["Key"] for o in moto_s3.list_objects_v2(Bucket="raylm-test")["Contents"]]
    # The parts are gone (pyarrow leaves a "jobs/" marker where it deleted a folder).
    assert sorted(k for k in keys if not k.endswith("/")) == ["jobs/in.jsonl", "jobs/out.jsonl"]
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
