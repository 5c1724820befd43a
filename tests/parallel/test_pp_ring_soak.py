"""bench/pp_ring_soak.py on CPU over gloo: the async PP ring's order of operations (real
bootstrap, transport and SampledTokenRing, one spawned process per rank on 127.0.0.1)
passes with every value checked, and an injected wrong delivery fails it, naming the round.
"""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
ROUND = 17  # a round with tokens; its ids are consumed p rounds later


@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, BENCH)  # the spawned ranks import the module by name
    try:
        import pp_ring_soak

        yield pp_ring_soak
    finally:
        sys.path.remove(BENCH)
        sys.modules.pop("pp_ring_soak", None)


def test_tp2_pp2_ring_passes(soak):
    result = soak.run_soak(2, 2, 40, device="cpu", timeout_s=120)
    assert result.ok, result.line
    assert result.line.startswith(
        "PASS pp_ring_soak: 4 ranks tp=2 pp=2 backend=gloo rounds=40 in "), result.line
    assert (result.ranks, result.rounds, result.backend) == (4, 40, "gloo")


def test_wrong_sampled_id_fails_naming_round(soak):
    # pp=3: both earlier stages consume the last stage's broadcast, the middle one included.
    assert soak.schedule(ROUND, 8, 16)[0] > 0
    result = soak.run_soak(1, 3, 30, device="cpu", timeout_s=120, inject="ids",
                           inject_round=ROUND)
    assert not result.ok
    assert result.line.startswith(
        f"FAIL pp_ring_soak: round {ROUND}: sampled ids wrong on rank 0 (stage 0, tp 0), "
        f"broadcast at round {ROUND}, consumed at round {ROUND + 3}; 2 wrong check(s) in all"
    ), result.line


def test_wrong_hidden_state_fails_naming_round(soak):
    result = soak.run_soak(1, 2, 30, device="cpu", timeout_s=120, inject="hidden",
                           inject_round=ROUND)
    assert not result.ok
    assert result.line.startswith(
        f"FAIL pp_ring_soak: round {ROUND}: hidden states wrong on rank 1 (stage 1, tp 0); "
        "1 wrong check(s) in all"), result.line


def test_bad_injection_is_refused(soak):
    with pytest.raises(ValueError, match="non-empty round"):
        soak.run_soak(1, 2, 30, inject="ids", inject_round=12)  # round 12 is empty
