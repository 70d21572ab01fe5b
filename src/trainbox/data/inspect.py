"""`trainbox inspect`: what a token dataset (or preference set) holds and how many training steps it gives.

Reads any supported format (shard, Megatron, flat uint16; a file, a Megatron prefix, a shard prefix with
its _train_/_val_ files, or a folder of shards) through the same resolution and the same packed-sample
rule as the training loader, so the step count printed here is the one `trainbox train` will run:

    samples = sum over files of (tokens - 1) // seq_len      (windows of seq_len + 1 never cross files)
    steps_per_epoch = samples // global_batch; total = ceil(epochs x steps_per_epoch)

A run's data is counted after its family's adaptation of the packed windows (`adapt`, which the caller takes
from the run: t5's span corruption reads windows of more than seq_len tokens, data/spans.py), as its loader does.

Preference data (a `trainbox prepare` set of pairs or unpaired examples, raw preference JSONL, or a run of
train.objective=dpo) is read as training reads it (data/pairs.py: the truncation at seq_len, the mismatched
partners of unpaired examples, packed rows): pairs or examples, tokens, what the truncation cuts, and the steps
a global batch of them (of packed rows under data.packing) gives.

Zero steps raise the loader's own error message (data/loader.py: zero_steps). Files are opened under
the same data.format rule and the same output-set check (a `trainbox prepare` set whose manifest is not
complete is refused) as for training. Scans are chunked, so a many-GB dataset is inspected in bounded memory.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np

from trainbox.config import DataSection
from trainbox.config.preference import UNPAIRED_LOSSES
from trainbox.data import formats, manifest, megatron
from trainbox.data.loader import TokenDataset, open_tokens, zero_steps
from trainbox.data.pairs import PackedPairs, open_pair_datasets
from trainbox.data.preference import prepared_kind
from trainbox.data.prompts import open_prompt_datasets
from trainbox.data.readers import first_row_is_preference, first_row_is_unpaired
from trainbox.data.sources import check_tokenizer, check_vocab, resolve
from trainbox.data.tokenizer import get_tokenizer
from trainbox.errors import DataError

CHUNK = 1 << 24


def file_format(path: Path, fmt: str = "auto") -> str:
    return formats.detect_format(path, fmt)


def scan(tokens: np.ndarray, eot: int | None) -> dict:
    """Min / max id and EOT count, in chunks."""
    lo, hi, n_eot = None, None, 0
    for start in range(0, len(tokens), CHUNK):
        part = np.asarray(tokens[start:start + CHUNK])
        lo = int(part.min()) if lo is None else min(lo, int(part.min()))
        hi = int(part.max()) if hi is None else max(hi, int(part.max()))
        if eot is not None:
            n_eot += int(np.count_nonzero(part == eot))
    return {"min_id": lo, "max_id": hi, "eot": n_eot}


def describe_file(path: Path, eot: int | None, vocab_size: int | None, data_format: str = "auto",
                  tokenizer: str | None = None) -> dict:
    """One file's format, dtype, documents, tokens, id range and masked fraction."""

    tokens, mask = open_tokens(path, data_format)
    fmt = file_format(path, data_format)
    info = {"path": str(path), "format": fmt, "dtype": str(tokens.dtype), "tokens": int(len(tokens))}
    info.update(scan(tokens, eot))
    if fmt == "megatron":
        info["documents"] = megatron.read_megatron(path).num_documents
    else:  # shards and flat files put EOT before (or between) documents
        info["documents"] = info["eot"]
    if mask is not None:
        info["trained_tokens"] = int(sum(int(np.asarray(mask[s:s + CHUNK]).sum()) for s in range(0, len(mask), CHUNK)))
    if vocab_size is not None:
        check_vocab(tokens, formats.token_file(path), vocab_size, tokenizer=tokenizer)
    return info


