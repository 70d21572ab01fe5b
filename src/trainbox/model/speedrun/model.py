"""Speedrun GPT family (`model.family: speedrun`), after modded-nanogpt's FlexAttention-era model.

Architecture choices (modded-nanogpt records of late 2024 / early 2025, Keller Jordan et al.):
  - token embedding, then a parameter-free RMSNorm; x0 (the normed embedding) is mixed back into every
    block with learned scalars (`lambdas`), and U-net skips join encoder block i to decoder block L-1-i;
  - attention: RoPE, QK-norm (RMSNorm of queries and keys, attention scale 0.12), value embeddings (extra
    token embeddings added to the values of the first and last three layers), heads of `head_dim`;
  - document-causal sliding-window attention: a query sees keys that are (1) not in its future, (2) fewer
    than `window` tokens back, counted in blocks of `model.window_block` tokens (1: exactly; the recipes'
    128: whole blocks, as the records' block-wise windows) and (3) in its own document; a document
    starts at each EOT token (the data puts EOT before every document). The window grows from 128 to `model.window` over
    `model.window_warmup_steps` steps, or over the whole run when it is null (`set_step`, called by the
    training loop with the step and the run's total);
  - MLP of width 4d with ReLU^2; every output projection (attention, MLP, head) starts at zero;
  - untied output head; logits soft-capped by `logit_softcap * tanh(logits / logit_softcap)`;
  - `model.window_pattern` gives each layer its attention: L the window, S half of it (the "long-short"
    windows of modded-nanogpt's January 2025 records), - none at all (a later record drops layer 6's
    attention); the block keeps its MLP. Default: L everywhere;
  - under autocast the residual stream is kept in the autocast dtype (bf16), as in modded-nanogpt whose
    embeddings are bf16: the embedding lookups are cast once, so every norm, residual add and skip moves
    half the bytes. The weights stay fp32 for the optimizers. `model.lowp_residual=false` keeps it fp32.

RoPE positions count from the start of the row, not of the document (as in modded-nanogpt).

With model.attention=flash, or auto on a Hopper or Blackwell GPU with FlashAttention-4 installed and
model.window_block=1, attention runs through FlashAttention-4's variable-length kernels in bf16/fp16
(kernels/flash.py, kernels/choice.py). Otherwise, on CUDA (compute capability >= 8.0), it runs through
FlexAttention block masks, built per batch at the level of 128-token blocks, which skip the masked-out
blocks; elsewhere it runs through SDPA with the same rule as an explicit boolean mask (one logged
warning). Generation uses the SDPA path with a KV cache that remembers each key's document, so windows
and document boundaries hold while decoding.

    trainbox train speedrun-124m data.path=data/fineweb      # 124M, Muon, on FineWeb shards
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from trainbox.errors import ConfigError
from trainbox.kernels.choice import KernelChoice, choose
from trainbox.kernels.doc_mask import flex_block_mask, sdpa_mask
from trainbox.kernels.flash import doc_seqlens, flash_attention, half_precision
from trainbox.kernels.fp8 import fp8_linear, linear, mlp_fp8
from trainbox.kernels.fused_ce import head_cross_entropy
from trainbox.model.layers import DocKVCaches, KVCache, Output, RMSNorm, Rotary, cross_entropy, residual_dtype
from trainbox.model.spec import family

log = logging.getLogger("trainbox")


ATTN_SCALE = 0.12          # modded-nanogpt's attention scale for QK-normed heads of 128
MIN_WINDOW = 128           # window at step 0 of the warm-up
NUM_VALUE_EMBEDS = 3


# the attention calls take and return (B, T, H, D); FlexAttention and SDPA work in (B, H, T, D)
def _flex_call(flex, block_mask, q, k, v):
    return flex(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask, scale=ATTN_SCALE).transpose(1, 2)


def _sdpa_call(mask, q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask,
                                          scale=ATTN_SCALE).transpose(1, 2)


def _flash_call(cu, window, div, q, k, v):
    return flash_attention(q, k, v, cu, window, div, ATTN_SCALE)


@functools.cache
def _compiled_flex():
    # flex_attention must be compiled to run its fused kernel (uncompiled it materialises the scores)
    return torch.compile(flex_attention, dynamic=False)


def _flex_fn():
    """flex_attention itself inside a compiled model (the outer compile fuses it), else its compiled form."""
    if torch.compiler.is_compiling():
        return flex_attention
    return _compiled_flex()


# ----------------------------------------------------------------------------- blocks


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int, rotary: Rotary):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        hdim = n_head * head_dim
        self.c_q = nn.Linear(dim, hdim, bias=False)
        self.c_k = nn.Linear(dim, hdim, bias=False)
        self.c_v = nn.Linear(dim, hdim, bias=False)
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))  # mix of computed value and value embedding
        self.rotary = rotary
        self.qk_norm = RMSNorm(head_dim, weight=False)
        self.c_proj = nn.Linear(hdim, dim, bias=False)

    def forward(self, x, ve, attend, cache: KVCache | None, pos: int) -> torch.Tensor:
        B, T, _ = x.shape
        # one matmul for q, k and v, as modded-nanogpt's fused qkv weight: the three weights stay separate
        # parameters, so Muon still orthogonalises each. (B, T, C) -> (B, T, 3, H, D)
        w = torch.cat([self.c_q.weight, self.c_k.weight, self.c_v.weight])
        q, k, v = F.linear(x, w).view(B, T, 3, self.n_head, self.head_dim).unbind(2)
        dtype = v.dtype  # the matmul dtype (bf16 under autocast); norms and embeddings may come out in fp32
        q, k = self.rotary(self.qk_norm(q), pos), self.rotary(self.qk_norm(k), pos)
        v = self.lambdas[0] * v + (self.lambdas[1] * ve.view_as(v) if ve is not None else 0)
        # one dtype: flex_attention and FlashAttention, unlike SDPA, are not cast by autocast
        q, k, v = (t.to(dtype) for t in (q, k, v))  # (B, T, H, D)
        if cache is not None:  # the cache holds (B, H, S, D)
            k, v = (t.transpose(1, 2) for t in cache.update(pos, k.transpose(1, 2), v.transpose(1, 2)))
        y = attend(q, k, v).reshape(B, T, self.n_head * self.head_dim)
        return self.c_proj(y)


class MLP(nn.Module):
    """ReLU^2 (So et al. 2021, Primer). `fp8` (model.fp8_mlp): "down" runs the down-projection in FP8, as
    modded-nanogpt's later records do, "both" the up-projection too; decode steps stay bf16 (fp8_linear)."""

    def __init__(self, dim: int, fp8: str = "none"):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.c_proj = nn.Linear(4 * dim, dim, bias=False)
        self.fp8_up, self.fp8_down = mlp_fp8(fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.c_proj, F.relu(linear(self.c_fc, x, self.fp8_up)).square(), self.fp8_down)


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int, rotary: Rotary, attention: bool = True,
                 fp8_mlp: str = "none"):
        super().__init__()
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # x <- a * x + b * x0
        self.norm = RMSNorm(dim, weight=False)
        self.attn = Attention(dim, n_head, head_dim, rotary) if attention else None
        self.mlp = MLP(dim, fp8_mlp)

    def forward(self, x, x0, ve, attend, cache, pos) -> torch.Tensor:
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(self.norm(x), ve, attend, cache, pos)
        return x + self.mlp(self.norm(x))


