"""Autoscaling on the engines' signals (autoscaling_config.scale_on: engine_signals) on a
local Ray: a burst of requests that wait in the engine (a batch of 2) takes the model from 1
replica to 2, although its ongoing requests stay far below target_ongoing_requests (Serve's
own signal alone would not scale); when the burst ends it goes back to 1, and the prefix
router's view of the replicas follows. The test prints how long each step took."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from serve_helpers import running_serve_app

pytestmark = pytest.mark.ray

MODEL = "tiny-llama"
APP = "raylm-autoscale"


@pytest.fixture(scope="module")
def base_url(ray_local, llama_path):
    # ray_local pushes autoscaling metrics every 0.5 s (FAST_SERVE_METRICS), not 10 s.
    args = {"llm_configs": [{
        "model_loading_config": {"model_id": MODEL, "model_source": llama_path},
        "engine_kwargs": {"max_num_seqs": 2, "max_model_len": 512},
        "deployment_config": {
            "max_ongoing_requests": 64, "request_router": {"policy": "prefix",
                                                           "stats_period_s": 0.5},
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                   "target_ongoing_requests": 64,
                                   "scale_on": "engine_signals",
                                   "target_num_requests_waiting": 2,
                                   "upscale_delay_s": 0, "downscale_delay_s": 3,
                                   "look_back_period_s": 2}}}]}
    with running_serve_app(ray_local, args, APP) as url:
        yield url


def running_replicas() -> int:
    from ray import serve

    dep = serve.status().applications[APP].deployments[f"LLMServer:{MODEL}"]
    return dep.replica_states.get("RUNNING", 0)


def router_replicas(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("raylm:router_num_replicas{"):
            return float(line.split()[-1])
    return 0.0


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.25)
    return time.monotonic() - start


class Burst:
    """Keeps ``in_flight`` long requests running from a thread of its own until stopped."""

    def __init__(self, base_url: str, in_flight: int = 12) -> None:
        self.base_url, self.in_flight = base_url, in_flight
        self.stop = threading.Event()
        self.done = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="x",
                                      max_retries=0, timeout=300) as client:
            async def worker(w: int) -> None:
                i = 0
                while not self.stop.is_set():
                    await client.completions.create(
                        model=MODEL, prompt=[10 + w, 20 + i % 50] * 8, max_tokens=96,
                        extra_body={"ignore_eos": True})
                    self.done += 1
                    i += 1
            await asyncio.gather(*(worker(w) for w in range(self.in_flight)))

    def __enter__(self) -> Burst:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=300)


def test_waiting_requests_scale_out_and_the_end_of_the_burst_scales_back(base_url):
    assert running_replicas() == 1
    timings = {}
    with Burst(base_url) as burst:
        timings["1 -> 2 replicas running, from the burst's start"] = wait_for(
            lambda: running_replicas() == 2, 180, "a second replica")
        timings["the router sees 2"] = wait_for(lambda: router_replicas(base_url) == 2, 60,
                                                "the router's view of 2 replicas")
    assert burst.done > 0
    timings["2 -> 1 replica, from the burst's end"] = wait_for(
        lambda: running_replicas() == 1, 120, "back to one replica")
    timings["the router sees 1"] = wait_for(lambda: router_replicas(base_url) == 1, 60,
                                            "the router's view of 1 replica")
    print("\nautoscaling on engine signals, seconds waited: " +
          "; ".join(f"{k}: {v:.1f}" for k, v in timings.items()))
