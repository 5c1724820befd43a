"""Train an EAGLE-3 head for the default model (SmolLM2-135M-Instruct) on CPU in minutes.

    python bench/train_eagle.py [--minutes 16] [--prompts 960] [--max-tokens 128]
        [--draft-vocab 4096] [--ttt-steps 3] [--out ~/.cache/raylm/eagle3-smollm2]

1. Instructions from templates and word lists (bench/eagle_data.py), chat-templated; the
   target's greedy answers from raylm's offline ``LLM``.
2. transformers (float32, no grad): the inputs of target layers (2, L/2, L-3) and the top 8
   of the target's next-token distribution at every position.
3. The head (runner/models/eagle_head.py's EAGLE-3 layout, tests/eagle_heads.py's math):
   pair (token p+1, feature p) at position p -> one layer -> ``lm_head(norm(out))`` over a
   draft vocabulary of the ``--draft-vocab`` most frequent tokens of the answers. The loss
   is the cross entropy against the target's distribution (its top 8 inside the draft
   vocabulary, renormalised) at the positions whose next token the target generated.
   Training-time test: ``--ttt-steps`` unrolled steps, step j feeding the head's own
   step j-1 output as the feature (at position p+j, attending to step 0's keys up to p and
   its own chain's), as the engine drafts; step j's loss weighs 0.8^j. Adam, cosine decay,
   for ``--minutes``. The embedding is the target's (frozen, not saved); ``lm_head`` and
   ``norm`` start from the target's (tied) LM head rows and final norm.
4. Saves the head (model.safetensors + config.json, and training.json naming the
   instructions it was trained on, which bench/spec_decode.py leaves out) to ``--out``
   and prints the
   ``speculative_config`` to use; reports held-out top-1 agreement with the target per
   step, then checks through raylm: greedy tokens equal with speculation off, and the
   engine's mean acceptance length (1 + accepted / drafts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eagle_data  # noqa: E402

DEFAULT_OUT = os.path.expanduser("~/.cache/raylm/eagle3-smollm2")
STEP_DECAY = 0.8  # weight of TTT step j's loss: STEP_DECAY ** j


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Eagle3Head(nn.Module):
    """EAGLE-3's head with the checkpoint's parameter names (``fc``, ``midlayer.*``,
    ``norm``, ``lm_head``). ``embed`` (the target's) is a frozen tensor, not a parameter."""

    def __init__(self, target_cfg: dict, embed: torch.Tensor, draft_vocab: int) -> None:
        super().__init__()
        H = target_cfg["hidden_size"]
        self.heads = target_cfg["num_attention_heads"]
        self.kv_heads = target_cfg.get("num_key_value_heads", self.heads)
        self.head_dim = target_cfg.get("head_dim") or H // self.heads
        inter, eps = target_cfg["intermediate_size"], target_cfg.get("rms_norm_eps", 1e-6)
        self.theta = float(target_cfg.get("rope_theta", 10000.0))
        self.embed = embed
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm = RMSNorm(H, eps), RMSNorm(H, eps)
        m.post_attention_layernorm = RMSNorm(H, eps)
        m.self_attn = nn.Module()
        m.self_attn.q_proj = nn.Linear(2 * H, self.heads * self.head_dim, bias=False)
        m.self_attn.k_proj = nn.Linear(2 * H, self.kv_heads * self.head_dim, bias=False)
        m.self_attn.v_proj = nn.Linear(2 * H, self.kv_heads * self.head_dim, bias=False)
        m.self_attn.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj = nn.Linear(H, inter, bias=False)
        m.mlp.up_proj = nn.Linear(H, inter, bias=False)
        m.mlp.down_proj = nn.Linear(inter, H, bias=False)
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        for p in self.parameters():  # small random start; norms at one
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        with torch.no_grad():  # the feature starts as the highest aux layer's input
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * H:] = torch.eye(H)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = positions.float()[:, None] * inv[None]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def _qkv(self, tokens: torch.Tensor, feature: torch.Tensor, offset: int):
        m, (B, T) = self.midlayer, tokens.shape
        x = torch.cat((m.input_layernorm(F.embedding(tokens, self.embed)),
                       m.hidden_norm(feature)), dim=-1)
        q = m.self_attn.q_proj(x).view(B, T, self.heads, -1).transpose(1, 2)
        k = m.self_attn.k_proj(x).view(B, T, self.kv_heads, -1).transpose(1, 2)
        v = m.self_attn.v_proj(x).view(B, T, self.kv_heads, -1).transpose(1, 2)
        cos, sin = self.rope(torch.arange(T) + offset)
        rep = self.heads // self.kv_heads
        return (_rotate(q, cos, sin), _rotate(k, cos, sin).repeat_interleave(rep, 1),
                v.repeat_interleave(rep, 1))

    def _finish(self, attn: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        m, (B, _, T, _) = self.midlayer, attn.shape
        h = feature + m.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        x = m.post_attention_layernorm(h)
        return h + m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))

    def unrolled(self, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The head's outputs for ``steps`` chained steps from every anchor p of ``ids``
        [B, T] (aux [B, T, 3H]): step j's row p is the pair (ids[p+j+1], step j-1's output
        at p; step 0: fc(aux[p])) at position p+j, attending to step 0's keys at positions
        <= p and steps 1..j's of its own chain: the engine's k drafts after position p."""
        B, T = ids.shape
        scale = 1.0 / math.sqrt(self.head_dim)
        padded = F.pad(ids, (0, steps))
        feature = self.fc(aux)
        outs: list[torch.Tensor] = []
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for j in range(steps):
            q, k, v = self._qkv(padded[:, j + 1:j + 1 + T], feature, j)
            if j == 0:
                k0, v0 = k, v
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                chain.append((k, v))
                scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, -torch.inf)]
                scores += [(q * kc).sum(-1, keepdim=True) * scale for kc, _ in chain]
                probs = torch.cat(scores, dim=-1).softmax(-1)
                attn = probs[..., :T] @ v0
                for i, (_, vc) in enumerate(chain):
                    attn = attn + probs[..., T + i:T + i + 1] * vc
            feature = self._finish(attn, feature)
            outs.append(feature)
        return outs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))


class DraftVocab:
    """The ``size`` most frequent target tokens of ``counts``, sorted by id: d2t and t2d."""

    def __init__(self, counts: Counter, size: int, vocab: int) -> None:
        chosen = sorted(t for t, _ in counts.most_common(size))
        self.ids = torch.tensor(chosen, dtype=torch.long)  # draft id -> target id
        self.to_draft = torch.full((vocab,), -1, dtype=torch.long)
        self.to_draft[self.ids] = torch.arange(len(chosen))
        self.d2t = self.ids - torch.arange(len(chosen))
        self.t2d = self.to_draft >= 0


def make_batches(seqs: list[eagle_data.Sequence], batch_tokens: int, steps: int,
                 vocab: DraftVocab, shuffle: random.Random | None = None) -> list[dict]:
    """Padded batches of similar lengths, with each step's soft labels and loss mask."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i].ids) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    if shuffle is not None:
        shuffle.shuffle(groups)
    batches = []
    for group in groups:
        T = max(len(seqs[i].ids) for i in group)
        K, H3 = seqs[group[0]].top_ids.shape[1], seqs[group[0]].aux.shape[1]
        ids = torch.zeros(len(group), T, dtype=torch.long)
        aux = torch.zeros(len(group), T, H3)
        top = torch.zeros(len(group), T, K, dtype=torch.long)
        prob = torch.zeros(len(group), T, K)
        lens, plens = torch.zeros(len(group), 1), torch.zeros(len(group), 1)
        for b, i in enumerate(group):
            s, n = seqs[i], len(seqs[i].ids)
            ids[b, :n], aux[b, :n], top[b, :n], prob[b, :n] = s.ids, s.aux, s.top_ids, s.top_probs
            lens[b], plens[b] = n, s.prompt_len
        labels = []
        p = torch.arange(T)[None]
        for j in range(steps):
            # step j at anchor p predicts the token after position p+j+1, from the
            # target's distribution there; only where the target generated that token
            t = p + j + 1
            mask = (t <= lens - 1) & (t >= plens)
            at = t.clamp(max=T - 1).expand(len(group), T)
            tid = top.gather(1, at[..., None].expand(-1, -1, K))
            tp = prob.gather(1, at[..., None].expand(-1, -1, K))
            did = vocab.to_draft[tid]
            tp = torch.where(did >= 0, tp, 0.0)
            mask &= tp.sum(-1) > 0
            tp = tp / tp.sum(-1, keepdim=True).clamp(min=1e-9)
            labels.append((did.clamp(min=0), tp, tid[..., 0], mask))
        batches.append({"ids": ids, "aux": aux, "labels": labels})
    return batches


