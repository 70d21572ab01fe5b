"""Float8 training of the blocks' linear layers through torchao (`train.float8=true`), as torchtitan does it.

    trainbox train llama-1b --nproc 2 train.parallel=fsdp train.float8=true

Every nn.Linear inside the model's blocks (`checkpoint_units()`) whose both dimensions are multiples of 16
becomes torchao's Float8Linear: its forward and backward matmuls run on FP8 tensor cores with dynamic
tensorwise scales, its weights and optimizer state stay in full precision. The embedding and the head keep
their precision (the head's logits feed the loss directly). Under `train.parallel=fsdp` the weights are also
all-gathered in float8 (half the traffic of bf16), with the scales of every weight computed in one pass after
each optimizer step (`after_step`).

Needs FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200, Blackwell) and the `float8` extra
(torchao); anything else is refused before the model is built. The model families' own FP8 kernels
(model.fp8_head, model.fp8_mlp of gpt and speedrun) are a separate, narrower path.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn

from trainbox.errors import ConfigError
from trainbox.kernels.fp8 import fp8_supported

EXTRA = "pip install 'trainbox[float8]' (torchao)"


def require_float8(device: torch.device) -> None:
    """Refuse train.float8 where it cannot run: no FP8 tensor cores, or no torchao."""
    if not fp8_supported(device):
        name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
        raise ConfigError(f"train.float8=true needs a GPU with FP8 tensor cores (compute capability 8.9+: L4, "
                          f"L40S, H100, H200, Blackwell); this run is on {device}{name}",
                          hint="drop train.float8 (the matmuls then run in bf16)")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("train.float8=true needs torchao, which is not installed", hint=EXTRA)


def convertible(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: nn.Module, fsdp: bool) -> int:
    """Swap the blocks' linear layers for Float8Linear in place; returns how many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional: torchao

    units = getattr(model, "checkpoint_units", None)
    if units is None:
        raise ConfigError(f"train.float8 is not available for model.family={getattr(model, 'family', '?')}",
                          hint="drop train.float8")
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    count = 0
    for block in units():
        before = sum(convertible(m) for m in block.modules())
        convert_to_float8_training(block, config=config, module_filter_fn=lambda m, _name: convertible(m))
        count += before
    return count


def after_step(model: nn.Module) -> None:
    """Under fsdp with float8 all-gathers: every weight's scale in one all-reduce, ready for the next step."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # optional: torchao
    precompute_float8_dynamic_scale_for_fsdp(model)
