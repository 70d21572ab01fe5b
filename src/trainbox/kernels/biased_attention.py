"""Attention with a learned additive bias that every row of the batch shares (T5's relative positions), in Triton.

    o = softmax(scale * q k^T + bias[h] (+ causal mask)) v,    q, k, v (B, T, H, D),  bias (H, Tq, Tk) fp32

or a bias by distance, (H, Tq + Tk - 1), that depends only on key position - query position (T5's): the kernels read
it along its diagonals (a row stride of -1), a few KiB a head instead of Tq x Tk values, and its gradient is the
position gradient's diagonals summed (`diagonal_sums`, no atomics).

PyTorch's scaled_dot_product_attention takes such a bias only as a dense additive mask, and only its memory-efficient
kernel differentiates one: it writes the bias gradient for every row of the batch (B x H x Tq x Tk) and autograd then
sums the rows. The op here keeps the bias per head and sums its gradient over the batch inside the kernel:

- forward: FlashAttention-2's online softmax over blocks of keys; each block adds its tile of the bias (one tile for the
  whole batch, so it is read from L2), masks the keys past Tk (and past the query, causal); writes o and the rows'
  log-sum-exp (base 2).
- backward, three kernels and no atomics, each computing the logits again (FlashAttention's recomputation: nothing of
  size T x T is stored but the bias gradient): dk, dv per block of keys (a loop over the blocks of queries), dq per
  block of queries (a loop over the blocks of keys), and the bias gradient per tile, whose program loops over the
  batch and sums ds = dlogits in registers, then writes the tile once.

`biased_attention` is a Triton op (`torch.library.triton_op`: `trainbox::biased_attention`, its backward
`trainbox::biased_attention_bwd`), so torch.compile keeps the model in one graph around it and launches the kernels
from its generated code (`scale` is a compile-time constant of the kernels: one build per value). On CUDA the kernels
are Triton (kernels/biased_attention_triton.py); elsewhere the same arithmetic runs as torch ops (the tests'
oracle). T5's self-attention runs it on a CUDA GPU (`model.attention=auto` or `triton`); docs/performance.md has its
times against SDPA's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trainbox.kernels import biased_attention_triton as kernels
from trainbox.kernels.biased_attention_triton import BLOCKS  # noqa: F401 - the kernels' blocks (tests, benchmarks)

LOG2E = 1.4426950408889634


def _use_triton(x: torch.Tensor) -> bool:
    return kernels.triton is not None and x.is_cuda


def diagonals(rel: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """(H, q_len, k_len) from rel (H, q_len + k_len - 1): out[h, i, j] = rel[h, j - i + q_len - 1], a bias that
    depends only on key position - query position (queries are the last q_len of k_len positions), contiguous."""
    return rel.unfold(1, k_len, 1).flip(1).contiguous()   # [h, a, j] = rel[h, a + j]; a: query q_len - 1 - a


def diagonal_sums(grad: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """The gradient of `diagonals` (H, q_len + k_len - 1): grad's diagonals summed as columns, no atomics. The
    gradient, rows reversed and padded by q_len zero columns, read row-major with one element fewer per row, has
    diagonal m of the original in column m."""
    n = q_len + k_len - 1
    padded = F.pad(grad.flip(1), (0, q_len))                       # (H, q_len, n + 1), zeros right
    return padded.flatten(1)[:, :q_len * n].view(-1, q_len, n).sum(1)


def _relative(bias: torch.Tensor) -> bool:
    """A bias by distance (H, Tq + Tk - 1), not by position (H, Tq, Tk)."""
    return bias.dim() == 2


def _dense(bias: torch.Tensor, Tq: int, Tk: int) -> torch.Tensor:
    return diagonals(bias, Tq, Tk) if _relative(bias) else bias


def _bias_layout(bias: torch.Tensor, Tq: int, Tk: int) -> tuple[int, int, int]:
    """(head stride, row stride, offset) at which the kernels read bias[h, row, col] (col stride 1): by position,
    row-major; by distance, rel[h, col - row + Tq - 1] (a row stride of -1)."""
    return (bias.size(1), -1, Tq - 1) if _relative(bias) else (Tq * Tk, Tk, 0)


def _logits(q, k, bias, scale, causal):
    """(B, H, Tq, Tk) fp32 logits of the reference path."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale + bias.float()
    if causal:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _forward_reference(q, k, v, bias, scale, causal):
    s = _logits(q, k, _dense(bias, q.size(1), k.size(1)), scale, causal)
    lse = torch.logsumexp(s, dim=-1)                                           # (B, H, Tq)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v.float())
    return o.to(q.dtype), lse * LOG2E


def _backward_reference(do, q, k, v, bias, o, lse, scale, causal):
    Tq, Tk = q.size(1), k.size(1)
    p = torch.exp(_logits(q, k, _dense(bias, Tq, Tk), scale, causal) - lse[..., None] / LOG2E)
    dof = do.float()
    delta = (dof * o.float()).sum(-1).transpose(1, 2)                          # (B, H, Tq)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, v.float())
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.float()) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale
    dbias = ds.sum(0)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            (diagonal_sums(dbias, Tq, Tk) if _relative(bias) else dbias).to(bias.dtype))


