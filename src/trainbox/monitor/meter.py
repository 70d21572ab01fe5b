"""Throughput and ETA of a training process (tokens per second over each logged window, seconds per step since
its first step, so compilation stays out of both)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Meter:
    """Throughput and ETA counted over this process's steps only (a resume starts a new meter)."""

    tokens_per_step: int
    first_step: int
    t0: float = field(default_factory=time.time)
    t_ready: float | None = None   # end of the first step (compilation excluded from rates)
    step_ready: int = 0
    last_t: float = 0.0
    last_step: int = 0

    def step_done(self, step: int) -> None:
        if self.t_ready is None:
            self.t_ready, self.step_ready = time.time(), step
            self.last_t, self.last_step = self.t_ready, step

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (spent outside the steps: lm-eval tasks) out of the current window's tokens/s."""
        self.last_t += seconds

    def window(self, step: int) -> tuple[float | None, float | None]:
        """-> (tokens/s over the window since the last call, seconds per step since ready)."""
        now = time.time()
        tok_s = None
        if step > self.last_step and self.t_ready is not None:
            tok_s = (step - self.last_step) * self.tokens_per_step / max(now - self.last_t, 1e-9)
            self.last_t, self.last_step = now, step
        per_step = (now - self.t_ready) / (step - self.step_ready) if self.t_ready and step > self.step_ready else None
        return tok_s, per_step
