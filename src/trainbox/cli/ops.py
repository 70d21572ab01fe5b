"""Verbs for operations that read a config: launch (compose / k8s / slurm / sky / image), plan, doctor, dashboard
(the verbs on run directories that read none are in cli/runs.py)."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import yaml

from trainbox.config import load_config
from trainbox.config.layout import decide_layout, micro_batch_given
from trainbox.config.schema import MonitorSection
from trainbox.errors import ConfigError
from trainbox.launch import LaunchSpec, render, write_rendered
from trainbox.launch.apply import run_commands
from trainbox.launch.image import build_commands
from trainbox.launch.registry import regional_image, registries_to_push
from trainbox.monitor.server import start_server
from trainbox.monitor.state import RunState
from trainbox.rundir.runs import (
    resolve_run,
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
    for note in rendered.notes_at(out):
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


# ----------------------------------------------------------------------------- dashboard


def dashboard_token(option: str | None, env: dict) -> str | None:
    """The token `trainbox dashboard` enforces: --token, else a monitor.token=... in TRAINBOX_OVERRIDES (where the
    live server reads it too); None when neither gives one."""
    if option:
        return option
    token = None
    for arg in shlex.split(env.get("TRAINBOX_OVERRIDES", "")):
        key, eq, value = arg.partition("=")
        if eq and key.strip() == "monitor.token":
            token = value or None   # the last one wins, as for overrides
    return token


def cmd_dashboard(args) -> int:
    """Serve a run's dashboard from its files (metrics.jsonl, status.json) with the live run's server and
    page; the files are read again when they change, so a run still training elsewhere stays current.

    A run trained with monitor.token (config.yaml records it masked) is served only with a token, on any host: the
    files do not hold the run's token, so the one given (`dashboard_token`) is the one every endpoint but /health
    asks for, by the live server's rules."""

    run_dir = resolve_run(args.run, Path(args.root))
    try:
        mon = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("monitor") or {}
    except (OSError, yaml.YAMLError):
        mon = {}
    token = dashboard_token(args.token, dict(os.environ))
    if mon.get("token") and not token:
        raise ConfigError(f"{run_dir} was trained with monitor.token, so its dashboard is served only with a token "
                          f"(its files do not record the run's)",
                          hint="give the token: TRAINBOX_OVERRIDES='monitor.token=TOKEN' trainbox dashboard "
                               f"{args.run} (or --token TOKEN, which other users of this machine can read in its "
                               "process list)")
    settings = {"host": args.host, "log_every": int(mon.get("log_every") or 1),
                "stall_after": mon.get("stall_after"), "token": token}
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
    access = (f"; token required: 'Authorization: Bearer TOKEN', or open {server.url}/?token=TOKEN in a browser"
              if token else "")
    print(f"dashboard of {run_dir} ({snap['phase']}, step {snap['step']}/{snap['total_steps']}): {server.url}/ "
          f"(Ctrl-C to stop{access})", flush=True)
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

