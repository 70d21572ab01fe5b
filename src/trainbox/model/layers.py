"""Shared blocks. Model families compose these; none of them knows about training.

KVCache is the one key/value cache used by generation; Output is what every family's forward returns, and
cross_entropy the one token loss (fp32, masked targets excluded).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainbox.kernels.ops import autocast_dtype, gelu_tanh  # noqa: F401 - the models' shared helpers


class RMSNorm(nn.Module):
    """RMS norm; `weight=False` gives the parameter-free version (modded-nanogpt)."""

    def __init__(self, dim: int, eps: float = 1e-6, weight: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


class KVCache(nn.Module):
    """Pre-allocated keys/values for one attention layer: (B, H, T_max, D)."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v at positions pos..pos+T-1 -> the keys and values up to there; a device tensor `pos` (one
        token) writes there and gives the whole cache, the same shapes at every position. k and v are stored in the
        cache's dtype (a 4-bit base's layers hand fp32 out of a bf16 autocast)."""
        if isinstance(pos, torch.Tensor):
            self.k.index_copy_(2, pos.view(1), k.to(self.k.dtype))
            self.v.index_copy_(2, pos.view(1), v.to(self.v.dtype))
            return self.k, self.v
        t = k.size(2)
        self.k[:, :, pos:pos + t] = k
        self.v[:, :, pos:pos + t] = v
        return self.k[:, :, :pos + t], self.v[:, :, :pos + t]


SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch 2.5+


def cached_attention(q, k, v, cache: KVCache | None, pos: int | torch.Tensor,
                     attend: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA over (B, H, T, D) tensors, appending k/v to the cache when one is given.

    With a cache, the T new queries sit at positions pos..pos+T-1 and see every cached key up to their
    own position, so prefill (T > 1) and one-token decode (T = 1) are the same code. Keys and values with
    fewer heads than the queries (grouped-query attention: each serves H_q / H_kv query heads) go through
    SDPA's enable_gqa, or are repeated where torch lacks it.

    `attend` (B, S_max) bool, with a cache only: True where a cache position holds a real token; keys where it is
    False are never seen (left-padded rows of a batch, generate.py `rollout`). A query always sees its own key, so no
    row of the mask is all False: SDPA's kernels differ on such a row (zeros, NaN or arbitrary values), and what a
    padding query computes becomes the next layer's keys and values at its position, where a NaN would reach every
    real row as 0 x NaN.

    `pos` a device tensor (one query, with `attend`): the query sees the whole cache up to its position, shapes that
    do not change with it (generate.py `rollout` replays such a step in a CUDA graph).
    """
    if cache is not None:
        k, v = cache.update(pos, k, v)
    gqa = {}
    if k.size(1) != q.size(1):
        if SDPA_GQA:
            gqa = {"enable_gqa": True}
        else:
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    if cache is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    t, s = q.size(2), k.size(2)
    if isinstance(pos, torch.Tensor):
        keys = torch.arange(s, device=q.device)
        mask = (keys <= pos) if attend is None else (attend[:, None, None, :] & (keys <= pos)) | (keys == pos)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
    if attend is not None:
        own = torch.arange(s - t, s, device=q.device)[:, None]   # (t, 1): each query's position
        keys = torch.arange(s, device=q.device)
        mask = (attend[:, None, None, :s] & (keys <= own)) | (keys == own)   # (B, 1, t, s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v, **gqa)
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


def init_normal_(module: nn.Module, std: float = 0.02) -> None:
    for p_name, p in module.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, mean=0.0, std=std)
        elif p_name.endswith("bias"):
            nn.init.zeros_(p)


def scaled_residual_init_(model: nn.Module, suffix: str, n_layer: int, std: float = 0.02) -> None:
    """GPT-2: residual output projections start with std / sqrt(2 * n_layer)."""
    for name, p in model.named_parameters():
        if name.endswith(suffix):
            nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * n_layer))


class Rotary(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021) on (B, T, H, D) tensors.

    Positions start at `pos`, so a KV-cached decode step rotates its query by its true position. With
    `max_len`, the cos/sin tables of positions 0..max_len-1 are built once (non-persistent buffers, 2 x
    max_len x D/2 fp32: 32 MiB for 64K positions of heads of 128) and sliced per call; without it the
    angles are computed per call. The tables matter on the GPU: fused into the q/k norm kernels, the
    per-call form evaluates a cos and a sin for every element of q and k, in every layer, forward and
    backward; the table form reads them.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, max_len: int | None = None):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq) if max_len else None
        self.register_buffer("cos", angles.cos() if max_len else None, persistent=False)
        self.register_buffer("sin", angles.sin() if max_len else None, persistent=False)

    def forward(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        T = x.size(1)
        if self.cos is not None and pos + T <= self.cos.size(0):
            cos, sin = self.cos[None, pos:pos + T, None, :], self.sin[None, pos:pos + T, None, :]  # (1, T, 1, D/2)
        else:
            positions = torch.arange(pos, pos + T, device=x.device, dtype=torch.float32)
            angles = torch.outer(positions, self.inv_freq)[None, :, None, :]
            cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.float().chunk(2, dim=-1)
        y = torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)
        return y.type_as(x)


class DocKVCaches(list):
    """One KVCache per layer plus the document id of every cached position.

    Families with document-masked attention (speedrun) need to know, at decode time, which document each
    cached key belongs to; the ids are shared by all layers, so they are kept once here.
    """

    def __init__(self, caches: list[KVCache], batch: int, max_len: int, device):
        super().__init__(caches)
        self.docs = torch.zeros(batch, max_len, dtype=torch.long, device=device)

    def update_docs(self, pos: int, docs: torch.Tensor) -> torch.Tensor:
        """Store the (B, T) ids of positions pos.. and return the ids of every position up to them."""
        self.docs[:, pos:pos + docs.size(1)] = docs
        return self.docs[:, :pos + docs.size(1)]


@dataclass
class Output:
    loss: torch.Tensor | None = None          # mean cross-entropy over (unmasked) target tokens
    logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None      # extra training loss (MoE balance); added by the loop
    stats: dict = field(default_factory=dict)  # detached scalars/tensors for logging


def residual_dtype(cfg, device: str, default: bool) -> torch.dtype | None:
    """The dtype to cast the embeddings to (model.lowp_residual, `default` when unset): the autocast dtype
    under autocast, else None (leave the residual stream in the weights' dtype)."""
    on = default if cfg.lowp_residual is None else cfg.lowp_residual
    return autocast_dtype(device, None) if on else None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None,
                  reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy in fp32; masked-out targets (loss_mask False) contribute nothing."""
    if loss_mask is not None:
        targets = targets.masked_fill(~loss_mask, -100)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=-100, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss
