"""GELU MLP with the activation in its matmuls' epilogues (`model.fused_mlp`), dense and MoE experts.

    y = GELU(x W1ᵀ) W2ᵀ        (GELU: GPT-2's tanh approximation)

Compiled, the forward is a cuBLAS matmul that writes h = x W1ᵀ, then an Inductor kernel that reads h and
writes a = GELU(h); the backward is a matmul that writes dA = g W2, then a kernel that reads dA and h and
writes dH = dA GELU'(h). At gpt2-125m's shapes those two kernels move 1.2 GB per layer and micro-batch.
Here the up-projection's epilogue writes h and a from the fp32 accumulator, and the backward's dA matmul
reads h in its epilogue and writes dH alone (`dgelu`, an epilogue of ours; QuACK's gemm_dact would also
write a again, which the forward keeps instead, and is slower for it). These are
QuACK's warp-specialised GEMMs (CuTe DSL; Hopper and Blackwell GPUs; `trainbox[flash]` installs it with
FlashAttention-4), whose epilogues overlap the next tile's main loop. The weight gradients and dx are
cuBLAS matmuls.

The MoE experts (`moe_gelu_mlp`, model/moe.py) run all six of their matmuls on QuACK's variable-length
grouped GEMMs over the rows sorted by expert: the same two epilogues, the groups along M for the forward, dA
and dx, along K for the weight gradients (torch._grouped_mm and two GELU kernels otherwise).

docs/performance.md has the step times of gpt2-125m and moe-gpt2-125m with and without the ops.

The arithmetic differs from the unfused graph only in rounding: a and dH come from the fp32 accumulator
where the unfused graph rounds h (and dA) to bf16 first. Elsewhere (a CPU, other GPUs, no QuACK) the ops
run as torch ops, the tests' oracle; on a GPU without QuACK's kernels GPT runs its MLPs unfused instead,
with a warning, as that is faster there than these ops' torch paths. The ops are custom ops
(`trainbox::gelu_mlp`, `trainbox::moe_gelu_mlp` and their backwards), so torch.compile keeps the model in
one graph.
"""
from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

from trainbox.kernels.ops import gelu_tanh, load_failed

log = logging.getLogger("trainbox")  # the library logger
EXTRA = "pip install 'trainbox[flash]'  (QuACK comes with FlashAttention-4)"


@functools.cache
def _quack():
    """QuACK's GEMMs (gemm, gemm_act and `dgelu`, below), or None where QuACK is missing or does not load."""
    try:
        from quack import gemm_interface  # optional: quack
        from quack.activation import dgelu_tanh_approx  # optional: quack
        from quack.epilogue.frontend import gemm_epilogue  # optional: quack

        @gemm_epilogue()
        def dgelu(acc, c):
            """acc = dA = g W2ᵀ's tile, c = h's: writes dH = dA GELU'(h) alone. QuACK's gemm_dact also writes
            GELU(h), which the forward has written already."""
            dh, _ = dgelu_tanh_approx(c, acc)
            return {"D": dh}
    except ImportError as e:
        load_failed("quack-kernels", e)
        return None
    except Exception as e:  # noqa: BLE001 - a broken CUDA/CuTe install counts as missing, with its reason
        # (QuACK fingerprints an epilogue's dependencies, and refuses CuTe's own unless they are installed in a
        # site-packages folder: a `pip install --target` elsewhere fails here)
        log.warning(f"QuACK does not load ({load_failed('quack-kernels', e)})")
        return None

    return SimpleNamespace(gemm=gemm_interface.gemm, gemm_act=gemm_interface.gemm_act, dgelu=dgelu)


@functools.cache
def _config(device: torch.device):
    """The GEMM tiling on `device`: on Hopper 128 x 192 ping-pong tiles in clusters of 1 x 2, the fastest of
    four inside the training step on an H100 (timed alone, the tilings rank otherwise; docs/performance.md);
    QuACK's default elsewhere."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None
    from quack.gemm_config import GemmConfig  # optional: quack
    return GemmConfig(tile_m=128, tile_n=192, pingpong=True, cluster_m=1, cluster_n=2, device_capacity=9,
                      is_dynamic_persistent=False)


def quack_available(device: torch.device) -> bool:
    """True on Hopper or Blackwell GPUs with QuACK importable."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)
            and _quack() is not None)


def _use_quack(x: torch.Tensor, hidden: int) -> bool:
    """QuACK's kernels for x (M, C) through a hidden width: half precision, 16-byte aligned rows (TMA)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and x.size(1) % 8 == 0 and hidden % 8 == 0
            and quack_available(x.device))


@torch.library.custom_op("trainbox::gelu_mlp", mutates_args=())
def gelu_mlp_op(x: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, C), w1 (F, C), w2 (C, F), one dtype -> (y = GELU(x w1ᵀ) w2ᵀ (N, C), h = x w1ᵀ, a = GELU(h))."""
    x = x.contiguous()
    if _use_quack(x, w1.size(0)):
        h, a = _quack().gemm_act(x, w1.t(), activation="gelu_tanh_approx", config=_config(x.device), tuned=False)
    else:
        h = x @ w1.t()
        a = gelu_tanh(h)
    return a @ w2.t(), h, a


@gelu_mlp_op.register_fake
def _(x, w1, w2):
    return x.new_empty(x.size(0), w2.size(0)), x.new_empty(x.size(0), w1.size(0)), x.new_empty(x.size(0), w1.size(0))


