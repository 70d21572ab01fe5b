"""T5's self-attention, forward and backward: trainbox's Triton kernels (kernels/biased_attention.py) against PyTorch's
SDPA with the position bias as an additive mask that needs its gradient (its memory-efficient kernel, the only one
that takes it), on t5-base's shapes.

    python benchmarks/biased_attention.py [--sweep] [--record]

Shapes: t5-base's encoder (micro-batch 32 x 512 tokens, 12 heads of 64) and decoder (32 x 114, causal). SDPA runs as
the model's sdpa path does: the fp32 bias cast to bf16, broadcast over the batch, its gradient summed by autograd;
ours takes the fp32 bias and sums its gradient over the batch in the kernel, by position (H, T, T) and by distance
(H, 2T - 1: what T5 passes, read along its diagonals). For each: the median time of a forward
and backward (CUDA events), the TFLOP/s that makes (4 B H Tq Tk D forward, halved when causal, 2.5x that forward and
backward), and the largest difference of the output and of each gradient from the fp32 math reference, relative to
its largest value. --sweep also times each kernel at other block sizes (BM, BN, warps, stages): the forward alone,
and each backward kernel as the change of the whole backward's time when it alone takes that size (negative: faster
than at BLOCKS), the figures behind BLOCKS. Prints one JSON result record (common.Result);
--record writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import functools

import common
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainbox.kernels import biased_attention as ba

# name: (batch, sequence, heads, head dim, causal)
SHAPES = {"t5-base encoder": (32, 512, 12, 64, False), "t5-base decoder": (32, 114, 12, 64, True)}
SWEEP = [(64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
         (64, 128, 4, 3)]


def sdpa(q, k, v, bias, causal):
    mask = bias.unsqueeze(0)
    if causal:
        mask = mask + torch.full(bias.shape[-2:], float("-inf"), device=q.device).triu(1)
    mask = mask.to(q.dtype)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask.contiguous(), scale=1.0).transpose(1, 2)


def ours(q, k, v, bias, causal):
    return ba.biased_attention(q, k, v, bias, 1.0, causal)


def measure(shape: tuple, fn, reps: int, by: str = "position") -> dict:
    """`by`: the bias by position (H, T, T), or by distance (H, 2T - 1) as T5 passes it to our kernels."""
    b, t, h, d, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    bias = torch.randn(h, *((t, t) if by == "position" else (2 * t - 1,)), device="cuda",
                       generator=gen).requires_grad_()
    g = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = fn(q, k, v, bias, causal)
    out.backward(g)
    got = [out.float(), *(x.grad.float() for x in (q, k, v, bias))]
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v, bias)]
    mask = (ref_in[3] if by == "position" else ba.diagonals(ref_in[3], t, t)).unsqueeze(0)
    if causal:
        mask = mask + torch.full((t, t), float("-inf"), device="cuda").triu(1)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in ref_in[:3]), attn_mask=mask,
                                             scale=1.0).transpose(1, 2)
    ref.backward(g.float())
    want = [ref, *(x.grad for x in ref_in)]
    errors = {n: (a - w).abs().max().item() / w.abs().max().item()
              for n, a, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want)}
    del ref, ref_in, want, got

    def step():
        for x in (q, k, v, bias):
            x.grad = None
        fn(q, k, v, bias, causal).backward(g)
    ms = common.median_ms(step, reps=reps)
    return {"ms": round(ms, 3), "tflops": round(flops(shape) / ms / 1e9, 1),
            "max_rel_error_vs_math_fp32": {n: float(f"{e:.3g}") for n, e in errors.items()}}


def flops(shape: tuple) -> float:
    b, t, h, d, causal = shape
    return 2.5 * 4 * b * h * t * t * d / (2 if causal else 1)


def sweep(shape: tuple, reps: int) -> dict:
    """Each kernel alone at each block size, in ms: the forward, and the backward's dk-dv, dq and bias-gradient
    kernels (the backward timed whole, with every kernel at that size, less the others at their BLOCKS)."""
    b, t, h, d, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    bias = torch.randn(h, t, t, device="cuda", generator=gen)
    o, lse = ba._triton_forward(q, k, v, bias, 1.0, causal)
    base = common.median_ms(lambda: ba._triton_backward(do, q, k, v, bias, o, lse, 1.0, causal), reps=reps)
    out = {"backward_ms at BLOCKS": round(base, 3)}
    for blocks in SWEEP:
        row = {}
        try:
            forward = functools.partial(ba._triton_forward, q, k, v, bias, 1.0, causal, {"forward": blocks})
            row["forward"] = round(common.median_ms(forward, reps=reps), 3)
            for kernel in ("dkdv", "dq", "dbias"):   # the backward with this kernel alone at `blocks`
                backward = functools.partial(ba._triton_backward, do, q, k, v, bias, o, lse, 1.0, causal,
                                             {kernel: blocks})
                row[kernel] = round(common.median_ms(backward, reps=reps) - base, 3)
        except Exception as e:  # noqa: BLE001 - a block size the compiler refuses (shared memory) is a result too
            row["error"] = str(e).splitlines()[0][:200]
        out["x".join(map(str, blocks))] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    shapes = {}
    for name, shape in SHAPES.items():
        row = {"sdpa efficient (bias as a mask)": measure(shape, sdpa, args.reps),
               "trainbox triton": measure(shape, ours, args.reps),
               "trainbox triton, bias by distance": measure(shape, ours, args.reps, by="distance")}
        row["speedup"] = round(row["sdpa efficient (bias as a mask)"]["ms"] / row["trainbox triton"]["ms"], 2)
        row["speedup_by_distance"] = round(row["sdpa efficient (bias as a mask)"]["ms"]
                                           / row["trainbox triton, bias by distance"]["ms"], 2)
        if args.sweep:
            row["sweep"] = sweep(shape, args.reps)
        shapes[name] = row
    metrics = {"shapes": shapes, "blocks": {kernel: table[64] for kernel, table in ba.BLOCKS.items()}}
    common.emit(common.Result(tool="biased_attention", what="t5-biased-attention", gpu=common.gpu_info(), recipe=None,
                              overrides=[], command=common.command_line(), metrics=metrics), record=args.record)


if __name__ == "__main__":
    main()