def inspect_data(path: str, seq_len: int, global_batch: int | None = None, epochs: float = 1.0,
                 tokenizer: str | None = None, cache_dir: str | None = None, data_format: str = "auto",
                 adapt: Callable | None = None, chat_template: str | None = None) -> dict:
    """A report of the train (and val) files behind `path`; DataError when an epoch would have 0 steps, or, with a
    `tokenizer`, when a prepared set was made with another one (as training refuses it). `adapt`: the run's rule for
    its packed windows, adapt(train, val) -> (train, val) (model/build.py's adapt_datasets for the run); samples and
    steps are those of the datasets it returns. `chat_template`: data.chat_template, for raw chat JSONL."""

    tok = get_tokenizer(tokenizer or "gpt2")
    cfg = DataSection(path=path, tokenizer=tokenizer or "gpt2", seq_len=max(8, seq_len), cache_dir=cache_dir,
                      format=data_format, chat_template=chat_template)
    train_files, val_files = resolve(cfg, tok)
    if tokenizer:
        check_tokenizer(train_files + val_files, tok, "", path)
    vocab = tok.vocab_size if tokenizer else None
    report: dict = {"path": path, "seq_len": seq_len, "tokenizer": tokenizer or "gpt2 (for EOT only)"}
    datasets = [TokenDataset([open_tokens(f, data_format)[0] for f in files], seq_len, name=f"{path} ({split})")
                if files else None for split, files in (("train", train_files), ("val", val_files))]
    if adapt is not None:
        datasets = adapt(*datasets)
    for split, files, ds in zip(("train", "val"), (train_files, val_files), datasets):
        if not files:
            continue
        infos = [describe_file(f, tok.eot_id, vocab, data_format, tokenizer) for f in files]
        report[split] = {"files": infos, "tokens": ds.num_tokens, "samples": ds.num_samples, "window": ds.seq_len,
                         "documents": sum(i["documents"] for i in infos),
                         "min_id": (min(i["min_id"] for i in infos if i["min_id"] is not None)
                                    if ds.num_tokens else None),
                         "max_id": (max(i["max_id"] for i in infos if i["max_id"] is not None)
                                    if ds.num_tokens else None)}
        if ds.num_tokens == 0:
            raise DataError(f"{path} ({split}): the dataset is empty ({', '.join(map(str, files))})")
    if global_batch is not None:
        samples = report["train"]["samples"]
        per_epoch = samples // global_batch
        if per_epoch == 0:
            raise DataError(zero_steps(datasets[0], global_batch))
        report["global_batch"], report["epochs"] = global_batch, epochs
        report["steps_per_epoch"] = per_epoch
        report["total_steps"] = max(1, int(math.ceil(epochs * per_epoch)))
    return report


def is_preference_data(path: str) -> bool:
    """A prepared preference set (pair or example files) or a preference JSONL file."""
    p = Path(path)
    return prepared_kind(path) is not None or (p.is_file() and first_row_is_preference(p))


def preference_tokenizer(path: str) -> str | None:
    """The tokenizer a prepared preference set was made with (its manifest's), None for raw JSONL."""
    man = manifest.manifest_path(path)
    return manifest.read_manifest(man).get("tokenizer") if man.is_file() else None


def inspect_preferences(data, dpo, tok, global_batch: int | None = None, epochs: float = 1.0) -> dict:
    """A report of data.path's preference pairs (or examples) as training reads them: `data` and `dpo` are the run's
    sections (or made from the command line); a raw JSONL file is prepared into data.cache_dir as training does."""
    if prepared_kind(data.path) == "examples" or Path(data.path).is_file() and first_row_is_unpaired(Path(data.path)):
        dpo = dpo.model_copy(update={"loss": "kto"})
    train, val = open_pair_datasets(data, dpo, tok, tok.vocab_size)
    packed = data.packing and dpo.loss not in UNPAIRED_LOSSES
    report: dict = {"path": data.path, "seq_len": data.seq_len, "tokenizer": tok.name,
                    "unit": train.unit, "packed": bool(packed)}
    for split, ds in (("train", train), ("val", val)):
        if ds is None:
            continue
        ds = PackedPairs(ds) if packed else ds
        report[split] = {**ds.report, "samples": ds.num_samples, "tokens": ds.num_tokens, "text": ds.describe()}
    if global_batch is not None:
        samples = report["train"]["samples"]
        per_epoch = samples // global_batch
        what = "packed rows" if packed else train.unit
        if per_epoch == 0:
            raise DataError(f"{data.path}: {samples:,} {what} make no step of train.global_batch_size={global_batch}",
                            hint=f"lower the global batch to at most {samples}, or add data")
        report.update(global_batch=global_batch, epochs=epochs, steps_per_epoch=per_epoch,
                      total_steps=max(1, int(math.ceil(epochs * per_epoch))), batch_unit=what)
    return report


