"""Output head and (soft-capped) cross-entropy as one autograd function (`model.fused_loss`).

    loss_i = logsumexp_j s_ij - s_i,t(i),   s = x W^T                      (no cap)
                                            s = 2 cap sigmoid(2 x W^T / cap)  (cap: cap tanh(z / cap) + cap,
                                                                               the same softmax)

The unfused head keeps the (tokens x vocab) logits for the backward, and the backward reads them again
to recompute the softmax (and the cap) before it writes their gradient: for a 64K-token row and GPT-2's
vocabulary that is a 6.6 GB bf16 tensor read twice and written once, plus the transcendental work twice.
Here the forward computes the gradient G = dloss_i/dlogits (upstream gradient 1) right after the loss,
in the same kernel, while each row is still in cache, and written over the logits, which are dead (the
same size). The backward has no elementwise pass over the big tensor at all: the upstream gradient g_i
(one number per token) is applied to the small operands,

    dx = diag(g) (G W),      dW = G^T (diag(g) x),

so a per-token loss weighting (loss masks, the loop's 1/tokens) costs nothing.

On CUDA the kernel is Triton (one program per row: an online logsumexp pass, then a pass that writes G);
elsewhere, and where Triton is missing, the same arithmetic runs as torch ops. Both are registered as the
custom op `trainbox::head_ce_`, which writes G over the logits (they are dead once read), so
torch.compile keeps the model in one graph and the head holds one (tokens x vocab) tensor, not two. Rows whose target is
-100 (masked) get loss 0 and a zero gradient.

On in the gpt2-125m, moe-gpt2-125m and speedrun-124m recipes.

A summed loss (the training loop's) on an H100/H200 with QuACK installed goes through QuACK's scaled-exp
linear cross-entropy instead (`_use_quack_lce`): per chunk of LCE_CHUNK rows, the logits GEMM's epilogue
writes exp(z - its tile's max) in bf16 with per-tile sums and the target logit, and the dx and dW GEMMs
form the softmax gradient in their operand loads; the forward returns the loss with dx and dW (fp32)
computed, the backward scales them. No pass of a loss kernel over the logits, and no (tokens x vocab) tensor
beyond one chunk's (docs/performance.md has the step times with each kernel). It keeps exp(z - tile max), the
softmax's scale and their product in bf16, where bf16 logits round once, so its dx and dW are further from fp64
than torch's bf16 logits with F.cross_entropy and its loss is closer (tests/test_fused_ce.py compares the three).
The gpt2-125m recipe with it matches nanoGPT's validation loss after 200 steps (docs/performance.md, quality
parity).

With model.fp8_head all three of the head's matmuls run in FP8, as modded-nanogpt's FP8 head does: the
logits from e4m3 copies of x and W; the kernel writes G in e5m2 at a fixed scale (head_ce_fp8: G is
bounded by 1, so nothing needs measuring), to a new tensor of half the logits' size; dx = G W and
dW = G^T x take that e5m2 G, the latter through one transposed copy of it made in the backward.
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from trainbox.kernels.fp8 import (
    E4M3,
    E5M2,
    fp8_backward,
    fp8_forward,
    fp8_shapes_ok,
    quantize,
)
from trainbox.kernels.ops import autocast_dtype, constant_when_traced, eager, inductor_fallback

IGNORE = -100
GRAD_SCALE = 2.0 ** 15  # FP8 head: dloss/dlogits (in [-1, 1]) is stored in e5m2 times this (head_ce_fp8)

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:
    @triton.jit
    def _capped(z, cap, HAS_CAP: tl.constexpr):
        if HAS_CAP:
            return 2.0 * cap * tl.sigmoid(z * (2.0 / cap))
        return z

    @triton.jit
    def _head_ce_kernel(Z, stride_z, T, LOSS, G, stride_g, cap, V: tl.constexpr,
                        HAS_CAP: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr,
                        FP8_OUT: tl.constexpr = False, GRAD_SCALE: tl.constexpr = 1.0):
        row = tl.program_id(0).to(tl.int64)
        z_row = Z + row * stride_z
        if IN_PLACE:  # G is Z: the gradient goes through the same pointer, so no load can pass a store
            g_row = z_row
        else:
            g_row = G + row * stride_g
        target = tl.load(T + row)
        cols = tl.arange(0, BLOCK)
        # running max per lane; finite, so that a lane that never sees a column (V < BLOCK) stays 0 * exp(0)
        # instead of 0 * exp(-inf + inf) = NaN
        m = tl.full([BLOCK], -1e30, tl.float32)
        d = tl.zeros([BLOCK], tl.float32)                  # running sum of exp(s - m) per lane
        for start in range(0, V, BLOCK):
            mask = start + cols < V
            s = _capped(tl.load(z_row + start + cols, mask=mask, other=0.0).to(tl.float32), cap, HAS_CAP)
            s = tl.where(mask, s, float("-inf"))
            m_new = tl.maximum(m, s)
            d = d * tl.exp(m - m_new) + tl.where(mask, tl.exp(s - m_new), 0.0)
            m = m_new
        m_all = tl.max(m, axis=0)
        lse = m_all + tl.log(tl.sum(d * tl.exp(m - m_all), axis=0))
        ignored = target == -100
        t = tl.where(ignored, 0, target)
        s_t = _capped(tl.load(z_row + t).to(tl.float32), cap, HAS_CAP)
        tl.store(LOSS + row, tl.where(ignored, 0.0, lse - s_t))
        for start in range(0, V, BLOCK):
            idx = start + cols
            mask = idx < V
            s = _capped(tl.load(z_row + idx, mask=mask, other=0.0).to(tl.float32), cap, HAS_CAP)
            g = tl.exp(s - lse) - tl.where(idx == t, 1.0, 0.0)
            if HAS_CAP:
                sig = s * (0.5 / cap)                     # s = 2 cap sigmoid(u): ds/dz = 4 sig (1 - sig)
                g = g * 4.0 * sig * (1.0 - sig)
            g = tl.where(ignored, 0.0, g)
            if FP8_OUT:  # e5m2 at a fixed scale: |g| <= 1
                tl.store(g_row + idx, (g * GRAD_SCALE).to(G.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
            else:
                tl.store(g_row + idx, g.to(G.dtype.element_ty), mask=mask)


def _reference(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, in fp32 or wider; dloss/dlogits in the logits' dtype) with torch ops: the CPU path and
    the oracle."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    s = 2 * cap * torch.sigmoid(z * (2 / cap)) if cap else z
    lse = torch.logsumexp(s, dim=-1)
    ignored = targets == IGNORE
    t = targets.masked_fill(ignored, 0)
    loss = (lse - s.gather(1, t[:, None])[:, 0]).masked_fill(ignored, 0.0)
    g = torch.exp(s - lse[:, None])
    g[torch.arange(len(t), device=g.device), t] -= 1
    if cap:
        sig = s * (0.5 / cap)
        g = g * (4 * sig * (1 - sig))
    return loss, g.masked_fill(ignored[:, None], 0.0).to(logits.dtype)


@torch.library.custom_op("trainbox::head_ce_", mutates_args=("logits",))
def head_ce_(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> torch.Tensor:
    """logits (M, V) contiguous, targets (M,) -> loss (M,) in fp32 (or wider); overwrites the logits with
    the loss's gradient w.r.t. them, which is all the backward needs, so the head never holds two (M, V)
    tensors at once. Each row is read (twice) before it is written, by the same program."""
    if logits.is_cuda and triton is not None:
        M, V = logits.shape
        loss = torch.empty(M, dtype=torch.float32, device=logits.device)
        _head_ce_kernel[(M,)](logits, logits.stride(0), targets.contiguous(), loss, logits, logits.stride(0),
                              float(cap), V=V, HAS_CAP=bool(cap), IN_PLACE=True, BLOCK=4096, num_warps=16)
        return loss
    loss, grad = _reference(logits, targets, cap)
    logits.copy_(grad)
    return loss


@head_ce_.register_fake
def _(logits, targets, cap):
    return logits.new_empty(logits.size(0), dtype=torch.promote_types(logits.dtype, torch.float32))


@torch.library.custom_op("trainbox::head_ce_fp8", mutates_args=())
def head_ce_fp8(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (M, V) contiguous, targets (M,) -> (loss (M,) fp32, GRAD_SCALE * dloss/dlogits in float8_e5m2).

    The gradient of a (soft-capped) cross-entropy w.r.t. the logits is softmax - onehot times the cap's
    derivative 4 sig (1 - sig) <= 1, so every entry lies in [-1, 1]: a fixed scale of 2^15 puts the largest
    possible one below e5m2's largest finite value (57,344), with nothing to measure first (a dynamic scale
    would cost one more pass over the 64K x 50K tensor), and flushes to zero only entries below 2^-31."""
    M, V = logits.shape
    grad = torch.empty(M, V, dtype=E5M2, device=logits.device)
    if logits.is_cuda and triton is not None:
        loss = torch.empty(M, dtype=torch.float32, device=logits.device)
        _head_ce_kernel[(M,)](logits, logits.stride(0), targets.contiguous(), loss, grad, grad.stride(0), float(cap),
                              V=V, HAS_CAP=bool(cap), IN_PLACE=False, BLOCK=4096, FP8_OUT=True,
                              GRAD_SCALE=GRAD_SCALE, num_warps=16)
        return loss, grad
    loss, g = _reference(logits, targets, cap)
    grad.copy_((g.float() * GRAD_SCALE).to(E5M2))
    return loss.float(), grad


