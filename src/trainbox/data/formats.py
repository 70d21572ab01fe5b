"""Token file formats: readers (memory-mapped) and atomic writers.

shard     llm.c / modded-nanogpt: 256 x int32 header (magic 20240520, version 1, token count), uint16 tokens
flat      nanoGPT: headerless uint16 .bin (read only)

Readers never write into an input file (read-only memmaps) and every corruption is a DataError that
names the file and the byte offset.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from trainbox.errors import DataError

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(path: str | Path, tokens: np.ndarray) -> None:
    """Write a shard atomically: a temporary name in the same folder, fsync, rename."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"{path}: token ids must fit uint16 for the shard format (max id {tokens.max()})",
                        hint="use --format megatron for vocabularies of 65,536 or more")
    header = np.zeros(SHARD_HEADER_INTS, dtype=np.int32)
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: str | Path) -> np.ndarray:
    """Memory-map a shard's tokens (uint16, read-only) after checking its header and size."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        raise DataError(f"token file {path} does not exist", hint="check data.path, or run `trainbox prepare`") from None
    if size < SHARD_HEADER_BYTES:
        raise DataError(f"{path}: truncated shard header ({size} bytes, expected at least {SHARD_HEADER_BYTES})")
    header = np.fromfile(path, dtype=np.int32, count=SHARD_HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: bad magic {header[0]} at byte offset 0 (expected {SHARD_MAGIC}); not a shard file")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} at byte offset 4 (expected {SHARD_VERSION})")
    n = int(header[2])
    expected = SHARD_HEADER_BYTES + 2 * n
    if size != expected:
        raise DataError(f"{path}: header says {n} tokens ({expected} bytes) but the file has {size} bytes; "
                        f"{'truncated' if size < expected else 'trailing bytes'} from byte offset {min(size, expected)}",
                        hint="re-create it with `trainbox prepare ... --overwrite` or re-download it")
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=SHARD_HEADER_BYTES, shape=(n,))


def read_flat(path: str | Path) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {path} does not exist")
    size = path.stat().st_size
    if size % 2:
        raise DataError(f"{path}: odd size {size} for a uint16 token file; truncated at byte offset {size - 1}")
    return np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, dtype=np.uint16)


def is_shard(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and int(np.frombuffer(head, dtype=np.int32)[0]) == SHARD_MAGIC
