"""The soak's checks (bench/soak.py), each a PASS/FAIL line with its numbers and, when it
fails, the history lines that show why.

- hung: every request ended (finished, error, cut by its client) within the deadline;
- exact: every finished greedy / seeded / stop / n=2 / logprobs request has exactly the text
  and finish reason the offline reference gives for the same request (bench/
  soak_reference.py: raylm's ``LLM`` on the same checkpoint at TP=1), so the streamed
  chunks joined lost or repeated nothing; a stream cut by its client or ended by an error
  holds a prefix of the reference; a divergence at a float32 tie of the TP=2 replicas'
  scores is listed apart (ties), and only when the rest follows the tie exactly;
- well-formed: structured output that finished ``stop`` parses and validates against its
  schema, logprobs come one per generated token (finite, <= 0), ``n`` = 2 gives both
  choices, no stream breaks the SSE protocol (data after ``[DONE]``, text after a
  choice's finish reason);
- errors: every error is OpenAI's error JSON, and only requests in flight during a fault
  window (the fault - 1 s .. its recovery) have one;
- idle: once idle, every replica reports ``raylm:kv_cache_usage_perc`` 0 and
  ``raylm:num_requests_running`` 0 on the ingress's /metrics;
- counters: the replicas' ``raylm:generation_tokens_total`` grows by exactly the tokens of
  a final probe of known lengths, and is at least what the history counted since the last
  recovery (the replicas' counters start over when a fault replaces them);
- memory: no process kind's RSS grows more than the bound over the last half of the run.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from soak_history import JSON_SCHEMA, Record
from soak_reference import TIE, Choice, Oracle

MAX_LINES = 8  # history lines printed under a failed check


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        head = f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"
        shown = self.lines[:MAX_LINES]
        more = [f"    ... {len(self.lines) - MAX_LINES} more"] if len(self.lines) > MAX_LINES else []
        return "\n".join([head, *(f"    {line}" for line in shown), *more])


# ---- checks on the history ----------------------------------------------------------------

def check_hung(records: list[Record], deadline_s: float) -> Check:
    hung = [r for r in records if r.end_kind == "timeout" or not r.end_kind]
    return Check("hung", not hung, f"{len(hung)} of {len(records)} requests without an end "
                 f"within {deadline_s:g} s", [r.line() for r in hung])


def check_exact(records: list[Record], refs: dict[int, dict[int, Choice]], oracle: Oracle
                ) -> tuple[Check, Check, Check, int]:
    """(finished requests equal to the reference, partial streams prefixes of it, the
    divergences a tie explains (soak_reference.py), number of finished requests
    compared)."""
    mismatches, partial_bad, ties, compared = [], [], [], 0
    for r in records:
        ref = refs.get(r.id)
        if ref is None:
            continue
        finished = r.end_kind == "finished"
        compared += finished
        if finished and set(r.texts) - set(ref):
            mismatches.append(f"{r.line()}\n      choices {sorted(r.texts)} for {sorted(ref)}")
            continue
        for i, choice in ref.items():
            text = r.texts.get(i, "")
            ok = ((text, r.finish.get(i)) == (choice.text, choice.finish_reason) if finished
                  else choice.text.startswith(text))
            if ok:
                continue
            line = (f"{r.line()}\n      choice {i}: served {text!r}\n"
                    f"      reference {choice.text!r} ({choice.finish_reason})")
            why = oracle.explain(r, i, choice, partial=not finished)
            if why is not None:
                ties.append(f"{line}\n      tie: {why}")
            else:
                (mismatches if finished else partial_bad).append(line)
            break
    n_partial = sum(1 for r in records if r.id in refs and r.end_kind != "finished")
    return (Check("exact", not mismatches, f"{len(mismatches)} token mismatches in "
                  f"{compared} finished requests compared with the offline reference",
                  mismatches),
            Check("prefixes", not partial_bad, f"{len(partial_bad)} of {n_partial} cut or "
                  "failed streams hold text that is not a prefix of the reference",
                  partial_bad),
            Check("ties", True, f"{len(ties)} requests left the TP=1 reference only at a tie "
                  f"(scores within {TIE:g}) and then followed it exactly (tolerated)", ties),
            compared)


def _schema_errors(text: str) -> str | None:
    try:
        obj = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    try:
        import jsonschema
    except ImportError:  # the dev extra has it; without it, JSON and an object suffice
        return None if isinstance(obj, dict) else "not an object"
    try:
        jsonschema.validate(obj, JSON_SCHEMA)
    except jsonschema.ValidationError as e:
        return f"schema: {e.message}"
    return None


def check_well_formed(records: list[Record]) -> Check:
    bad = []
    for r in records:
        problems = list(r.anomalies)
        if r.end_kind == "finished":
            if r.kind == "json" and r.finish.get(0) == "stop":
                err = _schema_errors(r.texts.get(0, ""))
                if err:
                    problems.append(err)
            n = r.body.get("n", 1)
            if sorted(r.finish) != list(range(n)) or not all(r.finish.values()):
                problems.append(f"finish reasons {r.finish} for n={n}")
            tokens = (r.usage or {}).get("completion_tokens")
            if r.streamed and tokens is None:
                problems.append("no usage chunk")
            if r.kind == "logprobs":
                lps = r.logprob_tokens.get(0, [])
                if len(lps) != tokens:
                    problems.append(f"{len(lps)} logprobs for {tokens} tokens")
                if any(not (math.isfinite(x) and x <= 0) for x in lps):
                    problems.append("a logprob that is not finite and <= 0")
        if problems:
            bad.append(f"{r.line()}\n      {'; '.join(problems)}")
    json_stop = sum(1 for r in records if r.kind == "json" and r.finish.get(0) == "stop")
    return Check("well-formed", not bad, f"{len(bad)} malformed responses ({json_stop} "
                 "structured outputs finished stop and were validated)", bad)


def fault_windows(faults: list[Any], t_end: float) -> list[tuple[float, float]]:
    return [(f.at - 1.0, f.recovered_at if f.recovered_at is not None else t_end)
            for f in faults]


def in_flight(r: Record, window: tuple[float, float], t_end: float) -> bool:
    """Whether ``r`` was open at some moment of ``window``."""
    end = r.end if r.end is not None else t_end
    return r.start <= window[1] and end >= window[0]


def check_errors(records: list[Record], faults: list[Any], t_end: float
                 ) -> tuple[Check, Check, int]:
    """(errors only inside fault windows, every error clean, errors outside windows)."""
    windows = fault_windows(faults, t_end)
    failed = [r for r in records if r.end_kind in ("error", "unclean")]

    outside = [r for r in failed if not any(in_flight(r, w, t_end) for w in windows)]
    unclean = [r for r in failed if r.end_kind == "unclean"]
    return (Check("errors-in-fault-windows", not outside,
                  f"{len(failed)} errors, {len(outside)} outside the fault windows",
                  [r.line() for r in outside]),
            Check("clean-errors", not unclean, f"{len(unclean)} of {len(failed)} errors were "
                  "not OpenAI error JSON", [r.line() for r in unclean]),
            len(outside))


# ---- checks on the live server -----------------------------------------------------------

def replica_series(base_url: str, name: str) -> dict[str, float]:
    """``name``'s per-replica samples on the ingress's /metrics."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}  # the check that reads it fails on the missing series
    out = {}
    for line in text.splitlines():
        m = re.match(re.escape(name) + r'\{.*replica="([^"]+)".*\} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def engine_totals(base_url: str) -> dict[str, float]:
    """Counters of note summed over the live replicas."""
    names = ("generation_tokens_total", "prompt_tokens_total", "num_preemptions_total",
             "prefix_cache_queries_total", "prefix_cache_hits_total")
    return {n: sum(replica_series(base_url, f"raylm:{n}").values()) for n in names}


def check_idle(base_url: str, replicas: int, timeout_s: float = 60.0) -> tuple[Check, dict]:
    """Polls until every replica reports 0 KV usage and 0 running requests (or times out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        kv = replica_series(base_url, "raylm:kv_cache_usage_perc")
        running = replica_series(base_url, "raylm:num_requests_running")
        waiting = replica_series(base_url, "raylm:num_requests_waiting")
        ok = (len(kv) == replicas and not any(kv.values()) and not any(running.values())
              and not any(waiting.values()))
        if ok or time.monotonic() > deadline:
            values = {"kv_cache_usage_perc": kv, "num_requests_running": running,
                      "num_requests_waiting": waiting}
            return Check("idle", ok, f"per replica {json.dumps(values, sort_keys=True)}"), values
        time.sleep(1.0)


def check_counters(base_url: str, model: str, records: list[Record], since: float,
                   probes: int = 6, timeout_s: float = 30.0) -> Check:
    """The generation-token counters against a probe of known size and the history."""
    before = replica_series(base_url, "raylm:generation_tokens_total")
    counted = sum((r.usage or {}).get("completion_tokens", 0) for r in records
                  if r.end_kind == "finished" and r.start >= since)
    sizes = [5 + 3 * i for i in range(probes)]
    for i, n in enumerate(sizes):
        try:
            r = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
                "model": model, "prompt": [20 + i, 21, 22, 23], "max_tokens": n,
                "temperature": 0, "ignore_eos": True})
        except httpx.HTTPError as e:
            return Check("counters", False, f"probe request {i} failed: {e!r}")
        if r.status_code != 200:
            return Check("counters", False, f"probe request {i}: {r.status_code} {r.text[:200]}")
    deadline = time.monotonic() + timeout_s
    while True:
        after = replica_series(base_url, "raylm:generation_tokens_total")
        grown = sum(after.values()) - sum(before.get(k, 0.0) for k in after)
        if grown >= sum(sizes) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    total = sum(before.values())
    ok = grown == sum(sizes) and total >= counted and set(after) == set(before)
    return Check("counters", ok, f"generation_tokens_total grew {grown:g} for a probe of "
                 f"{sum(sizes)} tokens; {total:g} counted by the replicas >= {counted} "
                 f"tokens the history finished since the last recovery ({since:.0f} s)")