@head_ce_fp8.register_fake
def _(logits, targets, cap):
    M, V = logits.shape
    return logits.new_empty(M, dtype=torch.float32), logits.new_empty(M, V, dtype=E5M2)


CHUNK_BYTES = 2**28  # the logits of one chunk of rows, where the head does not keep all of them: 256 MiB
WHOLE_SHARE = 4      # the (rows x vocab) gradient is kept whole up to 1/WHOLE_SHARE of the device's memory


@functools.cache
def _device_bytes(device: torch.device) -> int:
    """The memory this process may use on `device`: the GPU's (times the allocator's per-process fraction), or the
    machine's RAM."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory
                   * torch.cuda.get_per_process_memory_fraction(index))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@constant_when_traced   # read once when a graph is traced, a constant in it
def whole_limit(device: torch.device) -> int:
    """Bytes of (rows x vocab) gradient the head keeps whole for its backward; above, it recomputes it by chunks."""
    return _device_bytes(device) // WHOLE_SHARE


def chunk_rows(vocab: int, elem: int) -> int:
    """Rows a chunk holds: CHUNK_BYTES of logits of `elem` bytes, a multiple of 128 rows (at least 128): 768 of
    Qwen2's 151,936 ids in bf16, 2,560 of GPT-2's 50,304. Small enough that a frozen head's peak is one chunk, large
    enough that each chunk's matmuls stay long."""
    return max(128, CHUNK_BYTES // max(1, vocab * elem) // 128 * 128)


def _chunks(rows: int, w: torch.Tensor):
    n = chunk_rows(w.size(0), w.element_size())
    return ((s, min(s + n, rows)) for s in range(0, rows, n))


class _HeadCE(torch.autograd.Function):
    """Four ways, chosen from the shapes and the gradients asked for (`need_dx`, `need_dw`):

    whole      the logits of every row at once, overwritten by their gradient G and kept for the backward (one
               (rows x vocab) tensor; three matmuls)
    dx         the weight is frozen (LoRA): per chunk of rows (chunk_rows), the logits, G, and dx = G W before the
               next chunk, so only a chunk's logits exist at a time and the backward scales dx (two matmuls)
    recompute  the weight trains and G would pass `limit` bytes (long sequences): the forward keeps only the
               loss, the backward makes each chunk's logits and G again (four matmuls, a chunk's logits)
    loss       no gradient at all (evaluation, a reference's log-probabilities): the loss a chunk at a time
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float, dtype: torch.dtype,
                fp8: bool, need_dx: bool = True, need_dw: bool = True, limit: int | None = None, of: int = 0):
        ctx.dtypes, ctx.fp8, ctx.cap = (x.dtype, w.dtype), fp8, cap
        xc = x.to(dtype)
        if fp8:  # all three matmuls in FP8: the logits from e4m3 operands, both gradients from the e5m2 G
            logits, _, _, w8, ws = fp8_forward(xc, w)
            loss, grad8 = head_ce_fp8(logits.to(dtype), targets, cap)
            ctx.save_for_backward(grad8, xc, w8, ws)
            return loss
        wc = w.to(dtype)
        rows = xc.size(0)
        # `of`: these rows are the trained ones of that many, and the choice is the one all of them would make
        whole = need_dw and (limit is None or (of or rows) * w.size(0) * wc.element_size() <= limit)
        ctx.mode = "whole" if whole else "recompute" if need_dw else "dx" if need_dx else "loss"
        if whole:
            grad = xc @ wc.t()   # the logits, until head_ce_ overwrites them
            loss = head_ce_(grad, targets, cap)
            ctx.save_for_backward(grad, xc, wc)
            return loss
        loss = xc.new_empty(rows, dtype=torch.promote_types(xc.dtype, torch.float32))
        dx = xc.new_empty(rows, xc.size(1)) if ctx.mode == "dx" else None
        for s, e in _chunks(rows, wc):
            grad = xc[s:e] @ wc.t()
            loss[s:e] = head_ce_(grad, targets[s:e], cap)
            if dx is not None:
                dx[s:e] = grad @ wc
        if ctx.mode != "loss":
            ctx.save_for_backward(*((dx,) if dx is not None else (xc, wc, targets)))
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        none = (None,) * 8
        if ctx.fp8:
            grad8, xc, w8, ws = ctx.saved_tensors
            scale = g.float()[:, None]
            inv = torch.full((), 1.0 / GRAD_SCALE, dtype=torch.float32, device=g.device)
            # the per-row upstream gradient: folded into x for dW, applied to dx after its matmul
            dx, dw = fp8_backward(grad8, inv, *quantize(xc.float() * scale, E4M3), w8, ws)
            return (dx.float() * scale).to(ctx.dtypes[0]), dw.to(ctx.dtypes[1]), *none
        if ctx.mode == "dx":
            dx, = ctx.saved_tensors
            acc = torch.promote_types(dx.dtype, torch.float32)
            return (dx.to(acc) * g.to(acc)[:, None]).to(ctx.dtypes[0]), None, *none
        if ctx.mode == "whole":
            grad, xc, wc = ctx.saved_tensors
            acc = torch.promote_types(grad.dtype, torch.float32)
            scale = g.to(acc)[:, None]
            dx = (grad @ wc).to(acc) * scale
            dw = grad.t() @ (xc.to(acc) * scale).to(xc.dtype)
            return dx.to(ctx.dtypes[0]), dw.to(ctx.dtypes[1]), *none
        xc, wc, targets = ctx.saved_tensors
        acc = torch.promote_types(xc.dtype, torch.float32)
        dx = xc.new_empty(xc.shape, dtype=ctx.dtypes[0])
        dw = torch.zeros(wc.shape, dtype=acc, device=wc.device)
        for s, e in _chunks(xc.size(0), wc):
            grad = xc[s:e] @ wc.t()
            head_ce_(grad, targets[s:e], ctx.cap)
            scale = g[s:e].to(acc)[:, None]
            dx[s:e] = ((grad @ wc).to(acc) * scale).to(dx.dtype)
            dw += grad.t() @ (xc[s:e].to(acc) * scale).to(xc.dtype)
        return dx, dw.to(ctx.dtypes[1]), *none


LCE_CHUNK = 8192  # rows per chunk of QuACK's linear cross-entropy (its logits buffer: LCE_CHUNK x V bf16)


_QUACK_LCE = None  # QuACK's (scaled_exp_linear_cross_entropy, scaled_exp_lce_supported) once enabled


@functools.cache
def _load_quack_lce():
    """QuACK's scaled-exp linear cross-entropy, or None where it is missing. Its forward is one custom op,
    which gets an explicit Inductor fallback: an implicit one logs the IR of its inputs, the end of the
    model's chain of fused ops, as text that doubles per layer (kernels/ops.py)."""
    try:
        from quack.linear_cross_entropy import (
            scaled_exp_lce_supported,
            scaled_exp_linear_cross_entropy,
        )  # optional: quack
    except Exception:  # noqa: BLE001 - a broken CUDA/CuTe install counts as missing
        return None
    inductor_fallback(torch.ops.quack.lce_scaled_exp_fwd.default)
    return scaled_exp_linear_cross_entropy, scaled_exp_lce_supported


def quack_lce_available(device: torch.device) -> bool:
    """Whether QuACK's linear cross-entropy runs on `device` (an H100/H200 with QuACK installed). Asked outside
    torch.compile (kernels.choice): where it runs, a summed loss goes through it from then on (`_use_quack_lce`)."""
    global _QUACK_LCE
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        _QUACK_LCE = _QUACK_LCE or _load_quack_lce()
        return _QUACK_LCE is not None
    return False


def _use_quack_lce(x: torch.Tensor, weight: torch.Tensor, reduction: str, cap: float, fp8: bool) -> bool:
    """QuACK's scaled-exp linear cross-entropy takes the head where it applies: a summed loss (the upstream
    gradient is one number, which its forward folds into dx and dW), no soft cap, no FP8, an H100/H200 in
    bf16, a vocabulary that its tiles divide (50,304 does)."""
    if reduction != "sum" or cap or fp8 or not x.is_cuda or _QUACK_LCE is None:
        return False
    return _QUACK_LCE[1](x, weight, LCE_CHUNK, "sum")


def head_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None,
                       cap: float = 0.0, reduction: str = "mean", fp8: bool = False) -> torch.Tensor:
    """Cross-entropy of the logits x @ weight.T (soft-capped when cap > 0) without keeping the logits.

    x (..., K), weight (V, K), targets (...): the same loss as `cross_entropy(logits(x), targets, ...)`.
    Under autocast the matmuls run in the autocast dtype, as nn.Linear's would. `fp8` (model.fp8_head):
    the logits' matmul takes e4m3 copies of x and the weight, the gradient's two matmuls the e5m2 G (where the
    shapes allow: multiples of 16). With a `loss_mask` (fine-tuning: prompts, padding and other turns are not
    trained) only the trained rows reach the head (`_trained_rows`).
    """
    if loss_mask is not None:
        targets = targets.masked_fill(~loss_mask, IGNORE)
        return _trained_rows(x.reshape(-1, x.size(-1)), weight, targets, cap, reduction, fp8)
    return _rows(x.reshape(-1, x.size(-1)), weight, targets, cap, reduction, fp8)


