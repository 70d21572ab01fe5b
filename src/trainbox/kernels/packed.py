"""Attention over packed rows (`data.packing`, data/packing.py): several examples end to end in one row, each query
seeing the keys of its own example up to itself and never another example's.

    mask = doc_mask(doc_ids, "flex")     # once per forward, from the row's example ids; shared by every layer
    y = doc_attention(q, k, v, mask)     # q (B, H, T, D), k and v (B, H_kv, T, D) -> (B, H, T, D)

The ids number a row's examples 0, 1, ... and its padding last, so they never decrease along a row. The kernels
(kernels/choice.py `packed_on` picks one per run, from the family's `Family.packing`, model.attention and the
device):

    flash  FlashAttention-4's variable-length kernels (kernels/flash.py): the examples are the sequences
           (cu_seqlens over the flattened batch) and no mask exists; bf16/fp16 only, so an fp32 forward runs flex
           on CUDA (sdpa elsewhere)
    flex   FlexAttention with a block mask built from the ids (kernels/doc_mask.py, the speedrun family's rule with
           a window as long as the row): blocks that lie between two examples are skipped (CUDA, capability 8.0+)
    sdpa   PyTorch SDPA with the dense (B, 1, T, T) block-diagonal causal mask: the reference, and the CPU path

Grouped-query attention (fewer key/value heads than query heads) runs natively in all three.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from trainbox.kernels.doc_mask import flex_block_mask, sdpa_mask
from trainbox.kernels.flash import doc_seqlens, flash_attention
from trainbox.kernels.ops import eager

KERNELS = ("flash", "flex", "sdpa")


@dataclass(frozen=True)
class DocMask:
    """What one forward's layers need to keep attention inside each example, for one kernel."""

    kernel: str                          # flash, flex or sdpa
    cu: torch.Tensor | None = None       # flash: int32 cu_seqlens over the flattened B * T tokens
    window: torch.Tensor | None = None   # flash: the row length as a 0-d CPU tensor (a window that never binds)
    block_mask: object = None            # flex: a BlockMask
    dense: torch.Tensor | None = None    # sdpa: (B, 1, T, T) bool, True where a query may see a key


@eager
def doc_mask(doc_ids: torch.Tensor, kernel: str, half: bool = True) -> DocMask:
    """The mask of (B, T) example ids for `kernel`; `half`: attention runs in bf16/fp16 (FlashAttention's only
    dtypes: in fp32, flash gives way to flex on CUDA and sdpa elsewhere). Built eagerly, outside any compiled graph
    (cu_seqlens has a data-dependent length; a FlexAttention block mask must not be traced, kernels/doc_mask.py)."""
    T = doc_ids.size(1)
    if kernel == "flash" and not half:
        kernel = "flex" if doc_ids.is_cuda else "sdpa"
    if kernel == "flash":
        return DocMask("flash", cu=doc_seqlens(doc_ids), window=torch.tensor(T))
    if kernel == "flex":
        return DocMask("flex", block_mask=flex_block_mask(doc_ids, T))
    if kernel != "sdpa":
        raise ValueError(f"no packed attention kernel {kernel!r} (one of {', '.join(KERNELS)})")
    return DocMask("sdpa", dense=sdpa_mask(doc_ids, doc_ids, 0, T))


@functools.cache
def _compiled_flex():
    # flex_attention must be compiled to run its fused kernel (uncompiled it materialises the scores)
    return torch.compile(flex_attention, dynamic=False)


def _flex():
    """flex_attention itself inside a compiled model (the outer compile fuses it), else its compiled form."""
    return flex_attention if torch.compiler.is_compiling() else _compiled_flex()


def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocMask,
                  scale: float | None = None) -> torch.Tensor:
    """Attention of q (B, H, T, D) over k, v (B, H_kv, T, D) inside each example of the rows -> (B, H, T, D);
    `scale` defaults to 1 / sqrt(D)."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    gqa = k.size(1) != q.size(1)
    if mask.kernel == "flash":  # FlashAttention takes (B, T, H, D)
        out = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask.cu, mask.window, 1, scale)
        return out.transpose(1, 2)
    if mask.kernel == "flex":
        return _flex()(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa)
    if gqa and q.is_cuda:   # CUDA's SDPA kernels that take a mask do not group heads (only its math one does)
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=gqa)
