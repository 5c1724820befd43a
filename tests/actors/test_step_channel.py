"""The step stream without Ray: ordering, pipelining, deferred outputs, errors, deaths, auth."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from raylm.actors.step_channel import AUTH, StepChannel, StepServer, encode_frame
from raylm.scheduler.core.executor_base import EngineDeadError


class _Deferred:
    """An output whose value is only known later (as AsyncModelRunnerOutput)."""

    def __init__(self, value, delay: float) -> None:
        self.value, self.delay = value, delay

    def get_output(self):
        time.sleep(self.delay)
        return self.value


def _servers(n: int, run_step, token=b"t" * 16, output_rank: int = 0):
    servers = [StepServer(run_step(rank), rank == output_rank, token, "127.0.0.1")
               for rank in range(n)]
    for s in servers:
        s.start()
    return servers


def _channel(servers, token=b"t" * 16, output_rank: int = 0, failures=None):
    failures = failures if failures is not None else []

    def on_failure(rank, reason):
        failures.append((rank, reason))
        return EngineDeadError(f"rank {rank}: {reason}")

    return StepChannel([s.address for s in servers], token, output_rank, on_failure)


def test_steps_run_in_order_on_every_rank_and_resolve_in_order():
    seen = {0: [], 1: []}

    def run_step(rank):
        def run(step):
            seen[rank].append(step)
            # the output rank's later steps resolve faster: order must still hold
            return _Deferred(step * 10, delay=0.01 if step % 3 == 0 else 0.0)
        return run

    servers = _servers(2, run_step)
    ch = _channel(servers)
    futures = [ch.submit(i) for i in range(50)]
    assert [f.result(timeout=10) for f in futures] == [i * 10 for i in range(50)]
    assert seen[0] == seen[1] == list(range(50))
    ch.close()


def test_output_rank_other_than_zero():
    servers = _servers(2, lambda rank: (lambda step: (rank, step)), output_rank=1)
    ch = _channel(servers, output_rank=1)
    assert ch.submit(5).result(timeout=10) == (1, 5)
    ch.close()


def test_step_error_on_non_output_rank_fails_pending_and_later_steps():
    gate = threading.Event()
    submitted = threading.Event()

    def run_step(rank):
        def run(step):
            if rank == 0:
                gate.wait(5)  # the output rank is "stuck in a collective"
                return step
            if step == 2:
                # Fail only once all four are in: a failure seen earlier refuses the
                # later submits themselves (checked below with step 9).
                submitted.wait(5)
                raise ValueError("bad step 2")
            return None
        return run

    failures = []
    servers = _servers(2, run_step)
    ch = _channel(servers, failures=failures)
    futures = [ch.submit(i) for i in range(4)]
    submitted.set()
    with pytest.raises(EngineDeadError, match="ValueError: bad step 2"):
        futures[-1].result(timeout=10)
    assert [rank for rank, _ in failures] == [1]
    with pytest.raises(EngineDeadError):
        ch.submit(9)
    gate.set()
    ch.close()


def test_worker_death_closes_stream_and_fails_pending():
    servers = _servers(2, lambda rank: (lambda step: time.sleep(0.05) or step))
    failures = []
    ch = _channel(servers, failures=failures)
    futures = [ch.submit(i) for i in range(20)]
    servers[1].close()  # as if the process died: its stream ends
    with pytest.raises(EngineDeadError, match="rank 1: its step stream closed"):
        futures[-1].result(timeout=10)
    assert failures and failures[0][0] == 1
    ch.close()


def test_stream_without_token_is_refused():
    server = StepServer(lambda step: step, True, b"secret-token-123", "127.0.0.1")
    server.start()
    with socket.create_connection(server.address) as sock:
        sock.sendall(encode_frame(AUTH, b"wrong-token-0000"))
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed on us
    deadline = time.monotonic() + 5
    while server.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.error is not None and "token" in server.error
