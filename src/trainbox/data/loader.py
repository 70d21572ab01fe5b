"""Deterministic, resumable, world-size-independent batches (docs/architecture.md, "From config to step").

A sample is a packed window of `seq_len + 1` tokens over one token file; an epoch is one pass over all
samples in a seeded permutation. The global batch at step `s` is a pure function of (seed, s):

    epoch, pos = divmod(s, steps_per_epoch)
    ids        = permutation(seed, epoch)[pos * G : (pos + 1) * G]

Rank r of W takes ids[r * G/W : (r+1) * G/W] and cuts it into `accum = G / (micro * W)` micro-batches,
so micro-batch k of rank r is always global slice (r * accum + k): the partition of a global batch
into micro-batches does not depend on W, and a resume on another number of GPUs continues the same
sequence of global batches. The loader's whole state is the step number. Fine-tuning examples come as rows
instead of windows (data/packing.py ExampleDataset: packed or padded); the order is drawn the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainbox.data import formats
from trainbox.errors import DataError


class TokenDataset:
    """Packed windows over one or more token arrays (memory-mapped). Windows never cross files."""

    def __init__(self, arrays: list[np.ndarray], seq_len: int, name: str = "data",
                 masks: list[np.ndarray | None] | None = None, transform=None):
        if masks is not None and all(m is None for m in masks):
            masks = None
        if masks is not None:  # files without a mask train on every token
            masks = [AllOnes(len(a)) if m is None else m for a, m in zip(arrays, masks)]
        self.arrays, self.masks, self.seq_len, self.name = arrays, masks, seq_len, name
        # transform(windows (B, seq_len + 1), sample indices) -> batch dict, for families whose examples
        # are not next-token windows (t5: span corruption, data/spans.py); transform.target_count(indices) is
        # the number of targets its batches of those samples train
        self.transform = transform
        per_file = [max(0, (len(a) - 1) // seq_len) for a in arrays]
        self.offsets = np.concatenate([[0], np.cumsum(per_file)]).astype(np.int64)
        self.num_tokens = int(sum(len(a) for a in arrays))

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    def window(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        f = int(np.searchsorted(self.offsets, i, side="right") - 1)
        start = (i - int(self.offsets[f])) * self.seq_len
        toks = self.arrays[f][start:start + self.seq_len + 1]
        mask = self.masks[f][start:start + self.seq_len + 1] if self.masks is not None else None
        return toks, mask

    def target_count(self, indices) -> int:
        """Targets that carry loss in the samples `indices` (the transform's, where one makes the batches)."""
        if self.transform is not None:
            return self.transform.target_count(indices)
        if self.masks is None:
            return len(indices) * self.seq_len
        return int(sum(int(self.window(int(i))[1][1:].sum()) for i in indices))

    def tail_tokens(self) -> int:
        """The tokens at the end of each file that do not fill a window (windows never cross files)."""
        windows = np.diff(self.offsets)      # per file; the last window's final token is a target
        return int(sum(len(a) - (int(n) * self.seq_len + 1 if n else 0) for a, n in zip(self.arrays, windows)))

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """Inputs x, targets y (int64, shape B x T); `loss_mask` where the data carries one."""
        toks, masks = zip(*(self.window(int(i)) for i in indices))
        arr = torch.from_numpy(np.stack(toks).astype(np.int64))
        if self.transform is not None:
            return self.transform(arr, indices)
        out = {"x": arr[:, :-1], "y": arr[:, 1:]}
        if self.masks is not None:
            out["loss_mask"] = torch.from_numpy(np.stack(masks)[:, 1:].astype(np.bool_))
        return out


class AllOnes:
    """The mask of a file that has none: every token trains (no memory spent on it)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, sl: slice) -> np.ndarray:
        return np.ones(len(range(*sl.indices(self.n))), dtype=np.uint8)


@dataclass
class BatchOrder:
    """Which samples every rank sees at every step, for a layout that keeps the global batch (config/layout.py
    decides it: global_batch = micro_batch x accum x world). `repeat`: each global batch trains that many steps in a
    row (grpo.num_iterations), so an epoch takes that many times the steps."""

    dataset: TokenDataset       # or data/packing.py's ExampleDataset (rows of examples)
    global_batch: int
    micro_batch: int
    world: int = 1
    rank: int = 0
    seed: int = 0
    repeat: int = 1

    def __post_init__(self):
        self.accum = self.global_batch // (self.micro_batch * self.world)
        self._perm_epoch, self._perm = -1, None

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset.num_samples // self.global_batch * self.repeat

    def target_tokens(self, step: int) -> int:
        """Target tokens that carry loss in the global batch of `step` (the same number on every rank)."""
        return self.dataset.target_count(self.global_indices(step))

    def check_nonempty(self) -> None:
        if self.steps_per_epoch == 0:
            raise DataError(zero_steps(self.dataset, self.global_batch))

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.dataset.num_samples), epoch
        return self._perm

    def global_indices(self, step: int) -> np.ndarray:
        epoch, pos = divmod(step // self.repeat, self.steps_per_epoch // self.repeat)
        return self.permutation(epoch)[pos * self.global_batch:(pos + 1) * self.global_batch]

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        ids = self.global_indices(step)
        per_rank = self.global_batch // self.world
        mine = ids[self.rank * per_rank:(self.rank + 1) * per_rank]
        return [self.dataset.batch(mine[k * self.micro_batch:(k + 1) * self.micro_batch]) for k in range(self.accum)]


def to_device(batches: list[dict[str, torch.Tensor]], device: torch.device,
              pin: bool) -> list[dict[str, torch.Tensor]]:
    """A step's micro-batches on `device`: each field of all of them stacked into one host tensor
    (page-locked when `pin`) and sent in one asynchronous copy. A copy from pageable memory waits for the
    GPU's queue to drain (x = w[:, :-1] and y = w[:, 1:] are views, which torch would make contiguous in
    pageable memory: one blocking copy per field and micro-batch). A BatchOrder's micro-batches all have one
    shape."""
    fields = {}
    for key, t in batches[0].items():
        host = torch.empty((len(batches), *t.shape), dtype=t.dtype, pin_memory=pin)
        torch.stack([b[key] for b in batches], out=host)
        fields[key] = host.to(device, non_blocking=pin)
    return [{k: v[i] for k, v in fields.items()} for i in range(len(batches))]


def unused_data(dataset: TokenDataset, global_batch: int) -> tuple[int, int, str | None]:
    """Data a run never trains on, said out loud rather than dropped without a word.

    -> (tail tokens, samples per epoch, message or None). Tail tokens: the end of each file that does
    not fill a window (windows never cross files). Samples per epoch: beyond the last full global batch
    of an epoch; every epoch draws a new permutation, so a different few sit out each time."""
    tails = dataset.tail_tokens()
    skipped = dataset.num_samples % global_batch if global_batch <= dataset.num_samples else 0
    if not tails and not skipped:
        return 0, 0, None
    parts = []
    if tails:
        parts.append(f"{tails:,} tokens ({100 * tails / max(1, dataset.num_tokens):.2g}%) at the ends of "
                     f"{len(dataset.arrays)} file(s) do not fill a window of {dataset.seq_len} tokens")
    if skipped:
        parts.append(f"{skipped} of {dataset.num_samples:,} samples per epoch fall beyond the last full "
                     f"global batch of {global_batch} (a different {skipped} each epoch)")
    return tails, skipped, f"{dataset.name}: not trained on: " + "; ".join(parts)


def zero_steps(dataset, global_batch: int) -> str:
    """Why an epoch of `dataset` has no step of `global_batch` samples, in data.seq_len's terms: where a transform
    makes the samples (t5's span corruption), data.seq_len is its length, and each sample reads a longer window."""
    d, transform = dataset, getattr(dataset, "transform", None)
    longest = max((len(a) for a in d.arrays), default=0)
    if transform is not None and hasattr(transform, "seq_len_for"):
        return zero_steps_message(d.name, d.num_samples, transform.seq_len, global_batch, d.num_tokens, longest,
                                  window=d.seq_len, fits=transform.seq_len_for(longest - 1))
    return zero_steps_message(d.name, d.num_samples, d.seq_len, global_batch, d.num_tokens, longest)


def zero_steps_message(name: str, samples: int, seq_len: int, global_batch: int, tokens: int, longest: int,
                       window: int | None = None, fits: int | None = None) -> str:
    """The zero-steps error: `samples` of data.seq_len=`seq_len` in `tokens` (the longest file `longest`); `window`:
    the tokens a sample reads (+1) where that is not seq_len, `fits`: the largest data.seq_len of one sample in the
    longest file where that is not longest - 1."""
    reads = f" tokens (each read from a window of {window} (+1) tokens)" if window is not None else " (+1) tokens"
    if samples == 0:   # not one window: the sequence length is the setting to change
        fits = longest - 1 if window is None else fits
        at_most = f" (at most {fits} here)" if fits and fits >= 8 else ""
        return (f"{name}: the training data holds {tokens:,} tokens (the longest file {longest:,}), fewer than one "
                f"sample of data.seq_len={seq_len}{reads}, so an epoch has 0 steps. Lower data.seq_len"
                f"{at_most}, or add more training data")
    each = f" (each read from a window of {window})" if window is not None else ""
    return (f"{name}: {samples} samples of data.seq_len={seq_len} tokens{each} is fewer than one global batch of "
            f"{global_batch} sequences, so an epoch has 0 steps. Add more data, or lower train.global_batch_size "
            f"(at most {samples}) or data.seq_len")


def open_tokens(path: Path, fmt: str = "auto") -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens, loss mask or None) of a shard, a Megatron prefix or a flat uint16 file, memory-mapped;
    `fmt` is data.format (auto, shard, megatron, flat: data/formats.py says what each accepts)."""

    return formats.open_tokens(path, fmt)


def eval_batches(dataset: TokenDataset, eval_tokens: int, micro_batch: int, world: int = 1, rank: int = 0):
    """The fixed validation slice: the first eval_tokens // seq_len samples, split among ranks. Every rank yields
    as many batches as rank 0 (expert parallelism needs every rank in every forward): a rank whose share ends
    first pads with a batch whose loss mask is all False."""
    n = min(dataset.num_samples, max(1, eval_tokens // dataset.seq_len))
    if n == 0:
        raise DataError(f"{dataset.name}: validation data holds no complete sample of {dataset.seq_len + 1} tokens",
                        hint="add validation data or lower data.seq_len")
    ids = np.arange(n)[rank::world]
    for k in range(0, len(range(0, n, world)), micro_batch):
        if k < len(ids):
            yield dataset.batch(ids[k:k + micro_batch])
        else:
            pad = dataset.batch(np.arange(min(micro_batch, n)))
            yield {**pad, "loss_mask": torch.zeros_like(pad["y"], dtype=torch.bool)}
