"""torch's OpenMP threads spin briefly before they sleep (scheduler/config/openmp_wait.py):
set by raylm's package init before torch loads, the user's own choice kept and forwarded."""

from __future__ import annotations

import os
import subprocess
import sys

from raylm.scheduler.config import envs, openmp_wait

# Records GOMP_SPINCOUNT at the moment torch is first imported: libgomp reads it then.
_PROBE = r"""
import builtins, os, sys
seen = []
real_import = builtins.__import__
def probe(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules and not seen:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = probe
import raylm.runner.worker  # imports torch on the way
print("SEEN", seen[0] if seen else "no torch import")
"""


def _seen_at_torch_import(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in openmp_wait.USER_VARIABLES}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return out.split("SEEN ", 1)[1].strip()


def test_package_init_sets_the_short_spin_before_torch_loads():
    assert _seen_at_torch_import({}) == str(openmp_wait.DEFAULT_SPIN_COUNT)


def test_a_user_value_reaches_torch_unchanged():
    assert _seen_at_torch_import({"GOMP_SPINCOUNT": "250000"}) == "250000"


def test_apply_keeps_any_user_wait_policy():
    env: dict[str, str] = {}
    openmp_wait.apply(env)
    assert env == {"GOMP_SPINCOUNT": str(openmp_wait.DEFAULT_SPIN_COUNT)}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    openmp_wait.apply(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}  # no spin count added beside it


def test_actors_get_only_a_choice_that_is_not_the_default(monkeypatch):
    for var in openmp_wait.USER_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", str(openmp_wait.DEFAULT_SPIN_COUNT))
    assert openmp_wait.to_forward() == {}  # the actor's own package init sets it
    assert "GOMP_SPINCOUNT" not in envs.forwarded_to_actors()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert envs.forwarded_to_actors()["OMP_WAIT_POLICY"] == "PASSIVE"
    assert openmp_wait.to_forward() == {
        "GOMP_SPINCOUNT": str(openmp_wait.DEFAULT_SPIN_COUNT), "OMP_WAIT_POLICY": "PASSIVE"}
