"""Checkpoints: writing random ones, reading safetensors and GGUF into a rank's model, the default model's fetch."""
