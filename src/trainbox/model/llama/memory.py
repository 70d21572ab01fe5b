"""The llama family's activations for the plan: the Llama-style decoder block (model/memory.py) read from the model's
own projections (grouped-query attention, SwiGLU)."""
from __future__ import annotations

from trainbox.model.memory import Forward, Kernels, Widths, decoder_block


def forward(cfg, counts, micro: int, mode: str, w: Widths, kern: Kernels) -> Forward:
    N, s = micro * cfg.data.seq_len, counts.shapes
    blk = decoder_block(s, w, kern, frozen=counts.frozen > 0, lora_dropout=cfg.lora.dropout > 0)
    return Forward(blocks=N * counts.n_blocks * blk.bytes(mode), recompute=N * blk.none,
                   other=N * (8 + w.rms(s.d, True)), head_tokens=N, width=s.d)
