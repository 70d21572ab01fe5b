"""Helpers for tests that start `trainbox train --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT` twice on
this host, as two nodes of one job (tests/test_multinode.py, tests/test_faults_nodes.py), read a run's events, and
serve a finished run's dashboard to a headless browser (tests/test_dpo_train.py, tests/test_kto.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node's `trainbox train` launcher (its own session), its output in a file. `args` start with `train`;
    with nnodes > 1 the node flags go after it."""

    def __init__(self, args: list[str], log: Path, nnodes: int = 1, rank: int = 0, port: int | None = None,
                 cmd: list[str] | None = None, env: dict | None = None):
        flags = [f"--nnodes={nnodes}", f"--node-rank={rank}", f"--rdzv-endpoint=127.0.0.1:{port}"] if nnodes > 1 else []
        self.cmd = cmd or [sys.executable, "-m", "trainbox", *args[:1], *flags, *args[1:]]
        self.log = log
        self.t0 = time.time()
        with open(log, "w") as out:   # a file, not a pipe: a full pipe would block a worker and hang the job
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                                         start_new_session=True)

    def wait(self, timeout: float = 300) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        return code, self.log.read_text()

    def tree(self) -> list[int]:
        """The launcher, its torchrun and torchrun's workers (from /proc), parents first."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop(0)
            out.append(pid)
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return out

    def kill_all(self) -> None:
        """The node dies: every process of it frozen first (none may react to another's end), then SIGKILLed."""
        pids = self.tree()
        for pid in reversed(pids):
            _signal(pid, signal.SIGSTOP)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_all()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start_nodes(args: list[str], logs: Path, name: str, nnodes: int = 2, rendered: list[str] | None = None,
                nproc: int = 1, make=None) -> list[Node]:
    """`nnodes` launchers of one job; node 0 (the rendezvous host) first, the others once it listens. `rendered`:
    a container's command line from `trainbox launch` with the Trainer's PET_* variables in it, run instead of
    `args` with their values filled in as the Trainer would (nproc, nnodes, this node's rank, node 0's address).
    `make(rank, port, log)`: a Node of another making (a rendered Slurm script's lines)."""
    port = free_port()

    def node(rank: int) -> Node:
        log = logs / f"{name}-node{rank}.log"
        if make is not None:
            return make(rank, port, log)
        if rendered is None:
            return Node(args, log, nnodes, rank, port)
        values = {"PET_NPROC_PER_NODE": nproc, "PET_NNODES": nnodes, "PET_NODE_RANK": rank,
                  "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port}
        filled = [a for a in rendered]
        for key, value in values.items():
            filled = [a.replace(f"$({key})", str(value)) for a in filled]
        assert filled[0] == "trainbox" and "$(" not in " ".join(filled), filled
        return Node(filled[1:], log)

    nodes = [node(0)]
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert nodes[0].proc.poll() is None, nodes[0].log.read_text()
            assert time.monotonic() < deadline, f"node 0 never listened on {port}\n{nodes[0].log.read_text()}"
            time.sleep(0.05)   # polling a socket that is not up yet
    nodes += [node(r) for r in range(1, nnodes)]
    return nodes


def finish(nodes: list[Node], timeout: float = 300) -> list[str]:
    """Wait for every node; each must exit 0. Returns their outputs."""
    try:
        results = [n.wait(timeout) for n in nodes]
    finally:
        for n in nodes:
            n.stop()
    assert [c for c, _ in results] == [0] * len(nodes), "\n\n".join(o for _, o in results)
    return [o for _, o in results]


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x.endswith("}")) if e["event"] == kind]


def losses(run_dir: Path) -> dict[int, tuple[float, float | None]]:
    """step -> (loss, grad norm) of every logged step (a step logged again after a resume: its later value)."""
    return {e["step"]: (e["loss"], e.get("grad_norm")) for e in events(run_dir, "train")}


def wait_for(cond, what: str, timeout: float, procs=()) -> float:
    """Poll `cond` until true (a file or socket state); returns when it became true. Fails on the deadline, or at
    once when one of `procs` (Node) ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.time()
        for n in procs:
            assert n.proc.poll() is None, f"{n.log} ended while waiting for {what}\n{n.log.read_text()}"
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextmanager
def dashboard(run_dir: Path):
    """`trainbox dashboard RUN --port 0` in a process of its own -> its URL, the process ended on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "trainbox", "dashboard", str(run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        url = next(re.search(r"http://[\d.:]+", line).group(0) for line in proc.stdout if "http://" in line)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def gauges(url: str) -> dict[str, float]:
    """The Prometheus samples of `url`/metrics by name (labels dropped)."""
    import urllib.request
    prom = urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers={"Accept": "text/plain"}))
    return {k: float(v) for k, v in re.findall(r"^(trainbox_\w+)(?:\{[^}]*\})? (\S+)$", prom.read().decode(), re.M)}


def chart_points(url: str, profile: Path) -> tuple[dict[str, int], str] | None:
    """The page at `url` in headless Chromium after 5 s of page time -> (points drawn on each chart canvas, the
    DOM); None where Debian's chromium is not installed."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        return None
    dom = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                          "--virtual-time-budget=5000", "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    return {k: int(v) for k, v in re.findall(r'<canvas id="chart-(\w+)" data-points="(\d+)"', dom)}, dom
