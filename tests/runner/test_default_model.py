"""The default model's cache: fetched once (here pre-seeded with a tiny GGUF under the
default model's file name, so nothing is downloaded), converted once, reused; a registry
that cannot be reached gives an error naming the demo fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raylm.runner.loading.default_model import (
    DEFAULT_MODEL_ID,
    ModelFetchError,
    default_model_dir,
    ensure_local_model,
    resolve_default_model,
)
from raylm.runner.loading.gguf_writer import write_gguf_from_hf

# A registry address nothing listens on: pip fails at once with a connection error.
OFFLINE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1"}


@pytest.fixture
def seeded_cache(llama_path, tmp_path) -> str:
    write_gguf_from_hf(llama_path, str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return str(tmp_path)


def test_converted_once_then_reused(seeded_cache, llama_path):
    lines: list[str] = []
    folder = resolve_default_model(seeded_cache, log=lines.append)
    assert folder == default_model_dir(seeded_cache) and len(lines) == 1
    assert "converting" in lines[0]  # the GGUF was there: no fetch line
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder).chat_template == \
        AutoTokenizer.from_pretrained(llama_path).chat_template
    stamp = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert resolve_default_model(seeded_cache, log=lines.append) == folder
    assert len(lines) == 1  # nothing logged, nothing redone
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == stamp


def test_a_rank_on_another_node_resolves_it_itself(seeded_cache):
    folder = default_model_dir(seeded_cache)
    assert not os.path.exists(folder)
    ensure_local_model(folder)  # what model_loader.get_model does before loading
    assert os.path.isfile(os.path.join(folder, "config.json"))
    ensure_local_model("/no/such/other/model")  # not the default model: left to the loader


def test_unreachable_registry_names_the_fallback(tmp_path, monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ModelFetchError, match="registry") as e:
        resolve_default_model(str(tmp_path), log=lambda _: None)
    assert "--model demo-random" in str(e.value) and DEFAULT_MODEL_ID in str(e.value)
    assert not os.path.exists(default_model_dir(str(tmp_path)))  # nothing half-written


def test_cli_uses_the_default_model_and_reports_an_offline_registry(seeded_cache, tmp_path):
    cli = [sys.executable, "-m", "raylm.cluster.cli", "generate", "hello", "--max-tokens", "3"]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "RAYLM_CACHE_DIR": seeded_cache})
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(os.path.join(default_model_dir(seeded_cache), "config.json"))
    r = subprocess.run(cli, capture_output=True, text=True, timeout=240,
                       env={**os.environ, **OFFLINE, "RAYLM_CACHE_DIR": str(tmp_path / "empty")})
    assert r.returncode != 0
    assert "registry" in r.stderr and "--model demo-random" in r.stderr, r.stderr
