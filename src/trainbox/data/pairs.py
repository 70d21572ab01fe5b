"""Preference data in training (train.objective=dpo): the token files of data/preference.py, memory-mapped and cut to
data.seq_len by its truncation rule (`fit`), as the loop's batches of pairs (or of examples, dpo.loss=kto). A raw
JSONL data.path is prepared first, into data.cache_dir, keyed by the file, the tokenizer and the chat template; a
prepared set whose manifest names another tokenizer than the run's is refused (data/identity.py)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from trainbox.config.preference import UNPAIRED_LOSSES
from trainbox.data import manifest
from trainbox.data.identity import check_prepared
from trainbox.data.packing import first_fit_decreasing
from trainbox.data.preference import (
    PARTS,
    describe,
    fit,
    no_room,
    part_path,
    prepare_pairs,
    prepared_kind,
)
from trainbox.data.readers import JSONL_SUFFIXES
from trainbox.data.sources import check_vocab, default_cache_dir
from trainbox.errors import DataError

log = logging.getLogger("trainbox")


class PairDataset:
    """Memory-mapped pairs cut to data.seq_len by `fit`; `batch` gives the loop's micro-batches: the chosen
    sequences, then the rejected ones (2 x B rows), padded to seq_len with mask-0 end-of-text tokens, with the
    reference log-probabilities once `reference` (N x 2: chosen, rejected) is set. The BatchOrder draws pairs as it
    draws a TokenDataset's windows (data/loader.py)."""

    unit = "pairs"

    def __init__(self, prefix: Path, split: str, seq_len: int, max_prompt: int | None, pad_id: int, name: str,
                 kind: str = "pairs"):
        self.prefix, self.split, self.seq_len, self.pad_id, self.name = prefix, split, seq_len, pad_id, name
        self.kind, self.files = kind, [part_path(prefix, split, p, kind) for p in PARTS]
        self.tokens, self.mask, self.index = (np.load(f, mmap_mode="r") for f in self.files)
        cols = np.asarray(self.index)
        self.source = cols[:, 4:6]   # (file, line) of each pair's row
        self._check_prompts(cols[:, 1], max_prompt)
        self.kept = fit(cols[:, 1], cols[:, 2], cols[:, 3], seq_len, max_prompt)
        self.prompts_cut = int((self.kept[0] < cols[:, 1]).sum())
        self.responses_cut = int(((self.kept[1] < cols[:, 2]) | (self.kept[2] < cols[:, 3])).sum())
        self.num_samples = self.num_pairs = len(cols)
        self.num_tokens = len(self.tokens)
        self.arrays, self.masks = [self.tokens], [self.mask]   # as TokenDataset: the data behind the pairs
        self.reference: np.ndarray | None = None
        self.score_pad: int | None = None   # a reward model's padding id (data/tokenizer.py pad_id), where one reads
        self.report = {"pairs": self.num_pairs, "prompts_cut": self.prompts_cut, "responses_cut": self.responses_cut}

    def _check_prompts(self, prompts: np.ndarray, max_prompt: int | None) -> None:
        """DataError naming the first row whose prompt the truncation rule cannot cut to leave a response room."""
        too_long = no_room(prompts, self.seq_len, max_prompt)
        if len(too_long):
            first = int(too_long[0])
            raise DataError(f"{self._where(first)}: the prompt has {int(prompts[first])} tokens, and cut to "
                            f"max_prompt_len={max_prompt} it leaves no room for a response in data.seq_len="
                            f"{self.seq_len} ({len(too_long)} such {self.unit} in {self.name})",
                            hint=f"give dpo.max_prompt_len (reward.max_prompt_len) below {self.seq_len}, or leave it "
                                 "out (default: half of data.seq_len)")

    def _where(self, i: int) -> str:
        path = manifest.manifest_path(self.prefix)
        m = manifest.read_manifest(path) if path.is_file() else {}
        sources = m.get("sources") or []
        f, line = int(self.source[i, 0]), int(self.source[i, 1])
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

    def _cut(self, prompt: slice, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of the tokens `prompt` followed by the `n` from `start`."""
        kp = prompt.stop - prompt.start
        return (np.concatenate([self.tokens[prompt], self.tokens[start:start + n]]),
                np.concatenate([np.zeros(kp, np.uint8), self.mask[start:start + n]]))

    def sequences(self, i: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of pair i's chosen and rejected sequences, as the truncation rule cuts them."""
        start, p, c, _, _, _ = (int(v) for v in self.index[i])
        kp, kc, kr = (int(k[i]) for k in self.kept)
        prompt = slice(start + p - kp, start + p)
        return self._cut(prompt, start + p, kc), self._cut(prompt, start + p + c, kr)

    def _rows(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, mask) of shape (2B, seq_len + 1): each index's first sequence, then the second ones."""
        B = len(indices)
        toks = np.full((2 * B, self.seq_len + 1), self.pad_id, dtype=np.int64)
        mask = np.zeros((2 * B, self.seq_len + 1), dtype=np.bool_)
        for b, i in enumerate(indices):
            for row, (ids, m) in zip((b, B + b), self.sequences(int(i))):
                toks[row, :len(ids)] = ids
                mask[row, :len(m)] = m
        return toks, mask

    def _reference_of(self, indices) -> torch.Tensor:
        ref = self.reference[np.asarray(indices, dtype=np.int64)]
        return torch.from_numpy(np.concatenate([ref[:, 0], ref[:, 1]]).astype(np.float32))

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """x, y, loss_mask: (2B, seq_len), chosen rows first; ref_logps (2B,) where the reference is set; score_at
        (2B,) where `score_pad` is: each sequence's last position in x whose token is not that id (0 where none is),
        the one a reward model scores (all of a sequence lies in x: the truncation keeps it within seq_len)."""
        toks, mask = self._rows(indices)
        t = torch.from_numpy(toks)
        out = {"x": t[:, :-1], "y": t[:, 1:], "loss_mask": torch.from_numpy(mask[:, 1:])}
        if self.reference is not None:
            out["ref_logps"] = self._reference_of(indices)
        if self.score_pad is not None:
            kp, kc, kr = (k[np.asarray(indices, dtype=np.int64)] for k in self.kept)
            lengths = np.concatenate([kp + kc, kp + kr])[:, None]
            x = toks[:, :-1]
            pos = np.arange(x.shape[1])[None, :]
            out["score_at"] = torch.from_numpy((pos * ((pos < lengths) & (x != self.score_pad))).argmax(-1))
        return out

    def identity(self) -> list:
        """What the pairs are (file names, sizes, modification times), for keys of what is derived from them."""
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]


