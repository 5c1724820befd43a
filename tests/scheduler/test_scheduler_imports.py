"""raylm.scheduler is pure Python: importing all of it pulls in no torch, ray or transformers."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import raylm.scheduler


def test_scheduler_imports_no_heavy_frameworks():
    modules = sorted(m.name for m in pkgutil.walk_packages(raylm.scheduler.__path__,
                                                            "raylm.scheduler."))
    assert {"raylm.scheduler.scheduler", "raylm.scheduler.core.engine_core",
            "raylm.scheduler.kv.block_pool"} <= set(modules)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'transformers'))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"raylm.scheduler imported {result.stdout.strip()}"
