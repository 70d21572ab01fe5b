"""Resolve `data.path` into train and validation token datasets.

Accepted forms:
  embedded:shakespeare     the embedded corpus, tokenized once into the cache (keyed by tokenizer)
  PREFIX                   shard files PREFIX_train_*.bin and PREFIX_val_*.bin (`trainbox prepare` output,
                           downloaded FineWeb shards)
  FILE.bin                 one shard or flat uint16 file (validation from data.val_path)
  data.val_path            any of the token forms above, or text / JSONL (tokenized once into the cache, all of
                           it for validation); it replaces the validation split of data.path
  MEGATRON_PREFIX          a Megatron dataset (PREFIX.bin + PREFIX.idx, as Megatron's --data-path); its
                           validation is data.val_path or the sibling `{out}_val_{key}_document`
  OUT                      the --out of `trainbox prepare --format megatron`: {OUT}_{key}_document (train)
                           and {OUT}_val_{key}_document (validation)
  TEXT or JSONL input      (pretraining families) .txt / .jsonl / .jsonl.gz files or a folder of them: prepared
                           once into the cache (keyed by the files' paths, sizes and mtimes, the tokenizer and
                           the text keys); 1% of the documents are held out for validation
  FILE.jsonl / FILE.txt    for model.family=hf: chat or plain-text fine-tuning data with loss masks (data/sft.py)
Loss masks (`.mask` beside a shard, `PREFIX_mask` beside a Megatron prefix) are opened with their tokens.

data.format (auto | shard | megatron | flat) picks the reader of every token file; data/formats.py gives the
rule of each, and auto's detection by content. Raw and embedded inputs become shards (auto or shard only).
The files of a `trainbox prepare` output set are read only when its manifest says the set is whole
(manifest.check_output_sets), and only under the tokenizer its manifest names (data/identity.py). Every token id
is checked against the tokenizer's vocabulary (not the model's padded one) and the model's when a dataset is opened
for training.
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
from pathlib import Path

import numpy as np

from trainbox.config import DataSection
from trainbox.data import embedded, formats, manifest, megatron
from trainbox.data.formats import write_shard
from trainbox.data.identity import beyond_model, check_prepared
from trainbox.data.loader import TokenDataset, open_tokens
from trainbox.data.prepare import PrepareOptions, prepare
from trainbox.data.readers import JSONL_SUFFIXES, TEXT_SUFFIXES, list_input_files
from trainbox.data.tokenizer import HFTokenizer, Tokenizer, tiktoken_twin
from trainbox.errors import DataError

log = logging.getLogger("trainbox")  # the monitor's console logger (data/ does not import monitor/)


def default_cache_dir(cfg: DataSection) -> Path:
    return Path(cfg.cache_dir) if cfg.cache_dir else Path.home() / ".cache" / "trainbox"


def tokenize_embedded(corpus: str, tokenizer: Tokenizer, cache: Path) -> Path:
    """Tokenize the embedded corpus once; later runs find the cached shards and start at once."""

    if corpus != embedded.CORPUS:
        raise DataError(f"no embedded corpus '{corpus}'", hint=f"use embedded:{embedded.CORPUS}")
    key = hashlib.sha256(
        f"{corpus}|{tokenizer.name}|{tokenizer.vocab_size}|{embedded.VAL_WORKS}".encode()).hexdigest()[:12]
    out = cache / f"{corpus}-{key}"
    prefix = out / corpus
    if not (out / "COMPLETE").exists():
        out.mkdir(parents=True, exist_ok=True)
        # a byte-level BPE's tiktoken twin gives the same tokens on this corpus (a test holds them equal), 10x faster
        twin = tiktoken_twin(tokenizer) if isinstance(tokenizer, HFTokenizer) else None
        for split, index in (("val", 0), ("train", 1)):
            docs = embedded.split(split)
            ids = (twin.encode_ordinary_batch(docs) if twin is not None
                   else tokenizer.encode_batch(docs) if hasattr(tokenizer, "encode_batch")
                   else [tokenizer.encode(d) for d in docs])
            stream = np.concatenate([np.concatenate([[tokenizer.eot_id], d]) for d in ids]).astype(np.uint16)
            write_shard(f"{prefix}_{split}_{index:06d}.bin", stream)
        (out / "COMPLETE").write_text(tokenizer.name + "\n")
    return prefix


def _split_files(prefix: str, split: str) -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(f"{glob.escape(prefix)}_{split}_*.bin"))]


def _is_raw_input(path: str) -> bool:

    if os.path.isdir(path):
        return not glob.glob(os.path.join(glob.escape(path), "*.bin"))
    return path.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES)


def _folder_prefix(path: str) -> str:
    """A folder of shards (e.g. `trainbox data fineweb --out DIR`) -> the prefix of its *_train_*.bin files."""
    names = {os.path.basename(p).rsplit("_train_", 1)[0]
             for p in glob.glob(os.path.join(glob.escape(path), "*_train_*.bin"))}
    if len(names) == 1:
        return os.path.join(path, names.pop())
    if names:
        raise DataError(f"data.path={path} holds shards of several prefixes ({', '.join(sorted(names))})",
                        hint=f"name one, e.g. data.path={os.path.join(path, sorted(names)[0])}")
    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(path), "*.bin")))
    first = os.path.join(path, found[0].removesuffix(".bin") if megatron.is_megatron_prefix(
        Path(path, found[0]).with_suffix("")) else found[0])
    raise DataError(f"data.path={path} is a folder of .bin files, none of them a shard named PREFIX_train_*.bin, "
                    f"which is what a folder of token files must hold ({', '.join(found[:4])}"
                    f"{f' and {len(found) - 4} more' if len(found) > 4 else ''})",
                    hint=f"name one dataset, e.g. data.path={first}; a folder of text or JSONL files is tokenized "
                         "when it holds no .bin file")


def prepare_into_cache(cfg: DataSection, progress=None, path: str | None = None, validation: bool = False) -> str:
    """Tokenize a raw text/JSONL data.path (or `path`) once into the cache; returns the shard prefix. With
    `validation` (data.val_path) every document goes to the prefix's _train_ files, none is held out."""

    files = list_input_files([path or cfg.path])
    ident = [cfg.tokenizer, cfg.chat_template or "", *cfg.text_key, *(["validation"] if validation else [])]
    for f in files:
        st = f.stat()
        ident += [str(f.resolve()), str(st.st_size), str(st.st_mtime_ns)]
    out = default_cache_dir(cfg) / f"prepared-{hashlib.sha256('|'.join(ident).encode()).hexdigest()[:16]}"
    prefix = out / "data"
    if not (out / "COMPLETE").exists():
        out.mkdir(parents=True, exist_ok=True)
        log.info(f"data: tokenizing {path or cfg.path} ({len(files)} file(s)) into {out} with {cfg.tokenizer}")
        st = prepare(PrepareOptions(inputs=[str(f) for f in files], out=str(prefix), tokenizer=cfg.tokenizer,
                                    text_keys=list(cfg.text_key), chat_template=cfg.chat_template,
                                    workers=max(1, cfg.num_workers), val_fraction=0.0 if validation else 0.01,
                                    overwrite=True), progress)
        held = "all for validation" if validation else f"{st.val_documents:,} documents held out for validation"
        log.info(f"data: {st.documents:,} documents, {st.tokens:,} tokens ({held}) in {st.seconds:.1f}s"
                 + st.mask_summary())
        (out / "COMPLETE").write_text((path or cfg.path) + "\n")
    return str(prefix)


