"""Activation checkpointing (`train.activation_checkpointing`): trade recomputation for activation memory.

    trainbox train speedrun-124m train.activation_checkpointing=selective

Modes, applied to each transformer block (a family lists its blocks in `checkpoint_units()`):
- none: autograd keeps what the backward needs (the default);
- experts (a family with experts, model/moe/experts.py): each MoE layer keeps only the rows that enter its experts,
  and the backward runs the experts' hidden layer (their first grouped matmul and its GELU, 4 x n_embd wide per
  routed row: the largest activations of such a model) again. Everything else is kept as under none;
- selective: the block's matmul and attention outputs (and expert parallelism's exchanged rows) are kept and
  the elementwise work between them (norms, activations, residual mixing, dtype casts) is recomputed in the
  backward. The recomputed ops
  are cheap next to the saved matmuls, and their outputs would otherwise be kept at the block's full
  width. This is torch's selective activation checkpointing; torchtitan calls it "selective op" AC;
- full: only each block's input is kept; the whole block runs again in the backward (about a third
  more compute for the smallest activation memory).

Blocks are wrapped by replacing their `forward`, so parameter names, checkpoints and exports do not
change. Without gradients (evaluation, generation) a block runs as usual. Recomputation replays the
RNG state (dropout masks are identical), so gradients equal those of mode none.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from trainbox.errors import ConfigError


def _saved_ops() -> frozenset:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_flash_attention_forward", "_efficient_attention_forward",
             "_scaled_dot_product_flash_attention_for_cpu"]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)  # the speedrun family's attention on GPU
    # expert parallelism's exchanges (parallel/expert.py): kept, so the recomputation communicates nothing
    ops |= {getattr(torch.ops._c10d_functional, n).default for n in ("all_to_all_single", "wait_tensor")}
    return frozenset(ops | ({flex} if flex is not None else set()))


SAVED_OPS = _saved_ops()
# trainbox's own ops, by name: defined on first use (kernels/biased_attention.py: t5's self-attention on GPU)
SAVED_CUSTOM_OPS = frozenset({"trainbox::biased_attention"})


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    saved = op in SAVED_OPS or (isinstance(op, torch._ops.OpOverload) and op.name() in SAVED_CUSTOM_OPS)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(block: nn.Module, mode: str) -> None:
    inner = block.forward
    selective = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _policy)} \
        if mode == "selective" else {}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **selective, **kwargs)

    block.forward = forward


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Wrap every block of `model` for `mode`; returns how many blocks were wrapped."""
    if mode == "none":
        return 0
    if mode == "experts":   # the family's MoE layers recompute their experts' hidden layer (MoEFFN.experts)
        layers = [m for _, m in getattr(model, "moe_layers", [])]
        if not layers:
            raise ConfigError(f"train.activation_checkpointing=experts: model.family={getattr(model, 'family', '?')} "
                              "has no expert layers", hint="use train.activation_checkpointing=selective or full")
        for m in layers:
            m.recompute = True
        return len(layers)
    units = getattr(model, "checkpoint_units", None)
    if units is None:  # (model.family=hf is refused earlier, by the config, with a pointer to its own option)
        raise ConfigError(f"train.activation_checkpointing={mode} is not available for model.family="
                          f"{getattr(model, 'family', '?')}", hint="use train.activation_checkpointing=none")
    blocks = list(units())
    for block in blocks:
        _wrap(block, mode)
    return len(blocks)
