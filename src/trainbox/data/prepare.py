"""`trainbox prepare`: text / JSONL / chat JSONL -> shard or Megatron token files.

Pipeline (one reader, N tokenizer processes, one writer):

    read inputs in order -> work items of ~1 MB text -> pool (bounded queue) -> results in order -> writers

- Streamed with bounded memory: at most `2 x workers + 2` work items are in flight, and a large .txt
  file is cut into ~8 MB pieces just before a newline (else a space) between printable ASCII bytes (a place where
  the GPT-2 / byte-level pre-tokenizer always splits, so the tokens equal those of the whole file).
- Byte-identical for any worker count: results are consumed in submission order and tokenization of a
  document does not depend on its neighbours.
- Documents: a .txt file is one document; a JSONL line is one document per --text-key (or one chat).
  The validation split takes whole documents: the first --val-docs, or an evenly spread
  --val-fraction (document i is held out when floor((i+1)f) > floor(if)). A --val-docs that holds out every
  document is refused (DataError), with nothing written.
- Atomic as a set: every output is written under a temporary name (NAME.partial). Once all are complete,
  {out}.manifest.json is written with state "committing" (the new files and the old ones they replace),
  the temporaries are renamed into place, stale outputs of the previous set and leftover temporaries
  are removed, and the manifest is rewritten with state "complete": each file's name, size and token
  count, the tokenizer (data/identity.py: a run with another one is refused), the inputs and the options.
  Readers (data/sources.py, `trainbox inspect`) refuse a set whose manifest is not complete, so a kill at
  any moment leaves either the previous whole set or a refused one; a rerun with --overwrite replaces it.
  Existing outputs are replaced only with overwrite=True; an input is never opened for writing.
- An input with no tokens at all (no documents, or only empty ones) is a NoData error (exit code 2), and
  nothing is written.

Shard output: {out}_val_000000.bin, {out}_train_000001.bin ... (EOT before each document, rolled over
every `shard_tokens` tokens) plus `.mask` files for chat data. Megatron output: {out}_{key}_document
(.bin/.idx) and {out}_val_{key}_document, plus `_mask` datasets for chat data; chat text goes to the
first text key's dataset.
"""
from __future__ import annotations

import glob
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from trainbox.data import formats, manifest, megatron
from trainbox.data.chat import load_template
from trainbox.data.encode import EncodePool, fast_encoder
from trainbox.data.identity import recorded
from trainbox.data.readers import (
    first_record_is_chat,
    is_jsonl,
    list_input_files,
    splits_like_gpt2,
    work_items,
)
from trainbox.data.sinks import MegatronSink, ShardSink, partial
from trainbox.data.tokenizer import asset_path, get_tokenizer
from trainbox.errors import DataError, NoData

log = logging.getLogger("trainbox")


@dataclass
class PrepareOptions:
    """What `trainbox prepare` does; one field per command-line flag."""

    inputs: list[str]
    out: str
    tokenizer: str = "gpt2"
    format: str = "shard"                 # shard | megatron
    text_keys: list[str] = field(default_factory=lambda: ["text"])
    chat_template: str | None = None      # built-in name or .jinja; default: the tokenizer's, else chatml
    workers: int = 1
    shard_tokens: int = 100_000_000
    val_docs: int = 0
    val_fraction: float = 0.0
    append_eod: bool = False              # megatron: EOD after each document (shards always put EOT before)
    write_vocab: bool = False
    overwrite: bool = False


@dataclass
class PrepareStats:
    """Running totals, handed to the progress callback and returned at the end."""

    documents: int = 0
    tokens: int = 0
    val_documents: int = 0
    val_tokens: int = 0
    bytes_read: int = 0
    total_bytes: int | None = None        # input size when known (regular, uncompressed files)
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    masked: bool = False                  # chat records: a loss mask on the assistant's tokens
    trained: int = 0                      # tokens the loss mask keeps
    unanswered: int = 0                   # chat records with no assistant token

    def mask_summary(self) -> str:
        """The summary line's end: what the loss mask keeps ("" for plain text)."""
        if not self.masked:
            return ""
        return f"; the loss on {self.trained:,} assistant tokens ({self.trained / max(1, self.tokens):.1%})"


# ----------------------------------------------------------------------------- the command


