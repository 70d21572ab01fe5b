"""The expert GEMMs of moe-gpt2-125m at micro-batch 48 (R = 2 x 49,152 rows, 8 experts, 768 <-> 3072):
TFLOP/s of each operand layout through `grouped_mm`, against a dense mm of equal FLOPs, then Inductor's Triton
grouped-mm template (offered by patching its gate, as max-autotune would). Prints progress, then one JSON line.

    python benchmarks/grouped_mm_layouts.py          # CUDA only (H100/H200: torch's CUTLASS grouped kernel)

What it showed on an H100 (benchmarks/records/2026-11-26-session10.json): the grouped kernel runs at 545-640
TFLOP/s where a dense mm of the same FLOPs runs at 680-725; the weights' (E, in, out) layout is the faster
of the two for forward + input gradient together; Triton's template is no faster.
"""
import functools
import json
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("grouped_mm_layouts.py needs a CUDA GPU")
from triton.testing import do_bench  # noqa: E402  (triton comes with CUDA torch)

torch.manual_seed(0)
E, C, H, R = 8, 768, 3072, 98304
dev, bf = "cuda", torch.bfloat16
counts = torch.bincount(torch.randint(0, E, (R,)), minlength=E)
offs = counts.cumsum(0).to(torch.int32).to(dev)
gm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def kmaj(w):  # the same matrix, stored with K (the reduced dimension) contiguous
    return w.transpose(1, 2).contiguous().transpose(1, 2)


x, h = torch.randn(R, C, device=dev, dtype=bf), torch.randn(R, H, device=dev, dtype=bf)
g1, g2 = torch.randn(R, H, device=dev, dtype=bf), torch.randn(R, C, device=dev, dtype=bf)
w1, w2 = torch.randn(E, C, H, device=dev, dtype=bf) / 30, torch.randn(E, H, C, device=dev, dtype=bf) / 50
flops = 2 * R * C * H
res = {}


def t(name, fn):
    try:
        ms = do_bench(fn, warmup=25, rep=200)
        res[name] = [round(ms, 4), round(flops / ms / 1e9, 1)]
    except Exception as e:
        res[name] = str(e).splitlines()[0][:160]
    print(name, res[name], flush=True)


W1d, W2d = torch.randn(C, H, device=dev, dtype=bf), torch.randn(H, C, device=dev, dtype=bf)
t("dense x@W1 (R,768)@(768,3072)", lambda: x @ W1d)
t("dense h@W2 (R,3072)@(3072,768)", lambda: h @ W2d)
t("dense wgrad x^T@g1", lambda: x.t() @ g1)
t("dense wgrad h^T@g2", lambda: h.t() @ g2)
t("fwd c_fc x@w1 (B N-major)", lambda: gm(x, w1, offs=offs))
w1k, w2k = kmaj(w1), kmaj(w2)
t("fwd c_fc x@w1 (B K-major)", lambda: gm(x, w1k, offs=offs))
t("fwd c_proj h@w2 (B N-major)", lambda: gm(h, w2, offs=offs))
t("fwd c_proj h@w2 (B K-major)", lambda: gm(h, w2k, offs=offs))
t("dgrad c_proj g2@w2^T view (K-major)", lambda: gm(g2, w2.transpose(1, 2), offs=offs))
t("dgrad c_proj g2@w2^T copy (N-major)", lambda: gm(g2, w2.transpose(1, 2).contiguous(), offs=offs))
t("dgrad c_fc g1@w1^T view (K-major)", lambda: gm(g1, w1.transpose(1, 2), offs=offs))
t("dgrad c_fc g1@w1^T copy (N-major)", lambda: gm(g1, w1.transpose(1, 2).contiguous(), offs=offs))
t("wgrad c_fc x^T@g1 -> (E,768,3072)", lambda: gm(x.t(), g1, offs=offs))
t("wgrad c_fc (g1^T@x) -> (E,3072,768)", lambda: gm(g1.t(), x, offs=offs))
t("wgrad c_proj h^T@g2 -> (E,3072,768)", lambda: gm(h.t(), g2, offs=offs))
t("wgrad c_proj (g2^T@h) -> (E,768,3072)", lambda: gm(g2.t(), h, offs=offs))
t("wgrad c_fc x^T@g1 out fp32", lambda: gm(x.t(), g1, offs=offs, out_dtype=torch.float32))
# Inductor's Triton template (torch 2.11 needs K-major A and B)
import torch._inductor.kernel.mm_grouped as G  # noqa: E402
import torch._inductor.utils as U  # noqa: E402
from torch._inductor.select_algorithm import ExternKernelCaller  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

G.use_triton_template = functools.partial(U.use_triton_template, check_max_autotune=False)
calls = []
orig = G.can_use_triton_kernel


def spy(a, b, o, bi, s):
    r = orig(a, b, o, bi, s)
    calls.append((a.get_stride(), b.get_stride(), r))
    return r


G.can_use_triton_kernel = spy
_sel = G.autotune_select_algorithm


def only_tri(name, choices, *a, **k):
    tri = [c for c in choices if not isinstance(c, ExternKernelCaller)]
    print("choices", len(choices), "triton", len(tri), flush=True)
    return _sel(name, tri or choices, *a, **k)


G.autotune_select_algorithm = only_tri
for name, a, b in [("triton fwd c_fc K-major", x, w1k), ("triton fwd c_proj K-major", h, w2k),
                   ("triton dgrad c_fc view", g1, w1.transpose(1, 2))]:
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda a, b, o: gm(a, b, offs=o))
        _, code = run_and_get_code(f, a, b, offs)
        print(name, "template in code:", "grouped_mm" in code[0] and "tl.dot" in code[0], calls[-1:] , flush=True)
        t(name, lambda: f(a, b, offs))
        ref = gm(a, b, offs=offs).float(); out = f(a, b, offs).float()
        res[name + " maxrel"] = float((out - ref).abs().max() / ref.abs().max())
    except Exception as e:
        res[name] = "ERR " + str(e).splitlines()[0][:300]; print(name, res[name], calls[-1:], flush=True)
print(json.dumps(res))
