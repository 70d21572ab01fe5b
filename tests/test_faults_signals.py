"""Fault injection on real `trainbox train` processes with the tiny recipe's own settings: 600 steps, a log
line every 20 steps, evaluation and a checkpoint every 300 (only the model is smaller, so a run takes
seconds). Nothing may be lost:

- SIGTERM, SIGINT and SIGUSR1, each at 10+ moments of one run (seeded random moments, the first step, an
  evaluation, a checkpoint save), the run resumed after each: every stop exits 0 with a verified checkpoint at
  the step it names, and the per-step losses of the whole chain equal an uninterrupted run's bit for bit;
- the same through `trainbox train --nproc 2` (torchrun, gloo);
- SIGKILL at seeded random moments: the run resumes from its newest checkpoint and every logged loss, the
  re-run steps' included, equals the uninterrupted run's;
- a second run on the same run directory is refused naming the holder's pid; a lock left by a gone process
  is taken over;
- a stop signal during the end of a run (its final evaluation) cuts the end short, and SIGKILL there leaves a
  crashed run: either way the same command does the end again from the final checkpoint, and then says the run
  is finished.

A moment inside the first step, an evaluation or a save is hit exactly by a wrapper that signals the process
itself when the loop reaches that function (`_hooked`); the other moments are signals from outside.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import run_check_script

from trainbox import checkpoint

pytestmark = pytest.mark.faults

# the tiny recipe as shipped (its optimizer, logging and sample settings), with a smaller model and evaluation, run
# for 600 steps with an evaluation and a save at step 300 (the recipe's own 300 steps evaluate and save at the end)
SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.seq_len=32", "train.global_batch_size=8",
         "train.micro_batch_size=8", "train.eval_tokens=8192", "train.sample_tokens=0", "monitor.port=0",
         "train.max_steps=600", "train.eval_every=300", "train.checkpoint_every=300"]
TOTAL, EVAL_AT = 600, 300
STOPS = 6   # per signal: the first step, the evaluation or save of step 300, then random moments
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

HOOK = r"""
import os, signal, sys
import trainbox.checkpoint as ckpt
import trainbox.train.loop as loop
sig, where, at = getattr(signal, sys.argv[1]), sys.argv[2], int(sys.argv[3])
fire = lambda: os.kill(os.getpid(), sig)
if where == "step":      # while the step that ends at `at` runs
    step = loop.Trainer.train_step
    loop.Trainer.train_step = lambda self, s: (fire() if s + 1 == at else None, step(self, s))[1]
elif where == "eval":    # while the evaluation at step `at` runs (the run's objective evaluates)
    import trainbox.objective.next_token as objective
    evaluate = objective.NextToken.evaluate
    objective.NextToken.evaluate = lambda self, run: (fire(), evaluate(self, run))[1]
elif where == "save":    # while the checkpoint of step `at` is written
    save = ckpt.save
    ckpt.save = lambda root, s, *a, **k: (fire() if s == at else None, save(root, s, *a, **k))[1]
elif where == "sample":  # while the end-of-run sample is drawn
    import trainbox.train.evaluate as evaluations
    draw = evaluations.sample
    evaluations.sample = lambda *a, **k: (fire(), draw(*a, **k))[1]
from trainbox.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _args(root: Path, cache: Path, name: str, *extra: str) -> list[str]:
    return ["train", "tiny", *SMALL, f"run.dir={root}", f"run.name={name}", f"data.cache_dir={cache}",
            "train.threads=1", *extra]


