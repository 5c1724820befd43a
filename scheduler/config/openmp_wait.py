"""How long torch's OpenMP threads spin before they sleep, set before torch is loaded.

libgomp (the OpenMP runtime of torch's CPU builds) keeps a thread that reached the end of
a parallel region spinning for ~300k iterations (milliseconds) before it sleeps. On a quiet
machine that saves a wake-up per op; beside a process that takes a core, the spinning
threads take the CPU that the descheduled team member and the engine's own host threads
(scheduling, sampling, output) need, and a 2-core engine fell to a third of its quiet
throughput (bench/busy_neighbour.py, docs/performance.md). A short spin keeps most of the
quiet speed and none of the collapse. libgomp reads the variable once, when it is loaded,
so raylm's package init sets it (``apply``) before anything imports torch; a value the
user set (GOMP_SPINCOUNT or OMP_WAIT_POLICY) wins. Torch imported before raylm keeps
libgomp's default.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# libgomp spin iterations (each a CPU pause) before a waiting thread sleeps; chosen by
# bench/busy_neighbour.py and bench/throughput.py (docs/performance.md).
DEFAULT_SPIN_COUNT = 1000
USER_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def user_choice(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The wait variables already in the environment (the user's, or raylm's own default
    in a process whose package init ran)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in USER_VARIABLES if env.get(k)}


def to_forward(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """What an actor must be started with: the user's own choice; nothing when it is
    raylm's default, which the actor's package init sets itself (an actor started with
    env_vars cannot take a worker process Ray started ahead, so it starts slower)."""
    choice = user_choice(environ)
    return {} if choice == {"GOMP_SPINCOUNT": str(DEFAULT_SPIN_COUNT)} else choice


def apply(environ: MutableMapping[str, str] | None = None) -> None:
    """Set the short spin unless the environment already says how OpenMP threads wait."""
    env = os.environ if environ is None else environ
    if not user_choice(env):
        env["GOMP_SPINCOUNT"] = str(DEFAULT_SPIN_COUNT)
