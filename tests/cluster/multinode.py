"""A multi-node Ray cluster on one machine, for tests: a head and worker nodes started as
separate ``ray start`` processes, each with its own ``--temp-dir``, ports, custom
resources (``{"node_a": 1}``), optional fake GPUs, and its own ``HOME`` and
``RAYLM_CACHE_DIR`` so that no file is shared between nodes by accident.

Nodes run this interpreter (``sys.executable -m ray.scripts.scripts``), so their workers
import the raylm under test. Teardown never runs ``ray stop`` (it would stop every Ray on
the machine): it kills the processes whose command line names this cluster's folder,
with their descendants.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


def auth_env() -> dict[str, str]:
    """Ray's token authentication as this (driver) process has it: Ray fixes the mode once
    per process (an earlier local ``ray.init`` turns it on; a first explicit-address one
    leaves it off), and a driver with token auth on rejects the calls of nodes without it
    (the cluster then loses track of the driver's actors). The nodes get the driver's token
    itself, since each node's HOME (where Ray keeps it) differs here."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    if not is_token_auth_enabled():
        return {"RAY_AUTH_MODE": "disabled"}
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if not token and os.path.isfile(path):
        with open(path) as f:
            token = f.read().strip()
    assert token, f"token authentication is on but no token in RAY_AUTH_TOKEN or {path}"
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class NodeSpec:
    name: str
    num_cpus: int
    num_gpus: int = 0
    resources: dict[str, float] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class LocalCluster:
    def __init__(self, head: NodeSpec, workers: list[NodeSpec]) -> None:
        # Short: Ray's unix sockets live under it and paths are limited to ~107 bytes.
        self.root = tempfile.mkdtemp(prefix="rlmc", dir="/tmp")
        self.head = head
        self.specs = {s.name: s for s in [head, *workers]}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._starts: dict[str, int] = {}
        self._auth = auth_env()

    # ---- nodes ------------------------------------------------------------------------
    def node_dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def node_env(self, spec: NodeSpec) -> dict[str, str]:
        home = os.path.join(self.node_dir(spec.name), "home")
        # raylm's settings travel (the test session's numerics); its per-node paths do not.
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "HOME", "RAYLM_CACHE_DIR", "RAYLM_DEMO_MODEL_DIR")}
        env.update(RAY_ENV, **self._auth, HOME=home, RAYLM_CACHE_DIR=os.path.join(home, ".cache", "raylm"),
                   **spec.env)
        return env

    def start_node(self, name: str) -> None:
        self._wait_started(name, self._start_node(name))

    def _wait_started(self, name: str, proc: subprocess.Popen) -> None:
        out, err = proc.communicate(timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start of node {name} failed:\n{out}\n{err}")

    def _start_node(self, name: str) -> subprocess.Popen:
        spec = self.specs[name]
        n = self._starts[name] = self._starts.get(name, 0) + 1
        temp = os.path.join(self.node_dir(name), f"t{n}")
        os.makedirs(os.path.join(self.node_dir(name), "home"), exist_ok=True)
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start",
               "--node-ip-address=127.0.0.1", f"--temp-dir={temp}",
               f"--num-cpus={spec.num_cpus}", f"--num-gpus={spec.num_gpus}",
               f"--resources={json.dumps(spec.resources)}",
               "--object-store-memory=100000000", "--disable-usage-stats",
               f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
               f"--dashboard-agent-listen-port={free_port()}",
               f"--dashboard-agent-grpc-port={free_port()}",
               f"--runtime-env-agent-port={free_port()}",
               f"--metrics-export-port={free_port()}"]
        if spec is self.head:
            cmd += ["--head", f"--port={self.port}", "--include-dashboard=false",
                    f"--ray-client-server-port={free_port()}"]
        else:
            cmd += [f"--address={self.address}"]
        return subprocess.Popen(cmd, env=self.node_env(spec), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def start(self, timeout_s: float = 120.0) -> None:
        try:
            self.start_node(self.head.name)
            # The worker nodes join concurrently: each `ray start` spends seconds importing.
            procs = {n: self._start_node(n) for n in self.specs if n != self.head.name}
            for name, proc in procs.items():
                self._wait_started(name, proc)
            self.wait_for_nodes(len(self.specs), timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def alive_nodes(self) -> list[dict]:
        import ray

        return [n for n in ray.nodes() if n["Alive"]]

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        """Connects this process as the driver if it is not yet; waits for ``count`` nodes."""
        import ray

        if not ray.is_initialized():
            # For this driver's ray.init (a no-op if Ray fixed the mode in this process).
            self._saved_env = {k: os.environ.get(k) for k in self._auth}
            os.environ.update(self._auth)
            ray.init(address=self.address, log_to_driver=False)
        deadline = time.monotonic() + timeout_s
        while len(self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.alive_nodes())} of {count} Ray nodes alive "
                                   f"after {timeout_s:g}s")
            time.sleep(0.5)

    def node_id(self, name: str) -> str:
        """The Ray node id of node ``name`` (its custom resource ``name`` marks it)."""
        for node in self.alive_nodes():
            if node["Resources"].get(name, 0) > 0:
                return node["NodeID"]
        raise KeyError(f"no alive node holds resource {name!r}")

    def node_name(self, node_id: str) -> str:
        for node in self.alive_nodes():
            if node["NodeID"] == node_id:
                return next(n for n in self.specs if node["Resources"].get(n, 0) > 0)
        raise KeyError(node_id)

    def diagnosis(self, lines: int = 8) -> str:
        """What a failed wait should say: each node alive or not with its free resources,
        and the last lines of its raylet log that tell of deaths and kills."""
        import glob

        import ray
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
        out = []
        for node in ray.nodes():
            name = next((n for n in self.specs if node["Resources"].get(n, 0) > 0), "?")
            have = {k: v for k, v in free.get(node["NodeID"], {}).items()
                    if not k.startswith(("node:", "memory", "object_store"))}
            out.append(f"{name}: alive={node['Alive']} free={have}")
            logs = {os.path.realpath(p) for p in glob.glob(os.path.join(
                self.node_dir(name), "t*", "session_*", "logs", "raylet.out"))}
            for log in sorted(logs):
                with open(log, errors="replace") as f:
                    hits = [ln.rstrip() for ln in f if "[state-dump]" not in ln and any(
                        w in ln for w in ("Killing", "killed", "memory", "dead", "Dead",
                                          "failed", "FATAL"))]
                out += [f"  {ln[:300]}" for ln in hits[-lines:]]
        return "\n".join(out)

    # ---- processes -------------------------------------------------------------------------
    def _pids(self, marker: str) -> list[int]:
        """Processes naming ``marker`` in their command line, and all their descendants."""
        roots = [int(p) for p in os.listdir("/proc") if p.isdigit()
                 and int(p) != os.getpid() and marker in _cmdline(int(p))]
        tree, found, todo = _children(), [], list(roots)
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.append(pid)
                todo.extend(tree.get(pid, []))
        return found

    def raylet_pid(self, name: str) -> int:
        marker = self.node_dir(name) + os.sep
        pids = [p for p in self._pids(marker) if "/raylet/raylet" in _cmdline(p)
                and marker in _cmdline(p)]
        if len(pids) != 1:
            raise RuntimeError(f"expected one raylet for node {name}, found {pids}")
        return pids[0]

    def kill_raylet(self, name: str) -> None:
        """A node failure as Ray sees one: its raylet dies (SIGKILL), its workers with it."""
        os.kill(self.raylet_pid(name), signal.SIGKILL)

    def kill_node(self, name: str) -> None:
        self._kill(self._pids(self.node_dir(name) + os.sep))

    @staticmethod
    def _kill(pids: list[int]) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGTERM:
                time.sleep(1.0)

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for k, v in getattr(self, "_saved_env", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._kill(self._pids(self.root + os.sep))
        shutil.rmtree(self.root, ignore_errors=True)