def _output_globs(opts: PrepareOptions) -> list[str]:
    o = glob.escape(opts.out)
    if opts.format == "shard":
        return [f"{o}_train_*.bin", f"{o}_val_*.bin", f"{o}_train_*.mask", f"{o}_val_*.mask"]
    return [f"{o}{tag}_{glob.escape(k)}_document{m}.{ext}" for tag in ("", "_val") for k in opts.text_keys
            for m in ("", "_mask") for ext in ("bin", "idx")]


def existing_outputs(opts: PrepareOptions) -> list[Path]:
    """Files a prepare into `opts.out` would create or replace: its output names, the files its manifest
    lists (an interrupted commit's old and new ones), and the manifest itself, last."""
    found = {Path(p) for pat in _output_globs(opts) for p in glob.glob(pat)}
    man = manifest.manifest_path(opts.out)
    if man.is_file():
        try:
            m = manifest.read_manifest(man)
        except DataError:
            m = {}
        names = [e["name"] for e in m.get("files", [])] + m.get("replaces", [])
        found |= {man.parent / n for n in names if (man.parent / n).is_file()}
    return sorted(found) + ([man] if man.is_file() else [])


def _leftover_temporaries(opts: PrepareOptions) -> list[Path]:
    """`.partial` files of earlier prepares into `opts.out` that were killed."""
    man = glob.escape(str(manifest.manifest_path(opts.out)))
    pats = [f"{p}.partial" for p in _output_globs(opts)] + [f"{man}.partial"]
    return sorted({Path(p) for pat in pats for p in glob.glob(pat)})


def _check(opts: PrepareOptions, files: list[Path]) -> None:
    if opts.format not in ("shard", "megatron"):
        raise DataError(f"unknown output format {opts.format!r}", hint="use --format shard or --format megatron")
    if opts.val_docs and opts.val_fraction:
        raise DataError("give either --val-docs or --val-fraction, not both")
    if opts.val_docs < 0:
        raise DataError(f"--val-docs {opts.val_docs} must be at least 0",
                        hint="give the number of documents to hold out for validation")
    if not 0 <= opts.val_fraction < 1:
        raise DataError(f"--val-fraction {opts.val_fraction} must be in [0, 1)")
    if opts.workers < 1 or opts.shard_tokens < 1:
        raise DataError("--workers and --shard-tokens must be at least 1")
    old = existing_outputs(opts)
    if old and not opts.overwrite:
        raise DataError(f"output {old[0]} already exists ({len(old)} output file(s) under {opts.out}_*)",
                        hint="add --overwrite to replace them, or choose another --out")
    inputs = {f.resolve() for f in files}
    clash = [p for p in old if p.resolve() in inputs]
    if clash:
        raise DataError(f"{clash[0]} is both an input and an output; prepare never writes into an input",
                        hint="choose another --out")
    if opts.write_vocab:
        _vocab_targets(opts.tokenizer, Path(opts.out).parent, opts.overwrite, files)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)


def _is_val(i: int, opts: PrepareOptions) -> bool:
    if opts.val_docs:
        return i < opts.val_docs
    f = opts.val_fraction
    return f > 0 and int((i + 1) * f) > int(i * f)


