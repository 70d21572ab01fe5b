"""Python's cyclic garbage collector while training: run at step boundaries, not whenever allocations trip it.

Left to itself, Python runs a full collection once enough objects have survived its younger ones. In a training
process that holds millions of objects (a compiled model's graphs and guards, the tokenizer, the data index) one
such pass stops the host for a tenth of a second or more, in the middle of whatever step it falls in; under
several processes each rank's pass falls in a different step and the others wait for it in the next collective.
With `train.gc_every=N` (N > 0) the loop turns automatic collection off for the run and moves what exists before
the first step, and what the first step makes (compiled graphs), to Python's permanent generation (gc.freeze),
which no collection scans; it then collects the young generations (0 and 1) every N steps and makes a full pass,
over what the run made since, at each evaluation and save, where the step is paused anyway: on every rank at the
same step. When the loop ends, automatic collection is as it was found and the frozen objects are back in the
oldest generation (gc.unfreeze); a process that had frozen objects of its own before the loop is not frozen or
unfrozen by it. A reference cycle that holds tensors would live up to N steps longer; the families' training steps
and the dpo recipe's make none (tests/test_gc.py).
"""
from __future__ import annotations

import gc


class StepCollector:
    """The loop's garbage collection: `start()` before the first step, `after_step()` after each step's
    evaluation and save, `stop()` when the loop ends (also on an error). `every=0` leaves Python's own."""

    def __init__(self, every: int):
        self.every = every
        self._enabled = None        # whether automatic collection was on before start()
        self._first = False         # the first step not yet frozen
        self._freeze = False        # whether this collector freezes (not where the process had frozen objects)

    def start(self) -> None:
        if self.every and self._enabled is None:
            self._enabled = gc.isenabled()
            gc.disable()
            # a process that froze objects of its own (a server that forks workers) keeps them frozen: unfreeze()
            # would release them too, so such a process is left unfrozen by the loop
            self._freeze = gc.get_freeze_count() == 0
            if self._freeze:
                gc.freeze()         # the run as set up: long-lived, never scanned again while it trains
            self._first = self._freeze

    def after_step(self, step: int, paused: bool) -> None:
        """After `step` (1-based): the full pass where the loop evaluated or saved (`paused`), the young
        generations every `every` steps."""
        if self._enabled is None:
            return
        if self._first:             # the first step's compiled graphs and caches: long-lived too
            self._first = False
            gc.freeze()
        if paused:
            gc.collect(2)
        elif step % self.every == 0:
            gc.collect(1)

    def stop(self) -> None:
        if self._enabled is not None:
            if self._freeze:
                gc.unfreeze()       # back to the oldest generation, where a full collection reaches them
            if self._enabled:
                gc.enable()
            self._enabled = None
