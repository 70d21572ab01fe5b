"""The monitor over real sockets against real tiny training runs: every endpoint and content type, the
token, the health rule (stall, NaN, failed, preempted), port 0 and the URL in status.json.

Tests wait on observable state (status.json, HTTP answers) with a deadline, never on fixed sleeps.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection
from http.cookiejar import CookieJar
from pathlib import Path

import pytest
from conftest import REPO, TINY, run_cli
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from trainbox.rundir import status as st

TOKEN = "s3cret-token"


def wait_for(cond, timeout: float = 60.0, what: str = "condition"):
    """Poll `cond` until it returns a truthy value (returned) or the deadline passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args):
        return None


def http(url: str, headers: dict | None = None, method: str = "GET", redirect: bool = True
         ) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    opener = urllib.request.build_opener(*([] if redirect else [_NoRedirect]))
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class LiveRun:
    """`trainbox train` in a subprocess that runs until stopped (a long max_steps)."""

    def __init__(self, root: Path, cache: Path, name: str, extra: list[str], min_step: int = 12,
                 want_eval: bool = True):
        self.root, self.name, self.run_dir = root, name, root / name
        self.log = open(root.parent / f"{name}.out", "w")
        args = [*TINY, f"run.dir={root}", f"data.cache_dir={cache}", f"run.name={name}", "train.max_steps=100000",
                "train.eval_every=5", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "trainbox", "train", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)
        s = wait_for(lambda: self._ready(min_step, want_eval), 120, f"{name} to reach step {min_step}")
        self.url, self.pid = s["url"], s["pid"]

    def _ready(self, min_step: int, want_eval: bool):
        if self.proc.poll() is not None:
            raise AssertionError(f"run exited early:\n{(self.root.parent / f'{self.name}.out').read_text()}")
        s = read_status(self.run_dir)
        ready = s and s.get("url") and s["step"] >= min_step and (s.get("val_loss") is not None or not want_eval)
        return s if ready else None

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=120)
        self.log.close()
        return rc


@pytest.fixture(scope="module")
def live(tmp_path_factory, data_cache):
    run = LiveRun(tmp_path_factory.mktemp("live") / "runs", data_cache, "live",
                  [f"monitor.token={TOKEN}", "monitor.plot=true"])
    yield run
    run.stop()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


# ----------------------------------------------------------------------------- the health rule


def test_stall_limit_follows_step_time_and_spares_slow_phases():
    base = {"phase": "training", "step": 10, "total_steps": 100, "heartbeat": 1000.0}
    assert st.stall_limit({**base, "step_time_s": None}) == st.FIRST_STEP_SECONDS
    assert st.stall_limit({**base, "step_time_s": 0.01}) == st.MIN_STALL_SECONDS  # floor for fast steps
    assert st.stall_limit({**base, "step_time_s": 30.0}, log_every=5) == 10 * 30.0 * 5  # ten missed logs
    assert st.stall_limit({**base, "step_time_s": 30.0}, configured=7.0) == 7.0
    for phase in ("compiling", "evaluating", "checkpointing", "loading"):  # they report their own phase
        assert st.stall_limit({**base, "phase": phase}, configured=7.0) >= 1800
    fresh = st.health({**base, "step_time_s": 1.0}, now=1000.0 + 59)
    stale = st.health({**base, "step_time_s": 1.0}, now=1000.0 + 61)
    assert fresh[0] and not stale[0] and stale[1].startswith("stalled")
    assert not st.health({**base, "loss": math.nan}, now=1000.0)[0]
    ok, reason = st.health({**base, "phase": "failed", "error": "loss is nan at step 3\n  -> hint"})
    assert not ok and "\n" not in reason and "nan" in reason
    assert st.health({**base, "phase": "finished"}, now=10**10)[0]  # finished never goes stale
    assert not st.health({**base, "phase": "preempted"})[0]


# ----------------------------------------------------------------------------- endpoints of a live run


def test_port_zero_picks_a_free_port_and_status_json_has_the_url(live):
    assert live.url.startswith("http://127.0.0.1:") and int(live.url.rsplit(":", 1)[1]) not in (0, 8080)
    code, headers, body = http(live.url + "/health")
    assert code == 200 and headers["Content-Type"] == "application/json"
    h = json.loads(body)
    assert h["healthy"] is True and h["phase"] in ("training", "evaluating", "checkpointing")
    assert http(live.url + "/health", method="HEAD")[0] == 200


