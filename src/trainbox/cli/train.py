"""`trainbox train`: one run in this process, under its torchrun launcher (--nproc, --nodes), or detached."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainbox.cli.data import fetch_run_data
from trainbox.cli.detach import detach, read_status
from trainbox.config import build_config, load_config
from trainbox.config.hfargs import mapping_report
from trainbox.config.layout import micro_batch_given
from trainbox.errors import ConfigError, DataError
from trainbox.monitor.console import ProgressBar, setup_logging
from trainbox.rundir.lock import RunLock, lock_run, unlock_run
from trainbox.rundir.runs import catches_signal, clear_launcher, write_launcher
from trainbox.train.stop import BEFORE_FIRST_STEP, STOP, STOP_SIGNALS, stop_when_gone  # armed by cli.main

# ----------------------------------------------------------------------------- train


def cmd_train(args) -> int:

    _allocator_env()
    worker = "LOCAL_RANK" in os.environ
    if worker:   # a torchrun worker stops (and saves) when its torchrun or `trainbox train --nproc` launcher ends
        stop_when_gone(os.getppid(), "torchrun")
        if os.environ.get("TRAINBOX_LAUNCHER_PID"):
            stop_when_gone(int(os.environ["TRAINBOX_LAUNCHER_PID"]), "the launcher")
    if getattr(args, "detach", False) and not worker:
        cfg = load_config(args.recipe, args.overrides)
        return _stopped_before_start() if STOP.requested else detach(args, cfg)
    if not worker:
        _check_nodes(args)
    cfg, decided = _run_config(args)
    if STOP.requested and not worker:   # workers agree on stopping in the loop, all at one step boundary
        return _stopped_before_start()
    if args.recipe and args.recipe.endswith(".json") and not worker:
        report = mapping_report(args.recipe)
        if report:
            print(report, file=sys.stderr)
    from trainbox.parallel.distributed import Dist  # heavy: torch

    dist = Dist.from_env(os.environ)
    checked = _preflight(args, cfg, dist, decided)   # before any download, any file of the run, any worker
    if _procs(args) > 1 and not worker:
        if not _fetch(cfg, args.recipe):   # once, before any worker starts
            return _stopped_before_start(cfg.data.path)
        return _launch_torchrun(args, checked.layout.applied(cfg))
    # under a torchrun started elsewhere, the download folder's lock lets one process per machine fetch
    if not _fetch(cfg, args.recipe, main=dist.is_main) or (STOP.requested and not worker):
        return _stopped_before_start(cfg.data.path)

    single = dist.world == 1
    if single:  # refused at once when another run holds the folder; under torchrun rank 0 locks in the trainer
        lock_run(cfg.run_dir)
    _kernel_cache_env()
    from trainbox.train.loop import train  # heavy: numpy, torch

    mode = cfg.monitor.progress
    bar = dist.is_main and (mode == "bar" or (mode == "auto" and sys.stderr.isatty()))
    log_file = None
    if dist.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        log_file = cfg.run_dir / "train.log"
    setup_logging(log_file, console=dist.is_main, bar=bar)
    try:
        result = train(cfg, dist, argv=["trainbox", "train", *sys.argv[2:]], progress=ProgressBar(enabled=bar),
                       checked=checked)
    finally:
        if single:
            unlock_run(cfg.run_dir)
    if dist.is_main and not (result.get("stopped") and result["step"] == 0):   # that stop said it in one line
        if result.get("val_bpb") is not None:
            print(f"validation: {result['val_loss']:.4f} nats/token, {result['val_bpb']:.4f} bits/byte "
                  f"({result['val_tokens']:,} tokens)")
        elif result.get("validation"):   # another objective's (train.objective=dpo: pairs)
            print(f"validation: {result['validation']}")
        if result.get("sample"):
            print(f"--- sample ---\n{cfg.train.sample_prompt}{result['sample']}")
        print(f"run directory: {result['run_dir']}")
    if dist.enabled:
        _exit_worker()
    return 0


def _stopped_before_start(data_path: str | None = None) -> int:
    """A stop before the first step: one line, exit 0; a download it cut short says what it kept."""
    parts = sorted(Path(data_path).glob(".*.part")) if data_path and Path(data_path).is_dir() else []
    kept = "".join(f"; kept {p.stat().st_size:,} bytes of {p.name[1:-len('.part')]} in {p}, which the same command "
                   "continues" for p in parts)
    print(BEFORE_FIRST_STEP + kept, file=sys.stderr)
    return 0


def _fetch(cfg, recipe: str | None, main: bool = True) -> bool:
    """The run's data.source download (cli/data.py); False when a stop signal ended it (the .part files stay)."""

    try:
        fetch_run_data(cfg, recipe, main=main)
    except DataError:
        if STOP.requested:
            return False
        raise
    return True