def _triton_forward(q, k, v, bias, scale, causal, blocks=None):
    """The forward kernel on either bias; `blocks`: other block sizes than BLOCKS (a sweep)."""
    return kernels.forward(q, k, v, bias, _bias_layout(bias, q.size(1), k.size(1)), scale, causal, blocks)


def _triton_backward(do, q, k, v, bias, o, lse, scale, causal, blocks=None, bias_grad=True):
    """The backward kernels on either bias: its gradient as the bias (by distance: the diagonals' sums)."""
    Tq, Tk = q.size(1), k.size(1)
    dq, dk, dv, dbias = kernels.backward(do, q, k, v, bias, _bias_layout(bias, Tq, Tk), o, lse, scale, causal, blocks,
                                         bias_grad)
    if dbias is not None:
        dbias = (diagonal_sums(dbias, Tq, Tk) if _relative(bias) else dbias).to(bias.dtype)
    return dq, dk, dv, dbias


def _check(q, k, v, bias, causal):
    B, Tq, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (H, D):
        raise ValueError(f"biased_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                         "(B, T, H, D) of one batch, heads and width")
    if bias.shape not in ((H, Tq, k.size(1)), (H, Tq + k.size(1) - 1)):
        raise ValueError(f"biased_attention: bias {tuple(bias.shape)} is neither (heads, Tq, Tk) = "
                         f"{(H, Tq, k.size(1))} nor (heads, Tq + Tk - 1) = {(H, Tq + k.size(1) - 1)}")
    if causal and Tq != k.size(1):
        raise ValueError("biased_attention: causal attention needs as many queries as keys")


def _define(name: str, fn, fake):
    """The op `name` run by `fn`: a triton_op, whose Triton kernels and torch ops torch.compile traces into its graph
    (its generated code launches them: no custom-op dispatch on the host per call), or on a torch without triton_op
    an opaque custom op with `fake` for its shapes."""
    if hasattr(torch.library, "triton_op"):
        return torch.library.triton_op(name, fn, mutates_args=())
    op = torch.library.custom_op(name, fn, mutates_args=())
    op.register_fake(fake)
    return op


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Tq, H, D), k, v (B, Tk, H, D), bias (H, Tq, Tk) -> o (B, Tq, H, D), lse (B, H, Tq) fp32 base 2."""
    if not _use_triton(q):
        return _forward_reference(q, k, v, bias, scale, causal)
    return _triton_forward(q.contiguous(), k.contiguous(), v.contiguous(), bias.contiguous(), scale, causal)


def _forward_fake(q, k, v, bias, scale, causal):
    B, Tq, H, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(B, H, Tq, dtype=torch.float32)


def _backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                 bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq, dk, dv (as q, k, v), dbias (as bias: summed over the batch; empty unless bias_grad)."""
    if not _use_triton(q):
        dq, dk, dv, dbias = _backward_reference(do, q, k, v, bias, o, lse, scale, causal)
    else:
        dq, dk, dv, dbias = _triton_backward(do, q, k, v, bias, o, lse, scale, causal, bias_grad=bias_grad)
    return dq, dk, dv, dbias if bias_grad else bias.new_empty(0)


def _backward_fake(do, q, k, v, bias, o, lse, scale, causal, bias_grad):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(bias) if bias_grad else bias.new_empty(0))


_OPS: tuple | None = None


def ops() -> tuple:
    """(the op, its backward op), defined on first use: defining a triton_op imports Inductor and Dynamo, which a
    process that never runs these kernels (generate, export, a CPU run) does not load. Call it before torch.compile
    traces a model that uses the op (T5.set_kernels does)."""
    global _OPS
    if _OPS is None:
        op = _define("trainbox::biased_attention", _forward, _forward_fake)
        op.register_autograd(_backward, setup_context=_setup_context)
        _OPS = op, _define("trainbox::biased_attention_bwd", _backward_op, _backward_fake)
    return _OPS


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, bias, o, lse)
    ctx.scale, ctx.causal = scale, causal
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _lse):
    q, k, v, bias, o, lse = ctx.saved_tensors
    bias_grad = ctx.needs_input_grad[3]
    dq, dk, dv, dbias = ops()[1](do, q, k, v, bias, o, lse, ctx.scale, ctx.causal, bias_grad)
    return dq, dk, dv, dbias if bias_grad else None, None, None



def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float = 1.0,
                     causal: bool = False) -> torch.Tensor:
    """softmax(scale * q k^T + bias (+ causal mask)) v for q (B, Tq, H, D), k, v (B, Tk, H, D) and a bias shared by
    the batch (its gradient summed over it) -> (B, Tq, H, D). The bias is by position, (H, Tq, Tk), or by distance,
    (H, Tq + Tk - 1): rel[h, key - query + Tk - 1] with the queries the last Tq of Tk positions (`diagonals`; T5's),
    which the kernels read along its diagonals, a few KiB a head. Contiguous q, k, v and an fp32 bias avoid copies."""
    _check(q, k, v, bias, causal)
    return ops()[0](q.contiguous(), k.contiguous(), v.contiguous(), bias.contiguous(), float(scale), bool(causal))[0]


def triton_attention_available(device: torch.device) -> bool:
    """The Triton kernels run here: a CUDA GPU of compute capability 8.0+ with Triton."""
    return kernels.triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)

