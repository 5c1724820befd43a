"""One rank on one device: model runner, input batch, sampler, attention, models, loading.

Names resolve lazily (PEP 562) so that importing a light submodule such as
``raylm.runner.loading.checkpoint`` does not pay for torch and the whole runner.
"""

import importlib

_EXPORTS = {
    "AsyncModelRunnerOutput": "raylm.runner.async_output",
    "CachedRequestState": "raylm.runner.input_batch",
    "InputBatch": "raylm.runner.input_batch",
    "IntermediateTensors": "raylm.runner.models.llama",
    "ModelRunner": "raylm.runner.model_runner",
    "PPTransport": "raylm.runner.worker",
    "Sampler": "raylm.runner.sample.sampler",
    "SamplingMetadata": "raylm.runner.sample.sampler",
    "UniProcExecutor": "raylm.runner.uniproc_executor",
    "Worker": "raylm.runner.worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raylm.runner' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
