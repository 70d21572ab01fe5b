"""Room for a checkpoint: a save that does not fit is said plainly, before it writes or after it failed.

A full disk, a disk quota or the file size limit (`ulimit -f`; Python ignores SIGXFSZ, so a write past it fails
with EFBIG) ends a save with one message naming the cause, the checkpoint, the bytes it needs and what to do.
`check_room` refuses a save before anything is written when the bytes of its tensors alone (a lower bound of
its files) exceed the free space or a file exceeds the limit, so no save that would fit is refused and a disk
is not filled for nothing. A save that gets past it and fails is explained by `disk_cause`: by the errno where
one is left, else from the disk, since torch's C++ writer loses it ("unexpected pos 12160 vs 12052") and
DCP hands rank 0 another rank's error pickled without it. Any other failure keeps its own message.
"""
from __future__ import annotations

import errno
import os
import re
import resource
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from trainbox.errors import CheckpointError

NO_ROOM = {errno.ENOSPC: "space", errno.EDQUOT: "quota", errno.EFBIG: "size"}


@dataclass(frozen=True)
class NoRoom:
    """Why a save does not fit: `kind` "space" (disk full), "quota" or "size" (a file over the file size limit);
    `need` the bytes the checkpoint (kind "size": `file`) needs at least, 0 when unknown (`more_than`: more than
    that, what was written before the disk was full); `file` the file that was being written or that hit the
    limit, as named in the checkpoint folder (None: none yet)."""
    kind: str
    need: int
    file: str | None = None
    more_than: bool = False


def payload_bytes(obj) -> int:
    """The bytes of the tensors in `obj` (nested dicts, lists, tuples), each storage once: a lower bound of the
    size of the file it is saved to."""
    sizes: dict[int, int] = {}
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage().data_ptr() if t.nbytes else id(t)
            sizes[key] = max(sizes.get(key, 0), t.nbytes)
    return sum(sizes.values())


