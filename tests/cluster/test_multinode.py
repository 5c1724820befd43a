"""raylm on a multi-node Ray cluster on one machine (tests/cluster/multinode.py): a head
and two worker nodes, each its own ``ray start`` with its own HOME and cache.

Engines: PP=2 with one stage per node on the default (demo) model that each node writes
for itself, DP=2 with one rank per node, both greedy-equal to the single-process engine.
Serving: replicas on both nodes; autoscaling 1 -> 2 -> 1 under a bounded loopback load
with every request answered; a killed node (raylet) gives the open streams a clean error
within 30 s, and the app recovers. A killed replica process and a killed EngineCore actor
under load are the chaos soak's CI profile (tests/cluster/test_soak.py: a two-node
cluster too, every request accounted for). One cluster for the module: its start is the
slow part.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import threading
import time

import httpx
import pytest
from multinode import LocalCluster, free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [[5, 9, 33, 70, 2], [11, 400, 7]]


@pytest.fixture(scope="module")
def cluster(ray_multinode):
    """A head and node_a, node_b of one CPU each, with fast Serve autoscaling signals and
    node-death detection (conftest's ``ray_multinode``)."""
    yield ray_multinode.cluster


def _greedy(llm, max_tokens: int = 6) -> list[list[int]]:
    from raylm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def _reference(path: str) -> list[list[int]]:
    from raylm import LLM

    with LLM(path, num_kv_blocks=32, max_num_seqs=4) as llm:  # in this process
        return _greedy(llm)


def _worker_nodes(llm) -> list[str]:
    return [info["node_id"] for info in llm.llm_engine.core.info["worker_infos"]]


def test_ranks_on_two_nodes_resolve_the_default_model_on_each_node(cluster, tmp_path):
    """The driver's copy of the demo model has no weights: each rank must load the copy
    its own node writes (model_resolver), under that node's HOME. (PP stages spread over
    nodes; a TP group never does: it shares one bundle.)"""
    from raylm import LLM
    from raylm.cluster.demo import ensure_demo_model

    # The demo writer at its smallest size: what is tested is who writes it, and where.
    resolver = functools.partial(ensure_demo_model, None, "tiny")
    driver_copy = ensure_demo_model(str(tmp_path / "driver-demo"), "tiny")
    for f in glob.glob(os.path.join(driver_copy, "*.safetensors")):
        os.remove(f)  # the driver reads config and tokenizer only
    with LLM(driver_copy, pipeline_parallel_size=2, placement_group_strategy="STRICT_SPREAD",
             model_resolver=resolver, num_kv_blocks=32, max_num_seqs=4) as llm:
        nodes = _worker_nodes(llm)
        got = _greedy(llm)
    assert len(set(nodes)) == 2, nodes
    for node_id in nodes:
        home = os.path.join(cluster.node_dir(cluster.node_name(node_id)), "home")
        assert os.path.isfile(os.path.join(home, ".cache", "raylm", "demo-model",
                                           "model.safetensors")), os.listdir(home)
    node_copy = os.path.join(cluster.node_dir(cluster.node_name(nodes[0])), "home", ".cache",
                             "raylm", "demo-model")
    assert got == _reference(node_copy)


def test_dp2_one_rank_per_node_equals_single_process(cluster, llama_path):
    from raylm import LLM

    # Each node has one CPU: the two rank actors cannot share a node.
    with LLM(llama_path, data_parallel_size=2, num_kv_blocks=32, max_num_seqs=4) as llm:
        nodes = [info["node_id"] for info in llm.llm_engine.core.rank_infos]
        got = _greedy(llm)
    assert len(set(nodes)) == 2, nodes
    assert got == _reference(llama_path)


# ---- serving ----------------------------------------------------------------------------

def _llm_config(model_id: str, llama_path: str, **extra) -> dict:
    # One replica per worker node: its bundle asks for the node's one "replica_slot".
    return {"model_loading_config": {"model_id": model_id, "model_source": llama_path},
            "engine_kwargs": {"max_num_seqs": 8, "num_kv_blocks": 64, **extra.pop("engine", {})},
            "placement_group_config": {"bundles": [{"CPU": 1, "replica_slot": 1}, {"CPU": 1}]},
            **extra}


@pytest.fixture(scope="module")
def serve_port(cluster):
    from ray import serve

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


def _run_app(cluster: LocalCluster, name: str, config: dict, timeout_s: float = 180) -> None:
    """Deploys the app and waits until it runs; past ``timeout_s`` deletes it and fails with
    the cluster's state (a lost node or a replica that cannot be placed would otherwise
    keep serve.run waiting forever)."""
    from ray import serve

    from raylm.cluster import build_openai_app

    errors: list[BaseException] = []

    def deploy() -> None:
        try:
            serve.run(build_openai_app({"llm_configs": [config]}), name=name,
                      route_prefix=f"/{name}")
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    thread = threading.Thread(target=deploy, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    if thread.is_alive():
        state = f"{_replicas(name)}\n{cluster.diagnosis()}"
        serve.delete(name)  # its serve.run then ends: the app is gone
        raise AssertionError(f"app {name} not running within {timeout_s:g}s: {state}")


def _replicas(name: str) -> dict[str, int]:
    """Replica states of the app's LLMServer deployment."""
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None:
        return {}
    dep = next(d for n, d in app.deployments.items() if n.startswith("LLMServer"))
    return {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()}


def _running(name: str) -> int:
    return _replicas(name).get("RUNNING", 0)


def _wait(cond, timeout_s: float, what) -> None:
    """``what``: the failure's text, or a callable that says it when the wait fails."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what() if callable(what) else what}: "
                                 f"not within {timeout_s:g}s")
        time.sleep(0.25)


def _complete(url: str, model: str, max_tokens: int = 8, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout, json={
        "model": model, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def _processes(cluster: LocalCluster, node: str, title: str) -> list[int]:
    """Processes of ``node`` whose title (Ray sets ``ray::<actor>``) contains ``title``."""
    from multinode import _cmdline

    return [p for p in cluster._pids(cluster.node_dir(node) + os.sep) if title in _cmdline(p)]


def _nodes_running(cluster: LocalCluster, title: str) -> list[str]:
    return [n for n in cluster.specs for _ in _processes(cluster, n, title)]


def test_autoscaling_one_to_two_to_one_replicas_without_losing_a_request(cluster, serve_port,
                                                                         llama_path):
    from ray import serve

    url = f"http://127.0.0.1:{serve_port}/auto"
    counts: list[tuple[float, int]] = []
    results: list[int] = []
    stop = threading.Event()

    def client() -> None:  # closed loop: one request at a time, until told to stop
        while not stop.is_set():
            results.append(_complete(url, "m-auto", max_tokens=48, timeout=120).status_code)

    try:
        _run_app(cluster, "auto", _llm_config("m-auto", llama_path, deployment_config={
            "max_ongoing_requests": 4,
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                   "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
                                   "downscale_delay_s": 2, "look_back_period_s": 2}}))
        _wait(lambda: _running("auto") == 1, 60, "one replica at start")
        t0 = time.monotonic()
        clients = [threading.Thread(target=client) for _ in range(3)]
        for t in clients:
            t.start()
        try:
            def sample() -> int:
                n = _running("auto")
                counts.append((round(time.monotonic() - t0, 1), n))
                return n

            _wait(lambda: sample() == 2, 120, lambda: f"scale up to 2 under load (seen "
                  f"{counts[-5:]}, replicas {_replicas('auto')})\n{cluster.diagnosis()}")
        finally:
            stop.set()
            for t in clients:
                t.join(timeout=150)
        _wait(lambda: (counts.append((round(time.monotonic() - t0, 1), _running("auto")))
                       or counts[-1][1] == 1 and len(_replicas("auto")) == 1),
              90, lambda: f"scale back to 1 after the load (seen {counts[-5:]})")
    finally:
        serve.delete("auto")
    seen = [n for _, n in counts]
    assert seen[0] == 1 and 2 in seen and seen[-1] == 1, counts  # 1 -> 2 -> 1
    assert results and all(code == 200 for code in results), results


def _stream(url: str, model: str, events: list, max_tokens: int = 900) -> None:
    """Record ("token", t) per SSE chunk, then ("done"|"error"|"http", detail, t)."""
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=90) as r:
            if r.status_code != 200:
                r.read()
                events.append(("http", r.status_code, r.text, time.monotonic()))
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    events.append(("done", None, None, time.monotonic()))
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    events.append(("error", chunk["error"], None, time.monotonic()))
                    return
                events.append(("token", None, None, time.monotonic()))
        events.append(("cut", None, None, time.monotonic()))
    except httpx.HTTPError as e:
        events.append(("cut", repr(e), None, time.monotonic()))


def _clean_failure(events: list, killed_at: float) -> None:
    """The stream ended with an SSE error event or a 5xx OpenAI error JSON, within 30 s."""
    kind, detail, text, at = events[-1]
    assert kind in ("error", "http"), events[-3:]
    if kind == "http":
        assert detail >= 500 and "error" in json.loads(text), (detail, text)
    else:
        assert detail["code"] >= 500 and detail["message"], detail
    assert at - killed_at < 30, at - killed_at


def _kill_mid_stream(url: str, model: str, kill, n_streams: int = 1) -> tuple[list, float]:
    streams = [[] for _ in range(n_streams)]
    threads = [threading.Thread(target=_stream, args=(url, model, ev)) for ev in streams]
    # One at a time: a stream already running is in the router's count of its replica,
    # so the next goes to the other one (streams started together can all land on one).
    for t, ev in zip(threads, streams, strict=True):
        t.start()
        _wait(lambda ev=ev: any(e[0] == "token" for e in ev), 60, "a stream started")
    _wait(lambda: all(sum(e[0] == "token" for e in ev) >= 3 for ev in streams), 60,
          "streams started")
    killed_at = time.monotonic()
    kill()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a stream hung after the failure"
    return streams, killed_at


def _check_failed_streams(streams: list, killed_at: float, allow_cut: bool = False) -> None:
    """Every stream finished or ended cleanly within 30 s; at least one did not finish.
    ``allow_cut``: the killed node also ran an ingress replica, and a stream whose HTTP
    process died can only be cut (within 30 s too): nothing is left to send it an error."""
    ends = [ev[-1][0] for ev in streams]
    allowed = {"done", "error", "http"} | ({"cut"} if allow_cut else set())
    assert set(ends) <= allowed, [ev[-2:] for ev in streams]
    failed = [ev for ev in streams if ev[-1][0] != "done"]
    assert failed, "every stream finished: none was served by what was killed"
    for ev in failed:
        if ev[-1][0] == "cut":
            assert ev[-1][3] - killed_at < 30, ev[-1]
        else:
            _clean_failure(ev, killed_at)


@pytest.fixture(scope="module")
def two_replicas(cluster, serve_port, llama_path):
    """An app with two replicas, one per worker node (shared by the tests below, in order:
    placement, a killed replica process, a killed node)."""
    from ray import serve

    _run_app(cluster, "two", _llm_config("m-two", llama_path,
                                         deployment_config={"num_replicas": 2}))
    yield f"http://127.0.0.1:{serve_port}/two"
    serve.delete("two")


def test_serve_replicas_land_on_both_nodes(cluster, two_replicas):
    for _ in range(4):
        r = _complete(two_replicas, "m-two")
        assert r.status_code == 200, r.text
    nodes = _nodes_running(cluster, "ServeReplica:two:LLMServer")
    assert sorted(nodes) == ["node_a", "node_b"], nodes


def test_killed_node_gives_a_clean_error_and_serve_recovers(cluster, two_replicas):
    """One worker node's raylet is killed mid-stream (its workers die with it). Its streams
    end with a clean error within 30 s (or are cut, if that node also ran the ingress
    replica relaying them), the other node's finish; once the node is back (a
    new node, as KubeRay would start), Serve runs two replicas again and requests succeed."""
    # A worker node that runs a model replica, one without the ingress if there is one.
    # Where Serve restarted the previous test's killed replica is its choice: both model
    # replicas may now share a node, and killing the other node would hit nothing.
    ingress = _nodes_running(cluster, "ServeReplica:two:OpenAIIngress")
    serving = _nodes_running(cluster, "ServeReplica:two:LLMServer")
    victim = ([n for n in serving if n not in ingress] or serving)[0]
    streams, killed_at = _kill_mid_stream(two_replicas, "m-two",
                                          lambda: cluster.kill_raylet(victim), n_streams=4)
    _check_failed_streams(streams, killed_at, allow_cut=victim in ingress)
    cluster.start_node(victim)
    cluster.wait_for_nodes(3)
    _wait(lambda: _running("two") == 2, 120, "two replicas again")
    for _ in range(3):
        assert _complete(two_replicas, "m-two").status_code == 200
