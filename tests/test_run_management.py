"""Run management on real detached processes: `trainbox train --detach` returns at once with the run directory
and the commands to follow and stop it, `trainbox runs` lists the detached run as running, `trainbox attach`
follows it and returns when it ends, `trainbox stop` ends it with a checkpoint at the step it reports, and the
same train command resumes it to the end; the same through `--nproc 2` (the launcher is what is stopped);
stopping a run that is not running is refused with the reason.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainbox import checkpoint
from trainbox.rundir.runs import pid_alive

pytestmark = pytest.mark.faults

# the tiny recipe with a smaller model and evaluation (as tests/test_faults_signals.py), long enough (TOTAL steps,
# about 10 s on 2 cores) that it still runs when a `trainbox stop` started under load arrives
TOTAL = 1000
SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.seq_len=32", "train.global_batch_size=8",
         "train.micro_batch_size=4", "train.eval_tokens=8192", "train.sample_tokens=0", "monitor.port=0",
         "train.threads=1", f"train.max_steps={TOTAL}"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainbox", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def _train_args(root: Path, cache: Path, *extra: str) -> list[str]:
    return ["train", "tiny", *SMALL, f"run.dir={root}", f"data.cache_dir={cache}", *extra]


def _status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait_for_step(run: Path, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = _status(run)
        if s.get("phase") == "training" and (s.get("step") or 0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"{run} did not reach step {step}: {_status(run)}")


def _detach(root: Path, cache: Path, *extra: str) -> tuple[Path, str]:
    t0 = time.monotonic()
    p = _cli(*_train_args(root, cache, *extra), "--detach")
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    run = root / "tiny"
    assert f"run directory {run}" in p.stdout
    assert re.search(r"monitor:\s+http://127\.0\.0\.1:\d+", p.stdout), p.stdout
    assert f"trainbox logs {run} -f" in p.stdout and f"trainbox attach {run}" in p.stdout
    assert f"trainbox stop {run}" in p.stdout
    assert took < 45, f"--detach took {took:.1f} s"
    return run, p.stdout


def _assert_stopped_at_checkpoint(run: Path, out: str) -> int:
    m = re.search(r"stopped at step (\d+)", out)
    assert m, out
    step = int(m.group(1))
    ckpt = checkpoint.latest(run / "checkpoints")
    assert ckpt is not None and checkpoint.step_of(ckpt) == step, (ckpt, out)
    checkpoint.verify(ckpt)
    s = _status(run)
    assert s["phase"] == "preempted" and s["step"] == step, s
    return step


def test_detach_runs_attach_stop_resume(tmp_path, data_cache):
    root = tmp_path / "runs"
    run, _ = _detach(root, data_cache)
    pid = int(_status(run).get("pid") or 0)
    assert pid and pid != os.getpid()

    listed = _cli("runs", str(root))
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.startswith("tiny "))
    assert row.split()[1] == "running", listed.stdout

    attach = subprocess.Popen([sys.executable, "-m", "trainbox", "attach", str(run)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV)
    _wait_for_step(run, 40)
    stop = _cli("stop", str(run), "--timeout", "60")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    step = _assert_stopped_at_checkpoint(run, stop.stdout)
    assert 40 <= step < TOTAL
    assert not pid_alive(pid), f"process {pid} still runs after trainbox stop"  # (a zombie counts as gone)

    out, err = attach.communicate(timeout=30)  # attach returns by itself once the run has ended
    assert attach.returncode == 0, err
    assert "received SIGTERM" in out and f"preempted at step {step}" in err, (out[-500:], err)

    again = _cli("stop", str(run))  # stopped already: nothing to stop, and why
    assert again.returncode == 1 and "is not running: preempted" in again.stderr, again.stderr

    resumed = _cli(*_train_args(root, data_cache), timeout=180)  # the same command resumes to the end
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert re.search(rf"resuming from \S+step_0*{step} at step {step}\b", (run / "train.log").read_text())
    assert _status(run)["phase"] == "finished" and _status(run)["step"] == TOTAL
    finished = _cli("stop", "tiny", "--root", str(root))
    assert finished.returncode == 0 and "already finished" in finished.stderr, finished.stderr


@pytest.mark.slow
def test_detach_nproc_stops_through_the_launcher(tmp_path, data_cache):
    root = tmp_path / "runs"
    run, _ = _detach(root, data_cache, "--nproc", "2")
    launcher = json.loads((run / "launcher.pid").read_text())
    assert launcher["host"] == socket.gethostname() and launcher["pid"] != _status(run)["pid"]
    _wait_for_step(run, 20)
    stop = _cli("stop", str(run), "--timeout", "90")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert f"torchrun launcher {launcher['pid']}" in stop.stderr
    _assert_stopped_at_checkpoint(run, stop.stdout)
    assert not (run / "launcher.pid").exists()  # the launcher removes it as it ends
    console = (run / "console.log").read_text()
    assert "stopped at step" in console and "Traceback" not in console, console[-2000:]


def _fake_run(root: Path, name: str, **status) -> Path:
    run = root / name
    run.mkdir(parents=True)
    now = time.time()
    (run / "status.json").write_text(json.dumps({"run_name": name, "step": 7, "total_steps": 10, "started_at": now,
                                                 "heartbeat": now, **status}))
    return run


# In the front's process only: after it prints its hand-over line it holds for a second, so that a signal can be
# sent while it still runs (the front alone ends within milliseconds of that line). Loaded through PYTHONPATH.
HOLD_AFTER_HANDOVER = """
import builtins, sys, time
_print = builtins.print
def _held(*args, **kwargs):
    _print(*args, **kwargs)
    if args and str(args[0]).startswith("detached: process"):
        sys.stdout.flush()
        time.sleep(1.0)
