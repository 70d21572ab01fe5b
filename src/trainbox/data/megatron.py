"""Megatron-LM's MMIDIDX token datasets (data.format=megatron): PREFIX.idx + PREFIX.bin, read memory-mapped and
written atomically, byte for byte as Megatron-LM's indexed_dataset.py lays them out (the layout: data/formats.py).
"""
from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainbox.errors import DataError

MMIDIDX_MAGIC = b"MMIDIDX\x00\x00"
MMIDIDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py)
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                   7: np.float32, 8: np.uint16}
MEGATRON_CODES = {np.dtype(v): k for k, v in MEGATRON_DTYPES.items()}


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron-LM picks: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class MegatronWriter:
    """Streams a Megatron MMIDIDX dataset: tokens to PREFIX.bin as they come, PREFIX.idx at `close()`.

    Each document is one sequence (no sentence splitting), as in Megatron-LM's preprocess_data.py.
    Both files are written under temporary names; the caller renames them (`outputs()`).
    """

    def __init__(self, prefix: str | Path, dtype, tmp_suffix: str):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        if self.dtype not in MEGATRON_CODES:
            raise DataError(f"dtype {self.dtype} has no Megatron code")
        self.bin_tmp = Path(f"{self.prefix}.bin{tmp_suffix}")
        self.idx_tmp = Path(f"{self.prefix}.idx{tmp_suffix}")
        self.lengths = array("q")  # compact: 8 bytes a document, not a Python int
        self.current = self.tokens = 0
        self.f = open(self.bin_tmp, "wb")

    def extend(self, tokens: np.ndarray) -> None:
        """Append tokens to the current document."""
        self.f.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.current += len(tokens)
        self.tokens += len(tokens)

    def end_document(self) -> None:
        if self.current >= 2**31:
            raise DataError(f"{self.prefix}: a document of {self.current} tokens exceeds Megatron's int32 lengths")
        self.lengths.append(self.current)
        self.current = 0

    def add_document(self, tokens: np.ndarray) -> None:
        self.extend(tokens)
        self.end_document()

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        write_megatron_index(self.idx_tmp, self.dtype, np.asarray(self.lengths, dtype=np.int32),
                             np.arange(len(self.lengths) + 1, dtype=np.int64))

    def outputs(self) -> list[tuple[Path, Path]]:
        return [(self.bin_tmp, Path(f"{self.prefix}.bin")), (self.idx_tmp, Path(f"{self.prefix}.idx"))]


def write_megatron_index(path: Path, dtype, lengths: np.ndarray, doc_indices: np.ndarray) -> None:
    """The .idx bytes exactly as Megatron-LM's _IndexWriter lays them out (little-endian)."""
    dtype = np.dtype(dtype)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MMIDIDX_MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_indices)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_indices.astype("<i8").tobytes())
        f.flush()
        os.fsync(f.fileno())


@dataclass
class MegatronData:
    """A memory-mapped Megatron dataset: `tokens` is the whole .bin; documents from the index."""

    prefix: Path
    tokens: np.ndarray
    lengths: np.ndarray
    pointers: np.ndarray
    doc_indices: np.ndarray

    @property
    def num_documents(self) -> int:
        return max(0, len(self.doc_indices) - 1)


def _idx_error(idx: Path, msg: str) -> DataError:
    return DataError(f"{idx}: {msg}", hint="re-create it with `trainbox prepare ... --format megatron --overwrite`")


def read_megatron(prefix: str | Path) -> MegatronData:
    """Open PREFIX.idx / PREFIX.bin read-only, checking magic, version, dtype and every size."""
    prefix = Path(str(prefix).removesuffix(".idx").removesuffix(".bin"))
    idx, binf = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for p in (idx, binf):
        if not p.is_file():
            raise DataError(f"Megatron file {p} does not exist", hint="pass the prefix without .bin/.idx")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(MMIDIDX_HEADER_BYTES)
    if len(head) < MMIDIDX_HEADER_BYTES:
        raise _idx_error(idx, f"truncated header: the file ends at byte offset {len(head)} "
                              f"(the header is {MMIDIDX_HEADER_BYTES} bytes)")
    if head[:9] != MMIDIDX_MAGIC:
        raise _idx_error(idx, f"bad magic {head[:9]!r} at byte offset 0 (expected {MMIDIDX_MAGIC!r})")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise _idx_error(idx, f"unsupported version {version} at byte offset 9 (expected 1)")
    if code not in MEGATRON_DTYPES:
        raise _idx_error(idx, f"unknown dtype code {code} at byte offset 17")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    expected = MMIDIDX_HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if size != expected:
        raise _idx_error(idx, f"{n_seq} sequences and {n_doc} document indices need {expected} bytes but the "
                              f"file has {size}; {'truncated' if size < expected else 'trailing bytes'} "
                              f"from byte offset {min(size, expected)}")
    off = MMIDIDX_HEADER_BYTES
    lengths = np.fromfile(idx, dtype="<i4", count=n_seq, offset=off)
    pointers = np.fromfile(idx, dtype="<i8", count=n_seq, offset=off + 4 * n_seq)
    doc_indices = np.fromfile(idx, dtype="<i8", count=n_doc, offset=off + 12 * n_seq)
    neg = np.flatnonzero(lengths < 0)
    if len(neg):
        raise _idx_error(idx, f"sequence length {neg[0]} at byte offset {off + 4 * int(neg[0])} is {lengths[neg[0]]}")
    ok = (doc_indices >= 0) & (doc_indices <= n_seq)  # Megatron's document_indices: 0, ..., sequence count
    ok[1:] &= np.diff(doc_indices) >= 0
    ok[:1] &= doc_indices[:1] == 0
    bad = np.flatnonzero(~ok)
    if len(bad) or n_doc == 0:
        i = int(bad[0]) if len(bad) else 0
        raise _idx_error(idx, f"document index {i} at byte offset {off + 12 * n_seq + 8 * i} is "
                              f"{doc_indices[i] if n_doc else 'missing'}; document indices run from 0 up to the "
                              f"sequence count {n_seq}, never decreasing")
    total = int(lengths.astype(np.int64).sum())
    bsize = binf.stat().st_size
    if bsize != total * dtype.itemsize:
        raise DataError(f"{binf}: the index {idx} describes {total} tokens ({total * dtype.itemsize} bytes) but the "
                        f".bin has {bsize} bytes; .idx/.bin size mismatch from byte offset "
                        f"{min(bsize, total * dtype.itemsize)}", hint="re-create both files together")
    want = np.zeros(n_seq, dtype=np.int64)
    if n_seq > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=want[1:])
    bad = np.flatnonzero(pointers != want)
    if len(bad):
        raise _idx_error(idx, f"sequence pointer {bad[0]} at byte offset {off + 4 * n_seq + 8 * int(bad[0])} is "
                              f"{pointers[bad[0]]}, expected {want[bad[0]]}")
    tokens = np.memmap(binf, dtype=dtype, mode="r") if bsize else np.zeros(0, dtype=dtype)
    return MegatronData(prefix, tokens, lengths, pointers, doc_indices)


def is_megatron_prefix(path: str | Path) -> bool:
    p = str(path).removesuffix(".idx").removesuffix(".bin")
    return os.path.isfile(p + ".idx") and os.path.isfile(p + ".bin")
