"""A checkpoint's manifest: COMPLETE, written last, holds the step, the layout (single or sharded) and each
file's size and sha256; `verify` checks a folder against it before anything is loaded."""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trainbox.errors import CheckpointError

STEP_RE = re.compile(r"^step_(\d{8,})$")
FILES = ("model.safetensors", "optimizer.pt", "trainer.json", "rng.pt")
SHARDED_DIR = "state"   # torch.distributed.checkpoint folder of a sharded checkpoint: weights and optimizer state
SHARDED_FILES = (f"{SHARDED_DIR}/.metadata", "trainer.json", "rng.pt")
NO_MARKER = "no COMPLETE marker: its save was interrupted or the marker was deleted"


def step_of(ckpt: Path) -> int:
    return int(STEP_RE.match(ckpt.name).group(1))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def files_of(ckpt: Path) -> list[str]:
    """Every file of a checkpoint folder but COMPLETE, as paths relative to it (sharded: `state/...`)."""
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "COMPLETE")


def is_sharded(ckpt: Path) -> bool:
    """A checkpoint written by torch.distributed.checkpoint (train.parallel=fsdp): `state/` instead of
    model.safetensors + optimizer.pt."""
    return (ckpt / SHARDED_DIR / ".metadata").is_file()


def write_manifest(ckpt: Path, step: int) -> None:
    """Write COMPLETE: the step and each file's size and sha256, as the files are now (fsynced)."""
    names = files_of(ckpt)
    with ThreadPoolExecutor(min(8, len(names))) as pool:   # hashlib releases the GIL: the files hash side by side
        digests = dict(zip(names, pool.map(lambda f: sha256(ckpt / f), names)))
    files = {f: {"bytes": (ckpt / f).stat().st_size, "sha256": digests[f]} for f in names}
    layout = "sharded" if is_sharded(ckpt) else "single"
    with open(ckpt / "COMPLETE", "w") as out:
        out.write(json.dumps({"step": step, "layout": layout, "files": files}, indent=1) + "\n")
        out.flush()
        os.fsync(out.fileno())


def verify(ckpt: Path) -> None:
    """Raise CheckpointError naming the first file of `ckpt` that is missing, of the wrong size, or whose sha256
    differs from what COMPLETE recorded at save time (and a trainer.json that does not parse)."""
    if not (ckpt / "COMPLETE").exists():
        raise CheckpointError(f"{ckpt} has {NO_MARKER}")
    try:
        manifest = json.loads((ckpt / "COMPLETE").read_text())
        files, step = manifest["files"], int(manifest["step"])
        required = SHARDED_FILES if manifest.get("layout") == "sharded" else FILES
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{ckpt / 'COMPLETE'} is missing or not a checkpoint manifest (JSON with each "
                              f"file's size and sha256): the checkpoint cannot be verified") from None
    for name in required:
        if name not in files:
            raise CheckpointError(f"{ckpt / 'COMPLETE'} lists no {name}: the checkpoint cannot be verified")
    for name, want in files.items():
        path = ckpt / name
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointError(f"{path} is missing") from None
        if size != want["bytes"]:
            raise CheckpointError(f"{path} has {size:,} bytes, {want['bytes']:,} when it was saved "
                                  f"({'truncated' if size < want['bytes'] else 'grown'})")
        if sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path} differs from what was saved (sha256 mismatch): the file is damaged")
    try:
        saved = json.loads((ckpt / "trainer.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt / 'trainer.json'} is unreadable: {e}") from None
    if saved != step or (STEP_RE.match(ckpt.name) and step_of(ckpt) != step):
        raise CheckpointError(f"{ckpt}: trainer.json says step {saved}, COMPLETE step {step}: not one checkpoint")
