"""The soak's requests and their history (bench/soak.py): a seeded random request mix, the
HTTP client that runs one request and records everything it saw, and the record itself.

Kinds (weights in MIX): greedy streamed and whole completions, seeded sampling, stop
strings, ``n`` = 2, logprobs, structured output on the chat route (``response_format``
json_schema), and client aborts (a whole completion the client gives up on after a random
delay). Prompts are token ids (8-200, a third of them behind one of a few shared prefixes,
so the prefix cache and the prefix router have work). 10% of streams are cut by the client
after a random number of chunks.

A record ends exactly once, as one of:
  finished  the stream's ``[DONE]`` (or a 200 JSON body);
  error     a clean OpenAI error: an ``{"error": {...}}`` event in the stream, or a 4xx/5xx
            whose body is OpenAI's error JSON;
  unclean   anything else that is not a success: a stream that stopped without ``[DONE]``
            or an error event, a body that is not error JSON, a dropped connection;
  cut       the client cut the stream, or gave up on a whole completion (an abort);
  timeout   no end within the deadline: a hung request.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

# kind -> weight; every kind but "greedy_full" and "abort" streams.
MIX = {"greedy": 28, "greedy_full": 8, "seeded": 14, "stop": 8, "n2": 6, "logprobs": 8,
       "json": 8, "abort": 5}
STREAMED = {"greedy", "seeded", "stop", "n2", "logprobs", "json"}
# Kinds whose text is compared token-exactly with the offline reference.
EXACT = {"greedy", "greedy_full", "seeded", "stop", "n2", "logprobs", "abort"}
CUT_SHARE = 0.10
STOP_STRINGS = ("e", "a ", "th", "in", "s.", "!", "er", "o", ",", "x")
WORDS = ("the sea a cpu paris rain chess moon bread violin gravity tea river stone light "
         "cloud seven table green quick slow north paper glass music").split()
JSON_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}


@dataclass
class Record:
    id: int
    kind: str
    route: str  # "completions" or "chat/completions"
    body: dict[str, Any]
    cut_after: int | None = None  # streams: chunks with text before the client cuts
    abort_after_s: float | None = None  # "abort": seconds before the client gives up
    start: float = 0.0
    end: float | None = None
    end_kind: str = ""
    status: int | None = None
    error: Any = None  # the error object, body text or exception
    chunks: list[tuple[float, int, str]] = field(default_factory=list)  # (t, index, text)
    texts: dict[int, str] = field(default_factory=dict)  # per choice index, joined
    finish: dict[int, str | None] = field(default_factory=dict)
    logprob_tokens: dict[int, list[float]] = field(default_factory=dict)  # token logprobs
    usage: dict[str, Any] | None = None
    anomalies: list[str] = field(default_factory=list)  # protocol breaches seen in the stream

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    def line(self) -> str:
        """One line of the history, for the report."""
        end = f"{self.end:.2f}" if self.end is not None else "-"
        texts = {i: t[:40] for i, t in self.texts.items()}
        return (f"#{self.id} {self.kind} start={self.start:.2f} end={end} {self.end_kind} "
                f"status={self.status} chunks={len(self.chunks)} finish={self.finish} "
                f"error={str(self.error)[:160]!r} texts={texts}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RequestMix:
    """The seeded request mix: ``next()`` is the next request's record, not yet sent."""

    def __init__(self, rng: random.Random, model: str, vocab_size: int) -> None:
        self.rng = rng
        self.model = model
        self.lo, self.hi = 6, vocab_size - 1  # past the special tokens
        self.prefixes = [[rng.randint(self.lo, self.hi) for _ in range(rng.randint(32, 96))]
                         for _ in range(6)]
        self.kinds, self.weights = zip(*MIX.items())
        self.count = 0

    def prompt(self) -> list[int]:
        rng = self.rng
        n = rng.randint(8, 200)
        head: list[int] = rng.choice(self.prefixes)[:n] if rng.random() < 1 / 3 else []
        return head + [rng.randint(self.lo, self.hi) for _ in range(n - len(head))]

    def next(self) -> Record:
        rng = self.rng
        kind = rng.choices(self.kinds, self.weights)[0]
        self.count += 1
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(8, 48),
                                "temperature": 0.0, "ignore_eos": True}
        route = "completions"
        if kind == "json":
            route = "chat/completions"
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
            body.update(messages=[{"role": "user", "content": words}], ignore_eos=False,
                        max_tokens=rng.randint(48, 96),
                        response_format={"type": "json_schema", "json_schema": {
                            "name": "item", "schema": JSON_SCHEMA, "strict": True}})
        else:
            body["prompt"] = self.prompt()
        if kind == "seeded":
            body.update(temperature=0.8, seed=rng.randint(0, 2**31 - 1),
                        ignore_eos=rng.random() < 0.5)
        elif kind == "stop":
            body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 3))
        elif kind == "n2":
            body["n"] = 2
        elif kind == "logprobs":
            body["logprobs"] = 2
        rec = Record(self.count, kind, route, body)
        if kind in STREAMED:
            body.update(stream=True, stream_options={"include_usage": True})
            if rng.random() < CUT_SHARE:
                rec.cut_after = rng.randint(1, max(1, body["max_tokens"] - 1))
        elif kind == "abort":
            rec.abort_after_s = rng.uniform(0.05, 2.0)
        return rec