def free_bytes(path: Path) -> int | None:
    """The bytes this process can still write on the file system of `path` (root: the reserved blocks too); None
    where the file system reports no size (some FUSE and object-store mounts)."""
    path = Path(path)
    while not path.exists() and path != path.parent:   # a folder not made yet: the file system it would be on
        path = path.parent
    st = os.statvfs(path)
    if st.f_blocks == 0:
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def file_size_limit() -> int | None:
    """The size past which this process may not write a file (ulimit -f); None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def host_available() -> int | None:
    """Bytes of host memory available now (MemAvailable of /proc/meminfo: free, and the page cache the kernel can
    drop); None where unknown (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def no_host_room(per_rank: int, ranks: int, available: int | None) -> CheckpointError | None:
    """The refusal of sharded async saves whose host copies cannot fit, None where they can (or the host does not
    say): every rank of this host keeps a copy of its shards in host memory (`per_rank` bytes each, `ranks` ranks),
    which would otherwise take the host's memory as it is paged in, and the kernel's out-of-memory killer would end
    a rank without a word."""
    if available is None or per_rank * ranks <= available:
        return None
    return CheckpointError(
        f"sharded checkpoints keep a host copy of each rank's shards to write in the background: "
        f"{_size(per_rank)} per rank, {_size(per_rank * ranks)} for this host's {ranks} rank(s), and the host has "
        f"{_size(available)} of memory available",
        hint="free host memory, spread the run over more hosts (smaller shards per rank), or train without "
             "checkpoints (train.checkpoints=false)")


def check_room(ckpt_root: Path, final: Path, need: dict[str, int], more: int = 0) -> None:
    """Before a save writes anything, refuse it when it surely cannot fit: a file over the file size limit, or the
    checkpoint over the free space. `need` (file -> bytes) and `more` (bytes spread over other files: shards) are
    lower bounds, so no save that fits is refused; a save they let through that does not fit fails while writing
    and `disk_cause` finds out why."""
    limit = file_size_limit()
    big = next((f for f, n in need.items() if limit is not None and n > limit), None)
    if big is not None:
        raise no_room(NoRoom("size", need[big], big), final, ckpt_root)
    total, free = sum(need.values()) + more, free_bytes(ckpt_root)
    if free is not None and total > free:
        raise no_room(NoRoom("space", total), final, ckpt_root)


def _errors(e: BaseException):
    """`e`, the exceptions it was raised from, and those of each rank a DCP CheckpointException carries."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__, *(f[0] for f in (getattr(x, "failures", None) or {}).values())]


def disk_cause(e: BaseException, tmp: Path, ckpt_root: Path, need: int, writing: str | None = None) -> NoRoom | None:
    """Why writing the save staged in `tmp` failed, when a full disk, a disk quota or the file size limit explains
    it; None for any other failure (permission denied, ...), which keeps its own message. Read before `tmp` is
    removed. `need`: the bytes of the whole save, at least; `writing`: the file being written, where known.

    An errno decides (Python's OSError; safetensors says "(os error 28)"). Without one (torch's writer): a staged
    file that reached the file size limit, or less free space than the save still needed."""
    found = [x.errno for x in _errors(e) if isinstance(getattr(x, "errno", None), int)]
    found += [int(m) for x in _errors(e) for m in re.findall(r"\(os error (\d+)\)", str(x))]
    staged = {str(p.relative_to(tmp)): p.stat().st_size for p in tmp.rglob("*") if p.is_file()} \
        if tmp.is_dir() else {}
    written = sum(staged.values())
    kind = next((NO_ROOM[n] for n in found if n in NO_ROOM), None)
    limit = file_size_limit()
    at_limit = next((f for f, n in staged.items() if limit is not None and n >= limit), None)
    if kind == "size" or (kind is None and not found and at_limit is not None):
        return NoRoom("size", 0, at_limit or writing)
    free = free_bytes(ckpt_root)
    if kind is None and not found and free is not None and free < max(need - written, 1 << 20):
        kind = "space"
    return NoRoom(kind, max(need, written), writing, more_than=written >= need) if kind else None


def save_error(e: BaseException, cause: NoRoom | None, final: Path, ckpt_root: Path) -> CheckpointError:
    """A failed save's error: `no_room`'s for a disk cause, else the failure's own first line."""
    for x in _errors(e):   # a writer the traceback keeps alive keeps its removed file's blocks: let it close
        traceback.clear_frames(x.__traceback__)
    if cause is not None:
        return no_room(cause, final, ckpt_root)
    inner = next((x for x in _errors(e) if not getattr(x, "failures", None)), e)   # a DCP rank's own error
    why = getattr(inner, "strerror", None) or (str(inner).strip().splitlines() or [type(inner).__name__])[0][:300]
    return CheckpointError(f"saving checkpoint {final} failed: {why}; older checkpoints are kept",
                           hint=f"check that {ckpt_root} is writable, then resume with the same command")


def no_room(cause: NoRoom, final: Path, ckpt_root: Path) -> CheckpointError:
    """The error of a save that does not fit: the cause, the bytes needed and what to free (the free space as it is
    now, a failed save's files removed)."""
    head = f"saving checkpoint {final} failed" + (f" writing {cause.file}" if cause.file and cause.kind != "size"
                                                  else "")
    kept = "older checkpoints are kept"
    again = "then resume with the same command"
    if cause.kind == "size":
        limit = file_size_limit()
        name = cause.file or "a file"
        if limit is None:   # EFBIG without a ulimit: the file system's own largest file
            return CheckpointError(f"{head}: {name} is too large for the file system of {ckpt_root}; {kept}",
                                   hint=f"put the run on a file system that holds larger files (run.dir=...), {again}")
        needs = (f"at least {_size(cause.need)}, and this process may write files of at most {_size(limit)}"
                 if cause.need > limit else f"more than this process's file size limit of {_size(limit)}")
        return CheckpointError(f"{head}: file too large: {name} needs {needs} (ulimit -f); {kept}",
                               hint=f"raise the limit (ulimit -f unlimited; in a container, its fsize ulimit), {again}")
    needs = (f"the checkpoint needs {'more than' if cause.more_than else 'at least'} {_size(cause.need)}"
             if cause.need else "the checkpoint does not fit")
    if cause.kind == "quota":
        return CheckpointError(f"{head}: disk quota exceeded: {needs} in {ckpt_root}; {kept}",
                               hint=f"free space within your quota (quota -s) or have it raised, {again}")
    free = free_bytes(ckpt_root)
    has = f" and {ckpt_root} has {_size(free)} free" if free is not None else f" in {ckpt_root}"
    short = f"at least {_size(cause.need - free)}" if free is not None and cause.need > free else "space"
    return CheckpointError(f"{head}: no space left on device: {needs}{has}; {kept}",
                           hint=f"free {short} on that disk (df -h {ckpt_root}; delete old runs or lower "
                                f"train.keep_last), {again}")


def _size(n: int) -> str:
    """Bytes as df -h counts them (powers of 1024), with the exact count."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"
