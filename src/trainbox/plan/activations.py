"""Activation memory of one micro-batch: what autograd keeps for the backward, per family, from the shapes.

Each family's block is written out as the tensors its forward saves, per token, in the order the code makes
them (the comments name the op that saves each). `Block` tags each one with when it is kept:

    inp   the block's input: kept in every mode (train.activation_checkpointing=full keeps only these)
    keep  kept without recomputation only (norm inputs and outputs, activation-function outputs, indices)
    mm    a matmul output: kept by mode none where the next op saves it (keep=True); by selective always in
          eager mode (its policy caches the outputs of matmuls: train/recompute.py) and, compiled, unless it only
          feeds a residual sum (residual=True): the partitioner saves a must-save output only where the backward
          reads it (the compiled Llama peaks in benchmarks/records/ agree)
    attn  the attention kernel's output and log-sum-exp: kept by none; by selective where the kernel is one of
          the ops its policy saves (SDPA and FlexAttention; not FlashAttention-4's custom op, which is
          recomputed). The kernel's inputs (q, k, v) are tagged by what makes them.

Widths: `a` bytes for matmul operands (2 under bf16/fp16 autocast, 4 in fp32), `r` bytes for the residual
stream (4: fp32, or `a` with model.lowp_residual and under FSDP's bf16 parameters). Norm statistics and
attention log-sum-exps are fp32, indices int64. Attention kernels that never form the T x T scores (flash,
memory-efficient, FlexAttention, the CPU's flash kernel) keep q, k, v, output and log-sum-exp; the math
path (`math`: T5's learned position bias on a CPU) keeps the softmax probabilities, T x T per head.

`tests/test_plan.py` holds these numbers to the bytes that saved-tensor hooks (and the selective policy's
cache) count in real eager forwards of gpt, moe, speedrun, t5 and a LoRA-wrapped Hugging Face Llama, in
fp32 and bf16, within 1% (2% for LoRA).

torch.compile (`Widths.compiled`): an RMSNorm keeps its input as it is and its rstd (Inductor recomputes
the fp32 upcast and the normalised input that eager F.rms_norm keeps), a compiled loss keeps the logits
(head_bytes), and COMPILE_FACTOR scales the blocks of the families whose partitioning saves less still.
Measured with the same hooks on CPU Inductor (4-layer models): gpt and moe within 1% (fp32) and 3% (bf16)
of the compiled formulas, speedrun within 3%, t5 6% below (fp32) to 13% above (bf16, where the CPU's
attention runs the math path in fp32). Against the H100 peaks in benchmarks/records/ (compiled recipes) the
whole plan is 0-7% above the measurement (tests/test_plan.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from trainbox.plan.count import ParamCount

COMPILE_FACTOR = {"t5": 0.85, "speedrun": 0.96}   # blocks' activations compiled / eager (1.0 where absent)
LOSS_CHUNK = 8192                                  # QuACK's linear cross-entropy: rows per chunk (fused_ce.py)


@dataclass(frozen=True)
class Kernels:
    """What runs, as far as memory goes: a KernelPlan seen from the plan."""
    attention: str          # flash (FlashAttention-4), flex, sdpa, hf
    fused_loss: str         # quack, triton, torch, off
    fused_mlp: str          # quack, torch, unfused, off
    fp8: str                # fp8, bf16, off

    @property
    def attn_saved_by_selective(self) -> bool:
        return self.attention in ("sdpa", "flex", "hf")


@dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch's activations on one GPU."""
    blocks: int           # saved by every block at the end of the forward
    other: int            # saved outside the blocks: embeddings, final norm, head and loss
    weight_copies: int    # 16-bit (or FP8) copies of the weights the matmuls keep for the backward
    transient: int        # on top at the peak: the head's work buffers, one block recomputed, its gradients

    @property
    def saved(self) -> int:
        return self.blocks + self.other + self.weight_copies

    @property
    def peak(self) -> int:
        return self.saved + self.transient

    def as_dict(self) -> dict:
        return {**asdict(self), "saved": self.saved, "peak": self.peak}


