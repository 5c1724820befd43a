"""Every environment variable raylm reads, in one place."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """raylm's cache folder (the default model is fetched into it): RAYLM_CACHE_DIR, else
    raylm/ under the user's cache folder (XDG_CACHE_HOME, else ~/.cache)."""
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                   ".cache")
    return os.environ.get("RAYLM_CACHE_DIR") or os.path.join(user_cache, "raylm")


def demo_model_dir() -> str:
    """Where the demo model lives (created on first use)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "raylm", "demo-model")
    return os.environ.get("RAYLM_DEMO_MODEL_DIR", default)


def ray_address() -> str | None:
    """An existing Ray cluster to join (Ray's own variable)."""
    return os.environ.get("RAY_ADDRESS") or None


def ray_job_config_json() -> str | None:
    """The job config (runtime_env, metadata) Ray's job supervisor hands a job's driver."""
    return os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or None


def gloo_socket_ifname() -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME") or None


def _positive_int(name: str) -> int | None:
    """The variable as a positive int, None when unset; anything else is a ValueError."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return number


def num_threads_override() -> int | None:
    """Torch intra-op threads per rank, whatever the rank reserved."""
    return _positive_int("RAYLM_NUM_THREADS")


def _on_unless_off(name: str) -> bool:
    """A switch that is on unless the variable says 0 or false."""
    return os.environ.get(name, "1") not in ("0", "false", "False")


def cpu_keep_freed_memory() -> bool:
    """CPU workers keep freed heap memory mapped (see raylm.runner.host_memory)."""
    return _on_unless_off("RAYLM_CPU_KEEP_FREED_MEMORY")


def cpu_kv_prefault() -> bool:
    """The CPU KV cache's pages are faulted in at start-up (RAYLM_CPU_KV_PREFAULT; off: on
    first write, as the pool fills: the test suite's engines touch a few blocks of it)."""
    return _on_unless_off("RAYLM_CPU_KV_PREFAULT")


def cpu_auto_bfloat16() -> bool:
    """dtype="auto" runs a float32 checkpoint in bfloat16 on a CPU with native bf16."""
    return _on_unless_off("RAYLM_CPU_AUTO_BFLOAT16")


def cpu_pack_linears() -> bool:
    """CPU linears run over oneDNN-packed weights (RAYLM_CPU_PACK_LINEARS)."""
    return _on_unless_off("RAYLM_CPU_PACK_LINEARS")


def cpu_attention_kernel() -> bool:
    """CPU attention uses the C++ paged kernel (RAYLM_CPU_ATTENTION_KERNEL)."""
    return _on_unless_off("RAYLM_CPU_ATTENTION_KERNEL")


def cpu_decode_layer() -> bool:
    """A quantized Llama's decode steps on CPU run each layer as one C++ call
    (runner/models/fused_decode_layer.py; RAYLM_CPU_DECODE_LAYER)."""
    return _on_unless_off("RAYLM_CPU_DECODE_LAYER")


ATTENTION_BACKENDS = ("auto", "triton", "native")


def attention_backend() -> str:
    """RAYLM_ATTENTION_BACKEND: ``auto`` (the Triton kernel on CUDA, the C++ / torch
    kernels on CPU), ``triton`` (everywhere: on CPU under TRITON_INTERPRET=1, for tests),
    ``native`` (the C++ / torch kernels everywhere)."""
    value = os.environ.get("RAYLM_ATTENTION_BACKEND", "auto")
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"RAYLM_ATTENTION_BACKEND must be one of {ATTENTION_BACKENDS}, "
                         f"got {value!r}.")
    return value


def quant_backend() -> str:
    """RAYLM_QUANT_BACKEND: the kernel quantized weights run on. ``auto`` (the Triton kernel
    on CUDA, the C++ kernel on CPU), ``triton`` (everywhere: on CPU under TRITON_INTERPRET=1,
    for tests), ``native`` (the C++ kernel; on CUDA the weights are then dequantized)."""
    value = os.environ.get("RAYLM_QUANT_BACKEND", "auto")
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"RAYLM_QUANT_BACKEND must be one of {ATTENTION_BACKENDS}, "
                         f"got {value!r}.")
    return value


def pad_decode_steps() -> bool:
    """RAYLM_PAD_DECODE_STEPS=1: pad decode steps to their CUDA-graph bucket on a device
    that runs no graphs (the CPU): the padded path's tokens, checked by tests, and its
    cost, measured by benchmarks."""
    return os.environ.get("RAYLM_PAD_DECODE_STEPS", "0") not in ("0", "", "false", "False")


def allow_cpu_fallback() -> bool:
    """Run on CPU even in a process Ray gave a GPU whose torch has no CUDA. Off: such a
    rank fails at start. On: for testing GPU placement with fake GPUs on CPU machines."""
    return os.environ.get("RAYLM_ALLOW_CPU_FALLBACK", "0") not in ("0", "", "false", "False")


def forwarded_to_actors() -> dict[str, str]:
    """raylm variables of this process that its engine's actors must see too (an actor
    inherits its node's environment, not the driver's; its own child actors inherit it).
    The OpenMP wait variables go too: an actor's libgomp reads them when it loads torch,
    so they travel in the actor's runtime_env, not in a call."""
    from raylm.scheduler.config import openmp_wait

    forwarded = {"RAYLM_ALLOW_CPU_FALLBACK": "1"} if allow_cpu_fallback() else {}
    forwarded.update(openmp_wait.to_forward())
    return forwarded


def ray_noset_cuda_visible_devices() -> bool:
    """Ray leaves CUDA_VISIBLE_DEVICES alone (Ray's own variable): every GPU of the node is
    visible, and a rank must pick its assigned one by id."""
    return os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "0") not in ("0", "")


def cuda_visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def local_ray_num_cpus() -> int | None:
    """Logical CPUs of a local Ray instance raylm starts itself (RAYLM_LOCAL_RAY_CPUS)."""
    return _positive_int("RAYLM_LOCAL_RAY_CPUS")
