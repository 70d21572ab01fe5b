"""Throughput and ETA of a training process (tokens per second over each logged window, seconds per step since
its first step), counted over the steps alone: compilation (the first step), validation, checkpoint saves and
lm-eval tasks stay out of both, so the window after an evaluation is not an outlier. The ETA is the steps left at
that pace; the evaluations and saves still to come are not in it."""
from __future__ import annotations

import time
from contextlib import contextmanager
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
    excluded: float = 0.0          # seconds left out since t_ready (evaluations, saves, tasks)

    def step_done(self, step: int) -> None:
        if self.t_ready is None:
            self.t_ready, self.step_ready = time.time(), step
            self.last_t, self.last_step = self.t_ready, step

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (spent outside the steps) out of the current window's tokens/s and the step time."""
        self.last_t += seconds
        if self.t_ready is not None:
            self.excluded += seconds

    @contextmanager
    def outside_steps(self):
        """Time spent inside (an evaluation, a checkpoint save, lm-eval tasks) is left out (`exclude`)."""
        t = time.time()
        try:
            yield
        finally:
            self.exclude(time.time() - t)

    def window(self, step: int) -> tuple[float | None, float | None]:
        """-> (tokens/s over the window since the last call, seconds per step since ready)."""
        now = time.time()
        tok_s = None
        if step > self.last_step and self.t_ready is not None:
            tok_s = (step - self.last_step) * self.tokens_per_step / max(now - self.last_t, 1e-9)
            self.last_t, self.last_step = now, step
        per_step = ((now - self.t_ready - self.excluded) / (step - self.step_ready)
                    if self.t_ready and step > self.step_ready else None)
        return tok_s, per_step