class Block:
    """Per-token bytes of one block, by mode (see the module docstring for the tags)."""

    def __init__(self, attn_saved: bool, compiled: bool = False):
        self.none = self.selective = self.inputs = 0.0
        self.attn_saved, self.compiled = attn_saved, compiled

    def inp(self, n: float) -> None:
        self.none += n
        self.selective += n
        self.inputs += n

    def keep(self, n: float) -> None:
        self.none += n

    def mm(self, n: float, keep: bool = True, residual: bool = False) -> None:
        self.none += n if keep else 0
        self.selective += 0 if residual and self.compiled else n

    def attn(self, n: float) -> None:
        self.none += n
        self.selective += n if self.attn_saved else 0

    def bytes(self, mode: str) -> float:
        return {"none": self.none, "selective": self.selective, "full": self.inputs}[mode]


@dataclass(frozen=True)
class Widths:
    a: int              # matmul operands
    r: int              # residual stream
    cuda: bool
    compiled: bool = False
    expert_parallel: int = 1   # ranks the experts are split over

    def casts(self, n: int) -> int:
        """Copies autocast makes of a norm's output that n matmuls read: one each where the norm's output is
        fp32 and the matmuls 16-bit (autocast caches casts of weights only), else the output itself."""
        return n if self.a != 4 and (self.cuda or self.r == 4) else 1

    def rms(self, d: int, weighted: bool, r_in: int | None = None) -> float:
        """What an RMSNorm keeps: F.rms_norm computes in fp32 and keeps its input upcast (the input itself
        when it is fp32), the rstd, and with a weight the normalised fp32 input; compiled, the input as it is
        and the rstd (Inductor recomputes the rest)."""
        if self.compiled:
            return (r_in or self.r) * d + 4
        return 4 * d + 4 + (4 * d if weighted else 0)


def gpt_attention(b: Block, d: int, heads: int, w: Widths) -> None:
    """LayerNorm -> c_attn -> causal attention -> c_proj (gpt.CausalSelfAttention)."""
    a = w.a
    b.inp(w.r * d)                 # ln_1 input (the block's input)
    b.keep(8)                      # its mean and rstd
    b.keep(a * d)                  # ln_1 output, cast for c_attn
    b.mm(3 * a * d)                # qkv, kept by the attention (q, k, v are views of it)
    b.attn(a * d + 4 * heads)      # attention output (c_proj's input) and log-sum-exp
    b.mm(a * d, keep=False, residual=True)   # c_proj output


def gpt_block(d: int, heads: int, w: Widths, kern: Kernels, bias: bool, moe=None) -> Block:
    b = Block(kern.attn_saved_by_selective, w.compiled)
    gpt_attention(b, d, heads, w)
    a = w.a
    b.keep(w.r * d + 8)            # ln_2 input, mean, rstd
    if moe is not None:
        moe_ffn(b, d, moe, w, kern, bias)
        return b
    b.keep(a * d)                  # ln_2 output (c_fc's input)
    fused = kern.fused_mlp in ("quack", "torch") and not bias   # one custom op: selective recomputes it
    b.mm(4 * a * d) if not fused else b.keep(4 * a * d)         # h = c_fc(x), kept by the GELU
    b.keep(4 * a * d)              # GELU(h), c_proj's input
    if not fused:
        b.mm(a * d, keep=False, residual=True)   # c_proj output
    return b


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


