"""Packaging: each folder imports only as raylm.<folder>, from an installed wheel too."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import venv

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SUBPACKAGES = ["raylm", "raylm.scheduler", "raylm.runner", "raylm.runner.models",
               "raylm.parallel", "raylm.actors", "raylm.cluster"]
FOLDERS = {"scheduler", "runner", "parallel", "actors", "cluster", "api"}
# Who may import whom (docs/architecture.md §1): cluster -> actors -> runner -> parallel; all may
# import scheduler; scheduler imports none of them.
ALLOWED = {
    "scheduler": {"scheduler"},
    "parallel": {"parallel", "scheduler"},
    "runner": {"runner", "parallel", "scheduler"},
    "actors": {"actors", "runner", "parallel", "scheduler"},
    "cluster": {"cluster", "actors", "runner", "parallel", "scheduler"},
}


def _raylm_imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "raylm" and len(parts) > 1:
                found.add(parts[1])
            elif parts[0] in FOLDERS - {"api"}:
                found.add("BARE:" + parts[0])
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_import_direction(layer):
    bad = {}
    for path in (REPO / layer).rglob("*.py"):
        imported = _raylm_imports(path)
        wrong = {i for i in imported if i.startswith("BARE:") or i not in ALLOWED[layer]}
        if wrong:
            bad[str(path.relative_to(REPO))] = sorted(wrong)
    assert not bad, f"imports against the layer order: {bad}"


def test_only_actors_use_ray_remote():
    offenders = [str(p.relative_to(REPO)) for folder in FOLDERS - {"actors"}
                 for p in (REPO / folder).rglob("*.py") if "@ray.remote" in p.read_text()]
    assert offenders == []


def test_runner_and_parallel_never_import_ray():
    offenders = []
    for folder in ("runner", "parallel", "scheduler"):
        for p in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    mods = [node.module]
                if any(m == "ray" or m.startswith("ray.") for m in mods):
                    offenders.append(str(p.relative_to(REPO)))
    assert offenders == []


@pytest.mark.slow
def test_wheel_installs_and_imports_outside_repo(tmp_path):
    wheel_dir = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheel_dir), str(REPO)], check=True)
    wheels = list(wheel_dir.glob("raylm-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = tmp_path / "venv"
    # System site packages provide torch/ray; raylm itself comes only from the wheel.
    venv.create(env_dir, with_pip=True, system_site_packages=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])], check=True)
    code = (
        "import importlib, raylm\n"
        f"mods = {SUBPACKAGES!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "import raylm.scheduler, os\n"
        "assert 'site-packages' in raylm.scheduler.__file__, raylm.scheduler.__file__\n"
        "from raylm import LLM, SamplingParams, __version__\n"
        "print('ok', __version__)\n"
    )
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
