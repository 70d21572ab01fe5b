"""model.fused_mlp's two epilogue GEMMs (QuACK) against what the compiled unfused MLP runs, at gpt2-125m's
shapes (49,152 tokens, 768 -> 3,072, bf16), for several tilings. Forward: cuBLAS h = x W1ᵀ, then Inductor's
GELU kernel, against one GEMM writing h and GELU(h). Backward: cuBLAS dA = g W2, then Inductor's kernel
writing dH = dA GELU'(h), against one GEMM writing dH and GELU(h). Each QuACK output is checked against
torch in fp32 (relative max error), then timed (median of 30, CUDA events). Prints one JSON line; needs a
Hopper/Blackwell GPU and `trainbox[flash]`.

    python benchmarks/fused_mlp_kernels.py

Alone, the tilings' order differs from the order in the model (session 13, H100: 256 x 160 cooperative was
fastest alone, 128 x 192 ping-pong in the model); fused_mlp uses the latter. Compare step times.
"""
import json
import torch
import torch.nn.functional as F
from quack.gemm_config import GemmConfig
from quack.gemm_interface import gemm_act, gemm_dact

from cuda_timing import median_ms

M, C, FH = 49152, 768, 3072
TILINGS = [(128, 192, True, 1, 2), (128, 192, True, 2, 1), (128, 160, True, 2, 1), (128, 208, True, 2, 1),
           (256, 160, False, 1, 2), (256, 192, False, 2, 1), (128, 256, False, 2, 1), (256, 128, False, 2, 1)]
torch.manual_seed(0)
bf = torch.bfloat16
x = torch.randn(M, C, device="cuda", dtype=bf)
w1 = (torch.randn(FH, C, device="cuda") * 0.02).to(bf)
w2 = (torch.randn(C, FH, device="cuda") * 0.02).to(bf)
g = torch.randn(M, C, device="cuda", dtype=bf)
h = x @ w1.t()
dA = g @ w2


def t(f):
    return round(median_ms(f), 4)


def rel(a, b):
    return round(((a.float() - b).abs().max() / b.abs().max()).item(), 5)


gelu = torch.compile(lambda v: F.gelu(v, approximate="tanh"))
dgelu = torch.compile(lambda d, v: torch.ops.aten.gelu_backward(d, v, approximate="tanh"))
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [M, C, FH]}
out["unfused"] = {"fwd_mm": t(lambda: x @ w1.t()), "fwd_gelu": t(lambda: gelu(h)),
                  "bwd_mm": t(lambda: g @ w2), "bwd_gelu_backward": t(lambda: dgelu(dA, h))}
out["unfused"]["fwd"] = round(out["unfused"]["fwd_mm"] + out["unfused"]["fwd_gelu"], 4)
out["unfused"]["bwd"] = round(out["unfused"]["bwd_mm"] + out["unfused"]["bwd_gelu_backward"], 4)
a_ref = F.gelu(h.float(), approximate="tanh")
dh_ref = torch.ops.aten.gelu_backward(dA.float(), h.float(), approximate="tanh")
out["quack"] = {}
for tm, tn, pp, cm, cn in TILINGS:
    cfg = GemmConfig(tile_m=tm, tile_n=tn, pingpong=pp, cluster_m=cm, cluster_n=cn, device_capacity=9,
                     is_dynamic_persistent=False)
    name = f"{tm}x{tn}_{'pingpong' if pp else 'coop'}_cluster{cm}x{cn}"
    fwd = lambda: gemm_act(x, w1.t(), activation="gelu_tanh_approx", config=cfg, tuned=False)  # noqa: E731
    bwd = lambda: gemm_dact(g, w2, h, activation="gelu_tanh_approx", config=cfg, tuned=False)  # noqa: E731
    hq, aq = fwd()
    dhq, aq2 = bwd()[:2]
    out["quack"][name] = {"fwd": t(fwd), "bwd": t(bwd),
                          "rel_err": {"h": rel(hq, h.float()), "a": rel(aq, a_ref), "dH": rel(dhq, dh_ref),
                                      "a_bwd": rel(aq2, a_ref)}}
print(json.dumps(out))