class Segment:
    """One `trainbox train` process of a chain, its output in a file (a full pipe would block it)."""

    def __init__(self, args: list[str], log: Path, hook: tuple[str, str, int] | None = None):
        self.log = log
        cmd = [sys.executable, "-c", HOOK, *map(str, hook), *args] if hook else [sys.executable, "-m", "trainbox",
                                                                               *args]
        self.out = open(log, "w")
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=ENV)

    def wait(self, timeout: float = 240) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        self.out.close()
        return code, self.log.read_text()


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait_training(seg: Segment, run_dir: Path, timeout: float = 120) -> bool:
    """Until this segment's run (rank 0 under torchrun) reports its loop running (False: it ended first)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = _status(run_dir)
        if s.get("started_at", 0) >= seg.t0 and s.get("phase") in ("training", "evaluating", "checkpointing"):
            return True
        if seg.proc.poll() is not None:
            return False
        time.sleep(0.01)
    raise AssertionError(f"{run_dir}: no training phase within {timeout}s\n{seg.log.read_text()}")


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e["event"] == "train"]


def _check_stop(code: int, out: str, run_dir: Path, after: int, torchrun: bool = False) -> int:
    """A graceful stop: exit 0, 'stopped at step N', a checkpoint of step N that verifies. Returns N, which is
    past `after` (the step the segment resumed from) or equal to it: a signal that arrives before the segment's
    first step stops the run where it resumed, which loses nothing either. (torchrun's agent prints its own
    SignalException traceback when it passes a signal on.)"""
    assert code == 0, out
    assert "unexpected error" not in out and (torchrun or "Traceback" not in out), out
    line = next((x for x in out.splitlines() if "stopped at step" in x), None)
    assert line is not None, out
    step = int(line.split("stopped at step ")[1].split()[0])
    assert step >= after, (step, after, out)
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    assert ckpt is not None and checkpoint.step_of(ckpt) == step, (ckpt, step)
    checkpoint.verify(ckpt)
    return step


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


@pytest.fixture(scope="module")
def reference(root, cache) -> dict:
    """The uninterrupted run: step -> loss, and its training speed (steps per second). While it trains, a second
    run of the same command on its run directory is started: `second` is that run's (exit status, output),
    `pid` the running one's process id (test_second_run_on_a_run_directory_is_refused_and_a_stale_lock_is_taken)."""
    t0 = time.time()
    run_dir = root / "reference"
    first = Segment(_args(root, cache, "reference"), root / "reference.log")
    assert _wait_training(first, run_dir)
    second = Segment(_args(root, cache, "reference"), root / "reference-second.log").wait()
    code, out = first.wait()
    assert code == 0, out
    losses = _losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, TOTAL + 1))   # nothing interleaved
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(e["time"] for e in events if e["event"] == "start")
    end = next(e["time"] for e in events if e["event"] == "train" and e["step"] == TOTAL)
    return {"losses": dict(losses), "steps_per_s": TOTAL / max(end - start, 1e-3), "seconds": time.time() - t0,
            "second": second, "pid": first.proc.pid}


def _signal_chain(root: Path, cache: Path, reference: dict, sig: str, hook_at_eval: str, seed: int,
                  extra: tuple[str, ...] = ()) -> list[int]:
    """Stop one run with `sig` at the first step, at the evaluation or the save of step 300, then at seeded
    random moments until STOPS stops, resuming after each; finish it and compare every step's loss."""
    name = f"chain-{sig.lower()}"
    run_dir = root / name
    rnd = random.Random(seed)
    stops: list[int] = []
    logs = root / f"{name}-logs"
    logs.mkdir()
    hooks = [("step", 1), (hook_at_eval, EVAL_AT)]
    while len(stops) < STOPS:
        k = len(stops)
        after = stops[-1] if stops else 0
        if k < len(hooks):
            where, at = hooks[k]
            seg = Segment(_args(root, cache, name, *extra), logs / f"{k}.log", hook=(sig, where, at))
        else:
            seg = Segment(_args(root, cache, name, *extra), logs / f"{k}.log")
            if not _wait_training(seg, run_dir):
                raise AssertionError(f"{sig}: the run ended before stop {k + 1}\n{seg.log.read_text()}")
            # a moment 1-20 steps into this segment's training, at the reference run's pace
            time.sleep(rnd.uniform(1, 20) / reference["steps_per_s"])
            seg.proc.send_signal(getattr(signal, sig))
        code, out = seg.wait()
        stops.append(_check_stop(code, out, run_dir, after))
        if k < len(hooks):
            assert stops[-1] == hooks[k][1], (sig, hooks[k], stops)
        assert f"received {sig}" in out, out
    code, out = Segment(_args(root, cache, name, *extra), logs / "last.log").wait()
    assert code == 0 and "stopped" not in out, out
    got = _losses(run_dir)
    assert [s for s, _ in got] == list(range(1, TOTAL + 1)), "a step was logged twice or never"
    assert dict(got) == reference["losses"], sig
    return stops


@pytest.mark.slow
def test_stop_signals_at_any_moment_lose_nothing_and_resume_bit_identically(root, cache, reference):
    """STOPS stops per signal, each resumed; SIGUSR1's run logs every 7 steps, the others every 20 (the recipe)."""
    chains = {"SIGTERM": ("save", 11, ()), "SIGINT": ("eval", 12, ()),
              "SIGUSR1": ("save", 13, ("monitor.log_every=7",))}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {sig: pool.submit(_signal_chain, root, cache, reference, sig, where, seed, extra)
                   for sig, (where, seed, extra) in chains.items()}
        stops = {sig: f.result() for sig, f in futures.items()}
    for sig, steps in stops.items():
        assert len(steps) == STOPS and steps[:2] == [1, EVAL_AT], (sig, steps)


