"""The prefix-aware Serve request router without a cluster: Serve's RequestRouter base with
fake replicas (their queue lengths and routing stats), driven as Serve's router drives it:
update_replicas, choose_replicas, on_send_request, on_request_routed. The prompt hasher on
the tiny Llama's tokenizer and chat template; the config and CLI that select the router."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from raylm.actors.prefix_affinity import (
    ADAPTER_MATCH,
    LEAST_LOADED,
    MOST_FREE_KV,
    NO_PROMPT,
    PREFIX_MATCH,
    prompt_block_hashes,
)
from raylm.cluster.serve.deployment.router import PrefixAwareRouter
from raylm.cluster.serve.deployment.router_prompt import PromptHasher
from raylm.cluster.serve.deployment.router_stats import find_router_view

BLOCK = 4


class FakeHasher:
    block_size = BLOCK
    adapters_per_replica = 2

    def hashes(self, route, body):
        return prompt_block_hashes(body["ids"], BLOCK, self.adapter(body)) \
            if "ids" in body else None

    def adapter(self, body):
        return body.get("model")


class FakeReplica:
    def __init__(self, name: str, dep: DeploymentID, kv_blocks: int = 1000, usage: float = 0.0):
        self.replica_id = ReplicaID(name, dep)
        self.routing_stats = {"num_kv_blocks": kv_blocks, "kv_cache_usage_perc": usage}
        self.max_ongoing_requests = 16
        self.queue_len = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


class FakeResult:
    """A routed request's result: ``complete`` runs the done callbacks (as Serve's does
    from another thread)."""

    def __init__(self) -> None:
        self.callbacks = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def complete(self) -> None:
        for callback in self.callbacks:
            callback(None)


class Harness:
    """A router and the replicas it sees; ``route`` plays Serve's part for one request."""

    def __init__(self, names, **rule) -> None:
        self.dep = DeploymentID(name=f"LLMServer:{uuid.uuid4().hex[:6]}", app_name="test")
        self.router = PrefixAwareRouter(deployment_id=self.dep,
                                        handle_source=DeploymentHandleSource.UNKNOWN,
                                        use_replica_queue_len_cache=True)
        self.router.initialize_state(hasher=FakeHasher(), **rule)
        self.replicas = {n: FakeReplica(n, self.dep) for n in names}
        self.router.update_replicas(list(self.replicas.values()))
        self.results = {n: [] for n in names}  # routed and not finished, per replica

    def set_replicas(self, names) -> None:
        self.replicas = {n: self.replicas.get(n) or FakeReplica(n, self.dep) for n in names}
        self.router.update_replicas(list(self.replicas.values()))
        self.results = {n: self.results.get(n, []) for n in names}

    async def choose(self, body) -> tuple[PendingRequest, FakeReplica]:
        await asyncio.sleep(0)  # completions' callbacks reach the loop first
        meta = RequestMetadata(request_id="r", internal_request_id=uuid.uuid4().hex,
                               call_method="handle")
        pending = PendingRequest(args=["/v1/completions", body], kwargs={}, metadata=meta)
        ranks = await self.router.choose_replicas(list(self.replicas.values()), pending)
        return pending, next(r for (r,) in ranks if r.queue_len < r.max_ongoing_requests)

    def send(self, pending: PendingRequest, chosen: FakeReplica) -> str:
        chosen.queue_len += 1
        self.router.on_send_request(chosen.replica_id)
        result = FakeResult()
        self.router.on_request_routed(pending, chosen.replica_id, result)
        name = chosen.replica_id.unique_id
        self.results[name].append(result)
        return name

    async def route(self, body) -> str:
        return self.send(*await self.choose(body))

    def finish(self, name: str) -> None:
        self.replicas[name].queue_len -= 1
        self.router.decrement_queue_len_cache(self.replicas[name].replica_id)
        self.results[name].pop(0).complete()

    def decisions(self):
        return find_router_view(self.dep.app_name, self.dep.name).decisions()


def _prompt(prefix: int, i: int, prefix_len: int = 32) -> dict:
    return {"ids": [prefix] * prefix_len + [100 + i] * 8}


def test_a_shared_prefix_stays_on_its_replica_while_load_is_balanced():
    async def main():
        h = Harness("ABC", imbalance_threshold=3)
        homes = {}
        for i in range(4):
            for prefix in (1, 2, 3):
                name = await h.route(_prompt(prefix, i))
                assert homes.setdefault(prefix, name) == name, (prefix, i)
                h.finish(name)  # one at a time: the load stays balanced
        assert h.decisions() == {MOST_FREE_KV: 3, PREFIX_MATCH: 9}
        # A prompt of no known prefix goes where the most KV is free.
        h.replicas["B"].routing_stats["kv_cache_usage_perc"] = 0.0
        h.replicas["A"].routing_stats["kv_cache_usage_perc"] = 0.7
        h.replicas["C"].routing_stats["kv_cache_usage_perc"] = 0.5
        h.router.update_replicas(list(h.replicas.values()))
        assert await h.route(_prompt(9, 0)) == "B"
        assert await h.route({"no": "prompt"}) in "AC"  # least loaded: B holds one now
        assert h.decisions()[NO_PROMPT] == 1
    asyncio.run(main())