def _clean_error(obj: Any) -> bool:
    """OpenAI's error shape: ``{"error": {"message": ..., ...}}``."""
    return (isinstance(obj, dict) and isinstance(obj.get("error"), dict)
            and bool(obj["error"].get("message")))


async def _stream(client: httpx.AsyncClient, url: str, rec: Record, now) -> None:
    async with client.stream("POST", url, json=rec.body) as r:
        rec.status = r.status_code
        if r.status_code != 200:
            await _whole(r, rec, now)
            return
        text_chunks, done = 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]" and rec.end_kind in ("", "error") and not done:
                done = True  # after an error event too, as vLLM ends its streams
                rec.end_kind = rec.end_kind or "finished"
                continue
            if rec.end_kind:  # anything after [DONE] or an error event
                rec.anomalies.append(f"data after the end: {data[:80]!r}")
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                rec.anomalies.append(f"not JSON: {data[:80]!r}")
                continue
            if "error" in chunk:
                rec.end_kind = "error" if _clean_error(chunk) else "unclean"
                rec.error = chunk.get("error")
                continue
            if chunk.get("usage"):
                rec.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                i = choice.get("index", 0)
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content") or ""
                if piece and rec.finish.get(i):
                    rec.anomalies.append(f"text for choice {i} after its finish_reason")
                if piece:
                    rec.chunks.append((now(), i, piece))
                    rec.texts[i] = rec.texts.get(i, "") + piece
                    text_chunks += 1
                if choice.get("finish_reason"):
                    rec.finish[i] = choice["finish_reason"]
                lp = choice.get("logprobs")
                if lp and lp.get("token_logprobs") is not None:
                    rec.logprob_tokens.setdefault(i, []).extend(lp["token_logprobs"])
            if rec.cut_after is not None and text_chunks >= rec.cut_after:
                rec.end_kind = "cut"
                return  # leaving the block closes the connection: the server must abort
        if not rec.end_kind:
            rec.end_kind = "unclean"
            rec.error = "the stream ended without [DONE] or an error event"


async def _whole(r: httpx.Response, rec: Record, now) -> None:
    body = await r.aread()
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if r.status_code == 200 and isinstance(obj, dict) and "choices" in obj:
        rec.end_kind = "finished"
        rec.usage = obj.get("usage")
        for choice in obj["choices"]:
            i = choice.get("index", 0)
            text = choice.get("text")
            if text is None:
                text = (choice.get("message") or {}).get("content") or ""
            rec.texts[i] = text
            rec.finish[i] = choice.get("finish_reason")
            rec.chunks.append((now(), i, text))
        return
    rec.end_kind = "error" if r.status_code >= 400 and _clean_error(obj) else "unclean"
    rec.error = obj.get("error") if _clean_error(obj) else body[:300].decode(errors="replace")


async def run_request(client: httpx.AsyncClient, base_url: str, rec: Record,
                      deadline_s: float, t0: float) -> Record:
    """Send ``rec``'s request and fill in what happened; never raises, never outlives
    ``deadline_s`` (a request still open then ends as ``timeout``)."""
    def now() -> float:
        return time.monotonic() - t0

    url = f"{base_url}/v1/{rec.route}"
    rec.start = now()

    async def send() -> None:
        if rec.streamed:
            await _stream(client, url, rec, now)
        else:
            r = await client.post(url, json=rec.body)
            rec.status = r.status_code
            await _whole(r, rec, now)

    limit = deadline_s if rec.abort_after_s is None else min(deadline_s, rec.abort_after_s)
    try:
        await asyncio.wait_for(send(), limit)
    except TimeoutError:
        if rec.abort_after_s is not None and rec.abort_after_s < deadline_s:
            rec.end_kind = "cut"
        else:
            rec.end_kind, rec.error = "timeout", f"no end within {deadline_s:g} s"
    except (httpx.HTTPError, OSError) as e:
        if rec.end_kind not in ("finished", "error"):
            rec.end_kind, rec.error = "unclean", repr(e)
    except Exception as e:  # noqa: BLE001 - the history must hold every end
        rec.end_kind, rec.error = "unclean", f"client: {e!r}"
    rec.end = now()
    return rec
