"""Drive a DP engine client in tests: requests, a collector of its merged outputs, and a
wait for every rank to end its wave. Each wait is bounded by DEADLINE_S, so a hang
fails the test instead of stalling the suite."""

from __future__ import annotations

import random
import time

from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import FinishReason
from raylm.scheduler.request import Request
from raylm.scheduler.sampling_params import SamplingParams

DEADLINE_S = 120.0  # turns a hang into a failure; nothing asserts on time


def prompts(n: int, seed: int = 0, lo: int = 10, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def request(config: EngineConfig, rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               ignore_eos=True),
                   eos_token_ids=config.model_config.eos_token_ids,
                   max_model_len=config.model_config.max_model_len, sampling_seed=0)


class Collector:
    """Reads a client's merged outputs into per-request token lists."""

    def __init__(self, client) -> None:
        self.client = client
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}

    def read(self, timeout: float) -> None:
        out = self.client.get_output(timeout=timeout)
        for o in out.outputs if out is not None else []:
            assert o.request_id not in self.finish, f"output after finish: {o}"
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finish[o.request_id] = o.finish_reason

    def until_finished(self, request_ids) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not set(request_ids) <= set(self.finish):
            assert time.monotonic() < deadline, f"unfinished: {set(request_ids) - set(self.finish)}"
            self.read(timeout=1.0)


def wait_paused(client) -> dict:
    """Until every rank has ended its wave; the DP state then."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        state = client.get_dp_state()
        ranks = state["ranks"]
        waves = {r["num_waves_completed"] for r in ranks}
        if not any(r["running"] for r in ranks) and len(waves) == 1 and (
                state["coordinator"]["num_waves_completed"] in waves):
            return state
        assert time.monotonic() < deadline, f"DP ranks never paused: {state}"
        time.sleep(0.05)
