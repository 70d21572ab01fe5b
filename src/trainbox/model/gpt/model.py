"""Dense GPT-2 family (`model.family: gpt`).

Architecture (GPT-2, Radford et al. 2019): learned absolute positions, pre-LayerNorm blocks, causal
self-attention through PyTorch SDPA (cuDNN or FlashAttention-2 on GPU; FlashAttention-4 on Hopper and
Blackwell GPUs where it is installed, `model.attention`), GELU(tanh) MLP of width 4d, final
LayerNorm, output head tied to the token embedding. Parameter names map 1:1 to Hugging Face's
GPT2LMHeadModel. The projections are nn.Linear, weights (out, in), where HF's Conv1D stores (in, out):
`export.py` transposes them both ways. Linear is the faster layout: cuBLAS fuses the bias into the
matmul epilogue and the backward needs fewer transposing copies. The vocabulary may be padded
(50,257 -> 50,304) for faster matmuls; `export.py` slices and pads. With model.fused_norm each residual
add and the LayerNorm after it are one op (kernels/fused_norm.py), across block boundaries: same
arithmetic, one-pass backward. With model.fused_mlp the MLP's GELU runs in its matmuls' epilogues
(kernels/fused_mlp.py). Packed rows (data.packing, data/packing.py) come with `doc_ids` and `position_ids`: each
token takes the learned position of its place inside its example, and attention stays inside each example
(kernels/packed.py, as kernels/choice.py `packed_on` picks), so every example computes what it computes alone.

    trainbox train gpt2-125m data.path=PREFIX        # 124M GPT-2 on shard files
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from trainbox.checkpoint import is_fsdp
from trainbox.kernels.choice import KernelChoice, choose, packed_on
from trainbox.kernels.fallbacks import register_inductor_fallbacks
from trainbox.kernels.flash import causal_qkv, half_precision
from trainbox.kernels.fp8 import linear, mlp_fp8
from trainbox.kernels.fused_ce import head_cross_entropy
from trainbox.kernels.fused_mlp import EXTRA as QUACK_EXTRA
from trainbox.kernels.fused_mlp import gelu_mlp
from trainbox.kernels.fused_norm import add_layer_norm
from trainbox.kernels.packed import DocMask, doc_attention, doc_mask
from trainbox.model.layers import (
    KVCache,
    Output,
    autocast_dtype,
    cached_attention,
    cross_entropy,
    gelu_tanh,
    init_normal_,
    residual_dtype,
    scaled_residual_init_,
)
from trainbox.model.spec import family

log = logging.getLogger("trainbox")


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.flash = False  # FlashAttention-4 on the packed qkv (set by GPT.set_kernels)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, pos: int = 0,
                docs: DocMask | None = None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x)
        if self.flash and cache is None and docs is None and qkv.dtype in (torch.bfloat16, torch.float16):
            D = C // self.n_head
            y = causal_qkv(qkv.view(B, T, 3, self.n_head, D), D ** -0.5)  # (B, T, H, D): c_proj reads it as is
            return self.resid_dropout(self.c_proj(y.view(B, T, C)))
        q, k, v = qkv.split(C, dim=2)
        # (B, T, C) -> (B, H, T, D)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = cached_attention(q, k, v, cache, pos) if docs is None else doc_attention(q, k, v, docs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GELU MLP; `fp8` (model.fp8_mlp): "down" runs the down-projection's matmul in FP8, "both" both;
    `fused` (model.fused_mlp): the GELU in the matmuls' epilogues (kernels/fused_mlp.py; MLPs with biases run
    unfused: the epilogues here add none)."""

    def __init__(self, n_embd: int, bias: bool, dropout: float, fp8: str = "none", fused: bool = False):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.fp8_up, self.fp8_down = mlp_fp8(fp8)
        self.fused = fused and not bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            dtype = autocast_dtype(x.device.type, x.dtype)
            return self.dropout(gelu_mlp(x.to(dtype), self.c_fc.weight.to(dtype), self.c_proj.weight.to(dtype)))
        return self.dropout(linear(self.c_proj, gelu_tanh(linear(self.c_fc, x, self.fp8_up)), self.fp8_down))


