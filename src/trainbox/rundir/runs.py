"""Run directories: create, describe (env.json), list and check (like `docker ps` for training runs)."""
from __future__ import annotations

import functools
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainbox.files import atomic_write_text

if TYPE_CHECKING:  # torch is imported only where a run is created: `runs`/`status` stay fast
    import torch
import urllib.error
import urllib.request

import yaml

import trainbox
from trainbox.errors import DataError, RunFinished, RunNotRunning
from trainbox.rundir import ranks
from trainbox.rundir.status import ACTIVE_PHASES, health

log = logging.getLogger("trainbox")  # the library logger


def git_commit() -> str | None:
    """The commit of the trainbox code that runs (None outside a git checkout)."""
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    """Software versions a checkpoint records (trainer.json) and env.json starts with."""
    import torch  # heavy: torch

    return {"trainbox": trainbox.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "rocm": getattr(torch.version, "hip", None)}


def environment(device: torch.device | None = None, world: int = 1) -> dict:
    import torch  # heavy: torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                         "capability": f"{p.major}.{p.minor}"})
    return {
        **versions(),
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),   # train/device.py set_float32_matmuls
        "gpus": gpus, "device": str(device) if device else None, "world_size": world,
        "host": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "git_commit": git_commit(), "command": recorded_command(sys.argv) if not hasattr(sys, "ps1") else [],
        "allocator": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def recorded_command(argv: list[str]) -> list[str]:
    """A command line as a run file records it (env.json): secret overrides (monitor.token=...) masked as
    config.yaml masks them."""
    from trainbox.config.load import public_args  # heavy: the config schema (pydantic)

    return public_args(list(argv))


def write_env(run_dir: Path, argv: list[str], device: torch.device, world: int, kernels: dict | None = None,
              layout: dict | None = None) -> None:
    env = environment(device, world)
    if kernels is not None:
        env["kernels"] = kernels
    if layout is not None:
        env["layout"] = layout
    if argv:
        env["command"] = recorded_command(argv)
    atomic_write_text(run_dir / "env.json", json.dumps(env, indent=1), fsync=False)


# ----------------------------------------------------------------------------- listing and health
#
# A run's state comes from its status.json (written by rank 0 at every phase change and logged step)
# plus two checks a file alone cannot make: is the process still alive (same host only: pid, and the
# process start time so a recycled pid is not mistaken for the run), and is the heartbeat fresh (the
# stall rule of monitor/state.py). A run whose process died without writing a final phase is "crashed",
# never "running".

STATES = ("running", "stalled", "finished", "failed", "preempted", "crashed")
HEALTHY_STATES = ("running", "finished")
STARTUP_QUIET_SECONDS = 600.0  # `logs -f` on a run that died before writing status.json stops after this


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (SigCgt in /proc/PID/status); False when it
    has none yet, is gone or /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def pid_alive(pid: int, started_at: float | None = None) -> bool:
    """True when `pid` runs and (on Linux) is not a zombie nor a newer process that reused the pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we can know
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces
    if fields[0] in ("Z", "X"):
        return False
    boot = _boot_time()
    if started_at is not None and boot is not None:
        proc_start = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        if proc_start > started_at + 2.0:  # started after the run did: a different process
            return False
    return True


def latest_eval(run_dir: Path) -> dict | None:
    """The newest evaluation record of a run (RUN/eval/<time>.json, from `trainbox eval` or train.eval_tasks) as
    {"file", "step", "model", "scores": {task: {metric: value}}}; None when it has none."""
    folder = Path(run_dir) / "eval"
    for path in sorted(folder.glob("*.json"), reverse=True) if folder.is_dir() else ():
        try:
            summary = _eval_summary(str(path), path.stat().st_mtime_ns)
        except OSError:
            continue
        if summary is not None:
            return summary
    return None


@functools.lru_cache(maxsize=64)
def _eval_summary(path: str, mtime_ns: int) -> dict | None:
    """One record's summary (read again only when the file changes)."""
    info = (read_json(Path(path)) or {}).get("trainbox")
    if not isinstance(info, dict) or not isinstance(info.get("scores"), dict):
        return None
    return {"file": path, "step": info.get("step"), "model": info.get("model"), "scores": info["scores"]}


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _monitor_settings(run_dir: Path) -> tuple[float | None, int]:
    """(monitor.stall_after, monitor.log_every) from the run's config.yaml."""
    try:
        mon = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("monitor") or {}
    except (OSError, yaml.YAMLError):
        mon = {}
    return mon.get("stall_after"), int(mon.get("log_every") or 1)