def _megatron_prefixes(path: str, keys: list[str]) -> tuple[list[Path], list[Path]] | None:
    """Train/val prefixes for a Megatron prefix or a `prepare --format megatron` --out; None if neither."""
    if megatron.is_megatron_prefix(path):
        p = Path(path.removesuffix(".idx").removesuffix(".bin"))
        val = [p.with_name(f"{p.name[:-len(f'_{k}_document')]}_val_{k}_document") for k in keys
               if p.name.endswith(f"_{k}_document")]
        return [p], [v for v in val if megatron.is_megatron_prefix(v)]
    train = [Path(f"{path}_{k}_document") for k in keys if megatron.is_megatron_prefix(f"{path}_{k}_document")]
    if not train:
        return None
    val = [Path(f"{path}_val_{k}_document") for k in keys if megatron.is_megatron_prefix(f"{path}_val_{k}_document")]
    return train, val


def _other_text_keys(path: str, keys: list[str]) -> list[str]:
    """The text keys of a `prepare --format megatron` set at `path` ({path}_{key}_document) other than `keys`:
    what data.text_key must name to read it."""
    found = [Path(p).name[len(Path(path).name) + 1:-len("_document.idx")]
             for p in sorted(glob.glob(f"{glob.escape(path)}_*_document.idx"))]
    found = [k for k in found if not (k.startswith("val_") and k[4:] in found)]   # {path}_val_{key}_document
    return [k for k in found if k not in keys and megatron.is_megatron_prefix(f"{path}_{k}_document")]


