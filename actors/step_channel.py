"""The per-step path from the executor to its workers: one TCP stream per worker.

Ray places, starts and watches the workers; the steps go over a plain socket, because a
Ray call per worker per step costs several times a pickled frame (``bench/dispatch.py``).
A frame is kind (1 byte) + length (8 bytes) + pickle; TCP keeps each worker's steps in
order. Only the output rank answers a step (RESULT), any rank answers ERROR when one
raises, and a closed stream is a dead worker. The first frame is a token handed over
through Ray, so that only the executor can drive a worker.
"""

from __future__ import annotations

import collections
import hmac
import logging
import pickle
import queue
import socket
import struct
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from raylm.scheduler.core.executor_base import EngineDeadError

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!BQ")
AUTH, STEP, RESULT, ERROR, CLOSE = range(1, 6)
ACCEPT_TIMEOUT_S = 120.0


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("stream closed")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> tuple[int, Any]:
    kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    payload = _recv_exact(sock, length) if length else b""
    return kind, (pickle.loads(payload) if kind != AUTH else bytes(payload))


def encode_frame(kind: int, obj: Any) -> bytes:
    payload = obj if kind == AUTH else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(kind, len(payload)) + payload


def _configure(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A node that vanishes sends no FIN: keepalive probes end the stream within ~30 s.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, name):  # Linux names; other platforms keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class StepServer:
    """Worker side: accept the executor's stream, run its steps in order on one thread.

    ``run_step(scheduler_output)`` returns the step's output (or an object with
    ``get_output()`` that resolves it later: the sender thread waits on it, so the step
    thread moves on to the next step while the copy of this one completes). A worker calls
    ``serve()`` on the thread that loaded its model (see WorkerActor); ``start()`` serves
    on a thread of its own.
    """

    def __init__(self, run_step: Callable[[Any], Any], send_outputs: bool, token: bytes,
                 host: str) -> None:
        self._run_step = run_step
        self._send_outputs = send_outputs
        self._token = token
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(ACCEPT_TIMEOUT_S)
        self.address = (host, self._listener.getsockname()[1])
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self.error: str | None = None
        self._sender = threading.Thread(target=self._send_loop, name="raylm-step-out", daemon=True)

    def start(self) -> None:
        threading.Thread(target=self.serve, name="raylm-step", daemon=True).start()

    def _send(self, kind: int, obj: Any) -> None:
        assert self._conn is not None
        frame = encode_frame(kind, obj)
        with self._send_lock:
            self._conn.sendall(frame)

    def _accept(self) -> socket.socket:
        try:
            conn, _ = self._listener.accept()
        finally:
            self._listener.close()
        _configure(conn)
        kind, token = recv_frame(conn)
        if kind != AUTH or not hmac.compare_digest(token, self._token):
            conn.close()
            raise PermissionError("step stream opened without the executor's token")
        return conn

    def serve(self) -> None:
        """Accept the executor's stream and run its steps on the calling thread until the
        stream closes; a failed step is reported to the executor, not raised."""
        self._sender.start()
        try:
            self._conn = self._accept()
            while True:
                kind, obj = recv_frame(self._conn)
                if kind == CLOSE:
                    break
                if kind != STEP:
                    raise ValueError(f"unexpected frame kind {kind} on a worker's step stream")
                out = self._run_step(obj)
                if self._send_outputs:
                    self._outbox.put((RESULT, out))
        except EOFError:
            pass  # the executor went away: nothing left to serve
        except BaseException as e:
            self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            logger.error("Step failed on this worker: %s", self.error)
            self._outbox.put((ERROR, self.error))  # after the results already queued
        finally:
            self._outbox.put(None)

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            if self._conn is None:
                return  # no executor ever connected: nobody to tell
            kind, out = item
            try:
                if kind == RESULT and hasattr(out, "get_output"):
                    out = out.get_output()
            except BaseException as e:
                kind, out = ERROR, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
                self.error = out
            try:
                self._send(kind, out)
            except OSError:
                return
            if kind == ERROR:
                return

    def close(self) -> None:
        for s in (self._listener, self._conn):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass


class StepChannel:
    """Executor side: send every step to every worker; futures resolve in submission order.

    ``on_failure(rank, reason)`` is called once, from a receiver thread, when a worker's
    stream ends or reports an error; it returns the exception that fails every pending
    (and later) step.
    """

    def __init__(self, addresses: list[tuple[str, int]], token: bytes, output_rank: int,
                 on_failure: Callable[[int, str], BaseException]) -> None:
        self._output_rank = output_rank
        self._on_failure = on_failure
        self._lock = threading.Lock()  # guards _pending and _error; never held while sending
        self._send_lock = threading.Lock()  # keeps each frame whole on every stream
        self._pending: collections.deque[Future] = collections.deque()
        self._error: BaseException | None = None
        self._closing = False
        self._socks = []
        for host, port in addresses:
            sock = socket.create_connection((host, port), timeout=ACCEPT_TIMEOUT_S)
            sock.settimeout(None)
            _configure(sock)
            sock.sendall(encode_frame(AUTH, token))
            self._socks.append(sock)
        self._receivers = [
            threading.Thread(target=self._receive, args=(rank,), daemon=True,
                             name=f"raylm-step-recv-{rank}")
            for rank in range(len(self._socks))
        ]
        for t in self._receivers:
            t.start()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, scheduler_output: Any) -> Future:
        frame = encode_frame(STEP, scheduler_output)  # pickled once for every worker
        future: Future = Future()
        with self._send_lock:
            with self._lock:
                if self._error is not None:
                    raise self._error
                self._pending.append(future)
            try:
                for sock in self._socks:
                    sock.sendall(frame)
            except OSError:
                pass  # the receiver of the broken stream reports the death
        return future

    def _receive(self, rank: int) -> None:
        sock = self._socks[rank]
        try:
            while True:
                kind, obj = recv_frame(sock)
                if kind == RESULT and rank == self._output_rank:
                    with self._lock:
                        future = self._pending.popleft() if self._pending else None
                    if future is None:
                        raise RuntimeError("worker sent a result for a step never submitted")
                    future.set_result(obj)
                elif kind == ERROR:
                    self._fail(rank, f"a step raised on the worker: {obj}")
                    return
                else:
                    raise RuntimeError(f"unexpected frame kind {kind} from worker rank {rank}")
        except (EOFError, OSError) as e:
            if not self._closing:
                self._fail(rank, f"its step stream closed ({type(e).__name__}: {e})")
        except BaseException as e:
            self._fail(rank, f"{type(e).__name__}: {e}")

    def _fail(self, rank: int, reason: str) -> None:
        with self._lock:
            if self._error is not None:
                return
        error = self._on_failure(rank, reason)  # outside the lock: it may block on Ray
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            pending, self._pending = self._pending, collections.deque()
        for future in pending:
            future.set_exception(error)

    def close(self) -> None:
        """End every stream. Steps still pending fail (their results would never come):
        whoever waits on one must not hang on a shut-down executor."""
        self._closing = True
        with self._lock:
            if self._error is None:
                self._error = EngineDeadError("the executor was shut down")
            pending, self._pending = self._pending, collections.deque()
        for future in pending:
            future.set_exception(EngineDeadError(
                "the executor was shut down with this step in flight"))
        for sock in self._socks:
            try:
                sock.sendall(encode_frame(CLOSE, None))
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass
