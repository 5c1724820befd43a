"""Weight-only quantized linears: checkpoint codes kept quantized in memory and multiplied
by a C++ CPU kernel (docs/architecture.md, quantized weights)."""
