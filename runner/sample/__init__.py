"""Sampling: the sampler, its per-step metadata, seeded noise, rejection sampling, prompt logprobs."""
