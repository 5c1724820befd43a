"""Ray Direct Transport (RDT) for the prefill/decode KV pull: a tensor transport of raylm's,
registered with Ray's RDT (``ray.experimental.register_tensor_transport``), over one
torch process group per (decode rank, prefill rank) pair.

Why not Ray's own ``"gloo"`` transport (Ray 2.60): its group (``TorchGLOOGroup``) is
torch.distributed's default group of each actor process, and its send/recv use that
default group. A TP > 1 rank already owns its default group (the engine's world), and a
rank can be in one such group for its life, where a decode rank meets every prefill
engine (Serve replicas come and go) and a prefill rank every decode rank. Its
``create_collective_group`` also runs on each actor's default concurrency group, which a
worker's step loop holds (``serve_steps``). Here a pair is a ``ProcessGroupGloo`` (CPU
KV) or ``ProcessGroupNCCL`` (CUDA KV on both sides) on a TCPStore of its own, never the
default group, made by the decode rank the first time it pulls from a prefill rank.

The flow of one pull (the decode rank is the ObjectRef's owner, so Ray's RDT manager that
orders the transfer is the decode rank's): the decode rank calls the prefill rank's
``read_kv_tensors`` with ``.options(tensor_transport=TRANSPORT)`` (the tensors stay in
the prefill rank's RDT store, the rest of the value goes through Ray as usual), then
passes the ref to its own ``take_kv``; Ray runs ``__ray_send__`` on the prefill rank and
``__ray_recv__`` on the decode rank (both on their ``_ray_system`` threads, with this
module's ``KVPairTransport``), and ``take_kv`` lands the value here for the pulling thread.
A two-sided ref cannot be ``ray.get`` (Ray refuses it): it must be an actor task's argument.

Each transfer's send and receive carry a tag of its own (drawn by the owner), so they
match whatever order Ray runs a pair's transfers in. Sends do not wait for their receive:
the prefill rank's ``_ray_system`` thread never blocks on a decode rank (otherwise two
decode ranks pulling from two prefill ranks in opposite orders could wait on each
other); a thread of this module waits for the sends and drops the tensors. A transfer
that fails drops its pair (``abort_transport``; Ray would otherwise kill both actors);
the next pull makes a new one. A decode rank leaves its pairs on shutdown, both sides; a
prefill rank keeps the pairs of a decode rank that died without leaving (a few sockets)
until it shuts down itself.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from ray.experimental.rdt import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
    register_tensor_transport,
)

logger = logging.getLogger(__name__)

TRANSPORT = "RAYLM_KV"  # the tensor_transport name (Ray upper-cases them)
SRC, DST = 0, 1  # ranks in a pair: the prefill rank sends, the decode rank receives


@dataclass
class PairMetadata(CommunicatorMetadata):
    """One transfer on a pair: its send and its receive match by ``tag`` (Gloo/NCCL tags),
    whatever order Ray runs them in."""

    name: str = ""
    tag: int = 0


class _Pair:
    def __init__(self, name: str, pg: Any, store: Any, device: torch.device) -> None:
        self.name = name
        self.pg = pg
        self.store = store  # keeps the store (server or client) alive as long as the pair
        self.device = device  # where received tensors are put


_lock = threading.Lock()
_pairs: dict[str, _Pair] = {}
_routes: dict[tuple[str, str], str] = {}  # owner side: (src actor, dst actor) -> pair
_landed: dict[str, Any] = {}  # take_kv -> the pulling thread
_abandoned: set[str] = set()  # pulls that gave up waiting: drop what lands for them
_tags = itertools.count(1)
_sends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raylm-kv-rdt-send")


def register() -> None:
    """Make the transport known to this process (idempotent); Ray registers it on the
    sending actor itself before the first transfer."""
    try:
        register_tensor_transport(TRANSPORT, ["cpu", "cuda"], KVPairTransport, torch.Tensor)
    except ValueError:  # already registered in this process
        pass


def join_pair(name: str, host: str, port: int, rank: int, backend: str, timeout_s: float,
              device: torch.device, local_host: str, store: Any = None) -> None:
    """Collective: both sides call it at once. The decode side (``DST``) passes the store
    it hosts at (``host``, ``port``); the prefill side connects to it. ``local_host``: this
    node's address (Gloo binds it)."""
    from raylm.parallel.dp_sync import gloo_device

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(name, store)
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        pg: Any = dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_opts)
    else:
        # Private pybind class, absent from torch's stubs (the public Options takes no devices).
        gloo_opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo_opts._timeout = timeout
        gloo_opts._devices = [gloo_device(host, local_host)]
        pg = dist.ProcessGroupGloo(prefixed, rank, 2, gloo_opts)
    with _lock:
        _pairs[name] = _Pair(name, pg, store, device)
    logger.info("Joined KV pair %s (%s) as the %s side.", name, backend,
                "decode" if rank == DST else "prefill")


