"""Write small random-weight Hugging Face checkpoints, for the demo model and the tests.

Everything is made locally: the config and safetensors come from ``transformers``'
own ``save_pretrained``; the tokenizer is a byte-level BPE trained with ``tokenizers``
on a generated corpus. Nothing is downloaded.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Literal

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could people "
    "my than first water been call who oil its now find long down day did get come made may "
    "part ray model token serve engine cluster batch queue step cache block async schedule "
    "river mountain light music garden window paper yellow purple quick brown fox jumps over "
    "lazy dog hello world computer science data value system network memory python torch"
).split()


@dataclass(frozen=True)
class CheckpointSpec:
    architecture: Literal["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                          "MistralForCausalLM", "Qwen3MoeForCausalLM",
                          "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
                          "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                          "BambaForCausalLM", "GraniteMoeHybridForCausalLM",
                          "Qwen3NextForCausalLM", "FalconH1ForCausalLM",
                          "DeepseekV3ForCausalLM"] = "LlamaForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    initializer_range: float = 0.2  # peaky logits: greedy ties between engines stay unlikely
    seed: int = 0
    # Mistral: the window of every layer; Qwen2/Qwen3: the window of the layers from
    # max_window_layers on (use_sliding_window). None: full attention everywhere.
    sliding_window: int | None = None
    max_window_layers: int = 0
    # Mixtures of experts: experts per layer, each token's top k, an expert's intermediate
    # size (Mixtral's is intermediate_size), whether the top k are renormalised (Mixtral's
    # always are)
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()  # Qwen-MoE layers with a dense MLP
    shared_expert_intermediate_size: int = 48  # Qwen2-MoE's shared expert
    # Gemma 3: every this-many-th layer global, the others sliding (sliding_window)
    sliding_window_pattern: int = 6
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2 (and 3): attention scores capped
    # Bamba: its attention layers (the others Mamba2), and the Mamba2 mixers' shape
    attn_layer_indices: tuple[int, ...] = (1,)
    mamba_n_heads: int = 8
    mamba_n_groups: int = 2
    mamba_d_state: int = 16
    mamba_chunk_size: int = 8
    # Granite 4: each layer "mamba" or "attention", experts (num_experts; 0: its shared MLP
    # alone), and any other config.json fields as (name, value) pairs (multipliers,
    # position_embedding_type)
    layer_types: tuple[str, ...] = ("mamba", "attention")
    shared_intermediate_size: int = 48
    # DeepSeek-V3: latent attention's ranks and head dims (q_lora_rank None: a plain q_proj),
    # the first dense layers, expert groups, shared experts; its MoE fields as above
    q_lora_rank: int | None = 48
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 24
    first_k_dense_replace: int = 1
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    config_overrides: tuple[tuple[str, Any], ...] = ()


# Named sizes used by the demo CLI and the benchmarks.
SPECS = {
    "tiny": CheckpointSpec(),
    "6m": CheckpointSpec(vocab_size=4096, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048, initializer_range=0.05),
    "120m": CheckpointSpec(vocab_size=16384, hidden_size=768, intermediate_size=2048,
                           num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                           max_position_embeddings=2048, initializer_range=0.02),
}
# A mixture of experts at the 6m model's width (bench/throughput.py fixedmoe): 16 experts,
# top 2, one dense layer among four.
SPECS["moe"] = CheckpointSpec(architecture="Qwen3MoeForCausalLM", vocab_size=4096,
                              hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                              max_position_embeddings=2048, initializer_range=0.05,
                              num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128,
                              mlp_only_layers=(1,))
# Mixtral's shape at the same width (bench/moe.py): 8 experts of 688, top 2, every layer
# sparse.
SPECS["mixtral"] = CheckpointSpec(architecture="MixtralForCausalLM", vocab_size=4096,
                                  hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=2048, initializer_range=0.05,
                                  num_experts=8, num_experts_per_tok=2)
# DeepSeek-V3's shape at the same width (bench/moe.py): latent attention with DeepSeek's
# own cache row (a latent of 512 and a rotated key of 64 per token: the one head size
# vLLM-CPU's MLA runs), 8 heads, a query rank of 192; 16 experts of 128 in 4 groups, top 2
# from 2 groups, one shared expert, the first layer dense.
SPECS["deepseek"] = CheckpointSpec(
    architecture="DeepseekV3ForCausalLM", vocab_size=4096, hidden_size=256,
    intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
    max_position_embeddings=2048, initializer_range=0.05, num_experts=16,
    num_experts_per_tok=2, moe_intermediate_size=128, q_lora_rank=192, kv_lora_rank=512,
    qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_group=4, topk_group=2,
    # As the hub's config.json says them (vLLM reads the router's bias only with these)
    config_overrides=(("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")))
# GPU benchmarks (bench/gpu_speed.py): Llama-3.2-1B's shape, Llama-3-8B's with 4 layers;
# (hidden, intermediate, layers), with Llama-3's vocabulary and 32 / 8 heads.
for _name, (_hidden, _inter, _layers) in {"1b": (2048, 8192, 16),
                                          "8b-4l": (4096, 14336, 4)}.items():
    SPECS[_name] = CheckpointSpec(vocab_size=128256, hidden_size=_hidden,
                                  intermediate_size=_inter, num_hidden_layers=_layers,
                                  num_attention_heads=32, num_key_value_heads=8,
                                  max_position_embeddings=4096, initializer_range=0.02)


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ":"]))
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_random_checkpoint(path: str, spec: CheckpointSpec = CheckpointSpec()) -> str:
    """Write config.json, model.safetensors and tokenizer files for ``spec`` into ``path``."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, spec.seed)
    kwargs = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if spec.head_dim is not None:
        kwargs["head_dim"] = spec.head_dim
    if spec.rope_scaling is not None:
        kwargs["rope_scaling"] = spec.rope_scaling
    qwen_moe = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")
    if spec.architecture in (*qwen_moe, "OlmoeForCausalLM"):
        kwargs.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                      norm_topk_prob=spec.norm_topk_prob)
    if spec.architecture in qwen_moe:
        kwargs.update(moe_intermediate_size=spec.moe_intermediate_size,
                      mlp_only_layers=list(spec.mlp_only_layers))
    if spec.architecture in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):
        kwargs["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size
    if spec.architecture == "Qwen3NextForCausalLM":
        # Gated delta net layers (every fourth layer attention): 2 key heads of 16, 4
        # value heads of 16 (config_overrides changes them).
        kwargs.update(linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16)
    if spec.architecture == "DeepseekV3ForCausalLM":
        # Every head has its own key and value from the latent (transformers repeats none).
        kwargs.update(num_key_value_heads=spec.num_attention_heads,
                      n_routed_experts=spec.num_experts,
                      num_experts_per_tok=spec.num_experts_per_tok,
                      norm_topk_prob=spec.norm_topk_prob,
                      moe_intermediate_size=spec.moe_intermediate_size,
                      q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                      qk_nope_head_dim=spec.qk_nope_head_dim,
                      qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
                      first_k_dense_replace=spec.first_k_dense_replace, n_group=spec.n_group,
                      topk_group=spec.topk_group, n_shared_experts=spec.n_shared_experts)
    if spec.architecture == "MixtralForCausalLM":
        kwargs.update(num_local_experts=spec.num_experts,
                      num_experts_per_tok=spec.num_experts_per_tok)
    if spec.architecture == "Gemma2ForCausalLM":
        head_dim = spec.head_dim or spec.hidden_size // spec.num_attention_heads
        kwargs.update(sliding_window=spec.sliding_window or 4096,
                      query_pre_attn_scalar=head_dim,
                      final_logit_softcapping=spec.final_logit_softcapping,
                      attn_logit_softcapping=spec.attn_logit_softcapping)
    elif spec.architecture == "Gemma3ForCausalLM":
        kwargs.pop("rope_theta")  # per layer kind: rope_parameters' defaults
        head_dim = spec.head_dim or spec.hidden_size // spec.num_attention_heads
        kwargs.update(sliding_window=spec.sliding_window or 4096,
                      query_pre_attn_scalar=head_dim,
                      final_logit_softcapping=spec.final_logit_softcapping,
                      layer_types=["sliding_attention" if (i + 1) % spec.sliding_window_pattern
                                   else "full_attention" for i in range(spec.num_hidden_layers)])
    elif spec.architecture in ("BambaForCausalLM", "GraniteMoeHybridForCausalLM",
                               "FalconH1ForCausalLM"):
        kwargs.update(mamba_n_heads=spec.mamba_n_heads, mamba_n_groups=spec.mamba_n_groups,
                      mamba_d_state=spec.mamba_d_state, mamba_chunk_size=spec.mamba_chunk_size)
        if spec.architecture == "FalconH1ForCausalLM":
            kwargs["mamba_d_ssm"] = 2 * spec.hidden_size
        if spec.architecture == "BambaForCausalLM":
            kwargs["attn_layer_indices"] = list(spec.attn_layer_indices)
        elif spec.architecture == "GraniteMoeHybridForCausalLM":
            kwargs.update(layer_types=list(spec.layer_types),
                          num_local_experts=spec.num_experts,
                          num_experts_per_tok=spec.num_experts_per_tok,
                          intermediate_size=spec.moe_intermediate_size,
                          shared_intermediate_size=spec.shared_intermediate_size)
    elif spec.architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        kwargs["sliding_window"] = spec.sliding_window
    elif spec.sliding_window is not None:
        if spec.architecture in ("LlamaForCausalLM", "OlmoeForCausalLM"):
            raise ValueError(f"a {spec.architecture} checkpoint has no sliding window.")
        kwargs.update(use_sliding_window=True, sliding_window=spec.sliding_window,
                      max_window_layers=spec.max_window_layers)
    kwargs.update(dict(spec.config_overrides))
    config: transformers.PretrainedConfig
    if spec.architecture == "LlamaForCausalLM":
        config = transformers.LlamaConfig(**kwargs)
    elif spec.architecture == "Qwen2ForCausalLM":
        config = transformers.Qwen2Config(**kwargs)
    elif spec.architecture == "Qwen3ForCausalLM":
        config = transformers.Qwen3Config(**kwargs)
    elif spec.architecture == "MistralForCausalLM":
        config = transformers.MistralConfig(**kwargs)
    elif spec.architecture == "Qwen3MoeForCausalLM":
        config = transformers.Qwen3MoeConfig(**kwargs)
    elif spec.architecture == "Qwen2MoeForCausalLM":
        config = transformers.Qwen2MoeConfig(**kwargs)
    elif spec.architecture == "MixtralForCausalLM":
        config = transformers.MixtralConfig(**kwargs)
    elif spec.architecture == "OlmoeForCausalLM":
        config = transformers.OlmoeConfig(**kwargs)
    elif spec.architecture == "Gemma2ForCausalLM":
        config = transformers.Gemma2Config(**kwargs)
    elif spec.architecture == "Gemma3ForCausalLM":
        config = transformers.Gemma3TextConfig(**kwargs)
    elif spec.architecture == "BambaForCausalLM":
        config = transformers.BambaConfig(**kwargs)
    elif spec.architecture == "GraniteMoeHybridForCausalLM":
        config = transformers.GraniteMoeHybridConfig(**kwargs)
    elif spec.architecture == "Qwen3NextForCausalLM":
        config = transformers.Qwen3NextConfig(**kwargs)
    elif spec.architecture == "FalconH1ForCausalLM":
        config = transformers.FalconH1Config(**kwargs)
    elif spec.architecture == "DeepseekV3ForCausalLM":
        config = transformers.DeepseekV3Config(**kwargs)
    else:
        raise ValueError(f"architecture {spec.architecture!r} cannot be written.")
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.architecture)(config).eval()
    with torch.no_grad():
        # Random biases (Qwen2's qkv) and norm weights, so those code paths are exercised.
        gen = torch.Generator().manual_seed(spec.seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * spec.initializer_range)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: a buffer
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=gen) * spec.initializer_range)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def scale_attention_output(path: str, factor: float,
                           projections: tuple[str, ...] = ("o_proj.weight",)) -> None:
    """Multiply every layer's attention output projection (``o_proj``; a hybrid's Mamba2
    mixers too with ``"out_proj.weight"`` among ``projections``) of the checkpoint at
    ``path`` by ``factor``, in place. A small factor makes the next token depend mostly
    on the current one, so greedy text falls into loops (what prompt lookup predicts);
    attention still contributes, so misplaced KV still changes the tokens."""
    from safetensors.torch import load_file, save_file

    weights_file = os.path.join(path, "model.safetensors")
    weights = load_file(weights_file)
    for name in weights:
        if name.endswith(projections):
            weights[name] = weights[name] * factor
    save_file(weights, weights_file, metadata={"format": "pt"})
