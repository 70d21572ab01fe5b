"""Building a run's model from its config: the functions the trainer, the plan and inference call, each asking the
run's family (model/spec.py) for its own way where it has one."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from trainbox.config.preference import UNPAIRED_LOSSES
from trainbox.data.sources import open_datasets as open_token_datasets
from trainbox.data.tokenizer import get_tokenizer
from trainbox.errors import ConfigError
from trainbox.model.spec import family


def pad_vocab(n: int, multiple: int = 64) -> int:
    """Round the vocabulary up for faster matmuls (GPT-2: 50,257 -> 50,304)."""
    return -(-n // multiple) * multiple


def resolve_model(run):
    """The run config completed for its model before anything is built: the keys the recipe requires are
    checked, then the family resolves what it takes from elsewhere (llama with model.path: the folder's shape,
    vocabulary and initial weights). A new config; the given one is not changed."""
    run.check_required()
    resolve = family(run.model.family).hook("resolve")
    return resolve(run) if resolve is not None else run


def context_length(run) -> int:
    """The positions the run's model supports: model.block_size where set, else the family's own (its `context`
    hook: llama with model.path, the folder's max_position_embeddings, which a fine-tune's data.seq_len does not
    limit), else data.seq_len. What the model is built with, so sampling, chat and lm-eval ask the model for it."""
    if run.model.block_size:
        return run.model.block_size
    own = family(run.model.family).hook("context")
    return (own(run) if own is not None else None) or run.data.seq_len


def build_model(cfg, vocab_size: int, block_size: int, run=None):
    """`cfg` is the ModelSection; `run` the whole RunConfig, which some families read (hf: LoRA, quantisation). A
    reward model (train.objective=reward) gets a score head beside the family's (`scores`)."""
    meta = torch.get_default_device().type == "meta"   # the memory plan counts a model built there
    with _NoDrawsOnMeta() if meta else nullcontext():
        model = family(cfg.family).load().build(cfg, vocab_size, block_size, run=run)
        add_score_head(model, cfg, run)
    return model


def add_score_head(model, cfg, run) -> None:
    """A reward model's (train.objective=reward) score head on `model`, as wide as its hidden state (`model.width`
    where the family has one, else model.n_embd). The token head is not trained: its weight stays the initial
    one, where it is not the token table."""
    if run is None or run.train.objective != "reward":
        return
    model.score = ScoreHead(getattr(model, "width", cfg.n_embd))
    head = getattr(model, "lm_head", None)
    if head is not None and not any(p is head.weight for n, p in model.named_parameters(remove_duplicate=False)
                                    if not n.startswith("lm_head.")):
        head.requires_grad_(False)


class ScoreHead(nn.Linear):
    """A reward model's head: the final hidden state -> one score, no bias (Hugging Face's
    *ForSequenceClassification `score` with num_labels=1), drawn from N(0, 0.02) as transformers initialises it."""

    def __init__(self, n_embd: int):
        super().__init__(n_embd, 1, bias=False)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).squeeze(-1).float()


class _NoDrawsOnMeta(TorchFunctionMode):
    """Leaves out the normal draws of a model's initialisation on the meta device, where a tensor holds no values to
    draw: torch runs a meta tensor's normal_ through its Python reference, whose first call imports torch._dynamo
    (with what that loads, most of a second of every run's start, whose memory check builds the model there)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.init.normal_, torch.Tensor.normal_):
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def build_tokenizer(run):
    """The family's own tokenizer where it has one (hf, llama with model.path), else `data.tokenizer`."""

    own = family(run.model.family).hook("tokenizer")
    return own(run) if own is not None else get_tokenizer(run.data.tokenizer)


def vocab_needed(cfg, tokenizer_vocab: int) -> int:
    """The ids the model must embed: the tokenizer's plus the family's extra ids (t5: sentinels, decoder start)."""
    extra = family(cfg.family).hook("extra_ids")
    return tokenizer_vocab + (extra(cfg) if extra is not None else 0)


