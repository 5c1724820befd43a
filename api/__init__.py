"""raylm: an LLM serving engine on Ray with asynchronous scheduling."""

from raylm.cluster.engine.llm import LLM
from raylm.scheduler.lora import LoRARequest
from raylm.scheduler.pooling_params import PoolingParams
from raylm.scheduler.sampling_params import RequestOutputKind, SamplingParams
from raylm.scheduler.structured.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "PoolingParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "__version__"]
