"""One AdamW step over one parameter whose two moments are stored in bfloat16, as one Triton kernel
(`optim.state_dtype: bf16` on CUDA; optim/adamw.py's BF16StateAdamW runs it).

torch.optim.AdamW's arithmetic (decoupled weight decay, lerp of the first moment, the bias corrections, eps outside
the square root) in fp32 registers: the kernel reads the fp32 parameter, the gradient and the two bf16 moments once,
and writes the parameter and the moments rounded stochastically, 20 bytes a parameter with an fp32 gradient where
the foreach path makes fp32 copies of the moments and a tensor of random bits first, and torch's fused fp32 AdamW
moves 28. The parameter is updated with the fp32 moments before their rounding, as the foreach path does.

Stochastic rounding: 16 random bits added below bfloat16's last bit of the fp32 pattern, then truncated (away
from zero with probability (the dropped bits) / 2^16; right in expectation). One Philox draw (`tl.randint`, keyed by
`seed` and the element's index) gives 32 bits: the low half rounds the first moment, the high half the second. The
same seed gives the same bits, so a resumed run rounds as the uninterrupted one.
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 2048


def available(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the kernel can update `p`: Triton present, a CUDA fp32 parameter, contiguous with its gradient."""
    return (triton is not None and p.is_cuda and p.dtype == torch.float32 and p.is_contiguous()
            and grad.is_contiguous() and grad.dtype in (torch.float32, torch.bfloat16))


if triton is not None:
    @triton.jit
    def _round_stochastic(x, bits):
        """fp32 x -> bfloat16, rounded away from zero with probability (x's low 16 bits + bits) / 2^16."""
        raw = x.to(tl.uint32, bitcast=True)
        return ((raw + bits) & 0xFFFF0000).to(tl.float32, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def _adamw_bf16_state_kernel(P, G, M, V, n, decay, lerp, beta2, one_minus_beta2, step_size, bias2_sqrt, eps,
                                 seed, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask)
        g = tl.load(G + offs, mask=mask).to(tl.float32)
        m = tl.load(M + offs, mask=mask).to(tl.float32)
        v = tl.load(V + offs, mask=mask).to(tl.float32)
        p = p * decay
        m = m + lerp * (g - m)                      # torch.lerp at a weight under 1/2
        v = v * beta2 + one_minus_beta2 * (g * g)
        bits = tl.randint(seed, offs)
        tl.store(M + offs, _round_stochastic(m, bits & 0xFFFF), mask=mask)
        tl.store(V + offs, _round_stochastic(v, bits >> 16), mask=mask)
        p = p + step_size * (m / (tl.sqrt(v) / bias2_sqrt + eps))
        tl.store(P + offs, p, mask=mask)


def adamw_bf16_state_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                      lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                      seed: int) -> None:
    """p, exp_avg, exp_avg_sq updated in place by AdamW step number `step` (1-based); `seed` keys the rounding's
    random bits (under 2^63). Requires `available(p, grad)`."""
    n = p.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    _adamw_bf16_state_kernel[grid](
        p, grad, exp_avg, exp_avg_sq, n, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2,
        -lr / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5, eps, seed, BLOCK=BLOCK)
