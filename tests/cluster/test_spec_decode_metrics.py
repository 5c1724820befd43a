"""Speculative decoding counters from get_metrics() to the Prometheus exposition."""

from __future__ import annotations

from raylm.cluster.engine.engine_stats import spec_decode_stats
from raylm.cluster.serve.deployment.metrics import ServingMetrics, render
from raylm.scheduler.spec_decode_stats import SpecDecodingCounters


def test_counters_reach_the_exposition_with_a_position_label():
    counters = SpecDecodingCounters(3)
    counters.observe(3, 2)
    counters.observe(2, 0)
    counters.observe(0, 0)  # nothing proposed: not a draft
    metrics = counters.metrics()
    assert metrics["raylm:spec_decode_num_drafts"] == 2
    assert metrics["raylm:spec_decode_num_draft_tokens"] == 5
    assert metrics["raylm:spec_decode_num_accepted_tokens"] == 2
    stats = spec_decode_stats(metrics)
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == [1, 1, 0]
    assert spec_decode_stats({"raylm:num_preemptions": 0}) == {}  # speculation off
    text = render([ServingMetrics("m", lambda: stats).families()]).decode()
    assert 'raylm:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'raylm:spec_decode_num_draft_tokens_total{model_name="m"} 5.0' in text
    assert 'raylm:spec_decode_num_accepted_tokens_total{model_name="m"} 2.0' in text
    assert ('raylm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}'
            ' 1.0') in text
    off = render([ServingMetrics("m", dict).families()]).decode()
    assert "spec_decode" not in off