builtins.print = _held
"""


def test_a_stop_signal_to_the_front_after_the_hand_over_stops_the_run(tmp_path, data_cache):
    """`trainbox train --detach` that takes a SIGTERM after it handed the run over (while it prints the commands
    and exits) passes it on: the run stops with a checkpoint of the step it reports, where the signal would
    otherwise be lost and the run train on."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_AFTER_HANDOVER)
    out = tmp_path / "front.log"
    with open(out, "w") as f:
        front = subprocess.Popen([sys.executable, "-m", "trainbox", *_train_args(tmp_path, data_cache), "--detach"],
                                 stdout=f, stderr=subprocess.STDOUT, env={**ENV, "PYTHONPATH": str(hook)})
    deadline = time.monotonic() + 60
    while "detached: process" not in out.read_text():
        assert front.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.01)
    front.send_signal(signal.SIGTERM)
    assert front.wait(timeout=30) == 0, out.read_text()
    pid = int(out.read_text().split("detached: process ")[1].split(",")[0])
    deadline = time.monotonic() + 60
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"the run went on training: {_status(tmp_path / 'tiny')}"
        time.sleep(0.05)
    run = tmp_path / "tiny"
    assert _status(run).get("phase") == "preempted", _status(run)
    step = _assert_stopped_at_checkpoint(run, (run / "console.log").read_text())
    assert step < TOTAL


def test_stop_refuses_runs_that_are_not_running_here(tmp_path, capsys):
    from trainbox.cli import main

    def stop(*args: str) -> tuple[int, str]:
        code = main(["stop", *args])
        return code, capsys.readouterr().err

    root = tmp_path / "runs"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    crashed = _fake_run(root, "crashed", phase="training", pid=dead.pid, host=socket.gethostname())
    code, err = stop(str(crashed))
    assert code == 1 and "is not running: crashed" in err, err

    elsewhere = _fake_run(root, "elsewhere", phase="training", pid=1234, host="another-host")
    code, err = stop(str(elsewhere))
    assert code == 1 and "runs on host another-host" in err and "not on this host" in err, err

    _fake_run(root, "done", phase="finished", pid=dead.pid, host=socket.gethostname(), step=10)
    code, err = stop("done", "--root", str(root))
    assert code == 0 and "already finished" in err, err

    code, err = stop("nothing", "--root", str(root))
    assert code == 1 and "no run 'nothing'" in err, err


def test_stop_of_an_unknown_run_lists_each_run_once(tmp_path, capsys):
    """The hint names each run directory once, as `stop NAME` accepts it: a copy of a run (same run_name in its
    status.json) under its own name, a run still starting (train.log, no status.json yet) too."""
    from trainbox.cli import main

    root = tmp_path / "runs"
    _fake_run(root, "b", phase="finished")
    _fake_run(root, "a", phase="finished")
    (root / "a-copy").mkdir()
    (root / "a-copy" / "status.json").write_bytes((root / "a" / "status.json").read_bytes())
    (root / "starting").mkdir()
    (root / "starting" / "train.log").write_text("")
    (root / "notes").mkdir()   # not a run
    assert main(["stop", "does-not-exist", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"  -> runs under {root}: a, a-copy, b, starting", err


def test_help_of_the_new_verbs_has_examples():
    for verb in ("stop", "attach"):
        p = _cli(verb, "--help")
        assert p.returncode == 0 and "examples:" in p.stdout and f"trainbox {verb} tiny" in p.stdout
    p = _cli("train", "--help")
    assert "--detach" in p.stdout and "trainbox train tiny --detach" in p.stdout


def test_the_launcher_finds_torchruns_workers():
    """Where torchrun would SIGKILL its workers 30 s after a stop signal, the launcher signals the workers it
    finds as torchrun's children: here two children of a real shell, and none of a process without any."""
    from trainbox.cli.train import workers
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        found: list[int] = []
        sleeping = lambda pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"sleep")  # noqa: E731
        for _ in range(200):   # the shell forks its children, which then exec sleep: wait until /proc shows both
            found = workers(shell.pid)
            if len(found) == 2 and all(sleeping(pid) for pid in found):
                break
            time.sleep(0.05)
        assert len(found) == 2
        assert all(sleeping(pid) for pid in found)
        assert workers(found[0]) == [] and workers(2**22 + 1) == []
    finally:
        for pid in workers(shell.pid):
            os.kill(pid, 9)
        shell.kill()
        shell.wait()
