"""Structured output on the device side: the xgrammar backend and the bitmask applied to logits."""