def batch_loss(head: Eagle3Head, batch: dict, vocab: DraftVocab, steps: int):
    """(weighted loss, per-step (correct top-1, counted positions))."""
    outs = head.unrolled(batch["ids"], batch["aux"], steps)
    loss, stats = 0.0, []
    for j, (out, (did, tp, target_top, mask)) in enumerate(zip(outs, batch["labels"],
                                                                strict=True)):
        logp = head.logits(out).log_softmax(-1)
        ce = -(logp.gather(-1, did) * tp).sum(-1)
        n = mask.sum().clamp(min=1)
        loss = loss + STEP_DECAY ** j * (ce * mask).sum() / n
        drafted = vocab.ids[logp.argmax(-1)]
        stats.append((int(((drafted == target_top) & mask).sum()), int(mask.sum())))
    return loss, stats


@torch.no_grad()
def evaluate(head: Eagle3Head, batches: list[dict], vocab: DraftVocab, steps: int
             ) -> list[float]:
    """Top-1 agreement with the target per step (step j: the earlier ones right)."""
    totals = [[0, 0] for _ in range(steps)]
    for batch in batches:
        for j, (c, n) in enumerate(batch_loss(head, batch, vocab, steps)[1]):
            totals[j][0] += c
            totals[j][1] += n
    return [c / max(n, 1) for c, n in totals]


