"""The prefill/decode KV pull by transport: Ray's object store against Ray Direct Transport.

    python bench/kv_transport.py [--sizes tiny,6m] [--tokens 512,2048,8192] [--runs 15]

One prefill rank and one decode rank per transport, each a real ``WorkerActor`` (one CPU,
one torch thread) whose worker is a stand-in holding only a ``RayKVConnectorWorker`` and
a KV cache of the model's shape (float32, blocks of 16; no weights, so 8192-token prompts
fit any model). The prefill rank registers a prompt's blocks as a finished prefill does;
the decode rank pulls them through the connector's real transport
(``RayKVTransport.fetch``, the payload turned into a tensor as the connector does before
it writes the cache), ``--runs`` times after one warm-up pull (for RDT the warm-up also
makes the rank pair's Gloo group; its time is printed apart), the transports taking
turns pull by pull. Latency: the median pull; bytes/s: the KV bytes over it. Same
machine, so both transports cross processes through host memory (object store: shared
memory and one copy; RDT: Gloo over loopback TCP).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCK = 16


class KVStubWorker:
    """Stands in for ``raylm.runner.worker.Worker`` in a WorkerActor: a KV connector and
    its cache, nothing else (``init_worker(worker_cls=...)``)."""

    def __init__(self, engine_config: Any, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        from types import SimpleNamespace

        from raylm.runner.kv_transfer.ray_pd import RayKVConnectorWorker

        self.config = engine_config
        self.connector = RayKVConnectorWorker(engine_config)
        self.model_runner = SimpleNamespace(kv_steps=SimpleNamespace(connector=self.connector))

    def init_device(self, ctx: Any, num_threads: int = 1, expect_cuda: bool = False) -> None:
        import torch

        torch.set_num_threads(num_threads)

    def make_cache(self, num_blocks: int) -> int:
        """Random KV for ``num_blocks`` blocks per layer; its bytes."""
        import torch

        hf = self.config.model_config.hf_config
        heads = int(hf["num_key_value_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
        shape = (num_blocks, heads, BLOCK, head_dim)
        caches = [(torch.randn(shape), torch.randn(shape))
                  for _ in range(int(hf["num_hidden_layers"]))]
        self.connector.register_kv_caches(caches)
        return sum(k.numel() * k.element_size() * 2 for k, _ in caches)

    def hold(self, request_id: str, num_blocks: int) -> None:
        """Register a finished prompt's blocks for reads, as its last prefill step does."""
        from raylm.scheduler.kv_transfer.ray_pd import RayKVMetadata

        self.connector.bind_connector_metadata(
            RayKVMetadata(sends={request_id: list(range(num_blocks))}))
        self.connector.start_load_kv()

    def pull(self, engine_id: str, request_id: str, heads: int, runs: int,
             warm_up: bool = True) -> dict[str, Any]:
        """A warm-up pull (unless not ``warm_up``), then ``runs`` timed ones; seconds each
        and the bytes."""
        from raylm.runner.kv_transfer.ray_pd import unpack

        transport = self.connector.transport

        def once() -> tuple[float, int]:
            start = time.perf_counter()
            data = unpack(transport.fetch(engine_id, 0, request_id, 0, 0, heads, 60.0))
            return time.perf_counter() - start, data.numel() * data.element_size()

        warm, nbytes = once() if warm_up else (0.0, 0)
        times = [once()[0] for _ in range(runs)]
        return {"warm_up": warm, "times": times, "bytes": nbytes,
                "transport": transport.kind}


