"""The tokenizer a prepared set was made with: how its manifest records it, and the check a run makes with it.

Every manifest `trainbox prepare` writes (shard and Megatron sets, pair and example sets; data/manifest.py) records
the --tokenizer as given, the sha256 of its tokenizer.json (a local file, a folder's, an embedded one's;
"tokenizer_sha256") and its vocabulary size. A run's tokenizer is the same one (`same_tokenizer`):

- where both digests are known, when they are equal, wherever the files lie;
- else when both have one name: the built-in gpt2 is itself everywhere, a local tokenizer is named by its real path;
- not when their vocabulary sizes differ;
- otherwise (no file on one side and one size: gpt2 and a Hugging Face GPT-2 folder, a hub id, a relative path
  from another folder) it cannot be told: a warning names both, and the set is read.

A set of another tokenizer is refused with the command that prepares it again (`check_prepared`). Token files no
manifest speaks for (downloaded FineWeb shards, Megatron's own output) carry no identity and are read as they are.
Data whose ids, all the tokenizer's, reach past the model's vocabulary (a Hugging Face model under another, larger
data.tokenizer) is refused in the same spirit, with the command that prepares it with the model's tokenizer
(`beyond_model`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
from pathlib import Path

from trainbox.data.tokenizer import asset_path
from trainbox.errors import DataError

log = logging.getLogger("trainbox")


def tokenizer_identity(spec: str) -> tuple[str, str | None]:
    """(the tokenizer `spec` by a name: a local one's real path, so one folder given by different paths has one
    name, else `spec` (gpt2, a hub id); the sha256 of its tokenizer.json, local or embedded, else None)."""
    if spec == "gpt2" or spec.startswith("embedded:"):   # data/tokenizer.py get_tokenizer's own names
        file = asset_path(f"{spec.split(':', 1)[1]}.json") if spec != "gpt2" else None
    else:
        local = Path(spec).expanduser()
        file = local / "tokenizer.json" if local.is_dir() else local
        spec = os.path.realpath(file if file.is_file() else local) if local.exists() else spec
    return spec, hashlib.sha256(file.read_bytes()).hexdigest() if file is not None and file.is_file() else None


def recorded(spec: str, vocab_size: int) -> dict:
    """The manifest fields that name a set's tokenizer: `spec` as given to prepare, its digest and its ids."""
    return {"tokenizer": spec, "tokenizer_sha256": tokenizer_identity(spec)[1], "vocab_size": vocab_size}


def same_tokenizer(m: dict, tok) -> bool | None:
    """Whether the run's tokenizer `tok` is the one the manifest `m` records (the module docstring's rule); None
    when that cannot be told."""
    (name, digest), (was, was_digest) = tokenizer_identity(tok.name), tokenizer_identity(m["tokenizer"])
    was_digest = m.get("tokenizer_sha256") or was_digest
    if digest and was_digest:
        return digest == was_digest
    if name == was:
        return True
    if isinstance(m.get("vocab_size"), int) and m["vocab_size"] != tok.vocab_size:
        return False
    return None


def prepare_again(man: Path, m: dict, tokenizer: str, out: str | None = None) -> list[str]:
    """The `trainbox prepare` command that makes the set of manifest `man` (read: `m`) again with `tokenizer`: its
    inputs and options as the manifest records them, over the set itself (--overwrite), or into `out`."""
    fmt = m.get("format", "shard")
    keys = m.get("text_keys") or ["text"]
    return ["trainbox", "prepare", *(m.get("sources") or ["INPUTS"]), "--tokenizer", tokenizer,
            "--out", out or str(man.parent / m["out"]),
            *(["--format", fmt] if fmt == "megatron" else []),
            *([a for k in keys for a in ("--text-key", k)] if keys != ["text"] else []),
            *(["--append-eod"] if m.get("append_eod") else []),
            *(["--chat-template", m["chat_template"]] if m.get("chat_template") else []),
            *(["--val-docs", str(m["val_docs"])] if m.get("val_docs") else []),
            *(["--val-fraction", f"{m['val_fraction']:g}"] if m.get("val_fraction") else []),
            *([] if out else ["--overwrite"])]


def check_prepared(man: Path, m: dict, tok, label: str, path: str) -> None:
    """DataError when the set of manifest `man` (read: `m`) was prepared with another tokenizer than `tok` (the run's);
    a warning when that cannot be told. `label`=`path` is the setting that names the set (data.path ...; `path` alone
    where `label` is empty)."""
    if not m.get("tokenizer"):
        return
    same = same_tokenizer(m, tok)
    if same:
        return
    where = f"{label}={path}" if label else path
    if same is None:
        log.warning(f"data: {where} was prepared with the tokenizer {m['tokenizer']} ({man}), and is read with "
                    f"{tok.name}: with no tokenizer.json to compare, whether they are one tokenizer cannot be told; "
                    f"both have {tok.vocab_size:,} ids, so the set is read")
        return
    val = "" if "val_docs" in m else " (with its --val-docs or --val-fraction)"
    raise DataError(f"{where} was prepared with the tokenizer {m['tokenizer']} ({man}), not with {tok.name}: its "
                    f"token ids stand for other text under {tok.name}",
                    hint=f"prepare it again with {tok.name}: {shlex.join(prepare_again(man, m, tok.name))}{val}, or "
                         f"use the tokenizer it was prepared with")


def beyond_model(where: str, top: int, model_vocab: int, tokenizer: str | None, tokenizer_vocab: int | None,
                 listed: tuple[Path, dict] | None = None, inputs: str | None = None, first: str = "") -> DataError:
    """The error of data whose token ids, all the tokenizer's, reach past the model's vocabulary (the run's tokenizer
    is not the model's): `top` the largest id, `first` where the first such id lies; the command that prepares the
    data with the model's tokenizer from the manifest `listed` where one lists the data, else from `inputs`."""
    cmd = prepare_again(*listed, "MODEL", out="PREFIX") if listed else \
        ["trainbox", "prepare", inputs or "INPUTS", "--tokenizer", "MODEL", "--out", "PREFIX"]
    tok = f"{tokenizer or 'another tokenizer'}" + (f" ({tokenizer_vocab:,} ids)" if tokenizer_vocab else "")
    return DataError(f"{where}: the data's token ids reach {top:,}, but the model's vocabulary is {model_vocab:,} ids "
                     f"(0 to {model_vocab - 1:,}{'; ' + first if first else ''}): it was tokenized with {tok}, not "
                     f"with the model's tokenizer",
                     hint=f"prepare the data with the model's tokenizer, MODEL being model.path: {shlex.join(cmd)}, "
                          f"then train with data.path=PREFIX; or, where the run tokenizes data.path itself (text or "
                          f"JSONL), leave data.tokenizer unset (the model's own)")
