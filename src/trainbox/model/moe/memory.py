"""The moe family's activations for the plan: gpt blocks whose MLP, every model.moe.every-th block, is the routed
expert FFN (model.py's MoEFFN)."""
from __future__ import annotations

from functools import partial

from trainbox.model.gpt.memory import gpt_block
from trainbox.model.memory import Block, Forward, Kernels, Widths


def moe_ffn(b: Block, d: int, moe, w: Widths, kern: Kernels, bias: bool) -> None:
    """Router, top-k, dispatch, two grouped matmuls, gates, combine (moe.MoEFFN), for k of E experts."""
    a, k, E = w.a, moe.top_k, moe.num_experts
    b.keep(4 * d)                  # ln_2 output in fp32, the fp32 router's input
    b.mm(4 * E)                    # router logits (fp32), kept by the z-loss's logsumexp
    b.keep(8 * E + 4)              # softmax probabilities (routing, balance loss), logsumexp
    b.keep(k * (8 + 4 + 8 + 16) + 4)   # top-k ids, gates, the sort order, dispatch/combine indices
    b.keep(k * a * d)              # dispatched rows (c_fc's input)
    fused = kern.fused_mlp in ("quack", "torch") and not bias
    b.mm(4 * k * a * d) if not fused else b.keep(4 * k * a * d)   # h, kept by the GELU
    if not (w.expert_parallel > 1 and w.compiled and not fused):
        # GELU(h); under expert parallelism the experts run in a graph of their own after the exchange's host
        # read, where the compiler recomputes it in the backward (measured: 2026-11-27-2xh200-moe-gpt2-125m-ep2-
        # vs-ddp-memory.json, every rank's allocator history)
        b.keep(4 * k * a * d)
    b.mm(k * a * d) if not fused else b.keep(k * a * d)   # expert outputs, kept by the gate multiply
    b.keep(4 * k)                  # the gates, in fp32
    if bias:
        b.keep(8 * k)              # expert id per row, for the bias gradient


def forward(cfg, counts, micro: int, mode: str, w: Widths, kern: Kernels) -> Forward:
    m, T = cfg.model, cfg.data.seq_len
    N, d = micro * T, m.n_embd
    experts = partial(moe_ffn, d=d, moe=m.moe, w=w, kern=kern, bias=m.bias)
    per_layer = [gpt_block(d, m.n_head, w, kern, m.bias, ffn=experts if i % m.moe.every == 0 else None)
                 for i in range(m.n_layer)]
    return Forward(blocks=N * sum(b.bytes(mode) for b in per_layer), recompute=N * max(b.none for b in per_layer),
                   other=N * (8 + w.r * d + 8) + 8 * T, head_tokens=N, width=d, widest=4 * d * m.moe.top_k)
