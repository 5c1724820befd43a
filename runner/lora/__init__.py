"""LoRA adapters on a rank (docs/architecture.md, "LoRA adapters"): PEFT files, device slots, the host
cache, and the per-step products (torch, and a Triton kernel for CUDA)."""