def train(head: Eagle3Head, batches: list[dict], vocab: DraftVocab, steps: int,
          seconds: float, lr: float = 1e-3, log=print) -> int:
    """Adam with a short warm-up and cosine decay over the time budget; returns the
    number of updates."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    start, updates, epoch = time.monotonic(), 0, 0
    rng = random.Random(0)
    while True:
        rng.shuffle(batches)
        for batch in batches:
            frac = (time.monotonic() - start) / seconds
            if frac >= 1.0:
                return updates
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (updates + 1) / 20) * (0.55 + 0.45 * math.cos(
                    math.pi * frac))
            loss, stats = batch_loss(head, batch, vocab, steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            updates += 1
            if updates % 25 == 0:
                acc = " ".join(f"{c / max(n, 1):.2f}" for c, n in stats)
                log(f"  update {updates} epoch {epoch} {time.monotonic() - start:.0f}s "
                    f"loss {loss.item():.3f} top-1 per step {acc}")
        epoch += 1


def save_head(head: Eagle3Head, vocab: DraftVocab, target_cfg: dict, aux_layers: list[int],
              out: str) -> str:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    tensors["d2t"] = vocab.d2t.clone()
    tensors["t2d"] = vocab.t2d.clone()
    config = dict(target_cfg, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                  draft_vocab_size=len(vocab.ids), tie_word_embeddings=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layers)})
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out


def build_head(path: str, target_cfg: dict, vocab: DraftVocab) -> Eagle3Head:
    """A fresh head, its embedding the target's, ``lm_head``/``norm`` from the target's."""
    from safetensors.torch import load_file

    w = load_file(os.path.join(path, "model.safetensors"))
    embed = w["model.embed_tokens.weight"].float()
    head = Eagle3Head(target_cfg, embed, len(vocab.ids))
    with torch.no_grad():
        head.lm_head.weight.copy_(w.get("lm_head.weight", embed)[vocab.ids])
        head.norm.weight.copy_(w["model.norm.weight"])
    return head


def raylm_check(path: str, head_dir: str, prompts: list[list[int]], max_tokens: int,
                k: int, **engine_args) -> tuple[bool, float, int]:
    """Greedy outputs with the head equal those with speculation off; the engine's mean
    acceptance length 1 + accepted / drafts, and its number of drafts."""
    outs_off = eagle_data.generate(path, prompts, max_tokens, ignore_eos=True, **engine_args)
    from raylm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    spec = {"method": "eagle3", "model": head_dir, "num_speculative_tokens": k}
    with LLM(path, max_num_seqs=len(prompts), speculative_config=spec, **engine_args) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        m = llm.get_metrics()
    drafts = m.get("raylm:spec_decode_num_drafts", 0)
    accept_len = 1 + m["raylm:spec_decode_num_accepted_tokens"] / drafts if drafts else 1.0
    equal = [list(o.outputs[0].token_ids) for o in outs] == outs_off
    return equal, accept_len, int(drafts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target folder (default: SmolLM2)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--minutes", type=float, default=16.0, help="training time")
    ap.add_argument("--prompts", type=int, default=960, help="training instructions")
    ap.add_argument("--held-out", type=int, default=32, help="held-out instructions")
    ap.add_argument("--max-tokens", type=int, default=128, help="answer length cap")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--ttt-steps", type=int, default=3, help="unrolled steps (1: step 0)")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens to check with")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-cache", default=None,
                    help="a folder to keep the generated data and features in (reused by "
                         "a later run with the same --prompts/--held-out/--max-tokens/--seed)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    from raylm.runner.loading.default_model import resolve_default_model
    from raylm.runner.loading.eagle_checkpoint import aux_layer_ids

    path = args.model or resolve_default_model()
    with open(os.path.join(path, "config.json")) as f:
        target_cfg = json.load(f)
    aux_layers = aux_layer_ids(target_cfg["num_hidden_layers"])
    t0 = time.monotonic()
    key = f"p{args.prompts}-h{args.held_out}-t{args.max_tokens}-s{args.seed}"
    cache = os.path.join(args.data_cache, f"{key}.pt") if args.data_cache else None
    if cache and os.path.isfile(cache):
        prompts, outputs, seqs = torch.load(cache, weights_only=False)
        print(f"data from {cache}", flush=True)
    else:
        train_text = eagle_data.make_instructions(args.prompts, args.seed)
        held_text = eagle_data.make_instructions(args.held_out, args.seed + 1,
                                                 set(train_text))
        prompts = eagle_data.chat_prompts(path, train_text + held_text)
        outputs = eagle_data.generate(path, prompts, args.max_tokens)
        print(f"generated {sum(len(o) for o in outputs)} tokens for {len(prompts)} prompts "
              f"({sum(len(p) for p in prompts)} prompt tokens) in "
              f"{time.monotonic() - t0:.0f}s", flush=True)
        t1 = time.monotonic()
        seqs = eagle_data.target_features(path, prompts, outputs, aux_layers)
        print(f"target features (aux layers {aux_layers}) in {time.monotonic() - t1:.0f}s",
              flush=True)
        if cache:
            os.makedirs(args.data_cache, exist_ok=True)
            torch.save((prompts, outputs, seqs), cache)
    n_gen = sum(len(o) for o in outputs)
    train_seqs, held_seqs = seqs[:args.prompts], seqs[args.prompts:]
    counts = Counter(t for o in outputs[:args.prompts] for t in o)
    vocab = DraftVocab(counts, args.draft_vocab, target_cfg["vocab_size"])
    held_gen = [t for o in outputs[args.prompts:] for t in o]
    cover = sum(bool(vocab.t2d[t]) for t in held_gen) / max(len(held_gen), 1)
    print(f"draft vocabulary {len(vocab.ids)} tokens ({len(counts)} distinct in the "
          f"training answers; covers {cover:.1%} of held-out answer tokens)", flush=True)
    head = build_head(path, target_cfg, vocab)
    batches = make_batches(train_seqs, args.batch_tokens, args.ttt_steps, vocab)
    held = make_batches(held_seqs, args.batch_tokens, args.ttt_steps, vocab)
    t2 = time.monotonic()
    updates = train(head, batches, vocab, args.ttt_steps, args.minutes * 60, args.lr)
    train_s = time.monotonic() - t2
    acc = evaluate(head, held, vocab, args.ttt_steps)
    print(f"trained {updates} updates in {train_s:.0f}s on {n_gen - len(held_gen)} answer "
          f"tokens ({len(train_seqs)} sequences); held-out top-1 per step "
          + " ".join(f"{a:.3f}" for a in acc), flush=True)
    out = save_head(head, vocab, target_cfg, aux_layers, args.out)
    eagle_data.write_training_record(out, args.prompts, args.seed)
    spec = {"method": "eagle3", "model": out, "num_speculative_tokens": args.k}
    print(f"head saved to {out}\nspeculative_config={json.dumps(spec)}", flush=True)
    check = prompts[args.prompts:][:8]
    equal, accept_len, drafts = raylm_check(path, out, check, 64, args.k)
    print(f"raylm check ({len(check)} held-out prompts, 64 tokens, k={args.k}): greedy "
          f"tokens equal to speculation off: {equal}; mean acceptance length "
          f"{accept_len:.2f} over {drafts} drafts", flush=True)
    print(f"total {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
