"""`trainbox train --detach`: the run handed over to a process of its own, and the stop signals that reach this one
meanwhile passed on to it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainbox.files import open_append
from trainbox.rundir.runs import catches_signal
from trainbox.train.stop import BEFORE_FIRST_STEP, STOP, STOP_SIGNALS


def read_status(run_dir: Path, since: float) -> dict:
    """RUN/status.json when this launch's process wrote it (not left over from an earlier one), else {}."""
    status = run_dir / "status.json"
    try:
        return json.loads(status.read_text()) if status.stat().st_mtime >= since else {}
    except (OSError, ValueError):
        return {}


DETACH_WAIT_S = 60.0  # how long `train --detach` waits for the new process's monitor URL


def detach(args, cfg) -> int:
    """`trainbox train ... --detach`: the same command, without --detach, in a new session (no terminal: stdin
    from /dev/null, its console output appended to RUN/console.log; the run's own log is RUN/train.log as
    always). Prints the run directory, its monitor URL once status.json of the new process shows one (up to
    DETACH_WAIT_S), and the commands to follow and stop it, then returns. A process that ends first (a busy or
    finished run, a config error) has its exit status and last console lines passed on. A stop signal while it
    waits stops the new process too (the run was not handed over yet), as it would have stopped this one; one that
    lands after the hand-over, while this command prints and exits, is passed on to the run."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "trainbox", "train", *([args.recipe] if args.recipe else []), *args.overrides,
            *([f"--nproc={args.nproc}"] if args.nproc else []),
            *([f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--rdzv-endpoint={args.rdzv_endpoint}"]
              if args.nnodes > 1 else []),
            *([f"--rdzv-id={args.rdzv_id}"] if args.rdzv_id else []),
            *([f"--max-restarts={args.max_restarts}"] if args.max_restarts else [])]
    env = {k: v for k, v in os.environ.items() if k != "TRAINBOX_OVERRIDES"}  # already in args.overrides
    env["PYTHONUNBUFFERED"] = "1"
    console = run_dir / "console.log"

    with open_append(console) as out:  # refuses a planted symbolic link
        offset = out.tell()
        started = time.time()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                start_new_session=True, close_fds=True)
    url, code, forwarded = None, None, None
    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline or forwarded:
        code = proc.poll()
        if code is not None:
            break
        if STOP.requested and forwarded is None and (catches_signal(proc.pid, signal.SIGTERM)
                                                     or not Path(f"/proc/{proc.pid}").exists()):
            forwarded = STOP.signum   # once its handler is in place: a starting Python would just be killed
            os.kill(proc.pid, forwarded)
        if forwarded is None:
            try:
                s = json.loads((run_dir / "status.json").read_text())
            except (OSError, ValueError):
                s = {}
            if (s.get("started_at") or 0) >= started - 1 and s.get("url"):
                url = s["url"]
                break
        time.sleep(0.2)
    if code is None and forwarded is None:
        # handed over. A stop signal from here until this command exits goes on to the run, which stops as if it
        # had taken it itself; one that came while the hand-over was decided is answered as one during the wait
        def pass_on(signum, frame):
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:   # the run has ended
                pass

        signals = {s: signal.signal(s, pass_on) for s in STOP_SIGNALS}
        if STOP.requested:
            for s, h in signals.items():
                signal.signal(s, h)
            forwarded = STOP.signum
            os.kill(proc.pid, forwarded)
            code = proc.wait()
        else:
            STOP.handed_over = True   # cli.main ends the process with pass_on in place
    if forwarded is not None and code == 0:
        status = read_status(run_dir, started)
        step = status.get("step") if status.get("phase") == "preempted" else None
        print(f"stopped at step {step} on {signal.Signals(forwarded).name}; run the same command to continue"
              if step else BEFORE_FIRST_STEP, file=sys.stderr)
        return 0
    if code is not None:  # ended before it served: say why, as the foreground command would have
        with open(console, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            tail = f.read().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        print(f"the detached run ended at once (exit {code}); its output is in {console}", file=sys.stderr)
        return code
    print(f"detached: process {proc.pid}, run directory {run_dir}")
    print(f"monitor:  {url}" if url else f"monitor:  starting (no URL after {DETACH_WAIT_S:.0f} s; "
          f"trainbox status {run_dir})")
    print(f"follow:   trainbox logs {run_dir} -f    (or: trainbox attach {run_dir})")
    print(f"stop:     trainbox stop {run_dir}       (saves a checkpoint; the same train command resumes)")
    return 0
