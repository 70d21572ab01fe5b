"""Every rank watches the others' heartbeats (rundir/ranks.py) so that a lost node or a stuck rank ends the job with
its name, within `train.collective_timeout`, instead of hanging it.

Two ways a peer is found:

- a collective fails in this rank (gloo or NCCL saw a connection close: a killed process, a lost node), or any
  other error ends it. The loop then calls `name_lost`, which waits until every other rank either ended by
  itself or has been silent for GONE_S (ten missed beats; `train.collective_timeout` when shorter), two beats
  more at most, and returns the line naming the silent ones ("lost node 1 (host, ranks 2-3): silent for 10s"),
  or None: then the error was this rank's own and is raised as it is;
- nothing fails, the collective just waits (a stopped or frozen rank keeps its connections open). A thread
  (`Watchdog`) reads the heartbeats every beat, and once a peer has been silent for `train.collective_timeout`
  hands the line ("stalled: rank 1 silent for 30s (node 0, host)") to its `on_lost`, which records it and ends
  the process: the training thread is blocked inside the collective and cannot be interrupted from Python.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from trainbox.rundir import ranks

GONE_S = 10 * ranks.BEAT_S   # after a failed collective: silence that marks a peer as gone


def _expected(beats: list[ranks.RankBeat], world: int, me: int, since: float, now: float) -> list[ranks.RankBeat]:
    """The other ranks' beats; a rank with no file yet counts as silent since `since`."""
    seen = {b.rank for b in beats}
    missing = [ranks.RankBeat(rank=r, node=-1, host="?", pid=0, age=now - since)
               for r in range(world) if r not in seen]
    return [b for b in beats if b.rank != me] + [m for m in missing if m.rank != me]


def name_lost(run_dir: Path, world: int, me: int, timeout: float, since: float) -> str | None:
    """After a failed collective: the line naming the silent peers, waiting until each other rank has ended by
    itself or been silent for GONE_S (or `timeout`, when shorter). A rank still beating after that is alive, so
    the wait is bounded by two beats more; None when no peer is silent (the failure was this rank's own)."""
    limit = min(GONE_S, timeout)
    deadline = time.monotonic() + limit + 2 * ranks.BEAT_S
    while True:
        now = time.time()
        beats = ranks.read(run_dir, now)
        peers = _expected(beats, world, me, since, now)
        lost = ranks.silent(peers, limit)
        if all(b.ended is not None or b in lost for b in peers) or time.monotonic() > deadline:
            return ranks.describe(lost, beats) if lost else None
        time.sleep(ranks.BEAT_S / 4)   # polling the heartbeat files, whose times are what is waited on


def end_process(code: int) -> None:
    """End this process at once, its logs and output flushed: called from the watchdog's thread while the training
    thread is blocked inside a collective, which no Python exception can reach."""
    for logger in (logging.getLogger(), *[logging.getLogger(n) for n in logging.root.manager.loggerDict]):
        for handler in getattr(logger, "handlers", []):
            handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """A thread that calls `on_lost(line)` once a peer has been silent for `timeout` seconds (module docstring)."""

    def __init__(self, run_dir: Path, world: int, me: int, timeout: float, on_lost: Callable[[str], None]):
        self.run_dir, self.world, self.me, self.timeout, self.on_lost = run_dir, world, me, timeout, on_lost
        self.since = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(ranks.BEAT_S):
            now = time.time()
            beats = ranks.read(self.run_dir, now)
            lost = ranks.silent(_expected(beats, self.world, self.me, self.since, now), self.timeout)
            if lost and not self._stop.is_set():
                self._stop.set()
                self.on_lost(ranks.describe(lost, beats))
                return
