"""Activation memory of one micro-batch, the pieces every family's formula (model/<family>/memory.py) is written
with: what autograd keeps for the backward, from the shapes.

Each family's block is written out as the tensors its forward saves, per token, in the order the code makes
them (the comments name the op that saves each). `Block` tags each one with when it is kept:

    inp   the block's input: kept in every mode (train.activation_checkpointing=full keeps only these)
    keep  kept without recomputation only (norm inputs and outputs, activation-function outputs, indices)
    mm    a matmul output: kept by mode none where the next op saves it (keep=True); by selective always in
          eager mode (its policy caches the outputs of matmuls: train/recompute.py) and, compiled, unless it only
          feeds a residual sum (residual=True): the partitioner saves a must-save output only where the backward
          reads it (the compiled Llama peaks in benchmarks/records/ agree)
    hidden=True (on keep and mm) the experts' hidden layer (model/moe/memory.py): kept by none, not by experts
          (train.activation_checkpointing=experts keeps everything else as none does)
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
(head_bytes), and a family's COMPILE_FACTOR (its memory module's) scales the blocks where the partitioning
saves less still.
Measured with the same hooks on CPU Inductor (4-layer models): gpt and moe within 1% (fp32) and 3% (bf16)
of the compiled formulas, the Llama-style block exactly (its norm's output cast once, SiLU(gate) made again in the
backward; tests/test_plan.py), speedrun within 3%, t5 6% below (fp32) to 13% above (bf16, where the CPU's
attention runs the math path in fp32). Against the H100 peaks in benchmarks/records/ (compiled recipes) the
whole plan is 0-7% above the measurement (tests/test_plan.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

LOSS_CHUNK = 8192                                  # QuACK's linear cross-entropy: rows per chunk (fused_ce.py)
CHUNK_BYTES = 2**28                                # the fused loss's logits per chunk (fused_ce.CHUNK_BYTES)
WHOLE_SHARE = 4                                    # its gradient kept whole up to 1/4 of the memory (fused_ce)


@dataclass(frozen=True)
class Forward:
    """What one micro-batch of a family's forward keeps, before the head (a family's memory.forward returns it)."""
    blocks: float          # saved by every block at the end of the forward
    recompute: float       # one block's activations without checkpointing (recomputed in the backward)
    other: float           # saved outside the blocks and the head: ids, positions, the final norm
    head_tokens: int       # tokens that reach the head
    width: int             # the head's input width
    softcap: bool = False  # the logits are soft-capped (the plain loss keeps the cap's sigmoid too)
    widest: int = 0        # the widest intermediate per head token that a block's backward writes (default 4 d)


@dataclass(frozen=True)
class Kernels:
    """What runs, as far as memory goes: a KernelChoice seen from the plan."""
    attention: str          # flash (FlashAttention-4), flex, triton (t5's biased attention), sdpa, hf
    fused_loss: str         # quack, triton, torch, off
    fused_mlp: str          # quack, torch, unfused, off
    fp8: str                # fp8, bf16, off

    @property
    def attn_saved_by_selective(self) -> bool:
        return self.attention in ("sdpa", "flex", "triton", "hf")


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
        self.none = self.selective = self.inputs = self.hidden = 0.0
        self.attn_saved, self.compiled = attn_saved, compiled

    def inp(self, n: float) -> None:
        self.none += n
        self.selective += n
        self.inputs += n

    def keep(self, n: float, hidden: bool = False) -> None:
        self.none += n
        self.hidden += n if hidden else 0

    def mm(self, n: float, keep: bool = True, residual: bool = False, hidden: bool = False) -> None:
        self.none += n if keep else 0
        self.hidden += n if keep and hidden else 0
        self.selective += 0 if residual and self.compiled else n

    def attn(self, n: float) -> None:
        self.none += n
        self.selective += n if self.attn_saved else 0

    def bytes(self, mode: str) -> float:
        return {"none": self.none, "experts": self.none - self.hidden, "selective": self.selective,
                "full": self.inputs}[mode]


@dataclass(frozen=True)
class Widths:
    a: int              # matmul operands
    r: int              # residual stream
    cuda: bool
    compiled: bool = False
    expert_parallel: int = 1   # ranks the experts are split over
    autocast: bool = True      # the weights are fp32 and autocast casts them (not: fp32 runs, FSDP's bf16 weights)
    head_limit: int = 0        # bytes of (rows x vocab) gradient the fused loss keeps whole (fused_ce.whole_limit)

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


def decoder_block(shapes, w: Widths, kern: Kernels, frozen: bool = False, lora_dropout: bool = False) -> Block:
    """A Llama-style block: RMSNorm, q/k/v (grouped-query), RoPE, attention, o; RMSNorm, SwiGLU (or a plain
    two-matmul MLP). `frozen`: the projections' weights are frozen (LoRA), so they keep no inputs; the adapters
    keep theirs (dropped out copies under lora.dropout) and their rank-r products."""
    a, d = w.a, shapes.d
    b = Block(kern.attn_saved_by_selective, w.compiled)
    b.inp(w.r * d)
    b.keep(w.rms(d, True) - w.r * d)
    def norm_out(n: int) -> int:             # compiled: the norm's output cast once, read by every matmul
        return 1 if w.compiled else w.casts(n)
    if not frozen:
        b.keep(norm_out(3) * a * d)            # the norm's output, q's, k's and v's input
    b.mm(a * (shapes.q + 2 * shapes.kv), keep=False)   # q, k, v (RoPE makes new q and k)
    if shapes.qk_norm:   # Qwen3: q and k normalized a head at a time, each head a row of the norm
        head = shapes.q // shapes.heads
        b.keep(w.rms(head, True, a) * (shapes.q + shapes.kv) // head)
    b.keep(a * (shapes.q + 2 * shapes.kv))     # the attention's inputs: rotated q and k, v
    b.attn(a * shapes.q + 4 * shapes.heads)    # its output and log-sum-exp
    if not frozen:
        b.keep(a * shapes.q)                   # the output made contiguous: o's input
    b.mm(a * d, keep=False, residual=True)
    b.keep(w.rms(d, True))
    if not frozen:
        b.keep(norm_out(2 if shapes.gated else 1) * a * d)
    if shapes.gated:
        b.mm(2 * a * shapes.ffn)               # gate (kept by SiLU) and up (kept by the product)
        if not w.compiled:                     # Inductor makes SiLU(gate) again from gate in the backward
            b.keep(a * shapes.ffn)             # SiLU(gate)
    else:
        b.mm(a * shapes.ffn)
    if not frozen:
        b.keep(a * shapes.ffn)                 # the product (or the activation): down's input
    b.mm(a * d, keep=False, residual=True)
    if shapes.lora_in:   # dropout's output and its mask (bool on a GPU, the input's dtype on a CPU)
        mask = (1 if w.cuda else a) if lora_dropout else 0
        b.keep(shapes.lora_in * ((a if lora_dropout or not frozen else 0) + mask) + shapes.lora_r * a)
    return b


def chunk_rows(vocab: int, elem: int) -> int:
    """The fused loss's rows per chunk (fused_ce.chunk_rows)."""
    return max(128, CHUNK_BYTES // max(1, vocab * elem) // 128 * 128)


def head_bytes(tokens: int, d: int, vocab: int, w: Widths, kern: Kernels, softcap: bool, fp8: bool,
               compiled: bool, frozen: bool = False) -> tuple[int, int]:
    """(saved, transient) bytes of the final norm's output, the head and the loss over `tokens` targets (every
    token: a loss mask's prompts and padding never reach the head, so this is the most they take). `frozen`: the
    head's weight does not train (LoRA)."""
    a = w.a
    # QuACK's linear cross-entropy takes the loss where it applies: no soft cap, no FP8 head (fused_ce.py); dx and
    # dW computed in the forward, in fp32, one chunk of logits at a time. Elsewhere the Triton kernel runs.
    if kern.fused_loss == "quack" and not softcap and not fp8:
        return tokens * (4 * d) + vocab * d * 4, min(tokens, LOSS_CHUNK) * vocab * 2
    if kern.fused_loss in ("quack", "triton", "torch"):
        if fp8:                      # the e5m2 gradient kept; bf16 logits while it is written
            return tokens * (vocab + d), tokens * vocab * 2
        # the logits, overwritten by their gradient, and the head's input; the torch path's work copies. A frozen
        # weight: dx made in the forward a chunk at a time; past head_limit: the head's input kept, each chunk's
        # logits and their gradient made again in the backward beside an fp32 dW (fused_ce._HeadCE)
        extra = 2 * tokens * vocab * 4 if kern.fused_loss == "torch" else 0
        chunk = min(tokens, chunk_rows(vocab, a)) * vocab * a * (1 + (4 if kern.fused_loss == "torch" else 0))
        if frozen:
            return tokens * a * d, chunk
        if w.head_limit and tokens * vocab * a > w.head_limit:
            return tokens * a * d, chunk + vocab * d * 4 + tokens * d * 4
        return tokens * (vocab * a + a * d), extra
    head_input = tokens * a * d     # the final norm's output (cast for the head under autocast)
    if compiled:   # Inductor fuses the cap, log-softmax and loss: the logits kept, their gradient written once
        return tokens * (vocab * a + 4) + head_input, tokens * vocab * (a + 1)
    # plain: fp32 log-probabilities kept (the soft cap keeps its sigmoid too); the backward's fp32 gradients
    saved = tokens * (vocab * 4 * (2 if softcap else 1)) + head_input
    return saved, tokens * vocab * (8 + (2 if a != 4 else 0))
