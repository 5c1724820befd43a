"""raylm batch: OpenAI Batch files through engine replicas on Ray Data."""
