"""Shared fixtures: small random-weight checkpoints written on the fly (nothing downloaded)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

# The equality tests are defined in float32: dtype="auto" would run these float32
# checkpoints in bfloat16 on a CPU with native bf16. Set before any engine (or Ray worker,
# which inherits the environment) starts; the bf16 tests ask for bfloat16 explicitly.
os.environ.setdefault("RAYLM_CPU_AUTO_BFLOAT16", "0")

from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint


def _write(tmp_path_factory, name: str, spec: CheckpointSpec) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp(name)), spec)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> str:
    """Llama with GQA (4 query heads, 2 KV heads), untied embeddings."""
    return _write(tmp_path_factory, "llama", CheckpointSpec())


@pytest.fixture(scope="session")
def llama_mha_tied_path(tmp_path_factory) -> str:
    """Llama with MHA and tied embeddings, and linear rope scaling."""
    spec = CheckpointSpec(num_key_value_heads=4, tie_word_embeddings=True,
                          rope_scaling={"rope_type": "linear", "factor": 2.0}, seed=1)
    return _write(tmp_path_factory, "llama_mha_tied", spec)


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory) -> str:
    """Qwen2: biases on q/k/v projections."""
    return _write(tmp_path_factory, "qwen2", CheckpointSpec(architecture="Qwen2ForCausalLM", seed=2))


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory) -> str:
    """Qwen3: per-head RMSNorm on q and k, explicit head_dim, tied embeddings."""
    spec = CheckpointSpec(architecture="Qwen3ForCausalLM", head_dim=32, tie_word_embeddings=True, seed=3)
    return _write(tmp_path_factory, "qwen3", spec)


@pytest.fixture(scope="session")
def loopy_llama_path(tmp_path_factory) -> str:
    """A random Llama whose attention output is scaled down 250x: its next token depends
    mostly on the current one, so greedy text falls into loops that prompt lookup predicts
    (speculative decoding tests: a plain random model almost never repeats, so nearly
    every draft would be rejected). Attention still contributes, so misplaced KV still
    changes the tokens."""
    from raylm.runner.loading.checkpoint import scale_attention_output

    path = _write(tmp_path_factory, "loopy_llama", CheckpointSpec(seed=6))
    scale_attention_output(path, 0.004)
    return path


@pytest.fixture(scope="session")
def loopy_draft_path(tmp_path_factory) -> str:
    """A draft model for ``loopy_llama_path``: the same weights with attention scaled down
    5x less, so it proposes what the target would often but not always (speculative
    decoding tests: partial acceptance, rollbacks)."""
    from raylm.runner.loading.checkpoint import scale_attention_output

    path = _write(tmp_path_factory, "loopy_draft", CheckpointSpec(seed=6))
    scale_attention_output(path, 0.02)
    return path


@pytest.fixture(scope="session", params=["llama", "llama_mha_tied", "qwen2", "qwen3"])
def any_model_path(request) -> str:
    return request.getfixturevalue(f"{request.param}_path")


class HFOracle:
    """Hugging Face ``generate`` (greedy) and logits: the correctness reference."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        kwargs = {}
        if path.endswith(".gguf"):  # transformers dequantizes GGUF files itself
            path, kwargs["gguf_file"] = os.path.split(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          **kwargs).eval()
        self.eos = self.model.generation_config.eos_token_id

    def greedy(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
        torch = self.torch
        self.model.generation_config.eos_token_id = None if ignore_eos else self.eos
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=0)
        self.model.generation_config.eos_token_id = self.eos
        return out[0, len(prompt_ids):].tolist()

    def last_hidden_states(self, token_ids: list[int]) -> object:
        """The decoder's final-norm hidden states at every position ([T, hidden])."""
        with self.torch.inference_mode():
            return self.model.model(self.torch.tensor([token_ids])).last_hidden_state[0]

    def logprobs(self, token_ids: list[int]) -> object:
        """log_softmax of the logits at every position of ``token_ids`` ([T, vocab])."""
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="session")
def hf_oracle():
    """hf_oracle(path) -> HFOracle, cached per checkpoint for the session."""
    oracles: dict[str, HFOracle] = {}

    def get(path: str) -> HFOracle:
        if path not in oracles:
            oracles[path] = HFOracle(path)
        return oracles[path]

    return get


# ---- LoRA: random PEFT adapters for the tiny Llama, and transformers + PEFT as oracle ----
# (rank, lora_alpha, use_rslora, target modules): four ranks, rsLoRA, attention only, MLP only.
LORA_SPECS = [
    (8, 16, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj")),
    (4, 8, True, ("q_proj", "v_proj")),
    (16, 8, False, ("o_proj", "gate_proj", "up_proj", "down_proj")),
    (2, 4, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj")),
]


@pytest.fixture(scope="session")
def lora_adapters(llama_path, tmp_path_factory) -> list[str]:
    """Four PEFT adapter folders for ``llama_path`` (LORA_SPECS)."""
    from raylm.runner.lora.random_adapter import write_random_adapter

    root = tmp_path_factory.mktemp("lora")
    return [write_random_adapter(str(root / f"adapter{i}"), llama_path, r, alpha,
                                 targets, use_rslora=rslora, seed=10 + i)
            for i, (r, alpha, rslora, targets) in enumerate(LORA_SPECS)]


class PeftOracle:
    """transformers + PEFT greedy generate, the adapter applied unmerged (None: the base
    model alone); results cached per (adapter, prompt, length)."""

    def __init__(self, base_path: str) -> None:
        self.base_path = base_path
        self._models: dict[str | None, object] = {}
        self._cache: dict[tuple, list[int]] = {}

    def _model(self, adapter: str | None):
        if adapter not in self._models:
            import torch
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=torch.float32)
            model.generation_config.eos_token_id = None  # ignore_eos
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapter)  # unmerged
            self._models[adapter] = model.eval()
        return self._models[adapter]

    def greedy(self, adapter: str | None, prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (adapter, tuple(prompt_ids), max_tokens)
        if key not in self._cache:
            import torch

            with torch.inference_mode():
                out = self._model(adapter).generate(
                    torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                    pad_token_id=0)
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]


@pytest.fixture(scope="session")
def peft_oracle(llama_path) -> PeftOracle:
    return PeftOracle(llama_path)


@pytest.fixture
def moto_s3(monkeypatch):
    """A moto S3 server on loopback; the AWS variables the driver's pyarrow reads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "moto did not start"
                time.sleep(0.1)
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        import boto3

        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="raylm-test")
        yield s3
    finally:
        proc.kill()
        proc.wait()