@torch.library.custom_op("trainbox::gelu_mlp_bwd", mutates_args=())
def gelu_mlp_bwd(g: torch.Tensor, x: torch.Tensor, h: torch.Tensor, a: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dL/dy (N, C) -> (dx, dw1, dw2)."""
    g = g.contiguous()
    if _use_quack(x, w1.size(0)):
        dh = _quack().dgelu(g, w2, h, config=_config(x.device), tuned=False, dynamic_scheduler=False)["D"]
    else:
        dh = torch.ops.aten.gelu_backward(g @ w2, h, approximate="tanh")
    return dh @ w1, dh.t() @ x, g.t() @ a


@gelu_mlp_bwd.register_fake
def _(g, x, h, a, w1, w2):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)


def _setup_context(ctx, inputs, output):
    x, w1, w2 = inputs
    ctx.save_for_backward(x, output[1], output[2], w1, w2)
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, g, _dh, _da):
    x, h, a, w1, w2 = ctx.saved_tensors
    return gelu_mlp_bwd(g, x, h, a, w1, w2)


gelu_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def gelu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """GELU(x w1ᵀ) w2ᵀ for x (..., C), w1 (F, C), w2 (C, F), all in x's dtype."""
    shape = x.shape
    return gelu_mlp_op(x.reshape(-1, shape[-1]), w1, w2)[0].view(*shape[:-1], w2.size(0))


# The MoE experts (model/moe.py): E GELU MLPs over rows sorted by expert, expert e taking rows
# cu[e]:cu[e+1]. On QuACK all six matmuls are its variable-length grouped GEMMs: the forward's two and the
# backward's dA (with GELU' in the epilogue) and dx take the groups along M (cu_seqlens_m); the weight
# gradients, a_eᵀ g_e, take them along K (cu_seqlens_k), where an expert with no rows gets a zero gradient.
# Weights are (E, in, out), the layout of moe.GroupedLinear.


def _groups(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


@torch.library.custom_op("trainbox::moe_gelu_mlp", mutates_args=())
def moe_gelu_mlp_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, C) sorted by expert, w1 (E, C, F), w2 (E, F, C), cu (E + 1,) int32 row offsets from 0 ->
    (y (M, C): rows of expert e times GELU(x_e w1[e]) w2[e], h = x_e w1[e] (M, F), a = GELU(h))."""
    x = x.contiguous()
    if _use_quack(x, w1.size(2)):
        q, cfg = _quack(), _config(x.device)
        h, a = q.gemm_act(x, w1, activation="gelu_tanh_approx", cu_seqlens_m=cu, config=cfg, tuned=False)
        return q.gemm(a, w2, cu_seqlens_m=cu, tuned=False), h, a
    groups = _groups(cu)
    h = torch.empty(x.size(0), w1.size(2), dtype=x.dtype, device=x.device)
    for e, (lo, hi) in enumerate(groups):
        h[lo:hi] = x[lo:hi] @ w1[e]
    a = gelu_tanh(h)
    y = torch.empty_like(x)
    for e, (lo, hi) in enumerate(groups):
        y[lo:hi] = a[lo:hi] @ w2[e]
    return y, h, a


@moe_gelu_mlp_op.register_fake
def _(x, w1, w2, cu):
    return torch.empty_like(x), x.new_empty(x.size(0), w1.size(2)), x.new_empty(x.size(0), w1.size(2))


@torch.library.custom_op("trainbox::moe_gelu_mlp_bwd", mutates_args=())
def moe_gelu_mlp_bwd(g: torch.Tensor, x: torch.Tensor, h: torch.Tensor, a: torch.Tensor, w1: torch.Tensor,
                     w2: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dL/dy (M, C) -> (dx, dw1, dw2)."""
    g = g.contiguous()
    if _use_quack(x, w1.size(2)):
        q, cfg = _quack(), _config(x.device)
        dh = q.dgelu(g, w2.mT, h, config=cfg, tuned=False, dynamic_scheduler=False, cu_seqlens_m=cu)["D"]
        dx = q.gemm(dh, w1.mT, cu_seqlens_m=cu, tuned=False)
        dw1 = q.gemm(x.mT, dh, cu_seqlens_k=cu, tuned=False)
        dw2 = q.gemm(a.mT, g, cu_seqlens_k=cu, tuned=False)
        return dx, dw1, dw2
    dx, dw1, dw2 = torch.empty_like(x), torch.zeros_like(w1), torch.zeros_like(w2)
    for e, (lo, hi) in enumerate(_groups(cu)):
        dh = torch.ops.aten.gelu_backward(g[lo:hi] @ w2[e].t(), h[lo:hi], approximate="tanh")
        dx[lo:hi] = dh @ w1[e].t()
        dw1[e] = x[lo:hi].t() @ dh
        dw2[e] = a[lo:hi].t() @ g[lo:hi]
    return dx, dw1, dw2


@moe_gelu_mlp_bwd.register_fake
def _(g, x, h, a, w1, w2, cu):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)


def _moe_setup_context(ctx, inputs, output):
    x, w1, w2, cu = inputs
    ctx.save_for_backward(x, output[1], output[2], w1, w2, cu)
    ctx.mark_non_differentiable(output[1], output[2])


def _moe_backward(ctx, g, _dh, _da):
    x, h, a, w1, w2, cu = ctx.saved_tensors
    return (*moe_gelu_mlp_bwd(g, x, h, a, w1, w2, cu), None)


moe_gelu_mlp_op.register_autograd(_moe_backward, setup_context=_moe_setup_context)


def moe_gelu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Expert e's rows x[offsets[e-1]:offsets[e]] through GELU(x w1[e]) w2[e]; x (M, C) in the weights' dtype,
    w1 (E, C, F), w2 (E, F, C), offsets (E,) int32, the running row count (moe.MoEFFN)."""
    cu = torch.cat([offsets.new_zeros(1), offsets])
    return moe_gelu_mlp_op(x, w1, w2, cu)[0]
