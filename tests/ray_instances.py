"""One Ray at a time for the whole test run, each topology started once.

A Ray instance costs seconds of the 2-core machine's time to start (GCS, raylet, agents,
prestarted workers) and as much to stop. Test modules ask for a topology through a fixture
(``ray_local``, ``ray_gpu_node``, ...); conftest orders the modules so that those asking
for the same topology run one after another, and ``RayInstances`` keeps the instance up
until a module asks for another. Every ``ray.init`` of the test process is counted, with
the test that made it, and the count is printed at the end of the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Callable, Iterator

import ray

# Replicas push autoscaling metrics every 10 s by default; Serve reads these when Ray
# starts (replicas inherit them). Fast pushes let the autoscaling tests see a burst in time.
FAST_SERVE_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                      "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class RayInstance:
    """A started topology: what its modules need to reach it."""

    topology: str
    stop: Callable[[], None]
    cluster: object | None = None  # ray.cluster_utils.Cluster or tests' LocalCluster
    serve_port: int | None = None  # Serve's HTTP proxy, once a module started Serve

    def serve_url(self) -> str:
        """Serve's loopback URL on this instance, starting Serve the first time."""
        from ray import serve

        if self.serve_port is None:
            self.serve_port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": self.serve_port})
        return f"http://127.0.0.1:{self.serve_port}"

    @contextlib.contextmanager
    def serve_app(self, app, name: str) -> Iterator[str]:
        """``app`` deployed as ``name`` at ``/``; deleted (replicas and all) on exit."""
        from ray import serve

        url = self.serve_url()
        serve.run(app, name=name, route_prefix="/")
        try:
            yield url
        finally:
            serve.delete(name)


class RayInstances:
    """The run's Ray instances, one at a time (see the module docstring)."""

    def __init__(self) -> None:
        self.current: RayInstance | None = None
        self.inits: list[str] = []  # one line per ray.init in this process: who called it
        self.killed: list[str] = []  # actors modules left alive, killed after them
        self.test = "(collection)"
        self._real_init = ray.init

    def install_counter(self) -> None:
        """Count every ``ray.init`` of this process, the product's own included."""
        def counted_init(*args, **kwargs):
            self.inits.append(f"{self.test}: address={kwargs.get('address', args[0] if args else None)!r}")
            return self._real_init(*args, **kwargs)

        ray.init = counted_init

    def uninstall_counter(self) -> None:
        ray.init = self._real_init

    def use(self, topology: str, start: Callable[[], RayInstance]) -> RayInstance:
        if self.current is not None and self.current.topology == topology:
            return self.current
        self.close()
        if ray.is_initialized():  # a test's own, never ours: it must not leak into others
            raise RuntimeError(f"Ray was left initialized before {self.test} ({topology})")
        self.current = start()
        return self.current

    def close(self) -> None:
        if self.current is not None:
            instance, self.current = self.current, None
            if instance.serve_port is not None:
                from ray import serve

                serve.shutdown()
            instance.stop()

    def end_module(self) -> list[str]:
        """Kill the actors a module left alive on the shared instance (detached ones, as
        Serve's controller and proxies, stay): the next module starts from an idle
        cluster. Returns their class names."""
        if self.current is None or not ray.is_initialized():
            return []
        left = [a for a in ray._private.state.actors().values()
                if a["State"] == "ALIVE" and not a["IsDetached"]]
        core_worker = ray._private.worker.global_worker.core_worker
        for a in left:  # what ray.kill does, for actors this process holds no handle to
            with contextlib.suppress(Exception):
                core_worker.kill_actor(ray.ActorID(bytes.fromhex(a["ActorID"])), True)
        names = [a.get("ActorClassName", "?") for a in left]
        if names:
            self.killed.append(f"{self.test}: {names}")
        return names


def start_local(num_cpus: int, num_gpus: int = 0, topology: str = "local") -> RayInstance:
    """A single-node Ray of this process (``address="local"``: never a cluster ``ray
    start`` left on the machine), with ``num_cpus`` logical CPUs and ``num_gpus``
    declared GPUs."""
    saved = {k: os.environ.get(k) for k in FAST_SERVE_METRICS}
    os.environ.update(FAST_SERVE_METRICS)
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             log_to_driver=False)

    def stop() -> None:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return RayInstance(topology, stop)


def start_cluster(topology: str, head: dict, workers: list[dict]) -> RayInstance:
    """A ``ray.cluster_utils.Cluster`` of several nodes on this machine, this process its
    driver."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=head)
    for node in workers:
        cluster.add_node(**node)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()

    def stop() -> None:
        ray.shutdown()
        cluster.shutdown()

    return RayInstance(topology, stop, cluster=cluster)
