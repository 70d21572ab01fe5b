"""Gradient clipping by the global norm, as torch.nn.utils.clip_grad_norm_: every gradient times
min(1, max_norm / (norm + 1e-6)).

Where every optimizer of the step is torch's fused Adam or AdamW, the scale goes to their kernel instead
(`grad_scale`, the attribute torch's GradScaler sets): the step divides each gradient by
max(1, (norm + 1e-6) / max_norm) as it reads it, so the gradients are not read and written once more for the
multiplication. Elsewhere (Muon, bf16 optimizer state, foreach AdamW on the CPU) they are multiplied in place
first.
"""
from __future__ import annotations

import torch


def folds_into_step(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Whether every optimizer is torch's fused Adam or AdamW, whose step takes a gradient scale."""
    return bool(optimizers) and all(isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) and o.defaults.get("fused")
                                    for o in optimizers)


def clip_(params: list[torch.Tensor], max_norm: float, optimizers: list[torch.optim.Optimizer]) -> torch.Tensor:
    """Clip the gradients of `params` (plain tensors or DTensors) to `max_norm` by their global norm, at once or
    in the coming optimizer step (see the module docstring); returns the norm before clipping, a plain tensor."""
    if not folds_into_step(optimizers) or not hasattr(torch.nn.utils, "get_total_norm"):
        return _plain(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norm = _plain(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True))
    scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)
    for opt in optimizers:
        opt.grad_scale = scale
    return norm


def _plain(norm: torch.Tensor) -> torch.Tensor:
    """A DTensor norm (FSDP's sharded gradients) as a plain tensor of the whole norm."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
