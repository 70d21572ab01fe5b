"""The custom ops that fused models chain, registered with Inductor as explicit fallbacks once such a model is built:
left implicit, torch 2.11 renders the IR of each call's inputs as text while compiling, and through a chain of
these ops that text doubles per layer."""
from __future__ import annotations

import torch

import trainbox.kernels.fused_ce  # noqa: F401 - the ops register on import
import trainbox.kernels.fused_mlp  # noqa: F401
import trainbox.kernels.fused_norm  # noqa: F401
from trainbox.kernels.ops import inductor_fallback

CHAINED_OPS = ("add_layer_norm", "add_layer_norm_bwd", "gelu_mlp", "gelu_mlp_bwd", "moe_gelu_mlp", "moe_gelu_mlp_bwd",
               "head_ce_", "head_ce_fp8")


def register_inductor_fallbacks() -> None:
    """Register the ops a fused_norm / fused_mlp / fused_loss model chains (called where such a model is built)."""
    inductor_fallback(*(getattr(torch.ops.trainbox, name).default for name in CHAINED_OPS))
