"""The gpt family's activations for the plan (model/memory.py's conventions): pre-LayerNorm blocks of attention and
a GELU MLP (model.py)."""
from __future__ import annotations

from trainbox.model.memory import Block, Forward, Kernels, Widths


def gpt_attention(b: Block, d: int, heads: int, w: Widths) -> None:
    """LayerNorm -> c_attn -> causal attention -> c_proj (gpt.CausalSelfAttention)."""
    a = w.a
    b.inp(w.r * d)                 # ln_1 input (the block's input)
    b.keep(8)                      # its mean and rstd
    b.keep(a * d)                  # ln_1 output, cast for c_attn
    b.mm(3 * a * d)                # qkv, kept by the attention (q, k, v are views of it)
    b.attn(a * d + 4 * heads)      # attention output (c_proj's input) and log-sum-exp
    b.mm(a * d, keep=False, residual=True)   # c_proj output


def gpt_block(d: int, heads: int, w: Widths, kern: Kernels, bias: bool, ffn=None) -> Block:
    b = Block(kern.attn_saved_by_selective, w.compiled)
    gpt_attention(b, d, heads, w)
    a = w.a
    b.keep(w.r * d + 8)            # ln_2 input, mean, rstd
    if ffn is not None:   # another feed-forward in place of the MLP (the moe family's experts)
        ffn(b)
        return b
    b.keep(a * d)                  # ln_2 output (c_fc's input)
    fused = kern.fused_mlp in ("quack", "torch") and not bias   # one custom op: selective recomputes it
    b.mm(4 * a * d) if not fused else b.keep(4 * a * d)         # h = c_fc(x), kept by the GELU
    b.keep(4 * a * d)              # GELU(h), c_proj's input
    if not fused:
        b.mm(a * d, keep=False, residual=True)   # c_proj output
    return b


def forward(cfg, counts, micro: int, mode: str, w: Widths, kern: Kernels) -> Forward:
    m, T = cfg.model, cfg.data.seq_len
    N, d = micro * T, m.n_embd
    per_layer = [gpt_block(d, m.n_head, w, kern, m.bias) for _ in range(m.n_layer)]
    # token ids, positions; the final norm's input and stats
    return Forward(blocks=N * sum(b.bytes(mode) for b in per_layer), recompute=N * max(b.none for b in per_layer),
                   other=N * (8 + w.r * d + 8) + 8 * T, head_tokens=N, width=d)
