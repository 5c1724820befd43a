"""Which device a Ray actor that runs a model must use, from what Ray assigned it.

Every rank (a worker actor, a DP rank actor or a Serve replica running the model in
process) asks Ray for exactly one whole GPU. Ray then narrows ``CUDA_VISIBLE_DEVICES`` to
it, so the rank's device is ``cuda:0``; with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``
every GPU of the node stays visible and the rank must pick its own by id, or all ranks of
a node would land on GPU 0. A fraction of a GPU would let Ray put two ranks on one device:
refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from raylm.scheduler.config import envs


@dataclass(frozen=True)
class DeviceAssignment:
    gpu_ids: tuple[str, ...]
    local_rank: int  # the CUDA device index this process uses
    expect_cuda: bool  # a GPU was assigned: running on CPU would be an error


def local_device_index(gpu_ids: list[str], noset: bool, visible: str | None) -> int:
    """The CUDA index of ``gpu_ids[0]`` as torch sees it in this process."""
    if not gpu_ids or not noset:
        return 0  # Ray narrowed CUDA_VISIBLE_DEVICES to the assigned GPU(s)
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if gpu_ids[0] not in ids:
            raise RuntimeError(f"Ray assigned GPU {gpu_ids[0]} but CUDA_VISIBLE_DEVICES="
                               f"{visible!r} hides it (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_"
                               "DEVICES is set, so Ray did not narrow it).")
        return ids.index(gpu_ids[0])
    return int(gpu_ids[0])


def check_whole_gpus(num_gpus: float, who: str) -> None:
    if num_gpus and num_gpus != int(num_gpus):
        raise ValueError(f"{who} holds num_gpus={num_gpus:g}: a fraction of a GPU would let "
                         "two ranks share one device; give each rank a whole GPU.")


def current_device_assignment(who: str = "this rank") -> DeviceAssignment:
    """What Ray assigned the calling actor (no GPU outside a Ray worker)."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return DeviceAssignment((), 0, False)
    assigned = ray.get_runtime_context().get_assigned_resources()
    check_whole_gpus(assigned.get("GPU", 0.0), who)
    gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    local_rank = local_device_index(gpu_ids, envs.ray_noset_cuda_visible_devices(),
                                    envs.cuda_visible_devices())
    return DeviceAssignment(tuple(gpu_ids), local_rank,
                            bool(gpu_ids) and not envs.allow_cpu_fallback())
