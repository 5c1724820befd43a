"""The prefix router's own count of each replica's requests (cluster/serve/deployment/router.py).

Serve's queue-length cache is set to each replica's answer when it accepts a request, and
that answer lags a burst: requests chosen together all see the loads of before the burst,
and a late acceptance resets a count the router had already raised. So the router also
counts, per replica, the requests it chose it for (until ``on_request_routed``, at most
``choice_ttl_s``: a request cancelled before routing never gets there) and the requests
routed to it (until their result completes). The load it ranks by is the larger of the two
views; with several ingress replicas each router counts its own traffic.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable


class InflightCounts:
    def __init__(self, choice_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if choice_ttl_s <= 0:
            raise ValueError(f"choice_ttl_s must be > 0, got {choice_ttl_s!r}.")
        self._ttl, self._clock = choice_ttl_s, clock
        self._chosen: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (rid, t)
        self._running: dict[str, int] = {}

    def choose(self, key: str, replica: str) -> None:
        """``key`` is about to go to ``replica`` (a retry replaces its earlier choice)."""
        self._chosen.pop(key, None)
        self._chosen[key] = (replica, self._clock())
        self._expire()

    def route(self, key: str, replica: str) -> None:
        """``key`` was accepted by ``replica``: it runs there until ``finish``."""
        self._chosen.pop(key, None)
        self._running[replica] = self._running.get(replica, 0) + 1

    def finish(self, replica: str) -> None:
        n = self._running.get(replica, 0)
        if n > 0:
            self._running[replica] = n - 1

    def load(self, replica: str, excluding: str | None = None) -> int:
        """Requests running on ``replica`` plus those chosen for it, but ``excluding``
        (the request being chosen for now: its own earlier choice is no load)."""
        self._expire()
        chosen = sum(1 for key, (rid, _) in self._chosen.items()
                     if rid == replica and key != excluding)
        return self._running.get(replica, 0) + chosen

    def sync(self, replicas: Iterable[str]) -> None:
        """Forget replicas that left (their requests ended with them)."""
        keep = set(replicas)
        self._running = {rid: n for rid, n in self._running.items() if rid in keep}
        for key in [k for k, (rid, _) in self._chosen.items() if rid not in keep]:
            del self._chosen[key]

    def _expire(self) -> None:
        cutoff = self._clock() - self._ttl
        while self._chosen:
            key, (_, t) = next(iter(self._chosen.items()))
            if t >= cutoff:
                break
            del self._chosen[key]
