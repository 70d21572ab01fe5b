"""A model family defined outside src/ (tests/test_architecture.py registers it): a causal LM whose blocks mix each
token with the one before it, then a GELU MLP. It brings what every family brings, in one module: its model
(build), its activation formula for the plan (forward) and its export (export)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from trainbox.model.hf_folder import check_out, no_merge, staged
from trainbox.model.layers import Output, cross_entropy
from trainbox.model.load import load_for_inference
from trainbox.model.memory import Block, Forward, Kernels, Widths
from trainbox.model.spec import Family

FAMILY = Family(name="toy", summary="token-shift mixing and a GELU MLP per block", module="toy_family",
                hf_module="toy_family", memory_module="toy_family", options=frozenset({"dropout"}),
                export="toy folder (config.json, model.safetensors)")


class ToyBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mix = nn.Linear(2 * d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        prev = F.pad(h, (0, 0, 1, 0))[:, :-1]      # each token sees itself and the token before: causal
        x = x + self.mix(torch.cat([h, prev], dim=-1))
        return x + self.down(F.gelu(self.up(x)))


class Toy(nn.Module):
    def __init__(self, cfg, vocab_size: int, block_size: int):
        super().__init__()
        self.cfg, self.vocab_size, self.block_size = cfg, vocab_size, block_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(ToyBlock(cfg.n_embd) for _ in range(cfg.n_layer))
        self.head = nn.Linear(cfg.n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None, loss_mask=None, caches=None, pos=0, reduction="mean") -> Output:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return Output(logits=logits)
        return Output(loss=cross_entropy(logits, targets, loss_mask, reduction))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * self.num_params()


def build(cfg, vocab_size: int, block_size: int, run=None) -> Toy:
    return Toy(cfg, vocab_size, block_size)


def forward(cfg, counts, micro: int, mode: str, w: Widths, kern: Kernels) -> Forward:
    """What one micro-batch keeps, per token and block: the input, the norm's statistics and output, the mixed
    pair, the MLP's hidden and its GELU."""
    N, d = micro * cfg.data.seq_len, cfg.model.n_embd
    b = Block(kern.attn_saved_by_selective, w.compiled)
    b.inp(w.r * d)
    b.keep(8 + w.a * d)
    b.keep(2 * w.a * d)
    b.mm(w.a * d, keep=False, residual=True)
    b.mm(4 * w.a * d)
    b.keep(4 * w.a * d)
    b.mm(w.a * d, keep=False, residual=True)
    return Forward(blocks=N * cfg.model.n_layer * b.bytes(mode), recompute=N * b.none, other=N * 8, head_tokens=N,
                   width=d)


def export(path: str, out: str, merge: bool = False, force: bool = False, dtype: str | None = None) -> list[str]:
    no_merge(path, merge)
    model, _, cfg = load_for_inference(path)
    target = Path(out)
    check_out(target, force)
    with staged(target) as tmp:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps({"family": "toy", "n_layer": cfg.model.n_layer,
                                                     "n_embd": cfg.model.n_embd, "vocab_size": model.vocab_size}))
    return [f"wrote {target} (toy folder)"]
