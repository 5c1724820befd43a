"""A checkpoint's own MTP layer drafting (speculative_config method "mtp"), DeepSeek-V3's and
Qwen3-Next's: transformers' greedy tokens sync and async, and every proposal equal to a
chain computed with transformers' own decoder layer of that model as the MTP block over
the whole history."""

from __future__ import annotations

import random

import pytest
import torch
from eagle_heads import record_drafts

from raylm import LLM, SamplingParams
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.runner.loading.eagle_checkpoint import add_mtp_layer

SPECS = {
    "deepseek-v3": CheckpointSpec(architecture="DeepseekV3ForCausalLM", num_hidden_layers=2,
                                  seed=43),
    # Seven layers (the fourth full attention): the MTP layer, the eighth, is full attention.
    "qwen3-next": CheckpointSpec(architecture="Qwen3NextForCausalLM", num_hidden_layers=7,
                                 head_dim=16, num_experts=4, seed=53),
}
# (fusion norms and linear, final norm) as each model names them
NAMES = {"deepseek-v3": ("model.layers.{L}.", "enorm.weight", "hnorm.weight",
                         "eh_proj.weight", "shared_head.norm.weight"),
         "qwen3-next": ("mtp.", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                        "fc.weight", "norm.weight")}


@pytest.fixture(scope="module", params=list(SPECS))
def mtp_model(request, tmp_path_factory) -> tuple[str, str, str]:
    """(model name, target with its MTP layer, an (L + 1)-layer checkpoint whose layer L is
    the MTP layer's decoder layer)."""
    spec = SPECS[request.param]
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("mtp")), spec)
    return request.param, path, add_mtp_layer(path, spec)


class ReferenceMTP:
    def __init__(self, name: str, path: str, wider: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.name = name
        self.target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.block = AutoModelForCausalLM.from_pretrained(wider, dtype=torch.float32).eval()
        self.layer = SPECS[name].num_hidden_layers
        prefix = NAMES[name][0].format(L=self.layer)
        self.w = {k.removeprefix(prefix): v for k, v in
                  load_file(f"{path}/model.safetensors").items() if k.startswith(prefix)}
        self.eps = self.target.config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = self.w[name] + (1.0 if self.name == "qwen3-next" else 0.0)  # offset norms
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _mtp(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        _, enorm, hnorm, fc, final = NAMES[self.name]
        ids = torch.tensor(tokens)
        embeds = self.target.model.embed_tokens(ids)
        if self.name == "deepseek-v3":
            embeds[0] = 0  # position 0
        x = torch.cat((self._norm(embeds, enorm), self._norm(features, hnorm)),
                      -1) @ self.w[fc].T
        positions = torch.arange(len(tokens))[None]
        rope = self.block.model.rotary_emb(x[None], positions)
        out = self.block.model.layers[self.layer](x[None], attention_mask=None,
                                                  position_ids=positions,
                                                  position_embeddings=rope)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        # Qwen3-Next's next feature is after the final norm, DeepSeek's before it.
        return self._norm(out, final) if self.name == "qwen3-next" else out

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.name == "qwen3-next":
            return self.target.lm_head(out)
        return self._norm(out, NAMES[self.name][4]) @ self.w["shared_head.head.weight"].T

    @torch.inference_mode()
    def drafts(self, history: list[int], k: int) -> list[int]:
        hidden = self.target.model(torch.tensor([history])).last_hidden_state[0]
        tokens, features, drafts = list(history[1:]), hidden[:len(history) - 1], []
        for _ in range(k):
            outs = self._mtp(tokens, features)
            drafts.append(int(self._logits(outs[-1]).argmax()))
            tokens.append(drafts[-1])
            features = torch.cat((features, outs[-1:]), 0)
        return drafts


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mtp_drafts_are_the_layers_chain_and_tokens_equal_transformers(
        mtp_model, hf_oracle, monkeypatch, async_scheduling):
    name, path, wider = mtp_model
    seen = record_drafts(monkeypatch)
    llm = LLM(path, async_scheduling=async_scheduling, block_size=4, max_num_batched_tokens=24,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                  "draft_step_overhead_tokens": 1e6})
    rng = random.Random(1)
    prompts = [[rng.randrange(3, SPECS[name].vocab_size) for _ in range(n)] for n in (7, 29, 13)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    assert llm.get_metrics()["raylm:spec_decode_num_draft_tokens"] > 0
    llm.shutdown()
    oracle = hf_oracle(path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 14)
    reference = ReferenceMTP(name, path, wider)
    assert len(seen) >= 10, len(seen)
    for history, drafts in seen:
        assert drafts == reference.drafts(history, len(drafts)), len(history)


def test_mtp_needs_an_mtp_layer(llama_path):
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        LLM(llama_path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
