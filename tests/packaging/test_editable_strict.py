"""Strict editable mode gives tools a real `raylm/` tree (docs/contributing.md).

pyproject.toml maps each top-level folder to `raylm.<folder>` (`package-dir`). A default
editable install resolves that map with an import hook, so nothing named `raylm/scheduler/`
exists on `sys.path` and tools that resolve `raylm.x` by path see nothing. With
`--config-settings editable_mode=strict` setuptools builds a link tree instead. This test
installs raylm that way (no dependencies) into a throw-away environment that sees this
interpreter's packages, then looks for the modules the way such a tool does: a file under
a `sys.path` folder, which must be the repository's own file.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from test_layout import REPO

# raylm module path in the installed tree -> the repository file it must be.
MODULES = {
    "raylm/__init__.py": "api/__init__.py",
    "raylm/scheduler/scheduler.py": "scheduler/scheduler.py",
    "raylm/scheduler/kv/block_pool.py": "scheduler/kv/block_pool.py",
    "raylm/cluster/cli.py": "cluster/cli.py",
}
# Found with the import system's path finder, which runs no package code (importing raylm
# would import torch): what an editor or an import-graph tool does.
FIND = """
import importlib.machinery as m, json, sys
found, path = {}, None
for name in ("raylm", "raylm.scheduler", "raylm.scheduler.scheduler", "raylm.scheduler.kv",
             "raylm.scheduler.kv.block_pool", "raylm.cluster", "raylm.cluster.cli"):
    parent = name.rpartition(".")[0]
    spec = m.PathFinder.find_spec(name, found[parent].submodule_search_locations if parent else None)
    found[name] = spec
print(json.dumps({"sys_path": sys.path,
                  "origins": {k: (v.origin if v else None) for k, v in found.items()}}))
"""


def _can_build_without_isolation() -> bool:
    """This interpreter's setuptools meets pyproject.toml's build requirement (>= 68) and
    builds wheels by itself (>= 70.1, or with `wheel` installed): build with it, offline.
    Otherwise (a fresh Python 3.11 venv has setuptools 65) pip fetches the build
    requirements into an isolated build environment, as a plain install does."""
    def version(name: str) -> tuple[int, ...] | None:
        try:
            return tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version(name))[:2])
        except importlib.metadata.PackageNotFoundError:
            return None

    setuptools = version("setuptools")
    if setuptools is None or setuptools < (68, 0):
        return False
    return setuptools >= (70, 1) or version("wheel") is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_strict_editable_install_links_the_repository_files(tmp_path, scratch_venv):
    py, purelib = scratch_venv
    cmd = [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
           "--config-settings", "editable_mode=strict", "-e", str(REPO)]
    if _can_build_without_isolation():
        cmd.insert(cmd.index("--no-deps"), "--no-build-isolation")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    # Strict mode: a .pth naming the link tree, no import-hook finder.
    hooks = sorted(p.name for p in purelib.glob("__editable__*raylm*finder*.py"))
    assert hooks == [], f"a lenient editable install (import hook): {hooks}"
    pths = list(purelib.glob("__editable__*raylm*.pth"))
    assert len(pths) == 1, sorted(p.name for p in purelib.iterdir())
    tree = pathlib.Path(pths[0].read_text().strip().splitlines()[0])
    assert tree.is_dir(), f"{pths[0].name} names {tree}, which is no folder"

    for installed, source in MODULES.items():
        path = tree / installed
        assert path.is_file(), f"{installed} is not in the link tree {tree}"
        assert path.is_symlink() or path.stat().st_nlink > 1, f"{path} is a copy, not a link"
        assert os.path.samefile(path, REPO / source), f"{path} is not {REPO / source}"

    probe = subprocess.run([str(py), "-c", FIND], capture_output=True, text=True,
                           cwd=tmp_path, timeout=60)
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout)
    assert str(tree) in found["sys_path"], found["sys_path"]
    origins = found["origins"]
    for name, origin in origins.items():
        assert origin is not None, f"{name} is not found by path: {origins}"
        assert pathlib.Path(origin).is_relative_to(tree), f"{name} resolved to {origin}"
    assert os.path.samefile(origins["raylm.scheduler.scheduler"],
                            REPO / "scheduler" / "scheduler.py")
