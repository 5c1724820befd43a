"""The chart's batch RayJob writes where the user can read it: an object-store URI or an
absolute path on a mounted volume; a relative output (lost in the job's temporary working
directory) is refused at `helm template` time."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("output", ["s3://my-bucket/jobs/out.jsonl", "/data/out.jsonl",
                                    "gs://b/shards/"])
def test_rayjob_output_uri_or_absolute_path(helm_template, crd_errors, output):
    job = helm_template({"batch": {"enabled": True, "input": "s3://my-bucket/jobs/in.jsonl",
                                   "output": output, "numReplicas": "2..4"}}).one("RayJob")
    assert crd_errors(job) == []
    assert job["spec"]["entrypoint"] == (f"raylm batch --input s3://my-bucket/jobs/in.jsonl "
                                         f"--output {output} --num-replicas 2..4")


@pytest.mark.parametrize("output", ["out.jsonl", "./data/out.jsonl"])
def test_relative_batch_output_is_refused(helm_template, output):
    r = helm_template({"batch": {"enabled": True, "input": "/data/in.jsonl", "output": output}})
    assert r.returncode != 0
    assert f'batch.output "{output}" is relative' in r.stderr and "s3://" in r.stderr


@pytest.mark.parametrize("replicas", ["0", "2..", "x", "1..2..3"])
def test_bad_num_replicas_is_refused_by_the_schema(helm_template, replicas):
    r = helm_template({"batch": {"enabled": True, "input": "/d/in.jsonl",
                                 "output": "/d/out.jsonl", "numReplicas": replicas}})
    assert r.returncode != 0 and "numReplicas" in r.stderr
