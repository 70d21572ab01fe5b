"""Writing run files safely: atomic replacement and appends that never follow a symbolic link.

A run directory may come from elsewhere (a copied run, a shared folder); a link planted under a name trainbox
writes must not redirect the write outside the directory. Whole-file writes go to a fresh temporary name
(O_EXCL | O_NOFOLLOW), are fsynced and renamed over the target, which replaces a link instead of following
it; appends open with O_NOFOLLOW and fail on a link.
"""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, fsync: bool = True) -> None:
    """Replace `path` with `text` in one rename; readers see the old or the new file, never a part."""
    atomic_write_bytes(path, text.encode("utf-8"), fsync)


def atomic_write_bytes(path: Path, data: bytes, fsync: bool = True) -> None:
    """Replace `path` with `data` in one rename; readers see the old or the new file, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def open_append(path: Path, buffering: int = -1):
    """Open a text file for appending; refuses (OSError ELOOP) when `path` is a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "a", buffering=buffering, encoding="utf-8")


def default_modes(folder: Path) -> None:
    """Give every file under `folder` the mode a new file gets under the process umask (0644 under 022):
    safetensors writes 0600, which a model folder meant for others must not keep."""
    umask = os.umask(0)
    os.umask(umask)
    for p in Path(folder).rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, 0o666 & ~umask)
