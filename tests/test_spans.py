"""T5 span corruption: T5's lengths, a slow reference, reconstruction, determinism, noise statistics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainbox.data.spans import (
    SpanCorruption,
    corrupt,
    encode_with_sentinels,
    fill_prompt,
    noise_mask,
    sentinel_id,
    span_lengths,
    split_spans,
    uncorrupt,
)
from trainbox.errors import ConfigError

V, S, EOS = 1000, 100, 0


def slow_corrupt(tokens, mask, vocab_size, eos):
    """Obviously correct: walk the tokens once, numbering spans as they start."""
    inp, tgt, span = [], [], -1
    for i, (t, m) in enumerate(zip(tokens, mask)):
        if m:
            if i == 0 or not mask[i - 1]:
                span += 1
                inp.append(vocab_size - 1 - span)
                tgt.append(vocab_size - 1 - span)
            tgt.append(t)
        else:
            inp.append(t)
    return inp + [eos], tgt + [eos]


def test_lengths_are_t5s_random_spans_helper():
    # T5 (and nanoT5, HF's run_t5_mlm_flax): inputs_length 512 reads 568 raw tokens, targets are 114
    assert span_lengths(512) == (568, 114)


@pytest.mark.parametrize("density,mean_span", [(0.15, 3.0), (0.3, 8.0), (0.5, 1.0)])
def test_every_length_is_exact_and_the_raw_window_maximal(density, mean_span):
    rng = np.random.default_rng(0)
    for seq_len in range(12, 700, 7):
        try:
            raw, tgt_len = span_lengths(seq_len, density, mean_span)
        except ConfigError:  # degenerate settings skip some lengths: refused, never padded
            assert (density, mean_span) == (0.5, 1.0)
            continue
        mask = noise_mask(raw, density, mean_span, rng)
        inp, tgt = corrupt(rng.integers(1, 500, raw), mask, V, EOS)
        assert (len(inp), len(tgt)) == (seq_len, tgt_len)  # no padding: the encoder length is met exactly
        longer = noise_mask(raw + 1, density, mean_span, rng)
        assert len(corrupt(rng.integers(1, 500, raw + 1), longer, V, EOS)[0]) > seq_len


def test_vectorised_corruption_matches_slow_reference_and_inverts():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(2, 200))
        tokens = rng.integers(1, 900, n)
        mask = noise_mask(n, float(rng.uniform(0.05, 0.6)), float(rng.uniform(1, 6)), rng)
        inp, tgt = corrupt(tokens, mask, V, EOS)
        ref_inp, ref_tgt = slow_corrupt(tokens.tolist(), mask.tolist(), V, EOS)
        assert inp.tolist() == ref_inp and tgt.tolist() == ref_tgt
        assert uncorrupt(inp.tolist(), tgt.tolist(), V, S) == tokens.tolist()


def test_noise_density_and_span_lengths():
    rng = np.random.default_rng(2)
    L, density, mean_span = 568, 0.15, 3.0
    noise, spans, first_runs = [], [], []
    for _ in range(500):
        m = noise_mask(L, density, mean_span, rng)
        assert not m[0] and m[-1]                               # kept run first, noise run last
        starts = np.flatnonzero(m & ~np.concatenate([[False], m[:-1]]))
        noise.append(m.sum())
        spans.append(len(starts))
        first_runs.append(np.argmax(~m[starts[0]:]))            # length of the first masked span
    assert set(noise) == {round(L * density)} and set(spans) == {round(round(L * density) / mean_span)}
    assert abs(np.mean(noise) / L - density) < 0.005
    assert abs(np.mean(noise) / np.mean(spans) - mean_span) < 0.05
    # span lengths are random, not all equal to the mean; their average over samples is the mean
    assert len(set(first_runs)) > 4 and abs(np.mean(first_runs) - np.mean(noise) / np.mean(spans)) < 0.4


def test_pure_function_of_seed_and_index():
    t = SpanCorruption(64, 0.15, 3.0, S, V, EOS, seed=5)
    windows = torch.randint(1, 900, (4, t.raw_len + 1))
    a = t(windows, [10, 11, 12, 13])
    b = t(windows[[2]], [12])                                    # the same sample alone, in another batch
    assert torch.equal(a["x"][2], b["x"][0]) and torch.equal(a["y"][2], b["y"][0])
    assert torch.equal(t(windows, [10, 11, 12, 13])["x"], a["x"])
    same_tokens = windows[[0, 0]]
    c = t(same_tokens, [10, 99])                                 # another index: another corruption
    assert not torch.equal(c["x"][0], c["x"][1])
    other_seed = SpanCorruption(64, 0.15, 3.0, S, V, EOS, seed=6)(windows, [10, 11, 12, 13])
    assert not torch.equal(other_seed["x"], a["x"])
    val = SpanCorruption(64, 0.15, 3.0, S, V, EOS, seed=5, split="val")(windows, [10, 11, 12, 13])
    assert not torch.equal(val["x"], a["x"])
    assert a["x"].shape == (4, 64) and a["y"].shape == (4, t.target_len) and a["x"].dtype == torch.int64
    for row in range(4):  # the window's last token belongs to the next window, never to this example
        assert uncorrupt(a["x"][row].tolist(), a["y"][row].tolist(), V, S) == windows[row, :t.raw_len].tolist()


@pytest.mark.parametrize("seq_len,density,mean_span", [(512, 0.15, 3.0), (64, 0.15, 3.0), (40, 0.3, 8.0),
                                                       (12, 0.15, 3.0), (100, 0.05, 6.0)])
def test_a_batch_is_corrupted_as_each_of_its_samples_alone(seq_len, density, mean_span):
    """The batch transform (one pass over the rows) gives exactly what `example` gives each sample: the same random
    draws, masks and sentinels, whatever the token dtype; one span (12 tokens) included."""
    t = SpanCorruption(seq_len, density, mean_span, S, V, EOS, seed=3)
    for dtype in (torch.int64, torch.int32, torch.uint16):
        windows = torch.randint(1, 900, (9, t.raw_len + 1)).to(dtype)
        indices = [5, 0, 77, 12, 12, 3000, 1, 2, 9]
        got = t(windows, indices)
        for row, i in enumerate(indices):
            x, y = t.example(windows[row, :t.raw_len].numpy(), i)
            assert got["x"][row].tolist() == x.tolist() and got["y"][row].tolist() == y.tolist()
        assert got["x"].dtype == got["y"].dtype == torch.int64


def test_too_few_sentinels_is_a_config_error():
    with pytest.raises(ConfigError, match="model.t5.sentinel_tokens"):
        SpanCorruption(512, 0.15, 3.0, 10, V, EOS, seed=0)


def test_prompt_sentinels_round_trip():
    from trainbox.data.tokenizer import get_tokenizer

    tok = get_tokenizer("embedded:shakespeare-bpe")
    vocab = 2048 + 128
    ids = encode_with_sentinels(tok, "To be, <extra_id_0> not <extra_id_1>", vocab, S)
    assert ids.count(sentinel_id(0, vocab)) == 1 and ids[-1] == sentinel_id(1, vocab)
    assert tok.decode(ids[:ids.index(sentinel_id(0, vocab))]) == "To be, "
    out = [sentinel_id(0, vocab), *tok.encode(" or"), sentinel_id(1, vocab), *tok.encode(" to be")]
    spans = [(k, tok.decode(s)) for k, s in split_spans(out, vocab, S)]
    assert spans == [(0, " or"), (1, " to be")]
    assert fill_prompt("To be,<extra_id_0> not<extra_id_1>", spans) == "To be, or not to be"
    with pytest.raises(ConfigError, match="extra_id_100"):
        encode_with_sentinels(tok, "<extra_id_100>", vocab, S)
