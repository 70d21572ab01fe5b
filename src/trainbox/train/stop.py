"""Stop requests for the training loop: SIGTERM / SIGINT / SIGUSR1, or the end of the process that supervises a
worker, set a flag that the loop acts on at the next step boundary, agreed across ranks (train/loop.py).

`STOP` is the process's one flag. `trainbox train` installs it before its heavy imports (cli/__init__.py), so a
signal that arrives while the run starts is kept: before the first step the run ends with "stopped before the
first step; nothing to save" and exit 0. Until the loop runs, a signal is only noted (the loop, or the CLI
before it, says what it did); from the first step boundary on, each is logged as it arrives: by a thread of its
own, which the handler wakes through a pipe, because a handler that wrote the line itself could run inside a write
of the same stream, where Python's buffered files refuse the second write (a "--- Logging error ---" traceback on
the console). The loop waits for that line (`settle`) before it says how it stopped. A second SIGINT
stops at once (`SecondInterrupt`, a KeyboardInterrupt: exit 130). Once the final checkpoint is written there is no
step boundary left to wait for: inside `cutting_short` (the final evaluation, lm-eval tasks and sample) a stop signal
raises `StopRequested` in the main thread, so the end of the run is cut short within the grace period a scheduler
gives, and the same command does it again from that checkpoint. The handlers are restored, and the flag
cleared, when the command ends; as the process's entry point ends, the signals are ignored instead (`ignore`).

`Ending` is the part of train/loop.py's Trainer that ends a run: a stop at a step boundary, said in one line, and
the end of the run after its final checkpoint, which a stop cuts short.

`stop_when_gone(pid, who)` asks for a stop once another process ends: a torchrun worker watches its launcher and
its torchrun, so a launcher killed with SIGKILL leaves no workers training unsupervised; they save and exit.
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time
from contextlib import contextmanager

from trainbox.monitor.console import log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
BEFORE_FIRST_STEP = "stopped before the first step; nothing to save"
CUT = 0x80   # set in the announcer's byte for a signal inside `cutting_short` (signal numbers are below it)


class SecondInterrupt(KeyboardInterrupt):
    """A second Ctrl-C: every `except KeyboardInterrupt` catches it, and the CLI exits 130.

    A subclass, not KeyboardInterrupt itself: CPython notes a KeyboardInterrupt (that exact type) that leaves code
    run by exec() or eval() of a string, which dataclasses and pydantic do while a config loads, and a process
    started with `python -m` then ends by SIGINT at its exit even though the CLI caught the interrupt."""


class StopRequested(BaseException):
    """A stop during the end of a run, after its final checkpoint (`StopFlag.cutting_short`): the end is cut short.
    A BaseException, as KeyboardInterrupt is, so that no `except Exception` between the handler and the loop keeps
    it."""


class StopFlag:
    """Set by SIGTERM/SIGINT/SIGUSR1 or `request`; the loop agrees across ranks at the next step boundary."""

    def __init__(self):
        self.signum: int | None = None
        self.reason: str | None = None   # a stop asked for without a signal (the supervising process is gone)
        self.announce = False            # the loop runs: log each signal as it arrives
        self._cut = False                # inside `cutting_short`: a stop signal raises StopRequested
        self._old: dict = {}
        self._depth = 0
        self._wake: int | None = None    # the pipe's write end: the handler's signals for the announcing thread
        self._sent = self._announced = 0
        self._logged = threading.Condition()   # notified by the announcing thread after each line
        self.handed_over = False   # `train --detach`: stop signals go on to the run it handed over

    @property
    def requested(self) -> bool:
        return self.signum is not None or self.reason is not None

    def why(self) -> str:
        if self.signum is not None:
            return signal.Signals(self.signum).name
        return self.reason or "another rank's stop request"

    def install(self) -> None:
        """Install the handlers (nested: the CLI, then the trainer; the outermost `restore` undoes them)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._depth += 1
        if not self._old:
            # blocked while the handlers go in, so a signal between two of them (a Ctrl-C just after SIGTERM's
            # handler is in place, while Python's own SIGINT handler would still raise KeyboardInterrupt here)
            # waits for its handler; a parent that started this process with them blocked (to keep them until a
            # handler is in place) hands them over the same way: a pending one is delivered to the handler
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            self._start_announcer()   # made now, its thread keeps them blocked: they always reach this one
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _start_announcer(self) -> None:
        """Once per process: the pipe and the thread that logs each signal the handler writes into it."""
        if self._wake is not None:
            return
        read, self._wake = os.pipe()
        os.set_blocking(self._wake, False)   # a full pipe drops a line rather than block the handler

        def announce() -> None:
            while data := os.read(read, 64):
                for byte in data:
                    then = ("the final checkpoint is written; cutting the end of the run short" if byte & CUT
                            else "saving a checkpoint at the next step boundary")
                    log.info(f"received {signal.Signals(byte & ~CUT).name}: {then}")
                    with self._logged:
                        self._announced += 1
                        self._logged.notify_all()

        threading.Thread(target=announce, name="trainbox-stop-announce", daemon=True).start()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:  # a second Ctrl-C stops at once
            raise SecondInterrupt
        self.signum = signum
        cut, self._cut = self._cut, False   # the end is cut short once
        if self.announce and self._wake is not None:
            try:
                os.write(self._wake, bytes([signum | (CUT if cut else 0)]))   # one byte, atomic; no lock, no buffer
                self._sent += 1
            except OSError:   # the pipe is full: the stop still happens, unannounced
                pass
        if cut:
            raise StopRequested(self.why())

    @contextmanager
    def cutting_short(self):
        """The end of a run, after its final checkpoint: a stop signal raises StopRequested wherever the main thread
        is (the evaluation, the sample), and one that came before raises it at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        if self.requested:
            raise StopRequested(self.why())
        self._cut = True
        try:
            yield
        finally:
            self._cut = False

    def settle(self, timeout: float = 2.0) -> None:
        """Until the announcing thread has logged every signal the handler passed it (at most `timeout` s): the loop
        calls it before it logs how the run stopped, so that line comes after them."""
        with self._logged:   # the handler never takes this lock: it only writes to the pipe and counts
            self._logged.wait_for(lambda: self._announced >= self._sent, timeout)

    def request(self, reason: str) -> None:
        """A stop without a signal (from any thread): acted on like SIGTERM."""
        if self.reason is None:
            self.reason = reason
            if self.announce:
                log.info(f"{reason}: saving a checkpoint at the next step boundary")

    def ignore(self) -> None:
        """For the process's entry point as it exits: the stop signals ignored from now on. As the interpreter
        shuts down it puts back the default action (which kills) for every signal that has a Python handler, but
        keeps an ignored one ignored, so a stop signal in that last moment would otherwise end the process with
        the signal's status (143, 130) instead of the command's."""
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        self.signum = self.reason = None
        self.handed_over = False
        self.announce = self._cut = False


class Ending:
    """Mixed into train/loop.py's Trainer: how the loop ends, at a stop or at the end of the run. Uses its cfg, dist,
    stop, total, val_data, tasks, run_dir, objective, end_again and cut_short, and its other parts' _phase,
    _saves_published, _evaluate, _evaluate_tasks and _final_sample."""

    def _stopped(self, step: int, end: bool = False) -> dict:
        """A stop at a step boundary, or during the end of the run (`end`), said in one line."""
        self._saves_published(wait=True)
        self._phase("preempted")
        why = f" on {self.stop.why()}" if self.stop.signum or not self.stop.reason else f": {self.stop.why()}"
        self.stop.settle()   # "received SIGTERM: ..." first
        saves = self.cfg.train.checkpoints
        log.info(BEFORE_FIRST_STEP if step == 0 else f"stopped at step {step}{why}" + (
            ", during the end of the run (the final evaluation and sample), which was cut short" if end else "")
            + "; " + ("run `trainbox train` again with the same arguments to continue" if saves else
                      "no checkpoint was written (train.checkpoints=false), so the run cannot be continued"))
        return {"step": step, "total": self.total, "stopped": True, "sample": None, "run_dir": str(self.run_dir)}

    def _end(self, step: int) -> dict:
        """The end of the run, after its final checkpoint: the final evaluation, lm-eval tasks and sample. A stop
        signal here, or one during the final steps, cuts it short (the run is preempted); the same command then does
        the end again from the final checkpoint, as it does after a crash or an error here (setup's `end_again`), and
        its events replace those the end cut short had logged (train/resume.py supersede)."""
        d, last_eval, sample = self.dist, None, None
        self.stop.announce = True   # (a run that does its end again has run no step)
        if self.end_again is not None and d.is_main:
            log.info(f"the checkpoint of step {step} is the run's last, but the run did not finish (status: "
                     f"{self.end_again}); doing the end of the run again from it")
        try:
            if d.any(self.stop.requested):   # every rank cuts the end short, or none
                raise StopRequested(self.stop.why())
            with self.stop.cutting_short():
                last_eval = self._evaluate(step) if self.val_data is not None else None
                if self.tasks is not None and self.tasks.due(step, self.total):
                    self._evaluate_tasks(step)
                sample = self._final_sample()
        except (StopRequested, Exception) as e:   # on several ranks, one that cut its end short fails the others'
            if not isinstance(e, StopRequested) and not (d.enabled and self.stop.requested):   # collectives
                raise
            self.cut_short = d.enabled
            return self._stopped(step, end=True)
        self._saves_published(wait=True)
        self._phase("finished")
        return {"step": step, "total": self.total, "stopped": False, "sample": sample,
                "run_dir": str(self.run_dir), **(last_eval or {}),
                "validation": self.objective.eval_line(last_eval) if last_eval else None}


STOP = StopFlag()


def stop_when_gone(pid: int, who: str, flag: StopFlag = STOP) -> None:
    """Request a stop on `flag` once process `pid` has ended ("{who} (process {pid}) is gone"). A pidfd where Linux
    has one (the wait costs nothing and a reused pid cannot fool it), else a check each second."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        flag.request(f"{who} (process {pid}) is gone")
        return
    except (AttributeError, OSError):   # no pidfd_open here (macOS, Linux before 5.3)
        fd = None

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])   # readable once the process has ended
            os.close(fd)
        else:
            while _alive(pid):
                time.sleep(1.0)
        flag.request(f"{who} (process {pid}) is gone")

    threading.Thread(target=wait, name=f"trainbox-watch-{pid}", daemon=True).start()



def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True
