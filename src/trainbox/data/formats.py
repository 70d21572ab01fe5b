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
            data.format=shard to refuse it), and a file whose first bytes are printable UTF-8 text is refused: no
            token file reads so (`reads_as_text`).
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
from pathlib import Path

import numpy as np

from trainbox.data.megatron import MMIDIDX_MAGIC, is_megatron_prefix, read_megatron
from trainbox.errors import DataError
from trainbox.files import fsync_dir  # noqa: F401 - the writers' and prepare's

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
MASK_MAGIC = 20240521

FORMATS = ("auto", "shard", "megatron", "flat")
REBUILD = "re-create it with `trainbox prepare ... --overwrite`, or download it again"


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
    if reads_as_text(head):
        raise DataError(f"{path}: its first {len(head):,} bytes are text (printable UTF-8), not headerless uint16 "
                        f"tokens, so the file is not read as a token file (data.format=auto)",
                        hint="text is tokenized when its file name ends in .txt, .md or .text (JSON lines: .jsonl), "
                             "or by `trainbox prepare FILE --out DATA`; if it really is a headerless nanoGPT token "
                             "file, set data.format=flat")
    return "flat"


def reads_as_text(head: bytes) -> bool:
    """Whether a file's first bytes are UTF-8 text of printable characters and white space. No token file's are:
    the ids below 8,192, common in every tokenizer's output, put a control byte in each pair they occupy."""
    for cut in range(min(4, len(head))):   # the head may end inside a multi-byte character
        try:
            text = head[:len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return all(c.isprintable() or c in "\t\n\r" for c in text)
    return False


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
