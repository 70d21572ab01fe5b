"""Preference data for train.objective=dpo: JSONL rows -> token files with loss masks (data/pairs.py reads them in
training as batches of pairs, or of examples for dpo.loss=kto).

    trainbox prepare prefs.jsonl --out data/prefs --tokenizer FOLDER --seq-len 1024   # token files, a report
    trainbox train dpo model.path=FOLDER data.path=prefs.jsonl                          # or data.path=data/prefs

Rows (one JSON object a line), the forms preference sets come in:

    {"prompt": "text", "chosen": "text", "rejected": "text"}                 plain text (TRL's standard form)
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}     TRL's conversational form
    {"chosen": [messages], "rejected": [messages]}                           the prompt is their shared first turns
    {"prompt": "text", "chosen": [messages], "rejected": [messages]}         as UltraFeedback: the messages repeat
                                                                             the prompt, or it is the user turn

Unpaired rows (dpo.loss=kto), each a response judged desirable (label true) or not, in TRL's unpaired forms:

    {"prompt": "text", "completion": "text", "label": true}
    {"prompt": [messages], "completion": [messages], "label": false}

A set whose first row is unpaired is written as examples; a pair row in it gives two (chosen: true, rejected:
false), as TRL's unpair_preference_dataset. A set of pairs trains dpo.loss=kto too, read as those examples.

Plain text is tokenized as prompt + response, the response ending with the end-of-text token; every response
token carries loss. Messages are rendered with the chat template (data/chat.py, as for SFT: data.chat_template
or the tokenizer's own) and only the assistant tokens of a response carry loss. A pair is stored once as its
prompt, chosen and rejected tokens (no padding); the prompt is the longest common token prefix of the two
rendered sequences that ends before either response's first trained token.

Refused, naming the file and line: a row without chosen or rejected (or without a prompt for text responses),
a chosen response equal to the rejected one, and a response without assistant tokens.

Truncation (counted in the report and the run's log), for prompts of any length: a pair whose longer sequence
exceeds data.seq_len loses the start of its prompt (its end is kept, TRL's keep_end), down to dpo.max_prompt_len
tokens at most (default half of data.seq_len); then its responses lose their ends (their start is kept) to fit.
A max_prompt_len of data.seq_len or more is refused (`no_room`: the rows it cannot fit).

Files of `trainbox prepare --out OUT` per split (train, val): OUT_{split}_pairs.tokens.npy (uint16, int32 for
vocabularies over 65,536), OUT_{split}_pairs.mask.npy (uint8 loss mask, 0 on prompts), OUT_{split}_pairs.index.npy
(int64 rows: start, prompt, chosen and rejected lengths, source file, line), under OUT.manifest.json as every
prepared set; examples as OUT_{split}_examples.*.npy, their index rows: start, prompt and completion lengths,
label (1 desirable), source file, line. A raw JSONL data.path is prepared the same way into data.cache_dir. The
reference log-probabilities of dpo.reference=precompute are stored beside a split's files (objective/preference.py).
"""
from __future__ import annotations

import logging
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainbox.data import manifest
from trainbox.data.chat import (
    BUILTIN,
    ChatTemplate,
    hf_chat_template,
    load_template,
    messages_of,
    render_spans,
    tools_of,
)
from trainbox.data.identity import recorded
from trainbox.data.readers import first_row_is_unpaired, is_unpaired_row, json_objects, list_input_files
from trainbox.data.sft import tokenize_spans
from trainbox.errors import ConfigError, DataError, NoData

log = logging.getLogger("trainbox")

SPLITS = ("train", "val")
PARTS = ("tokens", "mask", "index")
INDEX_COLUMNS = ("start", "prompt", "chosen", "rejected", "file", "line")
EXAMPLE_COLUMNS = ("start", "prompt", "completion", "label", "file", "line")
KINDS = ("pairs", "examples")


# ----------------------------------------------------------------------------- rows


@dataclass
class Pair:
    """One row: plain text (`chat` False: strings) or messages ([{role, content}]), with the row's `tools`."""
    chat: bool
    prompt: str | list
    chosen: str | list
    rejected: str | list
    tools: list | None = None


