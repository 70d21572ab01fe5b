"""Resolve `data.path` into train and validation token datasets.

Accepted forms:
  embedded:shakespeare     the embedded corpus, tokenized once into the cache (keyed by tokenizer)
  PREFIX                   shard files PREFIX_train_*.bin and PREFIX_val_*.bin (`trainbox prepare` output,
                           downloaded FineWeb shards)
  FILE.bin                 one shard or flat uint16 file (validation from data.val_path)
  FILE.jsonl / FILE.txt    chat or plain-text fine-tuning data, tokenized with loss masks (data/sft.py)
"""
from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

import numpy as np

from trainbox.config import DataSection
from trainbox.data.formats import write_shard
from trainbox.data.loader import TokenDataset, open_token_files
from trainbox.data.tokenizer import Tokenizer
from trainbox.errors import DataError


def default_cache_dir(cfg: DataSection) -> Path:
    return Path(cfg.cache_dir) if cfg.cache_dir else Path.home() / ".cache" / "trainbox"


def tokenize_embedded(corpus: str, tokenizer: Tokenizer, cache: Path) -> Path:
    """Tokenize the embedded corpus once; later runs find the cached shards and start at once."""
    from trainbox.data import embedded

    if corpus != embedded.CORPUS:
        raise DataError(f"no embedded corpus '{corpus}'", hint=f"use embedded:{embedded.CORPUS}")
    key = hashlib.sha256(f"{corpus}|{tokenizer.name}|{tokenizer.vocab_size}|{embedded.VAL_WORKS}".encode()).hexdigest()[:12]
    out = cache / f"{corpus}-{key}"
    prefix = out / corpus
    if not (out / "COMPLETE").exists():
        out.mkdir(parents=True, exist_ok=True)
        for split, index in (("val", 0), ("train", 1)):
            docs = embedded.split(split)
            ids = tokenizer.encode_batch(docs) if hasattr(tokenizer, "encode_batch") else [tokenizer.encode(d) for d in docs]
            stream = np.concatenate([np.concatenate([[tokenizer.eot_id], d]) for d in ids]).astype(np.uint16)
            write_shard(f"{prefix}_{split}_{index:06d}.bin", stream)
        (out / "COMPLETE").write_text(tokenizer.name + "\n")
    return prefix


def _split_files(prefix: str, split: str) -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(f"{glob.escape(prefix)}_{split}_*.bin"))]


def resolve(cfg: DataSection, tokenizer: Tokenizer) -> tuple[list[Path], list[Path]]:
    """-> (train files, val files)."""
    path = cfg.path
    if path.startswith("embedded:"):
        path = str(tokenize_embedded(path.split(":", 1)[1], tokenizer, default_cache_dir(cfg)))
    if os.path.isfile(path):
        train = [Path(path)]
        val = [Path(cfg.val_path)] if cfg.val_path else []
    else:
        train, val = _split_files(path, "train"), _split_files(path, "val")
        if cfg.val_path:
            val = [Path(cfg.val_path)] if os.path.isfile(cfg.val_path) else _split_files(cfg.val_path, "val")
        if not train:
            found = sorted(glob.glob(f"{glob.escape(path)}*"))[:5]
            raise DataError(f"data.path={cfg.path}: no token files {path}_train_*.bin" +
                            (f" (found: {', '.join(found)})" if found else ""),
                            hint="create them with `trainbox prepare INPUT --out PREFIX`, "
                                 "or use data.path=embedded:shakespeare")
    return train, val


def open_datasets(cfg: DataSection, tokenizer: Tokenizer, vocab_size: int) -> tuple[TokenDataset, TokenDataset | None]:
    from trainbox.data.sft import is_sft_input, open_sft_datasets
    if is_sft_input(cfg.path):  # raw chat/text JSONL for fine-tuning: tokenized with loss masks (data/sft.py)
        return open_sft_datasets(cfg, tokenizer, vocab_size)
    train_files, val_files = resolve(cfg, tokenizer)
    train = TokenDataset(open_token_files(train_files), cfg.seq_len, name=f"{cfg.path} (train)")
    val = TokenDataset(open_token_files(val_files), cfg.seq_len, name=f"{cfg.path} (val)") if val_files else None
    for ds, files in ((train, train_files), (val, val_files)):
        if ds is None:
            continue
        for arr, f in zip(ds.arrays, files):
            if len(arr) and int(arr.max()) >= vocab_size:
                pos = int(np.argmax(np.asarray(arr) >= vocab_size))
                raise DataError(f"{f}: token id {int(arr[pos])} at token {pos} is >= the model's vocab size {vocab_size}",
                                hint="the data was tokenized with another tokenizer; set data.tokenizer to match")
    return train, val
