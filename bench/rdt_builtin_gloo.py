"""Why the PD pull does not use Ray's own ``tensor_transport="gloo"`` (Ray 2.60): a repro.

    python bench/rdt_builtin_gloo.py

It works between two fresh actors, but (1) its group is torch.distributed's default group
of each actor process, (2) an actor can be in one group per backend, (3) creating a group
waits for the actors' default concurrency group, and (4) a process that already owns its
default group (a TP rank) cannot join. raylm's transport (``raylm.actors.kv_transfer.kv_rdt``) keeps
Ray's RDT and uses a process group of its own per pair instead.
"""

from __future__ import annotations

import time

import ray
import torch
from ray.experimental.collective import create_collective_group


@ray.remote(concurrency_groups={"other": 1}, enable_tensor_transport=True)
class Rank:
    def make(self) -> dict:
        return {"kv": torch.ones(4)}

    def take(self, payload: dict) -> float:
        return float(payload["kv"].sum())

    def default_group(self) -> tuple[bool, int | None]:
        import torch.distributed as dist

        return dist.is_initialized(), dist.get_world_size() if dist.is_initialized() else None

    def own_world(self) -> None:  # as a TP rank's init_distributed_environment does
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)

    def busy(self, seconds: float) -> None:  # as WorkerActor.serve_steps holds its thread
        time.sleep(seconds)


def main() -> None:
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        a, b, c = Rank.remote(), Rank.remote(), Rank.remote()
        create_collective_group([a, b], backend="gloo")
        ref = a.make.options(tensor_transport="gloo").remote()
        print("pair a-b moves a tensor:", ray.get(b.take.remote(ref)))
        print("(1) a's torch default group (initialized, world size):",
              ray.get(a.default_group.remote()))
        try:
            create_collective_group([b, c], backend="gloo")
        except RuntimeError as e:
            print("(2) a second group with b:", e)
        d, e = Rank.remote(), Rank.remote()
        ray.get([d.__ray_ready__.remote(), e.__ray_ready__.remote()])
        d.busy.remote(10)
        start = time.perf_counter()
        create_collective_group([d, e], backend="gloo")
        print(f"(3) a group with an actor busy for 10 s took {time.perf_counter() - start:.1f} s")
        f, g = Rank.remote(), Rank.remote()
        ray.get(f.own_world.remote())
        try:
            create_collective_group([f, g], backend="gloo")
            print("(4) an actor that owns its default group joined")
        except Exception as err:  # noqa: BLE001 - printed: the point of the repro
            print("(4) an actor that owns its default group:", str(err).splitlines()[-1])
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
