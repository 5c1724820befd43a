"""The soak's oracle (bench/soak.py): every finished greedy / seeded request run again by
raylm's offline ``LLM`` on the same checkpoint at TP=1, in this process, after the cluster
is gone; and the one divergence the comparison tolerates, a tie.

Served replicas run TP=2: their logits come from a different float32 reduction order than
the oracle's, so where two tokens' scores are equal to within float32 rounding the two may
pick different ones (seen: a greedy step whose top-2 logprobs TP=2 computes bit-equal, and
TP=1 2e-7 apart). As the project's SmolLM2 test does, such a divergence is tolerated only
when, at the first position where the served text leaves the reference, the reference's
score of its own token and of another token differ by less than TIE (the raw logprob for
greedy; logprob / T plus the request's own Gumbel noise for seeded sampling), and the
served text is exactly what the oracle generates with that other token taken there (the
rest of the request run on from it, a few ties in a row at most). Anything else is a
mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from soak_history import EXACT, Record

TIE = 1e-4
MAX_TIES = 3  # ties one request may cross
TOP = 20  # logprobs asked for when a divergence is examined (the engine's maximum)


@dataclass
class Choice:
    text: str
    finish_reason: str | None
    token_ids: list[int]


def request_params(rec: Record) -> Any:
    """The SamplingParams the server built from the record's body (the protocol's own
    conversion, so the oracle runs the very same request)."""
    from raylm.cluster.serve.openai_api.protocol import CompletionRequest

    return CompletionRequest.model_validate(rec.body).to_sampling_params(rec.body["max_tokens"])


class Oracle:
    def __init__(self, model_path: str, engine_kwargs: dict[str, Any]) -> None:
        from raylm import LLM

        # The served engine's arguments at TP=1, in this process, with room to batch
        # everything at once (raylm's tests hold its tokens independent of the batch).
        self.llm = LLM(model_path, **{
            **engine_kwargs, "tensor_parallel_size": 1, "distributed_executor_backend": None,
            "num_kv_blocks": 4096, "max_num_seqs": 256, "max_num_batched_tokens": 8192})
        self.tok = self.llm.get_tokenizer()
        self.vocab_keys = None

    def close(self) -> None:
        self.llm.shutdown()

    def run(self, records: list[Record]) -> dict[int, dict[int, Choice]]:
        """Record id -> choice index -> the reference, for every record of an exact kind
        that received any text. Identical requests run once."""
        keys: dict[str, tuple[list[int], Any]] = {}
        by_record: dict[int, str] = {}
        for r in records:
            if r.kind not in EXACT or not any(r.texts.values()):
                continue
            body = {k: v for k, v in r.body.items() if k not in ("stream", "stream_options")}
            key = json.dumps(body, sort_keys=True)
            keys.setdefault(key, (r.body["prompt"], request_params(r)))
            by_record[r.id] = key
        if not keys:
            return {}
        order = list(keys)
        outs = self.llm.generate([keys[k][0] for k in order], [keys[k][1] for k in order],
                                 use_tqdm=False)
        got = {k: {c.index: Choice(c.text, c.finish_reason, list(c.token_ids))
                   for c in o.outputs} for k, o in zip(order, outs, strict=True)}
        return {rid: got[key] for rid, key in by_record.items()}

    # ---- ties ---------------------------------------------------------------------------

    def explain(self, rec: Record, index: int, ref: Choice, partial: bool = False
                ) -> str | None:
        """How the served text of choice ``index`` follows from the reference through ties
        (None: it does not; a mismatch). ``partial``: the stream did not finish (cut, or
        ended by an error), so its text need only start the tie's run."""
        served = rec.texts.get(index, "")
        params = request_params(rec).clone(n=1)
        prompt = list(rec.body["prompt"])
        ids, text = ref.token_ids, ref.text
        if self._decode(ids) != text:
            return None  # the text is not the plain decode of its ids: no way to tell
        ties = []
        for _ in range(MAX_TIES):
            tie = self._one_tie(prompt, params, ids, text, served)
            if tie is None:
                return None
            at, alt, gap, ids, text, finish = tie
            ties.append(f"position {at}: token {alt} within {gap:.1e} of the reference's")
            if (text.startswith(served) if partial
                    else text == served and finish == rec.finish.get(index)):
                return "; ".join(ties)
        return None

    def _one_tie(self, prompt: list[int], params: Any, ids: list[int], text: str,
                 served: str):
        """The first position where ``served`` leaves ``text`` (``ids``' decode), if a tie
        there leads closer to it: (position, the other token, the gap, the token ids,
        text and finish reason of the run that takes it)."""
        agree = _common(text, served)
        k = 0
        while k < len(ids) and len(self._decode(ids[:k + 1])) <= agree:
            k += 1
        best = None
        # A token ending inside a UTF-8 character decodes to U+FFFD, which the served text
        # may show for another token: the divergence may sit a little before k.
        for at in range(min(k, len(ids) - 1), max(-1, k - 3), -1):
            scores = self._scores(prompt, params, ids[:at])
            own = scores.get(ids[at])
            if own is None:
                continue
            for alt, score in scores.items():
                if alt == ids[at] or abs(own - score) >= TIE:
                    continue
                run_ids, finish = self._run_on(prompt, params, ids[:at] + [alt])
                run_text = self._decode(run_ids)
                cut = min((i for i in (run_text.find(s) for s in params.stop) if i >= 0),
                          default=-1)
                if cut >= 0:
                    run_text, finish = run_text[:cut], "stop"
                if _common(run_text, served) > agree and (
                        best is None or _common(run_text, served) > _common(best[4], served)):
                    best = (at, alt, abs(own - score), run_ids, run_text, finish)
        return best

    def _scores(self, prompt: list[int], params: Any, head: list[int]) -> dict[int, float]:
        """What the sampler compared at the position after ``head``: raw logprobs (greedy)
        or logprob / T plus the request's Gumbel noise (seeded), for the top TOP tokens."""
        from raylm import SamplingParams

        probe = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=TOP)
        (out,) = self.llm.generate([prompt + head], probe, use_tqdm=False)
        lps = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
        if params.temperature == 0:
            return lps
        import torch

        from raylm.runner.sample import rng

        vocab = self.llm.llm_engine.model_config.vocab_size
        if self.vocab_keys is None:
            self.vocab_keys = rng.vocab_keys(vocab, torch.device("cpu"))
        keys = rng.row_keys(torch.tensor([rng.to_int64_seed(params.seed)]),
                            torch.tensor([len(prompt) + len(head)]))
        noise = rng.gumbel_noise(keys, self.vocab_keys)[0]
        return {t: lp / params.temperature + float(noise[t]) for t, lp in lps.items()
                if t < vocab}

    def _run_on(self, prompt: list[int], params: Any, head: list[int]
                ) -> tuple[list[int], str | None]:
        """``head`` then what the request generates after it (same params, same positions,
        so the same seeded noise): all its output ids and the finish reason."""
        left = params.max_tokens - len(head)
        if left <= 0:
            return head, "length"
        rest = params.clone(max_tokens=left, stop=[], logprobs=None)
        (out,) = self.llm.generate([prompt + head], rest, use_tqdm=False)
        return head + list(out.outputs[0].token_ids), out.outputs[0].finish_reason

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _common(a: str, b: str) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