def _allocator_env() -> None:
    """PyTorch's caching allocator with expandable segments: memory freed by one phase of a step is reused by the
    next whatever the sizes, where fixed segments fragment (the GPU figures in docs/performance.md were measured
    so). Read when CUDA starts, so set before any work, and inherited by torchrun's workers. A value the user
    set wins; ROCm builds keep their own default."""
    if "PYTORCH_ALLOC_CONF" in os.environ or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    import torch  # heavy: torch
    if torch.version.hip is None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def _kernel_cache_env() -> None:
    """FlashAttention-4 compiles its kernels at first use (about 8 s on an H100) and keeps them on disk only when
    asked to, through two variables it reads at import: ask, in a folder beside Inductor's cache (the containers
    mount /cache/compile), so that a second start loads them as it loads Inductor's kernels. Values the user set
    win. Where flash_attn is not installed nothing reads them, and they are left unset: finding Inductor's folder
    imports Inductor and Dynamo, most of a second at every start."""
    if importlib.util.find_spec("flash_attn") is None:
        return
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    if "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR" not in os.environ:
        from trainbox.kernels.ops import compile_cache_dir  # heavy: torch
        os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = str(
            Path(compile_cache_dir()).parent / "flash_attention_cute")


def _exit_worker() -> None:
    """End a torchrun worker whose run is over without the interpreter's teardown.

    By now the run's files are written and closed and its process groups destroyed (Trainer.run), but
    C++ objects of torch.distributed (DDP's reducer, gloo work) can still hold Python references and be
    destroyed while the interpreter is being torn down, which aborts the process ("terminate called
    without an active exception"; seen once in about ten passes of the CPU test suite). torchrun
    then reports a finished run as failed and, with restarts allowed, starts the workers again."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


LAUNCHED_CONFIG = "TRAINBOX_LAUNCHED_CONFIG"   # the config `train --nproc N` decided, as JSON, for its workers


def _run_config(args):
    """-> (the run's config, whether a launcher decided it). A worker of `trainbox train --nproc N` takes the config
    its launcher decided (LAUNCHED_CONFIG: its layout applied), so no worker decides again; every other process
    loads the recipe and the overrides."""
    launched = os.environ.get(LAUNCHED_CONFIG) if "LOCAL_RANK" in os.environ else None
    if launched:
        return build_config(json.loads(launched)), True
    return load_config(args.recipe, args.overrides), False


def _preflight(args, cfg, dist, decided: bool):
    """The run's pre-flight checks (train/preflight.py) on the processes this command runs: --nproc N's, or the
    torchrun world this process is part of. The micro-batch adapts to them unless the command line gives it (or
    the launcher decided it); the main process says so once."""
    from trainbox.train.preflight import preflight  # heavy: torch
    world = dist.world if "LOCAL_RANK" in os.environ or _procs(args) == 1 else _procs(args)
    adapt = not (decided or micro_batch_given(args.overrides))
    checked = preflight(cfg, world, dist.local_rank, adapt_micro_batch=adapt, serves_monitor=dist.is_main)
    note = checked.layout.note(cfg)
    if note and dist.is_main:
        print(note, file=sys.stderr)
    return checked


def _procs(args) -> int:
    """Processes of the whole job: --nproc on each of --nnodes nodes."""
    return (1 if args.nproc is None else args.nproc) * getattr(args, "nnodes", 1)


def _check_nodes(args) -> None:
    """--nnodes / --node-rank / --rdzv-endpoint make sense together, before anything starts."""
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes}: the number of nodes must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} is not a node of --nnodes {args.nnodes}",
                          hint=f"number the nodes 0..{args.nnodes - 1}; node 0 hosts the rendezvous")
    if args.nnodes > 1:
        host, _, port = (args.rdzv_endpoint or "").rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (got "
                              f"{args.rdzv_endpoint or 'none'})",
                              hint="node 0's address and a free port, the same on every node, e.g. "
                                   "--rdzv-endpoint node0:29500")
    elif args.rdzv_endpoint or args.node_rank:
        raise ConfigError("--rdzv-endpoint and --node-rank are for a job of several nodes",
                          hint="add --nnodes N (the same on every node)")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more (got {args.max_restarts})")


def _rendezvous(args, cfg) -> list[str]:
    """torchrun's flags for where this node's processes meet the others: one node stands alone; several meet
    through c10d at --rdzv-endpoint, hosted by node 0."""
    nodes = [f"--nproc-per-node={args.nproc or 1}", f"--max-restarts={args.max_restarts}"]
    if args.nnodes == 1:
        return ["--standalone", *nodes]
    return [f"--nnodes={args.nnodes}", *nodes, "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id or cfg.run_name}", f"--rdzv-conf=is_host={str(args.node_rank == 0).lower()}"]


def _launch_torchrun(args, cfg) -> int:
    """`trainbox train --nproc N ...` re-runs itself under torchrun: standalone on one node; with --nnodes M, one such
    command on each node (its --node-rank), meeting through c10d rendezvous at --rdzv-endpoint, which node 0 hosts.

    A run directory that a live process holds is refused here, in one line, before torchrun starts. torchrun
    runs in its own session, so a terminal Ctrl-C reaches only this launcher, which passes each SIGTERM / SIGINT /
    SIGUSR1 to every worker itself, once the workers have installed their stop handler (a worker still starting
    Python would be killed by the signal's default action): the workers agree on a step boundary, save and exit
    0, and torchrun, which saw no signal, exits 0 with them. The workers learn this launcher's pid
    (TRAINBOX_LAUNCHER_PID) and stop in the same way when it ends, however it ends (SIGKILL included), so no
    worker trains on unsupervised; where /proc does not list the workers, the signal goes to torchrun, which
    passes it on.
    `cfg` is the config the launcher decided (its layout applied): the workers take it from TRAINBOX_LAUNCHED_CONFIG
    (their command line is the user's, for the record)."""

    from torch.distributed.run import get_args_parser  # heavy: torch


    first = args.node_rank == 0   # one node speaks for the job in the run directory (`trainbox stop` finds it)
    if args.nnodes == 1:   # (several nodes: the job's rank 0 takes the lock, on whichever node it is)
        RunLock(cfg.run_dir).acquire().release()   # a live holder: RunBusy (exit 2), before any worker starts
    if STOP.requested:
        return _stopped_before_start()
    known = {o for action in get_args_parser()._actions for o in action.option_strings}
    extra = []  # flags of newer torchruns: the signals a `kill` of torchrun itself passes on, time to save
    if "--signals-to-handle" in known:
        extra.append("--signals-to-handle=" + ",".join(s.name for s in (*STOP_SIGNALS, signal.SIGHUP, signal.SIGQUIT)))
    if "--shutdown-timeout" in known:
        extra.append(f"--shutdown-timeout={cfg.train.pg_timeout_s}")  # time for the ranks to save before SIGKILL
    cmd = [sys.executable, "-m", "torch.distributed.run", *_rendezvous(args, cfg), *extra,
           "-m", "trainbox", "train", *([args.recipe] if args.recipe else []), *args.overrides]
    print("launching: " + " ".join(cmd), file=sys.stderr)
    started = time.time()
    pending = [STOP.signum] if STOP.signum is not None else []

    def note(signum, frame):
        pending.append(signum)

    old = {s: signal.signal(s, note) for s in STOP_SIGNALS}   # from here this launcher's own handler
    # the keys the config sets, and only those: what the user gave stays apart from the defaults in the workers too
    launched = json.dumps(cfg.model_dump(mode="json", exclude_unset=True))
    proc = subprocess.Popen(cmd, start_new_session=True,
                            env={**os.environ, "TRAINBOX_LAUNCHER_PID": str(os.getpid()), LAUNCHED_CONFIG: launched,
                                 "TRAINBOX_NODE_RANK": str(args.node_rank)})
    if first:
        write_launcher(cfg.run_dir, proc.pid, started)  # `trainbox stop` signals this launcher, which passes it on
    forwarded: list[int] = []
    try:
        while True:
            try:
                code = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if not pending:
                continue
            kids = workers(proc.pid)
            if not kids and not Path(f"/proc/{proc.pid}").exists():   # no /proc here: torchrun passes it on
                targets = [proc.pid]
            elif len(kids) == (args.nproc or 1) and all(catches_signal(k, signal.SIGTERM) for k in kids):
                targets = kids
            else:
                continue   # the workers are still starting: the signal waits for their handlers
            for signum in pending:
                for pid in targets:
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:   # a worker that has just exited
                        pass
            forwarded += pending
            pending.clear()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if first:
            clear_launcher(cfg.run_dir)
    if forwarded and code != 0:
        if read_status(cfg.run_dir, started).get("phase") == "preempted":
            print(f"stopped on {signal.Signals(forwarded[0]).name}; run the same command to continue",
                  file=sys.stderr)
            return 0
    if not forwarded and pending:   # torchrun ended before its workers could take the signal
        print(BEFORE_FIRST_STEP if code == 0 else f"stopped on {signal.Signals(pending[0]).name} (exit {code})",
              file=sys.stderr)
    return code


def workers(pid: int) -> list[int]:
    """The processes `pid` started (torchrun's workers), from /proc; [] where /proc does not list them."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []
