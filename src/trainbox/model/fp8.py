"""FP8 linear layer without bias, y = x @ w.T, for the speedrun GPT's output head (`model.fp8_head`).

The head is the largest matmul of a small GPT: 768 x 50,304 per token, about a third of its FLOPs.
FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200) run it at twice the bf16 rate.
Choices:
- the forward multiplies x and w in float8_e4m3 (3 mantissa bits). The backward multiplies the
  incoming gradient in float8_e5m2 (more range, less precision, since gradients span more orders of
  magnitude) by the e4m3 copies saved from the forward. e5m2 x e5m2 products are never formed (no
  kernel takes them);
- scales are dynamic and per tensor, scale = amax / largest finite value of the format, taken on every
  call. Nothing needs tuning and nothing overflows; each amax is one cheap reduction;
- dx comes out in bf16. dw comes out in fp32, accumulated in fp32 by the kernel, because it feeds an
  fp32 master weight;
- the ops are `torch.library` custom ops with a fake (meta) implementation and a registered autograd
  formula, so torch.compile keeps the whole model in one graph.

`torch._scaled_mm` wants its first operand row-major, its second column-major, and every dimension a
multiple of 16. `fp8_linear` falls back to the plain matmul when the rows are not a multiple of 16, as
in a one-token decode step. The CPU runs the same arithmetic, which is how the tests check it against
the fp32 product; only GPUs with FP8 tensor cores make it fast, and the loop refuses the option
elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_supported(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.version.cuda is not None and \
        torch.cuda.get_device_capability(device) >= (8, 9)


def _quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (t / scale in `dtype`, scale as an fp32 scalar tensor), scale = amax / the format's max."""
    scale = t.abs().amax().float().clamp(min=1e-12) / torch.finfo(dtype).max
    return (t.float() / scale).to(dtype), scale


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix, stored column-major (the layout _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


@torch.library.custom_op("trainbox::fp8_linear_fwd", mutates_args=())
def _fwd(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K), w (N, K) -> y (M, N) bf16, plus the e4m3 operands and their scales for the backward."""
    x8, xs = _quantize(x, E4M3)
    w8, ws = _quantize(w, E4M3)
    y = torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    return y, x8, xs, w8, ws


@_fwd.register_fake
def _(x, w):
    return (x.new_empty(x.size(0), w.size(0), dtype=torch.bfloat16), torch.empty_like(x, dtype=E4M3),
            x.new_empty((), dtype=torch.float32), torch.empty_like(w, dtype=E4M3), w.new_empty((), dtype=torch.float32))


@torch.library.custom_op("trainbox::fp8_linear_bwd", mutates_args=())
def _bwd(g: torch.Tensor, x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor,
         ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy (M, N) -> dx = dy @ w (M, K) bf16 and dw = dy.T @ x (N, K) fp32, with dy in e5m2."""
    g8, gs = _quantize(g, E5M2)
    dx = torch._scaled_mm(g8, _col_major(w8), scale_a=gs, scale_b=ws, out_dtype=torch.bfloat16)
    dw = torch._scaled_mm(g8.t().contiguous(), _col_major(x8), scale_a=gs, scale_b=xs, out_dtype=torch.float32)
    return dx, dw


@_bwd.register_fake
def _(g, x8, xs, w8, ws):
    return g.new_empty(g.size(0), w8.size(1), dtype=torch.bfloat16), g.new_empty(w8.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, w = inputs
    _, x8, xs, w8, ws = output
    ctx.save_for_backward(x8, xs, w8, ws)
    ctx.dtypes = (x.dtype, w.dtype)


def _backward(ctx, g, *unused):
    x8, xs, w8, ws = ctx.saved_tensors
    dx, dw = _bwd(g.contiguous(), x8, xs, w8, ws)
    return dx.to(ctx.dtypes[0]), dw.to(ctx.dtypes[1])


_fwd.register_autograd(_backward, setup_context=_setup_context)


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ w.T with w (N, K), in FP8; bf16 result. Plain F.linear where the rows are not a
    multiple of 16 (decode steps) or K, N are not (the kernels' tiling)."""
    rows = x.numel() // x.size(-1)
    if rows % 16 or x.size(-1) % 16 or w.size(0) % 16:
        return F.linear(x, w.to(x.dtype))
    y = _fwd(x.reshape(rows, x.size(-1)).contiguous(), w)[0]
    return y.view(*x.shape[:-1], w.size(0))
