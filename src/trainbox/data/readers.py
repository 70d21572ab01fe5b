"""Reading `trainbox prepare` inputs: .txt (one document per file), .jsonl / .jsonl.gz (one per line).

The main process only reads bytes here and groups them into work items; decoding, JSON parsing and
validation (`parse_json_line`) run in the tokenizer workers. A .txt file larger than TXT_PIECE_BYTES
is cut into pieces at points where the GPT-2 pre-tokenizer always splits (`_safe_cut`), so a multi-GB
file streams in bounded memory and still gives the tokens of the whole file.
"""
from __future__ import annotations

import glob
import gzip
import json
import shlex
from pathlib import Path
from typing import Iterator

from trainbox.data import embedded
from trainbox.data.chat import is_chat_record, messages_of, tools_of
from trainbox.data.tokenizer import GPT2Tokenizer
from trainbox.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")
GZIP_MAGIC = b"\x1f\x8b"      # the first two bytes of every gzip file
ITEM_BYTES = 1 << 20          # raw input bytes per work item sent to a tokenizer worker
TXT_PIECE_BYTES = 8 << 20     # a .txt file larger than this is read and tokenized in pieces


def list_input_files(inputs: list[str]) -> list[Path]:
    """Files in command-line order; a directory contributes its text/JSONL files recursively, sorted."""
    files: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES))
            if not found:
                raise DataError(f"input folder {p} holds no .txt or .jsonl files")
            files += found
        elif p.exists():  # a file, or a named pipe / process substitution such as <(zcat x.jsonl.gz)
            if p.name.endswith((".json", ".parquet", ".arrow")):
                raise DataError(f"input {p}: {p.suffix} files are not read by prepare (only .txt and JSON Lines)",
                                hint="convert it to JSON Lines, one {\"text\": ...} object per line")
            files.append(p)
        else:
            matches = sorted(glob.glob(spec))
            if not matches:
                raise DataError(f"input {spec} does not exist")
            files += [Path(m) for m in matches if Path(m).is_file()]
    return files


def is_jsonl(path: Path) -> bool:
    return path.name.endswith(JSONL_SUFFIXES)


def _open(path: Path, mode: str = "rb"):
    """`path` for reading (`mode` "rb" or "rt", UTF-8), through gzip when its name ends in .gz; a file so named that
    is not gzip-compressed (a plain file renamed) is a DataError naming it. A pipe is not peeked at."""
    if not path.name.endswith(".gz"):
        return open(path, mode, **({"encoding": "utf-8"} if mode == "rt" else {}))
    if path.is_file():
        with open(path, "rb") as f:
            head = f.read(2)
        if head and head != GZIP_MAGIC:
            was, plain = shlex.quote(str(path)), shlex.quote(str(path.with_name(path.name.removesuffix(".gz"))))
            raise DataError(f"{path}: not gzip-compressed, though its name ends in .gz (its first bytes are "
                            f"{head.hex(' ')}, a gzip file's {GZIP_MAGIC.hex(' ')})",
                            hint=f"rename it, and it is read as the plain file it is: mv {was} {plain}; or compress "
                                 f"it: mv {was} {plain} && gzip {plain}")
    return gzip.open(path, mode, **({"encoding": "utf-8"} if mode == "rt" else {}))


