"""One TP x PP rank as a Ray actor around ``raylm.runner.worker.Worker``.

Every rank runs every step (``Worker.run``); only the output rank, TP rank 0 of the last
stage, sends results back. Steps come over the step stream (``serve_steps``, the default)
or as Ray calls (``execute_model``). One thread, the default concurrency group, makes all
of the rank's torch calls (OpenMP keeps a team per calling thread); ``serve_steps`` holds
it while the stream is open, so health, node info, ``call`` and shutdown use ``control``;
a prefill rank serves its KV blocks to decode ranks on ``kv`` (prefill/decode transfer),
and a decode rank takes the blocks that Ray Direct Transport received on ``kv_in``
(RDT needs ``enable_tensor_transport``: Ray adds its ``_ray_system`` threads, which run
the transfers).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray

from raylm.actors.actor_logging import show_raylm_info_logs
from raylm.actors.step_channel import StepServer
from raylm.scheduler.config.engine_config import EngineConfig

if TYPE_CHECKING:
    from raylm.parallel.context import ParallelContext
    from raylm.runner.kv_transfer.ray_pd import RayKVConnectorWorker
    from raylm.runner.worker import Worker

logger = logging.getLogger(__name__)


def output_rank(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    """TP rank 0 of the last PP stage (vLLM layout: ``rank = pp_rank * tp + tp_rank``)."""
    return (pipeline_parallel_size - 1) * tensor_parallel_size


def new_token() -> bytes:
    return secrets.token_bytes(16)


CONTROL = "control"
KV = "kv"
KV_IN = "kv_in"
SHUTDOWN_WAIT_S = 5.0  # for the torch thread to finish its step before tearing down


# Ray's typed overload of remote() lacks these actor options (they exist at runtime).
@ray.remote(  # type: ignore[call-overload]
    concurrency_groups={CONTROL: 1, KV: 2, KV_IN: 2}, enable_tensor_transport=True)
class WorkerActor:
    """Construct with ``.options(num_cpus=..., num_gpus=..., scheduling_strategy=...)``.

    Methods outside the ``control`` group run on one thread, in submission order, which
    keeps the Ray-call step path ordered; ``execute_model`` checks the sequence number
    anyway.
    """

    def __init__(self, rank: int, num_threads: int, env: dict[str, str] | None = None) -> None:
        """``rank``: where the executor created it; ``assign_rank`` may renumber it once
        every rank's GPU is known (before the rendezvous)."""
        show_raylm_info_logs()
        # Values the executor read through raylm.scheduler.config.envs, exported for torch/gloo here.
        os.environ.update(env or {})
        self.rank = rank
        self.num_threads = num_threads
        # A Worker, or a stand-in for one (worker_cls: tests, benchmarks).
        self.worker: Worker | None = None
        self.is_output_rank = False
        self._next_seq = 0
        self._step_server: StepServer | None = None
        self._busy = threading.Lock()  # held by the torch thread while it runs steps
        self._rendezvous: Any = None  # rank 0's held store server (StoreRendezvous)

    # ---- setup -------------------------------------------------------------------------

    @ray.method(concurrency_group=CONTROL)
    def get_node_info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "node_id": ctx.get_node_id(), "actor_id": ctx.get_actor_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "assigned_resources": dict(ctx.get_assigned_resources())}

    def assign_rank(self, rank: int) -> None:
        self.rank = rank

    def publish_rendezvous(self, world_size: int, timeout_s: float) -> str:
        """Rank 0 starts the world's store on an OS-picked port of its node's IP and holds
        it (no window in which another process could take the port); returns its URL."""
        from raylm.parallel.rendezvous import StoreRendezvous

        self._rendezvous = StoreRendezvous.publish(ray.util.get_node_ip_address(), world_size,
                                                   timeout_s)
        return str(self._rendezvous.init_method)

    def init_worker(self, engine_config: EngineConfig, distributed_init_method: str | None,
                    local_rank: int = 0, worker_cls: type[Worker] | None = None,
                    dist_timeout_s: float = 300.0,
                    expert_dp: tuple[int, int] | None = None) -> None:
        """Join torch.distributed (world size > 1), build the Worker, bind its device.
        ``expert_dp``: (DP rank, DP size) when the experts spread over the DP ranks too;
        the group joins later (``join_expert_group``)."""
        from raylm.actors.gpu_assignment import current_device_assignment

        # Find this node's checkpoint before joining torch.distributed: a resolver that
        # writes files (the demo model) must not run as a non-zero distributed rank,
        # which transformers' save_pretrained treats as "not the main process".
        engine_config = replace(engine_config,
                                model_config=engine_config.model_config.on_this_node())
        pc = engine_config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.is_output_rank = self.rank == output_rank(tp, pp)
        device = current_device_assignment(f"worker rank {self.rank}")
        local_rank = device.local_rank if device.gpu_ids else local_rank
        ctx = None
        if pc.world_size > 1:
            from raylm.parallel.distributed import init_distributed_environment

            ctx = init_distributed_environment(
                world_size=pc.world_size, rank=self.rank,
                distributed_init_method=distributed_init_method,
                tensor_parallel_size=tp, pipeline_parallel_size=pp, local_rank=local_rank,
                timeout_s=dist_timeout_s, expect_cuda=device.expect_cuda,
                rendezvous=self._rendezvous if self.rank == 0 else None)
        from raylm.runner.worker import Worker

        self._run = Worker.run  # the one step dispatch, for a stand-in worker_cls too
        self.worker = worker = (worker_cls or Worker)(
            engine_config, rank=self.rank, local_rank=local_rank,
            distributed_init_method=distributed_init_method)
        # The Worker sets torch's thread count itself; hand it this rank's CPU share.
        if expert_dp is None:
            worker.init_device(ctx, num_threads=self.num_threads, expect_cuda=device.expect_cuda)
        else:
            from raylm.parallel.expert_parallel import DPExpertGroup

            worker.init_device(ctx, num_threads=self.num_threads, expect_cuda=device.expect_cuda,
                               ep_group=DPExpertGroup(*expert_dp))
        if pp > 1:
            assert ctx is not None  # world_size > 1
            self._init_pp_transport(worker, engine_config, ctx, dist_timeout_s)
        kv = engine_config.kv_transfer_config
        if kv is not None and not kv.is_offloading:  # prefill/decode: the rank's connector
            from raylm.actors.kv_transfer.kv_transport import RayKVTransport

            connector = self._kv_connector()
            # Decode ranks pull through it; its caches exist once initialize_kv_cache ran.
            connector.transport = RayKVTransport(
                connector.config.pd_transport, device=lambda: connector.cache_device)

    def _ready_worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError(f"worker rank {self.rank}: init_worker has not run")
        return self.worker

    def _kv_connector(self) -> RayKVConnectorWorker:
        """This rank's prefill/decode KV connector."""
        from raylm.runner.kv_transfer.ray_pd import RayKVConnectorWorker

        runner = self._ready_worker().model_runner
        steps = runner.kv_steps if runner is not None else None
        connector = steps.connector if steps is not None else None
        if not isinstance(connector, RayKVConnectorWorker):
            raise RuntimeError(f"worker rank {self.rank} has no prefill/decode KV connector")
        return connector

    def _init_pp_transport(self, worker: Worker, engine_config: EngineConfig,
                           ctx: ParallelContext, dist_timeout_s: float) -> None:
        """Hidden states stage to stage, sampled ids back from the last stage. Collective
        (it creates the PP broadcast group): every rank runs it, in init_worker."""
        from raylm.parallel.layers import get_pp_layer_range
        from raylm.parallel.pp_comm import build_pp_transport
        from raylm.runner.loading.model_loader import resolve_dtype
        from raylm.runner.models.llama import IntermediateTensors, aux_layers_before

        mc = engine_config.model_config
        hidden_size = int(mc.hf_config["hidden_size"])
        dtype = resolve_dtype(mc.dtype, ctx.device, mc.hf_config)  # the runner's dtype
        # An EAGLE-3 head on the last stage reads layers of the stages before it.
        start, _ = get_pp_layer_range(int(mc.hf_config["num_hidden_layers"]), ctx.pp_rank,
                                      ctx.pp_size)
        aux = engine_config.eagle_aux_layers
        worker.pp_transport = build_pp_transport(ctx, hidden_size, dtype,
                                                 IntermediateTensors, dist_timeout_s,
                                                 len(aux_layers_before(aux, start)))

    def load_model(self) -> dict[str, Any] | None:
        """Loads the rank's weights; returns what it runs on (``Worker.device_info``)."""
        worker = self._ready_worker()
        worker.load_model()
        describe = getattr(worker, "device_info", None)  # a stand-in worker may lack it
        return describe() if describe is not None else None

    def determine_num_kv_blocks(self) -> int:
        return int(self._ready_worker().determine_num_kv_blocks())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._ready_worker().initialize_kv_cache(num_blocks)

    @ray.method(concurrency_group=CONTROL)
    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``collective_rpc``'s one string dispatch: a public Worker method by name. It
        answers while the stream is served, so it runs beside the steps, not between them."""
        if method.startswith("_") or not callable(getattr(self.worker, method, None)):
            raise ValueError(f"Worker has no public method {method!r}.")
        from raylm.runner.worker import set_intra_op_threads

        set_intra_op_threads(self.num_threads)  # torch's count is per thread: this one's too
        return getattr(self.worker, method)(*args, **kwargs)

    def join_expert_group(self, host: str, port: int, timeout_s: float) -> None:
        """Join this rank's expert-parallel group across the DP ranks (Worker's method,
        with this node's address for Gloo)."""
        self._ready_worker().join_expert_group(host, port, timeout_s,
                                               ray.util.get_node_ip_address())

    @ray.method(concurrency_group=KV)
    def read_kv(self, request_id: str, first_block: int, head_lo: int, head_hi: int) -> Any:
        """A prefill rank's blocks of a finished prompt, for a decode rank (see
        ``RayKVConnectorWorker.read_blocks``; the blocks are held until it is released)."""
        return self._kv_connector().read_blocks(request_id, first_block, head_lo, head_hi)

    # Ray Direct Transport (raylm.actors.kv_transfer.kv_rdt): the prefill rank's side, then the decode
    # rank's (which calls it on itself, with the ref of the prefill rank's tensors).
    @ray.method(concurrency_group=KV)
    def read_kv_tensors(self, request_id: str, first_block: int, head_lo: int, head_hi: int,
                        on_device: bool = False) -> dict[str, Any]:
        """``read_kv`` as torch tensors; the caller asks for it with
        ``.options(tensor_transport=kv_rdt.TRANSPORT)``, so they leave out of band."""
        return self._kv_connector().read_block_tensors(request_id, first_block, head_lo,
                                                       head_hi, on_device)

    @ray.method(concurrency_group=KV)
    def kv_device(self) -> str:
        return str(self._kv_connector().cache_device.type)

    @ray.method(concurrency_group=KV)
    def join_kv_pair(self, name: str, host: str, port: int, backend: str,
                     timeout_s: float) -> None:
        """The prefill side of a KV pair (the decode rank joins it at the same time)."""
        import torch

        from raylm.actors.kv_transfer import kv_rdt

        device = (self._kv_connector().cache_device if backend == "nccl"
                  else torch.device("cpu"))
        kv_rdt.join_pair(name, host, port, kv_rdt.SRC, backend, timeout_s, device,
                         ray.util.get_node_ip_address())

    @ray.method(concurrency_group=CONTROL)
    def leave_kv_pair(self, name: str) -> None:
        from raylm.actors.kv_transfer import kv_rdt

        kv_rdt.leave_pair(name)

    @ray.method(concurrency_group=KV_IN)
    def take_kv(self, key: str, payload: dict[str, Any]) -> None:
        """Ray resolved ``payload`` (a ref to a prefill rank's ``read_kv_tensors``) with
        tensors received over the pair; hand it to the pulling thread."""
        from raylm.actors.kv_transfer import kv_rdt

        kv_rdt.land(key, payload)

    # ---- steps ---------------------------------------------------------------------------

    def _run_step(self, message: Any) -> Any:
        """``Worker.run``; only the output rank's result goes back."""
        out = self._run(self._ready_worker(), message)
        return out if self.is_output_rank else None

    def execute_model(self, seq: int, scheduler_output: Any) -> Any:
        """The Ray-call step path: run one step and return its resolved output (output rank)."""
        if seq != self._next_seq:
            raise RuntimeError(f"worker rank {self.rank} got step #{seq}, expected #{self._next_seq}")
        self._next_seq += 1
        with self._busy:
            out = self._run_step(scheduler_output)
            return out.get_output() if hasattr(out, "get_output") else out

    def open_step_server(self, token: bytes) -> tuple[str, int]:
        """Listen for the step stream; the executor connects to the returned address once
        it has called ``serve_steps``."""
        self._step_server = StepServer(self._run_step, self.is_output_rank, token,
                                       ray.util.get_node_ip_address())
        return self._step_server.address

    def serve_steps(self) -> None:
        """Run the stream's steps on this (the torch) thread until the stream closes."""
        if self._step_server is None:
            raise RuntimeError("serve_steps called before open_step_server")
        with self._busy:
            self._step_server.serve()

    # ---- lifecycle -------------------------------------------------------------------------

    @ray.method(concurrency_group=CONTROL)
    def check_health(self) -> None:
        if self._step_server is not None and self._step_server.error is not None:
            raise RuntimeError(f"worker rank {self.rank} failed a step: {self._step_server.error}")
        if self.worker is not None and hasattr(self.worker, "check_health"):
            self.worker.check_health()

    @ray.method(concurrency_group=CONTROL)
    def shutdown(self) -> None:
        if self._step_server is not None:
            self._step_server.close()  # ends serve_steps if the executor did not
        # Tear down only once the torch thread is out of its step (a collective in flight
        # must not lose its process group under it).
        if not self._busy.acquire(timeout=SHUTDOWN_WAIT_S):
            logger.warning("worker rank %d: a step still runs after %.0fs; shutting down anyway",
                           self.rank, SHUTDOWN_WAIT_S)
        if self.worker is not None and hasattr(self.worker, "shutdown"):
            self.worker.shutdown()
        if "raylm.actors.kv_transfer.kv_rdt" in sys.modules:  # this rank's KV pairs, either side
            sys.modules["raylm.actors.kv_transfer.kv_rdt"].leave_all()
        from raylm.parallel.distributed import destroy_distributed_environment

        destroy_distributed_environment()
