"""Evaluation helpers of the loop: the autocast context it runs forwards in. The validation itself is the
objective's (objective/next_token.py: loss and bits per byte; objective/preference.py: pairs)."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from trainbox.objective.next_token import evaluate  # noqa: F401 - the token validation, where callers look for it


def autocast_context(device: torch.device, dtype: torch.dtype):
    """A fresh autocast context (bf16/fp16 on GPU); a no-op in fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
