"""Paged attention over the block-major KV cache: the metadata, the torch ragged kernel, the CPU C++ kernel."""
