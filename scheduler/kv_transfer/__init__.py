"""KV connectors, scheduler side (docs/architecture.md §2): offload tier, prefill/decode transfer."""
