"""The demo model: a small random-weight Llama that raylm writes itself on first use."""

from __future__ import annotations

import os

from raylm.runner.loading.checkpoint import SPECS, write_random_checkpoint
from raylm.scheduler.config import envs

DEMO_MODEL_ID = "raylm-demo"
# The names that select the demo model where a model is expected (CLI, Serve config).
DEMO_MODEL_NAMES = ("demo-random", "demo")


def ensure_demo_model(path: str | None = None, size: str = "6m") -> str:
    """Return the demo checkpoint folder, writing it first if it is missing."""
    path = path or envs.demo_model_dir()
    if not os.path.isfile(os.path.join(path, "config.json")):
        if size not in SPECS:
            raise ValueError(f"demo model size {size!r} is unknown; choose one of {list(SPECS)}.")
        tmp = f"{path}.tmp-{os.getpid()}"
        write_random_checkpoint(tmp, SPECS[size])
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            os.rename(tmp, path)  # atomic: concurrent first uses never see half a checkpoint
        except OSError:
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise
    return path
