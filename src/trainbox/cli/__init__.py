"""trainbox command line. `main` is the entry point (`trainbox`, `python -m trainbox`); the dispatch is in cli/app.py,
the parser in cli/parser.py, the verbs in cli/train.py, cli/model.py, cli/configure.py, cli/data.py, cli/runs.py,
cli/ops.py and cli/evaluate.py.

This package is the only place that reads environment variables, prints for humans, or exits. Library code
raises typed errors (trainbox.errors); the CLI turns each into one short message and an exit code.

`trainbox train` keeps a stop signal (SIGTERM, SIGINT, SIGUSR1) from its first moment: `main` installs the
handler before anything else is imported (torch takes seconds), so a signal that lands while the run starts is
acted on at the first point where stopping is safe, never by the default action that kills the process.
"""
from __future__ import annotations

import os
import sys

from trainbox.cli.app import run  # after the handler: the verbs' modules and what they import
from trainbox.train.stop import STOP  # imports nothing heavy: the handler is in place within milliseconds


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    armed = None
    if next((a for a in args if not a.startswith("-")), None) == "train":
        STOP.install()
        armed = STOP
    try:
        code = run(argv)
        if argv is None and armed is not None and armed.handed_over:
            # `train --detach` has handed its run over and passes stop signals on to it: the process ends here,
            # with that handler in place, not in the interpreter's shutdown, where a signal would be lost
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except KeyboardInterrupt:   # a second Ctrl-C while the run was still starting
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        # called in-process (argv given): the caller gets its handlers back. As the process's entry point the
        # command is done: a stop signal from now until the exit is ignored, so one that lands while the
        # interpreter shuts down changes nothing (the interpreter would put back the default action, which kills)
        if armed is not None:
            armed.restore() if argv is not None else armed.ignore()