def _shared_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_of(row, where: str) -> Pair:
    """A row in one of the module docstring's forms, checked (DataError naming `where`)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: each line must be a JSON object, not {type(row).__name__}")
    missing = [k for k in ("chosen", "rejected") if row.get(k) is None]
    if missing:
        raise DataError(f"{where}: a preference row needs 'chosen' and 'rejected'; '{missing[0]}' is missing "
                        f"(found keys {sorted(row)[:8]})", hint="see `trainbox prepare --help` for the row forms")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise DataError(f"{where}: text responses need a text 'prompt' ("
                            + ("it is missing" if prompt is None else f"got {type(prompt).__name__}") + ")",
                            hint='{"prompt": "...", "chosen": "...", "rejected": "..."}, or messages')
        if chosen == rejected:
            raise DataError(f"{where}: 'chosen' equals 'rejected'", hint="remove the row: it prefers nothing")
        return Pair(False, prompt, chosen, rejected)
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise DataError(f"{where}: 'chosen' and 'rejected' must both be text or both be message lists, got "
                        f"{type(chosen).__name__} and {type(rejected).__name__}")
    c, r = messages_of({"messages": chosen}, where), messages_of({"messages": rejected}, where)
    if isinstance(prompt, list):
        p = messages_of({"messages": prompt}, where)
    else:   # the shared first turns are the prompt; else a text prompt is the user's turn
        n = _shared_prefix(c, r)
        p, c, r = c[:n], c[n:], r[n:]
        if not p and isinstance(prompt, str):
            p = [{"role": "user", "content": prompt}]
    if not p:
        raise DataError(f"{where}: no prompt: give 'prompt', or start 'chosen' and 'rejected' with the same turns")
    if c == r:
        raise DataError(f"{where}: 'chosen' equals 'rejected'", hint="remove the row: it prefers nothing")
    if not c or not r:
        raise DataError(f"{where}: '{'chosen' if not c else 'rejected'}' has no turns after the prompt")
    return Pair(True, p, c, r, tools_of(row, where))


@dataclass
class Example:
    """One unpaired row: a prompt and a completion (text, or messages), desirable or not."""
    chat: bool
    prompt: str | list
    completion: str | list
    label: bool
    tools: list | None = None


def example_of(row, where: str) -> Example:
    """An unpaired row in one of the module docstring's forms, checked (DataError naming `where`)."""
    label, prompt, completion = row.get("label"), row.get("prompt"), row.get("completion")
    if not isinstance(label, bool):
        raise DataError(f"{where}: 'label' must be true (a desirable completion) or false, not {label!r}",
                        hint='{"prompt": ..., "completion": ..., "label": true}')
    if isinstance(prompt, str) and isinstance(completion, str):
        return Example(False, prompt, completion, label)
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise DataError(f"{where}: 'prompt' and 'completion' must both be text or both be message lists, got "
                        f"{type(prompt).__name__} and {type(completion).__name__}")
    p, c = messages_of({"messages": prompt}, where), messages_of({"messages": completion}, where)
    if not p or not c:
        raise DataError(f"{where}: '{'prompt' if not p else 'completion'}' has no turns")
    return Example(True, p, c, label, tools_of(row, where))


def read_rows(path: Path, examples: bool):
    """(Pair or Example, line number) of each non-empty line of a JSONL (.gz) file; with `examples`, a pair row
    gives its chosen and rejected responses as two Examples."""
    for row, n in json_objects(path):
        where = f"{path}:{n}"
        if is_unpaired_row(row):
            if not examples:
                raise DataError(f"{where}: an unpaired row (completion, label) in a set of pairs",
                                hint="a set whose first row is unpaired is read as examples for dpo.loss=kto; "
                                     "put such a row first, or give every row chosen and rejected")
            yield example_of(row, where), n
            continue
        pair = pair_of(row, where)
        if not examples:
            yield pair, n
            continue
        for response, label in ((pair.chosen, True), (pair.rejected, False)):
            yield Example(pair.chat, pair.prompt, response, label, pair.tools), n


