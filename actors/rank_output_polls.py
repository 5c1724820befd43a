"""One long poll in flight per EngineCore actor: the driver's read of the ranks' outputs.

Each rank's ``get_outputs`` returns every batch its loop has queued (waiting up to the poll
timeout for the first). The reader takes the polls that have answered, by blocking
(``wait``: the offline engine) or by awaiting on its event loop (``wait_async``: the asyncio
engine client's output task), with no thread and no queue of its own between the Ray reply
and the reader. A rank whose poll has not answered within the poll timeout plus the call
timeout is overdue: the reader treats it as dead.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import ray

from raylm.actors.remote_engine import submit
from raylm.scheduler.core_outputs import EngineCoreOutputs


@dataclass
class _Poll:
    ref: Any  # ObjectRef of list[EngineCoreOutputs]
    issued_at: float
    future: asyncio.Future | None = None  # the ref as a future of the awaiting reader's loop


# A rank's answer: its batches, or the Ray error its poll raised.
Answer = tuple[int, list[EngineCoreOutputs] | BaseException]


class RankOutputPolls:
    def __init__(self, ranks: list[Any], poll_timeout_s: float, call_timeout_s: float) -> None:
        self._ranks = ranks
        self.poll_timeout_s = poll_timeout_s
        self.answer_timeout_s = poll_timeout_s + call_timeout_s
        self._polls: dict[int, _Poll] = {}

    def issue(self, ranks: list[int] | None = None) -> None:
        """Start the next poll of each rank (all by default) that has none in flight."""
        now = time.monotonic()
        for rank in range(len(self._ranks)) if ranks is None else ranks:
            if rank not in self._polls:
                ref = submit(self._ranks[rank].get_outputs, self.poll_timeout_s)
                self._polls[rank] = _Poll(ref, now)

    def wait(self, timeout: float | None) -> list[Answer]:
        """The answers in by ``timeout`` (all that are in once the first is)."""
        self.issue()
        refs = [p.ref for p in self._polls.values()]
        ready, _ = ray.wait(refs, num_returns=1, timeout=self._bounded(timeout))
        if ready and len(refs) > 1:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = {id(r) for r in ready}
        return [(rank, self._take(rank, _fetch_ref))
                for rank, p in list(self._polls.items()) if id(p.ref) in done]

    async def wait_async(self) -> list[Answer]:
        """The answers in once the first is, awaited on the running event loop; [] after
        the longest a healthy rank takes to answer (the caller then asks ``overdue``)."""
        self.issue()
        loop = asyncio.get_running_loop()
        for p in self._polls.values():
            if p.future is None or p.future.get_loop() is not loop:
                p.future = asyncio.wrap_future(p.ref.future())
        futures = {rank: p.future for rank, p in self._polls.items() if p.future is not None}
        done, _ = await asyncio.wait(futures.values(), timeout=self.answer_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        return [(rank, self._take(rank, _fetch_future))
                for rank, f in futures.items() if f in done]

    def overdue(self) -> int | None:
        """A rank whose poll has gone unanswered for longer than a healthy one takes."""
        now = time.monotonic()
        for rank, p in self._polls.items():
            if now - p.issued_at > self.answer_timeout_s:
                return rank
        return None

    def _bounded(self, timeout: float | None) -> float:
        return self.answer_timeout_s if timeout is None else min(timeout, self.answer_timeout_s)

    def _take(self, rank: int, fetch: Any) -> list[EngineCoreOutputs] | BaseException:
        poll = self._polls.pop(rank)
        try:
            return fetch(poll)
        except ray.exceptions.RayError as e:
            return e


def _fetch_ref(poll: _Poll) -> list[EngineCoreOutputs]:
    return ray.get(poll.ref, timeout=0)


def _fetch_future(poll: _Poll) -> list[EngineCoreOutputs]:
    assert poll.future is not None
    return poll.future.result()
