"""Engines built in a loop in one process: ``del llm`` (garbage collection) releases the
worker actors, the placement group and the threads as ``shutdown()`` does, a local Ray
that raylm starts fits a later, larger engine, and interpreter exit releases the last."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_six_engines_in_a_loop_run_to_the_end(llama_path, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["RAY_TMPDIR"] = str(tmp_path)  # its own session folder, removed with the test's
    proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_loop_main.py"),
                           llama_path, "6"], env=env, capture_output=True, text=True,
                          timeout=420)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("engine ")]
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert lines == [f"engine {i} ok; released" for i in range(5)] + [
        "engine 5 ok; left for exit"], proc.stdout
