"""HTTP monitoring on rank 0: /health /metrics /status and / (the dashboard page).

The server runs in a daemon thread and only reads `RunState.snapshot()` (a dict copy under a lock),
so it never touches the training step. /health is what Docker HEALTHCHECK and Kubernetes probes hit:

  200  training and the step heartbeat is fresh, or the run finished
  503  stalled (no progress for stall_seconds), failed, or preempted

With `monitor.token` every endpoint but /health needs `Authorization: Bearer <token>`.
"""
from __future__ import annotations

import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlparse

from prometheus_client import CollectorRegistry, generate_latest, CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainbox.monitor.console import log
from trainbox.monitor.state import RunState

# phases that report their own progress and may take long without a step (compile, eval, save)
SLOW_PHASES = ("loading", "compiling", "evaluating", "checkpointing")
SLOW_PHASE_SECONDS = 1800.0


def stall_limit(snapshot: dict, configured: float | None) -> float:
    """Seconds without a heartbeat before /health says stalled."""
    if configured:
        return configured
    if snapshot["phase"] in SLOW_PHASES:
        return SLOW_PHASE_SECONDS
    step = snapshot.get("step_time_s") or 0.0
    return max(120.0, 20.0 * step)


def health(snapshot: dict, configured_stall: float | None, now: float | None = None) -> tuple[bool, str]:
    now = time.time() if now is None else now
    phase = snapshot["phase"]
    if phase == "failed":
        return False, f"failed: {snapshot.get('error') or 'unknown error'}"
    if phase == "preempted":
        return False, f"preempted at step {snapshot['step']}"
    if phase == "finished":
        return True, f"finished at step {snapshot['step']}"
    age = now - snapshot["heartbeat"]
    limit = stall_limit(snapshot, configured_stall)
    if age > limit:
        return False, f"stalled: no progress for {age:.0f}s in phase {phase} (limit {limit:.0f}s)"
    return True, f"{phase} step {snapshot['step']}/{snapshot['total_steps']}"


def metrics_json(s: dict) -> dict:
    return {"current_step": s["step"], "total_steps": s["total_steps"], "last_loss": s["loss"],
            "is_training": s["phase"] in ("compiling", "training", "evaluating", "checkpointing"),
            "gpu_memory_allocated": s["gpu_memory_allocated"], "val_loss": s["val_loss"], "lr": s["lr"],
            "grad_norm": s["grad_norm"], "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"],
            "tokens_seen": s["tokens_seen"], "phase": s["phase"]}


class _Collector:
    """Prometheus view of one snapshot: base units, trainbox_ prefix."""

    def __init__(self, state: RunState):
        self.state = state

    def collect(self):
        s = self.state.snapshot()
        counters = {"steps": ("optimizer steps taken", s["step"]), "tokens": ("training tokens consumed", s["tokens_seen"]),
                    "checkpoints": ("checkpoints saved by this process", s["checkpoints_saved"]),
                    "restarts": ("times this run was resumed", s["restarts"])}
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(f"trainbox_{name}", doc, labels=["run"])
            c.add_metric([s["run_name"]], float(value or 0))
            yield c
        gauges = {"loss": ("last training loss (nats/token)", s["loss"]), "val_loss": ("last validation loss", s["val_loss"]),
                  "learning_rate": ("current learning rate", s["lr"]), "grad_norm": ("last gradient norm", s["grad_norm"]),
                  "tokens_per_second": ("training throughput", s["tokens_per_s"]), "mfu_ratio": ("model FLOPs utilisation", s["mfu"]),
                  "gpu_memory_allocated_bytes": ("GPU memory allocated by tensors", s["gpu_memory_allocated"]),
                  "total_steps": ("steps planned", s["total_steps"]), "eta_seconds": ("estimated seconds left", s["eta_s"]),
                  "is_training": ("1 while training", 1.0 if s["phase"] in ("compiling", "training", "evaluating", "checkpointing") else 0.0)}
        for name, (doc, value) in gauges.items():
            if value is None:
                continue
            g = GaugeMetricFamily(f"trainbox_{name}", doc, labels=["run"])
            g.add_metric([s["run_name"]], float(value))
            yield g


def _dashboard_html() -> bytes:
    return resources.files("trainbox.monitor").joinpath("dashboard.html").read_bytes()


class MonitorServer:
    def __init__(self, state: RunState, cfg):
        self.state, self.cfg = state, cfg
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(state))
        handler = self._handler_class()
        try:
            self.httpd = ThreadingHTTPServer((cfg.host, cfg.port), handler)
        except OSError as e:
            if cfg.port == 0:
                raise
            log.warning(f"monitor port {cfg.host}:{cfg.port} is unavailable ({e.strerror}); serving on a free port "
                        f"instead (set monitor.port to choose one)")
            self.httpd = ThreadingHTTPServer((cfg.host, 0), handler)
        self.httpd.daemon_threads = True
        host = cfg.host if cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.token:
            log.warning(f"monitor binds {cfg.host} without monitor.token: anyone who can reach this port can read "
                        f"the run's status; set monitor.token=SECRET")
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="trainbox-monitor", daemon=True)
        self.thread.start()
        log.info(f"monitor: {self.url} (/health /metrics /status, dashboard at /)")

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the training console clean
                pass

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def _json(self, code: int, obj) -> None:
                self._send(code, json.dumps(obj, default=str).encode(), "application/json")

            def _authorized(self) -> bool:
                token = server.cfg.token
                if not token:
                    return True
                got = self.headers.get("Authorization", "")
                return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

            def do_GET(self):
                url = urlparse(self.path)
                snap = server.state.snapshot()
                if url.path == "/health":
                    ok, reason = health(snap, server.cfg.stall_seconds)
                    return self._json(200 if ok else 503, {"healthy": ok, "reason": reason, "phase": snap["phase"],
                                                           "step": snap["step"]})
                if not self._authorized():
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", "Bearer")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if url.path == "/metrics":
                    accept = self.headers.get("Accept", "")
                    if "text/plain" in accept or "openmetrics" in accept:
                        return self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                    return self._json(200, metrics_json(snap))
                if url.path == "/status":
                    ok, reason = health(snap, server.cfg.stall_seconds)
                    return self._json(200, {**snap, "healthy": ok, "health_reason": reason})
                if url.path == "/history":
                    since = int(parse_qs(url.query).get("since", ["0"])[0])
                    return self._json(200, server.state.points(since))
                if url.path in ("/", "/index.html"):
                    return self._send(200, _dashboard_html(), "text/html; charset=utf-8")
                self._json(404, {"error": f"no endpoint {url.path}", "endpoints": ["/health", "/metrics", "/status", "/"]})

        return Handler


def start_server(state: RunState, cfg) -> MonitorServer:
    return MonitorServer(state, cfg)