def test_token_guards_every_endpoint_but_health(live):
    for path in ("/metrics", "/status", "/history", "/", "/nosuch"):
        code, headers, _ = http(live.url + path)
        assert code == 401 and headers["WWW-Authenticate"].startswith("Bearer"), path
        assert http(live.url + path, {"Authorization": "Bearer wrong"})[0] == 401, path
        assert http(live.url + path, AUTH)[0] == (404 if path == "/nosuch" else 200), path
    code, headers, _ = http(live.url + "/?token=" + TOKEN, redirect=False)  # a browser opens the page once so
    assert code == 303 and headers["Location"] == "/" and "HttpOnly" in headers["Set-Cookie"]
    assert http(live.url + "/metrics?token=" + TOKEN)[0] == 401  # the query token opens the dashboard only
    assert http(live.url + "/health")[0] == 200


def test_metrics_json_tracks_the_run(live):
    code, headers, body = http(live.url + "/metrics", AUTH)
    assert code == 200 and headers["Content-Type"] == "application/json"
    m = json.loads(body)
    for key in ("current_step", "total_steps", "last_loss", "is_training", "gpu_memory_allocated"):
        assert key in m, key
    assert m["total_steps"] == 100000 and m["is_training"] is True and m["gpu_memory_allocated"] == 0
    assert math.isfinite(m["last_loss"]) and m["current_step"] >= 12
    later = wait_for(lambda: (lambda x: x if x["current_step"] > m["current_step"] else None)(
        json.loads(http(live.url + "/metrics", AUTH)[2])), 60, "the step counter to advance")
    assert later["tokens_seen"] == later["current_step"] * 8 * 32  # global batch 8 x seq_len 32


def test_metrics_prometheus_and_openmetrics(live):
    code, headers, body = http(live.url + "/metrics", {**AUTH, "Accept": "text/plain;version=0.0.4"})
    assert code == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in parse_prometheus(body.decode())}
    for name in ("trainbox_steps", "trainbox_tokens", "trainbox_checkpoints", "trainbox_restarts"):
        assert fams[name].type == "counter", name
        assert fams[name].samples[0].name == name + "_total"
    for name in ("trainbox_loss", "trainbox_learning_rate", "trainbox_grad_norm", "trainbox_tokens_per_second",
                 "trainbox_gpu_memory_allocated_bytes", "trainbox_val_loss", "trainbox_eta_seconds",
                 "trainbox_healthy", "trainbox_is_training"):
        assert fams[name].type == "gauge", name
        assert fams[name].samples[0].labels == {"run": "live"}
    value = {n: f.samples[0].value for n, f in fams.items()}
    assert value["trainbox_tokens"] == value["trainbox_steps"] * 256 and value["trainbox_healthy"] == 1.0
    from trainbox.config import load_config
    assert 0 < value["trainbox_learning_rate"] <= load_config("tiny").optim.lr   # the recipe's peak
    assert math.isfinite(value["trainbox_loss"])
    # Prometheus' own scraper asks for OpenMetrics first
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    code, headers, body = http(live.url + "/metrics", {**AUTH, "Accept": accept})
    assert headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    assert "trainbox_steps" in {f.name for f in parse_openmetrics(body.decode())}
    assert http(live.url + "/metrics", {**AUTH, "Accept": "application/json, text/plain"})[1]["Content-Type"] \
        == "application/json"


def test_status_has_every_field(live):
    code, headers, body = http(live.url + "/status", AUTH)
    assert code == 200 and headers["Content-Type"] == "application/json"
    s = json.loads(body)
    for key in ("run_name", "phase", "step", "total_steps", "epoch", "tokens_per_s", "mfu", "eta_s", "gpu_name",
                "gpu_count", "cuda_available", "last_checkpoint", "resumed_from", "url", "pid", "healthy"):
        assert key in s, key
    assert s["run_name"] == "live" and s["url"] == live.url and s["pid"] == live.pid and s["healthy"]
    assert s["eta_s"] > 0 and s["tokens_per_s"] > 0 and s["gpu_count"] == 0 and s["resumed_from"] is None