def leave_pair(name: str) -> None:
    """Forget the pair (Gloo closes its sockets once the group is freed); no-op if gone."""
    with _lock:
        _pairs.pop(name, None)
        for route in [r for r, n in _routes.items() if n == name]:
            del _routes[route]


def leave_all() -> None:
    with _lock:
        _pairs.clear()
        _routes.clear()


def has_pair(name: str) -> bool:
    with _lock:
        return name in _pairs


def add_route(src_actor: str, dst_actor: str, name: str) -> None:
    with _lock:
        _routes[(src_actor, dst_actor)] = name


def land(key: str, value: Any) -> None:
    """``take_kv``: the value of a pull's ref, tensors received."""
    with _lock:
        if key in _abandoned:
            _abandoned.discard(key)
            return
        _landed[key] = value


def take_landed(key: str) -> Any:
    with _lock:
        return _landed.pop(key)


def abandon(key: str) -> None:
    """The pull stopped waiting for ``key``: drop it if it lands later."""
    with _lock:
        if _landed.pop(key, None) is None:
            _abandoned.add(key)


def _pair(name: str) -> _Pair:
    with _lock:
        pair = _pairs.get(name)
    if pair is None:
        raise RuntimeError(f"KV pair {name} is gone (its peer left or a transfer failed).")
    return pair


def _wait_sends(name: str, works: list[Any], tensors: list[torch.Tensor]) -> None:
    try:
        for work in works:
            work.wait()
    except Exception as e:  # noqa: BLE001 - the decode side is gone or stuck
        logger.warning("KV send on pair %s failed: %s; dropping the pair.", name, e)
        leave_pair(name)
    del tensors  # held until sent


class KVPairTransport(TensorTransportManager):
    """Ray's tensor-transport interface over the pairs of this module (two-sided)."""

    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return False

    @staticmethod
    def can_abort_transport() -> bool:
        # Ray would otherwise kill both actors when a transfer fails; a pair's every wait
        # is bounded by its timeout, and aborting drops the pair.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True  # the pulling side makes the pair before it asks for tensors

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]
                                          ) -> TensorTransportMetadata:
        device = rdt_object[0].device.type if rdt_object else None
        return TensorTransportMetadata(tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
                                       tensor_device=device)

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: str | None = None) -> PairMetadata:
        key = (src_actor._actor_id.hex(), dst_actor._actor_id.hex())
        with _lock:
            name = _routes.get(key)
        if name is None:
            raise ValueError(f"no KV pair between {src_actor} and {dst_actor}.")
        return PairMetadata(name=name, tag=next(_tags) % (1 << 30))

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                              communicator_metadata: Any,
                              target_buffers: list[Any] | None = None) -> list[Any]:
        pair = _pair(communicator_metadata.name)
        tensors = target_buffers or [torch.empty(shape, dtype=dtype, device=pair.device)
                                     for shape, dtype in tensor_transport_metadata.tensor_meta]
        try:
            for tensor in tensors:
                pair.pg.recv([tensor], SRC, communicator_metadata.tag).wait()
        except Exception:
            leave_pair(pair.name)
            raise
        return tensors

    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                              communicator_metadata: Any) -> None:
        pair = _pair(communicator_metadata.name)
        tensors = [t.contiguous() for t in tensors]
        works = [pair.pg.send([t], DST, communicator_metadata.tag) for t in tensors]
        _sends.submit(_wait_sends, pair.name, works, tensors)

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any,
                        tensors: list[Any]) -> None:
        pass  # the send thread holds what it still sends

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        leave_pair(communicator_metadata.name)


register()
