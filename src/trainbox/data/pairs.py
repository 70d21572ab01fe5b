"""Preference pairs in training (train.objective=dpo): the token files of data/preference.py, memory-mapped and cut to
data.seq_len by its truncation rule (`fit`), as the loop's batches of pairs. A raw JSONL data.path is prepared first,
into data.cache_dir, keyed by the file, the tokenizer and the chat template."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from trainbox.data import manifest
from trainbox.data.preference import PARTS, describe, fit, part_path, prepare_pairs
from trainbox.data.readers import JSONL_SUFFIXES
from trainbox.data.sources import check_vocab, default_cache_dir
from trainbox.errors import DataError

log = logging.getLogger("trainbox")


class PairDataset:
    """Memory-mapped pairs cut to data.seq_len by `fit`; `batch` gives the loop's micro-batches: the chosen
    sequences, then the rejected ones (2 x B rows), padded to seq_len with mask-0 end-of-text tokens, with the
    reference log-probabilities once `reference` (N x 2: chosen, rejected) is set. The BatchOrder draws pairs as it
    draws a TokenDataset's windows (data/loader.py)."""

    def __init__(self, prefix: Path, split: str, seq_len: int, max_prompt: int | None, pad_id: int, name: str):
        self.prefix, self.split, self.seq_len, self.pad_id, self.name = prefix, split, seq_len, pad_id, name
        self.files = [part_path(prefix, split, p) for p in PARTS]
        self.tokens, self.mask, self.index = (np.load(f, mmap_mode="r") for f in self.files)
        cols = np.asarray(self.index)
        too_long = np.flatnonzero(cols[:, 1] >= seq_len)
        if len(too_long):
            first = int(too_long[0])
            raise DataError(f"{self._where(first)}: the prompt has {int(cols[first, 1])} tokens, which leaves no "
                            f"room for a response in data.seq_len={seq_len} ({len(too_long)} such pairs in {name})",
                            hint="raise data.seq_len, or leave those rows out")
        self.kept = fit(cols[:, 1], cols[:, 2], cols[:, 3], seq_len, max_prompt)
        self.prompts_cut = int((self.kept[0] < cols[:, 1]).sum())
        self.responses_cut = int(((self.kept[1] < cols[:, 2]) | (self.kept[2] < cols[:, 3])).sum())
        self.num_samples = self.num_pairs = len(cols)
        self.num_tokens = len(self.tokens)
        self.arrays, self.masks = [self.tokens], [self.mask]   # as TokenDataset: the data behind the pairs
        self.reference: np.ndarray | None = None
        self.report = {"pairs": self.num_pairs, "prompts_cut": self.prompts_cut, "responses_cut": self.responses_cut}

    def _where(self, i: int) -> str:
        path = manifest.manifest_path(self.prefix)
        m = manifest.read_manifest(path) if path.is_file() else {}
        sources = m.get("sources") or []
        f, line = int(self.index[i, 4]), int(self.index[i, 5])
        return f"{sources[f] if f < len(sources) else self.files[2]}:{line}"

    def describe(self) -> str:
        """One line for the run's log: the pairs and what the truncation rule cuts."""
        return (f"{self.name}: {self.num_pairs:,} pairs, each response with its prompt in a row of {self.seq_len} "
                f"positions; {self.prompts_cut:,} lose the start of their prompt, {self.responses_cut:,} the ends of "
                f"their responses")

    def tail_tokens(self) -> int:
        """Tokens no row trains on: none (what truncation cuts is counted in `describe`)."""
        return 0

    def target_count(self, indices) -> int:
        """Trained tokens of the pairs `indices`, both responses (the preference objective averages over pairs)."""
        return int(sum(int(m[1:].sum()) for i in indices for _, m in self.sequences(int(i))))

    def sequences(self, i: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of pair i's chosen and rejected sequences, as the truncation rule cuts them."""
        start, p, c, _, _, _ = (int(v) for v in self.index[i])
        kp, kc, kr = (int(k[i]) for k in self.kept)
        prompt = slice(start + p - kp, start + p)
        out = []
        for s, n in ((start + p, kc), (start + p + c, kr)):
            ids = np.concatenate([self.tokens[prompt], self.tokens[s:s + n]])
            mask = np.concatenate([np.zeros(kp, np.uint8), self.mask[s:s + n]])
            out.append((ids, mask))
        return out[0], out[1]

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """x, y, loss_mask: (2B, seq_len), chosen rows first; ref_logps (2B,) where the reference is set."""
        B = len(indices)
        toks = np.full((2 * B, self.seq_len + 1), self.pad_id, dtype=np.int64)
        mask = np.zeros((2 * B, self.seq_len + 1), dtype=np.bool_)
        for b, i in enumerate(indices):
            for row, (ids, m) in zip((b, B + b), self.sequences(int(i))):
                toks[row, :len(ids)] = ids
                mask[row, :len(m)] = m
        t = torch.from_numpy(toks)
        out = {"x": t[:, :-1], "y": t[:, 1:], "loss_mask": torch.from_numpy(mask[:, 1:])}
        if self.reference is not None:
            ref = self.reference[np.asarray(indices, dtype=np.int64)]
            out["ref_logps"] = torch.from_numpy(np.concatenate([ref[:, 0], ref[:, 1]]).astype(np.float32))
        return out

    def identity(self) -> list:
        """What the pairs are (file names, sizes, modification times), for keys of what is derived from them."""
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]