class UnpairedDataset(PairDataset):
    """dpo.loss=kto's examples, each a prompt and a completion labelled desirable or not: an examples set, or a
    pair set read as two examples a pair (2i its chosen response, desirable; 2i + 1 its rejected one). Example i
    gives two sequences: its own (trained), and its prompt with the completion of example (i + N // 2) mod N, the
    mismatched pair KTO's KL estimate reads. The partner is fixed by the data, not drawn with the batch (TRL rotates
    completions within each device's batch): the estimate is then the same on any number of processes, and the
    reference's log-probabilities of both sequences can be computed once. Half the set away, a pair set's two
    examples of one prompt are never partners. Both sequences are cut by `fit`, as a pair's two responses are.

    `batch`: x, y, loss_mask (B rows, the examples' own sequences), kl_x, kl_y, kl_loss_mask (B rows, the
    mismatched ones), label (B, true: desirable), ref_logps (2B: own, then mismatched) where the reference is set."""

    unit = "examples"

    def __init__(self, prefix: Path, split: str, seq_len: int, max_prompt: int | None, pad_id: int, name: str,
                 kind: str):
        self.prefix, self.split, self.seq_len, self.pad_id, self.name = prefix, split, seq_len, pad_id, name
        self.kind, self.files = kind, [part_path(prefix, split, p, kind) for p in PARTS]
        self.tokens, self.mask, self.index = (np.load(f, mmap_mode="r") for f in self.files)
        cols = np.asarray(self.index)
        if kind == "pairs":   # 2i: chosen, desirable; 2i + 1: rejected
            start, p, c, r = cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]
            self.prompt_start, self.prompt_len = np.repeat(start, 2), np.repeat(p, 2)
            self.completion_start = np.stack([start + p, start + p + c], 1).reshape(-1)
            self.completion_len = np.stack([c, r], 1).reshape(-1)
            self.label = np.tile(np.array([True, False]), len(cols))
            self.source = np.repeat(cols[:, 4:6], 2, axis=0)
        else:
            self.prompt_start, self.prompt_len = cols[:, 0], cols[:, 1]
            self.completion_start, self.completion_len = cols[:, 0] + cols[:, 1], cols[:, 2]
            self.label, self.source = cols[:, 3].astype(bool), cols[:, 4:6]
        n = self.num_samples = self.num_pairs = len(self.label)
        if n < 2:
            raise DataError(f"{name}: {n} example; KTO's KL estimate pairs each prompt with another example's "
                            "completion, so a set needs at least 2", hint="add examples, or leave out the val set")
        self._check_prompts(self.prompt_len, max_prompt)
        self.partner = (np.arange(n) + n // 2) % n
        self.kept = fit(self.prompt_len, self.completion_len, self.completion_len[self.partner], seq_len, max_prompt)
        self.prompts_cut = int((self.kept[0] < self.prompt_len).sum())
        self.responses_cut = int((self.kept[1] < self.completion_len).sum())
        self.desirable = int(self.label.sum())
        self.num_tokens = len(self.tokens)
        self.arrays, self.masks = [self.tokens], [self.mask]
        self.reference = None
        self.report = {"examples": n, "desirable": self.desirable, "prompts_cut": self.prompts_cut,
                       "responses_cut": self.responses_cut}

    def describe(self) -> str:
        return (f"{self.name}: {self.num_samples:,} examples, {self.desirable:,} desirable and "
                f"{self.num_samples - self.desirable:,} not, each with its prompt in a row of {self.seq_len} positions "
                f"and again with another example's completion (the KL estimate's); {self.prompts_cut:,} lose the "
                f"start of their prompt, {self.responses_cut:,} the end of their completion")

    def target_count(self, indices) -> int:
        """Trained tokens of the examples `indices` (their own sequences)."""
        return int(sum(int(self.sequences(int(i))[0][1][1:].sum()) for i in indices))

    def sequences(self, i: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of example i's own sequence and of its prompt with its partner's completion."""
        ps, p, j = int(self.prompt_start[i]), int(self.prompt_len[i]), int(self.partner[i])
        kp, kc, kr = (int(k[i]) for k in self.kept)
        prompt = slice(ps + p - kp, ps + p)
        return (self._cut(prompt, int(self.completion_start[i]), kc),
                self._cut(prompt, int(self.completion_start[j]), kr))

    def batch(self, indices) -> dict[str, torch.Tensor]:
        toks, mask = self._rows(indices)
        B = len(indices)
        t, m = torch.from_numpy(toks), torch.from_numpy(mask[:, 1:])
        out = {"x": t[:B, :-1], "y": t[:B, 1:], "loss_mask": m[:B], "kl_x": t[B:, :-1], "kl_y": t[B:, 1:],
               "kl_loss_mask": m[B:], "label": torch.from_numpy(self.label[np.asarray(indices, dtype=np.int64)])}
        if self.reference is not None:
            out["ref_logps"] = self._reference_of(indices)
        return out


class PackedPairs:
    """Pairs packed into rows of 2 x seq_len positions (data.packing=true under train.objective=dpo): each pair's
    chosen and rejected sequences whole and side by side in one row, pairs placed by first-fit decreasing on their
    positions (data/packing.py), attention and positions restarting at each sequence. Unpacked, a micro-batch of B
    pairs is 2B rows of seq_len positions, each padded; packed, it is B rows of 2 x seq_len holding as many pairs
    as fit, so the same tensor shapes carry more pairs where responses are shorter than seq_len. A sample is a row
    and train.global_batch_size counts rows; the objective's mean is over the pairs in them (`pairs_in`).

    `batch` adds to x, y, loss_mask (B, 2T), doc_ids and position_ids (data/packing.py), seq_index (B, 2T: the slot
    of each position's sequence, chosen of slot s = s, rejected = P + s, padding 2P) and pair_valid (P = B x the
    most pairs any row holds); ref_logps (2P: chosen slots, then rejected) where the pairs' reference is set."""

    unit = "pairs"

    def __init__(self, pairs: PairDataset):
        self.pairs, self.seq_len, self.name = pairs, pairs.seq_len, pairs.name
        self.row_len = 2 * pairs.seq_len
        kp, kc, kr = (np.asarray(k, dtype=np.int64) for k in pairs.kept)
        self.lengths = 2 * kp + kc + kr - 2   # positions: a sequence of n tokens takes n - 1
        rows = first_fit_decreasing(self.lengths, self.row_len)
        self.row_offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        self.row_pairs = np.asarray([i for r in rows for i in r], dtype=np.int64)
        self.per_row = max((len(r) for r in rows), default=1)
        self.arrays, self.masks, self.num_tokens = pairs.arrays, pairs.masks, pairs.num_tokens
        self.report = {**pairs.report, "rows": len(rows), "packed": True,
                       "fill": int(self.lengths.sum()) / max(1, len(rows) * self.row_len)}

    @property
    def num_samples(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def reference(self) -> np.ndarray | None:
        return self.pairs.reference

    def describe(self) -> str:
        return (f"{self.pairs.describe()}; packed by first-fit decreasing into {self.num_samples:,} rows of "
                f"{self.row_len} positions ({100 * self.report['fill']:.1f}% filled, up to {self.per_row} pairs a "
                f"row)")

    def tail_tokens(self) -> int:
        return 0

    def _pairs_of(self, row: int) -> np.ndarray:
        return self.row_pairs[self.row_offsets[row]:self.row_offsets[row + 1]]

    def pairs_in(self, indices) -> int:
        """Pairs in the rows `indices` (what a step's mean is over)."""
        rows = np.asarray(indices, dtype=np.int64)
        return int((self.row_offsets[rows + 1] - self.row_offsets[rows]).sum())

    def target_count(self, indices) -> int:
        return int(sum(self.pairs.target_count(self._pairs_of(int(r))) for r in indices))

    def identity(self) -> list:
        return self.pairs.identity()

    def batch(self, indices) -> dict[str, torch.Tensor]:
        B, T, R = len(indices), self.row_len, self.per_row
        P = B * R
        x = np.full((B, T), self.pairs.pad_id, dtype=np.int64)
        y = np.full((B, T), self.pairs.pad_id, dtype=np.int64)
        loss = np.zeros((B, T), dtype=np.bool_)
        docs = np.empty((B, T), dtype=np.int32)
        pos = np.empty((B, T), dtype=np.int64)
        slot = np.full((B, T), 2 * P, dtype=np.int64)
        valid = np.zeros(P, dtype=np.bool_)
        which = np.zeros(P, dtype=np.int64)   # the pair in each slot (0 where none)
        arange = np.arange(T)
        for b, r in enumerate(indices):
            p = d = 0
            for k, i in enumerate(self._pairs_of(int(r)).tolist()):
                s = b * R + k
                valid[s], which[s] = True, i
                for seq, (ids, m) in zip((s, P + s), self.pairs.sequences(i)):
                    n = len(ids) - 1
                    x[b, p:p + n], y[b, p:p + n], loss[b, p:p + n] = ids[:-1], ids[1:], m[1:]
                    docs[b, p:p + n], pos[b, p:p + n], slot[b, p:p + n] = d, arange[:n], seq
                    p, d = p + n, d + 1
            docs[b, p:], pos[b, p:] = d, arange[:T - p]   # the padding: a sequence of its own
        out = {"x": torch.from_numpy(x), "y": torch.from_numpy(y), "loss_mask": torch.from_numpy(loss),
               "doc_ids": torch.from_numpy(docs), "position_ids": torch.from_numpy(pos),
               "seq_index": torch.from_numpy(slot), "pair_valid": torch.from_numpy(valid)}
        if self.reference is not None:
            ref = np.where(valid[:, None], self.reference[which], 0.0)
            out["ref_logps"] = torch.from_numpy(np.concatenate([ref[:, 0], ref[:, 1]]).astype(np.float32))
        return out


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
    if prepared_kind(path) is not None:
        return Path(path)
    raise DataError(f"{label}={path} holds no preference data: train.objective=dpo and reward read preference JSONL "
                    f"(.jsonl, .jsonl.gz) or the output of `trainbox prepare` on it ({path}_train_pairs.*.npy, or "
                    f"_examples for unpaired rows)",
                    hint=f"trainbox prepare PREFS.jsonl --out PREFIX --tokenizer TOKENIZER, then {label}=PREFIX")


def _check_tokenizer(prefix: Path, tok, label: str, path: str) -> None:
    """DataError when the manifest of the prepared set `prefix` names another tokenizer than the run's `tok`
    (data/identity.py's rule)."""
    man = manifest.manifest_path(prefix)
    if man.is_file():
        check_prepared(man, manifest.read_manifest(man), tok, label, path)


def _kind(prefix: Path, label: str, path: str, examples: bool) -> str:
    kind = prepared_kind(prefix) or "pairs"
    if kind == "examples" and not examples:
        raise DataError(f"{label}={path} holds unpaired examples (completion, label), and dpo.loss=dpo, ipo, simpo "
                        "and orpo train on pairs of responses to one prompt", hint="train them with dpo.loss=kto")
    return kind


def open_pair_datasets(data, dpo, tok, vocab_size: int) -> tuple[PairDataset, PairDataset | None]:
    """(train, val) of data.path (val: data.val_path, else the prefix's val split where it has one): pairs, or
    under dpo.loss=kto examples (UnpairedDataset). `dpo`: the dpo section, or the reward one (pairs, its
    max_prompt_len)."""
    examples = getattr(dpo, "loss", None) in UNPAIRED_LOSSES
    train_prefix = _prefix(data.path, tok, data, "data.path")
    _check_tokenizer(train_prefix, tok, "data.path", data.path)
    kinds = [_kind(train_prefix, "data.path", data.path, examples)]
    if data.val_path:   # a set of its own: its val split where it has one, else all of it
        val_prefix = _prefix(data.val_path, tok, data, "data.val_path")
        _check_tokenizer(val_prefix, tok, "data.val_path", data.val_path)
        kinds.append(_kind(val_prefix, "data.val_path", data.val_path, examples))
        val_split = "val" if part_path(val_prefix, "val", "tokens", kinds[1]).is_file() else "train"
    else:
        val_prefix, val_split = train_prefix, "val"
        kinds.append(kinds[0])
    sets = []
    for prefix, split, label, kind in ((train_prefix, "train", "train", kinds[0]),
                                       (val_prefix, val_split, "val", kinds[1])):
        files = [part_path(prefix, split, p, kind) for p in PARTS]
        unit = "examples" if examples else "pairs"
        if not files[0].is_file():
            if label == "train":
                raise DataError(f"data.path={data.path}: no training {unit} ({files[0]} is missing)",
                                hint="prepare the set again with `trainbox prepare ... --overwrite`")
            sets.append(None)
            continue
        manifest.check_output_sets(files)
        cls = UnpairedDataset if examples else PairDataset
        ds = cls(prefix, split, data.seq_len, dpo.max_prompt_len, tok.eot_id, f"{prefix} ({label} {unit})", kind)
        check_vocab(ds.tokens, files[0], tok.vocab_size, tokenizer=tok.name, model_vocab=vocab_size)
        sets.append(ds)
    return sets[0], sets[1]
