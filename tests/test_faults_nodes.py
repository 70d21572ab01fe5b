"""A lost node and a stuck rank, on real `trainbox train` processes (torchrun, gloo), with the tiny recipe's model
made smaller and the intervals users run (a log line every 10 steps, a checkpoint every 50):

- two nodes of one job (`--nnodes 2 --node-rank R --rdzv-endpoint`, one process each); node 1's launcher,
  torchrun and worker are SIGKILLed mid-run. Node 0's rank stops with a message naming node 1 (well within
  train.collective_timeout), never hangs; the same two commands started again resume from the newest verified
  checkpoint, and every step's loss, the re-run ones included, equals the uninterrupted two-node run's bit for
  bit. The time from the kill to training again is printed (`-s`);
- one worker of `--nproc 2` frozen with SIGSTOP: /health turns 503 with "stalled: rank 1 silent for N s" once
  monitor.stall_after has passed, `trainbox status` names the rank, and after train.collective_timeout the other
  rank ends the job with that message (status.json: failed), the launcher exiting non-zero.
"""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from conftest import run_cli
from nodes import Node, finish, losses, start_nodes, status, wait_for

from trainbox import checkpoint

pytestmark = pytest.mark.faults

SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.seq_len=32", "train.global_batch_size=8",
         "train.micro_batch_size=4", "train.sample_tokens=0", "monitor.port=0", "train.threads=1"]
TOTAL = 200
RUN = [f"train.max_steps={TOTAL}", "train.checkpoint_every=50", "monitor.log_every=10", "train.eval_every=100",
       "train.eval_tokens=2048", "train.collective_timeout=30"]


def _args(root, cache, name: str, *extra: str) -> list[str]:
    return ["train", "tiny", "--nproc", "1", *SMALL, *RUN, f"run.dir={root}", f"run.name={name}",
            f"data.cache_dir={cache}", *extra]


@pytest.mark.slow
def test_a_killed_node_stops_the_job_by_name_and_a_relaunch_continues_exactly(tmp_path, data_cache):
    run_dir = tmp_path / "job"
    nodes = start_nodes(_args(tmp_path, data_cache, "job"), tmp_path, "job")
    reference_nodes = []
    try:   # mid-run, past the first checkpoint
        wait_for(lambda: status(run_dir).get("step", 0) >= 60 and status(run_dir).get("phase") == "training",
                 "step 60", 180, nodes)
        killed = time.time()
        nodes[1].kill_all()
        # the uninterrupted two-node run trains while node 0 waits out the silence that names node 1
        reference_nodes = start_nodes(_args(tmp_path, data_cache, "reference"), tmp_path, "reference")
        code, out = nodes[0].wait(timeout=30 + 90)   # train.collective_timeout, and time to say so
        stopped = time.time()
        finish(reference_nodes)
    finally:
        for n in [*nodes, *reference_nodes]:
            n.stop()
    reference = losses(tmp_path / "reference")
    assert sorted(reference) == list(range(1, TOTAL + 1))
    assert code != 0, out
    assert "lost node 1 (" in out, out
    newest = checkpoint.latest(run_dir / "checkpoints")
    checkpoint.verify(newest)
    resumed_at = checkpoint.step_of(newest)
    assert 50 <= resumed_at < TOTAL, newest

    relaunched = time.time()
    again = start_nodes(_args(tmp_path, data_cache, "job"), tmp_path, "again")
    training = wait_for(lambda: status(run_dir).get("started_at", 0) >= relaunched
                        and status(run_dir).get("phase") == "training", "training again", 180, again)
    outs = finish(again)
    assert any(f"resuming from {newest} at step {resumed_at}" in o for o in outs), outs
    assert losses(run_dir) == reference
    print(f"\nnode lost at step >= 60: the other node stopped {stopped - killed:.1f}s after the kill, "
          f"naming it; relaunched, training again {training - relaunched:.1f}s later: {training - killed:.1f}s "
          f"from the kill to training (resumed at step {resumed_at})")


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_stopped_rank_is_named_by_health_and_status_and_ends_the_job(tmp_path, data_cache):
    stall_after, timeout = 2, 6
    run_dir = tmp_path / "stuck"
    args = _args(tmp_path, data_cache, "stuck", "train.max_steps=100000", "train.eval_every=0",
                 f"monitor.stall_after={stall_after}", f"train.collective_timeout={timeout}",
                 "train.pg_timeout_s=10")
    args[3] = "2"   # --nproc 2 on one node
    node = Node(args, tmp_path / "stuck.log")
    stopped_pid = None
    try:
        wait_for(lambda: status(run_dir).get("phase") == "training" and status(run_dir).get("step", 0) >= 20,
                 "training", 180, [node])
        url = status(run_dir)["url"]
        assert _health(url)[0] == 200
        stopped_pid = json.loads((run_dir / "ranks" / "1.json").read_text())["pid"]
        os.kill(stopped_pid, signal.SIGSTOP)
        frozen = time.time()
        seen = {}

        def stalled() -> bool:
            code, body = _health(url)
            seen.update(body)
            return code == 503 and body["reason"].startswith("stalled: rank 1 silent for")

        at = wait_for(stalled, "/health 503 naming rank 1", stall_after + 15, [node])
        assert at - frozen < stall_after + 5, (at - frozen, seen)   # one beat late at most, with a loaded machine
        out = run_cli("status", str(run_dir), check=False)
        assert "stalled: rank 1 silent for" in out.stdout + out.stderr, out
        ended = wait_for(lambda: status(run_dir).get("phase") == "failed", "the job's end", timeout + 60, [node])
        # torchrun ends the frozen rank too, with SIGKILL 30 s after its SIGTERM (which a stopped process cannot
        # take); the test does at once what torchrun does then
        os.kill(stopped_pid, signal.SIGKILL)
        code, log = node.wait(timeout=60)
    finally:
        if stopped_pid is not None:
            try:
                os.kill(stopped_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.stop()
    assert code != 0 and "stalled: rank 1 silent for" in log, log
    assert "the job stops (train.collective_timeout=6s)" in log, log
    final = status(run_dir)
    assert final["phase"] == "failed" and final["error"].startswith("stalled: rank 1 silent for"), final
    print(f"\nSIGSTOP of rank 1: /health 503 after {at - frozen:.1f}s (monitor.stall_after={stall_after}), "
          f"the job ended {ended - frozen:.1f}s after the stop (train.collective_timeout={timeout})")
