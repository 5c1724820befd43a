"""The chart's Grafana dashboard (a ConfigMap for Grafana's sidecar, off by default) and its
routing and autoscaling values: every metric the dashboard queries is one raylm exports,
and the prefix router and engine-signal autoscaling reach the Serve app as configured."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import yaml

from raylm.cluster.serve.deployment.app import llm_server_options
from raylm.cluster.serve.deployment.config import load_app_config
from raylm.cluster.serve.deployment.metrics import ServingMetrics, render
from raylm.cluster.serve.deployment.router_stats import RouterView

CHART = Path(__file__).resolve().parents[2] / "helm" / "raylm"
DASHBOARD = CHART / "dashboards" / "raylm.json"


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def exported_names() -> set[str]:
    """Every sample name raylm's /metrics can show: one replica's series with speculative
    decoding on, and an ingress router's view of two replicas."""
    stats = {"num_requests_running": 1, "num_requests_waiting": 2, "kv_cache_usage_perc": 0.5,
             "prefix_cache_queries_total": 10, "prefix_cache_hits_total": 5,
             "spec_decode_num_drafts_total": 3, "spec_decode_num_draft_tokens_total": 9,
             "spec_decode_num_accepted_tokens_total": 4,
             "spec_decode_num_accepted_tokens_per_pos": [2, 1, 1],
             "devices": [("cpu", "cpu", 1.0)]}
    serving = ServingMetrics("m", lambda: stats)
    timer = serving.request_timer()
    timer.on_abort()
    view = RouterView()
    view.set_replicas({"r1": {"num_kv_blocks": 8.0, **{k: v for k, v in stats.items()
                                                         if isinstance(v, int | float)}},
                       "r2": {"kv_cache_usage_perc": 0.1}})
    view.count("prefix_match", 32, 16)
    text = render([serving.families(), view.families("m")]).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for e in _exprs(dashboard) for name in re.findall(r"raylm:[A-Za-z0-9_:]+", e)}
    exported = exported_names()
    assert queried and queried <= exported, sorted(queried - exported)
    # The panels the issue asks for are there.
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for word in ("tokens per second", "time to first token", "time per output token",
                 "kv cache", "prefix cache hit rate", "waiting", "replicas", "acceptance"):
        assert word in titles, word
    variable = dashboard["templating"]["list"][1]["query"]["query"]
    assert re.findall(r"raylm:[a-z_]+", variable)[0] in exported


def test_dashboard_configmap_is_off_by_default_and_carries_the_sidecar_label(helm_template):
    assert helm_template().kind("ConfigMap") == []
    cm = helm_template(values={"grafanaDashboard": {
        "enabled": True, "namespace": "monitoring", "annotations": {"folder": "LLM"}}}
    ).one("ConfigMap")
    assert cm["metadata"]["name"] == "r-raylm-grafana-dashboard"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"folder": "LLM"}
    assert json.loads(cm["data"]["raylm.json"]) == json.loads(DASHBOARD.read_text())


def test_prefix_router_and_engine_signal_autoscaling_reach_the_serve_app(helm_template):
    values = {"llmConfig": {"deployment_config": {
        "request_router": {"policy": "prefix", "imbalance_threshold": 4},
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                               "target_ongoing_requests": 96, "scale_on": "engine_signals",
                               "target_num_requests_waiting": 8}}}}
    rs = helm_template(values=values).one("RayService")
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    config = load_app_config(serve)
    assert not config.ingress_in_replica  # the router needs the ingress deployment
    opts = llm_server_options(config.llm_configs[0])
    router = opts["request_router_config"]
    assert router.request_router_class.endswith(":PrefixAwareRouter")
    assert router.request_router_kwargs["imbalance_threshold"] == 4
    policy = opts["autoscaling_config"]["policy"]
    assert policy["policy_function"].endswith(":EngineSignalPolicy")
    assert policy["policy_kwargs"]["target_num_requests_waiting"] == 8
    # The default: Serve's power of two choices, through raylm's router (its /metrics view).
    default = load_app_config(yaml.safe_load(
        helm_template().one("RayService")["spec"]["serveConfigV2"]))
    assert llm_server_options(default.llm_configs[0])["request_router_config"] \
        .request_router_class.endswith(":Pow2Router")


def test_schema_takes_the_router_as_a_name_or_an_object_and_refuses_others():
    schema = json.loads((CHART / "values.schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    dc = values["llmConfig"]["deployment_config"]
    for good in ("prefix", {"policy": "prefix", "stats_period_s": 2}):
        dc["request_router"] = good
        assert list(validator.iter_errors(values)) == []
    for bad in ("random", {"policy": "prefix", "made_up": 1}):
        dc["request_router"] = bad
        assert list(validator.iter_errors(values)), bad
    dc["request_router"] = "pow2"
    dc["autoscaling_config"]["scale_on"] = "gpu_temperature"
    assert list(validator.iter_errors(values))


def test_ray_lora_config_reaches_the_engine(helm_template):
    values = {"llmConfig": {"lora_config": {"dynamic_lora_loading_path": "/adapters",
                                            "max_num_adapters_per_replica": 6}}}
    rs = helm_template(values=values).one("RayService")
    (llm,) = load_app_config(yaml.safe_load(rs["spec"]["serveConfigV2"])).llm_configs
    ek = llm.engine_kwargs
    assert (ek.enable_lora, ek.allowed_lora_root, ek.max_cpu_loras) == (True, "/adapters", 6)
    schema = json.loads((CHART / "values.schema.json").read_text())
    bad = yaml.safe_load((CHART / "values.yaml").read_text())
    bad["llmConfig"]["lora_config"] = {"download_timeout_s": 30}
    assert list(jsonschema.Draft7Validator(schema).iter_errors(bad))
