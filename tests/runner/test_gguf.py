"""GGUF checkpoints: config and tokenizer from the metadata, weights dequantized and
unpermuted to Hugging Face names, and the engine equal to transformers on the same file."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.runner.loading.gguf_checkpoint import (
    find_gguf_file,
    iterate_gguf_weights,
    load_gguf_tokenizer,
    read_gguf_config,
)
from raylm.runner.loading.gguf_writer import write_gguf_from_hf


@pytest.fixture(scope="module")
def gguf_path(llama_path, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gguf")
    return write_gguf_from_hf(llama_path, str(folder / "tiny-llama.Q8_0.gguf"), "Q8_0")


def test_config_and_weights_match_the_hf_checkpoint(gguf_path, llama_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = read_gguf_config(gguf_path)
    hf = AutoConfig.from_pretrained(llama_path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "tie_word_embeddings", "eos_token_id", "bos_token_id"):
        assert config[key] == getattr(hf, key), key
    assert config["architectures"] == ["LlamaForCausalLM"]
    ref = load_file(os.path.join(llama_path, "model.safetensors"))
    loaded = dict(iterate_gguf_weights(gguf_path, config))
    assert set(loaded) == set(ref)
    for name, t in loaded.items():
        # Q8_0: one scale per 32 values, so the error is at most half a step of 1/127.
        tol = ref[name].abs().max().item() / 127 + 1e-6
        assert (t - ref[name]).abs().max().item() <= tol, name  # q/k rows back in HF order


def test_a_rank_reads_only_the_tensors_it_wants(gguf_path):
    config = read_gguf_config(gguf_path)
    names = [n for n, _ in iterate_gguf_weights(gguf_path, config,
                                                wanted=lambda n: n.startswith("model.layers.1."))]
    assert names and all(n.startswith("model.layers.1.") for n in names)


def test_tokenizer_and_chat_template_from_the_metadata(gguf_path, llama_path):
    from transformers import AutoTokenizer

    tok, ref = load_gguf_tokenizer(gguf_path), AutoTokenizer.from_pretrained(llama_path)
    text = "Hello world, the quick brown fox 123!"
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.chat_template == ref.chat_template


def test_find_gguf_file(gguf_path, llama_path, tmp_path):
    assert find_gguf_file(gguf_path) == gguf_path
    assert find_gguf_file(os.path.dirname(gguf_path)) == gguf_path  # a folder holding one
    assert find_gguf_file(llama_path) is None  # an HF folder
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_path, tmp_path / name)
    with pytest.raises(ValueError, match=r"2 \.gguf files"):
        find_gguf_file(str(tmp_path))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_llm_on_a_gguf_file_matches_transformers(gguf_path, hf_oracle, async_scheduling):
    # The oracle is transformers loading the same GGUF file (its own dequantization).
    llm = LLM(os.path.dirname(gguf_path), async_scheduling=async_scheduling, block_size=8)
    try:
        prompts = [[5, 17, 99, 260, 3], list(range(3, 40)), [42]]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        oracle = hf_oracle(gguf_path)
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(p, 12)
        chat = llm.chat([{"role": "user", "content": "hello world"}], params)[0]
        assert chat.prompt_token_ids == llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "hello world"}], add_generation_prompt=True,
            tokenize=True, return_dict=True)["input_ids"]
    finally:
        llm.shutdown()


def test_tokenizer_override(gguf_path, llama_path):
    llm = LLM(gguf_path, tokenizer=llama_path)
    try:
        assert llm.get_tokenizer().name_or_path == llama_path
    finally:
        llm.shutdown()


def _write_gguf(path: str, arch: str, qtype: str) -> str:
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    if qtype == "F32":
        w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:  # raw blocks of the named type: 4 rows of one 32-value block each
        qt = gguf.GGMLQuantizationType[qtype]
        size = gguf.GGML_QUANT_SIZES[qt][1]
        w.add_tensor("token_embd.weight", np.zeros((4, size), dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_and_quant_type_are_named(tmp_path):
    with pytest.raises(ValueError, match="'falcon'"):
        read_gguf_config(_write_gguf(str(tmp_path / "f.gguf"), "falcon", "F32"))
    with pytest.raises(ValueError, match="Q8_1"):
        read_gguf_config(_write_gguf(str(tmp_path / "q.gguf"), "llama", "Q8_1"))
    with pytest.raises(ValueError, match="'falcon'"):
        LLM(str(tmp_path / "f.gguf"))


def test_dequantized_weights_keep_the_serving_dtype(gguf_path):
    llm = LLM(gguf_path, dtype="bfloat16", async_scheduling=False, quantization="none")
    try:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        model = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert all(getattr(m, "quantized", None) is None for m in model.modules())
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def gemma3_gguf_path(tmp_path_factory) -> str:
    """A random Gemma 3 (two sliding layers, then a global one) as llama.cpp writes it."""
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    root = tmp_path_factory.mktemp("gemma3-gguf")
    spec = CheckpointSpec(architecture="Gemma3ForCausalLM", num_hidden_layers=3,
                          sliding_window=5, sliding_window_pattern=3, head_dim=16, seed=41)
    hf_dir = write_random_checkpoint(str(root / "hf"), spec)
    os.makedirs(root / "gguf")
    return write_gguf_from_hf(hf_dir, str(root / "gguf" / "tiny-gemma3.Q8_0.gguf"), "Q8_0")


@pytest.mark.parametrize("which", ["llama", "gemma3"])
def test_the_tokenizer_is_the_one_autotokenizer_builds(which, gguf_path, gemma3_gguf_path):
    """Named by the file's model type, the tokenizer is AutoTokenizer's own: same class,
    tokens, special tokens and chat template."""
    from transformers import AutoTokenizer

    path = {"llama": gguf_path, "gemma3": gemma3_gguf_path}[which]
    tok = load_gguf_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert type(tok) is type(ref)
    for text in ("Hello world, the quick brown fox 123!", " leading space\nnew line", ""):
        assert tok(text).input_ids == ref(text).input_ids, text
    assert tok.chat_template == ref.chat_template
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ref.bos_token, ref.eos_token,
                                                            ref.pad_token)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_a_gemma3_gguf_file_matches_transformers_on_it(gemma3_gguf_path, hf_oracle):
    """The norms stored plus one, llama.cpp's norm names, the window from the metadata and
    transformers' Gemma 3 defaults for what the file does not say (every sixth layer global:
    with 3 layers, all three slide)."""
    config = read_gguf_config(gemma3_gguf_path)
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["sliding_window"] == 5
    weights = dict(iterate_gguf_weights(gemma3_gguf_path, config))
    assert "model.layers.0.pre_feedforward_layernorm.weight" in weights
    prompts = [list(range(3, 40)), [42, 7]]
    with LLM(gemma3_gguf_path, block_size=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    oracle = hf_oracle(gemma3_gguf_path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 12)
