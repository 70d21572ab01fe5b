"""Real multi-process training with gloo: two torchrun "nodes" meeting through c10d rendezvous on
localhost, `trainbox train --nproc 2` stopped by SIGTERM and resumed, a raw torchrun job stopped by
SIGUSR1 in the middle of an evaluation and resumed on ONE process.

The straight two-node run is the reference for everything: the preempted-and-resumed two-process run
must reproduce its per-step losses bit for bit, and one process (in-process, accumulation doubled)
within 1e-5. Synchronisation is on the run's own files and on /proc (pending-signal masks); the
workers are frozen with SIGSTOP while a signal is on its way, so a stop always lands mid-run.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY

from trainbox import checkpoint
from trainbox.config import load_config
from trainbox.train.loop import Trainer, train

STEPS = 40
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_cache) -> list[str]:
    root = tmp_path_factory.mktemp("dist")
    return [*TINY, f"run.dir={root / 'runs'}", f"data.cache_dir={data_cache}", "train.sample_tokens=0",
            f"train.max_steps={STEPS}", "train.eval_every=0"]


@pytest.fixture(scope="module")
def one_process(base) -> Path:
    """1 process, accumulation 2 (also fills the token cache before any multi-process run)."""
    cfg = load_config(None, [*base, "run.name=one", "monitor.enabled=false"])
    train(cfg)
    return cfg.run_dir


@pytest.fixture(scope="module")
def two_nodes(base, one_process, tmp_path_factory) -> Path:
    """Two torchrun agents, one process each, meeting through c10d rendezvous on localhost.

    The host agent starts first and the second joins once the host's store accepts connections, and
    their output goes to files (a full pipe would block a worker and hang the collective)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = tmp_path_factory.mktemp("twonodes-logs")
    procs = []
    for node in range(2):
        out = open(logs / f"node{node}.log", "w")
        procs.append(subprocess.Popen([*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                                       f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonodes",
                                       f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
                                       "-m", "trainbox", "train", *base, "run.name=twonodes", "train.pg_timeout_s=123"],
                                      env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True))
        out.close()
        if node == 0:
            _wait_for_port(port, procs[0])
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [(logs / f"node{n}.log").read_text() for n in range(2)]
    assert codes == [0, 0], "\n".join(outs)
    return Path(base[TINY.__len__()].split("=", 1)[1]) / "twonodes"


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until the rendezvous host listens on `port` (or its agent died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)  # polling a socket that is not up yet, not waiting for timing
    raise AssertionError(f"the rendezvous host never listened on port {port} (exit code {proc.poll()})")


