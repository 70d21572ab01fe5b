"""FlashAttention-4 (`model.attention=flash`; `pip install 'trainbox[flash]'`, Hopper or Blackwell GPUs):
document-causal sliding-window attention on the speedrun model's packed rows, and plain causal attention
on the gpt family's packed qkv.

The rows of a speedrun batch are documents packed end to end, and a query sees the keys of its own
document inside the window. FlashAttention's variable-length kernels take exactly that: the documents as
sequences (cu_seqlens, their offsets in the flattened batch) and the window as (window - 1, 0) with
causal masking, i.e. `kernels/doc_mask.allowed()` with model.window_block = 1. No mask is built or evaluated
per block, and no block is partial at a document's edge, which is where FlexAttention spends its time on short
documents (docs/performance.md has the measured step times).

The kernels are FlashAttention-4's CuTe DSL port of FlashAttention-3 (the `flash-attn-4` package), which
compiles them at first use. They are wrapped here as two torch custom ops with fake implementations, so
torch.compile keeps the model in one graph around them. The window is passed as a 0-d CPU tensor, read
on the host inside the op: the window warm-up changes it every few steps without recompiling the model,
and without a device synchronisation.

The gpt family (`causal_qkv`) hands the kernels q, k and v as strided views of its fused qkv projection,
(B, T, 3, H, D), and the backward writes dq, dk and dv into one (B, T, 3, H, D) gradient: the qkv
projection's backward reads it as it is, where SDPA's three gradients are first concatenated (a copy of
3C per token per layer).
"""
from __future__ import annotations

import functools

import torch

from trainbox.errors import ConfigError
from trainbox.kernels.ops import eager, load_failed

MIN_MAJOR = 9  # compute capability: FlashAttention-4's backward runs on Hopper (9.x) and Blackwell
EXTRA = "pip install 'trainbox[flash]'  (FlashAttention-4; on CUDA 13 builds of torch: 'flash-attn-4[cu13]')"


@functools.cache
def _interface():
    """flash_attn.cute.interface, or None when the package is missing or fails to load. (FlashAttention-4
    keeps its compiled kernels on disk when FLASH_ATTENTION_CUTE_DSL_CACHE_* ask it to: `trainbox train`
    sets them, see cli/train.py.)"""
    try:
        from flash_attn.cute import interface  # optional: flash_attn
    except Exception as e:  # noqa: BLE001 - ImportError, or a CUDA/DSL library that does not load here
        load_failed("flash-attn-4", e)
        return None
    return interface


def flash_available(device: torch.device) -> bool:
    """True on CUDA GPUs of compute capability 9.0+ (Hopper, Blackwell) with flash-attn-4 importable."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    if torch.cuda.get_device_capability(device)[0] < MIN_MAJOR:
        return False
    return _interface() is not None


def require_flash(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Raise a ConfigError saying why model.attention=flash cannot run on `device` (in `dtype`, when given)."""
    if device.type != "cuda":
        raise ConfigError(f"model.attention=flash needs a CUDA GPU; this run is on {device}",
                          hint="use model.attention=auto (FlexAttention or SDPA)")
    if torch.cuda.get_device_capability(device)[0] < MIN_MAJOR:
        raise ConfigError(f"model.attention=flash needs a Hopper or Blackwell GPU (compute capability 9.0+); "
                          f"{torch.cuda.get_device_name(device)} is {torch.cuda.get_device_capability(device)}",
                          hint="use model.attention=auto (FlexAttention)")
    if _interface() is None:
        raise ConfigError("model.attention=flash needs FlashAttention-4, which is not installed (or does not load)",
                          hint=EXTRA)
    if dtype == torch.float32:
        raise ConfigError("model.attention=flash runs in bf16 or fp16 only; this run is in fp32",
                          hint="use train.dtype=bf16, or model.attention=auto (FlexAttention)")


def use_flash(want: str, device: torch.device, eligible: bool = True) -> bool:
    """model.attention=`want` on `device` -> whether to run FlashAttention-4: always for "flash" (after
    require_flash has refused what cannot run), for "auto" where the model's setting is `eligible` and
    flash_available; never otherwise."""
    if want == "flash":
        require_flash(device)
        return True
    return want == "auto" and eligible and flash_available(device)


