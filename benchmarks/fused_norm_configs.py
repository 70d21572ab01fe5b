"""Launch configurations of model.fused_norm's Triton kernels at gpt2-125m's shape (49,152 x 768, fp32
residual stream, bf16 sublayer output): each checked against the torch path, then timed (median of 40,
CUDA events), with the GB/s each moves (forward 12, backward 16 bytes per element) and a copy of x for
the card's reachable bandwidth. Prints one JSON line; needs a CUDA GPU.

    python benchmarks/fused_norm_configs.py
"""
import json, itertools, torch
from cuda_timing import median_ms
from trainbox.model import fused_norm as fn
N, C = 49152, 768
torch.manual_seed(0)
x = torch.randn(N, C, device="cuda") * 2
d = torch.randn(N, C, device="cuda").to(torch.bfloat16)
w = torch.randn(C, device="cuda")
g = torch.randn(N, C, device="cuda")
dy = torch.randn(N, C, device="cuda").to(torch.bfloat16)
sms = torch.cuda.get_device_properties(0).multi_processor_count

def t(f):
    return median_ms(f, reps=40)

out = {"gpu": torch.cuda.get_device_name(), "sms": sms, "fwd": {}, "bwd": {}}
out["clone_fp32_TBps"] = round(8 * N * C / t(lambda: x.clone()) / 1e9, 2)
ref = fn._forward_reference(x, d, w, None, 1e-5)
for bm, wp in itertools.product((1, 2, 4, 8, 16), (2, 4, 8, 16)):
    try:
        r = fn._triton_forward(x, d, w, None, 1e-5, torch.bfloat16, block_m=bm, warps=wp)
        assert torch.equal(r[0], ref[0]) and torch.allclose(r[3], ref[3])
        ms = t(lambda: fn._triton_forward(x, d, w, None, 1e-5, torch.bfloat16, block_m=bm, warps=wp))
        out["fwd"][f"m{bm}_w{wp}"] = [round(ms, 4), round(12 * N * C / ms / 1e9, 2)]
    except Exception as e:
        out["fwd"][f"m{bm}_w{wp}"] = repr(e)[:80]
xo, _, mean, rstd = ref
rb = fn._backward_reference(g, dy, xo, w, mean, rstd, False, torch.bfloat16)
for bm, wp, per in itertools.product((1, 2, 4, 8), (4, 8, 16), (2, 4, 8, 16)):
    try:
        kw = dict(progs=per * sms, block_m=bm, warps=wp)
        r = fn._triton_backward(g, dy, xo, w, mean, rstd, False, torch.bfloat16, **kw)
        assert torch.allclose(r[0], rb[0], atol=1e-4, rtol=1e-4) and torch.allclose(r[2], rb[2], rtol=1e-3, atol=1e-1)
        ms = t(lambda: fn._triton_backward(g, dy, xo, w, mean, rstd, False, torch.bfloat16, **kw))
        out["bwd"][f"m{bm}_w{wp}_p{per}"] = [round(ms, 4), round(16 * N * C / ms / 1e9, 2)]
    except Exception as e:
        out["bwd"][f"m{bm}_w{wp}_p{per}"] = repr(e)[:80]
for k in ("fwd", "bwd"):
    ok = {n: v for n, v in out[k].items() if isinstance(v, list)}
    out[f"best_{k}"] = min(ok.items(), key=lambda kv: kv[1][0])
out["default"] = {"fwd": out["fwd"].get("m4_w4"), "bwd": out["bwd"].get("m4_w4_p4")}
print(json.dumps(out))
