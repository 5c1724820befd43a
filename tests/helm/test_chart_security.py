"""The chart's security render: the model is the only thing the chart exposes (the Serve
port on <name>-serve-svc; the head's GCS, dashboard and client ports on its ClusterIP
head Service, never an ingress), and Ray's token authentication is on wherever the Ray
version has it (2.52.0+), refused where asked for on an older one."""

from __future__ import annotations

import pytest


def _cluster(doc: dict) -> dict:
    spec = doc["spec"]
    return spec["rayClusterConfig"] if doc["kind"] == "RayService" else spec["rayClusterSpec"]


BATCH = ["batch.enabled=true", "batch.input=s3://b/in.jsonl", "batch.output=s3://b/out.jsonl"]


def test_default_render_turns_token_auth_on_for_every_cluster(helm_template, crd_errors):
    result = helm_template(sets=BATCH)
    docs = result.kind("RayService") + result.kind("RayJob")
    assert len(docs) == 2
    for doc in docs:
        cluster = _cluster(doc)
        assert cluster["rayVersion"] == "2.60.0"
        assert cluster["authOptions"] == {"mode": "token"}
        assert crd_errors(doc) == []


def test_only_the_serve_port_is_exposed(helm_template):
    service = helm_template().one("RayService")
    cluster = _cluster(service)
    head = cluster["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and not head.get("enableIngress")
    assert "serveService" not in service["spec"]  # KubeRay's: the port named "serve" only
    head_ports = {p["name"]: p["containerPort"]
                  for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert head_ports["serve"] == 8000
    assert {head_ports[n] for n in ("gcs-server", "dashboard", "client")} == {6379, 8265, 10001}
    for group in cluster["workerGroupSpecs"]:
        ports = group["template"]["spec"]["containers"][0].get("ports", [])
        assert [p["name"] for p in ports] == ["serve"]


@pytest.mark.parametrize("sets, on", [
    (["rayVersion=2.52.0"], True),
    (["rayVersion=2.51.2"], False),
    (["rayVersion="], False),
    (["security.rayTokenAuth=false"], False),
    (["security.rayTokenAuth=true", "rayVersion=2.53.1"], True),
])
def test_token_auth_follows_the_ray_version(helm_template, crd_errors, sets, on):
    service = helm_template(sets=sets).one("RayService")
    assert ("authOptions" in _cluster(service)) is on
    assert crd_errors(service) == []


@pytest.mark.parametrize("sets, message", [
    (["security.rayTokenAuth=true", "rayVersion=2.40.0"],
     "rayVersion 2.40.0 has no token authentication"),
    (["security.rayTokenAuth=true", "rayVersion="], "needs rayVersion"),
    (["security.rayTokenAuth=maybe"], "rayTokenAuth"),
])
def test_token_auth_where_the_ray_version_lacks_it_is_refused(helm_template, sets, message):
    result = helm_template(sets=sets)
    assert result.returncode != 0 and message in result.stderr, result.stderr
