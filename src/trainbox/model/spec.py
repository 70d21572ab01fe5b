"""Model families: one typed spec each, in one table (FAMILIES). The trainer, `generate` and `export` ask a
family's spec; nothing else branches on family names.

A family's module defines `build(cfg, vocab_size, block_size[, run])` returning an nn.Module whose forward is
`forward(idx, targets=None, loss_mask=None, caches=None, pos=0, reduction="mean") -> Output` and which has
`num_params` and `flops_per_token`. The spec says what else the family brings:

    needs_run      build() also takes the whole RunConfig as `run=` (hf: LoRA, quantisation)
    resolves       the module's resolve(run) completes the run config before anything is built (llama with
                   model.path: the folder's shape, vocabulary and run.init_from)
    own_tokenizer  the module's tokenizer(run) (hf, llama with model.path: the model's own), else data.tokenizer
    extra_ids      the module's extra_ids(cfg): ids above the tokenizer's (t5: sentinels, decoder start)
    own_datasets   the module's open_datasets(run, tokenizer, vocab) (hf, llama with model.path: chat/text JSONL
                   -> SFT windows)
    adapts_data    the module's adapt_dataset(...) turns packed windows into its examples (t5: span corruption)
    steps          the model takes set_step(step, total) before each step (the kernel choice, speedrun's window)
    generate       causal (sampling with a KV cache), spans (t5: fill <extra_id_K> markers)
    export         what `trainbox export --format hf` writes, and the function that writes it
    hf_import      the function that loads a Hugging Face folder given as run.init_from (module:function)

A hook that applies to some runs of a family only (llama's with model.path) falls back to the default
behaviour inside the module, so the table stays a plain declaration.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch.nn as nn

from trainbox.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    module: str
    generate: str = "causal"
    export: tuple[str, str] | None = ("GPT2LMHeadModel", "trainbox.export:export_cli")   # (what, module:function)
    hf_import: str = "trainbox.export:load_hf_gpt2"
    needs_run: bool = False
    resolves: bool = False
    own_tokenizer: bool = False
    extra_ids: bool = False
    own_datasets: bool = False
    adapts_data: bool = False
    steps: bool = False

    def load(self):
        try:
            return importlib.import_module(self.module)
        except ModuleNotFoundError as e:
            if e.name == self.module:
                raise ConfigError(f"model.family={self.name!r} is not available in this version of trainbox") from None
            raise

    def exporter(self):
        """The function `trainbox export` calls: (path, out, merge, force) -> the lines saying what it wrote."""
        if self.export is None:
            raise ConfigError(f"model.family={self.name} has no Hugging Face model class to export to",
                              hint="the run's checkpoints (safetensors) are its portable form; generate with "
                                   "`trainbox generate RUN`")
        return _function(self.export[1])

    def hf_importer(self):
        """The function `run.init_from=HF_FOLDER` calls: (folder, model, model section) -> None."""
        return _function(self.hf_import)


def _function(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


FAMILIES = {f.name: f for f in (
    Family("gpt", "trainbox.model.gpt", steps=True),
    Family("moe", "trainbox.model.moe", steps=True,   # transformers has no GPT-2 MoE class: trainbox's own folder
           export=("trainbox MoE folder (trainbox.model.moe.from_pretrained)", "trainbox.export:export_moe_cli")),
    Family("speedrun", "trainbox.model.speedrun", steps=True, export=None),
    Family("t5", "trainbox.model.t5", generate="spans", extra_ids=True, adapts_data=True,
           export=("T5ForConditionalGeneration", "trainbox.export:export_t5_cli")),
    Family("hf", "trainbox.model.hf", needs_run=True, own_tokenizer=True, own_datasets=True,
           export=("PEFT adapter or merged model", "trainbox.export_lora:export_cli")),
    Family("llama", "trainbox.model.llama", resolves=True, own_tokenizer=True, own_datasets=True,
           export=("LlamaForCausalLM or Qwen2ForCausalLM", "trainbox.export:export_llama_cli"),
           hf_import="trainbox.model.llama_hf:load_hf"),
)}


def family(name: str) -> Family:
    spec = FAMILIES.get(name)
    if spec is None:
        raise ConfigError(f"model.family={name!r} is not one of {', '.join(FAMILIES)}")
    return spec


def pad_vocab(n: int, multiple: int = 64) -> int:
    """Round the vocabulary up for faster matmuls (GPT-2: 50,257 -> 50,304)."""
    return -(-n // multiple) * multiple


def resolve_model(run):
    """The run config completed for its model before anything is built: the keys the recipe requires are
    checked, then the family resolves what it takes from elsewhere (llama with model.path: the folder's shape,
    vocabulary and initial weights). A new config; the given one is not changed."""
    run.check_required()
    spec = family(run.model.family)
    return spec.load().resolve(run) if spec.resolves else run


def build_model(cfg, vocab_size: int, block_size: int, run=None) -> nn.Module:
    """`cfg` is the ModelSection; `run` the whole RunConfig, passed to families that need it."""
    spec = family(cfg.family)
    if spec.needs_run:
        return spec.load().build(cfg, vocab_size, block_size, run=run)
    return spec.load().build(cfg, vocab_size, block_size)


def build_tokenizer(run):
    """The family's own tokenizer where it has one (hf), else `data.tokenizer`."""
    from trainbox.data.tokenizer import get_tokenizer

    spec = family(run.model.family)
    return spec.load().tokenizer(run) if spec.own_tokenizer else get_tokenizer(run.data.tokenizer)


def model_vocab_size(cfg, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's plus the family's extra ids (t5 sentinels), padded."""
    if cfg.vocab_size:
        return cfg.vocab_size
    spec = family(cfg.family)
    return pad_vocab(tokenizer_vocab + (spec.load().extra_ids(cfg) if spec.extra_ids else 0))


def open_datasets(run, tokenizer, vocab_size: int):
    """(train, val) datasets: the family's own reader where it has one, else data.path's token files."""
    spec = family(run.model.family)
    if spec.own_datasets:
        return spec.load().open_datasets(run, tokenizer, vocab_size)
    from trainbox.data.sources import open_datasets as open_token_datasets
    return open_token_datasets(run.data, tokenizer, vocab_size)


def adapt_datasets(cfg, tokenizer, vocab_size: int, train, val):
    """Families whose examples are not next-token windows (t5) turn the packed datasets into theirs."""
    spec = family(cfg.model.family)
    if not spec.adapts_data:
        return train, val
    adapt = spec.load().adapt_dataset
    return (adapt(cfg, tokenizer, train, vocab_size, "train"),
            adapt(cfg, tokenizer, val, vocab_size, "val") if val is not None else None)
