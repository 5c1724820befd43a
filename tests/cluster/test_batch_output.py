"""Batch inputs and outputs without Ray: locations, shards, resume, the job-directory check."""

from __future__ import annotations

import json
import os

import pytest

from raylm.cluster.batch.fs import check_output_location, resolve
from raylm.cluster.batch.job import BatchJobConfig, parse_replicas, row_keys, run_batch_job
from raylm.cluster.batch.output import BatchOutput
from raylm.cluster.serve.deployment.config import LLMConfig


def out_line(custom_id, status=200):
    return json.dumps({"id": "batch_req-x", "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": "r", "body": {}},
                       "error": None})


def in_line(custom_id):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "x", "max_tokens": 2}})


def test_locations_local_file_uri_and_fsspec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loc = resolve("sub/out.jsonl")
    assert loc.is_local and loc.uri == loc.path == str(tmp_path / "sub" / "out.jsonl")
    loc.write_text("a\n")
    assert resolve(f"file://{tmp_path}/sub/out.jsonl").read_text() == "a\n"
    assert [f.path for f in resolve(str(tmp_path / "sub")).list_files()] == [loc.path]
    assert not [p for p in os.listdir(tmp_path / "sub") if ".tmp-" in p]
    mem = resolve("memory://raylm-test/x/out.jsonl")  # no pyarrow scheme: through fsspec
    assert not mem.is_local and mem.uri == "memory://raylm-test/x/out.jsonl"
    mem.write_text("b\n")
    assert resolve("memory://raylm-test/x/out.jsonl").read_text() == "b\n"
    with pytest.raises(ValueError, match="nosuchscheme"):
        resolve("nosuchscheme://bucket/x")


def test_file_output_checkpoints_in_parts_and_merges_in_input_order(tmp_path):
    out = BatchOutput(str(tmp_path / "out.jsonl"))
    assert not out.is_folder and out.load_completed() == ({}, [])
    out.write_shard([out_line("c"), out_line(None, 400)])
    out.write_shard([out_line("a")])
    assert (tmp_path / "out.jsonl.parts").is_dir() and not (tmp_path / "out.jsonl").exists()
    done, keyless = BatchOutput(str(tmp_path / "out.jsonl")).load_completed()
    assert sorted(done) == ["a", "c"] and len(keyless) == 1
    out.write_shard([out_line("b")])
    out.finalize(["a", None, "b", "c"])
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(ln)["custom_id"] for ln in lines] == ["a", None, "b", "c"]
    assert not (tmp_path / "out.jsonl.parts").exists()
    # A later run with one more row keeps the finished ones and adds the new one.
    again = BatchOutput(str(tmp_path / "out.jsonl"))
    assert sorted(again.load_completed()[0]) == ["a", "b", "c"]
    again.write_shard([out_line("d")])
    again.finalize(["a", None, "b", "c", "d"])
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(ln)["custom_id"] for ln in lines] == ["a", None, "b", "c", "d"]


def test_folder_output_is_its_shards(tmp_path):
    out = BatchOutput(str(tmp_path / "shards") + "/")
    assert out.is_folder
    first = out.write_shard([out_line("a"), out_line("b")])
    out.finalize(["a", "b"])
    assert first.path.startswith(str(tmp_path / "shards" / "part-"))
    assert sorted(BatchOutput(str(tmp_path / "shards")).load_completed()[0]) == ["a", "b"]


def test_a_file_that_is_no_batch_output_is_not_overwritten(tmp_path):
    (tmp_path / "notes.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not an OpenAI Batch output"):
        BatchOutput(str(tmp_path / "notes.jsonl")).load_completed()


def test_relative_output_in_a_ray_job_working_dir_is_refused(tmp_path, monkeypatch):
    wd = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    wd.mkdir(parents=True)
    monkeypatch.chdir(wd)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR",
                       json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_1.zip"}}))
    with pytest.raises(ValueError, match="working directory") as e:
        check_output_location("out.jsonl")
    assert "s3://" in str(e.value) and "absolute path" in str(e.value)
    check_output_location(str(tmp_path / "out.jsonl"))  # outside the copy: fine
    check_output_location("s3://bucket/out.jsonl")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    with pytest.raises(ValueError, match="working directory"):  # known by its path alone
        check_output_location("out.jsonl")


def test_row_keys_and_replica_counts():
    rows = [(1, in_line("a")), (2, "{bad"), (4, in_line("b"))]
    assert row_keys(rows) == ["a", None, "b"]
    with pytest.raises(ValueError, match="'a' appears on lines 1 and 5"):
        row_keys(rows + [(5, in_line("a"))])
    assert parse_replicas("3") == (3, 3) and parse_replicas("1..4") == (1, 4)
    for bad in ("0", "4..2", "x", "1..", ""):
        with pytest.raises(ValueError, match="--num-replicas"):
            parse_replicas(bad)
    cfg = LLMConfig.model_validate({"model_loading_config": {"model_id": "m"}})
    with pytest.raises(ValueError, match="max_replicas"):
        BatchJobConfig("in", "out", cfg, min_replicas=2, max_replicas=1)


def test_a_complete_output_needs_no_engine(tmp_path):
    """Everything already stored: the rerun starts no Ray and rewrites the same rows."""
    (tmp_path / "in.jsonl").write_text("\n".join([in_line("a"), "{bad", in_line("b")]) + "\n")
    (tmp_path / "out.jsonl").write_text("\n".join([out_line("b"), out_line(None, 400),
                                                   out_line("a")]) + "\n")
    cfg = LLMConfig.model_validate({"model_loading_config": {"model_id": "m"}})
    result = run_batch_job(BatchJobConfig(str(tmp_path / "in.jsonl"),
                                          str(tmp_path / "out.jsonl"), cfg))
    assert (result.num_rows, result.num_resumed, result.num_run) == (3, 3, 0)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(ln)["custom_id"] for ln in lines] == ["a", None, "b"]


def test_replica_placement_groups():
    """One bundle when the engine runs in the replica; else the Serve replica's layout."""
    from raylm.cluster.batch.replica import ReplicaPlacement, replica_bundles

    def cfg(**engine_kwargs):
        return LLMConfig.model_validate({"model_loading_config": {"model_id": "m"},
                                         "engine_kwargs": engine_kwargs})

    assert replica_bundles(cfg()) == ([{"CPU": 1.0}], "PACK")
    gpu = cfg().model_copy(update={"num_gpus_per_worker": 1.0})
    assert replica_bundles(gpu) == ([{"GPU": 1.0}], "PACK")
    # The replica, then one bundle for the stage's TP group.
    assert replica_bundles(cfg(tensor_parallel_size=2))[0] == [{"CPU": 1.0}, {"CPU": 2.0}]
    assert len(replica_bundles(cfg(data_parallel_size=2))[0]) == 3  # replica + 2 rank actors
    placement = ReplicaPlacement(*replica_bundles(gpu))
    assert placement.actor_resources == {"num_cpus": 0.0, "num_gpus": 1.0}
