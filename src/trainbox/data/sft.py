"""Fine-tuning data: chat or plain-text JSONL -> token arrays + loss masks, cached (used by LoRA runs).

    trainbox train lora model.path=DIR data.path=chat.jsonl                         # the model's chat template
    trainbox train lora model.path=DIR data.path=chat.jsonl data.chat_template=chatml   # built-in ChatML

Rows: `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}` (OpenAI style),
`{"conversations": [{"from": "human", "value": ...}, ...]}` (ShareGPT), or plain text under one of
`data.text_key` (default "text"). A `.txt` file is one plain-text document.

- Chat rows go through data/chat.py, the one chat pipeline (`trainbox prepare` uses it too): roles and
  ShareGPT speakers, the tokenizer's own chat template rendered as transformers renders it, or the built-in
  `chatml` when `data.chat_template: chatml` (needed when the tokenizer has none), and the assistant spans.
  The loss mask is 1 on assistant tokens only (content plus the end-of-turn marker, so the model learns
  to stop); tokens overlapping those characters are marked (offsets from the fast tokenizer). Plain text
  is trained on every token and ends with the end-of-text token.
- Each row of the file is one example. One longer than `data.seq_len + 1` tokens keeps its first
  `data.seq_len + 1` (a row of seq_len positions holds that many tokens' next-token pairs); one with no trained
  target left is left out; both are counted and logged.
- `data.packing: true` packs whole examples into rows of `data.seq_len` (data/packing.py: first-fit decreasing,
  positions restarting at each example, attention kept inside each); `false` gives each example a row of its own,
  padded with mask-0 end-of-text tokens. The run's log and its `start` event give the rows, their fill and what
  was truncated or left out.
- Output: `.npy` arrays (token ids, uint16 or int32 for vocabularies over 65,536; mask uint8; the examples' start
  offsets int64) that `ExampleDataset` memory-maps, in `data.cache_dir`, keyed by the input file, tokenizer and
  settings, and written atomically (temp name + rename, COMPLETE last); packed and padded runs share them.

This module is the fine-tuning path's data step (model.family=hf, llama with model.path): examples and masks for
a Hugging Face model's tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from trainbox.config import DataSection
from trainbox.data.chat import (
    BUILTIN,
    CHATML,
    ChatTemplate,
    is_chat_record,
    messages_of,
    render_spans,
    tokenizer_template,
    tools_of,
)
from trainbox.data.identity import beyond_model
from trainbox.data.packing import ExampleDataset
from trainbox.data.readers import json_objects
from trainbox.data.sources import default_cache_dir
from trainbox.data.sources import open_datasets as open_token_datasets
from trainbox.data.tokenizer import token_lengths
from trainbox.errors import ConfigError, DataError, require

log = logging.getLogger("trainbox")


BUILTIN_TEMPLATES = tuple(BUILTIN)


class HFModelTokenizer:
    """A transformers tokenizer (AutoTokenizer) behind trainbox's Tokenizer protocol; `.hf` is the original."""

    def __init__(self, hf, name: str):
        self.hf, self.name = hf, name
        self.vocab_size = len(hf)
        eot = hf.eos_token_id
        if eot is None:
            eot = hf.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in hf.get_vocab() else None
        if eot is None:
            raise DataError(f"tokenizer {name} has no end-of-sequence token (eos_token)")
        self.eot_id = int(eot)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> list[int]:
        special = set(self.hf.all_special_ids) | {i for i, t in self.hf.added_tokens_decoder.items() if t.special}
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:   # a fast tokenizer: its tokenizer.json's vocabulary, as data/tokenizer.py reads it
            return token_lengths(backend, special, self.vocab_size)
        pieces = self.hf.batch_decode([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return [0 if i in special else len(p.encode("utf-8")) for i, p in enumerate(pieces)]


# a local folder holds a tokenizer when it has one of these (vocab.json and merges.txt together)
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer_config.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


def check_tokenizer_folder(spec: str) -> None:
    """Refuse a local folder without tokenizer files: transformers would read it as an empty tokenizer (every
    text encodes to no tokens)."""
    folder = Path(spec).expanduser()
    if folder.is_dir() and not any(all((folder / f).is_file() for f in group) for group in TOKENIZER_FILES):
        looked = ", ".join(" + ".join(g) for g in TOKENIZER_FILES)
        raise DataError(f"{folder} has no tokenizer files (looked for {looked})",
                        hint="copy the model's tokenizer files into the folder (save_pretrained of its tokenizer "
                             "writes them), or point data.tokenizer at a folder or hub id that has them")


def load_hf_tokenizer(spec: str) -> HFModelTokenizer:
    """A model's tokenizer from a hub id or a folder (tokenizer.json, tokenizer_config.json, ...)."""
    check_tokenizer_folder(spec)
    require("transformers", "finetune", "the tokenizer of a Hugging Face model")
    from transformers import AutoTokenizer  # optional: transformers
    try:
        tok = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the tokenizer of {spec}: {str(e).splitlines()[0]}",
                        hint="model.path (or data.tokenizer) must be a folder with tokenizer files, "
                             "or a hub id") from None
    return HFModelTokenizer(tok, spec)


# ----------------------------------------------------------------------------- rendering


def tokenize_spans(tok, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Token ids of `text` and a 0/1 mask: 1 where a token overlaps one of `spans`."""
    hf = getattr(tok, "hf", None)
    if hf is not None and getattr(hf, "is_fast", False):
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(s < e2 and e > s2 for s2, e2 in spans)) for s, e in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask
    ids, mask = [], []  # other tokenizers: encode the pieces between span boundaries
    bounds = sorted({0, len(text), *(b for sp in spans for b in sp)})
    for a, b in zip(bounds, bounds[1:]):
        piece = tok.encode(text[a:b]) if b > a else []
        inside = any(s <= a and b <= e for s, e in spans)
        ids += piece
        mask += [int(inside)] * len(piece)
    return ids, mask


def encode_row(row: dict, tok, template: str | None, text_keys: list[str], where: str) -> tuple[list[int], list[int]]:
    """One JSONL row -> (ids, loss mask). Chat rows go through data/chat.py (roles, ShareGPT, templates, the
    assistant spans), the one chat pipeline of trainbox; a fast tokenizer then maps the spans to tokens by
    character offsets."""
    if not is_chat_record(row):
        key = next((k for k in text_keys if isinstance(row.get(k), str)), None)
        if key is None:
            raise DataError(f"{where}: a row needs 'messages', 'conversations' or one of the text keys "
                            f"{text_keys} (found keys {sorted(row)[:8]})", hint="set data.text_key=[KEY]")
        ids = tok.encode(row[key]) + [tok.eot_id]
        return ids, [1] * len(ids)
    msgs = messages_of(row, where)
    if template == "chatml":
        chat = ChatTemplate(CHATML, "chatml")
    else:
        chat = tokenizer_template(getattr(tok, "hf", None), tok.name)
        if chat is None:
            raise DataError(f"{where}: chat data, but the tokenizer {tok.name} has no chat template",
                            hint="use the built-in one: data.chat_template=chatml")
    text, spans = render_spans(chat, msgs, where, tools_of(row, where))
    return tokenize_spans(tok, text, spans)


def read_rows(path: Path) -> Iterator[tuple[dict, str]]:
    if path.suffix == ".txt":
        yield {"text": path.read_text(encoding="utf-8")}, str(path)
        return
    for row, n in json_objects(path):
        yield row, f"{path}:{n}"


# ----------------------------------------------------------------------------- streams and cache


def build_examples(examples: Iterable[tuple[list[int], list[int]]], seq_len: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Examples -> (their tokens end to end, loss mask, start offsets, counts). Each keeps its first seq_len + 1
    tokens; one without a trained target among them is left out. The mask of an example's first token is 0 (it is
    no token's target)."""
    ids: list[int] = []
    mask: list[int] = []
    starts = [0]
    stats = {"examples": 0, "truncated": 0, "truncated_tokens": 0, "dropped": 0, "trained_tokens": 0}
    for toks, m in examples:
        stats["examples"] += 1
        if len(toks) > seq_len + 1:
            stats["truncated"] += 1
            stats["truncated_tokens"] += len(toks) - seq_len - 1
            toks, m = toks[:seq_len + 1], m[:seq_len + 1]
        trained = sum(m[1:])
        if len(toks) < 2 or not trained:
            stats["dropped"] += 1
            continue
        ids += toks
        mask += [0] + list(m[1:])
        starts.append(len(ids))
        stats["trained_tokens"] += int(trained)
    dtype = np.uint16 if (max(ids) if ids else 0) < 2**16 else np.int32
    return (np.asarray(ids, dtype=dtype), np.asarray(mask, dtype=np.uint8), np.asarray(starts, dtype=np.int64),
            stats)


def _save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cache_key(path: Path, tok, cfg: DataSection) -> str:
    st = path.stat()
    parts = [str(path.resolve()), st.st_size, st.st_mtime_ns, tok.name, tok.vocab_size, cfg.chat_template,
             cfg.seq_len, cfg.text_key, "sft-v2"]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def prepare_sft(path: str | Path, tok, cfg: DataSection) -> Path:
    """Tokenize a chat/text JSONL (or .txt) once; -> its folder in the cache: tokens.npy, mask.npy, starts.npy
    (the examples' offsets) and stats.json (build_examples' counts)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if cfg.chat_template is not None and cfg.chat_template not in BUILTIN_TEMPLATES:
        raise ConfigError(f"data.chat_template={cfg.chat_template!r} is not a built-in template",
                          hint=f"built-in: {', '.join(BUILTIN_TEMPLATES)}; leave it unset to use the tokenizer's own")
    out = default_cache_dir(cfg) / f"sft-{path.stem}-{cache_key(path, tok, cfg)}"
    if (out / "COMPLETE").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    examples = (encode_row(row, tok, cfg.chat_template, cfg.text_key, where) for row, where in read_rows(path))
    ids, m, starts, stats = build_examples(examples, cfg.seq_len)
    if stats["trained_tokens"] == 0:
        raise DataError(f"{path}: no token carries loss ({stats['examples']} examples): no assistant turns "
                        f"survive data.seq_len={cfg.seq_len}", hint="check the roles, or raise data.seq_len")
    _save_npy(out / "tokens.npy", ids)
    _save_npy(out / "mask.npy", m)
    _save_npy(out / "starts.npy", starts)
    (out / "stats.json").write_text(json.dumps(stats))
    (out / "COMPLETE").write_text("ok\n")
    log.info(f"{path}: {stats['examples']} examples -> {len(ids):,} tokens, {stats['trained_tokens']:,} with loss")
    return out


def is_sft_input(path: str) -> bool:
    """Whether `data.path` is a raw JSONL/.txt file this module tokenizes."""
    return Path(path).suffix in (".jsonl", ".txt") and os.path.isfile(path)


def reads_examples(cfg: DataSection) -> bool:
    """Whether open_finetuning_datasets reads data.path as examples (so data.packing applies)."""
    return is_sft_input(cfg.path)


def open_sft_datasets(cfg: DataSection, tok, vocab_size: int) -> tuple[ExampleDataset, ExampleDataset | None]:
    """Train (and, with data.val_path, validation) examples with loss masks from JSONL files, packed into rows or
    one per row as data.packing says."""
    sets = []
    for p, split in ((cfg.path, "train"), (cfg.val_path, "val")):
        if p is None:
            sets.append(None)
            continue
        folder = prepare_sft(p, tok, cfg)
        arr = np.load(folder / "tokens.npy", mmap_mode="r")
        if len(arr) and int(arr.max()) >= vocab_size:   # the run's tokenizer has ids the model does not
            raise beyond_model(p, int(arr.max()), vocab_size, tok.name, tok.vocab_size, inputs=p)
        data = ExampleDataset(arr, np.load(folder / "mask.npy", mmap_mode="r"), np.load(folder / "starts.npy"),
                              cfg.seq_len, tok.eot_id, cfg.packing, name=f"{p} ({split})",
                              report=json.loads((folder / "stats.json").read_text()))
        log.info(data.describe())
        sets.append(data)
    return sets[0], sets[1]


def open_finetuning_datasets(cfg: DataSection, tok, vocab_size: int) -> tuple:
    """Fine-tuning data (model.family=hf, llama with model.path): raw chat / text JSONL (or .txt) tokenized here
    with loss masks; token files prepared with `trainbox prepare` read as for pretraining."""
    if is_sft_input(cfg.path):
        return open_sft_datasets(cfg, tok, vocab_size)
    return open_token_datasets(cfg, tok, vocab_size)