def test_a_hot_prefix_spills_over_once_its_replica_runs_ahead():
    async def main():
        h = Harness("AB", imbalance_threshold=2)
        served = [await h.route(_prompt(1, i)) for i in range(8)]  # none finishes
        home = served[0]
        # Affinity until the home runs 3 ahead: the other replica gets one (and holds the
        # prefix from then on, so the two share it by load).
        assert served[:4] == [home] * 3 + [served[3]] and served[3] != home
        assert h.decisions()[LEAST_LOADED] == 1
        counts = {n: served.count(n) for n in "AB"}
        assert abs(counts["A"] - counts["B"]) <= 3, counts
    asyncio.run(main())


def test_a_burst_chosen_before_any_acceptance_still_spills():
    """Serve routes a burst's requests concurrently: each is chosen before the earlier
    ones are accepted, and each acceptance resets Serve's cached queue length to what the
    replica counted then. The router's own counts still see the pile-up."""
    async def main():
        h = Harness("ABC", imbalance_threshold=2)
        home = await h.route(_prompt(1, 0))
        h.finish(home)
        chosen = [await h.choose(_prompt(1, i)) for i in range(1, 10)]  # none sent yet
        served = []
        for pending, replica in chosen:
            served.append(h.send(pending, replica))
            # The replica's answer at acceptance: it runs only this one so far.
            h.router.on_new_queue_len_info(replica.replica_id, 1)
        assert served[:3] == [home] * 3 and len(set(served)) == 3, served
        counts = {n: served.count(n) for n in "ABC"}
        assert max(counts.values()) - min(counts.values()) <= 3, counts
        # Completions free the counts: one at a time again, the prefix goes home.
        for name in served:
            h.finish(name)
        await asyncio.sleep(0.01)
        assert h.router._inflight.load(home) == 0
    asyncio.run(main())


def test_inflight_counts_expire_unrouted_choices_and_forget_departed_replicas():
    from raylm.cluster.serve.deployment.router_inflight import InflightCounts

    now = [0.0]
    c = InflightCounts(choice_ttl_s=5.0, clock=lambda: now[0])
    c.choose("r1", "A")
    c.choose("r2", "A")
    c.choose("r2", "B")  # a retry moves its choice
    assert (c.load("A"), c.load("B"), c.load("A", excluding="r1")) == (1, 1, 0)
    c.route("r1", "A")
    assert c.load("A") == 1
    now[0] = 6.0  # r2 was cancelled before routing: its choice expires
    assert (c.load("A"), c.load("B")) == (1, 0)
    c.finish("A")
    c.finish("A")  # never below zero
    assert c.load("A") == 0
    c.route("r3", "B")
    c.sync(["A"])
    assert c.load("B") == 0
    with pytest.raises(ValueError, match="choice_ttl_s"):
        InflightCounts(choice_ttl_s=0)


def test_replicas_that_leave_are_forgotten_and_new_ones_join_empty():
    async def main():
        h = Harness("AB", imbalance_threshold=8)
        home = await h.route(_prompt(1, 0))
        h.finish(home)
        other = "B" if home == "A" else "A"
        h.set_replicas([other, "C"])  # the home drained away, C joined
        assert set(h.router._index.engines()) == {other, "C"}
        assert h.router._index.num_blocks("C") == 0
        assert find_router_view(h.dep.app_name, h.dep.name).replica_stats().keys() == {other, "C"}
        # Nobody holds the prefix now: no match decides.
        await h.route(_prompt(1, 1))
        assert PREFIX_MATCH not in h.decisions()
        # A replica Serve reports dead goes at once.
        h.router.on_replica_actor_died(h.replicas["C"].replica_id)
        assert set(h.router._index.engines()) == {other}
        # The capacity each replica reports bounds its mirror (blocks, LRU first).
        h.replicas[other].routing_stats["num_kv_blocks"] = 4
        h.router.update_replicas([h.replicas[other]])
        assert h.router._index.num_blocks(other) <= 4
    asyncio.run(main())


