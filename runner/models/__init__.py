"""Llama-family decoders (Llama, Qwen2, Qwen3) and the architecture registry."""

from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.llama import IntermediateTensors, LlamaForCausalLM
from raylm.runner.models.registry import get_model_class, resolve_architecture

__all__ = [
    "DecoderConfig",
    "IntermediateTensors",
    "LlamaForCausalLM",
    "get_model_class",
    "resolve_architecture",
]