# ----------------------------------------------------------------------------- tokens


def pair_template(tok, name: str | None, spec: str | None = None) -> ChatTemplate | None:
    """The chat template of message rows: data.chat_template by name (or a .jinja file), else the tokenizer's own
    (a transformers tokenizer's, or that of the tokenizer folder `spec`); None when there is none."""
    if name:
        return load_template(spec or "", name)
    hf = getattr(tok, "hf", None)
    source = getattr(hf, "chat_template", None) if hf is not None else None
    if isinstance(source, dict):
        source = source.get("default")
    if source:
        return ChatTemplate(source, tok.name, bos_token=getattr(hf, "bos_token", None) or "",
                            eos_token=getattr(hf, "eos_token", None) or "")
    return hf_chat_template(spec) if spec else None


def encode_response(row: Pair | Example, response, tok, template: ChatTemplate | None, where: str,
                    what: str) -> tuple[list, list]:
    """The prompt of `row` followed by `response` -> (ids, loss mask: 1 on the response's assistant tokens)."""
    if row.chat:
        if template is None:
            raise DataError(f"{where}: message rows, but the tokenizer {tok.name} has no chat template",
                            hint=f"use a built-in one: --chat-template {next(iter(BUILTIN))} (prepare, inspect), "
                                 f"data.chat_template={next(iter(BUILTIN))} (train)")
        text, spans = render_spans(template, row.prompt + response, where, row.tools)
        ids, mask = tokenize_spans(tok, text, spans)
    else:
        text = row.prompt + response
        ids, mask = tokenize_spans(tok, text, [(len(row.prompt), len(text))] if response else [])
        ids, mask = ids + [tok.eot_id], mask + [1]
    if 1 not in mask:
        raise DataError(f"{where}: the {what} has no assistant tokens to train on",
                        hint="its messages need an assistant turn after the prompt")
    return ids, mask


def encode_example(ex: Example, tok, template: ChatTemplate | None, where: str) -> tuple[list, list, list]:
    """-> (prompt ids, completion ids, completion mask): the prompt ends before the first trained token."""
    ids, mask = encode_response(ex, ex.completion, tok, template, where, "completion")
    p = mask.index(1)
    return ids[:p], ids[p:], mask[p:]


def encode_pair(pair: Pair, tok, template: ChatTemplate | None, where: str) -> tuple[list, list, list, list, list]:
    """-> (prompt ids, chosen ids, chosen mask, rejected ids, rejected mask); see the module docstring."""
    (ci, cm), (ri, rm) = (encode_response(pair, r, tok, template, where, f"{what} response")
                          for r, what in ((pair.chosen, "chosen"), (pair.rejected, "rejected")))
    p = min(_shared_prefix(ci, ri), cm.index(1), rm.index(1))
    if ci[p:] == ri[p:]:
        raise DataError(f"{where}: 'chosen' and 'rejected' give the same tokens", hint="remove the row")
    return ci[:p], ci[p:], cm[p:], ri[p:], rm[p:]


def prompt_budget(seq_len: int, max_prompt: int | None) -> int:
    """The fewest prompt tokens the truncation rule keeps: max_prompt_len, default half of seq_len."""
    return max_prompt if max_prompt is not None else seq_len // 2


def no_room(prompt: np.ndarray, seq_len: int, max_prompt: int | None) -> np.ndarray:
    """Indices of the rows whose prompt, cut to the budget, still leaves no room for a response in seq_len (none
    while the budget is below seq_len)."""
    return np.flatnonzero(np.minimum(prompt, prompt_budget(seq_len, max_prompt)) >= seq_len)