def _rows(x2: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float, reduction: str,
          fp8: bool, of: int = 0) -> torch.Tensor:
    """`of`: these rows are the trained ones of that many: the head keeps its gradient whole or recomputes it as
    it would for all of them, so the memory plan, which counts every row, decides as the run does."""
    dtype = autocast_dtype(x2.device.type, x2.dtype)
    flat = targets.reshape(-1)
    # no autocast region here: _HeadCE casts its operands itself, and an autocast context inside a compiled
    # graph keeps AOTAutograd from caching it (a second start would trace the model again)
    if _use_quack_lce(x2, weight, reduction, cap, fp8):
        return _QUACK_LCE[0](x2, weight, flat, chunk_size=LCE_CHUNK, ignore_index=IGNORE, reduction="sum")
    fp8 = fp8 and fp8_shapes_ok(*x2.shape, weight.size(0))
    grads = torch.is_grad_enabled()
    loss = _HeadCE.apply(x2, weight, flat, float(cap), dtype, fp8, grads and x2.requires_grad,
                         grads and weight.requires_grad, whole_limit(x2.device), of)
    if reduction == "none":
        return loss.view(targets.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat != IGNORE).sum().clamp(min=1)


# (the flat indices of the trained targets on the device, how many targets they index) of the forward running inside
# `trained_rows`: made on the host from the batch before it was sent, so `_trained_rows` reads nothing back
_KNOWN_ROWS: ContextVar = ContextVar("trainbox_trained_rows", default=None)


