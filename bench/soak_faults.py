"""The soak's cluster and its faults (bench/soak.py): a ``ray.cluster_utils.Cluster`` of a
head and one worker node serving the model through Ray Serve, and the four faults the soak
injects, each followed by a wait for Serve to recover.

Placement: each model replica reserves ``1 + TP`` CPUs (its own bundle, then one bundle for
its TP group's workers, STRICT_PACK so a replica never spans nodes) and each node declares
``NODE_CPUS`` logical CPUs, so one replica fits per node. The app is deployed while only the
head exists (the ingress replica, Serve's controller and its HTTP proxy land there); the
worker node joins afterwards and takes the second replica. Removing the worker node then
kills one model replica with its EngineCore and worker actors, never the HTTP path.

Faults (each on a replica picked by the soak's seeded RNG):
  worker       SIGKILL of one ``WorkerActor`` process (as the OOM killer would);
  engine_core  SIGKILL of one ``EngineCoreActor`` process;
  replica      ``ray.kill`` of one Serve replica actor (``SERVE_REPLICA::...``);
  node         ``cluster.remove_node`` of the worker node (its processes SIGKILLed), then
               a fresh node with the same resources, as an autoscaler would start.
A fault has recovered when the victim replica's actor is gone, two model replica actors
are alive, Serve's status shows both running and two probe requests in a row answer 200.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx

APP = "soak"
MODEL = "soak-model"
DEPLOYMENT = "LLMServer:" + MODEL
REPLICA_PREFIX = f"SERVE_REPLICA::{APP}#{DEPLOYMENT}#"
INGRESS_PREFIX = f"SERVE_REPLICA::{APP}#OpenAIIngress#"
NODE_CPUS = 4
FAULT_KINDS = ("worker", "engine_core", "replica", "node")
# Fast node-death detection (Ray's defaults take tens of seconds) and the tests' numerics:
# set for the cluster's processes, which inherit the driver's environment. The GCS keeps
# the events of Ray's last 100000 tasks by default, ~27 KB a request here, so over a
# run its RSS measures Ray's setting; capped, it measures the rest (docs/performance.md).
CLUSTER_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_initial_delay_ms": "1000", "RAY_USAGE_STATS_ENABLED": "0",
               "RAYLM_CPU_AUTO_BFLOAT16": "0", "RAY_task_events_max_num_task_in_gcs": "1000"}


def free_port() -> int:
    """A free port above Ray's worker ports (10002-19999) and below the kernel's ephemeral
    range: a port bind(0) hands out is an ephemeral one, which any process's outgoing
    connection (a Ray worker's, in a suite running beside this) may take before the soak's
    listener binds it."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{low}")


def engine_kwargs(tp: int, num_kv_blocks: int, max_num_seqs: int) -> dict[str, Any]:
    """The served engine's arguments (the offline reference takes the same, at TP=1)."""
    return {"dtype": "float32", "max_model_len": 512, "max_num_seqs": max_num_seqs,
            "num_kv_blocks": num_kv_blocks, "block_size": 16, "enable_prefix_caching": True,
            "tensor_parallel_size": tp, "distributed_executor_backend": "ray"}


def app_args(model_path: str, tp: int, num_kv_blocks: int, max_num_seqs: int) -> dict:
    return {"ingress_in_replica": False, "llm_configs": [{
        "model_loading_config": {"model_id": MODEL, "model_source": model_path},
        "engine_kwargs": engine_kwargs(tp, num_kv_blocks, max_num_seqs),
        "placement_group_config": {"bundles": [{"CPU": 1}, {"CPU": tp}],
                                   "strategy": "STRICT_PACK"},
        "deployment_config": {"num_replicas": 2, "max_ongoing_requests": 64,
                              "health_check_period_s": 2, "health_check_timeout_s": 20,
                              "request_router": {"policy": "prefix", "stats_period_s": 0.5}}}]}


def cluster_env():
    """CLUSTER_ENV set for the block (the cluster's processes start inside it), the
    environment restored after it."""
    return mock.patch.dict(os.environ, CLUSTER_ENV)


class SoakCluster:
    """Head + one worker node, Serve on 127.0.0.1, the app deployed (see the docstring)."""

    def __init__(self, app: dict, log=print, keep_logs: bool = False) -> None:
        self.app = app
        self.keep_logs = keep_logs
        self.log = log
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # Short: Ray's unix sockets live under it and their paths are limited to ~107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="rsk", dir="/tmp")
        self.cluster: Any = None
        self.worker: Any = None

    def _node_args(self) -> dict[str, Any]:
        return {"num_cpus": NODE_CPUS, "temp_dir": self.temp_dir,
                "dashboard_agent_listen_port": free_port(),
                "runtime_env_agent_port": free_port(), "metrics_export_port": free_port()}

    def start(self, timeout_s: float = 600) -> None:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        from raylm.cluster import build_openai_app

        if ray.is_initialized():
            raise RuntimeError("the soak starts a Ray cluster of its own: this process is "
                               "already connected to one")
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **self._node_args(), "include_dashboard": False})
        ray.init(address=self.cluster.address, log_to_driver=False)
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": self.port})
        serve._run(build_openai_app(self.app), name=APP, route_prefix="/", _blocking=False)
        # The ingress and the first model replica placed on the head, then the worker node.
        def placed() -> bool:
            names = [a["Name"] for a in alive_actors()]
            return (any(n.startswith(INGRESS_PREFIX) for n in names)
                    and any(n.startswith(REPLICA_PREFIX) for n in names))

        self.wait(placed, timeout_s, "the ingress and a model replica placed on the head")
        self.add_worker()
        self.wait(lambda: self.settled(), timeout_s, "both replicas running")

    def add_worker(self) -> None:
        self.worker = self.cluster.add_node(**self._node_args())
        self.cluster.wait_for_nodes()

    def remove_worker(self) -> str:
        node_id = self.worker.node_id
        self.cluster.remove_node(self.worker, allow_graceful=False)
        self.worker = None
        return node_id

    def replica_states(self) -> dict[str, int]:
        from ray import serve

        app = serve.status().applications.get(APP)
        dep = app.deployments.get(DEPLOYMENT) if app else None
        if dep is None:
            return {}
        return {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()}

    def settled(self) -> bool:
        """Every replica of the deployment running, none starting or stopping."""
        states = self.replica_states()
        return states.get("RUNNING", 0) == 2 and sum(states.values()) == 2

    @staticmethod
    def wait(cond, timeout_s: float, what: str, period_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:g} s")
            time.sleep(period_s)

    def shutdown(self) -> None:
        import ray
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        if not self.keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