def mend_surrogates(value):
    """`value` (a parsed JSON value) with each lone UTF-16 surrogate in its strings made U+FFFD, as tiktoken's
    encode_ordinary does. JSON allows the escape alone ("\\ud83d": an emoji cut in half, common in scraped text),
    but such a string has no UTF-8 form, and no tokenizer takes it."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [mend_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {k: mend_surrogates(v) for k, v in value.items()}
    return value


def _surrogate_escape(line: str | bytes) -> bool:
    """Whether a raw JSON line may hold a surrogate escape: the only way a parsed string gets a lone one."""
    return ("\\ud" in line or "\\uD" in line) if isinstance(line, str) else (b"\\ud" in line or b"\\uD" in line)


def json_objects(path: Path) -> Iterator[tuple[dict, int]]:
    """(object, line number) of each non-empty line of a JSONL (.gz) file, or a DataError naming the line."""
    with _open(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if _surrogate_escape(line):
                row = mend_surrogates(row)
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: each line must be a JSON object, not {type(row).__name__}")
            yield row, n


def _bad_utf8(where: str, offset: int, e: UnicodeDecodeError) -> DataError:
    return DataError(f"{where}: invalid UTF-8 at byte offset {offset + e.start}", hint="convert the file to UTF-8")


def _first_row(path: Path):
    """The first non-empty line of a JSONL file, parsed (None: no such line, or not JSON, which the workers
    report with its line). Bytes that are not UTF-8 are a DataError naming the file, line and byte offset."""
    with _open(path) as f:
        offset = 0
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
                except UnicodeDecodeError as e:
                    raise _bad_utf8(f"{path}:{n}", offset, e) from None
            offset += len(line)
    return None


def first_record_is_chat(path: Path) -> bool:
    """Whether a JSONL file holds chat records, from its first line (False for a pipe, which can't be peeked)."""
    return path.is_file() and is_chat_record(_first_row(path))


def is_unpaired_row(row) -> bool:
    """An unpaired preference row: a completion and its label (dpo.loss=kto)."""
    return isinstance(row, dict) and "completion" in row and "label" in row


def is_preference_row(row) -> bool:
    """Pairs (chosen, rejected), or an unpaired row."""
    return isinstance(row, dict) and "chosen" in row and "rejected" in row or is_unpaired_row(row)


def first_row_is_unpaired(path: Path) -> bool:
    """Whether a preference JSONL file starts with an unpaired row, from its first non-empty line: its set is
    written as examples (data/preference.py)."""
    return is_unpaired_row(_first_row(path))


def first_row_is_preference(path: Path) -> bool:
    """Whether a JSONL file holds preference rows (data/preference.py), from its first non-empty line."""
    return path.is_file() and path.name.endswith(JSONL_SUFFIXES) and is_preference_row(_first_row(path))


def splits_like_gpt2(tok) -> bool:
    """True when the tokenizer pre-splits text with the GPT-2 regex and nothing else (tiktoken gpt2, or a
    `tokenizers` ByteLevel pre-tokenizer without prefix space or normalizer), so .txt pieces are safe."""
    if isinstance(tok, GPT2Tokenizer):
        return True
    try:
        cfg = json.loads(tok.tok.to_str())
    except AttributeError:
        return False
    pre = cfg.get("pre_tokenizer") or {}
    return (cfg.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space") and pre.get("use_regex", True))


def read_txt(path: Path, piece_bytes: int | None = None) -> Iterator[tuple[bytes, bool, int]]:
    """-> (raw piece, starts a document, its byte offset) for one .txt file (one document).

    piece_bytes=None reads the file whole (tokenizers whose pre-splitting we cannot vouch for).
    """
    piece_bytes = piece_bytes if piece_bytes is not None else TXT_PIECE_BYTES
    first = True
    offset = 0
    with open(path, "rb") as f:
        if piece_bytes <= 0:
            yield f.read(), True, 0
            return
        carry = b""
        while True:
            block = f.read(piece_bytes)
            data = carry + block
            if not block:
                if data or first:
                    yield data, first, offset
                return
            cut = _safe_cut(data)
            if cut <= 0:
                if len(data) > 8 * piece_bytes:
                    raise DataError(f"{path}: no newline or space between ASCII characters in the "
                                    f"{len(data):,} bytes from byte offset {offset}; cannot stream it in pieces",
                                    hint="split the file into documents (one .txt each, or JSONL)")
                carry = data
                continue
            yield data[:cut], first, offset
            first, offset, carry = False, offset + cut, data[cut:]


def _safe_cut(data: bytes) -> int:
    """Index of the last newline (else space) between two printable ASCII bytes; the piece ends before it.

    The GPT-2 / byte-level pre-tokenizer always splits there: no pre-token pattern takes in a space or
    newline after other characters, and each piece's regex matching is then the same as the whole
    file's. Cutting right after whitespace instead would let `\\s+$` merge it at the end of a piece;
    non-ASCII neighbours are avoided because some of them (NBSP, U+3000) count as whitespace.
    """
    for sep in (b"\n", b" "):
        i = len(data) - 1
        while True:
            i = data.rfind(sep, 0, i)
            if i <= 0 or i + 1 >= len(data):
                break
            if 0x21 <= data[i - 1] <= 0x7E and 0x21 <= data[i + 1] <= 0x7E:
                return i
    return -1


def decode_utf8(data: bytes, where: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad_utf8(where, offset, e) from None


def parse_json_line(line: bytes, where: str, offset: int, keys: list[str], chat: bool) -> tuple:
    """One JSONL line -> ("text", [text per key], True) or ("chat", messages, where, tools)."""

    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON at byte offset {offset + e.pos} ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise _bad_utf8(where, offset, e) from None
    if _surrogate_escape(line):
        rec = mend_surrogates(rec)
    if chat and is_chat_record(rec):
        return "chat", messages_of(rec, where), where, tools_of(rec, where)
    if chat:
        raise DataError(f"{where}: expected a chat record (`messages` or `conversations`)",
                        hint="keep chat and plain-text JSONL in separate prepare runs")
    return "text", text_fields(rec, keys, where), True


def text_fields(rec, keys: list[str], where: str) -> list[str]:
    """The string fields `keys` of a plain-text JSONL record, or a DataError saying what the record lacks (or what
    it seems meant to be: a chat record or a preference row that is not quite one)."""
    missing = [k for k in keys if not isinstance(rec, dict) or not isinstance(rec.get(k), str)]
    if missing:
        have = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
        near = _meant(rec) if isinstance(rec, dict) else None
        if near:
            raise DataError(f"{where}: {near[0]} (fields: {have})", hint=near[1])
        raise DataError(f"{where}: no string field {missing[0]!r} (fields: {have})", hint=_text_key_hint(rec))
    return [rec[k] for k in keys]


def _text_key_hint(rec) -> str:
    """How to name the text field, in each verb's spelling (this runs in the workers, for every verb that reads
    JSONL; `inspect` has no such option and reads a raw file with the default field)."""
    field = next((k for k, v in rec.items() if isinstance(v, str)), "FIELD") if isinstance(rec, dict) else "FIELD"
    return (f"name the text field: `prepare --text-key {field}` (or `tokenizer train --text-key {field}`), "
            f"data.text_key=[{field}] for train; to inspect it, inspect what that prepare writes")


def _meant(rec: dict) -> tuple[str, str] | None:
    """(what a record that is not plain text seems meant to be, and what it lacks; the next step), or None when
    nothing is recognised."""
    if is_chat_record(rec):
        return ("a chat record, but the input is read as plain text (the first record of each file decides, and "
                "none is a chat record)", "keep chat and plain-text records in separate files, prepared apart")
    forms = "see `trainbox prepare --help` for the row forms"
    for key in ("messages", "conversations"):
        if key in rec:
            return f"a chat record's {key!r} is a list of messages, not a {type(rec[key]).__name__}", forms
    pair = [k for k in ("prompt", "chosen", "rejected") if k in rec]
    if "chosen" in pair or "rejected" in pair:
        lacks = [k for k in ("chosen", "rejected") if k not in rec]
        return f"a preference row needs 'chosen' and 'rejected'; {' and '.join(map(repr, lacks))} missing", forms
    return None


def read_jsonl(path: Path) -> Iterator[tuple[bytes, str, int]]:
    """-> (raw line, "file:line", byte offset) for each non-blank line; parsing happens in the workers."""
    with _open(path) as f:
        offset = 0
        for lineno, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            if line.strip():
                yield line, f"{path}:{lineno}", start


def work_items(files: list[Path], piece_bytes: int | None = None) -> Iterator[tuple[list, int]]:
    """Group raw documents into work items of about ITEM_BYTES bytes.

    Entries: ("json", line, where, offset) or ("txt", piece, starts_document, path, offset); the main
    process only reads bytes, the workers decode, parse and tokenize them.
    """
    item, nbytes = [], 0
    for path in files:
        if is_jsonl(path):
            entries = (("json", line, where, off) for line, where, off in read_jsonl(path))
        else:
            entries = (("txt", data, first, str(path), off) for data, first, off in read_txt(path, piece_bytes))
        for entry in entries:
            item.append(entry)
            nbytes += len(entry[1])
            if nbytes >= ITEM_BYTES:
                yield item, nbytes
                item, nbytes = [], 0
    if item:
        yield item, nbytes


def tokenizer_texts(inputs: list[str], keys: list[str]) -> Iterator[str]:
    """The texts `trainbox tokenizer train` learns from, read as prepare reads them: a .txt file whole, each JSONL
    line's `keys` fields (a chat record: its messages' contents), never the JSON syntax around them. A missing
    input, bad UTF-8 or JSON, or a record without the field is a DataError naming the file and line."""
    for spec in inputs:
        if spec.startswith("embedded:"):
            yield from embedded.split("train")
            continue
        for path in list_input_files([spec]):
            if not is_jsonl(path):
                with _open(path) as f:
                    yield decode_utf8(f.read(), str(path), 0)
                continue
            for row, n in json_objects(path):
                where = f"{path}:{n}"
                if is_chat_record(row):
                    yield from (m["content"] for m in messages_of(row, where))
                else:
                    yield from text_fields(row, keys, where)
