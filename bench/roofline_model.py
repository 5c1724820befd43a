"""The work one engine step of a dense Llama-style decoder must do, per component, and its
roofline: FLOPs and the least bytes moved (every weight, activation and K/V read or
written once), with no torch import so the accounting is testable on its own.

The step: one new request prefilling ``prefill`` tokens (no cached prefix, causal) beside
``decode`` rows that each attend to ``context`` tokens (their own included). A linear of
``rows`` x ``k`` -> ``n`` costs 2*rows*k*n FLOPs and moves its weight, input and output.
Norms, RoPE, the activation and residual adds are left out (few FLOPs; the table shows
their time as the rest of the forward).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPONENTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attention", "lm_head",
              "sampling")
LOGITS_BYTES = 4  # the sampler reads float32 logits whatever the model's dtype


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict) -> ModelShape:
        """From a Hugging Face config.json (head_dim defaults to hidden / heads)."""
        heads = cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"])


@dataclass(frozen=True)
class Step:
    prefill: int  # tokens of the one prefilling request
    decode: int  # rows decoding one token each
    context: int  # tokens each decode row attends to, itself included

    @property
    def tokens(self) -> int:
        return self.prefill + self.decode

    @property
    def sampled(self) -> int:
        """Rows that get logits and a token: every decode row and the prefill's last."""
        return self.decode + (1 if self.prefill else 0)


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOP per byte."""
        return self.flops / self.bytes if self.bytes else 0.0


def gemm_shapes(m: ModelShape, s: Step) -> dict[str, tuple[int, int, int]]:
    """(rows, k, n) of each component's matmul in this step, for measuring the peak at the
    same shape. Attention's is the prefill's Q K^T of one head; in a decode-only step, every
    row's queries of one KV group against ``context`` keys as one matmul (per-row calls of
    one query would measure call overhead, not the machine). Sampling has none."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    t = s.tokens
    attention = ((s.prefill, m.head_dim, s.prefill) if s.prefill else
                 (s.decode * (m.heads // m.kv_heads), m.head_dim, s.context))
    return {"qkv_proj": (t, m.hidden, q + 2 * kv), "o_proj": (t, q, m.hidden),
            "gate_up_proj": (t, m.hidden, 2 * m.intermediate),
            "down_proj": (t, m.intermediate, m.hidden), "attention": attention,
            "lm_head": (s.sampled, m.hidden, m.vocab)}


def linear_work(rows: int, k: int, n: int, elem: int, layers: int = 1) -> Work:
    return Work(2.0 * rows * k * n * layers, float((k * n + rows * k + rows * n) * elem * layers))


def attention_work(m: ModelShape, s: Step, elem: int) -> Work:
    """QK^T and PV (2 FLOPs a multiply-add each, softmax left out) over the causal prefill
    (P(P+1)/2 query-key pairs) and the decode rows (``context`` pairs each); bytes: Q in,
    output out, the new K/V in and written to the cache, and the cached K/V each query
    group reads once (the prefill its own P tokens, each decode row its context)."""
    d, h, hkv = m.head_dim, m.heads, m.kv_heads
    pairs = s.prefill * (s.prefill + 1) // 2 + s.decode * s.context
    flops = 4.0 * d * h * pairs
    kv_read = (s.prefill + s.decode * s.context) * 2 * hkv * d
    elems = s.tokens * 2 * h * d + s.tokens * 2 * 2 * hkv * d + kv_read
    return Work(flops * m.layers, float(elems * elem * m.layers))


def step_work(m: ModelShape, s: Step, elem: int) -> dict[str, Work]:
    """The step's work per component (``elem``: bytes per weight/activation element)."""
    shapes = gemm_shapes(m, s)
    work = {name: linear_work(*shapes[name], elem, m.layers)
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    work["attention"] = attention_work(m, s, elem)
    r = s.sampled
    # The head writes float32 logits (what the sampler reads).
    work["lm_head"] = Work(2.0 * r * m.hidden * m.vocab,
                           float((m.vocab * m.hidden + r * m.hidden) * elem
                                 + r * m.vocab * LOGITS_BYTES))
    # Greedy: one compare per logit, the logits read once, an int64 token out per row.
    work["sampling"] = Work(float(r * m.vocab), float(r * m.vocab * LOGITS_BYTES + r * 8))
    return work


def roofline(work: Work, peak_flops: float | None, bandwidth: float) -> float:
    """Attainable FLOP/s: the GEMM peak or what the memory bandwidth feeds, the lower
    (memory only where there is no matmul)."""
    fed = work.intensity * bandwidth
    return fed if peak_flops is None else min(peak_flops, fed)
