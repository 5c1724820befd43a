"""One throw-away virtual environment for the packaging tests, built once per run."""

from __future__ import annotations

import pathlib
import venv

import pytest
from test_layout import see_running_packages


@pytest.fixture(scope="session")
def scratch_venv(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """(its python, its purelib folder): a venv without pip of its own (this interpreter's
    pip installs into it with ``--python``) that sees this interpreter's packages. Each
    test installs raylm into it its own way; pip replaces the previous test's raylm."""
    env_dir = tmp_path_factory.mktemp("packaging") / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    return py, see_running_packages(py)
