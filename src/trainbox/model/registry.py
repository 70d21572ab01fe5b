"""Family name -> builder: the one list of model families.

Each builder takes (ModelSection, vocab_size, block_size) and returns an nn.Module whose forward is
`forward(idx, targets=None, loss_mask=None, caches=None, pos=0, reduction="mean") -> Output` and which
has `make_caches`, `num_params` and `flops_per_token`.

Encoder-decoder families (t5) differ in two places, both resolved here so the loop stays one loop:
`model_vocab_size` adds their extra ids (sentinels, decoder start) above the tokenizer's, and
`adapt_datasets` turns packed token windows into their examples (span corruption); their batches
keep the {x, y} keys (encoder input, decoder targets), so forward(x, y) and evaluation are unchanged.
"""
from __future__ import annotations

import importlib

import torch.nn as nn

from trainbox.errors import ConfigError

FAMILIES = {
    "gpt": "trainbox.model.gpt",
    "moe": "trainbox.model.moe",
    "speedrun": "trainbox.model.speedrun",
    "t5": "trainbox.model.t5",
    "hf": "trainbox.model.hf",
}


def pad_vocab(n: int, multiple: int = 64) -> int:
    """Round the vocabulary up for faster matmuls (GPT-2: 50,257 -> 50,304)."""
    return -(-n // multiple) * multiple


def build_model(cfg, vocab_size: int, block_size: int) -> nn.Module:
    module = FAMILIES.get(cfg.family)
    if module is None:
        raise ConfigError(f"model.family={cfg.family!r} is not one of {', '.join(FAMILIES)}")
    try:
        builder = importlib.import_module(module).build
    except ModuleNotFoundError as e:
        if e.name == module:
            raise ConfigError(f"model.family={cfg.family!r} is not available in this version of trainbox") from None
        raise
    return builder(cfg, vocab_size, block_size)


def _family_module(family: str):
    return importlib.import_module(FAMILIES[family])


def model_vocab_size(cfg, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's plus the family's extra ids (t5 sentinels), padded."""
    if cfg.vocab_size:
        return cfg.vocab_size
    extra = _family_module("t5").extra_ids(cfg) if cfg.family == "t5" else 0
    return pad_vocab(tokenizer_vocab + extra)


def adapt_datasets(cfg, tokenizer, vocab_size: int, train, val):
    """Families whose examples are not next-token windows (t5) turn the packed datasets into theirs."""
    if cfg.model.family != "t5":
        return train, val
    adapt = _family_module("t5").adapt_dataset
    return (adapt(cfg, tokenizer, train, vocab_size, "train"),
            adapt(cfg, tokenizer, val, vocab_size, "val") if val is not None else None)
