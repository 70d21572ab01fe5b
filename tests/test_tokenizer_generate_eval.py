"""GPT-2 BPE against transformers, the KV cache against a full forward, and bits per byte by hand."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from trainbox.config import ModelSection
from trainbox.data import embedded, formats
from trainbox.data.loader import TokenDataset
from trainbox.data.sources import tokenize_embedded
from trainbox.data.tokenizer import (
    GPT2_ENCODER_SHA256,
    GPT2_VOCAB_BPE_SHA256,
    HFTokenizer,
    asset_path,
    fast_gpt2,
    get_tokenizer,
    gpt2_ranks,
    tiktoken_twin,
)
from trainbox.generate import filter_logits, sample
from trainbox.model.gpt.model import GPT
from trainbox.model.layers import Output
from trainbox.parallel.distributed import Dist
from trainbox.train.evaluate import evaluate

VARIED = [
    "Hello world", " leading space", "trailing space ", "  two  spaces\n\n\nnewlines\t\ttabs",
    "numbers 1234567890 and 3.14159, -42", "I'm can't we'll they've she'd", "UPPER lower MiXeD",
    "naïve café résumé über straße", "日本語のテキスト 中文 한국어", "emoji 🎉🚀 and ∑∫√ symbols",
    "code: def f(x):\n    return x**2  # comment", "<|endoftext|> is plain text here", "",
    "a" * 300, "https://example.com/path?q=1&r=2", "'s 're 've 'm 'll 'd",
]


def test_gpt2_matches_transformers_tokenizer():
    transformers = pytest.importorskip("transformers")
    files = (str(asset_path("encoder.json")), str(asset_path("vocab.bpe")))
    if int(transformers.__version__.split(".")[0]) >= 5:  # v5 renamed the file arguments
        ref = transformers.GPT2TokenizerFast(vocab=files[0], merges=files[1])
    else:
        ref = transformers.GPT2TokenizerFast(vocab_file=files[0], merges_file=files[1])
    assert len(ref) == 50257
    ours = get_tokenizer("gpt2")
    texts = VARIED + [t[:2000] for t in embedded.split("val")]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text, add_special_tokens=False, split_special_tokens=True)["input_ids"], text[:60]
        assert ours.decode(ids) == text
    assert ours.vocab_size == 50257 and ours.eot_id == 50256


def test_gpt2_ranks_equal_tiktokens_reading_of_the_merges():
    """gpt2_ranks reads encoder.json alone; tiktoken's reader replays vocab.bpe's merges and checks both files."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ref = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(asset_path("vocab.bpe")), encoder_json_file=str(asset_path("encoder.json")),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_SHA256)
    ours = gpt2_ranks()
    assert ours == ref and len(ours) == 50256


def test_fast_gpt2_gives_tiktokens_ids():
    """prepare's fastokens encoder against tiktoken: the varied texts, random strings of characters that the
    GPT-2 pattern splits on, every work of the embedded corpus as one document, and the whole corpus as one
    5 MB text (long enough for fastokens to split it over threads)."""
    fast, enc = fast_gpt2(), get_tokenizer("gpt2").enc
    assert fast is not None  # fastokens is a dependency: the fast path is the one prepare takes
    rng = np.random.default_rng(0)
    alphabet = [*"abcXYZ éß'sdtlmrev0123456789.,!?-_\"()<>/\\@#$%&*+=~`|:;", " ", "  ", "\t", "\n", "\r\n",
                "\n\n", "\u00a0", "\u3000", "\u2028", "\u200b",
                "日本", "語", "😀", "Ω", "ﬁ", "١٢", "Ⅻ", "'S", "'LL", "<|endoftext|>"]
    texts = VARIED + ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(5000)]
    texts += list(embedded.works().values())
    ids, offsets = fast.encode_batch_flat(texts)
    ids, offsets = np.frombuffer(ids, np.uint32), np.frombuffer(offsets, np.uint64)
    for i, text in enumerate(texts):
        assert ids[offsets[i]:offsets[i + 1]].tolist() == enc.encode_ordinary(text), text[:60]
    whole = "\n\n".join(texts[-len(embedded.works()):])
    assert np.array_equal(np.frombuffer(fast.encode_batch_flat([whole])[0], np.uint32), enc.encode_to_numpy(whole))


def test_embedded_corpus_shards_equal_the_bpe_tokenizers_own_encoding(tmp_path):
    """The embedded corpus is tokenized through the BPE's tiktoken twin: every token of it equals `tokenizers`'."""
    tok = get_tokenizer("embedded:shakespeare-bpe")
    assert tiktoken_twin(tok) is not None  # the fast path is the one under test
    prefix = tokenize_embedded("shakespeare", tok, tmp_path)
    for split, index in (("val", 0), ("train", 1)):
        ref = [[tok.eot_id, *e.ids] for e in tok.tok.encode_batch(embedded.split(split), add_special_tokens=False)]
        got = formats.read_shard(f"{prefix}_{split}_{index:06d}.bin")
        assert np.array_equal(got, np.concatenate(ref)), split


