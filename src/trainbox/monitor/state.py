"""Live run state, shared by the training loop (writer) and the HTTP server / status.json (readers). The health
rule that /health, `trainbox status` and `trainbox runs` apply to it is rundir/status.py's.

The loop calls `update(...)` at phase changes and logged steps; readers take `snapshot()`, a plain
dict copied under the lock. Times are wall-clock seconds (time.time()); `heartbeat` is the time of the
last update, i.e. the last observable progress. A run in an ending phase (ENDED: finished, failed, preempted)
has no ETA: `eta_s` is None from then on.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from trainbox.files import atomic_write_text
from trainbox.rundir.status import PHASES

# the preference objective's logged values (objective/preference.py, kto.py): the last logged step's, and validation's
PREFERENCE_TRAIN = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen",
                    "logp_rejected", "kl")
PREFERENCE_EVAL = ("val_reward_accuracy", "val_reward_margin", "val_kl")
PREFERENCE = PREFERENCE_TRAIN + PREFERENCE_EVAL
ENDED = ("finished", "failed", "preempted")   # the phases a process ends in: no step is coming, so no ETA


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
            **dict.fromkeys(PREFERENCE),
        )
        self.history: list[dict] = []  # logged points for the dashboard (bounded)

    def update(self, **kw) -> None:
        with self._lock:
            if "phase" in kw and kw["phase"] not in PHASES:
                raise ValueError(f"unknown phase {kw['phase']}")
            now = time.time()
            if kw.get("phase") in ENDED and self._s["finished_at"] is None:
                kw["finished_at"] = now
            self._s.update(kw)
            if self._s["phase"] in ENDED:
                self._s["eta_s"] = None
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
        metrics.jsonl's train, eval and eval_tasks events (the points the live run's add_point made; a step logged twice
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
            keys = {"train": ("loss", "lr", "tokens_per_s", "tokens", *PREFERENCE_TRAIN),
                    "eval": ("val_loss", "tokens", *PREFERENCE_EVAL)}.get(kind)
            if keys and ev.get(keys[0]) is not None:
                points[(kind, step)] = {"step": step, **{k: ev[k] for k in keys if ev.get(k) is not None}}
            elif kind == "eval_tasks" and isinstance(ev.get("scores"), dict):
                points[(kind, step)] = {"step": step, "eval_tasks": ev["scores"]}
        with self._lock:
            self._s.update({k: v for k, v in status.items() if k in self._s})
            if self._s["phase"] in ENDED:   # a status.json written with the ETA of its last step
                self._s["eta_s"] = None
            self.history = []
        for _, point in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0] != "train", kv[0][0])):
            self.add_point(point)

    def write_status(self, path: Path) -> None:
        """Write the snapshot to status.json atomically (temp name + rename)."""
        atomic_write_text(path, json.dumps(self.snapshot(), indent=1, default=str), fsync=False)
