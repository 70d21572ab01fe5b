"""Elementwise work over rows whose count a compiled graph does not know, run as ATen's kernels.

With expert parallelism's split sizes kept in the compiled graph (model.moe.split_sizes, parallel/__init__.py's
`split_sizes_in_graph`), the rows an expert group exchanges come in a count that is a symbol without a hint, and
torch 2.11's Inductor sizes the kernels it writes over such tensors for 8,192 elements: the experts' GELU, its
derivative and the regrouping gathers ran about twice as long as with the count read on the host
(2026-11-30-2xh200-moe-gpt2-125m-128x-ep2-fsdp-experts-mb30-graph-h100mem-profile.json against -host-). As custom
ops, opaque to Inductor, they run ATen's kernels, which size themselves when they run. `OPAQUE` says whether the
experts use them: set once, before compiling, where the split sizes stay in the graph; elsewhere Inductor's own
kernels, which it fuses with their neighbours, are the faster.
"""
from __future__ import annotations

import torch

from trainbox.kernels.ops import gelu_tanh, inductor_fallback

OPAQUE = False   # the experts' GELU and regrouping gathers through the ops below (parallel/__init__.py sets it)


@torch.library.custom_op("trainbox::gelu_tanh", mutates_args=())
def gelu_op(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (the tanh approximation), ATen's kernel."""
    return gelu_tanh(x)


@gelu_op.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("trainbox::gelu_tanh_backward", mutates_args=())
def gelu_backward_op(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dL/dx of gelu_op at x, from dL/dy = g."""
    return torch.ops.aten.gelu_backward(g, x, approximate="tanh")


@gelu_backward_op.register_fake
def _(g, x):
    return torch.empty_like(x)


def _save_input(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _gelu_grad(ctx, g):
    (x,) = ctx.saved_tensors
    return gelu_backward_op(g, x)


gelu_op.register_autograd(_gelu_grad, setup_context=_save_input)


@torch.library.custom_op("trainbox::take_rows", mutates_args=())
def take_rows_op(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for a 1-D index of rows."""
    return x.index_select(0, index)


@take_rows_op.register_fake
def _(x, index):
    return x.new_empty((index.size(0), *x.shape[1:]))


def gelu(x: torch.Tensor) -> torch.Tensor:
    return gelu_op(x) if OPAQUE else gelu_tanh(x)


def gelu_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return gelu_backward_op(g, x) if OPAQUE else torch.ops.aten.gelu_backward(g, x, approximate="tanh")


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return take_rows_op(x, index) if OPAQUE else x[index]


def use_opaque() -> None:
    """Run the experts' GELU and regrouping gathers as the ops above from now on (before torch.compile)."""
    global OPAQUE
    OPAQUE = True
    inductor_fallback(torch.ops.trainbox.gelu_tanh.default, torch.ops.trainbox.gelu_tanh_backward.default,
                      torch.ops.trainbox.take_rows.default)