def _two(root: Path, cache: Path, name: str, *extra: str) -> list[str]:
    """`trainbox train --nproc 2` with the same global batch (8 = 4 x 2)."""
    return ["train", "--nproc", "2", *_args(root, cache, name, "train.micro_batch_size=4", *extra)[1:]]


@pytest.fixture(scope="module")
def torchrun_reference(root, cache) -> dict:
    """The uninterrupted 2-process run: `losses`, (step, loss) of every step. While it trains, a second
    `--nproc 2` launch on its run directory is started: `busy` is that launch's (exit status, output)
    (test_a_busy_run_directory_is_refused_under_nproc)."""
    run_dir = root / "torchrun-reference"
    run = Segment(_two(root, cache, "torchrun-reference"), root / "torchrun-reference.log")
    assert _wait_training(run, run_dir)
    busy = Segment(_two(root, cache, "torchrun-reference"), root / "torchrun-busy.log").wait()
    code, out = run.wait()
    assert code == 0, out
    return {"losses": _losses(run_dir), "busy": busy}


@pytest.mark.slow
def test_stop_signals_under_torchrun_lose_nothing(root, cache, reference, torchrun_reference):
    """`trainbox train --nproc 2`: each signal to the launcher stops both ranks at one step with a checkpoint;
    the resumed chain matches an uninterrupted 2-process run bit for bit. The launcher passes the signal to the
    workers, so torchrun ends as they do (exit 0) and prints no traceback."""
    name = "torchrun-chain"
    run_dir, rnd, stops = root / name, random.Random(21), []
    for k, sig in enumerate(("SIGTERM", "SIGINT", "SIGUSR1")):
        seg = Segment(_two(root, cache, name), root / f"torchrun-{k}.log")
        assert _wait_training(seg, run_dir)
        time.sleep(rnd.uniform(5, 60) / reference["steps_per_s"])
        seg.proc.send_signal(getattr(signal, sig))
        code, out = seg.wait()
        stops.append(_check_stop(code, out, run_dir, stops[-1] if stops else 0))
        assert out.count("stopped at step") == 1, out   # rank 0 reports; the launcher adds no second failure
        assert "SignalException" not in out and "Traceback" not in out, out
    code, out = Segment(_two(root, cache, name), root / "torchrun-last.log").wait()
    assert code == 0, out
    got = _losses(run_dir)
    assert [s for s, _ in got] == list(range(1, TOTAL + 1))
    assert got == torchrun_reference["losses"]


ARM_LIMIT = 2.0   # seconds from the start by which `trainbox train` must hold its stop handler


def _armed(seg: Segment) -> float:
    """The seconds after its start at which the process held a handler for SIGTERM (polled in /proc).

    Before Python runs the first line of trainbox (its own start: about 30 ms on an idle machine, longer under
    load) no program can catch a signal; from that line on, trainbox keeps it. A trial aimed at a moment before
    that waits for it, and the handler must be in place within ARM_LIMIT (before the fix, about 8 s: torch's
    import came first)."""
    from trainbox.rundir.runs import catches_signal
    while not catches_signal(seg.proc.pid, signal.SIGTERM):
        assert seg.proc.poll() is None, seg.log.read_text()
        assert time.time() - seg.t0 < ARM_LIMIT, f"no stop handler {ARM_LIMIT}s after the start"
        time.sleep(0.002)
    return time.time() - seg.t0


def _signal_at(cmd: list[str], log: Path, sig: str, delay: float) -> tuple[int, str, int | None]:
    """Start `trainbox CMD`, send `sig` `delay` seconds after the start (or once its handler is in place, if
    that is later), wait for the end. A --detach front that has already handed the run over ("detached: process
    P") has ended: the signal goes to P, the run itself; one that takes the signal while it prints that and exits
    passes it on to P. Returns (the front's exit status, its output, P or None)."""
    seg = Segment(cmd, log)
    _armed(seg)
    while seg.proc.poll() is None and time.time() < seg.t0 + delay:
        time.sleep(0.005)
    sent = seg.proc.poll() is None
    if sent:
        seg.proc.send_signal(getattr(signal, sig))
    code, out = seg.wait()
    if "detached: process" not in out:
        assert sent, out   # only --detach returns on its own, once the run is handed over
        return code, out, None
    run = int(out.split("detached: process ")[1].split(",")[0])
    if not sent:
        assert code == 0, out
        while time.time() < seg.t0 + delay:
            time.sleep(0.005)
        os.kill(run, getattr(signal, sig))
    while _pid_running(run):   # a child of no one here: it ends by itself
        time.sleep(0.05)
    return code, out, run


