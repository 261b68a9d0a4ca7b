"""What an engine counts for its stats and metrics, whichever engine it is (``LLMEngine``,
``runtimes.onnx_engine.OnnxEngine``): the keys it gives its requests, the steps it ran
and their time, the tokens it generated."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class StepCounters:
    generated_tokens_total: int = 0
    steps_total: int = 0
    last_step_seconds: float = 0.0
    step_seconds_total: float = 0.0
    _next_key: int = field(default=0, repr=False)

    def new_key(self) -> int:
        """A request's key: 0, 1, 2, ... for the life of the process."""
        key, self._next_key = self._next_key, self._next_key + 1
        return key

    def token_generated(self) -> None:
        self.generated_tokens_total += 1

    def step_done(self, started: float) -> None:
        """A step that began at ``started`` (``time.perf_counter()``) has ended."""
        self.steps_total += 1
        self.last_step_seconds = time.perf_counter() - started
        self.step_seconds_total += self.last_step_seconds

    def totals(self) -> dict[str, int | float]:
        """The totals, as ``EngineStats`` fields."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}
