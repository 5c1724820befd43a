"""SpeculativeConfig: vLLM's ``speculative_config`` dict, validated and frozen.

Methods:
- ``"ngram"`` (prompt lookup): drafts are the tokens that followed the most recent earlier
  occurrence of the request's last ``n`` tokens (``prompt_lookup_max >= n >=
  prompt_lookup_min``) in its prompt + output.
- ``"draft_model"``: a smaller checkpoint with the target's vocabulary proposes the drafts.
- ``"eagle"`` / ``"eagle3"``: an EAGLE-1 / EAGLE-3 head (its folder in ``model``) drafts
  from the target's hidden states (runner/spec_decode/eagle_proposer.py).
- ``"mtp"``: the target checkpoint's own multi-token-prediction layer (DeepSeek-V3,
  Qwen3-Next) drafts
  the same way; ``model`` defaults to the target's folder.
Pure Python (read by the scheduler and the runner alike).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from raylm.scheduler.config.state_layout import STATE_SPACE_ARCHITECTURES
from raylm.scheduler.config.validation import check_config_dict

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# Methods whose drafts come from a checkpoint (``model``; mtp: the target's by default).
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# Methods that draft from the target's hidden states.
HEAD_METHODS = ("eagle", "eagle3", "mtp")


def _bad(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"speculative_config.{name} {why}, got {value!r}.")


def eagle3_aux_layers(head_hf: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head's ``fc`` reads: its config's
    ``eagle_config.eagle_aux_hidden_state_layer_ids``, else EAGLE-3's usual (2, L/2, L-3).
    Every pipeline stage keeps those among its own layers (docs/architecture.md §24)."""
    eagle_config = head_hf.get("eagle_config") or {}
    aux = tuple(int(i) for i in eagle_config.get(
        "eagle_aux_hidden_state_layer_ids", (2, target_layers // 2, target_layers - 3)))
    if len(aux) != 3 or not all(0 <= i < target_layers for i in aux):
        raise ValueError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids "
                         f"{list(aux)} must be 3 layers of the target's {target_layers}.")
    return aux


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None  # the draft model's or the EAGLE head's folder
    # vLLM's name: no drafts in a step that runs more than this many requests (verifying
    # 1 + k positions per request costs more than it saves once the batch is large).
    disable_by_batch_size: int | None = None
    # A step's fixed cost in units of one position's: a verified draft position in a step
    # of B requests costs B / (B + this) emitted tokens, and a request proposes draft j
    # only while its estimated acceptance p**j pays for it (runner/spec_decode/
    # draft_gate.py). The default suits a CPU step; a GPU step's fixed cost is worth far
    # more positions.
    draft_step_overhead_tokens: float = 24.0

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise _bad("method", self.method, f"must be one of {list(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise _bad("num_speculative_tokens", k, "must be an integer of at least 1")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise _bad("disable_by_batch_size", b, "must be an integer of at least 1")
        c = self.draft_step_overhead_tokens
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0:
            raise _bad("draft_step_overhead_tokens", c, "must be a positive number")
        if self.method == "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise _bad(name, value, "must be an integer of at least 1")
            if self.prompt_lookup_max < self.prompt_lookup_min:
                raise _bad("prompt_lookup_max", self.prompt_lookup_max,
                           f"must be at least prompt_lookup_min={self.prompt_lookup_min}")
            if self.model is not None:
                raise _bad("model", self.model, f"is only for methods {list(MODEL_METHODS)}")
        elif self.model is None and self.method == "mtp":
            pass  # the target's own checkpoint (EngineConfig fills it in)
        elif self.model is None or not os.path.isfile(os.path.join(self.model, "config.json")):
            raise _bad("model", self.model, "must be a folder with a config.json for "
                       f"method {self.method!r}")

    @property
    def reads_target_hidden_states(self) -> bool:
        """An EAGLE or MTP head: its drafts come from the target's hidden states."""
        return self.method in HEAD_METHODS

    @classmethod
    def from_dict(cls, config: dict[str, Any] | SpeculativeConfig | None,
                  target_hf_config: dict[str, Any] | None = None) -> SpeculativeConfig | None:
        """vLLM's dict -> config. Unknown keys are refused by name; a draft model whose
        vocabulary differs from the target's (``target_hf_config``) is refused."""
        if config is None or isinstance(config, SpeculativeConfig):
            spec = config
        else:
            check_config_dict("speculative_config", config, cls,
                              ("method", "num_speculative_tokens"))
            spec = cls(**config)
        if spec is not None and spec.method in MODEL_METHODS and target_hf_config is not None:
            spec.check_draft_vocab(target_hf_config)
        return spec

    def aux_layer_ids(self, target_hf_config: dict[str, Any]) -> tuple[int, ...]:
        """EAGLE-3: the target layers its head reads (``eagle3_aux_layers``); else ()."""
        if self.method != "eagle3" or self.model is None:
            return ()
        with open(os.path.join(self.model, "config.json")) as f:
            return eagle3_aux_layers(json.load(f), int(target_hf_config["num_hidden_layers"]))

    def check_draft_vocab(self, target_hf_config: dict[str, Any]) -> None:
        if self.model is None:  # mtp: the target's own layer
            return
        if "vocab_size" not in target_hf_config:
            return  # a stand-in config (arguments checked without the checkpoint)
        with open(os.path.join(self.model, "config.json")) as f:
            draft = json.load(f)
        if draft.get("vocab_size") != target_hf_config.get("vocab_size"):
            raise _bad("model", self.model,
                       f"has vocab_size={draft.get('vocab_size')}; the target model has "
                       f"{target_hf_config.get('vocab_size')} (they must share a tokenizer)")
        arch = next(iter(draft.get("architectures") or []), "")
        if self.method == "draft_model" and arch in STATE_SPACE_ARCHITECTURES:
            raise _bad("model", self.model,
                       f"is a {arch} (Mamba2 layers); a draft model must be attention-only")
