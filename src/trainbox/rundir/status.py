"""status.json, the file a run keeps current in its directory (phase, step, loss, heartbeat, pid, monitor URL),
and the one health rule that /health, `trainbox status` and `trainbox runs` all apply to it.

Stall rule (`stall_limit`). A run is stalled when its heartbeat is older than the limit for its phase:

  training, step time measured   max(60 s, 10 x step_time x log_every): ten missed log intervals
  training, no step measured yet 900 s (first step: allocator warm-up, cuDNN autotune, lazy init)
  loading / compiling            3600 s (dataset open, torch.compile of a large model)
  evaluating / checkpointing     1800 s (a full eval pass or a multi-GB save to network storage)

`monitor.stall_after`, when set, replaces the training limit; the slow phases, which report their own
phase, keep at least their default, so a short stall limit never fires during an eval or a save.

A run on several processes is also stalled when one rank's heartbeat (rundir/ranks.py) is older than
`monitor.stall_after` (default 60 s) in any active phase: "stalled: rank R silent for N s". That check comes
first, since the ranks waiting for a silent one stop making progress too.
"""
from __future__ import annotations

import time

from trainbox.rundir.ranks import RANK_STALL_S, RankBeat, describe, silent

PHASES = ("loading", "compiling", "training", "evaluating", "checkpointing", "finished", "failed", "preempted")
ACTIVE_PHASES = ("loading", "compiling", "training", "evaluating", "checkpointing")
SLOW_PHASE_SECONDS = {"loading": 3600.0, "compiling": 3600.0, "evaluating": 1800.0, "checkpointing": 1800.0}
FIRST_STEP_SECONDS = 900.0
MIN_STALL_SECONDS = 60.0
MISSED_LOGS = 10


def stall_limit(snapshot: dict, configured: float | None = None, log_every: int = 1) -> float:
    """Seconds without a heartbeat before the run counts as stalled (rule in the module docstring)."""
    phase = snapshot.get("phase", "training")
    slow = SLOW_PHASE_SECONDS.get(phase)
    if slow is not None:
        return max(slow, configured or 0.0)
    if configured:
        return float(configured)
    step_time = snapshot.get("step_time_s")
    if not step_time:
        return FIRST_STEP_SECONDS
    return max(MIN_STALL_SECONDS, MISSED_LOGS * step_time * max(1, log_every))


def health(snapshot: dict, configured: float | None = None, log_every: int = 1,
           now: float | None = None, ranks: list[RankBeat] | None = None) -> tuple[bool, str]:
    """-> (healthy, one-line reason). Finished runs are healthy; failed (NaN included), preempted and
    stalled runs (a silent rank among `ranks` included) are not."""
    now = time.time() if now is None else now
    phase, step, total = snapshot.get("phase"), snapshot.get("step", 0), snapshot.get("total_steps", 0)
    if phase == "failed":
        error = (snapshot.get("error") or "unknown error").strip().splitlines()[0]  # one line: probes print it
        return False, f"failed at step {step}: {error}"
    if phase == "preempted":
        return False, f"preempted at step {step}/{total} (resume with the same command)"
    if phase == "finished":
        return True, f"finished at step {step}/{total}"
    lost = silent(ranks or [], configured or RANK_STALL_S)
    if lost:
        return False, describe(lost, ranks)
    loss = snapshot.get("loss")
    if loss is not None and loss != loss:  # NaN loss that has not (yet) stopped the loop
        return False, f"loss is NaN at step {step}"
    age = now - snapshot.get("heartbeat", now)
    limit = stall_limit(snapshot, configured, log_every)
    if age > limit:
        return False, (f"stalled: no progress for {age:.0f}s in phase {phase} at step {step}/{total} "
                       f"(limit {limit:.0f}s)")
    return True, f"{phase} step {step}/{total}"
