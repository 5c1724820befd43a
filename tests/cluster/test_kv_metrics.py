"""KV-connector metrics on /metrics: the engine's series (vLLM's names where it has them,
labels kept) through get_stats(); a PD proxy sums both sides' series."""

from __future__ import annotations

from prometheus_client import generate_latest

from raylm.cluster.engine.engine_stats import kv_connector_stats
from raylm.cluster.serve.deployment.metrics import ServingMetrics
from raylm.cluster.serve.pd.pd_client import merge_pd_stats

ENGINE = {
    "raylm:prompt_tokens": 10,
    "raylm:external_prefix_cache_hits": 80,
    'raylm:kv_offload_total_bytes{transfer_type="GPU_to_CPU"}': 4096.0,
    'raylm:kv_offload_total_bytes{transfer_type="CPU_to_GPU"}': 2048.0,
    "raylm:kv_offload_cpu_cache_usage_perc": 0.25,
    "raylm:kv_connector_num_recomputed_tokens": 16,
}


def test_kv_series_reach_prometheus_with_their_labels():
    stats = kv_connector_stats(ENGINE)
    assert set(stats["kv_connector"]) == set(ENGINE) - {"raylm:prompt_tokens"}
    text = generate_latest(ServingMetrics("m", lambda: stats).registry).decode()
    assert 'raylm:external_prefix_cache_hits_total{model_name="m"} 80.0' in text
    assert ('raylm:kv_offload_total_bytes_total{model_name="m",transfer_type="CPU_to_GPU"} '
            '2048.0') in text
    assert "# TYPE raylm:kv_offload_cpu_cache_usage_perc gauge" in text
    assert 'raylm:kv_connector_num_recomputed_tokens_total{model_name="m"} 16.0' in text
    assert kv_connector_stats({"raylm:prompt_tokens": 1}) == {}  # no connector: nothing


def test_pd_proxy_sums_both_sides():
    decode = {"num_requests_running": 2, "kv_connector": {"raylm:kv_transfer_bytes_transferred": 5}}
    prefill = {"num_requests_running": 1, "num_requests_waiting": 3,
               "kv_connector": {"raylm:kv_transfer_bytes_transferred": 0,
                                "raylm:kv_transfer_num_kv_expired_reqs": 1}}
    merged = merge_pd_stats(decode, prefill, fallbacks=2)
    assert merged["num_requests_running"] == 3 and merged["num_requests_waiting"] == 3
    assert merged["kv_connector"] == {"raylm:kv_transfer_bytes_transferred": 5,
                                      "raylm:kv_transfer_num_kv_expired_reqs": 1,
                                      "raylm:pd_num_local_prefill_fallbacks": 2}
