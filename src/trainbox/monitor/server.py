"""HTTP monitoring on rank 0: /health /metrics /status /history and / (the dashboard page).

The server runs in a daemon thread and only reads `RunState.snapshot()` (a dict copy under a lock),
so it never touches the training step. /health is what Docker HEALTHCHECK and Kubernetes probes hit:

  200  training and the step heartbeat is fresh, or the run finished
  503  stalled (no progress within the phase's limit, see monitor/state.py), failed (NaN included) or
       preempted

/metrics answers JSON by default and Prometheus text (or OpenMetrics) when the Accept header asks for
`text/plain` or `application/openmetrics-text`, as Prometheus' scraper does (monitor/metrics.py). Metric names
carry the `trainbox_` prefix and base units (seconds, bytes, ratios); counters end in `_total`.

Access rules:

- With `monitor.token`, every endpoint but /health needs `Authorization: Bearer <token>` (the scheme in any
  case). The token is accepted nowhere else, with one exception: a browser cannot set that header when
  opening a page, so `GET /?token=<token>` sets an HttpOnly, SameSite=Strict cookie (an HMAC of the token,
  not the token) and answers 303 to `/`, leaving no token in the address bar; the dashboard and its own
  requests then authenticate with the cookie. A query token on any other path gets 401.
- Without a token, the Host header must name loopback (127.0.0.1, localhost, [::1], any port) when the
  server binds loopback, and loopback or an IP address when it binds anything else (0.0.0.0 in containers):
  a DNS-rebinding page sends its own domain name, which gets 421. A missing Host header passes.
- A connection must deliver its whole request line and headers within `REQUEST_TIMEOUT` seconds (the
  `timeout` argument), however slowly its bytes trickle in; then it is closed. Each reply gets as long.
- Requests are logged at DEBUG level on the `trainbox.monitor.http` logger with query strings and the
  token redacted.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlparse

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from trainbox.errors import ConfigError
from trainbox.monitor.console import log
from trainbox.monitor.metrics import Collector, metrics_json, rank_beats, wants_prometheus
from trainbox.monitor.state import RunState
from trainbox.rundir.runs import latest_eval
from trainbox.rundir.status import health

REQUEST_TIMEOUT = 10.0  # seconds a connection has to send its request (and the server to send the reply)
STOP_POLL_S = 0.05      # seconds between the serving thread's checks for a stop (the end of a run waits this long)
http_log = logging.getLogger("trainbox.monitor.http")


def _host_name(host: str) -> str:
    """The name in a Host header, without the port or IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _host_port(host: str) -> str:
    """The port in a Host header, or ''."""
    rest = host.strip().rsplit("]", 1)[-1]  # what follows an IPv6 literal
    port = rest.rpartition(":")[2]
    return port if rest.count(":") == 1 and port.isdigit() else ""


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _is_loopback(name: str) -> bool:
    ip = _ip(name)
    return name == "localhost" or (ip is not None and ip.is_loopback)


class _DeadlineReader(io.RawIOBase):
    """Socket reads that together must finish by `deadline` (time.monotonic()): each recv waits only for
    what is left, so a client trickling one byte at a time is cut off as surely as a silent one."""

    def __init__(self, sock: socket.socket):
        self.sock, self.deadline = sock, time.monotonic()

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buf)


class _Server(ThreadingHTTPServer):
    """One daemon thread per connection; a listen backlog that absorbs a burst of connections."""

    daemon_threads = True
    request_queue_size = 64


def _dashboard_html() -> bytes:
    return resources.files("trainbox.monitor").joinpath("dashboard.html").read_bytes()