def model_vocab_size(cfg, tokenizer_vocab: int) -> int:
    """model.vocab_size, or vocab_needed padded."""
    return cfg.vocab_size or pad_vocab(vocab_needed(cfg, tokenizer_vocab))


def check_vocab_size(cfg, tokenizer, run=None) -> None:
    """Refuse a model vocabulary smaller than the ids the model must embed (the run's pre-flight check). `cfg` is the
    resolved model section (resolve_model), `run` the config as given (None: `cfg` is as given). model.vocab_size is
    the user's, or one the family's resolution took from elsewhere (llama with model.path: the folder's): the
    message names which, and tells to drop model.vocab_size only where the user gave it and the model has enough ids
    without it."""
    need = vocab_needed(cfg, tokenizer.vocab_size)
    if cfg.vocab_size is None or cfg.vocab_size >= need:
        return
    extra = need - tokenizer.vocab_size
    ids = f"the {tokenizer.vocab_size:,} ids of the tokenizer {tokenizer.name}" + (
        f" plus {extra} {cfg.family} extra ids" if extra else "")
    origin = f"model.path={cfg.path}'s vocab_size" if cfg.path else f"model.family={cfg.family}'s"
    if run is None or run.model.vocab_size is not None:
        what = f"model.vocab_size={cfg.vocab_size} is smaller than {ids}"
        unset = None if run is None else resolve_model(run.model_copy(update={
            "model": run.model.model_copy(update={"vocab_size": None})})).model.vocab_size
        if unset is None:
            fix = (f"drop model.vocab_size (the default is {pad_vocab(need):,}: the ids padded to a multiple of 64) "
                   f"or set it to at least {need:,}")
        elif unset >= need:
            fix = f"drop model.vocab_size (without it, {origin}: {unset:,}) or set it to at least {need:,}"
        else:
            fix = f"set model.vocab_size to at least {need:,} (without it, {origin}: {unset:,}, fewer too)"
    else:
        what = f"the model's {cfg.vocab_size:,} ids ({origin}) are fewer than {ids}"
        fix = f"set model.vocab_size to at least {need:,}"
    if not cfg.path:
        fix += "; or set data.tokenizer to the model's own"
    elif run is not None and run.data.tokenizer != "gpt2":   # gpt2, the default, stands for model.path's own
        fix += f"; or drop data.tokenizer to use model.path={cfg.path}'s own tokenizer"
    raise ConfigError(what, hint=fix)


def packs_examples(run) -> bool:
    """Whether the run's rows are packed examples: data.packing on data its family reads as whole examples (its
    `reads_examples` hook: hf, llama with model.path)."""
    reads = family(run.model.family).hook("reads_examples")
    return bool(run.data.packing and reads is not None and reads(run))


def packs_pairs(run) -> bool:
    """Whether the run's preference pairs are packed into rows (data.packing under train.objective=dpo; kto's
    examples are refused packed by the config)."""
    return bool(run.data.packing and run.train.objective == "dpo" and run.dpo.loss not in UNPAIRED_LOSSES)


def check_packing(run) -> None:
    """Refuse packed examples (or pairs) for a family that cannot keep attention and positions inside each (a
    pre-flight check: the message names data.packing)."""
    if packs_examples(run) or packs_pairs(run):
        family(run.model.family).check_packing()


def open_datasets(run, tokenizer, vocab_size: int):
    """(train, val) datasets: the family's own reader where it has one, else data.path's token files."""
    own = family(run.model.family).hook("open_datasets")
    if own is not None:
        return own(run, tokenizer, vocab_size)
    return open_token_datasets(run.data, tokenizer, vocab_size)


def adapt_datasets(cfg, tokenizer, vocab_size: int, train, val):
    """Families whose examples are not next-token windows (t5) turn the packed datasets into theirs."""
    adapt = family(cfg.model.family).hook("adapt_dataset")
    if adapt is None:
        return train, val
    return (adapt(cfg, tokenizer, train, vocab_size, "train"),
            adapt(cfg, tokenizer, val, vocab_size, "val") if val is not None else None)
