"""Residual add + LayerNorm as one op with a one-pass backward (`model.fused_norm`).

A pre-LN block adds each sublayer's output to the residual stream and normalises the sum for the next
sublayer:

    x' = x + d,    y = LayerNorm(x') = (x' - mean) * rstd * w (+ b)

The gradient at x' is the sum of the residual path's and the norm's, g' = g + LayerNorm'(dy). Inductor
computes it in one kernel per norm, then sums dw in separate column-reduction kernels that read x' and dy
again, then casts g' to the sublayer output's dtype (bf16) for the matmuls that made d: three passes.
Here one Triton kernel reads x', dy and g once and writes g' and its bf16 copy, while each program
accumulates dw (and db) over the rows it visits: 16 bytes per element with an fp32 residual stream.
torch adds the programs' partial sums of dw afterwards (1,056 x C floats on an H100).

The forward writes x' (kept for the backward, as Inductor's graph keeps it), y in the dtype the next
matmul reads (bf16 under autocast), and the per-row mean and 1/std (fp32). The arithmetic is torch's:
fp32 statistics of x' as stored (a bf16 residual stream is rounded before it is normalised), biased
variance, y rounded once. With a bf16 residual stream (model.lowp_residual) g' is summed in fp32 and
rounded once, where torch rounds the norm's gradient and then the sum.

docs/performance.md has gpt2-125m's step time with and without the op.

`add_layer_norm` is a custom op (`trainbox::add_layer_norm`, its backward `trainbox::add_layer_norm_bwd`),
so torch.compile keeps the model in one graph around it. On CUDA the kernels are Triton; elsewhere, and
where Triton is missing, the same arithmetic runs as torch ops (the tests' oracle and the CPU path).
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:
    @triton.jit
    def _add_ln_fwd_kernel(X, D, W, B, XO, Y, MEAN, RSTD, N, C, eps,
                           HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_C)
        rmask = rows < N
        mask = rmask[:, None] & (cols[None, :] < C)
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        x += tl.load(D + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(XO.dtype.element_ty)          # x' as stored: what is normalised and what the backward reads
        tl.store(XO + offs, x, mask=mask)
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=1) / C
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
        w = tl.load(W + cols, mask=cols < C, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_B:
            y += tl.load(B + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(MEAN + rows, mean, mask=rmask)
        tl.store(RSTD + rows, rstd, mask=rmask)

    @triton.jit
    def _add_ln_bwd_kernel(XO, W, MEAN, RSTD, DY, G, DX, DD, DWB, N, C, PROGS,
                           HAS_G: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program p takes row blocks p, p + P, ...: writes g' = g + LayerNorm'(dy) to DX (x's dtype) and DD
        (d's dtype), and its partial sums of dy * xhat (and dy) to row p (and P + p) of DWB."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
        db = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
        for start in range(0, N, PROGS * BLOCK_M):
            rows = start + pid * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < N
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            xo = tl.load(XO + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (xo - mean[:, None]) * rstd[:, None], 0.0)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            wdy = dy * w[None, :]
            c1 = tl.sum(xhat * wdy, axis=1) / C
            c2 = tl.sum(wdy, axis=1) / C
            g = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if HAS_G:
                g += tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + offs, g.to(DX.dtype.element_ty), mask=mask)
            tl.store(DD + offs, g.to(DD.dtype.element_ty), mask=mask)
            dw += dy * xhat
            if HAS_B:
                db += dy
        tl.store(DWB + pid * C + cols, tl.sum(dw, axis=0), mask=cmask)
        if HAS_B:
            tl.store(DWB + (PROGS + pid) * C + cols, tl.sum(db, axis=0), mask=cmask)


def _blocks(C: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_C, forward BLOCK_M and warps, backward BLOCK_M and warps): a row padded to a power of two;
    4K elements over 2 warps per forward program, 2K over 4 warps per backward program. The fastest
    of 20 forward and 48 backward launch configurations at gpt2-125m's 49,152 x 768 on an H200."""
    block_c = triton.next_power_of_2(C)
    fwd_m, bwd_m = max(1, 4096 // block_c), max(1, 2048 // block_c)
    return block_c, fwd_m, max(2, block_c * fwd_m // 2048), bwd_m, max(4, block_c * bwd_m // 512)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton is not None


def _forward_reference(x, d, w, b, eps):
    xo = (x.float() + d.float()).to(x.dtype)
    xf = xo.float()
    mean = xf.mean(dim=-1)
    rstd = torch.rsqrt(xf.var(dim=-1, unbiased=False) + eps)
    y = (xf - mean[:, None]) * rstd[:, None] * w.float()
    if b is not None:
        y = y + b.float()
    return xo, y, mean, rstd


def _backward_reference(g, dy, xo, weight, mean, rstd, has_bias, d_dtype):
    xhat = (xo.float() - mean[:, None]) * rstd[:, None]
    wdy = dy.float() * weight.float()
    gx = (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True) - wdy.mean(-1, keepdim=True)) * rstd[:, None]
    if g is not None:
        gx = gx + g.float()
    dwb = [(dy.float() * xhat).sum(0)] + ([dy.float().sum(0)] if has_bias else [])
    return gx.to(xo.dtype), gx.to(d_dtype, copy=True), torch.stack(dwb).to(weight.dtype)


def _triton_forward(x, d, weight, bias, eps, out_dtype, block_m=None, warps=None):
    N, C = x.shape
    xo, y = torch.empty_like(x), torch.empty(N, C, dtype=out_dtype, device=x.device)
    mean, rstd = (torch.empty(N, dtype=torch.float32, device=x.device) for _ in range(2))
    block_c, bm, w, _, _ = _blocks(C)
    block_m, warps = block_m or bm, warps or w
    _add_ln_fwd_kernel[(triton.cdiv(N, block_m),)](
        x, d, weight, bias if bias is not None else weight, xo, y, mean, rstd, N, C, eps,
        HAS_B=bias is not None, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=warps)
    return xo, y, mean, rstd


def _triton_backward(g, dy, xo, weight, mean, rstd, has_bias, d_dtype, progs=None, block_m=None, warps=None):
    N, C = xo.shape
    block_c, _, _, bm, w = _blocks(C)
    block_m, warps = block_m or bm, warps or w
    if progs is None:  # 8 programs per SM, each summing dw over its share of the rows
        progs = 8 * torch.cuda.get_device_properties(xo.device).multi_processor_count
    progs = min(triton.cdiv(N, block_m), progs)
    dx, dd = torch.empty_like(xo), torch.empty(N, C, dtype=d_dtype, device=xo.device)
    part = torch.empty((2 if has_bias else 1) * progs, C, dtype=torch.float32, device=xo.device)
    _add_ln_bwd_kernel[(progs,)](xo, weight, mean, rstd, dy, g if g is not None else dy, dx, dd, part, N, C, progs,
                                 HAS_G=g is not None, HAS_B=has_bias, BLOCK_M=block_m, BLOCK_C=block_c,
                                 num_warps=warps)
    return dx, dd, part.view(-1, progs, C).sum(1).to(weight.dtype)


@torch.library.custom_op("trainbox::add_layer_norm", mutates_args=())
def add_layer_norm_op(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, d (N, C) contiguous -> x' = x + d (x's dtype), y = LayerNorm(x') (out_dtype), mean, rstd (N,) fp32."""
    if not _use_triton(x):
        xo, y, mean, rstd = _forward_reference(x, d, weight, bias, eps)
        return xo, y.to(out_dtype), mean, rstd
    return _triton_forward(x.contiguous(), d.contiguous(), weight, bias, eps, out_dtype)


@add_layer_norm_op.register_fake
def _(x, d, weight, bias, eps, out_dtype):
    N, C = x.shape
    return (torch.empty_like(x), x.new_empty(N, C, dtype=out_dtype), x.new_empty(N, dtype=torch.float32),
            x.new_empty(N, dtype=torch.float32))


@torch.library.custom_op("trainbox::add_layer_norm_bwd", mutates_args=())
def add_layer_norm_bwd(g: torch.Tensor | None, dy: torch.Tensor, xo: torch.Tensor, weight: torch.Tensor,
                       mean: torch.Tensor, rstd: torch.Tensor, has_bias: bool,
                       d_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (g' in x's dtype, g' in d's dtype, dw (and db) stacked: (1 or 2, C) in the weight's dtype)."""
    if not _use_triton(xo):
        return _backward_reference(g, dy, xo, weight, mean, rstd, has_bias, d_dtype)
    return _triton_backward(g.contiguous() if g is not None else None, dy.contiguous(), xo.contiguous(), weight,
                            mean, rstd, has_bias, d_dtype)


@add_layer_norm_bwd.register_fake
def _(g, dy, xo, weight, mean, rstd, has_bias, d_dtype):
    N, C = xo.shape
    return torch.empty_like(xo), xo.new_empty(N, C, dtype=d_dtype), weight.new_empty(2 if has_bias else 1, C)


def _setup_context(ctx, inputs, output):
    x, d, weight, bias, eps, out_dtype = inputs
    xo, _, mean, rstd = output
    ctx.save_for_backward(xo, weight, mean, rstd)
    ctx.has_bias, ctx.d_dtype = bias is not None, d.dtype
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # x' unused (the final norm): no zero gradient to read


def _backward(ctx, g, dy, _mean, _rstd):
    xo, weight, mean, rstd = ctx.saved_tensors
    dx, dd, dwb = add_layer_norm_bwd(g, dy, xo, weight, mean, rstd, ctx.has_bias, ctx.d_dtype)
    return dx, dd, dwb[0], dwb[1] if ctx.has_bias else None, None, None


add_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def add_layer_norm(x: torch.Tensor, d: torch.Tensor, norm: torch.nn.LayerNorm,
                   out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, norm(x + d)) for x, d (..., C): the sum in x's dtype, the norm in `out_dtype` (default d's)."""
    shape = x.shape
    C = shape[-1]
    xo, y, _, _ = add_layer_norm_op(x.reshape(-1, C), d.reshape(-1, C), norm.weight,
                                    norm.bias, norm.eps, out_dtype or d.dtype)
    return xo.view(shape), y.view(shape)
