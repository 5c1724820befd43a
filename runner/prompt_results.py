"""What a step's prompt positions give on the last stage besides sampling: prompt
logprobs (runner/sample/prompt_logprobs.py) and embeddings (runner/pooler.py). Computed
with the forward, they ride with the step's output, deferred sampling included."""

from __future__ import annotations

from dataclasses import dataclass, field

from raylm.scheduler.core_outputs import ModelRunnerOutput, PromptLogprobsChunk


@dataclass
class PromptResults:
    logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)

    def attach(self, output: ModelRunnerOutput) -> None:
        output.prompt_logprobs_dict = self.logprobs
        output.pooled_dict = self.pooled
