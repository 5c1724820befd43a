"""Engines built in a loop in one process: ``del llm`` (garbage collection) releases the
worker actors, the placement group and the threads as ``shutdown()`` does, a local Ray
that raylm starts fits a later, larger engine, and interpreter exit releases the last."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
@pytest.mark.ray  # raylm starts a Ray of its own in the subprocess
def test_five_engines_in_a_loop_run_to_the_end(llama_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    # Its own Ray session folder; short, as Ray's unix socket paths must be.
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rll", dir="/tmp")
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_loop_main.py"),
                               llama_path, "5"], env=env, capture_output=True, text=True,
                              timeout=420)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("engine ")]
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    # Engine 3, the larger one, is released too; engine 4 is left for exit.
    assert lines == [f"engine {i} ok; released" for i in range(4)] + [
        "engine 4 ok; left for exit"], proc.stdout