def _engine_config(size: str, role: str, transport: str, max_tokens: int):
    from dataclasses import asdict

    from raylm.cluster.engine.engine_args import EngineArgs
    from raylm.runner.loading.checkpoint import SPECS

    spec = asdict(SPECS[size])
    hf = {k: v for k, v in spec.items() if k not in ("seed", "initializer_range")}
    hf["architectures"] = [hf.pop("architecture")]
    hf["max_position_embeddings"] = max_tokens
    hf["head_dim"] = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    args = EngineArgs.from_kwargs(f"stub-{size}", dtype="float32", block_size=BLOCK,
                                  max_model_len=max_tokens, kv_transfer_config={
                                      "kv_connector": "RayKVConnector", "kv_role": role,
                                      "kv_connector_extra_config": {"transport": transport}})
    return args.create_engine_config(hf_config=hf), hf


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ray

    from raylm.actors.kv_transfer.kv_transport import KV_NAMESPACE, engine_actor_name
    from raylm.actors.worker_actor import WorkerActor

    @ray.remote(num_cpus=0)
    class Directory:
        """The prefill engine's name in the KV namespace: hands out its worker."""

        def __init__(self, workers: list[Any]) -> None:
            self.workers = workers

        def kv_worker_handles(self) -> list[Any]:
            return self.workers

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    try:
        for size in args.sizes.split(","):
            config, hf = _engine_config(size, "kv_producer", "object_store", max(tokens))
            producer = WorkerActor.options(num_cpus=1).remote(0, 1)
            ray.get(producer.init_worker.remote(config, None, worker_cls=KVStubWorker))
            engine_id = str(config.kv_transfer_config.engine_id)
            directory = Directory.options(  # noqa: F841 - alive while the pulls run
                name=engine_actor_name(engine_id), namespace=KV_NAMESPACE).remote([producer])
            ray.get(producer.call.remote("make_cache", max(tokens) // BLOCK))
            for n in tokens:
                ray.get(producer.call.remote("hold", f"r{n}", n // BLOCK))
            consumers = {}
            for transport in args.transports.split(","):
                consumer_config, _ = _engine_config(size, "kv_consumer", transport, max(tokens))
                consumers[transport] = WorkerActor.options(num_cpus=1).remote(0, 1)
                ray.get(consumers[transport].init_worker.remote(
                    consumer_config, None, worker_cls=KVStubWorker))
                ray.get(consumers[transport].call.remote("make_cache", max(tokens) // BLOCK))
            heads = int(hf["num_key_value_heads"])
            for n in tokens:
                # The transports take turns, pull by pull: the box's load drifts alike.
                out = {t: ray.get(c.call.remote("pull", engine_id, f"r{n}", heads, 0))
                       for t, c in consumers.items()}
                for _ in range(args.runs):
                    for t, c in consumers.items():
                        one = ray.get(c.call.remote("pull", engine_id, f"r{n}", heads, 1,
                                                    warm_up=False))
                        out[t]["times"] += one["times"]
                for transport, got in out.items():
                    assert got["transport"] == transport, got["transport"]
                    median = statistics.median(got["times"])
                    rows.append({"size": size, "tokens": n, "transport": transport,
                                 "bytes": got["bytes"], "median_s": median,
                                 "warm_up_s": got["warm_up"]})
                    print(f"{size} {n} {transport}: median {1e3 * median:.2f} ms",
                          file=sys.stderr, flush=True)
            for consumer in consumers.values():
                ray.get(consumer.shutdown.remote())
                ray.kill(consumer)
            ray.get(producer.shutdown.remote())
            ray.kill(producer)
    finally:
        ray.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,6m")
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--transports", default="object_store,rdt")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    rows = run(args)
    by = {(r["size"], r["tokens"], r["transport"]): r for r in rows}
    print(f"median of {args.runs} pulls after one warm-up; one prefill and one decode "
          "WorkerActor, 1 CPU each, same machine")
    print("| model | prompt tokens | KV bytes | transport | latency (ms) | MB/s | "
          "vs object store | first pull (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = by.get((r["size"], r["tokens"], "object_store"))
        ratio = f"{ref['median_s'] / r['median_s']:.2f}x" if ref else "-"
        print(f"| {r['size']} | {r['tokens']} | {r['bytes']} | {r['transport']} | "
              f"{1e3 * r['median_s']:.2f} | {r['bytes'] / r['median_s'] / 1e6:.0f} | "
              f"{ratio} | {1e3 * r['warm_up_s']:.1f} |")


if __name__ == "__main__":
    main()
