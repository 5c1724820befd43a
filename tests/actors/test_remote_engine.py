"""Engine calls made from a cancelled request's task are not cancelled with it.

A Serve replica serves each request in a Ray task of its own. When the client leaves,
Serve cancels the request's coroutine (its stream's ``finally`` then aborts the request in
the engine) and Ray cancels the task, and with it, recursively, every task the request
submitted: the abort included, which the engine client would read as the engine's death.
``remote_engine.submit`` sends engine calls from an empty context, so they have no parent
task. Here an async actor plays the replica and a sink actor the EngineCore: cancelling the
request cancels the call it made the plain way, not the one made through ``submit``."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray
from local_ray import ship_by_value

from raylm.actors.remote_engine import submit

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    ship_by_value(sys.modules[__name__])
    yield ray_local


@ray.remote
class Sink:
    """The EngineCore's stand-in: its call waits until the test releases it."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.done: list[str] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()

    async def abort_requests(self, tag: str) -> str:
        self.received.append(tag)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(tag)
            raise
        self.done.append(tag)
        return tag

    async def open(self) -> None:
        self.release.set()

    async def state(self) -> tuple[list[str], list[str], list[str]]:
        return list(self.received), list(self.done), list(self.cancelled)


@ray.remote
class Replica:
    async def handle(self, sink) -> None:
        """A request that has made two engine calls, the plain way and through submit."""
        self.refs = [sink.abort_requests.remote("plain"), submit(sink.abort_requests, "submit")]
        await asyncio.sleep(60)


def _wait(what: str, ready, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while not ready():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_cancelling_a_request_cancels_its_calls_but_not_those_made_through_submit():
    sink, replica = Sink.remote(), Replica.remote()
    ref = replica.handle.remote(sink)
    _wait("the calls never reached the sink",
          lambda: sorted(ray.get(sink.state.remote())[0]) == ["plain", "submit"])
    ray.cancel(ref)  # recursive, as Serve cancels a request whose client left
    with pytest.raises((ray.exceptions.TaskCancelledError, asyncio.CancelledError)):
        ray.get(ref, timeout=60)
    # Ray cancelled the plain call with its parent; the call made through submit has no
    # parent and runs to the end once released.
    _wait("the plain call was not cancelled",
          lambda: "plain" in ray.get(sink.state.remote())[2])
    ray.get(sink.open.remote())
    _wait("the call made through submit never finished",
          lambda: ray.get(sink.state.remote())[1] == ["submit"])
