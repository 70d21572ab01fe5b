"""The dispatch of the command line: `run` parses (cli/parser.py), calls the verb's function and turns a library
error into one short message and an exit code, with a traceback only when TRAINBOX_DEBUG=1. The message goes to
stderr and, where the command keeps a log file (`trainbox train`'s RUN/train.log, which `trainbox logs` and `trainbox
stop` point to), to the end of that file. The entry point is `trainbox.cli.main`, which arms the stop signals first."""
from __future__ import annotations

import errno
import logging
import os
import select
import shlex
import sys

from trainbox.cli.parser import build_parser
from trainbox.errors import RunBusy, TrainboxError
from trainbox.monitor.console import log

# What to do about a file-system error on a path the user chose (a run directory, --out, a cache folder): one line
# naming the path, instead of an unexpected error. Other errors (a missing file among them) stay unexpected.
_DENIED = "no permission to write there: choose a location you can write, or change its permissions"
PATH_HINTS = {
    errno.ENOTDIR: "a folder on this path is a file: choose another location",
    errno.EEXIST: "a file is where a folder is needed: choose another location, or move the file",
    errno.EISDIR: "this is a folder where a file is needed: give a file's path",
    errno.EACCES: _DENIED,
    errno.EPERM: _DENIED,
    errno.EROFS: "the file system is read-only: choose a location on a writable one",
    errno.ENAMETOOLONG: "the name is longer than the file system allows: choose a shorter one",
}


def _split_overrides(args) -> None:
    """`trainbox train train.max_steps=5` : a first positional with '=' is an override, not a recipe."""
    rec = getattr(args, "recipe", None) if hasattr(args, "recipe") else None
    if rec and "=" in rec:
        args.overrides = [rec, *args.overrides]
        args.recipe = None
    src = getattr(args, "source", None)
    if src and "=" in src:
        args.overrides = [src, *args.overrides]
        args.source = None


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone; if so it now points at /dev/null (no error at exit)."""

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured output)
        return False
    try:
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0)):
            return False
    except (AttributeError, OSError):  # no poll() here: take the broken pipe to be stdout's
        pass
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return True


def _report(message: str, logged: bool = True) -> None:
    """An error's message, on stderr and (`logged`) at the end of the command's log files: the trainbox logger's file
    handlers, train.log; its console handler is left out, stderr has the message already."""
    print(message, file=sys.stderr)
    if not logged:
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    # overrides may also follow an option (`train tiny --detach train.max_steps=5`): argparse leaves those over
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    _split_overrides(args)
    # TRAINBOX_OVERRIDES (set by the container images: monitor.host=0.0.0.0) come before the command line's
    env_overrides = shlex.split(os.environ.get("TRAINBOX_OVERRIDES", ""))
    if env_overrides and hasattr(args, "overrides"):
        args.overrides = [*env_overrides, *args.overrides]
    debug = os.environ.get("TRAINBOX_DEBUG", "") not in ("", "0")
    try:
        try:
            code = args.func(args) or 0
            sys.stdout.flush()  # a closed pipe shows here, not as an error at interpreter exit
            return code
        except BrokenPipeError:
            if not _stdout_closed():
                raise
            return 141  # `trainbox inspect ... | head`: the reader is gone; stop quietly, as SIGPIPE would
    except TrainboxError as e:
        if debug:
            raise
        # a finished run is no failure, and a busy run's train.log is its live holder's
        _report(f"trainbox {args.verb}: {e.message}" + (f"\n  -> {e.hint}" if e.hint else ""),
                logged=e.exit_code != 0 and not isinstance(e, RunBusy))
        return e.exit_code
    except KeyboardInterrupt:
        _report("interrupted")
        return 130
    except Exception as e:  # an unexpected bug: one line, and how to see the traceback
        if debug:
            raise
        if isinstance(e, OSError) and e.filename is not None and e.errno in PATH_HINTS:
            _report(f"trainbox {args.verb}: {e.filename}: {e.strerror}\n  -> {PATH_HINTS[e.errno]}")
            return 1
        _report(f"trainbox {args.verb}: unexpected error: {type(e).__name__}: {e}\n"
                f"  -> run again with TRAINBOX_DEBUG=1 for the traceback")
        return 1