def _pid_running(pid: int) -> bool:
    from trainbox.rundir.runs import pid_alive
    return pid_alive(pid)


@pytest.mark.parametrize("mode", ["one", pytest.param("nproc", marks=pytest.mark.slow),
                                  pytest.param("detach", marks=pytest.mark.slow)])
def test_a_stop_signal_at_any_moment_from_the_start_is_graceful(tmp_path, cache, mode):
    """SIGTERM, SIGINT and SIGUSR1 at seeded random moments 0.05-10 s after `trainbox train` starts (the tiny
    recipe as shipped), alone, under --nproc 2 and through --detach: whether it lands while Python imports torch,
    while the run is set up or while it trains, the process ends with exit 0 and one line saying what happened:
    "stopped before the first step; nothing to save", or "stopped at step N" with a checkpoint of step N that
    verifies. Never a signal's default exit (143, 130, 138) or a traceback."""
    rnd = random.Random({"one": 41, "nproc": 42, "detach": 43}[mode])
    strata = [(0.05, 1.0), (1.0, 4.0), (4.0, 10.0)]   # every signal once in each part of the start
    rnd.shuffle(strata)
    for sig, (lo, hi) in zip(("SIGTERM", "SIGINT", "SIGUSR1"), strata):
        name = f"{mode}-{sig.lower()}"
        cmd = ["train", "tiny", f"run.dir={tmp_path}", f"run.name={name}", f"data.cache_dir={cache}",
               "train.threads=1", "monitor.port=0"]
        if mode == "nproc":
            cmd[1:1] = ["--nproc", "2"]
        if mode == "detach":
            cmd.append("--detach")
        delay = rnd.uniform(lo, hi)
        code, out, run = _signal_at(cmd, tmp_path / f"{name}.log", sig, delay)
        run_dir = tmp_path / name
        where = f"{mode} {sig} at {delay:.2f} s"
        if run is not None:   # the run took the signal itself: its own output is in console.log
            out = (run_dir / "console.log").read_text()
            assert _status(run_dir).get("phase") == "preempted", (where, out)
        assert code == 0, (where, out)
        assert "Traceback" not in out and "unexpected error" not in out, (where, out)
        ckpt = checkpoint.latest(run_dir / "checkpoints")
        if "stopped before the first step; nothing to save" in out:
            assert ckpt is None and "stopped at step" not in out, (where, out)
        else:
            line = next((x for x in out.splitlines() if "stopped at step" in x), None)
            assert line is not None, (where, out)
            step = int(line.split("stopped at step ")[1].split()[0].rstrip(":;"))
            assert ckpt is not None and checkpoint.step_of(ckpt) == step, (where, ckpt, out)
            checkpoint.verify(ckpt)


def test_a_second_ctrl_c_while_the_run_starts_stops_at_once(tmp_path, cache):
    seg = Segment(["train", "tiny", f"run.dir={tmp_path}", "run.name=twice", f"data.cache_dir={cache}"],
                  tmp_path / "twice.log")
    start = _armed(seg)
    for at in (start, start + 0.02):   # while the config still loads
        while time.time() < seg.t0 + at:
            time.sleep(0.005)
        seg.proc.send_signal(signal.SIGINT)
    code, out = seg.wait()
    assert code == 130 and out.strip().splitlines()[-1] == "interrupted", out


# A Ctrl-C between two of the stop handlers being installed: SIGTERM's is in place (what the test above waits for),
# SIGINT's is still Python's own, which raises KeyboardInterrupt wherever the code is
BETWEEN_HANDLERS = r"""
import os, signal
import trainbox.train.stop as stop

real = signal.signal
def install_then_ctrl_c(s, h):
    old = real(s, h)
    if s == signal.SIGTERM:
        os.kill(os.getpid(), signal.SIGINT)
    return old

signal.signal = install_then_ctrl_c
stop.STOP.install()
signal.signal = real
assert stop.STOP.signum == signal.SIGINT, stop.STOP.signum
stop.STOP.restore()
print("ok")
"""


def test_a_ctrl_c_while_the_stop_handlers_go_in_reaches_its_handler():
    run_check_script(BETWEEN_HANDLERS)


# The second Ctrl-C lands inside code run by exec() of a string, as while dataclasses or pydantic build a class
# when the config loads: the interrupt leaves the exec'd code before the CLI catches it.
SECOND_IN_EXEC = r"""
import os, signal, sys
import trainbox.cli as cli

def run(argv):
    os.kill(os.getpid(), signal.SIGINT)   # the first: a stop at the next step boundary
    exec("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(1000): pass")
    return 0

cli.run = run
sys.argv = ["trainbox", "train"]
raise SystemExit(cli.main())
"""