def prepare(opts: PrepareOptions, progress: Callable[[PrepareStats], None] | None = None) -> PrepareStats:
    """Tokenize `opts.inputs` into `opts.out` (see the module docstring). Returns the totals."""

    files = list_input_files(opts.inputs)
    _check(opts, files)
    tok = get_tokenizer(opts.tokenizer)
    chat = any(is_jsonl(f) and first_record_is_chat(f) for f in files)
    if chat:
        load_template(opts.tokenizer, opts.chat_template)  # fail early on a bad template
    if opts.format == "shard" and tok.vocab_size > 65536:
        raise DataError(f"tokenizer {opts.tokenizer} has {tok.vocab_size} ids; shards hold uint16",
                        hint="use --format megatron")
    fast, why_not = (None, "") if chat else fast_encoder(tok)   # chat renders a template per message: no bulk text
    if why_not:
        log.warning(f"{why_not}: the text is encoded through {'tiktoken' if opts.tokenizer == 'gpt2' else 'tokenizers'}"
                    ", the same tokens more slowly")
    stats = PrepareStats(masked=chat, total_bytes=_total_bytes(files))
    sinks = _make_sinks(opts, tok, chat)
    pool = EncodePool(opts.workers, (opts.tokenizer, opts.chat_template, chat, list(opts.text_keys)), fast)
    start, last = time.perf_counter(), 0.0
    try:
        doc, split, content = -1, "train", 0
        pieces = None if splits_like_gpt2(tok) else 0
        for results, nbytes in pool.map(work_items(files, pieces)):
            if isinstance(results, tuple):  # ("error", message, hint) from a worker
                raise DataError(results[1], hint=results[2])
            for starts, ids_per_key, mask in results:
                if starts:
                    doc += 1
                    split = "val" if _is_val(doc, opts) else "train"
                n = _emit(sinks[split], ids_per_key, mask, starts)
                _count(stats, split, n, starts)
                if mask is not None:
                    kept = int(np.count_nonzero(mask))
                    stats.trained += kept
                    stats.unanswered += int(kept == 0)
                content += sum(len(ids) for ids in ids_per_key)
            stats.bytes_read += nbytes
            stats.seconds = time.perf_counter() - start
            if progress and stats.seconds - last >= 0.5:
                last = stats.seconds
                progress(stats)
        if content == 0:
            what = f"{stats.documents} empty document(s)" if stats.documents else "no documents"
            raise NoData(f"{_names(files)}: no tokens to write ({what}); nothing was written",
                         hint="check the input files" + (" and --text-key" if any(map(is_jsonl, files)) else ""))
        if chat and stats.trained == 0:
            raise NoData(f"{_names(files)}: no assistant tokens to train on in {stats.documents:,} chat record(s); "
                         "nothing was written", hint="only turns with role 'assistant' (ShareGPT: from 'gpt') are "
                         "trained: check the records' roles")
        if stats.documents == stats.val_documents:
            raise DataError(f"--val-docs {opts.val_docs} holds out all {stats.documents:,} documents: none is left for "
                            "training; nothing was written",
                            hint=f"hold out fewer: --val-docs {stats.documents - 1}"
                                 + (" or less, or --val-fraction" if stats.documents > 1 else " (no validation split)"))
        outputs = _close_sinks(sinks, stats)
    except BaseException:
        pool.close()
        _abort(sinks)
        raise
    pool.close()
    if stats.unanswered:
        log.warning(f"{stats.unanswered:,} of {stats.documents:,} chat records have no assistant turn: their tokens "
                    "are context, with nothing to learn")
    stats.files.append(str(_commit(outputs, opts, tok)))
    if opts.write_vocab:
        stats.files += [str(p) for p in write_vocab(opts.tokenizer, Path(opts.out).parent, opts.overwrite, files)]
    stats.seconds = time.perf_counter() - start
    if progress:
        progress(stats)
    return stats


def _names(files: list[Path]) -> str:
    return ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _total_bytes(files: list[Path]) -> int | None:
    if all(f.is_file() and not f.name.endswith(".gz") for f in files):
        return sum(f.stat().st_size for f in files)
    return None


def _make_sinks(opts: PrepareOptions, tok, chat: bool) -> dict:
    if opts.format == "shard":
        return {s: ShardSink(opts.out, s, i, opts.shard_tokens, tok.eot_id, chat)
                for s, i in (("val", 0), ("train", 1))}
    dtype = megatron.megatron_dtype(tok.vocab_size)
    eod = tok.eot_id if opts.append_eod else None
    return {s: MegatronSink(opts.out, s, opts.text_keys, dtype, eod, chat) for s in ("val", "train")}


def _emit(sink, ids_per_key: list[np.ndarray], mask, starts: bool) -> int:
    if isinstance(sink, ShardSink):
        return sum(sink.add(ids, mask, starts or k > 0) for k, ids in enumerate(ids_per_key))
    return sink.add_entry(ids_per_key, mask, starts)


def _count(stats: PrepareStats, split: str, n: int, starts: bool) -> None:
    stats.tokens += n
    stats.documents += int(starts)
    if split == "val":
        stats.val_tokens += n
        stats.val_documents += int(starts)