# ---- who is who: the GCS actor table ---------------------------------------------------

def alive_actors() -> list[dict[str, Any]]:
    import ray

    return [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]


def _addr(a: dict[str, Any]) -> tuple[str, int]:
    return a["IPAddress"], a["Port"]


def replica_of(actor: dict[str, Any], actors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The model replica that owns ``actor`` (workers belong to an EngineCore actor, which
    belongs to a replica): follow the owner addresses up to a SERVE_REPLICA actor."""
    by_addr = {_addr(a["Address"]): a for a in actors}
    seen = 0
    while actor is not None and seen < 4:
        if actor["Name"].startswith(REPLICA_PREFIX):
            return actor
        actor = by_addr.get(_addr(actor["OwnerAddress"]))
        seen += 1
    return None


def model_replicas(actors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((a for a in actors if a["Name"].startswith(REPLICA_PREFIX)),
                  key=lambda a: a["Name"])


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the soak's start: the moment of the kill
    victim: str  # what was killed (actor class and pid, replica name, node id)
    replica: str  # the model replica it hit ("" when none could be named)
    recovered_at: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        rec = (f"recovered at {self.recovered_at:.1f} s "
               f"({self.recovered_at - self.at:.1f} s)" if self.recovered_at is not None
               else "NOT recovered")
        return f"{self.kind:<11} at {self.at:7.1f} s  {rec}  victim {self.victim}"


class FaultInjector:
    """Injects the soak's faults on ``cluster``; times are relative to ``t0``."""

    def __init__(self, cluster: SoakCluster, rng: random.Random, t0: float,
                 node_down_s: float = 3.0) -> None:
        self.cluster = cluster
        self.rng = rng
        self.t0 = t0
        self.node_down_s = node_down_s

    def now(self) -> float:
        return time.monotonic() - self.t0

    def inject(self, kind: str) -> Fault:
        actors = alive_actors()
        if kind in ("worker", "engine_core"):
            cls = {"worker": "WorkerActor", "engine_core": "EngineCoreActor"}[kind]
            candidates = sorted((a for a in actors if a["ActorClassName"] == cls),
                                key=lambda a: a["ActorID"])
            if not candidates:
                raise RuntimeError(f"no alive {cls} to kill")
            victim = self.rng.choice(candidates)
            replica = replica_of(victim, actors)
            at = self.now()
            os.kill(int(victim["Pid"]), signal.SIGKILL)
            return Fault(kind, at, f"{cls} pid {victim['Pid']}",
                         replica["Name"] if replica else "")
        if kind == "replica":
            import ray

            victim = self.rng.choice(model_replicas(actors))
            handle = ray.get_actor(victim["Name"], namespace="serve")
            at = self.now()
            ray.kill(handle, no_restart=True)
            return Fault(kind, at, f"{victim['Name']} pid {victim['Pid']}", victim["Name"])
        if kind == "node":
            node_id = self.cluster.worker.node_id
            hit = [a["Name"] for a in model_replicas(actors)
                   if a["Address"]["NodeID"] == node_id]
            at = self.now()
            self.cluster.remove_worker()
            removed = self.now()
            time.sleep(self.node_down_s)
            self.cluster.add_worker()
            return Fault(kind, at, f"worker node {node_id[:12]}", ",".join(hit),
                         detail={"removed_at": removed, "added_at": self.now()})
        raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULT_KINDS)}")

    def wait_recovered(self, fault: Fault, probe, timeout_s: float = 240.0) -> Fault:
        """Wait until the victim replica is gone, the deployment is settled and ``probe()``
        succeeds twice in a row; sets ``fault.recovered_at`` (stays None on timeout)."""
        victims = set(filter(None, fault.replica.split(",")))
        deadline = time.monotonic() + timeout_s
        ok_in_a_row = 0
        while time.monotonic() < deadline:
            names = {a["Name"] for a in model_replicas(alive_actors())}
            # Serve's status lags a killed actor: count the live replica actors too.
            if victims & names or len(names) != 2 or not self.cluster.settled():
                ok_in_a_row = 0
            elif probe():
                ok_in_a_row += 1
                if ok_in_a_row == 2:
                    fault.recovered_at = self.now()
                    return fault
            time.sleep(0.5)
        return fault


def probe_request(base_url: str, timeout_s: float = 30.0) -> bool:
    """One short greedy completion answered 200."""
    try:
        r = httpx.post(f"{base_url}/v1/completions", timeout=timeout_s, json={
            "model": MODEL, "prompt": [11, 12, 13], "max_tokens": 2, "temperature": 0,
            "ignore_eos": True})
    except httpx.HTTPError:
        return False
    return r.status_code == 200