def test_tiktoken_twin_only_for_plain_byte_level_bpe(tmp_path):
    spec = json.loads(asset_path("shakespeare-bpe.json").read_text())
    for change in ({"pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}},
                   {"normalizer": {"type": "NFC"}},
                   {"model": {**spec["model"], "merges": spec["model"]["merges"][::-1]}}):  # ids against merge order
        (tmp_path / "t.json").write_text(json.dumps({**spec, **change}))
        assert tiktoken_twin(HFTokenizer(tmp_path / "t.json")) is None, change


def test_embedded_bpe_round_trips_and_split_holds_out_whole_works():
    tok = get_tokenizer("embedded:shakespeare-bpe")
    text = embedded.split("val")[0][:5000]
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 2048
    train, val = embedded.split("train"), embedded.split("val")
    assert len(train) + len(val) == 42 and len(val) == len(embedded.VAL_WORKS)
    assert not set(train) & set(val)
    # token byte lengths add up to the text's UTF-8 length
    tb = tok.token_bytes()
    assert sum(tb[i] for i in tok.encode(text)) == len(text.encode())


def _tiny_gpt(vocab=64, block=32):
    torch.manual_seed(0)
    cfg = ModelSection(family="gpt", n_layer=2, n_head=2, n_embd=32)
    return GPT(cfg, vocab, block).eval()


def test_kv_cache_matches_full_forward():
    model = _tiny_gpt()
    idx = torch.randint(0, 64, (2, 20))
    full = model.transformer  # reference: logits of every position without a cache
    with torch.no_grad():
        ref = model.lm_head(model.hidden(idx))
        caches = model.make_caches(2, 20, torch.float32, "cpu")
        got = [model(idx[:, :12], caches=caches, pos=0).logits[:, -1]]
        for t in range(12, 20):
            got.append(model(idx[:, t:t + 1], caches=caches, pos=t).logits[:, -1])
    assert full is not None
    torch.testing.assert_close(got[0], ref[:, 11], atol=1e-5, rtol=1e-5)
    for k, t in enumerate(range(12, 20), start=1):
        torch.testing.assert_close(got[k], ref[:, t], atol=1e-5, rtol=1e-5)


def test_sampling_is_seeded_and_top_k_top_p_filter():
    model = _tiny_gpt(vocab=2048, block=64)
    tok = get_tokenizer("embedded:shakespeare-bpe")
    a = sample(model, tok, "ROMEO:", max_tokens=20, temperature=1.0, top_k=50, seed=3, stop_at_eot=False)
    b = sample(model, tok, "ROMEO:", max_tokens=20, temperature=1.0, top_k=50, seed=3, stop_at_eot=False)
    assert a == b and len(tok.encode(a)) >= 10
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(filter_logits(logits, 1.0, 2, None))
    assert kept.tolist() == [[True, True, False, False, False]]
    p = logits.softmax(-1)[0]  # 0.636, 0.234, 0.086, ...: the 0.8 nucleus is the first two
    kept = torch.isfinite(filter_logits(logits, 1.0, None, 0.8))
    assert kept.tolist() == [[True, True, False, False, False]] and p[0] < 0.8 < p[0] + p[1]


class _Uniform(torch.nn.Module):
    """Predicts every token with probability 1/V: loss is exactly ln V per token."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx, targets, loss_mask=None, reduction="mean"):
        logits = torch.zeros(*idx.shape, self.vocab)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, self.vocab), targets.reshape(-1), reduction="none")
        return Output(loss=loss.view(targets.shape))


def test_bits_per_byte_by_hand():
    tok = get_tokenizer("embedded:shakespeare-bpe")
    text = embedded.split("val")[1][:20000]
    ids = [tok.eot_id] + tok.encode(text)
    import numpy as np
    ds = TokenDataset([np.array(ids, dtype=np.uint16)], seq_len=64)
    tb = torch.tensor(tok.token_bytes())
    res = evaluate(_Uniform(tok.vocab_size), ds, eval_tokens=10**9, micro_batch=8, token_bytes=tb,
                   device=torch.device("cpu"), autocast=lambda: torch.autocast("cpu", enabled=False), dist=Dist())
    n = ds.num_samples * 64
    targets = ids[1:n + 1]
    nbytes = sum(tb[t].item() for t in targets)
    assert res["val_tokens"] == n
    assert res["val_loss"] == pytest.approx(math.log(tok.vocab_size), rel=1e-6)
    assert res["val_bpb"] == pytest.approx(len(targets) * math.log2(tok.vocab_size) / nbytes, rel=1e-6)
