"""GPT-2 BPE against transformers, the KV cache against a full forward, and bits per byte by hand."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from trainbox.config import ModelSection
from trainbox.data import embedded, formats
from trainbox.data.encode import FastEncoder, _encode_texts, fast_encoder
from trainbox.data.loader import TokenDataset
from trainbox.data.sources import tokenize_embedded
from trainbox.data.tokenizer import (
    GPT2_ENCODER_SHA256,
    GPT2_VOCAB_BPE_SHA256,
    HFTokenizer,
    asset_path,
    get_tokenizer,
    gpt2_ranks,
    tiktoken_twin,
)
from trainbox.errors import BadInput
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
    (fast, why_not), enc = fast_encoder(get_tokenizer("gpt2")), get_tokenizer("gpt2").enc
    assert fast is not None and why_not == ""  # fastokens is a dependency: the fast path is the one prepare takes
    rng = np.random.default_rng(0)
    alphabet = [*"abcXYZ éß'sdtlmrev0123456789.,!?-_\"()<>/\\@#$%&*+=~`|:;", " ", "  ", "\t", "\n", "\r\n",
                "\n\n", "\u00a0", "\u3000", "\u2028", "\u200b",
                "日本", "語", "😀", "Ω", "ﬁ", "١٢", "Ⅻ", "'S", "'LL", "<|endoftext|>"]
    texts = VARIED + ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(5000)]
    texts += list(embedded.works().values())
    for text, ids in zip(texts, fast.encode(texts)):
        assert ids.tolist() == enc.encode_ordinary(text), text[:60]
    whole = "\n\n".join(texts[-len(embedded.works()):])
    assert np.array_equal(fast.encode([whole])[0], enc.encode_to_numpy(whole))


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _trained(tmp_path, name, pre, normalizer=None, model=None, added=(), all_bytes=True):
    """A small tokenizer.json trained on the embedded works with the given parts."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(model or models.BPE())
    tok.pre_tokenizer, tok.normalizer = pre, normalizer
    from tokenizers import pre_tokenizers

    kind = dict(vocab_size=1500, special_tokens=["<|endoftext|>", "<|im_start|>"], show_progress=False)
    trainer = (trainers.WordPieceTrainer(**kind) if isinstance(model, models.WordPiece) else trainers.BpeTrainer(
        **kind, initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if all_bytes else []))
    tok.train_from_iterator([w[:30_000] for w in embedded.works().values()], trainer=trainer)
    spec = json.loads(tok.to_str())
    if name == "llama3":
        spec["model"]["ignore_merges"] = True
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    hf = HFTokenizer(path)
    if added:
        from tokenizers import AddedToken
        hf.tok.add_tokens([AddedToken(t, special=False) for t in added])
        hf.tok.save(str(path))
        hf = HFTokenizer(path)
    return hf


def test_fast_encoder_gives_tokenizers_ids_for_byte_level_bpes_and_refuses_the_rest(tmp_path, monkeypatch):
    """fastokens reads the byte-level BPE tokenizer.json files (GPT-2, Llama 3 and Qwen2 style: a split regex, NFC,
    ignore_merges, added tokens) and gives `tokenizers`' ids on texts of every kind; it refuses other parts, and a
    reading whose ids differ on the probe text is not used."""
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    read = {"bytelevel": _trained(tmp_path, "bytelevel", pre_tokenizers.ByteLevel(add_prefix_space=False)),
            "llama3": _trained(tmp_path, "llama3", split),
            "qwen2": _trained(tmp_path, "qwen2", split, normalizers.NFC(), added=["<tool_call>"])}
    rng = np.random.default_rng(1)
    alphabet = [*"aZ é'sdlt09.,!-\"<>", " ", "  ", "\t", "\n", "\r\n", "\u00a0", "日本", "😀", "ﬁ", "e\u0301", "١٢",
                "<|endoftext|>", "<|im_start|>", "<tool_call>", "'LL", "12345"]
    texts = VARIED + ["".join(rng.choice(alphabet, size=int(rng.integers(0, 50)))) for _ in range(2000)]
    texts += [w[:100_000] for w in embedded.works().values()][:4]
    for name, tok in read.items():
        fast, why_not = fast_encoder(tok)
        assert fast is not None and why_not == "", name
        assert [ids.tolist() for ids in fast.encode(texts)] == tok.encode_texts(texts), name
    meta = _trained(tmp_path, "metaspace", pre_tokenizers.Metaspace())
    piece = _trained(tmp_path, "wordpiece", pre_tokenizers.BertPreTokenizer(), normalizers.BertNormalizer(),
                     models.WordPiece(unk_token="<|endoftext|>"))
    for tok, part in ((meta, "Metaspace"), (piece, "BertNormalizer")):
        fast, why_not = fast_encoder(tok)
        assert fast is None and why_not.startswith(f"fastokens cannot read {tok.name}") and part in why_not
    # bytes the vocabulary lacks: `tokenizers` drops them, fastokens refuses the text
    some = _trained(tmp_path, "some-bytes", pre_tokenizers.ByteLevel(add_prefix_space=False), all_bytes=False)
    fast, why_not = fast_encoder(some)
    assert fast is None and why_not.startswith(f"fastokens cannot encode a probe text with {some.name}")
    # and should a text reach such bytes past the probe, prepare's workers take `tokenizers`' ids for it
    unchecked = FastEncoder(fast_encoder.__globals__["fastokens"].Tokenizer.from_json_str(some.tok.to_str()))
    assert _encode_texts(some, ["tab\there"], unchecked) == some.encode_texts(["tab\there"])
    # a reading with other ids (here: another tokenizer's vocabulary) is caught by the probe
    other = read["bytelevel"].tok.to_str()
    monkeypatch.setattr(fast_encoder.__globals__["fastokens"].Tokenizer, "from_json_str",
                        staticmethod(lambda _s, _f=fast_encoder.__globals__["fastokens"].Tokenizer.from_json_str:
                                     _f(other)))
    assert fast_encoder(read["qwen2"]) == (None, f"fastokens' ids for {read['qwen2'].name} differ from tokenizers' "
                                                 "on a probe text")


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


