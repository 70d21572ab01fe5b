"""FP8 linear layer, y = x @ w.T, for the output head (`model.fp8_head`) and the MLP projections
(`model.fp8_mlp`) of the gpt and speedrun models. With `model.fused_loss` the head's three FP8 matmuls
live in kernels/fused_ce.py, on `fp8_forward` and `fp8_backward` from here.

The head is the largest matmul of a small GPT: 768 x 50,304 per token, about a third of its FLOPs; the
MLP's two projections are about half. FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200)
run them at up to twice the bf16 rate.
Choices:
- the forward multiplies x and w in float8_e4m3 (3 mantissa bits). The backward multiplies the
  incoming gradient in float8_e5m2 (more range, less precision, since gradients span more orders of
  magnitude) by the e4m3 copies saved from the forward. e5m2 x e5m2 products are never formed (no
  kernel takes them);
- scales are dynamic and per tensor, scale = amax / largest finite value of the format, taken on every
  call. Nothing needs tuning and nothing overflows; each amax is one cheap reduction;
- dx comes out in bf16. dw comes out in fp32, accumulated in fp32 by the kernel, because it feeds an
  fp32 master weight;
- the layer is an autograd.Function of plain torch ops, so torch.compile keeps the whole model in one
  graph and fuses the quantisation (amax, scale, cast) with its neighbours. Inside `torch.library`
  custom ops it would be opaque to Inductor: each amax, cast and transpose would run as its own eager
  kernel over the 64K x 50K gradient.

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


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (t / scale in `dtype`, scale as an fp32 scalar tensor), scale = amax / the format's max."""
    scale = t.abs().amax().float().clamp(min=1e-12) / torch.finfo(dtype).max
    return (t.float() / scale).to(dtype), scale


def fp8_shapes_ok(rows: int, *dims: int) -> bool:
    """_scaled_mm's tiling: every dimension a multiple of 16."""
    return all(d % 16 == 0 for d in (rows, *dims))


def col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix, stored column-major (the layout _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


def fp8_forward(x: torch.Tensor, w: torch.Tensor):
    """x (M, K) @ w.T (w (N, K)) from e4m3 copies -> (y in bf16, x8, xs, w8, ws): the product and what its
    backward (fp8_backward) needs."""
    x8, xs = quantize(x, E4M3)
    w8, ws = quantize(w, E4M3)
    return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16), x8, xs, w8, ws


def fp8_backward(g8: torch.Tensor, gs: torch.Tensor, x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor,
                 ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of y = x @ w.T from the FP8 dy (g8 * gs) and FP8 operands -> (dx in bf16, dw in fp32):
    _scaled_mm's layouts (first operand row-major, second column-major) made here once."""
    dx = torch._scaled_mm(g8, col_major(w8), scale_a=gs, scale_b=ws, out_dtype=torch.bfloat16)
    dw = torch._scaled_mm(g8.t().contiguous(), col_major(x8), scale_a=gs, scale_b=xs, out_dtype=torch.float32)
    return dx, dw


class _FP8Linear(torch.autograd.Function):
    """y = x @ w.T with e4m3 operands; the backward takes dy in e5m2 by the saved e4m3 copies.

    Written in plain torch ops (torch.compile traces an autograd.Function into the model's graph), so
    Inductor fuses each amax and each scale-and-cast into one kernel and the 64K x 50K gradient of the
    head is read as few times as possible; only `torch._scaled_mm` runs as a library kernel.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y, *saved = fp8_forward(x, w)
        ctx.save_for_backward(*saved)
        ctx.dtypes = (x.dtype, w.dtype)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x8, xs, w8, ws = ctx.saved_tensors
        dx, dw = fp8_backward(*quantize(g, E5M2), x8, xs, w8, ws)
        return dx.to(ctx.dtypes[0]), dw.to(ctx.dtypes[1])


def mlp_fp8(mode: str) -> tuple[bool, bool]:
    """model.fp8_mlp -> (up-projection in FP8, down-projection in FP8)."""
    return mode == "both", mode in ("down", "both")


def linear(layer: torch.nn.Linear, x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """`layer(x)`, with the matmul in FP8 when `fp8` (the bias added in the result's dtype, as autocast does)."""
    if not fp8:
        return layer(x)
    y = fp8_linear(x, layer.weight)
    return y if layer.bias is None else y + layer.bias.to(y.dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ w.T with w (N, K), in FP8; bf16 result. Plain F.linear where the rows are not a
    multiple of 16 (decode steps) or K, N are not (the kernels' tiling)."""
    rows = x.numel() // x.size(-1)
    if not fp8_shapes_ok(rows, x.size(-1), w.size(0)):
        return F.linear(x, w.to(x.dtype))
    y = _FP8Linear.apply(x.reshape(rows, x.size(-1)), w)
    return y.view(*x.shape[:-1], w.size(0))
