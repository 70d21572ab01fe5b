"""Token file formats: readers (memory-mapped) and atomic writers.

shard     llm.c / modded-nanogpt: 256 x int32 header (magic 20240520, version 1, token count), uint16 tokens.
          A loss mask rides beside a shard as `NAME.mask`: the same header with magic 20240521, then one
          uint8 (0/1) per token.
megatron  Megatron-LM MMIDIDX: PREFIX.idx (9-byte magic "MMIDIDX\\0\\0", uint64 version 1, uint8 dtype code,
          uint64 sequence count, uint64 document count, int32 lengths, int64 byte pointers, int64 document
          indices) + PREFIX.bin (the tokens). A loss mask is a second MMIDIDX dataset PREFIX_mask (uint8).
flat      nanoGPT: headerless uint16 .bin (read only)

Which reader opens a path (`detect_format`, data.format):
  shard     only shard files: the magic, version and token count of the header must fit the file's size.
  megatron  only PREFIX.idx + PREFIX.bin pairs (the path may be PREFIX, PREFIX.bin or PREFIX.idx).
  flat      only headerless uint16 files: a file that starts with a shard, mask or MMIDIDX magic, or a .bin
            with a PREFIX.idx beside it, is refused.
  auto      a Megatron pair when PREFIX.idx and PREFIX.bin exist (or the path ends in .idx); else a shard when
            the file starts with the shard magic; else a DataError when the first bytes are a mask or MMIDIDX
            magic, or look like a damaged shard header: a magic within 4 bits of the shard or mask magic, or
            version 1 with a token count that fits the file's size, or the 253 reserved header ints all zero
            together with either of those fields; else flat. A flat file is thus read only when no header
            of a known format fits it (a shard whose first 12 bytes were zeroed reads as flat: set
            data.format=shard to refuse it).
A 0-byte file is a DataError in every format.

Prepared output sets: `trainbox prepare` writes OUT.manifest.json (state "committing", listing the new files
and the ones they replace) before it renames any output into place, and rewrites it with state "complete"
(each file's name, size and token count) once every output is in place. `check_output_sets` refuses a file
of an unfinished set, a listed file that is missing or has another size, and an unlisted file among a
complete set's outputs. Files no manifest speaks for (downloaded shards, Megatron's own output) are read
as they are.

Readers never write into an input file (read-only memmaps) and every corruption is a DataError that
names the file and the byte offset.
"""
from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainbox.errors import DataError
from trainbox.files import fsync_dir  # noqa: F401 - the writers' and prepare's

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
MASK_MAGIC = 20240521

MMIDIDX_MAGIC = b"MMIDIDX\x00\x00"
MMIDIDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py)
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                   7: np.float32, 8: np.uint16}
MEGATRON_CODES = {np.dtype(v): k for k, v in MEGATRON_DTYPES.items()}

FORMATS = ("auto", "shard", "megatron", "flat")
REBUILD = "re-create it with `trainbox prepare ... --overwrite`, or download it again"


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron-LM picks: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


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


