"""The engine core: EngineCore and its loops (in process, DP waves), the Executor protocol."""
