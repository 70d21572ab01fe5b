"""PyTorch's own attention kernels side by side on the recipes' shapes: which SDPA backend a plain install (no
`flash` extra) should run on this GPU.

    python benchmarks/sdpa_backends.py [--record]

For each shape (gpt2-125m's micro-batch, llama-1b's 8,192-token rows with grouped-query heads) and each backend
(FLASH_ATTENTION: torch's FlashAttention-2, CUDNN_ATTENTION, EFFICIENT_ATTENTION), causal, bf16: the median time
of a forward and backward (CUDA events, --reps after warm-up), the TFLOP/s that makes (4 B H T^2 D / 2 forward, 2.5x
that forward and backward), and the largest difference of the output and of each input's gradient from the
math backend's in fp32 (the reference). A backend that refuses a shape is listed with its error. Prints one JSON
result record (common.Result); --record writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse

import common
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# name: (batch, query heads, sequence, head dim, key/value heads)
SHAPES = {"gpt2-125m micro-batch 48": (48, 12, 1024, 64, 12),
          "llama-1b micro-batch 2": (2, 32, 8192, 64, 8)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(q, k, v, backend):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))


def measure(shape: tuple, backend, reps: int) -> dict:
    b, h, t, d, hkv = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for n in (h, hkv, hkv))
    g = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    try:
        out = attention(q, k, v, backend)
        out.backward(g)
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0][:300]}
    got = [out.float(), *(x.grad.float() for x in (q, k, v))]
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = attention(*ref_in, SDPBackend.MATH)
    ref.backward(g.float())
    want = [ref, *(x.grad for x in ref_in)]
    errors = {n: (a - w).abs().max().item() / w.abs().max().item()
              for n, a, w in zip(("out", "dq", "dk", "dv"), got, want)}
    del ref, ref_in, want, got

    def step():
        for x in (q, k, v):
            x.grad = None
        attention(q, k, v, backend).backward(g)
    ms = common.median_ms(step, reps=reps)
    flops = 2.5 * 4 * b * h * t * t * d / 2   # causal: half the square; backward 2.5x the forward
    return {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
            "max_rel_error_vs_math_fp32": {n: float(f"{e:.3g}") for n, e in errors.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    results = {name: {b: measure(shape, backend, args.reps) for b, backend in BACKENDS.items()}
               for name, shape in SHAPES.items()}
    result = common.Result(tool="sdpa_backends", what="sdpa-backends", gpu=common.gpu_info(), recipe=None, overrides=[],
                           command=common.command_line(), metrics={"shapes": results,
                                                                   "cudnn": torch.backends.cudnn.version()})
    common.emit(result, record=args.record)


if __name__ == "__main__":
    main()
