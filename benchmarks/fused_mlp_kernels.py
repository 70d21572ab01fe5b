"""model.fused_mlp's epilogue GEMMs (QuACK) against what the compiled unfused MLP runs, at gpt2-125m's
shapes (49,152 tokens, 768 -> 3,072, bf16), for several tilings. Forward: cuBLAS h = x W1ᵀ, then Inductor's
GELU kernel, against one GEMM writing h and GELU(h). Backward: cuBLAS dA = g W2, then Inductor's kernel
writing dH = dA GELU'(h), against one GEMM writing dH (the model's `dgelu` epilogue; `bwd_dact` is QuACK's
gemm_dact, which also writes GELU(h)). Then moe-gpt2-125m's experts (8 of them, 98,304 rows = 2 x 49,152
in uneven groups): each of the six variable-length grouped GEMMs of fused_mlp.moe_gelu_mlp against
torch._grouped_mm and the GELU kernels that the unfused experts run. Each QuACK output is checked against
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
from trainbox.model.fused_mlp import _config, _quack

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
    bwd = lambda: _quack().dgelu(g, w2, h, config=cfg, tuned=False, dynamic_scheduler=False)["D"]  # noqa: E731
    dact = lambda: gemm_dact(g, w2, h, activation="gelu_tanh_approx", config=cfg, tuned=False)  # noqa: E731
    hq, aq = fwd()
    out["quack"][name] = {"fwd": t(fwd), "bwd": t(bwd), "bwd_dact": t(dact),
                          "rel_err": {"h": rel(hq, h.float()), "a": rel(aq, a_ref), "dH": rel(bwd(), dh_ref)}}

# the experts: rows sorted by expert, group sizes from a Dirichlet draw (a router's imbalance)
E, M2 = 8, 2 * M
sizes = (torch.distributions.Dirichlet(torch.full((E,), 4.0)).sample() * M2).long()
sizes[-1] = M2 - sizes[:-1].sum()
offs = sizes.cumsum(0).to(device="cuda", dtype=torch.int32)
cu = torch.cat([offs.new_zeros(1), offs])
xe, ge = torch.randn(M2, C, device="cuda", dtype=bf), torch.randn(M2, C, device="cuda", dtype=bf)
w1e = (torch.randn(E, C, FH, device="cuda") * 0.02).to(bf)
w2e = (torch.randn(E, FH, C, device="cuda") * 0.02).to(bf)
he = torch._grouped_mm(xe, w1e, offs=offs)
ae = gelu(he)
dAe = torch._grouped_mm(ge, w2e.transpose(1, 2), offs=offs)
q, cfg = _quack(), _config(torch.device("cuda"))
exp = {"group_sizes": sizes.tolist(), "torch": {
    "fwd_up": t(lambda: torch._grouped_mm(xe, w1e, offs=offs)), "fwd_gelu": t(lambda: gelu(he)),
    "fwd_down": t(lambda: torch._grouped_mm(ae, w2e, offs=offs)),
    "bwd_dA": t(lambda: torch._grouped_mm(ge, w2e.transpose(1, 2), offs=offs)),
    "bwd_gelu_backward": t(lambda: dgelu(dAe, he)),
    "bwd_dx": t(lambda: torch._grouped_mm(dAe, w1e.transpose(1, 2), offs=offs)),
    "bwd_dw1": t(lambda: torch._grouped_mm(xe.t(), dAe, offs=offs)),
    "bwd_dw2": t(lambda: torch._grouped_mm(ae.t(), ge, offs=offs))}}
hq, aq = q.gemm_act(xe, w1e, activation="gelu_tanh_approx", cu_seqlens_m=cu, config=cfg, tuned=False)
dhq = q.dgelu(ge, w2e.mT, he, config=cfg, tuned=False, dynamic_scheduler=False, cu_seqlens_m=cu)["D"]
dh_e = torch.ops.aten.gelu_backward(dAe.float(), he.float(), approximate="tanh")
exp["quack"] = {
    "fwd_up_gelu": t(lambda: q.gemm_act(xe, w1e, activation="gelu_tanh_approx", cu_seqlens_m=cu, config=cfg,
                                        tuned=False)),
    "fwd_down": t(lambda: q.gemm(ae, w2e, cu_seqlens_m=cu, tuned=False)),
    "bwd_dH": t(lambda: q.dgelu(ge, w2e.mT, he, config=cfg, tuned=False, dynamic_scheduler=False, cu_seqlens_m=cu)),
    "bwd_dx": t(lambda: q.gemm(dAe, w1e.mT, cu_seqlens_m=cu, tuned=False)),
    "bwd_dw1": t(lambda: q.gemm(xe.mT, dAe, cu_seqlens_k=cu, tuned=False)),
    "bwd_dw2": t(lambda: q.gemm(ae.mT, ge, cu_seqlens_k=cu, tuned=False)),
    "rel_err": {"h": rel(hq, he.float()), "a": rel(aq, F.gelu(he.float(), approximate="tanh")),
                "dH": rel(dhq, dh_e), "dw2": rel(q.gemm(ae.mT, ge, cu_seqlens_k=cu, tuned=False),
                                                 torch._grouped_mm(ae.t(), ge, offs=offs).float())}}
for side in ("torch", "quack"):
    exp[side]["total"] = round(sum(v for k, v in exp[side].items() if k != "rel_err"), 4)
out["experts"] = exp
print(json.dumps(out))