def test_token_bytes_add_up_to_the_text_for_hugging_face_tokenizers(tmp_path):
    """Bits per byte divides by the bytes the target tokens stand for. For a byte-level BPE, read by `tokenizers`
    and by transformers, they add up to the text's UTF-8 length, characters whose bytes split across tokens
    included (decoded alone, each such token was three bytes of U+FFFD); for Mistral's kind (byte fallback, a
    SentencePiece marker for each space) to that plus the marker before the text (decoded alone, a piece that
    starts a word lost its space)."""
    pytest.importorskip("transformers")
    import hf_tiny

    from trainbox.data.sft import load_hf_tokenizer
    text = "what is one plus two?\n\nMétéo à Paris: 21°C ☃ 東京 🎉 done"
    hf_tiny.make_tokenizer(tmp_path / "bpe")
    hf_tiny.make_sentencepiece_tokenizer(tmp_path / "spm")
    for tok, extra in ((HFTokenizer(tmp_path / "bpe"), 0), (load_hf_tokenizer(str(tmp_path / "bpe")), 0),
                       (HFTokenizer(tmp_path / "spm"), 1), (load_hf_tokenizer(str(tmp_path / "spm")), 1)):
        lengths, ids = tok.token_bytes(), tok.encode(text)
        assert len(lengths) == tok.vocab_size and lengths[tok.eot_id] == 0
        assert sum(lengths[i] for i in ids) == len(text.encode()) + extra, tok
        assert len(ids) > len(text.split()) + 10   # bytes spelled one token each: the case decoding alone got wrong


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


def test_text_past_the_context_slides_the_window_like_a_full_forward(caplog):
    """A prompt longer than the model's context, and more tokens than it holds: every token asked for comes, each
    the greedy choice of a full forward (no cache) over its window: the last block - 1 tokens at first, then, each
    time the caches fill, the last block // 2; one warning says so. A short prompt and text stay in one window."""
    block = 16
    model = _tiny_gpt(vocab=2048, block=block)
    tok = get_tokenizer("embedded:shakespeare-bpe")
    prompt = embedded.split("val")[1][:400]
    ids = tok.encode(prompt)
    assert len(ids) > block

    def reference(ids, n):
        seq, start = list(ids), max(0, len(ids) - (block - 1))
        for _ in range(n):
            if len(seq) - start >= block:
                start = len(seq) - block // 2
            with torch.no_grad():
                logits = model(torch.tensor([seq[start:]])).logits[0, -1, :tok.vocab_size]
            seq.append(int(logits.argmax()))
        return seq[len(ids):]

    with caplog.at_level("WARNING", logger="trainbox"):
        text = sample(model, tok, prompt, max_tokens=40, temperature=0, stop_at_eot=False)
    assert tok.encode(text) == tok.encode(tok.decode(reference(ids, 40)))
    assert [r.getMessage() for r in caplog.records] == [
        "the prompt and the text exceed the model's 16-token context: each token is drawn from the last 8 to 15 "
        "tokens before it"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainbox"):
        short = sample(model, tok, "ROMEO:", max_tokens=5, temperature=0, stop_at_eot=False)
    assert tok.encode(short) == tok.encode(tok.decode(reference(tok.encode("ROMEO:"), 5))) and not caplog.records


@pytest.mark.parametrize("options, named", [
    (dict(temperature=-0.5), "--temperature -0.5: must be 0 (greedy) or more"),
    (dict(temperature=float("nan")), "--temperature nan"),
    (dict(top_k=-1), "--top-k -1: must be 0 (off) or more"),
    (dict(top_p=0.0), "--top-p 0.0: must be above 0 and at most 1"),
    (dict(top_p=1.5), "--top-p 1.5"),
    (dict(max_tokens=-3), "--max-tokens -3: must be 0 or more"),
])
def test_sampling_options_that_mean_nothing_are_refused(options, named):
    model = _tiny_gpt(vocab=2048)
    tok = get_tokenizer("embedded:shakespeare-bpe")
    with pytest.raises(BadInput, match=re.escape(named)):
        sample(model, tok, "x", **{"max_tokens": 5, **options})


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
