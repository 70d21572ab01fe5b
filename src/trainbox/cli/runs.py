"""Verbs on run directories: runs, logs, attach, stop, status, plot. They read no config, so they start without
the config schema (cli/ops.py has the verbs that do)."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from trainbox.errors import TrainboxError
from trainbox.monitor.console import fmt_duration
from trainbox.monitor.plot import plot_runs
from trainbox.rundir.runs import (
    follow_log,
    list_runs,
    pid_alive,
    resolve_run,
    run_info,
    run_target,
    url_health,
    wait_exit,
)

# ----------------------------------------------------------------------------- runs, logs, status, plot


def cmd_runs(args) -> int:

    infos = list_runs(Path(args.dir))
    if args.json:
        print(json.dumps(infos, default=str, indent=1))
        return 0
    if not infos:
        print(f"no runs under {args.dir}", file=sys.stderr)
        return 0
    rows = runs_table(infos)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_logs(args) -> int:

    run_dir = resolve_run(args.run, Path(args.root))
    try:
        for line in follow_log(run_dir, args.follow, args.tail):
            sys.stdout.write(line)
            sys.stdout.flush()
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    return 0


def cmd_attach(args) -> int:
    """Follow a run's train.log until the run ends (Ctrl-C leaves the run going), then say how it ended."""

    run_dir = resolve_run(args.run, Path(args.root))
    try:
        for line in follow_log(run_dir, True, args.tail):
            sys.stdout.write(line)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print(f"detached from {run_dir}; the run goes on (trainbox stop {run_dir} stops it)", file=sys.stderr)
        return 0
    except BrokenPipeError:
        return 0
    try:
        info = run_info(run_dir)
        print(f"run {info['name']}: {info['state']} at step {info.get('step')}/{info.get('total_steps')}",
              file=sys.stderr)
    except TrainboxError:
        pass
    return 0


def cmd_stop(args) -> int:
    """SIGTERM to the run's process (a --nproc run's launcher), wait for it to exit, report the step it saved;
    --now: SIGKILL after --timeout."""

    from trainbox import checkpoint  # heavy: numpy, torch

    run_dir = resolve_run(args.run, Path(args.root))
    target = run_target(run_dir)  # RunFinished (exit 0) / RunNotRunning (exit 1) when there is nothing to stop
    pid = int(target["pid"])
    what = {"launcher": "torchrun launcher", "process": "process", "starting": "starting process"}[target["kind"]]
    graceful = not (args.now and args.timeout <= 0)
    if graceful:
        print(f"stopping {run_dir}: SIGTERM to {what} {pid} on {socket.gethostname()} (a checkpoint at the next "
              "step boundary)", file=sys.stderr)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    done = graceful and wait_exit(target["wait"], args.timeout)
    if not done:
        if not args.now:
            print(f"{run_dir}: still running after {args.timeout:g} s (process {pid}); wait longer with "
                  f"--timeout, or kill it with --now (no checkpoint of the current step)", file=sys.stderr)
            return 1
        print(f"killing {run_dir}: SIGKILL to {what} {pid}", file=sys.stderr)
        group = target.get("group")
        for p, started in target["wait"]:
            if pid_alive(p, started):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if group:
            try:
                os.killpg(int(group), signal.SIGKILL)  # torchrun and its workers (torchrun's own group)
            except (ProcessLookupError, PermissionError):
                pass
        wait_exit(target["wait"], 10.0)
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    step = checkpoint.step_of(ckpt) if ckpt is not None else None
    try:
        info = run_info(run_dir)
        state, total = info["state"], info.get("total_steps")
    except TrainboxError:
        state, total = "stopped", None
    if done and state == "finished":
        print(f"finished at step {info.get('step')}/{total} before the stop took effect"
              + (f"; checkpoint {ckpt}" if ckpt else ""))
    elif done and step is not None:
        print(f"stopped at step {step}" + (f"/{total}" if total else "") + f" ({state}); checkpoint {ckpt}")
        print("continue with the command that started it (trainbox train ... resumes from the checkpoint)")
    elif done:
        print(f"stopped ({state}) before the first checkpoint; the same train command starts it again")
    else:
        print("killed; newest checkpoint: " + (f"step {step} ({ckpt})" if ckpt else "none"))
    return 0


def cmd_status(args) -> int:

    try:
        if "://" in args.target:
            ok, reason = url_health(args.target, args.timeout)
        else:
            info = run_info(resolve_run(args.target, Path(args.root)))
            ok, reason = info["healthy"], info["reason"]
            scores = eval_scores(info.get("eval_tasks"))
            if scores:
                step = info["eval_tasks"].get("step")
                reason += f"; lm-eval{f' at step {step}' if step is not None else ''}: {', '.join(scores)}"
    except TrainboxError as e:  # a probe answers 0 or 1 only (Docker reserves 2)
        ok, reason = False, e.message
    print(("healthy: " if ok else "unhealthy: ") + reason)
    return 0 if ok else 1


def cmd_plot(args) -> int:

    out = plot_runs([resolve_run(r, Path(args.root)) for r in args.runs], Path(args.out))
    print(f"wrote {out}")
    return 0


def _ago(seconds: float | None) -> str:
    """'12s ago', '5m ago', '3h ago', '2d ago' (the coarse ages docker ps shows)."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{max(0, int(seconds))}s ago"


def eval_scores(summary: dict | None) -> list[str]:
    """["task metric value", ...] of a run's newest lm-eval record (rundir/runs.py latest_eval)."""
    if not summary:
        return []
    return [f"{task} {metric} {value:.4g}" for task, metrics in summary["scores"].items()
            for metric, value in metrics.items()]


def eval_cell(summary: dict | None) -> str:
    """`trainbox runs`' EVAL column: the first score of the newest record and how many more it holds."""
    scores = eval_scores(summary)
    return "-" if not scores else scores[0] + (f" +{len(scores) - 1}" if len(scores) > 1 else "")


def runs_table(infos: list[dict], now: float | None = None) -> list[list[str]]:
    """Rows (header first) for `trainbox runs`."""
    now = time.time() if now is None else now
    rows = [["NAME", "STATE", "STEP", "LOSS", "VAL", "EVAL", "TOK/S", "ETA", "STARTED", "UPDATED", "DETAIL"]]
    for r in infos:
        loss, val, tok = r.get("loss"), r.get("val_loss"), r.get("tokens_per_s")
        running = r["state"] in ("running", "stalled")
        detail = "" if r["state"] in ("running", "finished") else r["reason"]
        rows.append([r["name"], r["state"], f"{r.get('step', 0)}/{r.get('total_steps', 0)}",
                     f"{loss:.4f}" if loss is not None else "-", f"{val:.4f}" if val is not None else "-",
                     eval_cell(r.get("eval_tasks")), f"{tok:,.0f}" if tok else "-",
                     fmt_duration(r.get("eta_s")) if running else "-",
                     _ago(now - r["started_at"]) if r.get("started_at") else "-",
                     _ago(now - r["heartbeat"]) if r.get("heartbeat") else "-",
                     detail if len(detail) <= 70 else detail[:67] + "..."])
    return rows
