"""Live run state, shared by the training loop (writer) and the HTTP server / status.json (readers),
and the one health rule that /health, `trainbox status` and `trainbox runs` all apply.

The loop calls `update(...)` at phase changes and logged steps; readers take `snapshot()`, a plain
dict copied under the lock. Times are wall-clock seconds (time.time()); `heartbeat` is the time of the
last update, i.e. the last observable progress.

Stall rule (`stall_limit`). A run is stalled when its heartbeat is older than the limit for its phase:

  training, step time measured   max(60 s, 10 x step_time x log_every): ten missed log intervals
  training, no step measured yet 900 s (first step: allocator warm-up, cuDNN autotune, lazy init)
  loading / compiling            3600 s (dataset open, torch.compile of a large model)
  evaluating / checkpointing     1800 s (a full eval pass or a multi-GB save to network storage)

`monitor.stall_seconds`, when set, replaces the training limit; the slow phases, which report their own
phase, keep at least their default, so a short stall limit never fires during an eval or a save.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from trainbox.files import atomic_write_text

PHASES = ("loading", "compiling", "training", "evaluating", "checkpointing", "finished", "failed", "preempted")
ACTIVE_PHASES = ("loading", "compiling", "training", "evaluating", "checkpointing")
SLOW_PHASE_SECONDS = {"loading": 3600.0, "compiling": 3600.0, "evaluating": 1800.0, "checkpointing": 1800.0}
FIRST_STEP_SECONDS = 900.0
MIN_STALL_SECONDS = 60.0
MISSED_LOGS = 10


class RunState:
    """Thread-safe dict of the run's live state (see module docstring)."""

    def __init__(self, run_name: str, run_dir: Path, total_steps: int = 0):
        self._lock = threading.Lock()
        now = time.time()
        self._s = dict(
            run_name=run_name, run_dir=str(run_dir), phase="loading", step=0, total_steps=total_steps,
            epoch=0, loss=None, val_loss=None, val_bpb=None, lr=None, grad_norm=None, tokens_per_s=None,
            mfu=None, eta_s=None, tokens_seen=0, started_at=now, heartbeat=now, step_time_s=None,
            last_checkpoint=None, resumed_from=None, error=None, pid=os.getpid(), host=socket.gethostname(),
            url=None, gpu_name=None, gpu_count=0, cuda_available=False, gpu_memory_allocated=0,
            checkpoints_saved=0, restarts=0, steps_this_process=0, tokens_this_process=0, finished_at=None,
        )
        self.history: list[dict] = []  # logged points for the dashboard (bounded)

    def update(self, **kw) -> None:
        with self._lock:
            if "phase" in kw and kw["phase"] not in PHASES:
                raise ValueError(f"unknown phase {kw['phase']}")
            now = time.time()
            if kw.get("phase") in ("finished", "failed", "preempted") and self._s["finished_at"] is None:
                kw["finished_at"] = now
            self._s.update(kw)
            self._s["heartbeat"] = now

    def add_point(self, point: dict) -> None:
        with self._lock:
            self.history.append(point)
            if len(self.history) > 5000:  # keep every other old point: bounded memory, whole curve
                self.history = self.history[:2500:2] + self.history[2500:]

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._s)

    def points(self, since: int = 0) -> list[dict]:
        """History points with step >= since (the dashboard asks only for what it has not drawn)."""
        with self._lock:
            return [p for p in self.history if p.get("step", 0) >= since]

    def load_files(self, run_dir: Path) -> None:
        """Replace the state with what `run_dir` holds: status.json's snapshot, and history points from
        metrics.jsonl's train and eval events (the points the live run's add_point made; a step logged twice
        by a resumed run keeps its later value). For `trainbox dashboard` on a finished or remote run."""
        run_dir = Path(run_dir)
        try:
            status = json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
        points: dict[tuple[str, int], dict] = {}
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            kind, step = ev.get("event"), ev.get("step")
            if not isinstance(step, int):
                continue
            keys = {"train": ("loss", "lr", "tokens_per_s", "tokens"), "eval": ("val_loss", "tokens")}.get(kind)
            if keys and ev.get(keys[0]) is not None:
                points[(kind, step)] = {"step": step, **{k: ev[k] for k in keys if ev.get(k) is not None}}
        with self._lock:
            self._s.update({k: v for k, v in status.items() if k in self._s})
            self.history = []
        for _, point in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0] == "eval")):
            self.add_point(point)

    def write_status(self, path: Path) -> None:
        """Write the snapshot to status.json atomically (temp name + rename)."""
        atomic_write_text(path, json.dumps(self.snapshot(), indent=1, default=str), fsync=False)


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
           now: float | None = None) -> tuple[bool, str]:
    """-> (healthy, one-line reason). Finished runs are healthy; failed (NaN included), preempted and
    stalled runs are not."""
    now = time.time() if now is None else now
    phase, step, total = snapshot.get("phase"), snapshot.get("step", 0), snapshot.get("total_steps", 0)
    if phase == "failed":
        error = (snapshot.get("error") or "unknown error").strip().splitlines()[0]  # one line: probes print it
        return False, f"failed at step {step}: {error}"
    if phase == "preempted":
        return False, f"preempted at step {step}/{total} (resume with the same command)"
    if phase == "finished":
        return True, f"finished at step {step}/{total}"
    loss = snapshot.get("loss")
    if loss is not None and loss != loss:  # NaN loss that has not (yet) stopped the loop
        return False, f"loss is NaN at step {step}"
    age = now - snapshot.get("heartbeat", now)
    limit = stall_limit(snapshot, configured, log_every)
    if age > limit:
        return False, (f"stalled: no progress for {age:.0f}s in phase {phase} at step {step}/{total} "
                       f"(limit {limit:.0f}s)")
    return True, f"{phase} step {step}/{total}"
