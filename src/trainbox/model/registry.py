"""Family name -> builder: the one list of model families.

Each builder takes (ModelSection, vocab_size, block_size) and returns an nn.Module whose forward is
`forward(idx, targets=None, loss_mask=None, caches=None, pos=0, reduction="mean") -> Output` and which
has `make_caches`, `num_params` and `flops_per_token`. Optional module-level hooks let a family differ
without a second loop:
  USES_RUN_CONFIG = True   build() also receives the whole RunConfig as `run=` (hf: LoRA, quantisation)
  tokenizer(run)           the family brings its own tokenizer (hf: the model's)
  extra_ids(model_cfg)     ids above the tokenizer's (t5: 100 sentinels and a decoder start id)
  open_datasets(run, tok, vocab)  the family reads its own data (hf: chat/text JSONL -> SFT windows)
  adapt_dataset(...)       turns packed token windows into the family's examples (t5: span corruption);
                           batches keep the {x, y} keys, so forward(x, y) and evaluation are unchanged
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


def _family_module(cfg):
    """The family's module, from a ModelSection."""
    module = FAMILIES.get(cfg.family)
    if module is None:
        raise ConfigError(f"model.family={cfg.family!r} is not one of {', '.join(FAMILIES)}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise ConfigError(f"model.family={cfg.family!r} is not available in this version of trainbox") from None
        raise


def build_model(cfg, vocab_size: int, block_size: int, run=None) -> nn.Module:
    """`cfg` is the ModelSection; `run` the whole RunConfig, passed to families that ask for it."""
    mod = _family_module(cfg)
    if getattr(mod, "USES_RUN_CONFIG", False):
        return mod.build(cfg, vocab_size, block_size, run=run)
    return mod.build(cfg, vocab_size, block_size)


def build_tokenizer(run):
    """The family's own tokenizer where it has one (hf), else `data.tokenizer`."""
    from trainbox.data.tokenizer import get_tokenizer

    hook = getattr(_family_module(run.model), "tokenizer", None)
    return hook(run) if hook is not None else get_tokenizer(run.data.tokenizer)


def model_vocab_size(cfg, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's plus the family's extra ids (t5 sentinels), padded."""
    if cfg.vocab_size:
        return cfg.vocab_size
    hook = getattr(_family_module(cfg), "extra_ids", None)
    return pad_vocab(tokenizer_vocab + (hook(cfg) if hook is not None else 0))


def open_datasets(run, tokenizer, vocab_size: int):
    """(train, val) datasets: the family's own reader where it has one, else data.path's token files."""
    hook = getattr(_family_module(run.model), "open_datasets", None)
    if hook is not None:
        return hook(run, tokenizer, vocab_size)
    from trainbox.data.sources import open_datasets as open_token_datasets
    return open_token_datasets(run.data, tokenizer, vocab_size)


def adapt_datasets(cfg, tokenizer, vocab_size: int, train, val):
    """Families whose examples are not next-token windows (t5) turn the packed datasets into theirs."""
    adapt = getattr(_family_module(cfg.model), "adapt_dataset", None)
    if adapt is None:
        return train, val
    return (adapt(cfg, tokenizer, train, vocab_size, "train"),
            adapt(cfg, tokenizer, val, vocab_size, "val") if val is not None else None)
