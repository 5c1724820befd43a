"""``raylm batch``: an OpenAI Batch file through a pool of engine replicas on Ray Data.

The driver reads the input and writes the output itself (any location ``batch_fs``
resolves), so a local path is one on the driver's machine. In between, the rows that are
not yet in the output become a Ray Dataset mapped over ``BatchReplica`` actors (a fixed
count, or autoscaled between a min and a max). Finished rows are stored in shards as they
arrive (``batch_output``): an interrupted run loses at most the unflushed rows, and a rerun
runs only what is missing. A row that comes back twice (a batch retried after its first
result was delivered) is written once.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raylm.cluster.batch.fs import check_output_location, resolve
from raylm.cluster.batch.output import BatchOutput
from raylm.cluster.batch.replica import BatchReplica, ReplicaPlacement, replica_bundles
from raylm.cluster.batch.rows import DEFAULT_MAX_CONCURRENCY, input_custom_id, reject_row
from raylm.cluster.serve.deployment.config import LLMConfig

logger = logging.getLogger(__name__)

# A batch is retried this many times after its replica died before the run fails: enough
# for lost nodes and OOM kills, bounded for a row that kills every engine it meets.
MAX_BATCH_RETRIES = 3

ResultsHook = Callable[[dict[str, list[Any]]], None]


@dataclass(frozen=True)
class BatchJobConfig:
    input: str
    output: str
    llm_config: LLMConfig
    model_aliases: tuple[str, ...] = ()
    min_replicas: int = 1
    max_replicas: int = 1
    # Rows per Ray Data batch: the unit a replica returns at once and that is retried.
    batch_size: int = 16
    # Rows one replica keeps in its engine at once.
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    # A shard is stored once this many rows wait, or this long after the last one.
    flush_rows: int = 1000
    flush_interval_s: float = 10.0
    progress_interval_s: float = 10.0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("min_replicas", "batch_size", "max_concurrency", "flush_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be at least "
                             f"min_replicas ({self.min_replicas}).")
        for name in ("flush_interval_s", "progress_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")


@dataclass
class BatchResult:
    output_uri: str
    num_rows: int  # non-empty input lines
    num_resumed: int = 0  # rows an earlier run had stored
    num_run: int = 0  # rows this run stored
    num_errors: int = 0  # of those, rows whose response is an error
    completion_tokens: int = 0
    replicas: set[str] = field(default_factory=set)  # "node_id:pid" of the actors that ran rows


def parse_replicas(text: str) -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN..MAX"`` -> (MIN, MAX), autoscaled in between."""
    lo, sep, hi = text.partition("..")
    try:
        bounds = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ValueError(f"--num-replicas must be N or MIN..MAX, got {text!r}.") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"--num-replicas {text!r}: need 1 <= MIN <= MAX.")
    return bounds


def read_rows(uri: str) -> list[tuple[int, str]]:
    """(line number, line) of every non-empty input line."""
    loc = resolve(uri)
    try:
        text = loc.read_text()
    except FileNotFoundError:
        raise ValueError(f"input {uri!r} does not exist.") from None
    return [(no, ln) for no, ln in enumerate(text.splitlines(), 1) if ln.strip()]


def row_keys(rows: list[tuple[int, str]]) -> list[str | None]:
    """Each row's custom_id (None when unusable); a custom_id used twice is refused."""
    keys: list[str | None] = []
    first: dict[str, int] = {}
    for no, line in rows:
        cid = input_custom_id(line)
        key = cid if isinstance(cid, str) and cid else None
        if key is not None:
            if key in first:
                raise ValueError(f"custom_id {key!r} appears on lines {first[key]} and {no}; "
                                 "each row needs its own (it is the row's key in the output).")
            first[key] = no
        keys.append(key)
    return keys


class _Progress:
    def __init__(self, total: int, interval_s: float, enabled: bool) -> None:
        self.total, self.interval_s, self.enabled = total, interval_s, enabled
        self.start = self.last = time.monotonic()
        self.logged = -1

    def maybe_log(self, result: BatchResult, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < self.interval_s):
            return
        if force and self.logged == result.num_run:
            return  # the last line said it already
        self.last, self.logged = now, result.num_run
        done = result.num_run
        rate = result.completion_tokens / max(now - self.start, 1e-9)
        print(f"raylm batch: {done}/{self.total} rows, {result.num_errors} errors, "
              f"{rate:.0f} generated tok/s since the start, {len(result.replicas)} replicas, "
              f"{now - self.start:.0f}s", file=sys.stderr, flush=True)


