"""AdamW as every run builds it: weight decay on matrices only, fused on CUDA."""
from __future__ import annotations

import torch
import torch.nn as nn

from trainbox.config import OptimSection


def adamw_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float, lr: float) -> list[dict]:
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=weight_decay, lr=lr), dict(params=no_decay, weight_decay=0.0, lr=lr)]
    return [g for g in groups if g["params"]]


def make_adamw(groups: list[dict], cfg: OptimSection, device: torch.device) -> torch.optim.AdamW:
    # fused AdamW is one kernel per step on CUDA; on CPU the default foreach path is exact and fast enough
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
