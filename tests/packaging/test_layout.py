"""Packaging: each folder imports only as raylm.<folder>, from an installed wheel too."""

from __future__ import annotations

import ast
import pathlib
import site
import subprocess
import sys
import venv

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SUBPACKAGES = ["raylm", "raylm.scheduler", "raylm.scheduler.config", "raylm.scheduler.core",
               "raylm.scheduler.kv", "raylm.scheduler.structured", "raylm.runner",
               "raylm.runner.attention", "raylm.runner.loading", "raylm.runner.models",
               "raylm.runner.sample", "raylm.runner.spec_decode", "raylm.runner.structured",
               "raylm.parallel", "raylm.actors", "raylm.cluster", "raylm.cluster.batch",
               "raylm.cluster.engine", "raylm.cluster.serve"]
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


def _ray_remote_uses(source: str) -> list[int]:
    """Lines that use Ray's remote in any form: `@ray.remote`, `@ray.remote(...)`,
    `ray.remote(cls)`, or a `remote` imported from ray."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr == "remote"
                and isinstance(node.value, ast.Name) and node.value.id == "ray"):
            lines.append(node.lineno)
        elif (isinstance(node, ast.ImportFrom) and node.module == "ray"
              and any(a.name == "remote" for a in node.names)):
            lines.append(node.lineno)
    return lines


def test_ray_remote_detector_sees_calls_and_decorators():
    assert _ray_remote_uses("import ray\n@ray.remote\nclass A: pass\n") == [2]
    assert _ray_remote_uses("import ray\n@ray.remote(num_cpus=1)\nclass A: pass\n") == [2]
    assert _ray_remote_uses("import ray\nclass A: pass\nB = ray.remote(A)\n") == [3]
    assert _ray_remote_uses("import ray\nf = ray.remote(num_cpus=0)(len)\n") == [2]
    assert _ray_remote_uses("from ray import remote\n") == [1]
    assert _ray_remote_uses("import ray\nx = actor.step.remote()\n") == []


def test_only_actors_use_ray_remote():
    offenders = {str(p.relative_to(REPO)): lines for folder in FOLDERS - {"actors"}
                 for p in (REPO / folder).rglob("*.py")
                 if (lines := _ray_remote_uses(p.read_text()))}
    assert offenders == {}


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


def _see_running_packages(py: pathlib.Path) -> None:
    """Let the new environment import this interpreter's packages (torch, ray, ...), whether
    this is a virtualenv or the system interpreter: a .pth file listing our site dirs. Plain
    directory lines, so our own .pth files (an editable raylm among them) are not run, and
    they come after the new environment's site-packages, where the wheel goes."""
    dirs = [d for d in site.getsitepackages() if pathlib.Path(d).is_dir()]
    if site.ENABLE_USER_SITE and pathlib.Path(site.getusersitepackages()).is_dir():
        dirs.append(site.getusersitepackages())
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    (pathlib.Path(purelib) / "_running_interpreter.pth").write_text("\n".join(dirs) + "\n")


@pytest.mark.slow
def test_wheel_installs_and_imports_outside_repo(tmp_path):
    wheel_dir = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "-q", "-w", str(wheel_dir), str(REPO)], check=True)
    wheels = list(wheel_dir.glob("raylm-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    _see_running_packages(py)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])], check=True)
    code = (
        "import importlib, raylm\n"
        f"mods = {SUBPACKAGES!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "import raylm.scheduler, os\n"
        f"assert raylm.scheduler.__file__.startswith({str(env_dir)!r}), raylm.scheduler.__file__\n"
        "from raylm import LLM, SamplingParams, __version__\n"
        "print('ok', __version__)\n"
    )
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
