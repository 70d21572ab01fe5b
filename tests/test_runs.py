"""`trainbox runs`, `logs`, `status` and `plot` on real runs: live, finished, failed (NaN), stalled
(SIGSTOP) and killed (SIGKILL). A dead run must never show as running."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import run_cli
from test_monitor import LiveRun, read_status, wait_for

from trainbox import cli
from trainbox.rundir import runs


def main(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in-process (same code as `trainbox ARGS`, without a new interpreter per call)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def table(capsys, root) -> dict[str, list[str]]:
    """`trainbox runs ROOT` -> {name: row cells}, checking the header."""
    lines = main(capsys, "runs", root)[1].splitlines()
    assert lines[0].split() == ["NAME", "STATE", "STEP", "LOSS", "VAL", "EVAL", "TOK/S", "ETA", "STARTED", "UPDATED",
                               "DETAIL"]
    return {line.split()[0]: line.split() for line in lines[1:]}


def status(capsys, target, root=None) -> tuple[int, str]:
    rc, out, _ = main(capsys, "status", target, *(["--root", root] if root else []))
    assert len(out.strip().splitlines()) == 1, out  # probes log one line
    return rc, out.strip()


def test_stalled_then_killed_run_is_never_shown_running(tmp_path, data_cache, capsys):
    # no evals or checkpoints: the stop lands in the training phase, whose limit is stall_after
    live = LiveRun(tmp_path / "runs", data_cache, "victim", ["monitor.stall_after=1", "train.eval_every=0",
                                                              "train.checkpoint_every=0"], min_step=3, want_eval=False)
    try:
        assert table(capsys, live.root)["victim"][1] == "running"
        os.kill(live.pid, signal.SIGSTOP)  # a hung process: alive, no progress
        wait_for(lambda: runs.run_info(live.run_dir)["state"] == "stalled", 30, "state stalled")
        code, line = status(capsys, "victim", live.root)
        assert code == 1 and line.startswith("unhealthy: stalled: no progress")
        assert table(capsys, live.root)["victim"][1] == "stalled"
        os.kill(live.pid, signal.SIGKILL)  # the OOM killer: no chance to write a final status
        live.proc.wait(30)
        assert read_status(live.run_dir)["phase"] in ("training", "evaluating", "checkpointing")  # stale file
        row = table(capsys, live.root)["victim"]
        assert row[1] == "crashed" and row[7] == "-"  # no ETA for a dead run
        assert read_status(live.run_dir).get("eta_s") is not None and runs.run_info(live.run_dir)["eta_s"] is None
        p = run_cli("status", str(live.run_dir), check=False)  # once through a real process: the exit code
        code, line = p.returncode, p.stdout.strip()
        assert code == 1 and f"process {live.pid}" in line and "crashed" in line
    finally:
        if live.proc.poll() is None:
            live.proc.kill()
        live.stop()


# `trainbox train ARGS` with SIGTERM sent to itself while the step that ends at step N runs (argv[1]): the run stops
# at that step's boundary, as under tests/test_faults_signals.py's hook, with no timer
SIGTERM_DURING_STEP = r"""
import os, signal, sys
import trainbox.train.loop as loop
at = int(sys.argv[1])
step = loop.Trainer.train_step
loop.Trainer.train_step = lambda self, s: (os.kill(os.getpid(), signal.SIGTERM) if s + 1 == at else None,
                                           step(self, s))[1]
from trainbox.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_run_that_is_not_running_carries_no_eta(tiny, tmp_path, capsys):
    """A run preempted by SIGTERM at step 5 (each step logged, each with an ETA until then), then finished by the same
    command: status.json, `trainbox runs --json` and the dashboard's state show no ETA for either, nor for a failed
    run (a NaN loss)."""
    from trainbox.monitor.state import RunState

    root = tmp_path / "runs"
    args = ["train", *tiny, "run.name=p", "train.max_steps=8", "train.eval_every=0", "train.checkpoint_every=0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    stopped = subprocess.run([sys.executable, "-c", SIGTERM_DURING_STEP, "5", *args], env=env, capture_output=True,
                             text=True, timeout=300)
    assert stopped.returncode == 0 and "stopped at step 5" in stopped.stderr, stopped.stderr
    assert "eta 00:" in next(x for x in stopped.stderr.splitlines() if " step 5/8 " in x)   # had one while running
    s = read_status(root / "p")
    assert s["phase"] == "preempted" and s["step"] == 5 and s["eta_s"] is None, s
    infos = {i["name"]: i for i in json.loads(main(capsys, "runs", root, "--json")[1])}
    assert infos["p"]["state"] == "preempted" and infos["p"]["eta_s"] is None
    # a status.json that holds its last step's ETA (as a run wrote it while it trained): the dashboard drops it
    held = tmp_path / "held"
    held.mkdir()
    (held / "status.json").write_text(json.dumps({**s, "eta_s": 12.5}))
    state = RunState("held", held)
    state.load_files(held)
    assert state.snapshot()["eta_s"] is None

    run_cli(*args)   # the same command resumes it and finishes it
    s = read_status(root / "p")
    assert s["phase"] == "finished" and s["step"] == 8 and s["eta_s"] is None, s
    nan = run_cli("train", *tiny, "run.name=nan", "optim.lr=1e30", "train.max_steps=8", check=False)
    assert nan.returncode == 1 and "loss is nan" in nan.stderr, nan.stderr
    s = read_status(root / "nan")
    assert s["phase"] == "failed" and s["eta_s"] is None, s