def test_a_second_ctrl_c_inside_exec_code_exits_130_under_python_m(tmp_path):
    """`python -m trainbox train`: CPython ends a `-m` process by SIGINT at its exit once a KeyboardInterrupt has left
    exec'd code, even though the CLI caught it; the second Ctrl-C raises a subclass, which CPython does not note."""
    (tmp_path / "second_in_exec.py").write_text(SECOND_IN_EXEC)
    p = subprocess.run([sys.executable, "-m", "second_in_exec"], cwd=tmp_path, capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert p.returncode == 130 and p.stderr.strip().splitlines()[-1] == "interrupted", (p.returncode, p.stderr)


# `trainbox train` as the process's entry point, its command done; then a process that sends it SIGTERM every
# millisecond until it is gone, so signals land all through the interpreter's shutdown, where CPython puts back the
# default action (which kills) of every signal with a Python handler
SIGNALS_AT_THE_EXIT = r"""
import os, subprocess, sys
import trainbox.cli as cli

cli.run = lambda argv: 0   # the command, done at once
sys.argv = ["trainbox", "train"]
code = cli.main()
spam = ("import os, signal, sys, time\npid = int(sys.argv[1])\nprint('on', flush=True)\n"
        "while True:\n    try:\n        os.kill(pid, signal.SIGTERM)\n    except ProcessLookupError:\n        break\n"
        "    time.sleep(0.001)\n")
sender = subprocess.Popen([sys.executable, "-c", spam, str(os.getpid())], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)   # holds none of the test's pipes
assert sender.stdout.readline() == b"on\n"
raise SystemExit(code)
"""


def test_a_stop_signal_while_the_process_exits_leaves_the_commands_exit_status(tmp_path):
    """A stop signal that lands after the command is done (a --detach front that has handed its run over, a run
    that has finished) changes nothing: the exit status is the command's, not the signal's 143."""
    (tmp_path / "signals_at_the_exit.py").write_text(SIGNALS_AT_THE_EXIT)
    for _ in range(3):
        p = subprocess.run([sys.executable, "-m", "signals_at_the_exit"], cwd=tmp_path, capture_output=True,
                           text=True, env=ENV, timeout=60)
        assert p.returncode == 0, (p.returncode, p.stderr)


def _workers_of(launcher: int) -> list[int]:
    from trainbox.cli.train import workers
    return [w for t in workers(launcher) for w in workers(t)]


def _kill_launcher(launcher: int, run_dir: Path, timeout: float = 60) -> tuple[int, float]:
    """SIGKILL the `--nproc` launcher `launcher`; wait until its workers have ended. Returns (the step of the
    newest checkpoint, seconds from the kill until no worker was left)."""
    deadline = time.time() + timeout
    while len(workers := _workers_of(launcher)) != 2:   # /proc lists a process's children as it starts them
        assert time.time() < deadline, workers
        time.sleep(0.02)
    os.kill(launcher, signal.SIGKILL)
    killed = time.time()
    while any(_pid_running(w) for w in workers):
        assert time.time() - killed < timeout, f"workers {workers} still run {timeout}s after their launcher died"
        time.sleep(0.02)
    gone = time.time() - killed
    from trainbox.rundir.lock import RunLock
    RunLock(run_dir).acquire().release()   # free again
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    checkpoint.verify(ckpt)
    return checkpoint.step_of(ckpt), gone


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_workers_and_the_run_resumes_exactly(root, cache, reference, torchrun_reference):
    """SIGKILL of `trainbox train --nproc 2` (and then of its --detach form) at a seeded moment: the workers see
    their launcher gone, stop at the next step boundary with a checkpoint and release the run directory within
    seconds; the relaunched chain ends with every step's loss equal to an uninterrupted 2-process run's."""
    name, rnd = "orphans", random.Random(51)
    run_dir = root / name
    seg = Segment(_two(root, cache, name), root / "orphans-0.log")
    assert _wait_training(seg, run_dir)
    time.sleep(rnd.uniform(5, 60) / reference["steps_per_s"])
    first, gone = _kill_launcher(seg.proc.pid, run_dir)
    seg.wait()
    assert gone < 15, gone
    assert "the launcher (process" in (run_dir / "train.log").read_text()

    front = Segment([*_two(root, cache, name), "--detach"], root / "orphans-1.log")
    code, out = front.wait()
    assert code == 0 and "detached: process" in out, out
    launcher = int(out.split("detached: process ")[1].split(",")[0])
    _wait_for_step(run_dir, first + 5)
    second, gone = _kill_launcher(launcher, run_dir)
    assert second > first and gone < 15, (first, second, gone)

    code, out = Segment(_two(root, cache, name), root / "orphans-last.log").wait()
    assert code == 0, out
    got = _losses(run_dir)
    assert [s for s, _ in got] == list(range(1, TOTAL + 1))
    assert got == torchrun_reference["losses"]


@pytest.mark.slow
def test_a_busy_run_directory_is_refused_under_nproc(torchrun_reference):
    """While a `--nproc 2` run trains (the uninterrupted 2-process run), a second launch on its run directory is
    refused in one message (exit 2) before torchrun starts; the first trains on to its end (the fixture)."""
    code, out = torchrun_reference["busy"]
    assert code == 2 and "is in use by process" in out and "launching" not in out and "Traceback" not in out, out


def _wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while _status(run_dir).get("step", 0) < step:
        assert time.time() < deadline, f"{run_dir} did not reach step {step}"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_at_random_moments_resumes_from_the_newest_checkpoint(root, cache, reference):
    """SIGKILL 4 times at seeded moments (before and after the checkpoint of step 300); each restart resumes
    from the newest checkpoint. metrics.jsonl ends with each step once, equal to the straight run's, and the
    lines of the lost steps, moved to superseded/, equal it too (the re-run computed the same losses)."""
    name, run_dir, rnd = "killed", root / "killed", random.Random(31)
    # the step each kill aims at: the first before step 300's checkpoint (the restart begins again at 0), the
    # others after it (each restart resumes there)
    targets = [rnd.uniform(30, EVAL_AT - 20), *(rnd.uniform(EVAL_AT + 60, TOTAL - 20) for _ in range(3))]
    starts: list[int] = []
    for k, target in enumerate(targets):
        seg = Segment(_args(root, cache, name), root / f"killed-{k}.log")
        if not _wait_training(seg, run_dir):
            break
        ckpt = checkpoint.latest(run_dir / "checkpoints")
        starts.append(checkpoint.step_of(ckpt) if ckpt is not None else 0)
        # status.json names the step at each log line (every 20 steps): from the last one before the target, the
        # rest of the way at the reference run's pace, so a segment that trains faster than the reference did
        # cannot finish the run before its kill
        _wait_for_step(run_dir, max(starts[-1], int(target) - 20))
        time.sleep(max(0.0, target - _status(run_dir).get("step", 0)) / reference["steps_per_s"])
        seg.proc.kill()
        seg.wait()
        ckpt = checkpoint.latest(run_dir / "checkpoints")
        if ckpt is not None:
            checkpoint.verify(ckpt)
    code, out = Segment(_args(root, cache, name), root / "killed-last.log").wait()
    assert code == 0, out
    got = _losses(run_dir)
    assert [s for s, _ in got] == list(range(1, TOTAL + 1))
    assert dict(got) == reference["losses"]
    lost = [x for p in (run_dir / "superseded").glob("*/metrics.jsonl") for x in _losses(p.parent)]
    assert lost, "no kill landed after a logged step: nothing was re-run"
    assert EVAL_AT in starts, f"no restart resumed from step {EVAL_AT}'s checkpoint: {starts}"
    assert all(v == reference["losses"][s] for s, v in lost)


@pytest.mark.slow
def test_second_run_on_a_run_directory_is_refused_and_a_stale_lock_is_taken(root, cache, reference):
    """The second run started while the reference run trained is refused, naming the holder's pid, and writes
    nothing into its files; the holder ran to its end with every step once (the fixture): the losses every chain
    here is compared with."""
    name, run_dir = "reference", root / "reference"
    code, out = reference["second"]
    assert code == 2, out
    assert f"run directory {run_dir} is in use by process {reference['pid']}" in out, out
    assert [s for s, _ in _losses(run_dir)] == list(range(1, TOTAL + 1))   # nothing interleaved
    log = (run_dir / "train.log").read_text()
    assert "in use" not in log   # the refused run wrote nothing into the running one's files

    # a lock file left by a process that is gone (another host, a dead pid) is taken over
    stale = {"pid": 2**22 + 17, "host": "elsewhere", "started_at": time.time() - 60, "command": ["trainbox"]}
    (run_dir / ".lock").write_text(json.dumps(stale))
    code, out = Segment(_args(root, cache, name, "train.max_steps=610"), root / "locked-third.log").wait()
    assert code == 0, out
    assert f"left by process {stale['pid']} on elsewhere, which is gone" in out, out
    assert _losses(run_dir)[-1][0] == 610
    assert (run_dir / ".lock").read_text() == ""   # released at the end


def test_a_lock_holder_is_seen_from_another_thread_of_the_same_host(tmp_path):
    """The lock is the kernel's: a second open file description is refused while the first holds it."""
    from trainbox.errors import RunBusy
    from trainbox.rundir.lock import RunLock
    a = RunLock(tmp_path / "r").acquire()
    errors = []

    def other():
        try:
            RunLock(tmp_path / "r").acquire()
        except RunBusy as e:
            errors.append(e.message)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and f"process {os.getpid()}" in errors[0]
    a.release()
    RunLock(tmp_path / "r").acquire().release()


BLOCKED_WRITER = r"""
import logging, os, sys
from trainbox.monitor.console import log
from trainbox.train.stop import STOP
os.close(int(sys.argv[1]))
stream = os.fdopen(int(sys.argv[2]), "w", buffering=1)   # a line-buffered file, as train.log and the console are
handler = logging.StreamHandler(stream)
log.addHandler(handler), log.setLevel(logging.INFO)
STOP.install()
STOP.announce = True                                    # the loop runs: signals are announced
log.info("x" * 200_000)                                 # blocks in write() until the test drains the pipe
STOP.settle()
print("stop", STOP.why(), flush=True)
"""


def test_a_stop_signal_inside_a_blocked_log_write_is_announced_without_a_logging_error():
    """A signal that arrives while the loop is inside a write of its log (a slow disk, a full pipe) is announced
    after the write, in its own line, not from the handler: Python's buffered files refuse a write inside a write
    of the same file, which logging would print as a "--- Logging error ---" traceback (a Ctrl-C while the
    progress bar or train.log was written). The process is held inside the write by a pipe it has filled."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_WRITER, str(read), str(write)], pass_fds=(read, write),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    os.close(write)
    wchan = Path(f"/proc/{proc.pid}/wchan")
    while "pipe_write" not in wchan.read_text():   # until the process waits inside its write
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signal.SIGUSR1)
    with os.fdopen(read) as pipe:
        logged = pipe.read()                       # the write completes; the process ends, closing its end
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "stop SIGUSR1\n", (out, err)
    assert "Logging error" not in err and "Traceback" not in err, err
    lines = logged.splitlines()
    assert lines == ["x" * 200_000, "received SIGUSR1: saving a checkpoint at the next step boundary"], lines[1:]


def test_a_run_without_checkpoints_writes_none_and_a_stop_says_it_cannot_continue(tmp_path, cache):
    """train.checkpoints=false (benchmarks, throwaway runs): no save at the recipe's intervals, at the end, or on
    a stop signal, which still ends the run cleanly at a step boundary."""
    done = Segment(_args(tmp_path, cache, "done", "train.max_steps=6", "train.checkpoint_every=2",
                         "train.checkpoints=false"), tmp_path / "done.log")
    code, out = done.wait()
    assert code == 0 and not (tmp_path / "done" / "checkpoints").exists(), out
    assert [s for s, _ in _losses(tmp_path / "done")] == [1, 2, 3, 4, 5, 6]
    stop = Segment(_args(tmp_path, cache, "stop", "train.max_steps=6", "train.checkpoint_every=2",
                         "train.checkpoints=false"), tmp_path / "stop.log", hook=("SIGTERM", "step", 3))
    code, out = stop.wait()
    assert code == 0 and "stopped at step 3" in out and "cannot be continued" in out, out
    assert not (tmp_path / "stop" / "checkpoints").exists()


# the tiny recipe's own length, intervals and sample: its one evaluation and save come at its last step, 300
RECIPE = ["train.max_steps=300", "train.eval_every=300", "train.checkpoint_every=300", "train.sample_tokens=120"]


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def _end_done_again(root: Path, cache: Path, name: str, status_before: str) -> None:
    """The same command on a run whose final checkpoint is written but whose end is not: it does the end again
    (the final evaluation, the sample, loss.png, status finished) without training a step, metrics.jsonl then holds
    one final evaluation (that of the end done again, where the end cut short had logged one), and the command after
    it is told the run is finished and changes nothing."""
    run_dir = root / name
    code, out = Segment(_args(root, cache, name, *RECIPE), root / f"{name}-again.log").wait()
    assert code == 0 and "stopped" not in out and "Traceback" not in out, out
    assert (f"the checkpoint of step 300 is the run's last, but the run did not finish (status: {status_before}); "
            "doing the end of the run again from it") in out, out
    status = _status(run_dir)
    assert status["phase"] == "finished" and status["step"] == 300 and status["val_bpb"] is not None, status
    assert [s for s, _ in _losses(run_dir)] == list(range(1, 301))   # no step trained again
    assert [e["step"] for e in _events(run_dir, "eval")] == [300]
    assert (run_dir / "samples.txt").read_text().count("--- step 300\n") == 1
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [checkpoint.step_of(c) for c in checkpoint.list_complete(run_dir / "checkpoints")] == [300]
    before = (run_dir / "status.json").read_text()
    code, out = Segment(_args(root, cache, name, *RECIPE), root / f"{name}-done.log").wait()
    assert code == 0 and "already finished: it is at step 300 (of 300)" in out, out
    assert (run_dir / "status.json").read_text() == before


@pytest.mark.slow
def test_a_stop_signal_during_the_final_evaluation_cuts_the_end_short_and_the_same_command_does_it(tmp_path, cache):
    """SIGTERM while the final evaluation runs (after the final checkpoint): the evaluation and the sample are cut
    short, not run to the end past a scheduler's grace period; the run is preempted at step 300 with its checkpoint,
    which is what the sbatch script requeues on, and the requeued command does the end and finishes."""
    run_dir = tmp_path / "end"
    code, out = Segment(_args(tmp_path, cache, "end", *RECIPE), tmp_path / "end.log", hook=("SIGTERM", "eval", 300)
                        ).wait()
    assert _check_stop(code, out, run_dir, 300) == 300
    assert "received SIGTERM: the final checkpoint is written; cutting the end of the run short" in out, out
    assert ("stopped at step 300 on SIGTERM, during the end of the run (the final evaluation and sample), which was "
            "cut short") in out, out
    status = _status(run_dir)
    assert status["phase"] == "preempted" and status["step"] == 300 and status["last_checkpoint"] == "step_00000300"
    assert not _events(run_dir, "eval") and not (run_dir / "samples.txt").exists()
    _end_done_again(tmp_path, cache, "end", "preempted")


def test_the_end_done_again_after_a_kill_during_the_final_sample_logs_one_final_evaluation(tmp_path, cache):
    """A short run killed (SIGKILL) while its end-of-run sample is drawn, its final evaluation already in
    metrics.jsonl, then the same command: the end done again replaces that evaluation's event, so metrics.jsonl
    holds one eval event for the final step (the dashboard and `trainbox runs` read one), with the values of the
    evaluation done again, and the event that was replaced lies in superseded/."""
    run_dir, short = tmp_path / "short", ["train.max_steps=16", "train.eval_every=16", "train.checkpoint_every=16",
                                          "train.sample_tokens=8"]
    code, out = Segment(_args(tmp_path, cache, "short", *short), tmp_path / "short.log",
                        hook=("SIGKILL", "sample", 16)).wait()
    assert code == -signal.SIGKILL, out
    first = _events(run_dir, "eval")
    assert [e["step"] for e in first] == [16] and not (run_dir / "samples.txt").exists()
    code, out = Segment(_args(tmp_path, cache, "short", *short), tmp_path / "short-again.log").wait()
    assert code == 0 and "doing the end of the run again from it" in out, out
    again = _events(run_dir, "eval")
    assert [e["step"] for e in again] == [16] and again[0]["val_loss"] == first[0]["val_loss"], again
    assert again[0]["time"] > first[0]["time"]   # the event of the end done again
    assert _status(run_dir)["phase"] == "finished"
    assert (run_dir / "samples.txt").read_text().count("--- step 16\n") == 1
    moved = [e for f in (run_dir / "superseded").glob("*/metrics.jsonl") for e in map(json.loads, f.open())
             if e["event"] == "eval"]
    assert moved == first


@pytest.mark.slow
def test_a_run_killed_during_its_final_sample_has_its_end_done_by_the_same_command(tmp_path, cache):
    """SIGKILL while the end-of-run sample is drawn (the final checkpoint and evaluation are written): `trainbox
    status` says crashed, and the same command does the end again instead of calling the run finished."""
    run_dir = tmp_path / "killed"
    code, out = Segment(_args(tmp_path, cache, "killed", *RECIPE), tmp_path / "killed.log",
                        hook=("SIGKILL", "sample", 300)).wait()
    assert code == -signal.SIGKILL, out
    assert checkpoint.step_of(checkpoint.latest(run_dir / "checkpoints")) == 300
    assert [e["step"] for e in _events(run_dir, "eval")] == [300] and not (run_dir / "samples.txt").exists()
    said = subprocess.run([sys.executable, "-m", "trainbox", "status", str(run_dir)], capture_output=True, text=True,
                          env=ENV)
    assert said.returncode == 1 and said.stdout.startswith("unhealthy: crashed"), said.stdout
    _end_done_again(tmp_path, cache, "killed", f"crashed, last phase {_status(run_dir)['phase']}")
