"""flops_per_token of every family against FLOPs that torch itself counts on a forward + backward pass."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from trainbox.config import load_config
from trainbox.model.build import build_model
from trainbox.train.device import PEAK_TFLOPS


@pytest.mark.parametrize("family,extra", [("gpt", ["model.bias=false"]),
                                          ("moe", ["model.bias=false", "model.moe.num_experts=8", "model.moe.top_k=2"]),
                                          ("moe", ["model.bias=false", "model.moe.num_experts=4", "model.moe.top_k=1",
                                                   "model.moe.every=2"]),
                                          ("llama", ["model.llama.n_kv_head=1", "model.llama.intermediate_size=64"])])
def test_flops_per_token_matches_counted_flops(family, extra):
    """6N + 12 L d T is what the matmuls cost: attention counted in full by the math SDPA path, MoE
    counting only the top_k experts each token visits (the loop-over-experts path, which is aten.mm)."""
    cfg = load_config("tiny", [f"model.family={family}", "model.n_layer=3", "model.n_head=2", "model.n_embd=32",
                               *extra])
    torch.manual_seed(0)
    model = build_model(cfg.model, 64, 16)
    for _, m in getattr(model, "moe_layers", []):
        m.use_kernel = False  # FlopCounterMode has no formula for grouped kernels
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(x, y)
        (out.loss + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    counted = counter.get_total_flops() / x.numel()
    # the remainder is norm weights, which cost no matmul FLOPs but are in N
    assert counted == pytest.approx(model.flops_per_token(16), rel=0.01)
    if family == "moe":
        assert model.flops_per_token(16) < 6 * model.num_params()


def test_peak_table():
    assert ((PEAK_TFLOPS["H100"], PEAK_TFLOPS["H200"], PEAK_TFLOPS["A100"], PEAK_TFLOPS["MI300X"])
            == (989, 989, 312, 1307))