class MonitorServer:
    """Serves the endpoints above from a daemon thread; `url` is where it listens. `timeout`: seconds a
    connection has to send its request line and headers (default REQUEST_TIMEOUT)."""

    def __init__(self, state: RunState, cfg, timeout: float | None = None):
        self.state, self.cfg = state, cfg
        self.timeout = REQUEST_TIMEOUT if timeout is None else timeout
        self.loopback = _is_loopback(cfg.host)
        # the dashboard cookie's value: derived from the token, so the cookie is not the token itself
        self.session = (hmac.new(cfg.token.encode(), b"trainbox dashboard session", hashlib.sha256).hexdigest()
                        if cfg.token else None)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(Collector(state, cfg))
        handler = self._handler_class()
        try:
            self.httpd = _Server((cfg.host, cfg.port), handler)
        except OSError as e:
            if cfg.port == 0:
                raise
            if "port" in cfg.model_fields_set:   # asked for by the user: probes and links depend on it
                raise ConfigError(f"monitor.port={cfg.port} on {cfg.host} is unavailable ({e.strerror})",
                                  hint="stop what holds it, choose another monitor.port, or monitor.port=0 "
                                       "for a free one") from None
            log.warning(f"monitor port {cfg.host}:{cfg.port} is unavailable ({e.strerror}); serving on a free port "
                        f"instead (set monitor.port to choose one)")
            self.httpd = _Server((cfg.host, 0), handler)
        host = cfg.host if cfg.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        if not self.loopback and not cfg.token:
            log.warning(f"monitor binds {cfg.host or '0.0.0.0'} without monitor.token: anyone who can reach port "
                        f"{self.httpd.server_address[1]} can read this run's status and metrics; "
                        f"set monitor.token=SECRET")
        # serve_forever checks for shutdown once per poll interval: `stop` returns within STOP_POLL_S
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": STOP_POLL_S},
                                       name="trainbox-monitor", daemon=True)
        self.thread.start()
        log.info(f"monitor: {self.url} (/health /metrics /status, dashboard at /)")

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def host_allowed(self, host: str | None) -> bool:
        """The DNS-rebinding guard (see the module docstring); a token replaces it."""
        if self.cfg.token or host is None:
            return True
        name = _host_name(host)
        return _is_loopback(name) or (not self.loopback and _ip(name) is not None)

    def redact(self, text: str) -> str:
        """`text` with query strings and the token replaced, for the request log."""
        text = re.sub(r"\?[^\s\"']*", "?<redacted>", text)
        return text.replace(self.cfg.token, "<redacted>") if self.cfg.token else text

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = server.timeout

            def setup(self):
                super().setup()
                self.rfile.close()  # replaced by a reader that enforces the request deadline
                self.reader = _DeadlineReader(self.connection)
                self.rfile = io.BufferedReader(self.reader)

            def handle_one_request(self):
                self.reader.deadline = time.monotonic() + self.timeout
                super().handle_one_request()

            def log_message(self, format, *args):  # DEBUG only: keeps the training console clean
                if http_log.isEnabledFor(logging.DEBUG):
                    http_log.debug("%s %s", self.address_string(), server.redact(format % args))

            def _send(self, code: int, body: bytes, ctype: str, head: bool = False, headers: dict | None = None
                      ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                if code == 401:
                    self.send_header("WWW-Authenticate", 'Bearer realm="trainbox"')
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, code: int, obj, head: bool = False) -> None:
                self._send(code, json.dumps(obj, default=str).encode(), "application/json", head)

            def _cookie_name(self) -> str:
                """One cookie per host:port the browser addressed (cookies ignore ports; runs share hosts)."""
                port = _host_port(self.headers.get("Host", ""))
                return f"trainbox_{port}" if port else "trainbox"

            def _authorized(self) -> bool:
                token = server.cfg.token
                if not token:
                    return True
                scheme, _, cred = self.headers.get("Authorization", "").strip().partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(cred.strip().encode("latin-1", "replace"),
                                                                      token.encode()):
                    return True
                name = self._cookie_name()
                for part in self.headers.get("Cookie", "").split(";"):
                    key, _, value = part.strip().partition("=")
                    if key == name and hmac.compare_digest(value.encode("latin-1", "replace"),
                                                           server.session.encode()):
                        return True
                return False

            def _open_dashboard(self, query_token: str, head: bool) -> None:
                """`/?token=`: the cookie for the dashboard, and a redirect that drops the token from the URL."""
                if not hmac.compare_digest(query_token.encode(), server.cfg.token.encode()):
                    return self._json(401, {"error": "wrong token"}, head)
                cookie = f"{self._cookie_name()}={server.session}; HttpOnly; SameSite=Strict; Path=/"
                self._send(303, b"", "text/plain", head, {"Location": "/", "Set-Cookie": cookie})

            def do_HEAD(self):
                self.do_GET(head=True)

            def do_GET(self, head: bool = False):
                self.connection.settimeout(self.timeout)  # the reply gets the whole timeout
                url = urlparse(self.path)
                query = parse_qs(url.query)
                snap = server.state.snapshot()
                cfg = server.cfg
                if not server.host_allowed(self.headers.get("Host")):
                    allowed = "a loopback name" if server.loopback else "a loopback name or an IP address"
                    return self._json(421, {"error": f"Host {self.headers['Host']!r} is not allowed: without "
                                            f"monitor.token only requests addressed to {allowed} are answered"},
                                      head)
                if url.path == "/health":
                    ok, reason = health(snap, cfg.stall_after, cfg.log_every, ranks=rank_beats(snap))
                    return self._json(200 if ok else 503, {"healthy": ok, "reason": reason, "phase": snap["phase"],
                                                           "step": snap["step"], "total_steps": snap["total_steps"]},
                                      head)
                if url.path == "/" and "token" in query and cfg.token:
                    return self._open_dashboard(query["token"][0], head)
                if not self._authorized():
                    return self._json(401, {"error": "this endpoint needs 'Authorization: Bearer <monitor.token>' "
                                            "(the dashboard: open /?token=<monitor.token>)"}, head)
                if url.path == "/metrics":
                    if wants_prometheus(self.headers.get("Accept", "")):
                        encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
                        return self._send(200, encoder(server.registry), ctype, head)
                    return self._json(200, metrics_json(snap), head)
                if url.path == "/status":
                    ok, reason = health(snap, cfg.stall_after, cfg.log_every, ranks=rank_beats(snap))
                    return self._json(200, {**snap, "healthy": ok, "health_reason": reason,
                                            "eval_tasks": latest_eval(snap["run_dir"])}, head)
                if url.path == "/history":
                    try:
                        since = int(query.get("since", ["0"])[0] or 0)
                    except ValueError:
                        return self._json(400, {"error": "since must be a step number"}, head)
                    return self._json(200, server.state.points(since), head)
                if url.path in ("/", "/index.html"):
                    return self._send(200, _dashboard_html(), "text/html; charset=utf-8", head)
                self._json(404, {"error": f"no endpoint {url.path}",
                                 "endpoints": ["/health", "/metrics", "/status", "/history", "/"]}, head)

        return Handler


def check_host(cfg) -> None:
    """Refuse a monitor.host the server could not bind (a name that does not resolve, an address of another
    machine) before any work: the server starts only once the model is built. A probe socket of the server's
    address family binds the host on a port the system picks, then closes."""
    probe = socket.socket(_Server.address_family, socket.SOCK_STREAM)
    fix = ("use 127.0.0.1 (this machine only), 0.0.0.0 (every interface, in a container; with monitor.token) or an "
           "IPv4 address of this machine; or monitor.enabled=false")
    try:
        probe.bind((cfg.host, 0))
    except socket.gaierror as e:
        raise ConfigError(f"monitor.host={cfg.host!r} does not resolve to an IPv4 address ({e.strerror})",
                          hint=fix) from None
    except OSError as e:
        raise ConfigError(f"monitor.host={cfg.host!r} is not an address of this machine ({e.strerror})",
                          hint=fix) from None
    finally:
        probe.close()


def start_server(state: RunState, cfg, timeout: float | None = None) -> MonitorServer:
    """Start serving `state` on cfg.host:cfg.port (a MonitorSection); returns the running server.
    `timeout`: seconds a connection has to send its request (default REQUEST_TIMEOUT)."""
    return MonitorServer(state, cfg, timeout)