def run_info(run_dir: Path, now: float | None = None) -> dict:
    """status.json of `run_dir` plus `state` (one of STATES), `healthy` and a one-line `reason`."""

    run_dir = Path(run_dir)
    s = read_json(run_dir / "status.json")
    if s is None and (run_dir / "status.json").exists():
        raise DataError(f"{run_dir / 'status.json'} is not readable JSON", hint=f"`trainbox logs {run_dir}` shows the "
                        "run's log")
    if s is None:
        raise DataError(f"{run_dir / 'status.json'} is missing: {run_dir} is not a started run",
                        hint="list runs with `trainbox runs DIR`")
    now = time.time() if now is None else now
    stall, log_every = _monitor_settings(run_dir)
    phase = s.get("phase")
    ok, reason = health(s, stall, log_every, now=now, ranks=ranks.read(run_dir, now) if phase in ACTIVE_PHASES else [])
    if phase in ACTIVE_PHASES:
        local = s.get("host") in (None, socket.gethostname())
        if local and s.get("pid") and not pid_alive(int(s["pid"]), s.get("started_at")):
            ok, state = False, "crashed"
            reason = (f"crashed: process {s['pid']} on {s.get('host')} is gone without a final status "
                      f"(last phase {phase}, step {s.get('step')}/{s.get('total_steps')})")
        else:
            state = "running" if ok else "stalled"
    else:
        state = phase if phase in STATES else "crashed"
    if state not in ("running", "stalled"):
        s = {**s, "eta_s": None}   # a run that is not running has no time to go (a crashed one kept its last)
    return {**s, "state": state, "healthy": ok and state in HEALTHY_STATES, "reason": reason,
            "run_dir": str(run_dir), "name": s.get("run_name") or run_dir.name, "eval_tasks": latest_eval(run_dir)}


def list_runs(root: Path) -> list[dict]:
    """run_info of every run under `root` (or of `root` itself when it is a run), newest first."""
    root = Path(root)
    dirs = [root] if (root / "status.json").exists() else sorted(p.parent for p in root.glob("*/status.json"))
    infos = []
    for d in dirs:
        try:
            infos.append(run_info(d))
        except Exception as e:  # noqa: BLE001 - one unreadable run must not hide the others, nor go unsaid
            log.warning(f"{d}: not listed: {getattr(e, 'message', None) or f'{type(e).__name__}: {e}'}")
    return sorted(infos, key=lambda r: r.get("started_at") or 0, reverse=True)


def resolve_run(arg: str, root: Path = Path("runs")) -> Path:
    """A run given as a directory, or as a name under `root`."""

    for cand in (Path(arg), Path(root) / arg):
        if (cand / "status.json").exists() or (cand / "train.log").exists():
            return cand
    # the names this function accepts, each once: directory names (copies of a run share its status.json's name)
    known = ", ".join(sorted({p.parent.name for f in ("status.json", "train.log") for p in Path(root).glob(f"*/{f}")}))
    raise DataError(f"no run '{arg}' (looked for {arg}/status.json and {Path(root) / arg}/status.json)",
                    hint=f"runs under {root}: {known}" if known else "list runs with `trainbox runs DIR`")


def url_health(url: str, timeout: float = 5.0) -> tuple[bool, str]:
    """GET URL/health -> (healthy, one-line reason); an unreachable server is unhealthy."""

    base = url.rstrip("/")
    target = base if base.endswith("/health") else base + "/health"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as r:
            body, code = r.read(), r.status
    except urllib.error.HTTPError as e:
        body, code = e.read(), e.code
    except (urllib.error.URLError, OSError) as e:
        return False, f"unreachable: {target}: {getattr(e, 'reason', e)}"
    try:
        reason = json.loads(body).get("reason", "")
    except ValueError:
        reason = body[:200].decode(errors="replace")
    return code == 200, reason or f"HTTP {code}"


def follow_log(run_dir: Path, follow: bool, tail: int | None = None, poll_s: float = 0.25):
    """Yield train.log lines (the last `tail` when set); with `follow`, keep yielding new lines until the
    run has ended and (on this host) its process has exited, like `docker logs -f`."""
    path = Path(run_dir) / "train.log"
    while not path.exists():
        if not follow:
            return
        time.sleep(poll_s)
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
        yield from lines if tail is None else lines[max(0, len(lines) - tail):]
        partial = ""
        while follow:
            chunk = f.read()
            if chunk:
                *done, partial = (partial + chunk).split("\n")
                yield from (line + "\n" for line in done)
                continue
            try:
                info = run_info(run_dir)
                # a finished run's process may still write its last lines (sinks closing): wait for it
                alive = info["state"] in ("running", "stalled") or (
                    info.get("host") == socket.gethostname() and pid_alive(int(info["pid"]), info.get("started_at")))
            except Exception:  # noqa: BLE001 - no status.json yet: starting, unless the log went quiet
                alive = time.time() - path.stat().st_mtime < STARTUP_QUIET_SECONDS
            if not alive:
                rest = partial + f.read()  # the final lines written just before the status changed
                yield from (line + "\n" for line in rest.splitlines())
                return
            time.sleep(poll_s)


