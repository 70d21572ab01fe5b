"""Verbs for operations: launch (compose / k8s / slurm / sky / image), plan, doctor, runs, logs, attach, stop, status,
plot, dashboard."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import yaml

from trainbox.config import load_config
from trainbox.config.layout import decide_layout, micro_batch_given
from trainbox.config.schema import MonitorSection
from trainbox.errors import ConfigError, TrainboxError
from trainbox.launch import LaunchSpec, render, write_rendered
from trainbox.launch.apply import run_commands
from trainbox.launch.image import build_commands
from trainbox.launch.registry import regional_image, registries_to_push
from trainbox.monitor.console import fmt_duration
from trainbox.monitor.plot import plot_runs
from trainbox.monitor.server import start_server
from trainbox.monitor.state import RunState
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

# ----------------------------------------------------------------------------- launch


def cmd_launch(args) -> int:

    if args.target == "image":
        return _launch_image(args)

    if args.region and not args.registries and args.target != "sky":
        raise ConfigError(f"--region {args.region} picks a registry from --registries FILE (launch {args.target})",
                          hint="add --registries FILE (region -> registry), or leave --region out")
    image = regional_image(args.image, args.registries, args.region)
    spec = LaunchSpec(target=args.target, recipe=args.recipe, overrides=args.overrides, image=image,
                      nodes=args.nodes, min_nodes=args.min_nodes, gpus_per_node=args.gpus_per_node,
                      gpu_vendor=args.gpu_vendor, workspace=args.workspace, api=args.api, namespace=args.namespace,
                      runs_pvc=args.runs_pvc, data_pvc=args.data_pvc, storage=args.storage,
                      storage_class=args.storage_class,
                      cpus=args.cpus, memory=args.memory, shm=args.shm, time=args.time, partition=args.partition,
                      account=args.account, host_port=args.port, gpus=args.gpus, region=args.region,
                      bucket=args.bucket, store=args.store)
    rendered = render(spec)
    out = Path(args.out or f"deploy/{spec.config().run_name}-{args.target}")
    for path in write_rendered(rendered, out):
        print(f"wrote {path}")
    commands = rendered.apply_commands(out)
    for cmd in commands:
        print(f"{'apply' if args.apply else 'to apply'}: {' '.join(cmd)}")
    for note in rendered.notes:
        print(note)
    if args.apply and not args.dry_run:
        return run_commands(commands, Path.cwd())
    return 0


def _launch_image(args) -> int:

    context = Path(args.context)
    registries = registries_to_push(args.registry, args.registries)
    commands = build_commands(context, registries, args.tag, rocm=args.rocm, push=args.push,
                              build_args=args.build_arg, platform=args.platform)
    for cmd in commands:
        print(" ".join(cmd))
    return 0 if args.dry_run else run_commands(commands, context)


# ----------------------------------------------------------------------------- plan, doctor


def cmd_plan(args) -> int:
    from trainbox.model.build import resolve_model  # heavy: numpy
    from trainbox.objective import resolve_objective  # heavy: torch
    from trainbox.plan import plan_run, plan_target  # heavy: numpy, torch
    from trainbox.plan.report import format_plan  # heavy: numpy, torch

    # the model as train builds it: the recipe's required keys, the family's resolution (model.path's shape), the
    # objective's (dpo.disable_dropout)
    cfg = resolve_objective(resolve_model(load_config(args.recipe, args.overrides)))
    overrides = list(args.overrides)
    # the layout `trainbox train --nproc N` would decide: its micro-batch, planned
    target = plan_target(cfg, args.gpu, args.gpu_mem)
    layout = decide_layout(cfg, args.nproc, "cuda" if target.cuda else "cpu",
                           adapt_micro_batch=not micro_batch_given(overrides))
    if layout.micro_batch != cfg.train.micro_batch_size:
        overrides.append(f"train.micro_batch_size={layout.micro_batch}")
        cfg = layout.applied(cfg)
    plan = plan_run(cfg, args.nproc, args.gpu, args.gpu_mem, args.flash)
    if args.json:
        data = plan.as_dict()
        for s, row in zip(plan.suggestions, data["suggestions"]):
            row["command"] = s.command(cfg.recipe, overrides)
        print(json.dumps(data, indent=1))
    else:
        print(format_plan(plan, overrides))
    return 0 if plan.fits else 1


def cmd_doctor(args) -> int:
    from trainbox.doctor import as_json, run_checks  # heavy: torch

    cfg = load_config(args.recipe, args.overrides) if (args.recipe or args.overrides) else None
    checks = run_checks(dict(os.environ), cfg)
    if args.json:
        print(json.dumps(as_json(checks), indent=1))
    else:
        for c in checks:
            print(f"{c.status.upper() if c.status != 'ok' else 'ok':<5} {c.name:<15} {c.value}")
            if c.fix:
                print(f"{'':<22}-> {c.fix}")
    failed = [c.name for c in checks if c.status == "fail"]
    if failed and not args.json:
        print(f"missing for {cfg.recipe if cfg else 'this run'}: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


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


def cmd_dashboard(args) -> int:
    """Serve a run's dashboard from its files (metrics.jsonl, status.json) with the live run's server and
    page; the files are read again when they change, so a run still training elsewhere stays current."""



    run_dir = resolve_run(args.run, Path(args.root))
    try:
        mon = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("monitor") or {}
    except (OSError, yaml.YAMLError):
        mon = {}
    settings = {"host": args.host, "log_every": int(mon.get("log_every") or 1),
                "stall_after": mon.get("stall_after")}
    if args.port is not None:  # asked for: a busy port is an error; by default 8080, else a free one
        settings["port"] = args.port
    cfg = MonitorSection(**settings)
    state = RunState(run_dir.name, run_dir)
    files = [run_dir / "status.json", run_dir / "metrics.jsonl"]

    def stamp() -> list:
        out = []
        for f in files:
            try:
                st = f.stat()
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:  # not written yet, or being replaced
                out.append(None)
        return out

    seen = stamp()
    state.load_files(run_dir)
    server = start_server(state, cfg)
    snap = state.snapshot()
    print(f"dashboard of {run_dir} ({snap['phase']}, step {snap['step']}/{snap['total_steps']}): {server.url}/ "
          f"(Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(2.0)
            now = stamp()
            if now != seen:
                seen = now
                state.load_files(run_dir)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
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
