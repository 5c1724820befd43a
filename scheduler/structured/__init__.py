"""Structured output on the scheduler side: request params, grammar compiles, the steps that wait for a bitmask."""
