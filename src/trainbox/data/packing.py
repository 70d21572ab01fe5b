"""Whole examples in rows of `data.seq_len` positions: fine-tuning examples (data/sft.py), or any data that comes as
examples. `data.packing` says how they fill the rows:

    packing: true    examples packed into rows by first-fit decreasing (longest first, each into the first row
                     with room: a pure function of the lengths), never split across rows; the rest of a row is
                     padding. Attention stays inside each example and positions restart at each example's start.
    packing: false   one example per row, padded; plain causal attention needs nothing more (the baseline).

An example of n tokens gives n - 1 (input, target) pairs and takes n - 1 positions of a row, so a row of seq_len
positions holds an example of up to seq_len + 1 tokens; data/sft.py truncates longer ones to their first
seq_len + 1 tokens and counts them. A packed batch carries, beside x, y and loss_mask (B, T):

    doc_ids       int32   each position's example in its row, numbered 0, 1, ... (the padding after the last)
    position_ids  int64   its position inside that example (0 at the example's first token)

which the loop passes to the model's forward (`packed_inputs`); a family that can take them declares it
(model/spec.py `Family.packing`), and its attention kernel is kernels/packed.py's.
"""
from __future__ import annotations

import numpy as np
import torch

PACKED_FIELDS = ("doc_ids", "position_ids")


def packed_inputs(batch: dict) -> dict:
    """The forward's packed-row arguments of a batch: doc_ids and position_ids, or nothing for an unpacked batch."""
    return {k: batch[k] for k in PACKED_FIELDS if k in batch}


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of at most `capacity` for items of `lengths` (each <= capacity): items longest first (ties by index),
    each into the first bin with room. A max-tree over the bins' room finds that bin in O(log n)."""
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size *= 2
    room = [0] * (2 * size)                  # room[node]: the most room of any bin under it (leaves: the bins)
    for i in range(size, size + n):
        room[i] = capacity
    for i in range(size - 1, 0, -1):
        room[i] = max(room[2 * i], room[2 * i + 1])
    bins: list[list[int]] = []
    for item in np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable").tolist():
        need = int(lengths[item])
        node = 1
        while node < size:                   # the leftmost bin with room enough
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class ExampleDataset:
    """Examples (`tokens[starts[i]:starts[i + 1]]`, with their loss `mask`) in rows of `seq_len` positions, packed
    or one per row (module docstring). Each example has at least 2 and at most seq_len + 1 tokens. The BatchOrder
    draws rows as it draws a TokenDataset's windows."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray, seq_len: int, pad_id: int,
                 packed: bool, name: str = "examples", report: dict | None = None):
        self.tokens, self.mask, self.starts = tokens, mask, np.asarray(starts, dtype=np.int64)
        self.seq_len, self.pad_id, self.packed, self.name = seq_len, pad_id, packed, name
        self.arrays, self.masks = [tokens], [mask]          # as TokenDataset: the data behind the rows
        self.num_tokens = len(tokens)
        lengths = np.diff(self.starts) - 1                  # the positions each example takes
        if len(lengths) and (lengths.min() < 1 or lengths.max() > seq_len):
            raise ValueError(f"{name}: examples must have 2 to seq_len + 1 = {seq_len + 1} tokens")
        rows = first_fit_decreasing(lengths, seq_len) if packed else [[i] for i in range(len(lengths))]
        self.row_offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        self.row_examples = np.asarray([i for r in rows for i in r], dtype=np.int64)
        done = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        trained = done[self.starts[1:]] - done[self.starts[:-1] + 1]    # targets with loss, per example
        self.row_targets = np.add.reduceat(trained[self.row_examples], self.row_offsets[:-1]) if rows else \
            np.zeros(0, dtype=np.int64)
        self._arange = np.arange(seq_len + 1)
        used = int(lengths.sum())
        self.report = {**(report or {}), "rows": len(rows), "packed": packed, "examples_in_rows": len(lengths),
                       "fill": used / max(1, len(rows) * seq_len)}

    @property
    def num_samples(self) -> int:
        return len(self.row_offsets) - 1

    def tail_tokens(self) -> int:
        """Tokens no row trains on: none (truncation is counted where examples are made, data/sft.py)."""
        return 0

    def target_count(self, indices) -> int:
        """Targets with loss in the rows `indices`."""
        return int(self.row_targets[np.asarray(indices, dtype=np.int64)].sum())

    def describe(self) -> str:
        """One line for the run's log: examples, rows, fill, and what was cut or dropped."""
        r = self.report
        how = "packed by first-fit decreasing into" if self.packed else "one per row, padded, in"
        text = (f"{self.name}: {r['examples_in_rows']:,} examples {how} {r['rows']:,} rows of {self.seq_len} "
                f"positions ({100 * r['fill']:.1f}% filled)")
        if r.get("truncated"):
            text += (f"; {r['truncated']:,} longer than data.seq_len + 1 = {self.seq_len + 1} tokens kept their first "
                     f"{self.seq_len + 1} ({r['truncated_tokens']:,} tokens cut)")
        if r.get("dropped"):
            text += f"; {r['dropped']:,} without a trained token in their first {self.seq_len + 1} tokens left out"
        return text

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """x, y (int64), loss_mask (bool), each (B, seq_len); packed rows add doc_ids and position_ids."""
        B, T = len(indices), self.seq_len
        x = np.full((B, T), self.pad_id, dtype=np.int64)
        y = np.full((B, T), self.pad_id, dtype=np.int64)
        loss = np.zeros((B, T), dtype=np.bool_)
        docs = np.empty((B, T), dtype=np.int32)
        pos = np.empty((B, T), dtype=np.int64)
        for b, r in enumerate(indices):
            p = k = 0
            for k, e in enumerate(self.row_examples[self.row_offsets[r]:self.row_offsets[r + 1]].tolist()):
                s, t = int(self.starts[e]), int(self.starts[e + 1])
                n = t - s - 1
                x[b, p:p + n], y[b, p:p + n] = self.tokens[s:t - 1], self.tokens[s + 1:t]
                loss[b, p:p + n] = self.mask[s + 1:t]
                docs[b, p:p + n], pos[b, p:p + n] = k, self._arange[:n]
                p += n
            docs[b, p:], pos[b, p:] = k + 1, self._arange[:T - p]   # the padding: an example of its own
        out = {"x": torch.from_numpy(x), "y": torch.from_numpy(y), "loss_mask": torch.from_numpy(loss)}
        if self.packed:
            out.update(doc_ids=torch.from_numpy(docs), position_ids=torch.from_numpy(pos))
        return out
