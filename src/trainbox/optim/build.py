"""Optimizers and learning-rate schedules.

AdamW (`optim.name: adamw`): two groups, weight decay on matrices (dim >= 2), none on biases, norms and
scalars, as in GPT-2 / nanoGPT. Muon (`optim.name: muon`) is built in `optim/muon.py`: hidden 2-D
matrices go to Muon, embeddings, head, norms and scalars to AdamW.

Every optimizer is returned in a list, so the loop steps and schedules them all the same way; each
param group keeps its base lr in `initial_lr` and the schedule multiplies it.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from trainbox.config import OptimSection
from trainbox.optim.adamw import adamw_groups, make_adamw
from trainbox.optim.muon import build_muon_optimizers


def build_optimizers(model: nn.Module, cfg: OptimSection, device: torch.device) -> list[torch.optim.Optimizer]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.name == "muon":
        optimizers = build_muon_optimizers(model, params, cfg, device)
    else:
        optimizers = [make_adamw(adamw_groups(params, cfg.weight_decay, cfg.lr), cfg, device)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def lr_multiplier(step: int, total: int, cfg: OptimSection) -> float:
    """Multiplier of the base lr at `step` (0-based) of `total` steps. The warm-up is linear, (step + 1) /
    (warmup_steps + 1) for steps 0 .. warmup_steps - 1, as nanoGPT's get_lr and torchtitan's warm-up; the
    full lr comes at step warmup_steps, where the decay starts. So warmup_steps = nanoGPT's warmup_iters gives
    its lr at every step (with its lr_decay_iters = train.max_steps).

    The warm-up matters at gpt2-125m's nanoGPT comparison: a ramp of (step + 1) / warmup_steps, 5% hotter over
    20 steps, ends up to 0.165 above nanoGPT after 200 steps on one seed (H200); with this ramp the loop is "no
    worse" than nanoGPT over 8 paired seeds (docs/performance.md)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    lo = cfg.min_lr_ratio
    if cfg.schedule == "wsd":  # warmup-stable-decay: flat, then linear decay over the last cooldown_frac
        start = total * (1 - cfg.cooldown_frac)
        if step < start:
            return 1.0
        return lo + (1 - lo) * max(0.0, (total - step) / max(1.0, total - start))
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return lo + (1 - lo) * (1 - progress)
    return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizers: list[torch.optim.Optimizer], mult: float) -> float:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * mult
    return optimizers[0].param_groups[0]["lr"]
