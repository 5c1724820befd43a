"""Device -> host copies of a step's sampled ids that run off the critical path.

The copy is *started* right after sampling and *awaited* only when the result is needed:
by the executor's output thread (``AsyncModelRunnerOutput.get_output``) or by the runner
itself when a placeholder must be settled (penalties). CUDA: a dedicated copy stream that
first waits for the compute stream, pinned host buffers and a blocking event (the waiting
thread sleeps instead of spinning on the driver lock). CPU: one background thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from raylm.scheduler.core_outputs import (
    KVConnectorOutput,
    LogprobsLists,
    ModelRunnerOutput,
    PromptLogprobsChunk,
)


class AsyncCopy:
    """Handle to an in-flight copy of some device tensors to host numpy arrays."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> list[np.ndarray]:
        raise NotImplementedError


class _CudaCopy(AsyncCopy):
    def __init__(self, tensors: list[torch.Tensor], stream: torch.cuda.Stream) -> None:
        # Hazard: a tensor kept alive for an in-flight copy. ``_device_tensors`` holds the
        # sources until the copy is waited on, and record_stream stops the caching allocator
        # from handing their memory to the compute stream before the copy stream is done.
        self._device_tensors = tensors
        self.event = torch.cuda.Event(blocking=True)
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            stream.wait_stream(compute)
            self._host = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)
                self._host.append(host)
            self.event.record(stream)

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> list[np.ndarray]:
        self.event.synchronize()
        self._device_tensors = []
        return [h.numpy() for h in self._host]


class _ThreadCopy(AsyncCopy):
    def __init__(self, tensors: list[torch.Tensor], pool: ThreadPoolExecutor) -> None:
        # The future's closure keeps the tensors alive until the copy has run.
        self._future: Future[list[np.ndarray]] = pool.submit(
            lambda: [t.numpy().copy() for t in tensors])

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> list[np.ndarray]:
        return self._future.result()


class AsyncOutputCopier:
    """Starts AsyncCopy handles for one device (owns the copy stream / thread)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = None if self._stream else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="raylm-async-copy")

    def start(self, tensors: list[torch.Tensor]) -> AsyncCopy:
        if self._stream is not None:
            return _CudaCopy(tensors, self._stream)
        assert self._pool is not None  # no stream: __init__ made the pool
        return _ThreadCopy(tensors, self._pool)

    def to_host(self, tensors: list[torch.Tensor]) -> list[np.ndarray]:
        """A copy the host needs at once (speculative decoding's verification, drafts
        proposed at the start of their step): on CUDA through the copy stream, pinned
        memory and an event, the one wait a step may have; on the CPU a plain copy."""
        if self._stream is not None:
            return _CudaCopy(tensors, self._stream).wait()
        return [t.numpy().copy() for t in tensors]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def build_model_runner_output(req_ids: list[str], req_id_to_index: dict[str, int],
                              sample_mask: np.ndarray, sampled: np.ndarray,
                              num_logprobs: np.ndarray,
                              logprob_arrays: list[np.ndarray] | None) -> ModelRunnerOutput:
    """Host arrays -> ModelRunnerOutput. ``sampled`` [B]; rows with ``sample_mask`` False
    (non-final prefill chunks) get an empty list. ``logprob_arrays`` = (ids [B, n+1],
    logprobs [B, n+1], ranks [B]); each request keeps its own ``num_logprobs + 1`` columns."""
    tokens = sampled.tolist()
    sampled_token_ids = [[t] if m else [] for t, m in zip(tokens, sample_mask.tolist(), strict=True)]
    logprobs: list[LogprobsLists | None] | None = None
    if logprob_arrays is not None:
        ids, values, ranks = logprob_arrays
        logprobs = []
        for i, n in enumerate(num_logprobs.tolist()):
            if n < 0 or not sample_mask[i]:
                logprobs.append(None)
                continue
            logprobs.append(LogprobsLists(token_ids=[ids[i, :n + 1].tolist()],
                                          logprobs=[values[i, :n + 1].tolist()],
                                          sampled_token_ranks=[int(ranks[i])]))
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index=req_id_to_index,
                             sampled_token_ids=sampled_token_ids, logprobs=logprobs)


@dataclass(eq=False)  # identity, as any in-flight step's handle
class AsyncModelRunnerOutput:
    """A step's output whose sampled ids are still being copied to the host.

    Returned by ``execute_model`` under async scheduling; ``get_output()`` blocks until the
    copy is done and returns the plain ModelRunnerOutput (real token ids, never -1)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sample_mask: np.ndarray
    num_logprobs: np.ndarray
    copy: AsyncCopy
    has_logprobs: bool
    prompt_logprobs_dict: dict[str, PromptLogprobsChunk] | None = None  # already on the host
    pooled_dict: dict[str, list[float]] | None = None  # embeddings, already on the host
    kv_connector_output: KVConnectorOutput | None = None

    def done(self) -> bool:
        return self.copy.done()

    def get_output(self) -> ModelRunnerOutput:
        arrays = self.copy.wait()
        logprob_arrays = arrays[1:4] if self.has_logprobs else None
        out = build_model_runner_output(self.req_ids, self.req_id_to_index, self.sample_mask,
                                        arrays[0][:, 0], self.num_logprobs, logprob_arrays)
        out.prompt_logprobs_dict = self.prompt_logprobs_dict or {}
        out.pooled_dict = self.pooled_dict or {}
        out.kv_connector_output = self.kv_connector_output
        return out
