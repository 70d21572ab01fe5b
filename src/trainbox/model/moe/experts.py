"""The experts of an MoE layer (model.py's MoEFFN): E independent linears stored stacked (`GroupedLinear`), run as
one grouped matmul over rows sorted by expert (`grouped_mm`: `torch.nn.functional.grouped_mm` / `torch._grouped_mm`,
a loop over experts only where neither exists or the widths are not 16-byte aligned), with their backward written out,
and the experts' MLP recomputed in the backward for train.activation_checkpointing=experts (`recomputed`)."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainbox.kernels import rows

log = logging.getLogger("trainbox")  # the library logger (model/ never imports monitor/)

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_warned: set[str] = set()
_broken: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) where the kernel raised in eager mode


def _no_kernel_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the grouped kernel cannot run on these operands (None: it can)."""
    if _GROUPED_MM is None:
        return "this torch has no grouped_mm"
    if x.size(-1) % 8 or w.size(-1) % 8:
        return "widths are not multiples of 8 (the kernels need 16-byte aligned rows)"
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return "compiled grouped_mm needs bf16 (train.dtype=bf16)"  # its shape function accepts bf16 only
    if (x.device.type, x.dtype) in _broken:
        return f"grouped_mm failed on {x.device.type} {x.dtype}"
    return None


class _GroupedMM(torch.autograd.Function):
    """grouped_mm(act(x), w) with the backward written out; act is GELU(tanh) for the experts' second linear.

    Saves x (the pre-activation) and a = act(x), which the forward computes anyway as the matmul's input.
    The backward computes dA = g @ w^T, then dx = dA * act'(x) (`gelu_backward`: one pass that reads x and dA
    and writes dx), then dw[e] = a_e^T @ g_e. Recomputing a in the backward instead would save k*N*4C
    activations per layer but write a there once more: saving a is the faster of the two on an H100."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, gelu: bool) -> torch.Tensor:
        a = rows.gelu(x) if gelu else x
        ctx.save_for_backward(x, a, w, offsets)
        ctx.gelu = gelu
        return _GROUPED_MM(a, w, offs=offsets)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, a, w, offsets = ctx.saved_tensors
        g = g.contiguous()
        da = _GROUPED_MM(g, w.transpose(1, 2), offs=offsets)
        dx = rows.gelu_backward(da, x) if ctx.gelu else da
        dw = None
        if ctx.needs_input_grad[1]:  # dw[e] = a_e^T @ g_e. Compiled, the kernel's first operand is laid out
            # transposed: a copy of a^T, or of g^T for dw = (g^T @ a)^T. Copy the narrower of the two: with
            # a^T @ g for the second linear, the forward would write a transposed copy of a. dw in w's layout:
            # compiled, the transpose is one Triton copy (fused with a cast where w is one), where autograd's
            # accumulation into a 16-bit leaf w (parallel/expert.py's copies) would copy it strided
            dw = (_GROUPED_MM(a.t(), g, offs=offsets) if a.size(1) <= g.size(1)
                  else _GROUPED_MM(g.t(), a, offs=offsets).transpose(1, 2).contiguous())
        return dx, dw, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, use_kernel: bool = True,
               gelu: bool = False) -> torch.Tensor:
    """Rows a[offsets[e-1]:offsets[e]] times w[e], for a = GELU(x) if gelu else x, x (M, in), w (E, in, out),
    offsets (E,) int32 cumsum."""
    reason = _no_kernel_reason(x, w) if use_kernel else None
    if use_kernel and reason is None:
        if torch.compiler.is_compiling():
            return _GroupedMM.apply(x.contiguous(), w.contiguous(), offsets, gelu)
        try:  # some builds lack a device/dtype kernel: fall back, with one warning
            return _GroupedMM.apply(x.contiguous(), w.contiguous(), offsets, gelu)
        except (RuntimeError, NotImplementedError) as e:
            _broken.add((x.device.type, x.dtype))
            reason = f"grouped_mm failed on {x.device.type} {x.dtype}: {str(e).splitlines()[0][:200]}"
    if reason is not None and reason not in _warned:
        _warned.add(reason)
        log.warning(f"MoE experts run as a loop over experts ({reason}); slower than one grouped matmul")
    if gelu:
        x = rows.gelu(x)
    bounds = [0, *offsets.tolist()]  # the fallback needs the group sizes on the host
    return torch.cat([x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(w.size(0))])


# Autograd turns an indexing `a[idx]` into a scatter-add (`index_put_(accumulate=True)`) in the backward: one atomic
# add per element. For the expert biases that is k*N rows landing on E rows, and the atomics contend (on an H100, a
# large share of moe-gpt2-125m's step). `_ExpertBias` states its backward as a matmul, with no atomics (model.py's
# dispatch and combine state theirs as gathers).


class _ExpertBias(torch.autograd.Function):
    """y + bias[expert] for rows sorted by expert; d(bias) = one_hot(expert)^T @ dy, one small matmul."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(expert)
        ctx.num, ctx.bias_dtype = bias.size(0), bias.dtype
        return y + bias.to(y.dtype)[expert]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (expert,) = ctx.saved_tensors
        onehot = F.one_hot(expert, ctx.num).to(g.dtype)                 # (rows, E)
        return g, (onehot.t() @ g).to(ctx.bias_dtype), None


class GroupedLinear(nn.Module):
    """E independent Conv1D-layout linears: weight (E, in, out), bias (E, out)."""

    def __init__(self, num: int, nx: int, nf: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, nx, nf))
        self.bias = nn.Parameter(torch.zeros(num, nf)) if bias else None
        self.cast: torch.Tensor | None = None   # the step's 16-bit copy of weight (parallel/expert.py keeps it)

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype`: the copy parallel/expert.py keeps for the step where there is one of that dtype
        (its gradient goes to weight.grad), else a cast."""
        if self.cast is not None and self.cast.dtype == dtype:
            return self.cast
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, expert: torch.Tensor, use_kernel: bool,
                gelu: bool = False) -> torch.Tensor:
        """Expert e's rows of (GELU(x) if gelu else x) times weight[e], plus bias[e]."""
        y = grouped_mm(x, self.weight_as(x.dtype), offsets, use_kernel, gelu)
        return _ExpertBias.apply(y, self.bias, expert) if self.bias is not None else y


def _recompute_all(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def recomputed(fn, *args: torch.Tensor) -> torch.Tensor:
    """fn(*args), keeping only `args` for the backward (train.activation_checkpointing=experts): what the backward
    needs of fn's intermediates is computed again there. For the experts' MLP that is the hidden layer h = c_fc(x)
    and GELU(h), the second matmul's input (its weight gradient reads it). Every op of fn is tagged to be recomputed,
    which torch.compile's partitioner honours: neither h nor GELU(h) is saved, however it would rather trade.
    Compiled on CUDA GPUs under expert parallelism the backward runs the first grouped matmul again and not the
    second, whose output it never reads (7 grouped matmuls a layer, 6 without it: 2026-11-30-2xh200-moe-gpt2-125m-128x-
    ep2-fsdp-experts-mb30-h100mem-profile.json). Eager it runs the second one too, since autograd keeps what a custom
    autograd function saves only once its forward has run (tests/test_recompute.py counts it); so did Inductor's
    graph for a CPU in one process, counted once by hand."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_all))
