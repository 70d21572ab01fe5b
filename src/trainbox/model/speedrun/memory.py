"""The speedrun family's activations for the plan (model.py: x0 mixing, QK-norm, value embeddings, ReLU^2)."""
from __future__ import annotations

from trainbox.model.memory import Block, Forward, Kernels, Widths

COMPILE_FACTOR = 0.96   # the blocks' activations compiled / eager (Inductor on a CPU, model/memory.py)


def speedrun_block(d: int, heads: int, hd: int, T: int, letter: str, w: Widths, kern: Kernels, fp8: str) -> Block:
    """x = l0 x + l1 x0; x += attn(norm x) (QK-norm, RoPE, value mixing); x += relu(c_fc norm x)^2 c_proj."""
    a = w.a
    b = Block(kern.attn_saved_by_selective, w.compiled)
    b.inp(w.r * d)                 # x, kept by the lambdas' product (x0 is shared by every block)
    b.keep(w.rms(d, False))        # the mixed x, as the norm keeps it, and its rstd
    up8, down8 = fp8 == "both", fp8 in ("down", "both")
    if letter != "-":
        b.keep(d if up8 else a * d)            # norm output, the fused qkv matmul's input
        b.mm(3 * a * hd)                       # q, k, v (QK-norm keeps q and k; the value mix keeps v)
        b.keep(8 * heads + (8 * hd if a != 4 and not w.compiled else 0))   # QK-norm: rstd (and fp32 q, k)
        b.keep(3 * a * hd)                     # the attention's inputs: rotated q and k, mixed v
        b.attn(a * hd + 4 * heads)             # its output and log-sum-exp
        if kern.attention == "sdpa":           # the document/window mask, T keys per query, in q's dtype
            b.keep(a * T)
        b.mm(a * d, keep=False, residual=True)   # c_proj output
        b.keep(w.rms(d, False))                # the MLP norm's input (x after attention), rstd
    b.keep(d if up8 else a * d)                # MLP norm output, c_fc's input
    b.mm(4 * a * d, keep=False)                # h = c_fc(x)
    b.keep(4 * a * d)                          # relu(h), kept by relu and by the square
    b.keep(4 * (1 if down8 else a) * d)        # relu(h)^2, c_proj's input (an e4m3 copy under fp8_mlp)
    b.mm(a * d, keep=False, residual=True)   # c_proj output
    return b


def forward(cfg, counts, micro: int, mode: str, w: Widths, kern: Kernels) -> Forward:
    m, T = cfg.model, cfg.data.seq_len
    N, d = micro * T, m.n_embd
    fp8_mlp = m.fp8_mlp if kern.fp8 == "fp8" else "none"
    hd = m.n_head * (m.head_dim or d // m.n_head)
    pattern = m.window_pattern or "L" * m.n_layer
    per_layer = [speedrun_block(d, m.n_head, hd, T, c, w, kern, fp8_mlp) for c in pattern]
    n_ve = min(3, max(1, m.n_layer // 2))
    # ids; the embedding's norm (fp32); value embeddings; the first decoder block's skip; the final norm
    other = N * (8 + w.rms(d, False, 4) + n_ve * w.a * hd + w.r * d + w.rms(d, False))
    if mode == "none" and not (w.autocast and w.a != 4):   # q, k, v weights concatenated per call (no cast kept)
        other += 3 * hd * d * w.a * sum(c != "-" for c in pattern)
    return Forward(blocks=N * sum(b.bytes(mode) for b in per_layer), recompute=N * max(b.none for b in per_layer),
                   other=other, head_tokens=N, width=d, softcap=m.logit_softcap > 0)