# ----------------------------------------------------------------------------- stopping a run
#
# `trainbox stop` signals the process that owns the run: for `trainbox train --nproc N` the launcher, which
# records itself (and torchrun's pid, the leader of torchrun's own process group) in RUN/launcher.pid and
# passes the signal to every rank; otherwise the process named in status.json (a
# single process, or rank 0 of a torchrun job started by hand, whose stop flag the ranks agree on at the next
# step boundary), or, before status.json exists, the holder named in RUN/.lock.

LAUNCHER_NAME = "launcher.pid"


def write_launcher(run_dir: Path, torchrun_pid: int, started_at: float) -> None:
    """RUN/launcher.pid for `trainbox stop`: this launcher's pid, host, start time and torchrun's pid."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / LAUNCHER_NAME, json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "started_at": started_at, "torchrun_pid": torchrun_pid}),
        fsync=False)


def clear_launcher(run_dir: Path) -> None:
    """Remove RUN/launcher.pid when it names this process (the launch is over)."""
    path = Path(run_dir) / LAUNCHER_NAME
    if (read_json(path) or {}).get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def _live(record: dict | None) -> bool:
    return bool(record and record.get("pid") and record.get("host") == socket.gethostname()
                and pid_alive(int(record["pid"]), record.get("started_at")))


def run_target(run_dir: Path) -> dict:
    """The live process to signal for stopping `run_dir`: {"pid", "host", "started_at", "kind" ("launcher",
    "process" or "starting"), "group" (a process group to SIGKILL with it, or None), "wait" (every pid whose
    exit ends the run here)}.

    Raises RunFinished (exit 0) for a finished run, RunNotRunning for a run with no live process here (naming
    its state and last step) or one whose process runs on another host."""

    run_dir = Path(run_dir)
    status = read_json(run_dir / "status.json")
    launcher = read_json(run_dir / LAUNCHER_NAME)
    holder = None
    try:
        holder = json.loads((run_dir / ".lock").read_text() or "null")   # lock.LOCK_NAME
    except (OSError, ValueError):
        pass
    waits = [r for r in (launcher, status, holder) if _live(r)]
    wait = sorted({(int(r["pid"]), r.get("started_at")) for r in waits})
    if _live(launcher):
        return {**launcher, "kind": "launcher", "group": launcher.get("torchrun_pid"), "wait": wait}
    info = run_info(run_dir) if status is not None else None
    if info is not None and info["state"] in ("running", "stalled") and info.get("host") not in (
            None, socket.gethostname()):
        raise RunNotRunning(f"run {run_dir} runs on host {info['host']} (process {info.get('pid')}), not on "
                            f"this host ({socket.gethostname()})",
                            hint=f"run `trainbox stop {run_dir}` on {info['host']}, or "
                                 f"kill -TERM {info.get('pid')} there")
    if _live(status):  # running, or ending (a final status is written before the process exits)
        return {"pid": int(status["pid"]), "host": status.get("host"), "started_at": status.get("started_at"),
                "kind": "process", "group": None, "wait": wait}
    if _live(holder):  # started, but status.json is not written yet (or is an earlier run's)
        return {**holder, "kind": "starting", "group": None, "wait": wait}
    if info is None:
        raise RunNotRunning(f"run {run_dir} has no live process and no status.json: it never started here",
                            hint=f"see its log: trainbox logs {run_dir}")
    step = latest_checkpoint_step(run_dir)
    where = f"step {info.get('step')}/{info.get('total_steps')}" + (
        f", newest checkpoint at step {step}" if step is not None else ", no checkpoint")
    if info["state"] == "finished":
        raise RunFinished(f"run {run_dir} already finished ({where}); nothing to stop")
    raise RunNotRunning(f"run {run_dir} is not running: {info['state']} ({where})",
                        hint=f"continue it with the command that started it (trainbox logs {run_dir} shows why it "
                             "ended)" if info["state"] != "running" else None)


def latest_checkpoint_step(run_dir: Path) -> int | None:
    from trainbox import checkpoint  # heavy: numpy, torch
    ckpt = checkpoint.latest(Path(run_dir) / "checkpoints")
    return checkpoint.step_of(ckpt) if ckpt is not None else None


def wait_exit(pids: list[tuple[int, float | None]], timeout: float, poll_s: float = 0.2) -> bool:
    """Poll until none of `pids` ((pid, started_at) pairs) is alive, at most `timeout` seconds; True if all
    exited."""
    deadline = time.monotonic() + max(0.0, timeout)
    while any(pid_alive(p, t) for p, t in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
