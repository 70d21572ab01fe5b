"""Live run state, shared by the training loop (writer) and the HTTP server / status.json (readers).

The loop calls `update(...)` at phase changes and logged steps; readers take `snapshot()`, a plain
dict copied under the lock. Times are wall-clock seconds (time.time()).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

PHASES = ("loading", "compiling", "training", "evaluating", "checkpointing", "finished", "failed", "preempted")


class RunState:
    def __init__(self, run_name: str, run_dir: Path, total_steps: int = 0):
        self._lock = threading.Lock()
        now = time.time()
        self._s = dict(
            run_name=run_name, run_dir=str(run_dir), phase="loading", step=0, total_steps=total_steps,
            epoch=0, loss=None, val_loss=None, val_bpb=None, lr=None, grad_norm=None, tokens_per_s=None,
            mfu=None, eta_s=None, tokens_seen=0, started_at=now, heartbeat=now, step_time_s=None,
            last_checkpoint=None, resumed_from=None, error=None, pid=os.getpid(), url=None,
            gpu_name=None, gpu_count=0, cuda_available=False, gpu_memory_allocated=0,
            checkpoints_saved=0, restarts=0, steps_this_process=0, tokens_this_process=0,
        )
        self.history: list[dict] = []  # logged points for the dashboard (bounded)

    def update(self, **kw) -> None:
        with self._lock:
            if "phase" in kw and kw["phase"] not in PHASES:
                raise ValueError(f"unknown phase {kw['phase']}")
            self._s.update(kw)
            self._s["heartbeat"] = time.time()

    def add_point(self, point: dict) -> None:
        with self._lock:
            self.history.append(point)
            if len(self.history) > 5000:  # keep every other old point: bounded memory, whole curve
                self.history = self.history[:2500:2] + self.history[2500:]

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._s)

    def points(self, since: int = 0) -> list[dict]:
        with self._lock:
            return [p for p in self.history if p.get("step", 0) >= since]

    def write_status(self, path: Path) -> None:
        data = self.snapshot()
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, path)
