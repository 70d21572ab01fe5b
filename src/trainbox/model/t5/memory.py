"""The t5 family's activations for the plan: encoder and decoder blocks, cross-attention, the position biases
(model.py), over span-corrupted examples (data/spans.py)."""
from __future__ import annotations

from trainbox.data.spans import span_lengths
from trainbox.model.memory import Block, Forward, Kernels, Widths
from trainbox.model.t5.model import t5_d_ff, t5_d_kv, t5_decoder_layers

COMPILE_FACTOR = 0.85   # the blocks' activations compiled / eager (Inductor on a CPU, model/memory.py)
# the share of a GPT's FLOP rate this family's step reaches (plan/time.py; `speed`), a decoder of a fifth of the
# encoder's length among the reasons. On SDPA (model.attention=sdpa) the position bias's gradient keeps attention on
# the memory-efficient kernel (t5-base on an H100, benchmarks/records/2026-11-26-h100-t5-base-speed.json); on the
# Triton kernels, the step replayed as CUDA graphs, so that the GPU sets its pace (t5-base on an H200,
# benchmarks/records/2026-11-29-h200-t5-base-speed-cuda-graphs.json)
SPEED = 0.52
TRITON_SPEED = 0.654


def speed(model) -> float:
    """The share of a GPT's FLOP rate of model section `model` on a CUDA GPU (where auto takes the Triton kernels)."""
    return SPEED if model.attention == "sdpa" else TRITON_SPEED


def t5_blocks(d: int, heads: int, inner: int, ffn: int, S: int, T: int, w: Widths, kern: Kernels
              ) -> tuple[Block, Block, Block]:
    """(encoder block per encoder token, decoder block per decoder token, the decoder's cross-attention keys
    and values per encoder token). On a CPU the encoder and decoder self-attention take the math path (the
    position bias needs its gradient): fp32 copies of q, k, v and the output, and the probabilities."""
    a = w.a

    def self_attention(b: Block, length: int) -> None:
        b.inp(w.r * d)                         # the norm's input (the block's input)
        b.keep(w.rms(d, True) - w.r * d)       # the rest the norm keeps
        b.keep(w.casts(3) * a * d)             # norm output, cast once per projection under autocast
        if not w.cuda:
            b.mm(3 * a * inner, keep=False)    # q, k, v
            b.keep(3 * 4 * inner + 4 * heads * length)  # fp32 (the bias is): q, k, v, probabilities
            b.keep(a * inner)                  # the output, o's input
            b.mm(4 * heads * length + 4 * inner, keep=False)   # the two bmm outputs
        else:
            b.mm(3 * a * inner)                # q, k, v, kept by the attention
            b.attn(a * inner + 4 * heads)      # output and log-sum-exp
        b.mm(a * d, keep=False, residual=True)   # o output

    def feed_forward(b: Block) -> None:
        b.keep(w.rms(d, True))                 # norm input (x after attention), what the norm keeps
        b.keep(w.casts(2) * a * d)             # norm output (wi_0's and wi_1's inputs)
        b.mm(a * ffn)                          # wi_0 x, kept by the GELU
        b.keep(a * ffn)                        # GELU(wi_0 x)
        b.mm(a * ffn)                          # wi_1 x
        b.keep(a * ffn)                        # the product, wo's input
        b.mm(a * d, keep=False, residual=True)   # wo output

    enc = Block(kern.attn_saved_by_selective, w.compiled)
    self_attention(enc, S)
    feed_forward(enc)
    dec = Block(kern.attn_saved_by_selective, w.compiled)
    self_attention(dec, T)
    dec.keep(w.rms(d, True))                   # cross-attention norm
    dec.keep(a * d)                            # its output, q's input
    dec.mm(a * inner)                          # q
    dec.attn(a * inner + 4 * heads)            # output, log-sum-exp
    dec.mm(a * d, keep=False, residual=True)   # o output
    feed_forward(dec)
    cross = Block(kern.attn_saved_by_selective, w.compiled)
    cross.keep((w.casts(2) if w.casts(2) > 1 else 0) * a * d)   # the encoder output cast for k and for v
    cross.mm(2 * a * inner)                    # k, v
    return enc, dec, cross


def forward(cfg, counts, micro: int, mode: str, w: Widths, kern: Kernels) -> Forward:
    m, T, B = cfg.model, cfg.data.seq_len, micro
    d = m.n_embd
    _, dec = span_lengths(T, m.t5.noise_density, m.t5.mean_noise_span_length)
    inner = m.n_head * t5_d_kv(m)
    enc, dec_b, cross = t5_blocks(d, m.n_head, inner, t5_d_ff(m), T, dec, w, kern)
    n_dec = t5_decoder_layers(m)
    cross_mode = cross.bytes(mode) if mode != "full" else 0
    blocks = B * (m.n_layer * T * enc.bytes(mode) + n_dec * (dec * dec_b.bytes(mode) + T * cross_mode))
    recompute = B * max(T * enc.none, dec * dec_b.none + T * cross.none)
    # each stack's fp32 bias: by distance on the Triton kernels (2T - 1 a head), else by position (T x T)
    stacks = 4 * m.n_head * ((2 * T + 2 * dec - 2) if kern.attention == "triton" else (T * T + dec * dec))
    if mode == "none" and kern.attention == "triton":   # every layer keeps its stack's one bias
        bias = stacks
    elif mode == "none":   # each layer's copy of the position bias in q's dtype (on a GPU)
        bias = w.a * m.n_head * (T * T * m.n_layer + dec * dec * n_dec) if w.cuda else 0
    else:                # the blocks' inputs: each stack's bias, and the encoder output
        bias = stacks + (B * T * 4 * d if w.a != 4 else 0)
    # ids of both stacks, the targets; the bucket of each distance (2T - 1 a stack); the encoder's final norm and, in
    # fp32, its output (the memory every decoder block reads); the decoder's final norm
    other = (B * (T + 2 * dec) * 8 + 8 * (2 * T + 2 * dec - 2)
             + B * T * (w.rms(d, True) + (4 * d if w.a == 4 else 0)) + B * dec * w.rms(d, True) + bias)
    return Forward(blocks=blocks, recompute=recompute, other=other, head_tokens=B * dec, width=d)