def test_prompt_hasher_renders_chats_and_tokenizes_text_as_the_replica_does(llama_path):
    from transformers import AutoTokenizer

    from raylm.cluster.engine.chat_utils import apply_chat_template

    tok = AutoTokenizer.from_pretrained(llama_path)
    config = {"model_loading_config": {"model_id": "m", "model_source": llama_path},
              "engine_kwargs": {"block_size": 8}}
    hasher = PromptHasher(config, tokenizer=tok)
    messages = [{"role": "system", "content": "you are a helpful router " * 8},
                {"role": "user", "content": "hello"}]
    _, ids = apply_chat_template(tok, messages)
    assert hasher.hashes("/v1/chat/completions", {"model": "m", "messages": messages}) == \
        prompt_block_hashes(ids, 8)
    text = "the quick brown fox " * 10
    assert hasher.hashes("/v1/completions", {"model": "m", "prompt": text}) == \
        prompt_block_hashes(tok(text).input_ids, 8)
    assert hasher.hashes("/v1/completions", {"prompt": [5] * 20}) == prompt_block_hashes([5] * 20, 8)
    # Another served name (an adapter) keys its own blocks; unreadable bodies hash to None.
    assert not set(hasher.hashes("/v1/completions", {"model": "adapter", "prompt": [5] * 20})) & \
        set(prompt_block_hashes([5] * 20, 8))
    # An adapter's two spellings are one adapter.
    assert hasher.adapter({"model": "m:adapter"}) == hasher.adapter({"model": "adapter"}) == \
        "adapter"
    assert hasher.adapter({"model": "m"}) is None and hasher.adapter({}) is None
    assert hasher.hashes("/v1/completions", {"model": "m:adapter", "prompt": [5] * 20}) == \
        hasher.hashes("/v1/completions", {"model": "adapter", "prompt": [5] * 20})
    assert hasher.hashes("/v1/chat/completions", {"messages": "not a list"}) is None
    assert hasher.hashes("/tokenize", {"prompt": "x"}) is None
    off = PromptHasher({**config, "engine_kwargs": {"enable_prefix_caching": False}},
                       tokenizer=tok)
    assert off.hashes("/v1/completions", {"prompt": [5] * 20}) is None


def test_config_and_cli_select_the_router_and_the_engine_signal_policy():
    from raylm.cluster.cli import build_llm_config, build_parser, serve_app_args
    from raylm.cluster.serve.deployment.app import llm_server_options

    args = build_parser().parse_args(
        ["serve", "demo-random", "--request-router", "prefix", "--max-replicas", "3",
         "--scale-on", "engine_signals", "--target-num-requests-waiting", "2"])
    config = build_llm_config(args)
    opts = llm_server_options(config)
    assert opts["request_router_config"].request_router_class.endswith(":PrefixAwareRouter")
    policy = opts["autoscaling_config"]["policy"]
    assert policy["policy_function"].endswith(":EngineSignalPolicy")
    assert policy["policy_kwargs"]["target_num_requests_waiting"] == 2
    # Several replicas behind the prefix router: the routes move to an ingress deployment.
    assert serve_app_args(args, config)["ingress_in_replica"] is False
    one = build_parser().parse_args(["serve", "demo-random", "--request-router", "prefix"])
    assert serve_app_args(one, build_llm_config(one))["ingress_in_replica"] is True
    pow2 = build_parser().parse_args(["serve", "demo-random", "--num-replicas", "2"])
    assert serve_app_args(pow2, build_llm_config(pow2))["ingress_in_replica"] is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--request-router", "random"])


def test_requests_for_an_adapter_go_to_the_replica_that_holds_it():
    async def main():
        h = Harness("ABC", imbalance_threshold=3)
        homes = {}
        for i in range(4):
            for adapter in ("x", "y"):
                # No shared prefix: every prompt starts with its own block.
                body = {"model": adapter, "ids": [1000 + 10 * i + ord(adapter)] * 8}
                name = await h.route(body)
                assert homes.setdefault(adapter, name) == name, (adapter, i)
                h.finish(name)
        assert h.decisions() == {MOST_FREE_KV: 2, ADAPTER_MATCH: 6}
        # A replica keeps its last two adapters: a third and a fourth on x's replica push
        # x out, and x goes by free KV again.
        home = homes["x"]
        others = [n for n in "ABC" if n != home]
        for n in others:  # the other replicas look fuller: new adapters go to x's home
            h.replicas[n].routing_stats["kv_cache_usage_perc"] = 0.9
        h.router.update_replicas(list(h.replicas.values()))
        for adapter in ("z", "w"):
            assert await h.route({"model": adapter, "ids": [7] * 8}) == home
            h.finish(home)
        h.replicas[home].routing_stats["kv_cache_usage_perc"] = 0.95
        h.router.update_replicas(list(h.replicas.values()))
        assert await h.route({"model": "x", "ids": [8] * 8}) in others
    asyncio.run(main())
