"""acc += g for an fp32 accumulator and a 16-bit gradient of the same shape, as one Triton kernel on CUDA.

Expert parallelism adds each micro-batch's bf16 gradient of the experts' 16-bit weight copies into the fp32
weights' .grad (parallel/expert.py). torch's `add_` with operands of two dtypes takes its unvectorised path; this
kernel reads 6 bytes and writes 4 per element in wide blocks. Both tensors contiguous; elsewhere (the CPU, other
layouts) `add_`. The sum is the same: the 16-bit value converted to fp32 exactly, then one fp32 add.
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 4096


if triton is not None:
    @triton.jit
    def _accumulate_kernel(A, G, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(A + offs, mask=mask)
        g = tl.load(G + offs, mask=mask).to(tl.float32)
        tl.store(A + offs, a + g, mask=mask)


def accumulate_(acc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """acc += g in place (acc fp32, g of acc's shape); returns acc."""
    if (triton is None or not acc.is_cuda or acc.dtype != torch.float32 or acc.shape != g.shape
            or not (acc.is_contiguous() and g.is_contiguous()) or acc.numel() == 0):
        return acc.add_(g)
    n = acc.numel()
    _accumulate_kernel[(triton.cdiv(n, BLOCK),)](acc, g, n, BLOCK=BLOCK, num_warps=8)
    return acc