def host_trained_rows(targets: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The flat indices of the trained targets of a micro-batch on the host (loss mask on, target not IGNORE): the
    rows `_trained_rows` keeps, found before the batch goes to the device (the training loop sends them with it)."""
    return ((targets != IGNORE) & loss_mask).reshape(-1).nonzero().squeeze(1)


@contextmanager
def trained_rows(rows: torch.Tensor | None, total: int):
    """Forwards inside take their trained rows from `rows` (host_trained_rows of their batch, on its device; None:
    they find them themselves), for targets of `total` elements: the head needs no host read."""
    token = _KNOWN_ROWS.set(None if rows is None else (rows, total))
    try:
        yield
    finally:
        _KNOWN_ROWS.reset(token)


@eager   # the number of trained rows is the data's: one graph break, no recompilation
def _trained_rows(x2: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float, reduction: str,
                  fp8: bool) -> torch.Tensor:
    """The loss over the rows whose target is not IGNORE, computed on those rows alone: a preference pair's prompt
    half, an SFT row's prompt and padding cost no head matmul and no logits. The rows come from the host where the
    caller knows them (`trained_rows`: the training loop); otherwise they are found here, which reads their count
    back to the host (one synchronisation)."""
    flat = targets.reshape(-1)
    known = _KNOWN_ROWS.get()
    if known is not None and known[1] == len(flat) and known[0].device == flat.device:
        keep = known[0]
    else:
        keep = (flat != IGNORE).nonzero().squeeze(1)
    if len(keep) in (0, len(flat)):
        return _rows(x2, weight, targets, cap, reduction, fp8)
    loss = _rows(x2.index_select(0, keep), weight, flat.index_select(0, keep), cap,
                 "none" if reduction == "none" else "sum", fp8, of=len(flat))
    if reduction == "none":
        return loss.new_zeros(len(flat)).index_put((keep,), loss).view(targets.shape)
    return loss if reduction == "sum" else loss / len(keep)