def file_size(path: str | Path, what: str = "token file") -> int:
    """Size in bytes; DataError when the file is missing or empty (0 bytes holds no header and no token)."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        raise DataError(f"{what} {path} does not exist", hint="check data.path, or run `trainbox prepare`") from None
    if size == 0:
        raise DataError(f"{path}: empty file (0 bytes); the file ends at byte offset 0, before any header or token",
                        hint=f"{REBUILD}; remove it if it does not belong to the dataset")
    return size


def read_shard(path: str | Path, magic: int = SHARD_MAGIC, dtype=np.uint16) -> np.ndarray:
    """Memory-map a shard's tokens (uint16, read-only) after checking its header and size.

    With magic=MASK_MAGIC, dtype=uint8 it reads a `.mask` file.
    """
    path = Path(path)
    kind = "shard" if magic == SHARD_MAGIC else "mask"
    size = file_size(path, f"{kind} file")
    header = np.fromfile(path, dtype="<i4", count=min(size // 4, SHARD_HEADER_INTS))
    if len(header) and header[0] != magic:
        raise DataError(f"{path}: bad magic {header[0]} at byte offset 0 (expected {magic}); not a {kind} file",
                        hint=f"{REBUILD}; a headerless nanoGPT token file is read with data.format=flat"
                        if kind == "shard" else REBUILD)
    if size < SHARD_HEADER_BYTES:
        raise DataError(f"{path}: truncated shard header ({size} bytes, expected at least {SHARD_HEADER_BYTES}); "
                        f"the file ends at byte offset {size}", hint=REBUILD)
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} at byte offset 4 (expected {SHARD_VERSION})",
                        hint=REBUILD)
    n = int(header[2])
    if n < 0:
        raise DataError(f"{path}: negative token count {n} at byte offset 8", hint=REBUILD)
    itemsize = np.dtype(dtype).itemsize
    expected = SHARD_HEADER_BYTES + itemsize * n
    if size != expected:
        raise DataError(f"{path}: header says {n} tokens ({expected} bytes) but the file has {size} bytes; "
                        f"{'truncated' if size < expected else 'trailing bytes'} "
                        f"from byte offset {min(size, expected)}",
                        hint=REBUILD)
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=SHARD_HEADER_BYTES, shape=(n,))


def mask_path(shard: str | Path) -> Path:
    """Where the loss mask of a shard lives (`x_train_000001.bin` -> `x_train_000001.mask`)."""
    return Path(shard).with_suffix(".mask")


def read_shard_mask(path: str | Path) -> np.ndarray:
    return read_shard(path, magic=MASK_MAGIC, dtype=np.uint8)


class ShardWriter:
    """Streams one shard (or mask) file under a temporary name; `close()` patches the count into the header.

    The caller renames the temporary file into place once every output is complete (see prepare.py), so
    an interrupted run never leaves a half-written file under a final name.
    """

    def __init__(self, final: Path, tmp: Path, magic: int = SHARD_MAGIC, dtype=np.uint16):
        self.final, self.tmp, self.magic, self.dtype = Path(final), Path(tmp), magic, np.dtype(dtype)
        self.count = 0
        self.f = open(self.tmp, "wb")
        self.f.write(np.zeros(SHARD_HEADER_INTS, dtype=np.int32).tobytes())

    def write(self, arr: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self.count += len(arr)

    def close(self) -> None:
        header = np.zeros(SHARD_HEADER_INTS, dtype=np.int32)
        header[:3] = (self.magic, SHARD_VERSION, self.count)
        self.f.seek(0)
        self.f.write(header.tobytes())
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


# ----------------------------------------------------------------------------- megatron


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


def read_flat(path: str | Path) -> np.ndarray:
    """nanoGPT's headerless uint16 token file, memory-mapped read-only."""
    path = Path(path)
    size = file_size(path)
    if size % 2:
        raise DataError(f"{path}: odd size {size} for a uint16 token file; truncated at byte offset {size - 1}",
                        hint=REBUILD)
    return np.memmap(path, dtype=np.uint16, mode="r")