def inspect_prompts(data, grpo, tok, global_batch: int, epochs: float = 1.0) -> dict:
    """A report of a grpo run's prompts (data.path, data.val_path) as training reads them (data/prompts.py)."""
    train, val = open_prompt_datasets(data, grpo, tok)
    report: dict = {"path": data.path, "seq_len": data.seq_len, "tokenizer": tok.name, "unit": "prompts"}
    for split, ds in (("train", train), ("val", val)):
        if ds is not None:
            report[split] = {**ds.report, "samples": ds.num_samples, "tokens": ds.num_tokens, "text": ds.describe()}
    per_epoch = train.num_samples // global_batch * grpo.num_iterations   # each batch trains that many steps
    if per_epoch == 0:
        raise DataError(f"{data.path}: {train.num_samples:,} prompts make no step of train.global_batch_size="
                        f"{global_batch}", hint=f"lower the global batch to at most {train.num_samples}, or add data")
    report.update(global_batch=global_batch, epochs=epochs, steps_per_epoch=per_epoch,
                  total_steps=max(1, int(math.ceil(epochs * per_epoch))), batch_unit="prompts")
    return report


def format_report(r: dict) -> str:
    """The human-readable text `trainbox inspect` prints."""
    lines = [f"{r['path']}  (seq_len {r['seq_len']})"]
    if "unit" in r:   # preference data
        if "run" in r:
            lines.insert(0, f"run {r['run']['path']}: data.path={r['run']['data.path']}")
        lines += [f"{split}: {r[split]['text']}" for split in ("train", "val") if split in r]
        if "steps_per_epoch" in r:
            lines.append(f"global batch {r['global_batch']} {r['batch_unit']}: {r['steps_per_epoch']:,} steps per "
                         f"epoch, {r['total_steps']:,} steps for {r['epochs']:g} epoch(s)")
        return "\n".join(lines)
    if "run" in r:
        run = r["run"]
        length = f", whose {run['max_steps']:,} steps are {run['epochs']:g} epoch(s)" if run["max_steps"] else ""
        lines.insert(0, f"run {run['path']}: data.path={run['data.path']}, data.tokenizer={run['data.tokenizer']}"
                        + length)
    for split in ("train", "val"):
        if split not in r:
            continue
        s = r[split]
        lines.append(f"{split}: {len(s['files'])} file(s), {s['documents']:,} documents, {s['tokens']:,} tokens, "
                     f"ids {s['min_id']}..{s['max_id']}, {s['samples']:,} samples of {r['seq_len']}"
                     + (f" (each read from a window of {s['window']} tokens)" if s.get("window", r["seq_len"])
                        != r["seq_len"] else ""))
        for f in s["files"]:
            extra = f", {f['trained_tokens']:,} trained (loss mask)" if "trained_tokens" in f else ""
            lines.append(f"  {f['path']}: {f['format']} {f['dtype']}, {f['documents']:,} documents, "
                         f"{f['tokens']:,} tokens{extra}")
    if "steps_per_epoch" in r:
        lines.append(f"global batch {r['global_batch']}: {r['steps_per_epoch']:,} steps per epoch, "
                     f"{r['total_steps']:,} steps for {r['epochs']:g} epoch(s)")
    return "\n".join(lines)
