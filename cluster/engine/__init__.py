"""The engine client: LLM, LLMEngine, AsyncLLM, input processing, output processing, detokenizing, engine arguments."""