def test_pid_reuse_is_not_mistaken_for_the_run():
    assert runs.pid_alive(os.getpid(), started_at=time.time())
    assert not runs.pid_alive(os.getpid(), started_at=time.time() - 10**7)  # "run" began before this process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not runs.pid_alive(child.pid)


def test_finished_failed_logs_follow_and_plot(tiny, tmp_path, capsys):
    root = tmp_path / "runs"
    # follow a run from its start to its end: `logs -f` must return by itself when the run finishes
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = subprocess.Popen([sys.executable, "-m", "trainbox", "train", *tiny, "run.name=a", "train.max_steps=12",
                              "train.eval_every=6", "monitor.plot=true"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    wait_for(lambda: (root / "a" / "train.log").exists(), 60, "train.log")
    follow = run_cli("logs", "a", "--root", str(root), "-f", timeout=120)
    assert train.wait(60) == 0
    assert follow.stdout == (root / "a" / "train.log").read_text()  # every line, nothing after the end
    assert "eval step 12" in follow.stdout.splitlines()[-1]   # the run's end: its checkpoint, then validation
    more = ["train.max_steps=12", "train.eval_every=6"]
    run_cli("train", *tiny, "run.name=b", "optim.lr=3e-3", "monitor.plot=true", *more)   # stderr shown if it fails
    nan = run_cli("train", *tiny, "run.name=nan", "optim.lr=1e30", *more, check=False)
    assert nan.returncode == 1 and "loss is nan" in nan.stderr, nan.stderr
    # the error that ends a run is said on stderr and, in the same words, at the end of train.log, where `trainbox
    # logs` and `trainbox stop` send the user
    said = nan.stderr.rstrip().splitlines()[-2:]
    assert said[0].startswith("trainbox train: loss is nan at step 2") and said[1].startswith("  -> "), nan.stderr
    logged = (root / "nan" / "train.log").read_text().rstrip().splitlines()[-2:]
    assert logged[0].endswith(" " + said[0]) and logged[1] == said[1], logged
    # a finished run's log is left as it is when the same command is refused
    log_b = (root / "b" / "train.log").read_text()
    again = run_cli("train", *tiny, "run.name=b", "optim.lr=3e-3", "monitor.plot=true", *more)
    assert "already finished" in again.stderr and (root / "b" / "train.log").read_text() == log_b

    rows = table(capsys, root)
    assert [rows[n][1] for n in ("a", "b", "nan")] == ["finished", "finished", "failed"]
    assert rows["a"][2] == "12/12" and rows["nan"][2] == "1/12"
    assert status(capsys, "a", root) == (0, "healthy: finished at step 12/12")
    code, line = status(capsys, root / "nan")
    assert code == 1 and "loss is nan at step 2" in line
    infos = json.loads(main(capsys, "runs", root, "--json")[1])
    assert {i["name"]: i["state"] for i in infos} == {"a": "finished", "b": "finished", "nan": "failed"}

    # plot: the curves are metrics.jsonl's, and both runs are drawn (one colour each)
    from trainbox.monitor.plot import load_curves
    events = [json.loads(line) for line in (root / "a" / "metrics.jsonl").read_text().splitlines()]
    curves = load_curves(root / "a")
    assert [(s, v) for s, _, v in curves.train] == [(e["step"], e["loss"]) for e in events if e["event"] == "train"]
    assert [s for s, _, _ in curves.val] == [6, 12] and curves.train[-1][1] == 12 * 8 * 32
    out = tmp_path / "compare.png"
    assert main(capsys, "plot", "a", "b", "--root", root, "--out", out)[0] == 0
    mpimg = pytest.importorskip("matplotlib.image")
    img = mpimg.imread(out)
    assert img.shape[:2] == (450, 1200)
    rgb = (img[..., :3] * 255).round().astype(int).reshape(-1, 3)
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):  # matplotlib's first two cycle colours
        assert ((abs(rgb - colour)).sum(1) <= 6).sum() > 200, colour
    for name in ("a", "b"):  # each run wrote loss.png when it ended
        assert mpimg.imread(root / name / "loss.png").shape[:2] == (450, 1200)
    assert not (root / "nan" / "loss.png").exists()   # monitor.plot=false (TINY's)
    rc, _, err = main(capsys, "plot", "nosuch", "--root", root)
    assert rc == 1 and "no run 'nosuch'" in err


def test_run_on_another_host_is_judged_by_its_heartbeat(tmp_path):
    """A run dir shared from another machine (or a container): its pid means nothing here, so only the
    heartbeat decides between running and stalled."""
    from trainbox.monitor.state import RunState

    state = RunState("remote", tmp_path)
    state.update(phase="training", step=50, step_time_s=0.5, host="gpu-node-7", pid=1)
    state.write_status(tmp_path / "status.json")
    info = runs.run_info(tmp_path)
    assert info["state"] == "running" and info["healthy"]
    later = runs.run_info(tmp_path, now=info["heartbeat"] + 61)  # > max(60 s, 10 x 0.5 s x log_every 1)
    assert later["state"] == "stalled" and not later["healthy"] and "no progress for 61s" in later["reason"]


def test_a_run_whose_status_json_cannot_be_read_is_named_not_hidden(tmp_path, capsys, caplog):
    """`trainbox runs` lists the readable runs and says which it leaves out and why; `status` on it says the file
    cannot be read, not that the run never started."""
    from trainbox.monitor.state import RunState

    for name in ("good", "torn"):
        (tmp_path / name).mkdir()
        state = RunState(name, tmp_path / name)
        state.update(phase="finished", step=5, host="elsewhere", pid=1)
        state.write_status(tmp_path / name / "status.json")
    (tmp_path / "torn" / "status.json").write_text('{"phase": "fini')
    with caplog.at_level("WARNING", logger="trainbox"):
        assert list(table(capsys, tmp_path)) == ["good"]
    assert f"{tmp_path / 'torn'}: not listed: {tmp_path / 'torn' / 'status.json'} is not readable JSON" in caplog.text
    rc, out = status(capsys, tmp_path / "torn")
    assert rc == 1 and out == f"unhealthy: {tmp_path / 'torn' / 'status.json'} is not readable JSON"


def test_a_monitor_token_is_in_no_run_file(tiny, tmp_path):
    """monitor.token on the command line: every file of the run (env.json's recorded command, config.yaml, the
    log, metrics, status, the checkpoint) holds it masked as config.yaml masks it, never in plain text."""
    secret = "SuperSecret123"
    run_cli("train", *tiny, "run.name=tok", "train.max_steps=2", "train.checkpoint_every=2",
            f"monitor.token={secret}")
    run_dir = tmp_path / "runs" / "tok"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"env.json", "config.yaml", "train.log", "metrics.jsonl", "status.json", "trainer.json"} <= {
        p.name for p in files}
    assert [p for p in files if secret.encode() in p.read_bytes()] == []
    command = json.loads((run_dir / "env.json").read_text())["command"]
    assert command[:2] == ["trainbox", "train"] and "monitor.token=***" in command and "run.name=tok" in command
    assert runs.recorded_command(["trainbox", "train", f" monitor.token ={secret}", "monitor.token=",
                                  "x=monitor.token=1"]) == [
        "trainbox", "train", " monitor.token =***", "monitor.token=", "x=monitor.token=1"]


def test_the_run_lock_records_the_command_with_the_token_masked(tmp_path, monkeypatch):
    """RUN/.lock holds the holder's command while the run lasts (and after a kill): monitor.token masked there too."""
    from trainbox.rundir.lock import RunLock
    monkeypatch.setattr("sys.argv", ["trainbox", "train", "tiny", "monitor.token=SuperSecret123"])
    lock = RunLock(tmp_path).acquire()
    try:
        held = (tmp_path / ".lock").read_text()
        assert "SuperSecret123" not in held and json.loads(held)["command"][-1] == "monitor.token=***"
    finally:
        lock.release()
