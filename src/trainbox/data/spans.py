"""T5 span corruption, a pure function of (seed, sample index).

A packed window of `raw_len` tokens is split into alternating runs, starting with a kept run and
ending with a masked ("noise") run; `round(raw_len * noise_density)` tokens are masked in
`round(noise / mean_noise_span_length)` spans whose lengths, like those of the kept runs, are a random
segmentation (every run non-empty). Each masked span becomes one sentinel in the encoder input; the
decoder target lists each sentinel followed by the tokens it replaced:

    tokens   The  quick brown fox  jumps over the  lazy dog
    input    The  <X0>  fox  <X1>  lazy dog  <X2>  EOS          (kept tokens, one sentinel per span)
    target   <X0> quick brown  <X1> jumps over the  <X2> ...  EOS

Lengths follow T5's `random_spans_helper`: given the encoder length `seq_len`, `raw_len` is the
largest window whose corrupted input (kept tokens + one sentinel per span + EOS) still fits, so the
input is exactly `seq_len` tokens and the target exactly `target_len`: no padding anywhere. With the
defaults (0.15, 3) seq_len 512 reads 568 raw tokens and gives 114 target tokens.

Sentinels are the top ids of the model's vocabulary, <extra_id_k> = vocab_size - 1 - k (T5's
convention); the random numbers of sample i come from numpy's SeedSequence([seed, split, i]), so a
sample is corrupted the same way on any number of GPUs, after any resume, with no index files. (A
sample seen again in a later epoch gets the same corruption.)
"""
from __future__ import annotations

import re

import numpy as np
import torch

from trainbox.data.loader import TokenDataset
from trainbox.errors import ConfigError

SPLITS = {"train": 0, "val": 1}
SENTINEL_RE = re.compile(r"<extra_id_(\d+)>")