def _raw(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES) and os.path.isfile(path)


def _complete(out: Path) -> bool:
    man = manifest.manifest_path(out)
    return man.is_file() and manifest.read_manifest(man).get("state") == "complete"


def _prepare_apart(path: str, folder: Path, tok, data) -> None:
    """Prepare `path` into a folder of this process's own, then rename it to `folder` in one step: the ranks of a
    run that all find no prepared set each prepare the same one, the first rename wins and the others discard
    theirs, so no process reads a set another is writing."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    st = prepare_pairs([path], str(tmp / "data"), tok, tok.name, data.chat_template, overwrite=True)
    if folder.is_dir() and not _complete(folder / "data"):   # the remains of an interrupted older prepare
        shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rename(tmp, folder)
    except OSError:   # another process put the same set there first
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete(folder / "data"):
            raise
    log.info(f"data: {path}: {describe(st)} (prepared into {folder})")


def _prefix(path: str, tok, data, label: str) -> Path:
    """data.path (or data.val_path) -> the prefix of its pair files: a raw JSONL file prepared into the cache (keyed
    by the file, the tokenizer and the template), or a `trainbox prepare --out` prefix."""
    if _raw(path):
        st = os.stat(path)
        key = hashlib.sha256(json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, tok.name, tok.vocab_size,
                                         data.chat_template, "pairs-v1"]).encode()).hexdigest()[:16]
        folder = default_cache_dir(data) / f"pairs-{Path(path).name.split('.')[0]}-{key}"
        if not _complete(folder / "data"):
            _prepare_apart(path, folder, tok, data)
        return folder / "data"
    if part_path(path, "train", "tokens").is_file() or part_path(path, "val", "tokens").is_file():
        return Path(path)
    raise DataError(f"{label}={path} holds no preference pairs: train.objective=dpo reads preference JSONL "
                    f"(.jsonl, .jsonl.gz) or the output of `trainbox prepare` on it ({path}_train_pairs.*.npy)",
                    hint=f"trainbox prepare PREFS.jsonl --out PREFIX --tokenizer TOKENIZER, then {label}=PREFIX")


def open_pair_datasets(data, dpo, tok, vocab_size: int) -> tuple[PairDataset, PairDataset | None]:
    """(train, val) pairs of data.path (val: data.val_path, else the prefix's val split where it has one)."""
    train_prefix = _prefix(data.path, tok, data, "data.path")
    if data.val_path:   # a set of its own: its val split where it has one, else all of it
        val_prefix = _prefix(data.val_path, tok, data, "data.val_path")
        val_split = "val" if part_path(val_prefix, "val", "tokens").is_file() else "train"
    else:
        val_prefix, val_split = train_prefix, "val"
    sets = []
    for prefix, split, label in ((train_prefix, "train", "train"), (val_prefix, val_split, "val")):
        files = [part_path(prefix, split, p) for p in PARTS]
        if not files[0].is_file():
            if label == "train":
                raise DataError(f"data.path={data.path}: no training pairs ({files[0]} is missing)",
                                hint="prepare the set again with `trainbox prepare ... --overwrite`")
            sets.append(None)
            continue
        manifest.check_output_sets(files)
        ds = PairDataset(prefix, split, data.seq_len, dpo.max_prompt_len, tok.eot_id, f"{prefix} ({label} pairs)")
        check_vocab(ds.tokens, files[0], min(vocab_size, tok.vocab_size), tokenizer=tok.name)
        sets.append(ds)
    return sets[0], sets[1]