def resolve(cfg: DataSection, tokenizer: Tokenizer) -> tuple[list[Path], list[Path]]:
    """-> (train files, val files); Megatron datasets are given by their prefix."""
    path, fmt = cfg.path, cfg.format
    raw = path.startswith("embedded:") or (_is_raw_input(path) and os.path.exists(path))
    if raw and fmt not in ("auto", "shard"):
        raise DataError(f"data.format={fmt}, but data.path={path} is text input, tokenized into shards",
                        hint="drop data.format (auto) or set data.format=shard")
    if path.startswith("embedded:"):
        path = str(tokenize_embedded(path.split(":", 1)[1], tokenizer, default_cache_dir(cfg)))
    elif raw:
        path = prepare_into_cache(cfg)
    elif os.path.isdir(path):
        path = _folder_prefix(path)
    meg = _megatron_prefixes(path, list(cfg.text_key)) if fmt in ("auto", "megatron") else None
    keys = _other_text_keys(path, list(cfg.text_key)) if meg is None else []
    keys_hint = f"it holds {path}_{keys[0]}_document: set data.text_key=[{','.join(keys)}]" if keys else ""
    if fmt == "megatron" and meg is None:
        raise DataError(f"data.format=megatron, but {path} is not a Megatron dataset: no "
                        f"{path.removesuffix('.bin').removesuffix('.idx')}.idx and .bin, nor {path}_"
                        f"{cfg.text_key[0]}_document.idx and .bin",
                        hint=keys_hint or "give the prefix of PREFIX.idx / PREFIX.bin, or set data.format=auto")
    if meg is not None:
        train, val = meg
    elif os.path.isfile(path):
        train, val = [Path(path)], []
    else:
        train, val = _split_files(path, "train"), _split_files(path, "val")
        if not train:
            found = sorted(glob.glob(f"{glob.escape(path)}*"))[:5]
            raise DataError(f"data.path={cfg.path}: no token files {path}_train_*.bin" +
                            (f" (found: {', '.join(found)})" if found else ""),
                            hint=keys_hint or "create them with `trainbox prepare INPUT --out PREFIX`, "
                                              "or use data.path=embedded:shakespeare")
    if cfg.val_path:
        val = _val_files(cfg)
    manifest.check_output_sets(train + val)
    return train, val


def _val_files(cfg: DataSection) -> list[Path]:
    """data.val_path: a token file, a Megatron prefix, a shard prefix's _val_ files, or text / JSONL tokenized whole
    into the cache (as data.path is, with none of it held out)."""
    path = cfg.val_path
    if _is_raw_input(path) and os.path.exists(path):
        return _split_files(prepare_into_cache(cfg, path=path, validation=True), "train")
    if os.path.isfile(path) or megatron.is_megatron_prefix(path):
        return [Path(path)]
    found = _split_files(path, "val")
    if not found:
        raise DataError(f"data.val_path={path}: no such file, Megatron prefix (PREFIX.idx and .bin) or shard "
                        f"prefix ({path}_val_*.bin)",
                        hint="give token files, or a .txt / .jsonl file or folder (tokenized as data.path is)")
    return found


def open_datasets(cfg: DataSection, tokenizer: Tokenizer, vocab_size: int) -> tuple[TokenDataset, TokenDataset | None]:
    """(train, val) of data.path for a model of `vocab_size` ids. A prepared set must be the run's tokenizer's
    (`check_tokenizer`); token ids must be below the tokenizer's vocabulary (GPT-2: 50,257, not the padded 50,304)
    and the model's (a Hugging Face model's own, which another data.tokenizer may exceed)."""
    train_files, val_files = resolve(cfg, tokenizer)
    check_tokenizer(train_files, tokenizer, "data.path", cfg.path)
    check_tokenizer(val_files, tokenizer, *(("data.val_path", cfg.val_path) if cfg.val_path else
                                            ("data.path", cfg.path)))
    limit = getattr(tokenizer, "vocab_size", None) or vocab_size
    name = getattr(tokenizer, "name", None) or cfg.tokenizer
    train = open_dataset(train_files, cfg.seq_len, f"{cfg.path} (train)", limit, cfg.format, name, vocab_size)
    val = open_dataset(val_files, cfg.seq_len, f"{cfg.path} (val)", limit, cfg.format, name, vocab_size) \
        if val_files else None
    return train, val