def is_shard(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and int(np.frombuffer(head, dtype="<i4")[0]) == SHARD_MAGIC


def _damaged_shard_header(head: bytes, size: int) -> str | None:
    """Why the first bytes of a file look like a shard (or mask) header with a wrong magic; None if they don't."""
    ints = [int(x) for x in np.frombuffer(head[:len(head) // 4 * 4], dtype="<i4")]
    if len(ints) < 3:
        return None
    if min(bin((ints[0] ^ m) & 0xFFFFFFFF).count("1") for m in (SHARD_MAGIC, MASK_MAGIC)) <= 4:
        return "it is a few bits from the shard magic"
    version = ints[1] == SHARD_VERSION
    count = ints[2] >= 0 and size in (SHARD_HEADER_BYTES + 2 * ints[2], SHARD_HEADER_BYTES + ints[2])
    if version and count:
        return f"version {SHARD_VERSION} and the token count {ints[2]} at byte offsets 4 and 8 fit the file's size"
    if (version or count) and len(ints) == SHARD_HEADER_INTS and not any(ints[3:]):
        return (f"{'version 1' if version else f'the token count {ints[2]}'} and the zeroed rest of a "
                f"{SHARD_HEADER_BYTES}-byte header fit a shard")
    return None


def detect_format(path: str | Path, fmt: str = "auto") -> str:
    """'shard', 'megatron' or 'flat': the reader that opens `path` under data.format=fmt (module docstring)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise DataError(f"unknown token file format {fmt!r}", hint=f"data.format is one of {', '.join(FORMATS)}")
    if fmt == "megatron" or (fmt == "auto" and (is_megatron_prefix(path) or path.suffix == ".idx")):
        return "megatron"
    size = file_size(path)
    if fmt == "shard":
        return "shard"
    with open(path, "rb") as f:
        head = f.read(SHARD_HEADER_BYTES)
    magic = int(np.frombuffer(head[:4], dtype="<i4")[0]) if len(head) >= 4 else None
    known = {SHARD_MAGIC: "shard", MASK_MAGIC: "loss-mask"}.get(magic)
    known = known or ("MMIDIDX" if head[:9] == MMIDIDX_MAGIC else None)
    if fmt == "flat":
        if known:
            raise DataError(f"{path}: data.format=flat, but the file starts with the {known} magic at byte offset 0 "
                            f"(a flat token file has no header)",
                            hint=f"set data.format={'megatron' if known == 'MMIDIDX' else 'shard'} (or auto)")
        idx = path.with_suffix(".idx")
        if path.suffix == ".bin" and idx.is_file():
            raise DataError(f"{path}: data.format=flat, but {idx} beside it makes this the tokens of a Megatron "
                            f"dataset", hint=f"set data.format=megatron (or auto) and data.path={path.with_suffix('')}")
        return "flat"
    if known == "shard":
        return "shard"
    if known == "loss-mask":
        raise DataError(f"{path}: a loss mask (magic {MASK_MAGIC} at byte offset 0), not a token file",
                        hint=f"point data.path at its tokens, {path.with_suffix('.bin')}")
    if known == "MMIDIDX":
        raise DataError(f"{path}: a Megatron index (magic {MMIDIDX_MAGIC!r} at byte offset 0), not a token file",
                        hint="name the dataset by its prefix (PREFIX.idx and PREFIX.bin side by side)")
    why = _damaged_shard_header(head, size)
    if why:
        raise DataError(f"{path}: bad magic {magic} at byte offset 0 (expected {SHARD_MAGIC}), but {why}: a damaged "
                        f"shard header, so the file is not read as headerless tokens (data.format=auto)",
                        hint=f"{REBUILD}; if it really is a headerless nanoGPT token file, set data.format=flat")
    return "flat"


def open_tokens(path: str | Path, fmt: str = "auto") -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens, loss mask or None) of a shard, a Megatron prefix or a flat uint16 file, memory-mapped."""
    kind = detect_format(path, fmt)
    if kind == "megatron":
        data = read_megatron(path)
        mask_prefix = f"{data.prefix}_mask"
        mask = read_megatron(mask_prefix).tokens if is_megatron_prefix(mask_prefix) else None
        where, tokens = f"{mask_prefix}.bin", data.tokens
    elif kind == "shard":
        tokens = read_shard(path)
        mp = mask_path(path)
        mask = read_shard_mask(mp) if mp.is_file() else None
        where = str(mp)
    else:
        return read_flat(path), None
    if mask is not None and len(mask) != len(tokens):
        raise DataError(f"{where}: loss mask has {len(mask)} entries but {path} has {len(tokens)} tokens",
                        hint="re-create both with `trainbox prepare ... --overwrite`")
    return tokens, mask


def token_file(path: str | Path) -> Path:
    """The file holding the tokens of `path` (PREFIX.bin for a Megatron prefix), for messages."""
    p = Path(path)
    return Path(f"{str(p).removesuffix('.idx').removesuffix('.bin')}.bin") if is_megatron_prefix(p) else p