def _counts(length: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """-> (masked tokens, masked spans) of a window: at least one of each, and as many kept runs
    (each non-empty, one before every span) as spans."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    return noise, min(max(int(round(noise / mean_span)), 1), length - noise)


def _lengths_for(raw_len: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """Raw window length -> (encoder input length, decoder target length), EOS included. As T5's
    helper, except that the clamping of `noise_mask` is applied, so short windows stay exact too."""
    noise, spans = _counts(raw_len, noise_density, mean_span)
    return raw_len - noise + spans + 1, noise + spans + 1


def _raw_len(seq_len: int, noise_density: float, mean_span: float) -> int:
    """The largest raw window length whose corrupted input is at most `seq_len` tokens (T5's random_spans_helper)."""
    raw = seq_len - 1
    while _lengths_for(raw + 1, noise_density, mean_span)[0] <= seq_len:
        raw += 1
    return raw


def span_lengths(seq_len: int, noise_density: float = 0.15, mean_span: float = 3.0) -> tuple[int, int]:
    """Encoder length -> (raw packed window length, decoder target length), as T5's random_spans_helper:
    the largest raw length whose corrupted input is at most `seq_len` tokens."""
    raw = _raw_len(seq_len, noise_density, mean_span)
    inputs, targets = _lengths_for(raw, noise_density, mean_span)
    if inputs != seq_len:  # only extreme settings (half the tokens in 1-token spans) skip a length
        raise ConfigError(f"span corruption with noise density {noise_density} and mean span {mean_span} cannot "
                          f"make inputs of exactly data.seq_len={seq_len} tokens (closest: {inputs})",
                          hint=f"use data.seq_len={inputs} or {seq_len + 1}")
    return raw, targets


def _cuts(rng: np.random.Generator, items: int, segments: int) -> np.ndarray:
    """Where a uniformly random split of `items` into `segments` non-empty runs cuts, unsorted (segments - 1)."""
    return rng.choice(items - 1, segments - 1, replace=False) + 1 if segments > 1 else np.zeros(0, int)


def _runs(cuts: np.ndarray, items: int) -> np.ndarray:
    """(..., segments - 1) cuts -> (..., segments) run lengths."""
    edges = [np.zeros(cuts.shape[:-1] + (1,), int), np.sort(cuts, axis=-1), np.full(cuts.shape[:-1] + (1,), items)]
    return np.diff(np.concatenate(edges, axis=-1), axis=-1)


def _segment(rng: np.random.Generator, items: int, segments: int) -> np.ndarray:
    """Uniformly random split of `items` into `segments` non-empty runs -> run lengths."""
    return _runs(_cuts(rng, items, segments), items)


def noise_mask(length: int, noise_density: float, mean_span: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean mask of the masked tokens: kept and noise runs alternate, kept first, noise last."""
    noise, spans = _counts(length, noise_density, mean_span)
    noise_runs = _segment(rng, noise, spans)
    kept_runs = _segment(rng, length - noise, spans)
    runs = np.stack([kept_runs, noise_runs], axis=1).reshape(-1)          # kept0, noise0, kept1, noise1, ...
    is_noise = np.tile([False, True], spans)
    return np.repeat(is_noise, runs)


def noise_masks(cuts: np.ndarray, length: int, noise: int) -> np.ndarray:
    """noise_mask for a batch: (B, spans - 1) cuts of the noise, then (B, spans - 1) cuts of the kept tokens, as
    `_cuts` drew them for each row -> (B, length) boolean masks."""
    spans = cuts.shape[1] // 2 + 1
    kept_runs, noise_runs = _runs(cuts[:, spans - 1:], length - noise), _runs(cuts[:, :spans - 1], noise)
    ends = np.cumsum(np.stack([kept_runs, noise_runs], axis=2).reshape(len(cuts), -1), axis=1)
    edges = np.zeros((len(cuts), length + 1), np.int8)      # +1 where a noise run starts, -1 where it ends
    rows = np.arange(len(cuts))[:, None]
    edges[rows, ends[:, 0::2]] = 1                          # every kept run is non-empty: the two never meet
    edges[rows, ends[:, 1::2]] = -1
    return np.cumsum(edges[:, :length], axis=1, dtype=np.int8) > 0


def corrupt_batch(tokens: np.ndarray, mask: np.ndarray, vocab_size: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """`corrupt` for (B, L) tokens and masks that mask as many tokens in as many spans in every row (span corruption's
    masks do) -> (B, input length), (B, target length)."""
    prev = np.concatenate([np.ones((len(mask), 1), bool), mask[:, :-1]], axis=1)
    span_starts, kept_starts = mask & ~prev, ~mask & prev
    inp = np.where(span_starts, sentinel_id(np.cumsum(span_starts, axis=1) - 1, vocab_size), tokens)
    tgt = np.where(kept_starts, sentinel_id(np.cumsum(kept_starts, axis=1) - 1, vocab_size), tokens)
    eos = np.full((len(mask), 1), eos_id)
    return (np.concatenate([inp[~mask | span_starts].reshape(len(mask), -1), eos], axis=1),
            np.concatenate([tgt[mask | kept_starts].reshape(len(mask), -1), eos], axis=1))


def sentinel_id(k: int, vocab_size: int) -> int:
    """<extra_id_k>: the k-th sentinel from the top of the vocabulary."""
    return vocab_size - 1 - k


def corrupt(tokens: np.ndarray, mask: np.ndarray, vocab_size: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (input, target): each masked span replaced by its sentinel in the input; the target lists
    each sentinel then the tokens of its span. Both end with EOS. The mask starts with a kept token."""
    if mask[0]:
        raise ValueError("span corruption masks start with a kept token (noise_mask makes them so)")
    prev = np.concatenate([[True], mask[:-1]])             # the token before is masked (or absent)
    span_starts = mask & ~prev                             # first token of each masked span
    kept_starts = ~mask & prev                             # first token of each kept run
    inp = np.where(span_starts, sentinel_id(np.cumsum(span_starts) - 1, vocab_size), tokens)[~mask | span_starts]
    # kept run j precedes masked span j: in the target it collapses into span j's sentinel
    tgt = np.where(kept_starts, sentinel_id(np.cumsum(kept_starts) - 1, vocab_size), tokens)[mask | kept_starts]
    return np.append(inp, eos_id), np.append(tgt, eos_id)


def uncorrupt(inp: list[int], tgt: list[int], vocab_size: int, sentinel_tokens: int) -> list[int]:
    """Inverse of `corrupt`: put every target span back in place of its sentinel (final EOS dropped)."""
    first = vocab_size - sentinel_tokens
    spans, current = {}, None
    for t in tgt[:-1]:
        if t >= first:
            current = spans.setdefault(t, [])
        elif current is not None:
            current.append(t)
    out = []
    for t in inp[:-1]:
        out.extend(spans.get(t, []) if t >= first else [t])
    return out


class SpanCorruption:
    """Batch transform: (B, raw_len + 1) packed windows + their sample indices -> {x, y}."""

    def __init__(self, seq_len: int, noise_density: float, mean_span: float, sentinel_tokens: int,
                 vocab_size: int, eos_id: int, seed: int, split: str = "train"):
        self.seq_len, self.noise_density, self.mean_span = seq_len, noise_density, mean_span
        self.raw_len, self.target_len = span_lengths(seq_len, noise_density, mean_span)
        self.vocab_size, self.eos_id, self.seed, self.split = vocab_size, eos_id, seed, SPLITS[split]
        spans = _counts(self.raw_len, noise_density, mean_span)[1]
        if spans > sentinel_tokens:
            raise ConfigError(f"span corruption of {self.raw_len} tokens makes {spans} spans but only "
                              f"model.t5.sentinel_tokens={sentinel_tokens} sentinels exist",
                              hint=f"raise model.t5.sentinel_tokens to {spans}, or lower data.seq_len")

    def seq_len_for(self, tokens: int) -> int | None:
        """The largest data.seq_len (8 or more, up to this one) whose raw window fits in `tokens` tokens; None when
        none does. What a file of `tokens` + 1 tokens holds one sample of (the window's extra token included)."""
        lo, hi = 8, min(self.seq_len, tokens + 1)   # a raw window is never shorter than seq_len - 1
        if hi < lo or _raw_len(lo, self.noise_density, self.mean_span) > tokens:
            return None
        while lo < hi:   # the raw length grows with seq_len
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if _raw_len(mid, self.noise_density, self.mean_span) <= tokens else (lo, mid - 1)
        for s in range(lo, 7, -1):   # extreme settings skip an input length (span_lengths refuses it)
            try:
                span_lengths(s, self.noise_density, self.mean_span)
                return s
            except ConfigError:
                continue
        return None

    def target_count(self, indices) -> int:
        """Decoder targets that carry loss in the samples `indices`: all of them, `target_len` a sample."""
        return len(indices) * self.target_len

    def example(self, tokens: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray]:
        """One sample, on its own: the definition the batch transform (`__call__`) is tested against."""
        rng = np.random.default_rng([self.seed, self.split, int(index)])
        mask = noise_mask(len(tokens), self.noise_density, self.mean_span, rng)
        return corrupt(np.asarray(tokens), mask, self.vocab_size, self.eos_id)

    def __call__(self, windows: torch.Tensor, indices) -> dict[str, torch.Tensor]:
        """`example` for every row, in one pass over the batch: only the random draws are made row by row (each
        sample's own generator, as `example` draws them), the masks and the corruption for all rows at once."""
        raw = windows[:, :self.raw_len].numpy()  # the window's extra last token starts the next window
        noise, spans = _counts(self.raw_len, self.noise_density, self.mean_span)
        cuts = np.empty((len(raw), 2 * (spans - 1)), int)
        for b, i in enumerate(indices):
            rng = np.random.default_rng([self.seed, self.split, int(i)])
            cuts[b, :spans - 1] = _cuts(rng, noise, spans)                  # noise_mask's draws, in its order
            cuts[b, spans - 1:] = _cuts(rng, self.raw_len - noise, spans)
        x, y = corrupt_batch(raw, noise_masks(cuts, self.raw_len, noise), self.vocab_size, self.eos_id)
        return {"x": torch.from_numpy(x.astype(np.int64)), "y": torch.from_numpy(y.astype(np.int64))}


def span_corruption_dataset(dataset, t5_cfg, seq_len: int, vocab_size: int, eos_id: int, seed: int, split: str):
    """The same token files cut into raw windows of span_lengths(seq_len)[0] tokens, corrupted per sample."""

    transform = SpanCorruption(seq_len, t5_cfg.noise_density, t5_cfg.mean_noise_span_length,
                               t5_cfg.sentinel_tokens, vocab_size, eos_id, seed, split)
    return TokenDataset(dataset.arrays, transform.raw_len, name=dataset.name, transform=transform)


def encode_with_sentinels(tokenizer, text: str, vocab_size: int, sentinel_tokens: int) -> list[int]:
    """Text with <extra_id_K> markers -> ids, each marker becoming its sentinel id."""
    ids, pos = [], 0
    for m in SENTINEL_RE.finditer(text):
        k = int(m.group(1))
        if k >= sentinel_tokens:
            raise ConfigError(f"{m.group(0)} in the prompt: the model has only {sentinel_tokens} sentinels "
                              f"(<extra_id_0> to <extra_id_{sentinel_tokens - 1}>)")
        ids += tokenizer.encode(text[pos:m.start()]) + [sentinel_id(k, vocab_size)]
        pos = m.end()
    return ids + tokenizer.encode(text[pos:])


def split_spans(ids: list[int], vocab_size: int, sentinel_tokens: int) -> list[tuple[int, list[int]]]:
    """Decoder output -> [(sentinel number k, ids of its span), ...] in output order."""
    first, out = vocab_size - sentinel_tokens, []
    for t in ids:
        if first <= t < vocab_size:
            out.append((vocab_size - 1 - t, []))
        elif out:
            out[-1][1].append(t)
    return out


def fill_prompt(prompt: str, spans: list[tuple[int, str]]) -> str:
    """Replace each <extra_id_K> marker of the prompt by the text generated for sentinel K."""
    filled = dict(reversed(spans))  # the first span generated for a sentinel wins
    return SENTINEL_RE.sub(lambda m: filled.get(int(m.group(1)), m.group(0)), prompt)
