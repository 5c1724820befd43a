"""Expert-load metrics of a mixture of experts: tokens routed to each expert of each sparse
layer (a counter), and per layer how unbalanced the routing has been (a gauge: the busiest
expert's tokens over the mean expert's; 1 is perfectly even). Imbalance decides what
expert parallelism costs: the rank holding the busiest expert sets every step's pace."""

from __future__ import annotations

import re

EXPERT_TOKENS = "raylm:moe_expert_tokens"
LOAD_IMBALANCE = "raylm:moe_expert_load_imbalance"
MOE_DOCS = {
    EXPERT_TOKENS: "Tokens routed to each expert of each sparse layer.",
    LOAD_IMBALANCE: "Per sparse layer: tokens of its busiest expert over its mean expert's "
                    "(1 = even routing), since start.",
}
_KEY = re.compile(re.escape(EXPERT_TOKENS) + r'\{layer="(\d+)",expert="(\d+)"\}')


def expert_load_metrics(load: dict[int, dict[int, int]]) -> dict[str, float]:
    """Executor.expert_load() -> the get_metrics() counters, one per (layer, expert)."""
    return {f'{EXPERT_TOKENS}{{layer="{layer}",expert="{expert}"}}': float(tokens)
            for layer, experts in sorted(load.items())
            for expert, tokens in sorted(experts.items())}


def expert_load_series(metrics: dict[str, float]) -> dict[str, float]:
    """The counters of ``metrics`` (summed over DP ranks by then) and each layer's
    imbalance computed from them; empty for a dense model."""
    per_layer: dict[str, list[float]] = {}
    series: dict[str, float] = {}
    for key, value in metrics.items():
        match = _KEY.fullmatch(key)
        if match is not None:
            series[key] = float(value)
            per_layer.setdefault(match[1], []).append(float(value))
    for layer, tokens in per_layer.items():
        mean = sum(tokens) / len(tokens)
        series[f'{LOAD_IMBALANCE}{{layer="{layer}"}}'] = max(tokens) / mean if mean else 1.0
    return series
