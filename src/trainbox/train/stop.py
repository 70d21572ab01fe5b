"""Stop signals for the training loop: SIGTERM / SIGINT / SIGUSR1 set a flag that the loop acts on at the
next step boundary, agreed across ranks (train/loop.py).

`STOP` is the process's one flag. The CLI installs it before its heavy imports, so a signal that arrives while
the run starts is kept and acted on before the first step; the trainer installs it again (a no-op then) and
restores the previous handlers, clearing the flag, when the run ends.
"""
from __future__ import annotations

import signal
import threading

from trainbox.monitor.console import log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopFlag:
    """Set by SIGTERM/SIGINT/SIGUSR1; the loop agrees across ranks at the next step boundary."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def install(self) -> None:
        if self._old or threading.current_thread() is not threading.main_thread():
            return
        for s in STOP_SIGNALS:
            self._old[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.signum = signum
        log.info(f"received {signal.Signals(signum).name}: saving a checkpoint at the next step boundary")

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        self.signum = None


STOP = StopFlag()