def test_history_and_dashboard_page(live):
    code, _, body = http(live.url + "/history", AUTH)
    pts = json.loads(body)
    train = [p for p in pts if "loss" in p]
    assert [p["step"] for p in train] == list(range(1, len(train) + 1))  # log_every=1: every step
    assert any("val_loss" in p for p in pts)
    newer = json.loads(http(live.url + f"/history?since={train[-1]['step']}", AUTH)[2])
    assert newer and min(p["step"] for p in newer) == train[-1]["step"]
    code, headers, page = http(live.url + "/", AUTH)
    assert code == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert b"<canvas" in page and b"https://" not in page and b"src=" not in page  # self-contained


def _chromium(url: str, profile: Path, *mode: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("headless browser test needs Debian's chromium package (apt-get install chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             "--window-size=1280,1000", "--virtual-time-budget=5000"]  # 5 s of page time: two refreshes
    return subprocess.run([exe, *flags, *mode, url], capture_output=True, text=True, timeout=120)


def test_dashboard_in_headless_chromium(live, tmp_path):
    """The page loads from the live run, polls it, and its three charts have points; the screenshot is
    kept in test-artifacts/dashboard.png. The browser opens /?token=, follows the redirect to / with the
    cookie it got, and the page's own requests authenticate with that cookie alone."""
    url = f"{live.url}/?token={TOKEN}"
    dom = _chromium(url, tmp_path / "profile-dom", "--dump-dom").stdout
    assert "Authorization" not in dom and TOKEN not in dom  # no token in the page: its requests carry the cookie
    points = {m[0]: int(m[1]) for m in re.findall(r'<canvas id="chart-(\w+)" data-points="(\d+)"', dom)}
    logged = read_status(live.run_dir)["step"]  # the page loaded before this was read
    assert set(points) == {"loss", "lr", "tps", "tasks", "accuracy", "rewards"}, dom[:2000]
    assert points["tasks"] == points["accuracy"] == points["rewards"] == 0   # hidden: no eval_tasks, no rewards here
    assert points["loss"] > 12 and points["lr"] >= 12 and points["tps"] >= 11, points
    assert points["loss"] > points["lr"]  # the loss chart also holds validation points
    assert points["lr"] <= logged
    assert re.search(r'<span id="phase" class="badge (ok|warn)">(training|evaluating|checkpointing)</span>', dom)
    assert '<h1 id="title">trainbox: live</h1>' in dom and re.search(r"step \d+ / 100000", dom)
    assert ">disconnected</span>" not in dom
    shot = REPO / "test-artifacts" / "dashboard.png"
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    _chromium(url, tmp_path / "profile-shot", f"--screenshot={shot}")
    mpimg = pytest.importorskip("matplotlib.image")
    rgb = (mpimg.imread(shot)[..., :3] * 255).round().astype(int).reshape(-1, 3)
    for colour in ((0x09, 0x69, 0xDA), (0x1A, 0x7F, 0x37)):  # train-loss line, throughput line
        assert ((abs(rgb - colour)).sum(1) <= 30).sum() > 100, colour


def test_runs_status_and_logs_on_a_live_run_then_sigterm(tmp_path, data_cache):
    """On a run of its own: the SIGTERM ends it, and the other tests of this module share theirs in any order."""
    live = LiveRun(tmp_path / "runs", data_cache, "live", ["monitor.plot=true"], min_step=6)
    root = live.root
    table = run_cli("runs", str(root)).stdout.splitlines()
    assert table[0].split()[:3] == ["NAME", "STATE", "STEP"] and table[1].split()[:2] == ["live", "running"]
    ok = run_cli("status", str(live.run_dir), check=False)
    assert ok.returncode == 0 and ok.stdout.startswith("healthy")
    assert run_cli("status", live.url, check=False).returncode == 0
    assert "loss" in run_cli("logs", "live", "--root", str(root), "-n", "3").stdout
    assert live.stop(signal.SIGTERM) == 0  # saves a checkpoint at the next step boundary, then exits
    s = read_status(live.run_dir)
    assert s["phase"] == "preempted" and s["last_checkpoint"] == f"step_{s['step']:08d}"
    bad = run_cli("status", str(live.run_dir), check=False)
    assert bad.returncode == 1 and bad.stdout.startswith("unhealthy: preempted")
    gone = run_cli("status", live.url, check=False)
    assert gone.returncode == 1 and "unreachable" in gone.stdout
    assert run_cli("runs", str(root)).stdout.splitlines()[1].split()[:2] == ["live", "preempted"]
    assert (live.run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # written when the run ended


# ----------------------------------------------------------------------------- stall, NaN, binding (in-process)


def _cfg(tmp_path, data_cache, *extra):
    from trainbox.config import load_config
    return load_config(None, [*TINY, f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={data_cache}", *extra])


def test_stall_is_detected_and_clears(tmp_path, data_cache):
    """A step that hangs (here: the data read of step 6 blocks, as on a dead network filesystem) turns
    /health to 503 once stall_after pass, and back to 200 when progress resumes."""
    from trainbox.train.loop import Trainer

    gate = threading.Event()

    class HangingTrainer(Trainer):
        def train_step(self, step):
            if step == 5:
                self.hung_at = time.time()
                gate.wait(120)
            return super().train_step(step)

    cfg = _cfg(tmp_path, data_cache, "train.max_steps=10", "train.eval_every=0", "monitor.stall_after=1.5")
    trainer = HangingTrainer(cfg)
    result = {}
    thread = threading.Thread(target=lambda: result.update(trainer.run()), daemon=True)
    thread.start()
    try:
        url = wait_for(lambda: (read_status(cfg.run_dir) or {}).get("url"), 60, "the monitor URL")
        wait_for(lambda: hasattr(trainer, "hung_at"), 60, "the hang")
        code, _, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(http(url + "/health")), 30, "a 503")
        h = json.loads(body)
        last = json.loads(http(url + "/status")[2])["heartbeat"]   # the last progress the run reported
        assert h["reason"].startswith("stalled") and h["step"] == 5
        assert last <= trainer.hung_at and time.time() - last >= 1.5   # 503 only after 1.5 s without progress
        prom = http(url + "/metrics", {"Accept": "text/plain"})[2].decode()
        assert 'trainbox_healthy{run="tiny"} 0.0' in prom
        assert run_cli("status", url, check=False).returncode == 1
    finally:
        gate.set()
    thread.join(60)
    assert result["step"] == 10 and read_status(cfg.run_dir)["phase"] == "finished"


def test_nan_run_reports_503_failed(tmp_path, data_cache):
    """A real divergence (lr 1e30 -> NaN at step 2) stops the run; its state answers 503 with the reason."""
    from trainbox.errors import TrainingFailed
    from trainbox.monitor.server import start_server
    from trainbox.train.loop import Trainer

    cfg = _cfg(tmp_path, data_cache, "train.max_steps=20", "optim.lr=1e30")
    trainer = Trainer(cfg)
    with pytest.raises(TrainingFailed, match="nan"):
        trainer.run()
    server = start_server(trainer.state, cfg.monitor)  # the same state the run's server served
    try:
        code, _, body = http(server.url + "/health")
        assert code == 503 and "nan" in json.loads(body)["reason"]
    finally:
        server.stop()
    assert read_status(cfg.run_dir)["phase"] == "failed"


def test_tokens_per_second_and_the_eta_leave_out_validation_and_checkpoint_saves(tmp_path, data_cache, monkeypatch):
    """tokens/s over a logged window, and the step time the ETA is made of, count the steps alone: the window
    after an evaluation and a save (steps 4 and 7 here) is measured over an interval shorter than the wall time since
    the previous window by at least the evaluation's and the save's durations, timed around the loop's own calls of
    them; what metrics.jsonl and status.json show is that measure. Without it, one 8 s evaluation of a gpt2-125m
    run made the next window's tokens/s 437 against ~14,300."""
    from trainbox.monitor.meter import Meter
    from trainbox.train.loop import Trainer

    windows, outside = [], {}   # (step, the interval measured, the wall time since the previous window, rates)
    meter_window, evaluate, save = Meter.window, Trainer._evaluate, Trainer._save

    def window(self, step):
        before, previous = self.last_t, windows[-1][3] if windows else None
        rates = meter_window(self, step)
        windows.append((step, self.last_t - before, None if previous is None else self.last_t - previous,
                        self.last_t, rates, self.t_ready, self.step_ready))
        return rates

    def timed(method):
        def call(self, step):
            t0 = time.time()
            try:
                return method(self, step)
            finally:
                outside[step] = outside.get(step, 0.0) + time.time() - t0
        return call

    monkeypatch.setattr(Meter, "window", window)
    monkeypatch.setattr(Trainer, "_evaluate", timed(evaluate))
    monkeypatch.setattr(Trainer, "_save", timed(save))
    cfg = _cfg(tmp_path, data_cache, "train.max_steps=8", "train.eval_every=3", "train.checkpoint_every=3",
               "train.sample_tokens=0")
    Trainer(cfg).run()
    assert set(outside) == {3, 6, 8}   # the evaluations and saves of steps 3 and 6, the final save and evaluation
    logged = {e["step"]: e for e in map(json.loads, (cfg.run_dir / "metrics.jsonl").read_text().splitlines())
              if e["event"] == "train"}
    by_step = {w[0]: w for w in windows}
    for after in (4, 7):
        step, interval, wall, _, (tok_s, per_step), t_ready, step_ready = by_step[after]
        assert interval <= wall - outside[after - 1], (after, interval, wall, outside)
        assert logged[after]["tokens_per_s"] == tok_s
        # the step time since the first step leaves out every evaluation and save in between
        ended = by_step[after][3]
        assert per_step * (after - step_ready) <= ended - t_ready - sum(
            s for at, s in outside.items() if step_ready < at < after), (after, per_step)
    assert read_status(cfg.run_dir)["step_time_s"] == windows[-1][4][1]


def _busy() -> None:
    """A few milliseconds of work for a clock to measure."""
    sum(i * i for i in range(200_000))


def test_the_first_step_alone_shows_no_rate_rather_than_zero(tmp_path, data_cache):
    """A logged window that holds the first step alone (monitor.log_every=1) has no other step to measure, and its
    own time is mostly compilation: the console line says "tok/s ?" and metrics.jsonl has no rate, never "tok/s 0";
    the next line has the rate and an ETA at the steps' pace."""
    proc = run_cli("train", "tiny", *TINY, f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={data_cache}",
                   "run.name=first", "train.max_steps=3", "train.sample_tokens=0")
    lines = {n: next(x for x in proc.stderr.splitlines() if f" step {n}/3 " in x) for n in (1, 2)}
    first = re.search(r" tok/s (\S+) .*eta (\S+)$", lines[1]).groups()
    assert first == ("?", "?"), lines[1]
    rate, eta = re.search(r" tok/s (\S+) .*eta (\S+)$", lines[2]).groups()
    events = {e["step"]: e for e in map(json.loads, (tmp_path / "runs" / "first" / "metrics.jsonl").read_text()
                                        .splitlines()) if e["event"] == "train"}
    assert events[1]["tokens_per_s"] is None and events[2]["tokens_per_s"] > 0
    assert f"{events[2]['tokens_per_s']:,.0f}" == rate and eta != "?", lines[2]


def test_non_loopback_without_token_warns(tmp_path, data_cache):
    from trainbox.monitor.console import log
    from trainbox.monitor.server import start_server
    from trainbox.monitor.state import RunState

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    try:
        for host, token, warns in (("0.0.0.0", None, True), ("0.0.0.0", "t", False), ("127.0.0.1", None, False)):
            cfg = _cfg(tmp_path, data_cache, f"monitor.host={host}", *([f"monitor.token={token}"] if token else []))
            records.clear()
            server = start_server(RunState("x", tmp_path), cfg.monitor)
            try:
                assert http(server.url + "/health")[0] == 200
            finally:
                server.stop()
            warned = any(r.levelno == logging.WARNING and "monitor.token" in r.getMessage() for r in records)
            assert warned == warns, (host, token)
    finally:
        log.removeHandler(handler)


# ------------------------------------------------------------------------- hardening (in-process server, raw sockets)


def _serve(tmp_path, timeout: float | None = None, **monitor):
    """A monitor on a free port over a fresh RunState, with MonitorSection fields `monitor`."""
    from trainbox.config import MonitorSection
    from trainbox.monitor.server import MonitorServer
    from trainbox.monitor.state import RunState

    state = RunState("unit", tmp_path, total_steps=10)
    state.update(phase="training", step=1, loss=2.5)
    return MonitorServer(state, MonitorSection(port=0, **monitor), **({"timeout": timeout} if timeout else {}))


def _closed_by_server(sock: socket.socket, deadline: float, trickle: bool = False) -> bool:
    """Wait (on the socket, never a sleep) until the server closes it or `deadline` passes; with `trickle`
    send one more header byte every 0.1 s meanwhile, as a slowloris client does."""
    while time.monotonic() < deadline:
        sock.settimeout(min(0.1 if trickle else 1.0, max(deadline - time.monotonic(), 0.01)))
        try:
            if sock.recv(1024) == b"":
                return True
        except TimeoutError:
            if trickle:
                try:
                    sock.sendall(b"x")
                except OSError:
                    return True
        except OSError:  # reset: closed too
            return True
    return False


def _raw(server, path: str, headers: dict) -> tuple[int, dict, bytes]:
    """One request through http.client with exactly these headers (Host included: no automatic one)."""
    conn = HTTPConnection("127.0.0.1", server.httpd.server_address[1], timeout=10)
    try:
        conn.putrequest("GET", path, skip_host="Host" in headers, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, {k: v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_slow_and_silent_clients_are_dropped_and_others_served(tmp_path):
    """Connections that send nothing, half a request line or trickle headers are closed once the request
    timeout (1 s here) passes, and a normal request is answered while 20 of them hang open."""
    timeout = 1.0
    server = _serve(tmp_path, timeout=timeout)
    port = server.httpd.server_address[1]
    partial = [b"", b"GET /sta", b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "]
    slow = []
    try:
        opened = time.monotonic()
        for i in range(20):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(partial[i % 3])
            slow.append(sock)
        code, _, body = http(server.url + "/status")
        assert code == 200 and json.loads(body)["run_name"] == "unit"
        for sock in slow:  # all still connected while that request was answered
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
        bound = opened + timeout + 2.0  # the timeout plus scheduling slack on a loaded 2-core machine
        still_open = [i for i, sock in enumerate(slow) if not _closed_by_server(sock, bound)]
        assert not still_open, f"connections {still_open} still open {bound - opened:.1f} s after connecting"
        trickler = socket.create_connection(("127.0.0.1", port), timeout=5)
        slow.append(trickler)
        trickler.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        start = time.monotonic()
        assert _closed_by_server(trickler, start + timeout + 2.0, trickle=True), "a trickling client was kept"
        assert http(server.url + "/health")[0] == 200
    finally:
        for sock in slow:
            sock.close()
        server.stop()


def test_token_only_from_the_authorization_header_or_the_dashboard_cookie(tmp_path):
    server = _serve(tmp_path, token=TOKEN)
    try:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert http(server.url + "/metrics", {"Authorization": f"{scheme} {TOKEN}"})[0] == 200, scheme
        for bad in (TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer", ""):
            assert http(server.url + "/metrics", {"Authorization": bad})[0] == 401, bad
        for path in ("/metrics", "/status", "/history", "/index.html", "/nosuch"):
            assert http(server.url + f"{path}?token={TOKEN}", redirect=False)[0] == 401, path
        assert http(server.url + "/?token=wrong", redirect=False)[0] == 401
        # the dashboard: /?token= sets an HttpOnly, SameSite=Strict cookie and redirects to / without the token
        code, headers, _ = http(server.url + f"/?token={TOKEN}", redirect=False)
        assert code == 303 and headers["Location"] == "/"
        cookie = headers["Set-Cookie"]
        attrs = {a.strip().lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/"} <= attrs and TOKEN not in cookie
        pair = cookie.split(";")[0]
        for path in ("/", "/status", "/history?since=0"):
            assert http(server.url + path, {"Cookie": f"other=1; {pair}"})[0] == 200, path
        name, value = pair.split("=", 1)
        assert http(server.url + "/status", {"Cookie": f"{name}={value[:-1]}0"})[0] == 401
        # a browser-like client: follows the redirect with its cookie jar, then polls with the cookie only
        jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with opener.open(server.url + f"/?token={TOKEN}", timeout=10) as r:
            assert r.status == 200 and r.url == server.url + "/" and b"<canvas" in r.read()
        with opener.open(server.url + "/status", timeout=10) as r:
            assert json.loads(r.read())["run_name"] == "unit"
        assert http(server.url + "/health")[0] == 200
    finally:
        server.stop()


def test_request_log_never_holds_the_token(tmp_path):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("trainbox.monitor.http")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    server = _serve(tmp_path, token=TOKEN)
    try:
        http(server.url + f"/?token={TOKEN}", redirect=False)
        http(server.url + f"/metrics?token={TOKEN}")
        http(server.url + f"/{TOKEN}", {"Authorization": f"Bearer {TOKEN}"})
        with socket.create_connection(("127.0.0.1", server.httpd.server_address[1]), timeout=10) as sock:
            sock.sendall(f"GET /?token={TOKEN}&x=1 HTTP/1.1 junk\r\n\r\n".encode())  # a malformed request line
            assert b"400" in sock.makefile("rb").read()
    finally:
        server.stop()
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [r.getMessage() for r in records]
    assert len(lines) >= 4 and any('"GET /?' in ln and " 303 " in ln for ln in lines), lines
    assert any(" 401 " in ln for ln in lines) and any("400" in ln for ln in lines), lines
    assert not [ln for ln in lines if TOKEN in ln], lines


def test_loopback_without_token_rejects_foreign_host_headers(tmp_path):
    """DNS rebinding: a page on evil.example that resolves to 127.0.0.1 sends Host: evil.example."""
    server = _serve(tmp_path)
    port = server.httpd.server_address[1]
    try:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example",
                     "10.0.0.1", "[::2]"):
            for path in ("/status", "/metrics", "/", "/health"):
                code, _, body = _raw(server, path, {"Host": host})
                assert code == 421 and b"Host" in body, (host, path, code)
        for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LocalHost:{port}", f"[::1]:{port}", "[::1]"):
            assert _raw(server, "/status", {"Host": host})[0] == 200, host
    finally:
        server.stop()
    with_token = _serve(tmp_path, token=TOKEN)  # the token is the guard: any Host
    try:
        assert _raw(with_token, "/status", {"Host": "evil.example", "Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert _raw(with_token, "/status", {"Host": "evil.example"})[0] == 401
    finally:
        with_token.stop()


def test_all_interfaces_without_token_answer_ip_addresses_only(tmp_path):
    """Bound to 0.0.0.0 (containers: compose publishes the port on the host's loopback) without a token:
    requests addressed to an IP address or a loopback name, never to a DNS name a rebinding page controls."""
    server = _serve(tmp_path, host="0.0.0.0")
    try:
        for host in ("evil.example", "evil.example:8080", "gpu-node-3:8080"):
            assert _raw(server, "/status", {"Host": host})[0] == 421, host
        for host in ("127.0.0.1:8080", "localhost", "10.1.2.3:8080", "[fd00::5]:8080"):
            assert _raw(server, "/status", {"Host": host})[0] == 200, host
    finally:
        server.stop()


@pytest.mark.gpu
def test_gpu_fields_on_a_cuda_run(tmp_path, data_cache):
    """On the GPU machine: /status names the GPU, /metrics reports allocated memory and MFU."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run = LiveRun(tmp_path / "runs", data_cache, "gpu", ["train.device=cuda"], min_step=12)
    try:
        s = json.loads(http(run.url + "/status")[2])
        assert s["cuda_available"] and s["gpu_count"] == 1 and s["gpu_name"] == torch.cuda.get_device_name(0)
        m = json.loads(http(run.url + "/metrics")[2])
        assert m["gpu_memory_allocated"] > 0 and (m["mfu"] is None or 0 < m["mfu"] < 1)
        prom = {f.name: f.samples[0].value for f in
                parse_prometheus(http(run.url + "/metrics", {"Accept": "text/plain"})[2].decode())}
        assert prom["trainbox_gpu_memory_allocated_bytes"] > 0
    finally:
        run.stop()


def test_a_busy_port_that_was_asked_for_is_an_error_and_the_default_moves(tmp_path):
    """monitor.port given by the user and held by another process: one clear error (probes depend on it); the
    default port moves to a free one with a warning."""
    import socket as socketlib

    from trainbox.config import load_config
    from trainbox.errors import ConfigError
    from trainbox.monitor.server import start_server
    from trainbox.monitor.state import RunState

    holder = socketlib.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        asked = load_config("tiny", [f"monitor.port={port}"]).monitor
        with pytest.raises(ConfigError, match=rf"monitor.port={port} on 127.0.0.1 is unavailable"):
            start_server(RunState("r", tmp_path, 1), asked)
    finally:
        holder.close()
    default = load_config("tiny").monitor   # port 8080, not asked for: made busy here unless it already is
    busy = socketlib.socket()
    try:
        busy.bind(("127.0.0.1", default.port))
        busy.listen()
    except OSError:
        pass
    try:
        server = start_server(RunState("r", tmp_path, 1), default)
        assert not server.url.endswith(f":{default.port}")
        server.stop()
    finally:
        busy.close()
