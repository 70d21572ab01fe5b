"""Per-rank heartbeats of a run on several processes: RUN/ranks/R.json for rank R, its modification time the beat.

Every rank keeps its file's time current from a thread of its own (every BEAT_S seconds), whatever its training
loop waits on. A rank whose process is stopped (SIGSTOP, a frozen machine), killed, or cut off from the run
directory goes silent while the others keep beating, so the silent one is named, not the many that wait for it
in a collective. The file holds who the rank is (rank, node, host, pid); a rank that ends by itself (finished,
failed, stopped) says so in it (`ended`), and is never counted silent.

Readers: the one health rule (rundir/status.py: "stalled: rank R silent for N s" once a rank is silent for
`monitor.stall_after`, default RANK_STALL_S), which /health and `trainbox status` apply, and every rank's
watchdog (train/peers.py), which ends the job when a peer is silent for `train.collective_timeout`. Across nodes
the run directory is shared, as sharded checkpoints need it to be; ages come from the files' times.

Rank 0 clears the folder when it takes the run directory, before any rank of the run writes to it, so files of
an earlier run on more ranks are never read as silent ranks of this one.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from trainbox.files import atomic_write_text

BEAT_S = 1.0          # seconds between two beats of a rank
RANK_STALL_S = 60.0   # silence after which /health reports a rank stalled, unless monitor.stall_after says


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / "ranks"


@dataclass(frozen=True)
class RankBeat:
    """One rank's file as read: who it is and how long it has been silent."""

    rank: int
    node: int
    host: str
    pid: int
    age: float               # seconds since its last beat
    ended: str | None = None  # why it ended by itself (then it is not silent)


class Heartbeat:
    """This rank's file and the thread that keeps it beating; `end(why)` stops it and records why."""

    def __init__(self, run_dir: Path, rank: int, node: int, interval: float = BEAT_S):
        self.path = folder(run_dir) / f"{rank}.json"
        self.info = {"rank": rank, "node": node, "host": socket.gethostname(), "pid": os.getpid()}
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-rank{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.info), fsync=False)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                os.utime(self.path)
            except OSError:   # the folder was cleared by a newer run on this directory: nothing to keep alive
                return

    def end(self, why: str) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            atomic_write_text(self.path, json.dumps({**self.info, "ended": why}), fsync=False)
        except OSError:
            pass


def clear(run_dir: Path) -> None:
    """Remove every rank's file (rank 0, holding the run directory, before the ranks of its run start)."""
    shutil.rmtree(folder(run_dir), ignore_errors=True)


def read(run_dir: Path, now: float | None = None) -> list[RankBeat]:
    """Every rank's file, by rank; files being replaced or cut short are skipped."""
    now = time.time() if now is None else now
    out = []
    try:
        paths = list(folder(run_dir).glob("*.json"))
    except OSError:
        return []
    for p in paths:
        try:
            mtime = p.stat().st_mtime
            d = json.loads(p.read_text())
            out.append(RankBeat(rank=int(d["rank"]), node=int(d.get("node", 0)), host=str(d.get("host", "?")),
                                pid=int(d.get("pid", 0)), age=max(0.0, now - mtime), ended=d.get("ended")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda b: b.rank)


def silent(beats: list[RankBeat], limit: float) -> list[RankBeat]:
    """The ranks silent for longer than `limit` seconds that did not end by themselves."""
    return [b for b in beats if b.ended is None and b.age > limit]


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe(lost: list[RankBeat], beats: list[RankBeat]) -> str:
    """One line naming what went silent: a whole node ("lost node N (host, ranks a-b): silent for S s") when every
    rank of it that did not end is silent, else the rank that has been silent longest ("stalled: rank R silent for
    S s (node N, host)")."""
    if len({b.node for b in beats}) > 1:
        for node in sorted({b.node for b in lost}):
            gone = [b for b in lost if b.node == node]
            if len(gone) == len([b for b in beats if b.node == node and b.ended is None]):
                return (f"lost node {node} ({gone[0].host}, {_ranks([b.rank for b in gone])}): silent for "
                        f"{max(b.age for b in gone):.0f}s")
    worst = max(lost, key=lambda b: b.age)
    return f"stalled: rank {worst.rank} silent for {worst.age:.0f}s (node {worst.node}, {worst.host})"
