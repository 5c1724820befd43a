"""raylm: an LLM serving engine on Ray with asynchronous scheduling."""

from raylm.scheduler.config import openmp_wait

openmp_wait.apply()  # before the first torch import: libgomp reads it once, when loaded

from raylm.cluster.engine.llm import LLM  # noqa: E402
from raylm.scheduler.lora import LoRARequest  # noqa: E402
from raylm.scheduler.pooling_params import PoolingParams  # noqa: E402
from raylm.scheduler.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from raylm.scheduler.structured.params import StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "PoolingParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "__version__"]
