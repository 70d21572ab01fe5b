"""Per-rank heartbeats (rundir/ranks.py) and the health rule that reads them, in process: a beating rank is never
silent, a stopped one is after the limit, an ended one never is; one silent rank is named as a rank, every rank
of a node as the node; the watchdog (train/peers.py) hands that line over once the collective timeout passes, and
`name_lost` names a silent peer after a failed collective, or none, within two beats of its limit."""
from __future__ import annotations

import json
import os
import time

from trainbox.rundir import ranks
from trainbox.rundir.status import health
from trainbox.train import peers


def _beat(**kw) -> ranks.RankBeat:
    return ranks.RankBeat(**{"rank": 0, "node": 0, "host": "h0", "pid": 1, "age": 0.5, **kw})


def test_a_silent_rank_or_node_is_named():
    beats = [_beat(rank=0), _beat(rank=1, age=30), _beat(rank=2, node=1, host="h1", age=40),
             _beat(rank=3, node=1, host="h1", age=41)]
    assert ranks.describe(ranks.silent(beats[:2], 10), beats[:2]) == "stalled: rank 1 silent for 30s (node 0, h0)"
    assert ranks.describe(ranks.silent(beats, 35), beats) == "lost node 1 (h1, ranks 2, 3): silent for 41s"
    # rank 1 of node 0 also silent: node 1 is still named whole, node 0 not (rank 0 beats)
    assert ranks.describe(ranks.silent(beats, 20), beats).startswith("lost node 1 (h1")
    ended = [beats[0], _beat(rank=1, ended="finished", age=99), *beats[2:]]
    assert ranks.silent(ended, 20) == beats[2:]


def test_health_names_the_silent_rank_first():
    now = time.time()
    snap = {"phase": "training", "step": 5, "total_steps": 10, "heartbeat": now - 20, "step_time_s": 0.1}
    beats = [_beat(rank=0), _beat(rank=1, age=12)]
    assert health(snap, 10, 1, now=now, ranks=beats) == (False, "stalled: rank 1 silent for 12s (node 0, h0)")
    assert health(snap, 15, 1, now=now, ranks=beats)[1].startswith("stalled: no progress for 20s")
    assert health({**snap, "heartbeat": now}, None, 1, now=now, ranks=beats) == (True, "training step 5/10")
    assert health({**snap, "heartbeat": now}, None, 1, now=now, ranks=[_beat(rank=1, age=61)])[0] is False


def test_heartbeat_files_beat_end_and_clear(tmp_path):
    hb = ranks.Heartbeat(tmp_path, rank=3, node=1, interval=0.05).start()
    path = tmp_path / "ranks" / "3.json"
    os.utime(path, (0, 0))   # as old as can be: the thread's next beat makes it fresh
    deadline = time.monotonic() + 10
    while ranks.read(tmp_path)[0].age > 5:
        assert time.monotonic() < deadline, "no beat"
        time.sleep(0.01)
    [b] = ranks.read(tmp_path)
    assert (b.rank, b.node, b.pid, b.ended) == (3, 1, os.getpid(), None)
    hb.end("finished")
    assert json.loads(path.read_text())["ended"] == "finished"
    ranks.clear(tmp_path)
    assert ranks.read(tmp_path) == []


def test_the_watchdog_hands_over_the_silent_peer(tmp_path):
    mine = ranks.Heartbeat(tmp_path, rank=0, node=0, interval=0.05).start()
    other = ranks.Heartbeat(tmp_path, rank=1, node=0).start()
    other.end("x")   # stop its thread, then make it an unended, silent rank
    (tmp_path / "ranks" / "1.json").write_text(json.dumps({**other.info}))
    os.utime(tmp_path / "ranks" / "1.json", (time.time() - 3, time.time() - 3))
    found: list[str] = []
    dog = peers.Watchdog(tmp_path, world=2, me=0, timeout=2.0, on_lost=found.append).start()
    deadline = time.monotonic() + 20
    while not found:
        assert time.monotonic() < deadline, "the watchdog never fired"
        time.sleep(0.02)
    dog.stop()
    assert found[0].startswith("stalled: rank 1 silent for"), found
    # after a failed collective: the silent peer is named once past GONE_S (here: the timeout, smaller)
    assert peers.name_lost(tmp_path, 2, 0, timeout=2.0, since=time.time()).startswith("stalled: rank 1 silent")
    # every peer ended by itself: nothing to name, at once
    (tmp_path / "ranks" / "1.json").write_text(json.dumps({**other.info, "ended": "failed: RuntimeError"}))
    t0 = time.monotonic()
    assert peers.name_lost(tmp_path, 2, 0, timeout=30, since=time.time()) is None
    assert time.monotonic() - t0 < 5
    # a peer that keeps beating is alive: the error was this rank's own, and the wait ends two beats after the limit
    live = ranks.Heartbeat(tmp_path, rank=1, node=0, interval=0.05).start()
    t0 = time.monotonic()
    assert peers.name_lost(tmp_path, 2, 0, timeout=1.0, since=time.time()) is None
    assert 1.0 < time.monotonic() - t0 < 1.0 + 2 * ranks.BEAT_S + 2
    live.end("finished")
    mine.end("finished")