def decoder_block(shapes, w: Widths, kern: Kernels, frozen: bool = False, lora_dropout: bool = False) -> Block:
    """A Llama-style block: RMSNorm, q/k/v (grouped-query), RoPE, attention, o; RMSNorm, SwiGLU (or a plain
    two-matmul MLP). `frozen`: the projections' weights are frozen (LoRA), so they keep no inputs; the adapters
    keep theirs (dropped out copies under lora.dropout) and their rank-r products."""
    a, d = w.a, shapes.d
    b = Block(kern.attn_saved_by_selective, w.compiled)
    b.inp(w.r * d)
    b.keep(w.rms(d, True) - w.r * d)
    if not frozen:
        b.keep(w.casts(3) * a * d)             # the norm's output, q's, k's and v's input
    b.mm(a * (shapes.q + 2 * shapes.kv), keep=False)   # q, k, v (RoPE makes new q and k)
    b.keep(a * (shapes.q + 2 * shapes.kv))     # the attention's inputs: rotated q and k, v
    b.attn(a * shapes.q + 4 * shapes.heads)    # its output and log-sum-exp
    if not frozen:
        b.keep(a * shapes.q)                   # the output made contiguous: o's input
    b.mm(a * d, keep=False, residual=True)
    b.keep(w.rms(d, True))
    if not frozen:
        b.keep(w.casts(2 if shapes.gated else 1) * a * d)
    if shapes.gated:
        b.mm(2 * a * shapes.ffn)               # gate (kept by SiLU) and up (kept by the product)
        b.keep(a * shapes.ffn)                 # SiLU(gate)
    else:
        b.mm(a * shapes.ffn)
    if not frozen:
        b.keep(a * shapes.ffn)                 # the product (or the activation): down's input
    b.mm(a * d, keep=False, residual=True)
    if shapes.lora_in:   # dropout's output and its mask (bool on a GPU, the input's dtype on a CPU)
        mask = (1 if w.cuda else a) if lora_dropout else 0
        b.keep(shapes.lora_in * ((a if lora_dropout or not frozen else 0) + mask) + shapes.lora_r * a)
    return b


def head_bytes(tokens: int, d: int, vocab: int, w: Widths, kern: Kernels, softcap: bool, fp8: bool,
               compiled: bool) -> tuple[int, int]:
    """(saved, transient) bytes of the final norm's output, the head and the loss over `tokens` targets."""
    a = w.a
    # QuACK's linear cross-entropy takes the loss where it applies: no soft cap, no FP8 head (fused_ce.py); dx and
    # dW computed in the forward, in fp32, one chunk of logits at a time. Elsewhere the Triton kernel runs.
    if kern.fused_loss == "quack" and not softcap and not fp8:
        return tokens * (4 * d) + vocab * d * 4, min(tokens, LOSS_CHUNK) * vocab * 2
    if kern.fused_loss in ("quack", "triton", "torch"):
        if fp8:                      # the e5m2 gradient kept; bf16 logits while it is written
            return tokens * (vocab + d), tokens * vocab * 2
        # the logits, overwritten by their gradient, and the head's input; the torch path's work copies
        extra = 2 * tokens * vocab * 4 if kern.fused_loss == "torch" else 0
        return tokens * (vocab * a + a * d), extra
    head_input = tokens * a * d     # the final norm's output (cast for the head under autocast)
    if compiled:   # Inductor fuses the cap, log-softmax and loss: the logits kept, their gradient written once
        return tokens * (vocab * a + 4) + head_input, tokens * vocab * (a + 1)
    # plain: fp32 log-probabilities kept (the soft cap keeps its sigmoid too); the backward's fp32 gradients
    saved = tokens * (vocab * 4 * (2 if softcap else 1)) + head_input
    return saved, tokens * vocab * (8 + (2 if a != 4 else 0))