def fit(prompt: np.ndarray, chosen: np.ndarray, rejected: np.ndarray, seq_len: int, max_prompt: int | None
        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The truncation rule, over arrays of lengths -> (prompt tokens kept from its end, chosen and rejected tokens
    kept from their start) so that prompt + the longer response <= seq_len, for prompts of any length; a prompt
    keeps at least min(its length, the budget) tokens, so the rows of `no_room` are the ones it cannot fit."""
    keep_min = np.minimum(prompt, prompt_budget(seq_len, max_prompt))
    excess = np.maximum(prompt + np.maximum(chosen, rejected) - seq_len, 0)
    kept = prompt - np.minimum(excess, prompt - keep_min)
    room = seq_len - kept
    return kept, np.minimum(chosen, room), np.minimum(rejected, room)


# ----------------------------------------------------------------------------- writing


@dataclass
class PairStats:
    """What `trainbox prepare` reports for preference data (pairs, or examples and how many are desirable)."""
    pairs: int = 0
    val_pairs: int = 0
    tokens: int = 0
    prompts_cut: int = 0          # at --seq-len: rows whose prompt lost its start
    responses_cut: int = 0        # ... whose responses lost their ends
    seq_len: int | None = None
    files: list[str] = field(default_factory=list)
    kind: str = "pairs"
    desirable: int = 0            # examples: those labelled true (train split)


class PairWriter:
    """One split's pairs or examples, in memory until written (4 bytes a token)."""

    def __init__(self):
        self.tokens, self.mask, self.index = array("i"), array("B"), array("q")

    def add(self, prompt, chosen, cmask, rejected, rmask, file_no: int, line: int) -> None:
        start = len(self.tokens)
        for part in (prompt, chosen, rejected):
            self.tokens.extend(part)
        self.mask.extend([0] * len(prompt))
        self.mask.extend(cmask)
        self.mask.extend(rmask)
        self.index.extend((start, len(prompt), len(chosen), len(rejected), file_no, line))

    def add_example(self, prompt, completion, cmask, label: bool, file_no: int, line: int) -> None:
        start = len(self.tokens)
        self.tokens.extend(prompt)
        self.tokens.extend(completion)
        self.mask.extend([0] * len(prompt))
        self.mask.extend(cmask)
        self.index.extend((start, len(prompt), len(completion), int(label), file_no, line))

    def __len__(self) -> int:
        return len(self.index) // len(INDEX_COLUMNS)

    def arrays(self, vocab_size: int) -> dict[str, np.ndarray]:
        dtype = np.uint16 if vocab_size <= 2**16 else np.int32
        return {"tokens": np.frombuffer(self.tokens, dtype=np.int32).astype(dtype),
                "mask": np.frombuffer(self.mask, dtype=np.uint8),
                "index": np.frombuffer(self.index, dtype=np.int64).reshape(-1, len(INDEX_COLUMNS))}


def part_path(out: str | Path, split: str, part: str, kind: str = "pairs") -> Path:
    return Path(f"{out}_{split}_{kind}.{part}.npy")


def prepared_kind(out: str | Path) -> str | None:
    """Which preference files the prefix `out` holds ("pairs", "examples"), None for none."""
    return next((k for k in KINDS for s in SPLITS if part_path(out, s, "tokens", k).is_file()), None)


def _save_npy(path: Path, arr: np.ndarray) -> Path:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _count_cuts(stats: PairStats, cols: np.ndarray, seq_len: int, max_prompt_len: int | None) -> None:
    second = cols[:, 3] if stats.kind == "pairs" else cols[:, 2]
    kept, c, r = fit(cols[:, 1], cols[:, 2], second, seq_len, max_prompt_len)
    stats.prompts_cut = int((kept < cols[:, 1]).sum())
    stats.responses_cut = int(((c < cols[:, 2]) | (r < second)).sum())


def prepare_pairs(inputs: list[str], out: str, tok, tokenizer_spec: str, chat_template: str | None = None,
                  val_docs: int = 0, val_fraction: float = 0.0, seq_len: int | None = None,
                  max_prompt_len: int | None = None, overwrite: bool = False) -> PairStats:
    """Preference JSONL files -> OUT's pair (or example) files for train (and val), committed as one set under
    OUT.manifest.json. Examples when the first file's first row is unpaired. With `seq_len`, the truncation that
    training applies is counted (a `max_prompt_len` that leaves no room for a response is refused)."""
    if seq_len is not None and prompt_budget(seq_len, max_prompt_len) >= seq_len:
        raise ConfigError(f"--max-prompt-len {max_prompt_len} leaves no room for a response in --seq-len {seq_len}",
                          hint=f"give less than {seq_len}, or leave it out (default: half of --seq-len)")
    files = list_input_files(inputs)
    man = manifest.manifest_path(out)
    olds = [part_path(out, s, p, k) for k in KINDS for s in SPLITS for p in PARTS
            if part_path(out, s, p, k).exists()]
    if (olds or man.exists()) and not overwrite:
        raise DataError(f"output {(olds or [man])[0]} already exists", hint="add --overwrite, or choose another --out")
    kind = "examples" if files and first_row_is_unpaired(files[0]) else "pairs"
    template = pair_template(tok, chat_template, tokenizer_spec)
    man.parent.mkdir(parents=True, exist_ok=True)
    writers = {s: PairWriter() for s in SPLITS}
    stats, n = PairStats(seq_len=seq_len, kind=kind), 0
    for file_no, path in enumerate(files):
        for row, line in read_rows(path, kind == "examples"):
            where = f"{path}:{line}"
            if kind == "pairs":
                enc = encode_pair(row, tok, template, where)
            else:
                enc = encode_example(row, tok, template, where)
            held = val_docs and n < val_docs or val_fraction and int((n + 1) * val_fraction) > int(n * val_fraction)
            w = writers["val" if held else "train"]
            w.add(*enc, file_no, line) if kind == "pairs" else w.add_example(*enc, row.label, file_no, line)
            n += 1
    if not len(writers["train"]):
        raise NoData(f"{', '.join(map(str, files[:3]))}: no preference {kind} for training ({n} in all)",
                     hint="check the input, --val-docs and --val-fraction")
    outputs = []
    for split, w in writers.items():
        if not len(w):
            continue
        arrays = w.arrays(tok.vocab_size)
        stats.tokens += len(arrays["tokens"])
        if split == "val":
            stats.val_pairs = len(w)
        else:
            stats.pairs = len(w)
            stats.desirable = int(arrays["index"][:, 3].sum()) if kind == "examples" else 0
            if seq_len is not None:
                _count_cuts(stats, arrays["index"], seq_len, max_prompt_len)
        outputs += [(_save_npy(part_path(out, split, k, kind), a), part_path(out, split, k, kind))
                    for k, a in arrays.items()]
    entries = [{"name": final.name, "bytes": tmp.stat().st_size} for tmp, final in outputs]
    base = {"trainbox_prepare": 1, "out": Path(out).name, "format": kind, **recorded(tokenizer_spec, tok.vocab_size),
            "chat_template": chat_template, "sources": [str(f) for f in files], "val_docs": val_docs,
            "val_fraction": val_fraction, "files": entries}
    new = {final for _, final in outputs}
    manifest.write_manifest(man, {**base, "state": "committing", "replaces": [p.name for p in olds if p not in new]})
    for tmp, final in outputs:
        os.replace(tmp, final)
    for stale in olds:
        if stale not in new:
            stale.unlink(missing_ok=True)
    manifest.write_manifest(man, {**base, "state": "complete"})
    stats.files = [str(final) for _, final in outputs] + [str(man)]
    return stats


def describe(stats: PairStats) -> str:
    if stats.kind == "pairs":
        line = f"{stats.pairs:,} pairs ({stats.val_pairs:,} more for validation)"
    else:
        line = (f"{stats.pairs:,} examples, {stats.desirable:,} desirable and {stats.pairs - stats.desirable:,} not "
                f"({stats.val_pairs:,} more for validation)")
    line += f", {stats.tokens:,} tokens; loss mask on the responses' assistant tokens"
    if stats.seq_len is not None:
        line += (f"; at seq_len {stats.seq_len}: {stats.prompts_cut:,} prompts lose their start, "
                 f"{stats.responses_cut:,} {stats.kind}' responses lose their ends")
    return line