def run_batch_job(config: BatchJobConfig, on_results: ResultsHook | None = None) -> BatchResult:
    """Run the rows that ``config.output`` lacks; ``on_results`` sees each batch of results
    as it arrives (progress displays, tests)."""
    check_output_location(config.output)
    rows = read_rows(config.input)
    keys = row_keys(rows)
    output = BatchOutput(config.output)
    done, keyless_done = output.load_completed()
    result = BatchResult(output.uri, len(rows))
    todo = [row for row, key in zip(rows, keys) if key is not None and key not in done]
    keyless = [row for row, key in zip(rows, keys) if key is None]
    result.num_resumed = len(rows) - len(todo) - len(keyless)
    if keyless and not keyless_done:  # rows without a custom_id: errors, no engine needed
        rejected = [reject_row(line, no) for no, line in keyless]
        output.write_shard([r.text for r in rejected])
        result.num_run += len(rejected)
        result.num_errors += len(rejected)
    elif keyless:
        result.num_resumed += len(keyless)
    if result.num_resumed:
        print(f"raylm batch: {result.num_resumed} of {len(rows)} rows are already in "
              f"{output.uri}; running the other {len(todo)}", file=sys.stderr, flush=True)
    if todo:
        _run_rows(config, todo, output, result, on_results)
    output.finalize(keys)
    return result


def _run_rows(config: BatchJobConfig, todo: list[tuple[int, str]], output: BatchOutput,
              result: BatchResult, on_results: ResultsHook | None) -> None:
    import ray.data

    from raylm.actors.placement import ensure_ray_initialized

    ensure_ray_initialized(_replica_cpus(config.llm_config) * config.min_replicas)
    llm_config = _on_gpus_if_any(config.llm_config)
    bundles, strategy = replica_bundles(llm_config)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # one progress line of our own instead
    # Ray Data's high-memory detector calls ray_remote_args_fn to read the workers' memory
    # request, at the start and then periodically: each call would reserve one more
    # replica's placement group that no actor ever uses.
    issue_detectors = getattr(ctx, "issue_detectors_config", None)
    if issue_detectors is not None:
        issue_detectors.detectors = [d for d in issue_detectors.detectors
                                     if d.__name__ != "HighMemoryIssueDetector"]

    placement = ReplicaPlacement(bundles, strategy)
    ds = ray.data.from_items([{"line_no": no, "line": line} for no, line in todo],
                             override_num_blocks=math.ceil(len(todo) / config.batch_size))
    with warnings.catch_warnings():
        # Ray 2.60 deprecates ray_remote_args_fn and the remote-args kwargs (removal in
        # 2.64) without a replacement for a placement group per actor; Ray Data LLM's
        # engine stage reserves its groups the same way.
        warnings.filterwarnings("ignore", message=".*deprecated and will be removed in Ray 2.64")
        ds = _map_replicas(ds, config, llm_config, placement)

    progress = _Progress(result.num_run + len(todo), config.progress_interval_s, config.progress)
    seen: set[int] = set()
    pending: list[str] = []
    last_flush = time.monotonic()
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            cols = {k: list(v) for k, v in batch.items()}
            for no, text, status, tokens, replica in zip(
                    cols["line_no"], cols["output"], cols["status"], cols["completion_tokens"],
                    cols["replica"]):
                if int(no) in seen:
                    logger.warning("line %d came back twice (a retried batch); kept once", no)
                    continue
                seen.add(int(no))
                pending.append(str(text))
                result.num_run += 1
                result.num_errors += int(status) != 200
                result.completion_tokens += int(tokens)
                result.replicas.add(str(replica))
            if on_results is not None:
                on_results(cols)
            if len(pending) >= config.flush_rows or (
                    pending and time.monotonic() - last_flush >= config.flush_interval_s):
                output.write_shard(pending)
                pending, last_flush = [], time.monotonic()
            progress.maybe_log(result)
    finally:
        if pending:  # interrupted or not, what came back is kept for the next run
            output.write_shard(pending)
        placement.remove_all()
    progress.maybe_log(result, force=True)
    missing = len(todo) - len(seen)
    assert missing == 0, f"{missing} of {len(todo)} rows never came back from the replicas"


def _replica_cpus(llm_config: LLMConfig) -> float:
    return sum(b.get("CPU", 0.0) for b in replica_bundles(llm_config)[0])


def _on_gpus_if_any(llm_config: LLMConfig) -> LLMConfig:
    """Workers take one GPU each when the cluster has GPUs and the config names no GPU
    use of its own (as an engine's own placement does), else they would run on CPUs."""
    import ray

    if (llm_config.num_gpus_per_worker is None and llm_config.accelerator_type is None
            and ray.cluster_resources().get("GPU", 0) > 0):
        return llm_config.model_copy(update={"num_gpus_per_worker": 1.0})
    return llm_config


def _map_replicas(ds: Any, config: BatchJobConfig, llm_config: LLMConfig,
                  placement: ReplicaPlacement) -> Any:
    import ray.data

    per_actor = max(1, math.ceil(config.max_concurrency / config.batch_size))
    return ds.map_batches(
        BatchReplica, batch_size=config.batch_size, batch_format="numpy",
        fn_constructor_kwargs={"llm_config": llm_config.model_dump(),
                               "model_aliases": config.model_aliases,
                               "max_concurrency": config.max_concurrency},
        compute=ray.data.ActorPoolStrategy(
            min_size=config.min_replicas, max_size=config.max_replicas,
            max_tasks_in_flight_per_actor=per_actor, max_concurrent_calls_per_actor=per_actor),
        ray_remote_args_fn=placement, max_task_retries=MAX_BATCH_RETRIES,
        **placement.actor_resources)
