"""The moe family's activations for the plan: gpt blocks whose MLP, every model.moe.every-th block, is the routed
expert FFN (model.py's MoEFFN); under expert parallelism's padded exchange its experts run over capacity-sized
buffers, pad rows included (E x C rows per micro-batch where one process runs k x N)."""
from __future__ import annotations

from functools import partial

from trainbox.model.gpt.memory import gpt_block
from trainbox.model.memory import Block, Forward, Kernels, Widths


def padded_rows(moe, tokens: int) -> float:
    """Rows per token the experts run under the padded exchange (parallel/expert.py): E buffers of C = min(capacity,
    tokens) rows for a micro-batch of `tokens`, pad rows included."""
    capacity = int(moe.capacity_factor * moe.top_k * tokens / moe.num_experts)
    return moe.num_experts * min(capacity, tokens) / tokens


def moe_ffn(b: Block, d: int, moe, w: Widths, kern: Kernels, bias: bool, padded: float = 0) -> None:
    """Router, top-k, dispatch, two grouped matmuls, gates, combine (moe.MoEFFN), for k of E experts. `padded`: the
    rows per token of the padded exchange's buffers (padded_rows), which the experts run as batched matmuls."""
    a, k, E = w.a, moe.top_k, moe.num_experts
    b.keep(4 * d)                  # ln_2 output in fp32, the fp32 router's input
    b.mm(4 * E)                    # router logits (fp32), kept by the z-loss's logsumexp
    b.keep(8 * E + 4)              # softmax probabilities (routing, balance loss), logsumexp
    b.keep(k * (8 + 4 + 8 + 16) + 4)   # top-k ids, gates, the sort order, dispatch/combine indices
    if padded:
        _padded_experts(b, d, k, padded, w, kern)
        return
    b.keep(k * a * d)              # dispatched rows (c_fc's input)
    fused = kern.fused_mlp in ("quack", "torch") and not bias
    # the hidden layer (train.activation_checkpointing=experts keeps neither and runs the experts unfused)
    b.mm(4 * k * a * d, hidden=True) if not fused else b.keep(4 * k * a * d, hidden=True)   # h, kept by the GELU
    # GELU(h), kept for the second matmul's weight gradient. Under expert parallelism too: the experts' compiled
    # graph holds the exchanges (functional collectives), and the partitioner keeps it there rather than write it
    # again in the backward (2026-11-29-2xh200-moe-gpt2-125m-ep2-vs-ddp-2gpu.json: 39.2 GiB; before the exchanges
    # joined the graph it was recomputed, 30.3 GiB in 2026-11-27-2xh200-moe-gpt2-125m-ep2-vs-ddp-2gpu.json)
    b.keep(4 * k * a * d, hidden=True)
    b.mm(k * a * d) if not fused else b.keep(k * a * d)   # expert outputs, kept by the gate multiply
    b.keep(4 * k)                  # the gates, in fp32
    if w.expert_parallel > 1:      # selective: the rows the exchanges returned, there and back (train/recompute.py)
        b.mm(2 * k * a * d, keep=False)
    if bias:
        b.keep(8 * k)              # expert id per row, for the bias gradient


def forward(cfg, counts, micro: int, mode: str, w: Widths, kern: Kernels) -> Forward:
    m, T = cfg.model, cfg.data.seq_len
    N, d = micro * T, m.n_embd
    padded = padded_rows(m.moe, N) if w.expert_parallel > 1 and m.moe.exchange == "padded" else 0
    experts = partial(moe_ffn, d=d, moe=m.moe, w=w, kern=kern, bias=m.bias, padded=padded)
    per_layer = [gpt_block(d, m.n_head, w, kern, m.bias, ffn=experts if i % m.moe.every == 0 else None)
                 for i in range(m.n_layer)]
    # what the backward makes again at once: a whole block, or under experts one layer's hidden layer
    again = max(b.hidden if mode == "experts" else b.none for b in per_layer)
    return Forward(blocks=N * sum(b.bytes(mode) for b in per_layer), recompute=N * again,
                   other=N * (8 + w.r * d + 8) + 8 * T, head_tokens=N, width=d, widest=4 * d * m.moe.top_k)


def _padded_experts(b: Block, d: int, k: int, rows: float, w: Widths, kern: Kernels) -> None:
    """The experts over the padded exchange's `rows` per token (parallel/expert.py: ExpertShard._padded)."""
    a = w.a
    b.keep(9 * rows + 9 * k)       # the buffer and row maps, int64 indices and bool masks, both ways
    b.keep(rows * a * d)           # the buffer of every local expert (the first batched matmul's input)
    fused = kern.fused_mlp in ("quack", "torch")
    b.mm(4 * rows * a * d, hidden=True) if not fused else b.keep(4 * rows * a * d, hidden=True)   # h, for the GELU
    if not (w.compiled and not fused):
        # GELU(h); compiled, the partitioner recomputes it in the backward (measured: 2026-11-28-2xh200-moe-gpt2-
        # 125m-128x-ep2-padded-vs-uneven-h100mem.json)
        b.keep(4 * rows * a * d, hidden=True)
    b.keep(k * a * d)              # the results back in this rank's rows, kept by the gate multiply
    # selective: the second batched matmul's output, and the buffers the exchanges returned (train/recompute.py).
    # Compiled, the run keeps these three buffers without checkpointing too (the exchanges sit inside the graph,
    # and its partitioner does not recompute collectives): measured on 2 H200s at micro-batch 16, 77.6 GiB against
    # 73.9 without them (2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-padded-vs-uneven-h100mem.json)
    b.mm(rows * a * d, keep=w.compiled)
    b.mm(2 * rows * a * d, keep=w.compiled)
    b.keep(4 * k)                  # the gates, in fp32