# ----------------------------------------------------------------------------- the model


class SpeedrunGPT(nn.Module):
    """`cfg` is a ModelSection with `eot_id` set (the loop fills it from the tokenizer)."""

    family = "speedrun"

    def __init__(self, cfg, vocab_size: int, block_size: int):
        super().__init__()
        if cfg.eot_id is None:
            raise ConfigError("model.family=speedrun needs model.eot_id (the document separator token)",
                              hint="trainbox train sets it from the tokenizer; "
                                   "pass model.eot_id=N when building a model by hand")
        self.cfg, self.vocab_size, self.block_size, self.eot_id = cfg, vocab_size, block_size, cfg.eot_id
        L, dim = cfg.n_layer, cfg.n_embd
        self.head_dim = cfg.head_dim or dim // cfg.n_head
        hdim = cfg.n_head * self.head_dim
        self.embed = nn.Embedding(vocab_size, dim)
        n_ve = min(NUM_VALUE_EMBEDS, max(1, L // 2))
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab_size, hdim) for _ in range(n_ve))
        self.rotary = Rotary(self.head_dim, max_len=block_size)
        self.pattern = cfg.window_pattern or "L" * L  # per layer: L long window, S short, - no attention
        self.blocks = nn.ModuleList(Block(dim, cfg.n_head, self.head_dim, self.rotary, attention=c != "-",
                                          fp8_mlp=cfg.fp8_mlp) for c in self.pattern)
        used = {self.value_embed_index(i) for i, c in enumerate(self.pattern) if c != "-"}
        if len(used - {None}) < n_ve:
            raise ConfigError(f"model.window_pattern={self.pattern!r} turns off attention in every layer that reads "
                              f"one of the {n_ve} value embeddings (the first and last {n_ve} layers)",
                              hint="keep attention (L or S) in at least one of layer i and layer n_layer - "
                                   f"{n_ve} + i for each i < {n_ve}")
        self.n_encoder = L // 2  # U-net: blocks 0..n_encoder-1 push skips, the rest pop them in reverse
        self.skip_weights = nn.Parameter(torch.ones(self.n_encoder))
        self.norm = RMSNorm(dim, weight=False)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        # the long window (L layers); S layers see half of it
        self.register_buffer("window", torch.tensor(cfg.window, dtype=torch.int32), persistent=False)
        self.window_host = torch.tensor(cfg.window)  # the same on the CPU, read by the FlashAttention op
        self.backend: str | None = None  # flash, flex or sdpa: model.attention, decided on first use from the device
        self.kernels: KernelChoice | None = None
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight",)) or name == "lm_head.weight":
                nn.init.zeros_(p)  # every block starts as the identity; the head starts uniform
            elif p.dim() == 2 and "embed" not in name:
                bound = (3 ** 0.5) * 0.5 / p.size(1) ** 0.5  # uniform with std 0.5 / sqrt(fan_in)
                nn.init.uniform_(p, -bound, bound)
            elif p.dim() == 2:
                nn.init.normal_(p, std=1.0)

    # ------------------------------------------------------------------ schedules and backends
    def window_at(self, step: int, total: int | None = None) -> int:
        """Attention window at `step`: MIN_WINDOW growing linearly to model.window over the warm-up, which
        is model.window_warmup_steps steps or, when that is null, the run's `total` steps."""
        final = self.cfg.window
        start = min(MIN_WINDOW, final)
        warmup = self.cfg.window_warmup_steps if self.cfg.window_warmup_steps is not None else total
        if not warmup or step >= warmup:
            return final
        return int(start + (final - start) * step / warmup)

    def set_step(self, step: int, total: int | None = None) -> None:
        """Called by the loop before each step (outside torch.compile): window warm-up and backend choice."""
        window = self.window_at(step, total)
        self.window.fill_(window)
        self.window_host.fill_(window)
        self.set_kernels(self.window.device)

    def set_kernels(self, device: torch.device) -> KernelChoice:
        """The kernels for `device`, decided once (kernels.choice.choose): attention flash, flex or sdpa."""
        if self.kernels is not None:
            return self.kernels
        self.kernels = plan = choose(self.cfg, device, family(self.cfg.family))
        self.backend = plan.attention
        if plan.attention == "sdpa" and self.cfg.attention != "sdpa":
            log.warning(f"speedrun: FlexAttention is not available on {device} (it needs a CUDA GPU of compute "
                            "capability 8.0+); attention runs through SDPA with an explicit mask (same maths, "
                            "slower, memory O(T^2))")
        return plan

    def value_embed_index(self, layer: int) -> int | None:
        """The first and the last k layers share the k value embeddings (layer 0 and layer L-k use ve 0)."""
        k, L = len(self.value_embeds), len(self.blocks)
        if layer < k:
            return layer
        if layer >= L - k:
            return layer - (L - k)
        return None

    # ------------------------------------------------------------------ forward
    def _attend_fns(self, idx: torch.Tensor, caches: DocKVCaches | None, pos: int) -> dict:
        """Document ids of the new tokens, then {"L": attention with the long window, "S": the short one}
        (only the kinds the pattern uses; one mask each, shared by the layers of that kind)."""
        docs = (idx == self.eot_id).cumsum(dim=1)  # a document starts at each EOT
        windows = {"L": self.window, "S": (self.window // 2).clamp(min=1)}
        unit = self.cfg.window_block
        kinds = sorted(set(self.pattern) - {"-"})
        if caches is not None:
            prev = caches.docs[:, pos - 1:pos] if pos > 0 else 0
            kv_docs = caches.update_docs(pos, docs + prev)
            masks = {c: sdpa_mask(docs + prev, kv_docs, pos, windows[c], unit) for c in kinds}
        elif self.backend == "flash" and half_precision(idx.device, self.embed.weight.dtype):
            cu = doc_seqlens(docs)
            return {c: functools.partial(_flash_call, cu, self.window_host, 1 if c == "L" else 2) for c in kinds}
        elif self.backend in ("flex", "flash"):  # flash in fp32 (it has no fp32 kernels): FlexAttention
            flex = _flex_fn()
            block_masks = {c: flex_block_mask(docs, windows[c], unit) for c in kinds}
            return {c: functools.partial(_flex_call, flex, bm) for c, bm in block_masks.items()}
        else:
            masks = {c: sdpa_mask(docs, docs, 0, windows[c], unit) for c in kinds}
        return {c: functools.partial(_sdpa_call, m) for c, m in masks.items()}

    def hidden(self, idx: torch.Tensor, caches: DocKVCaches | None = None, pos: int = 0) -> torch.Tensor:
        T = idx.size(1)
        if pos + T > self.block_size:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the model's block_size {self.block_size}")
        self.set_kernels(idx.device)
        attend = self._attend_fns(idx, caches, pos)
        device = idx.device.type
        # under autocast the residual stream lives in the autocast dtype (model.lowp_residual, on by default
        # here): cast the lookups once
        dtype = residual_dtype(self.cfg, device, default=True)
        ves = [ve(idx) if dtype is None else ve(idx).to(dtype) for ve in self.value_embeds]
        x = x0 = self.norm(self.embed(idx))
        if dtype is not None:  # after the norm: CUDA autocast runs rms_norm in fp32 and returns fp32
            x = x0 = x.to(dtype)
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= self.n_encoder and skips:
                x = x + self.skip_weights[i - self.n_encoder] * skips.pop()
            j = self.value_embed_index(i)
            x = block(x, x0, ves[j] if j is not None else None, attend.get(self.pattern[i]),
                      caches[i] if caches else None, pos)
            if i < self.n_encoder:
                skips.append(x)
        return self.norm(x)

    def logits(self, x: torch.Tensor, shifted: bool = False) -> torch.Tensor:
        """Soft-capped logits, cap * tanh(z / cap). `shifted=True` returns them plus cap, computed as
        2 cap sigmoid(2 z / cap) (the same number: tanh(u) + 1 = 2 sigmoid(2u)); a softmax or a
        cross-entropy cannot tell the two apart, and the sigmoid is the cheaper of the two to compute."""
        # FP8 head (model.fp8_head): training and evaluation; decode steps (rows not a multiple of 16) stay bf16
        logits = (fp8_linear(x, self.lm_head.weight) if self.cfg.fp8_head else self.lm_head(x)).float()
        cap = self.cfg.logit_softcap
        if not cap:
            return logits
        return 2 * cap * torch.sigmoid(logits * (2 / cap)) if shifted else cap * torch.tanh(logits / cap)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                caches: DocKVCaches | None = None, pos: int = 0, reduction: str = "mean") -> Output:
        x = self.hidden(idx, caches, pos)
        if targets is None:  # inference: only the last position's logits are needed
            return Output(logits=self.logits(x[:, -1:, :]))
        if self.cfg.fused_loss:
            return Output(loss=head_cross_entropy(x, self.lm_head.weight, targets, loss_mask, self.cfg.logit_softcap,
                                                  reduction, fp8=self.cfg.fp8_head))
        return Output(loss=cross_entropy(self.logits(x, shifted=True), targets, loss_mask, reduction))

    # ------------------------------------------------------------------ interface
    def checkpoint_units(self) -> list[nn.Module]:
        """The blocks that train.activation_checkpointing wraps."""
        return list(self.blocks)

    def make_caches(self, batch: int, max_len: int, dtype, device) -> DocKVCaches:
        caches = [KVCache(batch, self.cfg.n_head, max_len, self.head_dim, dtype, device) if b.attn is not None
                  else None for b in self.blocks]
        return DocKVCaches(caches, batch, max_len, device)

    def num_params(self, exclude_embeddings: bool = True) -> int:
        """Parameters; by default without the lookup tables (token and value embeddings), which do no matmuls."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed.weight.numel() + sum(e.weight.numel() for e in self.value_embeds)
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """6N for the matmuls plus 12 * H * D * context per attention layer, the context capped by its window."""
        def mean_context(window: int) -> float:  # keys a query sees, on average, away from the row's start
            unit = self.cfg.window_block
            blocks = -(-window // unit)          # its own block and blocks - 1 whole ones before it
            return min(seq_len, window if unit == 1 else (blocks - 1) * unit + (unit + 1) / 2)

        context = {"L": mean_context(self.cfg.window), "S": mean_context(max(1, self.cfg.window // 2)), "-": 0}
        return 6 * self.num_params() + 12 * self.cfg.n_head * self.head_dim * sum(context[c] for c in self.pattern)


def build(cfg, vocab_size: int, block_size: int, run=None) -> SpeedrunGPT:
    return SpeedrunGPT(cfg, vocab_size, block_size)