def _events(run_dir: Path, kind: str = "train") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [e for e in (json.loads(line) for line in path.read_text().splitlines() if line.endswith("}"))
            if e["event"] == kind]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in _events(run_dir)]


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _wait(cond, procs, what: str, timeout: float = 180):
    """Poll `cond` (a file or /proc check) until true; fail at once if a process exits first."""
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"process exited ({dead}) while waiting for {what}"
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def _pending(pid: int, sig: int) -> bool:
    fields = dict(line.split(":\t") for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    mask = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return bool(mask & (1 << (sig - 1)))


def _freeze(workers: list[int]) -> None:
    """SIGSTOP every worker and wait until the kernel has really stopped each one: a signal sent to a
    process that has not yet acted on its SIGSTOP would be handled first (lower signal number)."""
    for w in workers:
        os.kill(w, signal.SIGSTOP)
    stopped = lambda: all(Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"  # noqa: E731
                          for w in workers)
    _wait(stopped, [], "the workers to stop", 60)


def _deliver_while_frozen(workers: list[int], send) -> None:
    """Workers are stopped: send the signal to the launcher, wait until it has reached every worker
    (pending in /proc), then let them run: they see it mid-run, whatever the machine's load."""
    send()
    _wait(lambda: all(_pending(w, SIG_NOW[0]) for w in workers), [], "the signal to reach every rank", 60)
    for w in workers:
        os.kill(w, signal.SIGCONT)


SIG_NOW = [signal.SIGTERM]


def test_two_nodes_match_one_process_and_only_rank0_writes(two_nodes, one_process):
    two, one = _losses(two_nodes), _losses(one_process)
    assert [s for s, _ in two] == list(range(1, STEPS + 1))          # rank 1 wrote no second copy
    assert max(abs(a - b) for (_, a), (_, b) in zip(two, one)) < 1e-5   # world-size invariant
    log = (two_nodes / "train.log").read_text()
    assert log.count(f"step 1/{STEPS} ") == 1 and "2 process(es)" in log
    assert "main gloo timeout 123s" in log                              # read back from the live group
    rngs = torch.load(checkpoint.latest(two_nodes / "checkpoints") / "rng.pt", weights_only=False)
    assert len(rngs) == 2 and not torch.equal(rngs[0]["torch"], rngs[1]["torch"])


@pytest.mark.slow
def test_nproc_sigterm_stops_all_ranks_and_resume_is_bit_identical(base, two_nodes):
    args = [sys.executable, "-m", "trainbox", "train", "--nproc", "2", *base, "run.name=nproc"]
    run_dir = two_nodes.parent / "nproc"
    launcher = subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait(lambda: any(e["step"] >= 3 for e in _events(run_dir)), [launcher], "step 3")
    (torchrun,) = _children(launcher.pid)
    workers = _children(torchrun)
    assert len(workers) == 2
    _freeze(workers)
    SIG_NOW[0] = signal.SIGTERM
    _deliver_while_frozen(workers, lambda: launcher.send_signal(signal.SIGTERM))
    out = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 0, out
    status = _status(run_dir)
    stop = status["step"]
    assert status["phase"] == "preempted" and 3 <= stop < STEPS, out
    assert checkpoint.latest(run_dir / "checkpoints").name == f"step_{stop:08d}"
    assert [s for s, _ in _losses(run_dir)] == list(range(1, stop + 1))

    resumed = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(run_dir) == _losses(two_nodes)        # no step lost or repeated; bit-identical
    assert _status(run_dir)["steps_this_process"] == STEPS - stop


def test_torchrun_sigusr1_during_eval_then_resume_on_one_process(base, two_nodes):
    run_dir = two_nodes.parent / "usr1"
    job = subprocess.Popen([*TORCHRUN, "--standalone", "--nproc_per_node=2",
                            "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1", "-m", "trainbox", "train", *base,
                            "run.name=usr1", "train.eval_every=4", "train.eval_tokens=8192"],
                           env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers: list[int] = []
    while True:   # freeze the ranks; keep the freeze only if rank 0 is inside an evaluation
        _wait(lambda: _status(run_dir).get("phase") == "evaluating", [job], "an evaluation")
        workers = workers or _children(job.pid)
        _freeze(workers)
        status = _status(run_dir)
        if status.get("phase") == "evaluating" and status["step"] < STEPS:
            break
        for w in workers:
            os.kill(w, signal.SIGCONT)
    eval_step = status["step"]
    SIG_NOW[0] = signal.SIGUSR1
    _deliver_while_frozen(workers, lambda: job.send_signal(signal.SIGUSR1))
    out = job.communicate(timeout=120)[0]
    status = _status(run_dir)
    # the evaluation finished, then both ranks stopped at that step boundary and saved
    assert status["phase"] == "preempted" and status["step"] == eval_step, out
    assert eval_step in [e["step"] for e in _events(run_dir, "eval")]
    assert checkpoint.latest(run_dir / "checkpoints").name == f"step_{eval_step:08d}"

    # resume on ONE process: the same global batches continue
    cfg = load_config(None, [*base, "run.name=usr1", "monitor.enabled=false"])   # evals change no weights
    Trainer(cfg).run()
    got, ref = _losses(run_dir), _losses(two_nodes)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert got[:eval_step] == ref[:eval_step]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref)) < 1e-5