def _close_sinks(sinks: dict, stats: PrepareStats) -> list[tuple[Path, Path, int | None]]:
    outputs = []
    for split, sink in sinks.items():
        if isinstance(sink, ShardSink):
            outputs += sink.close()
            continue
        n, done = sink.close()  # the EOD of each split's last document is counted here
        stats.tokens += n
        if split == "val":
            stats.val_tokens += n
        if split == "val" and not stats.val_documents:
            for tmp, _, _ in done:  # no validation split asked for: no empty val dataset
                tmp.unlink(missing_ok=True)
            continue
        outputs += done
    stats.files = [str(final) for _, final, _ in outputs]
    return outputs


def _abort(sinks: dict) -> None:
    """Remove every temporary file; final names are untouched."""
    for sink in sinks.values():
        for tmp in sink.abort():
            Path(tmp).unlink(missing_ok=True)


def _commit(outputs: list[tuple[Path, Path, int | None]], opts: PrepareOptions, tok) -> Path:
    """Put the new output set in place of the old one as a whole (module docstring); -> the manifest."""
    man = manifest.manifest_path(opts.out)
    new = {final for _, final, _ in outputs}
    old = [p for p in existing_outputs(opts) if p != man]
    base = {"trainbox_prepare": 1, "out": man.name.removesuffix(manifest.MANIFEST_SUFFIX), "format": opts.format,
            **recorded(opts.tokenizer, tok.vocab_size), "sources": list(opts.inputs), "text_keys": list(opts.text_keys),
            "chat_template": opts.chat_template, "append_eod": opts.append_eod, "val_docs": opts.val_docs,
            "val_fraction": opts.val_fraction,
            "files": [{"name": final.name, "bytes": tmp.stat().st_size, **({} if n is None else {"tokens": n})}
                      for tmp, final, n in outputs]}
    manifest.write_manifest(man, {**base, "state": "committing", "replaces": [p.name for p in old if p not in new]})
    for tmp, final, _ in outputs:
        os.replace(tmp, final)
    for stale in [p for p in old if p not in new] + _leftover_temporaries(opts):
        stale.unlink(missing_ok=True)
    formats.fsync_dir(man.parent.resolve())
    manifest.write_manifest(man, {**base, "state": "complete"})
    return man


VOCAB_FILES = (("encoder.json", "gpt2-vocab.json"), ("vocab.bpe", "gpt2-merges.txt"))


def _vocab_targets(tokenizer: str, folder: Path, overwrite: bool, inputs: list[Path]) -> list[tuple[Path, Path]]:
    """(asset, destination) of each vocabulary file to write; DataError, before anything is written, for another
    tokenizer than gpt2, a destination that is an input, or another file there without `overwrite`. A destination
    that already holds the asset's bytes is left out: writing it would change nothing."""
    if tokenizer != "gpt2":
        raise DataError(f"--write-vocab writes the GPT-2 vocabulary; the tokenizer here is {tokenizer}",
                        hint="drop --write-vocab and point your trainer at the tokenizer.json instead")
    ins = {f.resolve() for f in inputs}
    todo = []
    for src, name in VOCAB_FILES:
        final, asset = folder / name, asset_path(src)
        if final.resolve() in ins:
            raise DataError(f"{final} is an input, and --write-vocab would write {name} over it; prepare never "
                            "writes into an input", hint=f"move {final} out of the inputs' way, or choose another "
                                                         "--out folder for the vocabulary files")
        if final.is_file() and final.read_bytes() == asset.read_bytes():
            continue
        if final.exists() and not overwrite:
            raise DataError(f"{final} already exists, and --write-vocab would replace it with the GPT-2 {name}",
                            hint="add --overwrite to replace it, choose another --out folder, or drop --write-vocab")
        todo.append((asset, final))
    return todo


def write_vocab(tokenizer: str, folder: Path, overwrite: bool = False, inputs: list[Path] = ()) -> list[Path]:
    """gpt2-vocab.json and gpt2-merges.txt in `folder`, the files Megatron's GPT2BPETokenizer reads. Refused
    (_vocab_targets) where one is among `inputs`, or another file of that name is there without `overwrite`."""

    for asset, final in _vocab_targets(tokenizer, folder, overwrite, list(inputs)):
        tmp = partial(final)
        tmp.write_bytes(asset.read_bytes())
        os.replace(tmp, final)
    return [folder / name for _, name in VOCAB_FILES]