def family_activations(cfg, counts: ParamCount, vocab: int, micro: int, mode: str, w: Widths, kern: Kernels,
                       autocast_copies: bool = True) -> Activations:
    """One micro-batch of `micro` sequences of data.seq_len tokens, on one GPU. `autocast_copies`: the weights
    are fp32 and autocast casts them (else they are used as they are: fp32 runs, FSDP's bf16 parameters)."""
    m, T = cfg.model, cfg.data.seq_len
    B, fam = micro, m.family
    N = B * T
    d = m.n_embd
    head_tokens, softcap, fp8_head = N, False, m.fp8_head and kern.fp8 == "fp8"
    fp8_mlp = m.fp8_mlp if kern.fp8 == "fp8" else "none"
    if fam in ("gpt", "moe"):
        every = m.moe.every if fam == "moe" else 0
        per_layer = [gpt_block(d, m.n_head, w, kern, m.bias, m.moe if fam == "moe" and i % every == 0 else None)
                     for i in range(m.n_layer)]
        blocks = N * sum(b.bytes(mode) for b in per_layer)
        recompute = N * max(b.none for b in per_layer)
        other = N * (8 + w.r * d + 8) + 8 * T          # token ids, positions; the final norm's input and stats
    elif fam == "speedrun":
        hd = m.n_head * (m.head_dim or d // m.n_head)
        pattern = m.window_pattern or "L" * m.n_layer
        per_layer = [speedrun_block(d, m.n_head, hd, T, c, w, kern, fp8_mlp) for c in pattern]
        blocks = N * sum(b.bytes(mode) for b in per_layer)
        recompute = N * max(b.none for b in per_layer)
        n_ve = min(3, max(1, m.n_layer // 2))
        # ids; the embedding's norm (fp32); value embeddings; the first decoder block's skip; the final norm
        other = N * (8 + w.rms(d, False, 4) + n_ve * w.a * hd + w.r * d + w.rms(d, False))
        if mode == "none" and not (autocast_copies and w.a != 4):   # q, k, v weights concatenated per call
            other += 3 * hd * d * w.a * sum(c != "-" for c in pattern)
        softcap = m.logit_softcap > 0
    elif fam == "t5":
        from trainbox.data.spans import span_lengths
        from trainbox.model.t5 import t5_d_ff, t5_d_kv, t5_decoder_layers
        _, dec = span_lengths(T, m.t5.noise_density, m.t5.mean_noise_span_length)
        inner = m.n_head * t5_d_kv(m)
        enc, dec_b, cross = t5_blocks(d, m.n_head, inner, t5_d_ff(m), T, dec, w, kern)
        n_dec = t5_decoder_layers(m)
        cross_mode = cross.bytes(mode) if mode != "full" else 0
        blocks = B * (m.n_layer * T * enc.bytes(mode) + n_dec * (dec * dec_b.bytes(mode) + T * cross_mode))
        recompute = B * max(T * enc.none, dec * dec_b.none + T * cross.none)
        if mode == "none":   # each layer's copy of the position bias in q's dtype (on a GPU)
            bias = w.a * m.n_head * (T * T * m.n_layer + dec * dec * n_dec) if w.cuda else 0
        else:                # the blocks' inputs: each stack's fp32 bias, and the encoder output
            bias = 4 * m.n_head * (T * T + dec * dec) + (B * T * 4 * d if w.a != 4 else 0)
        # ids of both stacks, the targets; bucket ids; the encoder's final norm and, in fp32, its output (the
        # memory every decoder block reads); the decoder's final norm
        other = (B * (T + 2 * dec) * 8 + 8 * (T * T + dec * dec) + B * T * (w.rms(d, True) + (4 * d if w.a == 4 else 0))
                 + B * dec * w.rms(d, True) + bias)
        head_tokens = B * dec
    else:   # llama and Hugging Face causal LMs: the decoder block from the model's own widths
        s = counts.shapes
        blk = decoder_block(s, w, kern, frozen=counts.frozen > 0, lora_dropout=cfg.lora.dropout > 0)
        blocks = N * counts.n_blocks * blk.bytes(mode)
        recompute = N * blk.none
        d = s.d
        other = N * (8 + w.rms(d, True))
    if w.compiled:
        blocks *= COMPILE_FACTOR.get(fam, 1.0)
    head_saved, head_transient = head_bytes(head_tokens, d, vocab, w, kern, softcap, fp8_head, w.compiled)
    # one block's backward: the gradient of its largest intermediates, and under recomputation the block itself
    widest = 4 * d * (m.moe.top_k if fam == "moe" else 1)
    workspace = 2 * w.a * head_tokens * widest + (recompute if mode != "none" else 0)
    return Activations(blocks=int(blocks), other=int(other + head_saved), weight_copies=0,
                       transient=int(max(head_transient, workspace)))


def weight_copy_bytes(counts: ParamCount, w: Widths, mode: str) -> int:
    """16-bit copies of the matmul weights that autocast makes and the backward keeps: 2 bytes per weight in
    matrices (not embedding tables: a lookup casts nothing), none when the weights are already 16-bit (FSDP)
    or in fp32 runs. Activation checkpointing recomputes the casts inside the blocks."""
    if w.a == 4 or counts.matmul == 0:
        return 0
    return int((counts.matmul if mode == "none" else counts.matmul - counts.blocks_matmul) * w.a)


