"""Hugging Face TrainingArguments-style JSON -> RunConfig dict (`trainbox train config.json`).

    {"model_name": "Qwen/Qwen2.5-0.5B", "dataset": "chat.jsonl", "per_device_train_batch_size": 4,
     "gradient_accumulation_steps": 4, "num_train_epochs": 1, "learning_rate": 2e-4, "max_seq_length": 1024,
     "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "use_4bit": true, "logging_steps": 10,
     "save_steps": 100, "output_dir": "runs/qwen-lora"}

The result starts from the `lora` recipe. Keys keep their TrainingArguments meaning, so the optimiser
settings a key leaves unset take TrainingArguments' defaults (AdamW betas 0.9/0.999, weight decay 0,
linear decay to 0, no warm-up, lr 5e-5, 3 epochs, batch 8), not the recipe's; the printed mapping marks
those "(TrainingArguments default)". `gradient_accumulation_steps` becomes the global batch
`per_device_train_batch_size x gradient_accumulation_steps`, the same on any number of processes
(trainbox derives accumulation from the global batch; on N processes multiply by N for the exact
TrainingArguments batch). Unknown keys are ConfigErrors with the closest supported keys.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from trainbox.errors import ConfigError


def _same(v):
    return v


def _schedule(v):
    table = {"linear": "linear", "cosine": "cosine", "constant": "constant",
             "constant_with_warmup": "constant", "warmup_stable_decay": "wsd"}
    if v not in table:
        raise ConfigError(f"lr_scheduler_type={v!r} has no trainbox equivalent", hint=f"use one of {', '.join(table)}")
    return table[v]


def _positive_or_none(v):
    return v if v is not None and v > 0 else None


def _text_key(v):
    return [v] if isinstance(v, str) else v


# TrainingArguments / SFT-script key -> (dotted RunConfig key, value conversion)
KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model_name": ("model.path", _same),
    "model_name_or_path": ("model.path", _same),
    "dataset": ("data.path", _same),
    "dataset_path": ("data.path", _same),
    "train_file": ("data.path", _same),
    "eval_file": ("data.val_path", _same),
    "dataset_text_field": ("data.text_key", _text_key),
    "chat_template": ("data.chat_template", _same),
    "max_seq_length": ("data.seq_len", int),
    "packing": ("data.packing", bool),
    "per_device_train_batch_size": ("train.micro_batch_size", int),
    "num_train_epochs": ("train.epochs", float),
    "max_steps": ("train.max_steps", _positive_or_none),
    "learning_rate": ("optim.lr", float),
    "weight_decay": ("optim.weight_decay", float),
    "adam_beta1": ("optim.betas.0", float),
    "adam_beta2": ("optim.betas.1", float),
    "adam_epsilon": ("optim.eps", float),
    "max_grad_norm": ("optim.grad_clip", float),
    "lr_scheduler_type": ("optim.schedule", _schedule),
    "warmup_steps": ("optim.warmup_steps", int),
    "lora_r": ("lora.r", int),
    "lora_alpha": ("lora.alpha", float),
    "lora_dropout": ("lora.dropout", float),
    "lora_target_modules": ("lora.target_modules", _same),
    "target_modules": ("lora.target_modules", _same),
    "gradient_checkpointing": ("lora.gradient_checkpointing", bool),
    "use_4bit": ("quant.load_in_4bit", bool),
    "load_in_4bit": ("quant.load_in_4bit", bool),
    "use_8bit": ("quant.load_in_8bit", bool),
    "load_in_8bit": ("quant.load_in_8bit", bool),
    "logging_steps": ("monitor.log_every", int),
    "save_steps": ("train.checkpoint_every", int),
    "save_total_limit": ("train.keep_last", int),
    "eval_steps": ("train.eval_every", int),
    "seed": ("run.seed", int),
    "output_dir": ("run.dir+run.name", _same),
    "bf16": ("train.dtype", lambda v: "bf16" if v else "auto"),
    "fp16": ("train.dtype", lambda v: "fp16" if v else "auto"),
}
SPECIAL = ("gradient_accumulation_steps",)  # combined with per_device_train_batch_size
# TrainingArguments defaults for settings where the lora recipe differs
TA_DEFAULTS = {"learning_rate": 5e-5, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
               "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "lr_scheduler_type": "linear", "warmup_steps": 0,
               "num_train_epochs": 3.0, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}


@dataclass
class Row:
    source: str       # the JSON key
    value: Any        # its value
    target: str       # dotted RunConfig key(s)
    mapped: Any       # the value set there
    default: bool = False  # came from TrainingArguments' defaults, not the file


def _check_keys(data: dict) -> None:
    known = [*KEYS, *SPECIAL]
    bad = [k for k in data if k not in known]
    if not bad:
        return
    parts = []
    for k in bad:
        close = difflib.get_close_matches(k, known, n=3, cutoff=0.6)
        parts.append(f"'{k}'" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    raise ConfigError(f"unknown TrainingArguments key{'s' if len(bad) > 1 else ''} {', '.join(parts)}",
                      hint=f"supported keys: {', '.join(sorted(known))}; or write a trainbox YAML config")


def mapping_rows(data: dict) -> list[Row]:
    """Every TrainingArguments key (given or defaulted) and where it lands in the RunConfig."""
    _check_keys(data)
    merged = {**TA_DEFAULTS, **data}
    rows = []
    for key, value in merged.items():
        default = key not in data
        if key == "gradient_accumulation_steps":
            micro = int(merged["per_device_train_batch_size"])
            rows.append(Row(key, value, "train.global_batch_size", micro * int(value), default))
            continue
        if key == "max_steps" and _positive_or_none(value) is None:
            continue
        target, convert = KEYS[key]
        if target == "run.dir+run.name":
            p = Path(value)
            rows.append(Row(key, value, target, [str(p.parent), p.name], default))
            continue
        rows.append(Row(key, value, target, convert(value), default))
    return rows


def _set(out: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def map_training_arguments(data: dict) -> dict:
    """TrainingArguments-style dict -> RunConfig dict (the `lora` recipe plus the mapped keys)."""
    out = yaml.safe_load(resources.files("trainbox.recipes").joinpath("lora.yaml").read_text())
    out["optim"]["min_lr_ratio"] = 0.0  # TrainingArguments' schedules decay to 0
    for row in mapping_rows(data):
        if row.target == "run.dir+run.name":
            _set(out, "run.dir", row.mapped[0])
            _set(out, "run.name", row.mapped[1])
        elif row.target.startswith("optim.betas."):
            betas = list(out["optim"].get("betas", [0.9, 0.999]))
            betas[int(row.target[-1])] = row.mapped
            out["optim"]["betas"] = betas
        else:
            _set(out, row.target, row.mapped)
    if "max_steps" in data and _positive_or_none(data["max_steps"]) is not None:
        out["train"].pop("epochs", None)  # TrainingArguments: max_steps overrides num_train_epochs
    return out


def looks_like_training_arguments(data: dict) -> bool:
    return bool(data) and ("model_name" in data or "per_device_train_batch_size" in data
                           or "model_name_or_path" in data)


def mapping_report(path: str) -> str | None:
    """Human table of the mapping for a TrainingArguments-style JSON file (None for other files)."""
    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not looks_like_training_arguments(data):
        return None
    lines = [f"{path}: TrainingArguments-style config mapped onto trainbox's RunConfig (recipe lora):"]
    for r in mapping_rows(data):
        note = "  (TrainingArguments default)" if r.default else ""
        lines.append(f"  {r.source} = {r.value!r:<24} -> {r.target} = {r.mapped!r}{note}")
    return "\n".join(lines)