class Block(nn.Module):
    def __init__(self, cfg, mlp: nn.Module | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg.n_embd, cfg.n_head, cfg.bias, cfg.dropout)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias)
        self.mlp = mlp if mlp is not None else MLP(cfg.n_embd, cfg.bias, cfg.dropout, cfg.fp8_mlp, cfg.fused_mlp)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, pos: int = 0,
                docs: DocMask | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, pos, docs)
        return x + self.mlp(self.ln_2(x))

    def forward_fused(self, x: torch.Tensor, y: torch.Tensor, next_norm: nn.LayerNorm,
                      docs: DocMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """model.fused_norm: (residual x, y = ln_1(x)) -> (x after the block, next_norm of it). Each residual
        add is one op with the norm that follows it (fused_norm.add_layer_norm), the MLP's with the next
        block's ln_1 (or the final norm)."""
        mlp_dtype = torch.float32 if getattr(self.mlp, "fp32_input", False) else None  # MoE: its fp32 router
        x, y = add_layer_norm(x, self.attn(y, docs=docs), self.ln_2, mlp_dtype)
        return add_layer_norm(x, self.mlp(y), next_norm)


class GPT(nn.Module):
    """GPT-2. `cfg` is a ModelSection; `vocab_size` and `block_size` are already resolved."""

    family = "gpt"
    masks_attention = True   # forward(..., visible=, position_ids=): rows of any layout (eval/adapter.py)

    def __init__(self, cfg, vocab_size: int, block_size: int, make_mlp=None):
        super().__init__()
        self.cfg, self.vocab_size, self.block_size = cfg, vocab_size, block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, cfg.n_embd),
            wpe=nn.Embedding(block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, make_mlp(i) if make_mlp else None) for i in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        init_normal_(self)
        scaled_residual_init_(self, "c_proj.weight", cfg.n_layer)
        self.backend: str | None = None  # flash or sdpa: model.attention, decided on first use from the device
        self.kernels: KernelChoice | None = None
        self.packed_kernel: str | None = None   # the kernel of packed rows, decided on the first (kernels/choice.py)
        if cfg.fused_norm or cfg.fused_mlp:
            register_inductor_fallbacks()

    def set_step(self, step: int, total: int | None = None) -> None:
        """Called by the loop before each step, outside torch.compile: picks the attention kernel."""
        self.set_kernels(self.transformer.wte.weight.device)

    def set_kernels(self, device: torch.device) -> KernelChoice:
        """The kernels for `device`, decided once (kernels.choice.choose): attention flash or sdpa; model.fused_mlp
        on a GPU without QuACK's kernels runs unfused (the op's torch path is slower there than the compiled
        graph), with a warning; model.fused_loss on an H100/H200 with QuACK takes the loop's summed loss through
        QuACK's linear cross-entropy."""
        if self.kernels is not None:
            return self.kernels
        self.kernels = plan = choose(self.cfg, device, family(self.cfg.family))
        self.backend = plan.attention
        if plan.fused_mlp == "unfused":
            log.warning(f"model.fused_mlp: QuACK's GEMMs need a Hopper or Blackwell GPU and {QUACK_EXTRA}; "
                        "the MLP runs unfused")
        for block in self.transformer.h:
            block.attn.flash = plan.attention == "flash"
            if plan.fused_mlp == "unfused" and hasattr(block.mlp, "fused"):  # MLP, or MoE experts (moe.MoEFFN)
                block.mlp.fused = False
        return plan

    def doc_mask(self, doc_ids: torch.Tensor) -> DocMask:
        """Packed rows' attention mask for every block, in the kernel kernels/choice.py picks for the device."""
        if self.packed_kernel is None:
            self.packed_kernel = packed_on(family(self.cfg.family), self.cfg, doc_ids.device)
        return doc_mask(doc_ids, self.packed_kernel, half_precision(doc_ids.device, self.lm_head.weight.dtype))

    def hidden(self, idx: torch.Tensor, caches: list[KVCache] | None = None, pos: int = 0,
               doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               visible: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.size(1)
        if pos + T > self.block_size:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the model's block_size {self.block_size}")
        self.set_kernels(idx.device)
        positions = torch.arange(pos, pos + T, device=idx.device) if position_ids is None else position_ids
        docs = self.doc_mask(doc_ids) if doc_ids is not None else None if visible is None else \
            DocMask("sdpa", dense=visible[:, None])
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        dtype = residual_dtype(self.cfg, idx.device.type, default=False)
        if dtype is not None:  # model.lowp_residual: every residual add, LayerNorm read and gradient in bf16
            x = x.to(dtype)
        blocks = self.transformer.h
        # activation checkpointing wraps each block's forward (train/recompute.py), and FSDP gathers a block's
        # weights around its forward only, while the fused path calls the next block's ln_1: those run unfused
        if (self.cfg.fused_norm and caches is None
                and not any("forward" in vars(b) or is_fsdp(b) for b in blocks)):
            y = blocks[0].ln_1(x)  # no residual add before it; compiled, it is one kernel with the embeddings' sum
            for i, block in enumerate(blocks):
                x, y = block.forward_fused(x, y, blocks[i + 1].ln_1 if i + 1 < len(blocks) else self.transformer.ln_f,
                                           docs)
            return y
        for i, block in enumerate(blocks):
            x = block(x, caches[i] if caches else None, pos, docs)
        return self.transformer.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                caches: list[KVCache] | None = None, pos: int = 0, reduction: str = "mean",
                doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 1, visible: torch.Tensor | None = None) -> Output:
        """Packed rows: `doc_ids` (B, T), each token's example in its row, and `position_ids` (B, T), its position
        inside that example (data/packing.py). Rows of any other layout: `visible` (B, T, T) bool, True where a
        query sees a key, with `position_ids` (eval/adapter.py's contexts shared by their continuations). Without
        targets: the logits of the last `logits_to_keep` positions (0: all), as Hugging Face's forward."""
        x = self.hidden(idx, caches, pos, doc_ids, position_ids, visible)
        if targets is None:
            return Output(logits=self.lm_head(x[:, -logits_to_keep:, :]))
        return Output(loss=self.head_loss(x, targets, loss_mask, reduction), logits=None)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None,
                  reduction: str) -> torch.Tensor:
        """Cross-entropy of the head's logits; model.fused_loss computes it without keeping them."""
        if self.cfg.fused_loss:
            return head_cross_entropy(x, self.lm_head.weight, targets, loss_mask, 0.0, reduction, fp8=self.cfg.fp8_head)
        return cross_entropy(linear(self.lm_head, x, self.cfg.fp8_head), targets, loss_mask, reduction)

    def checkpoint_units(self) -> list[nn.Module]:
        """The blocks that train.activation_checkpointing wraps."""
        return list(self.transformer.h)

    def make_caches(self, batch: int, max_len: int, dtype, device) -> list[KVCache]:
        hd = self.cfg.n_embd // self.cfg.n_head
        return [KVCache(batch, self.cfg.n_head, max_len, hd, dtype, device) for _ in range(self.cfg.n_layer)]

    def num_params(self, exclude_positions: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if exclude_positions else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12 * L * d * T for attention (nanoGPT, PaLM)."""
        return 6 * self.num_params() + 12 * self.cfg.n_layer * self.cfg.n_embd * seq_len


def build(cfg, vocab_size: int, block_size: int, run=None) -> GPT:
    return GPT(cfg, vocab_size, block_size)
