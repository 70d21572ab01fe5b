"""Console output: a progress bar on a TTY, plain log lines otherwise (docker logs, Kubernetes).

Library code logs through the `trainbox` logger; `setup_logging` (called by the CLI) attaches the console
and train.log handlers. Step lines carry `extra={"progress": True}`: on a TTY the bar replaces them on
the console, while train.log always gets them (without bar redraws).
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from trainbox.files import open_append

log = logging.getLogger("trainbox")


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class _NoProgress(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "progress", False)


class ProgressBar:
    """One redrawn line: step/total, loss, tokens/s, ETA. No-op when not on a TTY."""

    def __init__(self, stream=None, enabled: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = 0.0

    def update(self, step: int, total: int, loss: float | None, tok_s: float | None, eta: float | None,
               force: bool = False) -> None:
        now = time.time()
        if not self.enabled or (not force and now - self._last < 0.2):
            return
        self._last = now
        frac = step / total if total else 0.0
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        loss_s = f"{loss:.4f}" if loss is not None else "-"
        tok_s_s = f"{tok_s / 1e3:.1f}k" if tok_s else "-"
        self.stream.write(f"\r[{bar}] {step}/{total} loss {loss_s} tok/s {tok_s_s} eta {fmt_duration(eta)}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


class _AppendHandler(logging.FileHandler):
    """train.log, opened without following a symbolic link (trainbox.files.open_append)."""

    def _open(self):
        return open_append(Path(self.baseFilename))


def setup_logging(log_file: Path | None, console: bool, bar: bool) -> None:
    """Attach handlers to the trainbox logger (idempotent: replaces earlier handlers). `console`: every line on
    stderr (rank 0), else only errors."""
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fmt = logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S")
    if not console:   # another rank than 0: only its errors (a lost peer it found) reach the console
        h = logging.StreamHandler(sys.stderr)
        h.setLevel(logging.ERROR)
        h.setFormatter(fmt)
        log.addHandler(h)
    else:
        h = logging.StreamHandler(sys.stderr)
        # on a TTY, clear the bar's line before a log line so the two never share a line
        h.setFormatter(logging.Formatter("\r\033[K%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S") if bar else fmt)
        if bar:
            h.addFilter(_NoProgress())
        log.addHandler(h)
    if log_file is not None:
        fh = _AppendHandler(log_file)
        fh.setFormatter(fmt)
        log.addHandler(fh)
