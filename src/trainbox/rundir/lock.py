"""One process per run directory: RunLock, an flock on RUN/.lock that rank 0 holds for the run's life, and the
run files that must not be symbolic links."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from trainbox.errors import ConfigError, RunBusy
from trainbox.rundir.runs import pid_alive, read_json, recorded_command

LOCK_NAME = ".lock"
RUN_FILES = (LOCK_NAME, "checkpoints", "superseded", "config.yaml", "env.json", "train.log", "metrics.jsonl",
             "status.json", "samples.txt", "loss.png", "tensorboard", "console.log", "launcher.pid")
REMOTE_STALE_SECONDS = 600.0  # lock files without kernel locks: another host's holder is gone after this quiet
_held: dict[str, "RunLock"] = {}


class RunLock:
    """Exclusive use of a run directory by one process (rank 0 of a run), as an flock on RUN/.lock held while
    the run lives. The kernel drops the lock when the process ends, however it ends, so a lock file left by a
    dead process (this host or another, on file systems with shared locks such as NFS) is simply taken over.
    The file names its holder (pid, host, start time, command) for the message that refuses a second run.
    Where the file system has no locks, the holder is judged alive by its pid (same host) or by the run's
    status.json heartbeat (another host, within REMOTE_STALE_SECONDS)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None
        self.users = 0
        self.previous: dict | None = None  # the holder named in the file when it was taken (a gone process)

    def _holder(self, fd: int) -> dict | None:
        try:
            return json.loads(os.pread(fd, 65536, 0) or b"null")
        except (OSError, ValueError):
            return None

    def _refuse(self, holder: dict | None) -> None:
        who = (f"process {holder.get('pid')} on {holder.get('host')} (started "
               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started_at', 0)))})"
               if holder else "another process")
        raise RunBusy(f"run directory {self.run_dir} is in use by {who}",
                      hint=f"wait for it, or stop it: trainbox stop {self.run_dir} (on {holder.get('host')}), or "
                           "choose another run.name" if holder else "wait for it, or choose another run.name")

    def _alive_without_flock(self, holder: dict | None) -> bool:
        if not holder or holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            return False
        if holder.get("host") == socket.gethostname():
            return pid_alive(int(holder["pid"]), holder.get("started_at"))
        beat = (read_json(self.run_dir / "status.json") or {}).get("heartbeat") or 0
        return time.time() - beat < REMOTE_STALE_SECONDS

    def acquire(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.run_dir.is_symlink():
            raise ConfigError(f"run directory {self.run_dir} is a symbolic link: a run writes only into a real "
                              "folder under run.dir", hint="remove the link or choose another run.name")
        links = [n for n in RUN_FILES if (self.run_dir / n).is_symlink()]
        if links:
            raise ConfigError(f"{self.run_dir / links[0]} is a symbolic link: a run writes only into its own "
                              "directory", hint=f"remove the link (rm {self.run_dir / links[0]}) or choose another "
                                                "run.name")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            self._refuse(holder)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            if self._alive_without_flock(self._holder(fd)):
                holder = self._holder(fd)
                os.close(fd)
                self._refuse(holder)
        self.previous = self._holder(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
              "command": recorded_command(sys.argv)}   # monitor.token masked, as in env.json
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)   # a clean end leaves no holder to report
            os.close(self.fd)
            self.fd = None


def lock_run(run_dir: Path) -> RunLock:
    """Hold `run_dir` for this process (raises RunBusy when a live process holds it); re-entrant, so the CLI
    can take it before logging starts and the trainer again; `unlock_run` once per `lock_run`."""
    key = str(Path(run_dir).absolute())
    lock = _held.get(key)
    if lock is None:
        lock = _held[key] = RunLock(Path(run_dir))
        try:
            lock.acquire()
        except BaseException:
            del _held[key]
            raise
    lock.users += 1
    return lock


def unlock_run(run_dir: Path) -> None:
    key = str(Path(run_dir).absolute())
    lock = _held.get(key)
    if lock is not None:
        lock.users -= 1
        if lock.users <= 0:
            lock.release()
            del _held[key]