def half_precision(device: torch.device, param_dtype: torch.dtype) -> bool:
    """Whether attention runs in bf16/fp16 here (autocast, or half-precision weights): FlashAttention's
    only dtypes; in fp32 the model takes FlexAttention instead."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type) in (torch.bfloat16, torch.float16)
    return param_dtype in (torch.bfloat16, torch.float16)


@eager
def doc_seqlens(docs: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids, non-decreasing along each row -> int32 cu_seqlens over the flattened B*T tokens:
    0, the start of every later document (a row's start is one), B*T.

    Eager, outside the compiled graph: its length is data-dependent (one host synchronisation per
    forward, to size it). Marked dynamic, so a new number of documents does not recompile the model."""
    B, T = docs.shape
    new = torch.ones_like(docs, dtype=torch.bool)
    new[:, 1:] = docs[:, 1:] != docs[:, :-1]
    starts = new.flatten().nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([B * T])]).to(torch.int32)
    torch._dynamo.maybe_mark_dynamic(cu, 0)
    return cu


def _left(window: torch.Tensor, div: int) -> int:
    return max(1, int(window) // div) - 1


@torch.library.custom_op("trainbox::flash_varlen_fwd", mutates_args=(), device_types="cuda")
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, window: torch.Tensor, div: int,
         max_len: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    res = _interface()._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                       max_seqlen_k=max_len, softmax_scale=scale, causal=True,
                                       window_size_left=_left(window, div), window_size_right=0, return_lse=True)
    return res[0], res[1]


@_fwd.register_fake
def _(q, k, v, cu, window, div, max_len, scale):
    return torch.empty_like(q), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)


@torch.library.custom_op("trainbox::flash_varlen_bwd", mutates_args=(), device_types="cuda")
def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         lse: torch.Tensor, cu: torch.Tensor, window: torch.Tensor, div: int, max_len: int,
         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    res = _interface()._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, True, 0.0,
                                       window_size_left=_left(window, div), window_size_right=0,
                                       cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len)
    return res[0], res[1], res[2]


@_bwd.register_fake
def _(dout, q, k, v, out, lse, cu, window, div, max_len, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu, window, div, max_len, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu, window)
    ctx.div, ctx.max_len, ctx.scale = div, max_len, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu, window = ctx.saved_tensors
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, cu, window, ctx.div, ctx.max_len, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, window: torch.Tensor,
                    div: int, scale: float) -> torch.Tensor:
    """q (B, T, H, D), k and v (B, T, H_kv, D) in bf16/fp16; cu from doc_seqlens; window a 0-d CPU int tensor
    (the long window), `div` 1 for it, 2 for the short one. -> (B, T, H, D). A query sees the last
    max(1, window // div) keys of its document (itself included)."""
    B, T, H, D = q.shape
    flat = [t.reshape(B * T, t.size(2), D) for t in (q, k, v)]
    return _fwd(*flat, cu, window, div, T, scale)[0].view(B, T, H, D)


@torch.library.custom_op("trainbox::flash_qkv_fwd", mutates_args=(), device_types="cuda")
def _qkv_fwd(qkv: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = qkv.unbind(2)
    res = _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    return res[0], res[1]


@_qkv_fwd.register_fake
def _(qkv, scale):
    B, T, _, H, D = qkv.shape
    return qkv.new_empty((B, T, H, D)), qkv.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("trainbox::flash_qkv_bwd", mutates_args=(), device_types="cuda")
def _qkv_bwd(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             scale: float) -> torch.Tensor:
    dqkv = torch.empty_like(qkv)
    _interface()._flash_attn_bwd(*qkv.unbind(2), out, dout.contiguous(), lse, scale, True, 0.0,
                                 dq=dqkv[:, :, 0], dk=dqkv[:, :, 1], dv=dqkv[:, :, 2])
    return dqkv


@_qkv_bwd.register_fake
def _(dout, qkv, out, lse, scale):
    return torch.empty_like(qkv)


def _qkv_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[0], output[1])
    ctx.scale = inputs[1]


def _qkv_backward(ctx, dout, dlse):
    qkv, out, lse = ctx.saved_tensors
    return _qkv_bwd(dout, qkv, out, lse, ctx.scale), None


_qkv_fwd.register_autograd(_qkv_backward, setup_context=_qkv_setup)


def causal_qkv(qkv: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of packed qkv (B, T, 3, H, D), bf16/fp16 -> (B, T, H, D), every query seeing the
    keys up to its own position (SDPA's is_causal=True)."""
    return _qkv_fwd(qkv, scale)[0]