def check_tokenizer(files: list[Path], tokenizer: Tokenizer, label: str, path: str) -> None:
    """DataError when a prepared set among `files` (its manifest) was made with another tokenizer than the run's
    (data/identity.py); files no manifest lists carry no identity and pass."""
    seen = set()
    for f in files:
        found = manifest.listing(f)
        if found is not None and found[0] not in seen:
            seen.add(found[0])
            check_prepared(*found, tokenizer, label, path)


def open_dataset(files: list[Path], seq_len: int, name: str, vocab_size: int | None = None, fmt: str = "auto",
                 tokenizer: str | None = None, model_vocab: int | None = None) -> TokenDataset:
    """Memory-map token files (and their masks) into one TokenDataset; check ids against the tokenizer's vocabulary
    `vocab_size` and the model's `model_vocab`."""
    opened = [open_tokens(f, fmt) for f in files]
    arrays, masks = [a for a, _ in opened], [m for _, m in opened]
    if sum(len(a) for a in arrays) == 0:
        raise DataError(f"{name}: the dataset is empty (0 tokens in {', '.join(map(str, files))})",
                        hint="check the input of `trainbox prepare`")
    if vocab_size is not None:
        for arr, f in zip(arrays, files):
            check_vocab(arr, formats.token_file(f), vocab_size, tokenizer=tokenizer, model_vocab=model_vocab)
    return TokenDataset(arrays, seq_len, name=name, masks=masks)


def _first_at_or_above(arr: np.ndarray, limit: int, chunk: int) -> int | None:
    """Index of the first token id >= limit: one max() per chunk of the memory map, the position searched for only in
    a chunk that fails."""
    for start in range(0, len(arr), chunk):
        part = np.asarray(arr[start:start + chunk])
        if len(part) and int(part.max()) >= limit:
            return start + int(np.argmax(part >= limit))
    return None


def check_vocab(arr: np.ndarray, path: Path, vocab_size: int, chunk: int = 1 << 24,
                tokenizer: str | None = None, model_vocab: int | None = None) -> None:
    """DataError naming the file, token index and byte offset of the first token id >= vocab_size (the tokenizer's
    ids: the data was tokenized with another tokenizer), or, where the model's `model_vocab` is smaller and every
    id is the tokenizer's, of the data's largest id and the model's vocabulary (the tokenizer is not the model's)."""
    limit = min(vocab_size, model_vocab or vocab_size)
    pos = _first_at_or_above(arr, limit, chunk)
    if pos is None:
        return
    if limit < vocab_size:
        top = max(int(np.asarray(arr[s:s + chunk]).max()) for s in range(pos, len(arr), chunk))
        if top < vocab_size:
            first = f"the first id past it at token {pos}, byte offset {_byte_offset(path, arr, pos)}"
            raise beyond_model(str(path), top, limit, tokenizer, vocab_size, manifest.listing(path), first=first)
        pos = _first_at_or_above(arr, vocab_size, chunk)
    off = _byte_offset(path, arr, pos)
    used = manifest.prepared_with(path)
    tok = f" of tokenizer {tokenizer}" if tokenizer else ""
    was = f"it was prepared with --tokenizer {used}" if used and used != tokenizer else \
        "the data was tokenized with another tokenizer"
    if tokenizer and _is_model_tokenizer(tokenizer):   # the model's weights fix its vocabulary
        hint = (f"{was}, not with {tokenizer}, the model's own; prepare it again with the model's tokenizer: "
                f"trainbox prepare ... --tokenizer {tokenizer} --overwrite (the same inputs and --out)")
    elif used and used != tokenizer:
        hint = f"{was}; set data.tokenizer={used}"
    else:
        hint = (f"{was} than {tokenizer or 'this one'}; set data.tokenizer to the one it was prepared with "
                "(`trainbox prepare --tokenizer`)")
    raise DataError(f"{path}: token id {int(arr[pos])} at token {pos} (byte offset {off}) is >= the "
                    f"vocab size {vocab_size}{tok}", hint=hint)


def _is_model_tokenizer(spec: str) -> bool:
    """Whether the tokenizer `spec` is a model's (a model.path run's, whose vocabulary the weights fix): a folder
    holding the model's config.json, or a hub id (neither gpt2, embedded:, nor a local file)."""
    if spec == "gpt2" or spec.startswith("embedded:"):
        return False
    folder = Path(spec).expanduser()
    return (folder / "config.json").is_file() or not folder.exists()


def _byte_offset(path: Path, arr: np.ndarray, pos: int) -> int:
    header = getattr(arr, "offset", 0) if isinstance(arr, np.memmap) else 0
    return int(header) + pos * arr.dtype.itemsize
