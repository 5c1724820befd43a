"""Packaging: each folder imports only as raylm.<folder>, from an installed wheel too."""

from __future__ import annotations

import ast
import pathlib
import site
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The map (docs/architecture.md §1): each folder holding modules, and what it holds.
MAP = {
    "api": "public names: LLM, SamplingParams",
    "scheduler": "pure Python: Scheduler, the async ledger, Request, sampling params",
    "scheduler/config": "the frozen engine configs, envs",
    "scheduler/core": "EngineCore, its loops (in process, DP waves), the Executor protocol",
    "scheduler/kv": "KV block pool, prefix hashes, block tables",
    "scheduler/kv_transfer": "KV connectors, scheduler side: offload tier, P/D transfer",
    "scheduler/structured": "structured output: params, grammar compiles, scheduling",
    "runner": "one rank: Worker, ModelRunner, input batch, async output, PP ring",
    "runner/attention": "paged attention: metadata, torch and C++ kernels",
    "runner/loading": "checkpoints: safetensors, GGUF, the default model",
    "runner/kv_transfer": "KV connectors, worker side: host pool, pulls, fault injection",
    "runner/models": "model definitions",
    "runner/quantization": "quantized weights: GGUF blocks, packing, the C++ linear kernel",
    "runner/lora": "LoRA adapters: PEFT files, device slots, host cache, torch and Triton products",
    "runner/sample": "sampler, seeded noise, rejection sampling, prompt logprobs",
    "runner/spec_decode": "speculative decoding: drafters and verification",
    "runner/structured": "grammar backend and bitmasks on the device",
    "parallel": "torch.distributed: groups, sharded layers, PP transport, DP group",
    "actors": "every Ray actor: EngineCore, workers, executor, placement",
    "actors/kv_transfer": "KV between engines over Ray: pulls from a peer's workers, RDT",
    "cluster": "the CLI",
    "cluster/engine": "LLM, LLMEngine, AsyncLLM, input and output processing",
    "cluster/serve": "the OpenAI server on Ray Serve",
    "cluster/serve/openai_api": "OpenAI's request and response shapes, errors, the HTTP routes",
    "cluster/serve/handlers": "the OpenAI handlers over an engine client, LoRA as models",
    "cluster/serve/tools": "tool-call and reasoning parsers",
    "cluster/serve/deployment": "the Serve app, its config, routers, autoscaling, metrics",
    "cluster/serve/pd": "the prefill/decode disaggregated app",
    "cluster/batch": "raylm batch on Ray Data",
}
# Product file names that repeat: each pair is one concept in two layers (a KV connector's
# scheduler and worker sides; prompt logprobs booked by the scheduler, computed by the rank).
SAME_CONCEPT_PAIRS = {
    "base.py": {"scheduler/kv_transfer", "runner/kv_transfer"},
    "factory.py": {"scheduler/kv_transfer", "runner/kv_transfer"},
    "offloading.py": {"scheduler/kv_transfer", "runner/kv_transfer"},
    "ray_pd.py": {"scheduler/kv_transfer", "runner/kv_transfer"},
    "prompt_logprobs.py": {"scheduler", "runner/sample"},
}
ROOTS = {"api": "raylm", "scheduler": "raylm.scheduler", "runner": "raylm.runner",
         "parallel": "raylm.parallel", "actors": "raylm.actors", "cluster": "raylm.cluster"}
SUBPACKAGES = [ROOTS[f.split("/")[0]] + "".join("." + p for p in f.split("/")[1:]) for f in MAP]
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


def test_the_map_is_the_tree():
    """Every folder of modules is in the map, as a package, and the wheel packages it."""
    folders = {str(p.parent.relative_to(REPO)) for f in FOLDERS for p in (REPO / f).rglob("*.py")
               if "csrc" not in p.parts and "__pycache__" not in p.parts}
    assert folders == set(MAP), folders ^ set(MAP)
    assert all((REPO / f / "__init__.py").is_file() for f in MAP)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert all(f'"{pkg}"' in pyproject for pkg in SUBPACKAGES)


def _module_names() -> dict[str, pathlib.Path]:
    mods = {}
    for folder, root in ROOTS.items():
        for p in (REPO / folder).rglob("*.py"):
            parts = [x for x in p.relative_to(REPO / folder).with_suffix("").parts
                     if x != "__init__"]
            mods[".".join([root, *parts])] = p
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports anywhere in its text: at the top, inside
    functions (lazy imports) and under TYPE_CHECKING (read by every annotation tool)."""
    mods = _module_names()
    graph = {}
    for name, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                           else node.module for a in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    return loops


def test_product_file_names_repeat_only_as_listed_pairs():
    folders: dict[str, set[str]] = {}
    for f in FOLDERS:
        for p in (REPO / f).rglob("*.py"):
            if p.name != "__init__.py" and "__pycache__" not in p.parts:
                folders.setdefault(p.name, set()).add(str(p.parent.relative_to(REPO)))
    repeated = {name: where for name, where in folders.items() if len(where) > 1}
    assert repeated == SAME_CONCEPT_PAIRS


def test_loop_finder_sees_a_lazy_loop():
    assert import_loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_loops({"a": {"b"}, "b": set()}) == []


def test_no_import_loop_between_product_modules():
    assert import_loops(import_graph()) == []


def test_only_the_schedulers_users_import_it():
    """Its collaborators (settling a step, structured output, the integrity check) get
    the state they need, not the Scheduler: only what builds, extends or re-exports one
    imports it."""
    importers = {name for name, edges in import_graph().items()
                 if "raylm.scheduler.scheduler" in edges}
    assert importers == {"raylm.scheduler", "raylm.scheduler.async_scheduler",
                         "raylm.scheduler.diffusion_scheduler",
                         "raylm.scheduler.core.engine_core"}


def test_the_engine_client_does_not_import_the_server():
    """cluster/engine (LLM, LLMEngine, AsyncLLM) is what the server is built on: the
    statistics and protocol it needs live beside it, not in cluster/serve."""
    bad = {name: sorted(e for e in edges if e.startswith("raylm.cluster.serve"))
           for name, edges in import_graph().items()
           if name.startswith("raylm.cluster.engine")}
    assert not {name: edges for name, edges in bad.items() if edges}


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


def see_running_packages(py: pathlib.Path) -> pathlib.Path:
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
    return pathlib.Path(purelib)


@pytest.mark.slow
def test_wheel_installs_and_imports_outside_repo(tmp_path, scratch_venv):
    wheel_dir = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "-q", "-w", str(wheel_dir), str(REPO)], check=True)
    wheels = list(wheel_dir.glob("raylm-*.whl"))
    assert len(wheels) == 1, wheels
    py, _ = scratch_venv
    env_dir = py.parent.parent
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", str(wheels[0])], check=True)
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
