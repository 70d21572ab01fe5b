"""Attention with a learned additive bias that every row of the batch shares (T5's relative positions), in Triton.

    o = softmax(scale * q k^T + bias[h] (+ causal mask)) v,    q, k, v (B, T, H, D),  bias (H, Tq, Tk) fp32

or a bias by distance, (H, Tq + Tk - 1), that depends only on key position - query position (T5's): the kernels read
it along its diagonals (a row stride of -1), a few KiB a head instead of Tq x Tk values, and its gradient is the
position gradient's diagonals summed (`diagonal_sums`, no atomics).

PyTorch's scaled_dot_product_attention takes such a bias only as a dense additive mask, and only its memory-efficient
kernel differentiates one: it writes the bias gradient for every row of the batch (B x H x Tq x Tk) and autograd then
sums the rows. The op here keeps the bias per head and sums its gradient over the batch inside the kernel:

- forward: FlashAttention-2's online softmax over blocks of keys; each block adds its tile of the bias (one tile for the
  whole batch, so it is read from L2), masks the keys past Tk (and past the query, causal); writes o and the rows'
  log-sum-exp (base 2).
- backward, three kernels and no atomics, each computing the logits again (FlashAttention's recomputation: nothing of
  size T x T is stored but the bias gradient): dk, dv per block of keys (a loop over the blocks of queries), dq per
  block of queries (a loop over the blocks of keys), and the bias gradient per tile, whose program loops over the
  batch and sums ds = dlogits in registers, then writes the tile once.

`biased_attention` is a Triton op (`torch.library.triton_op`: `trainbox::biased_attention`, its backward
`trainbox::biased_attention_bwd`), so torch.compile keeps the model in one graph around it and launches the kernels
from its generated code (`scale` is a compile-time constant of the kernels: one build per value). On CUDA the kernels
are Triton; elsewhere the same arithmetic runs as torch ops (the tests' oracle). T5's self-attention runs it on a CUDA
GPU (`model.attention=auto` or `triton`); docs/performance.md has its times against SDPA's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

LOG2E = 1.4426950408889634

if triton is not None:
    @triton.jit
    def _ld(ptrs, mask, EVEN: tl.constexpr):
        """A tile load: unmasked where every block is whole (EVEN), else zero outside `mask`."""
        if EVEN:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _st(ptrs, value, mask, EVEN: tl.constexpr):
        if EVEN:
            tl.store(ptrs, value)
        else:
            tl.store(ptrs, value, mask=mask)

    @triton.jit
    def _probabilities(q, k, bias, lse, rows, cols, Tq, Tk, scale, CAUSAL: tl.constexpr, EVEN: tl.constexpr):
        """p = exp(logits - lse) of one tile, zero outside the sequence and above the diagonal (causal)."""
        s = (tl.dot(q, tl.trans(k)) * scale + bias.to(tl.float32)) * 1.4426950408889634   # base-2 logits
        p = tl.exp2(s - lse[:, None])
        if CAUSAL:
            p = tl.where(cols[None, :] <= rows[:, None], p, 0.0)
        if not EVEN:
            p = tl.where((rows[:, None] < Tq) & (cols[None, :] < Tk), p, 0.0)
        return p

    @triton.jit
    def _biased_attn_fwd(Q, K, V, BIAS, sbh, sbr, boff, O, LSE, sqb, sqt, skb, skt, sob, sot, H, Tq, Tk,
                         scale: tl.constexpr, D, CAUSAL: tl.constexpr, DP: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BM + tl.arange(0, BM)
        dims = tl.arange(0, DP)   # D padded to a power of two
        qmask = (rows[:, None] < Tq) & (dims[None, :] < D)
        q = _ld(Q + b.to(tl.int64) * sqb + h * D + rows[:, None] * sqt + dims[None, :], qmask, EVEN)
        m = tl.full([BM], float("-inf"), tl.float32)
        l_sum = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DP], tl.float32)
        end = tl.minimum(Tk, (pid_m + 1) * BM) if CAUSAL else Tk
        bias_rows = BIAS + h.to(tl.int64) * sbh + boff + rows[:, None] * sbr
        kbase = K + b.to(tl.int64) * skb + h * D
        vbase = V + b.to(tl.int64) * skb + h * D
        for start in range(0, end, BN):
            cols = start + tl.arange(0, BN)
            kvmask = (cols[:, None] < Tk) & (dims[None, :] < D)
            k = _ld(kbase + cols[:, None] * skt + dims[None, :], kvmask, EVEN)
            v = _ld(vbase + cols[:, None] * skt + dims[None, :], kvmask, EVEN)
            bias = _ld(bias_rows + cols[None, :], (rows[:, None] < Tq) & (cols[None, :] < Tk), EVEN)
            s = (tl.dot(q, tl.trans(k)) * scale + bias.to(tl.float32)) * 1.4426950408889634   # base-2 logits
            if CAUSAL:
                s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
            if not EVEN:
                s = tl.where(cols[None, :] < Tk, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        acc = acc / l_sum[:, None]
        _st(O + b.to(tl.int64) * sob + h * D + rows[:, None] * sot + dims[None, :], acc.to(O.dtype.element_ty), qmask,
            EVEN)
        _st(LSE + bh.to(tl.int64) * Tq + rows, m + tl.log2(l_sum), rows < Tq, EVEN)

    @triton.jit
    def _biased_attn_dkdv(Q, K, V, BIAS, sbh, sbr, boff, DO, LSE, DELTA, DK, DV, sqb, sqt, skb, skt, H, Tq, Tk,
                          scale: tl.constexpr, D, CAUSAL: tl.constexpr, DP: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr):
        pid_n, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        cols = pid_n * BN + tl.arange(0, BN)
        dims = tl.arange(0, DP)   # D padded to a power of two
        kvmask = (cols[:, None] < Tk) & (dims[None, :] < D)
        kv = b.to(tl.int64) * skb + h * D + cols[:, None] * skt + dims[None, :]
        k = _ld(K + kv, kvmask, EVEN)
        v = _ld(V + kv, kvmask, EVEN)
        dk = tl.zeros([BN, DP], tl.float32)
        dv = tl.zeros([BN, DP], tl.float32)
        qbase = b.to(tl.int64) * sqb + h * D
        bias_base = BIAS + h.to(tl.int64) * sbh + boff
        first = (pid_n * BN // BM) * BM if CAUSAL else 0   # earlier queries see none of these keys
        for start in range(first, Tq, BM):
            rows = start + tl.arange(0, BM)
            rmask = rows < Tq
            qmask = rmask[:, None] & (dims[None, :] < D)
            q = _ld(Q + qbase + rows[:, None] * sqt + dims[None, :], qmask, EVEN)
            do = _ld(DO + qbase + rows[:, None] * sqt + dims[None, :], qmask, EVEN)
            lse = _ld(LSE + bh.to(tl.int64) * Tq + rows, rmask, EVEN)
            delta = _ld(DELTA + bh.to(tl.int64) * Tq + rows, rmask, EVEN)
            bias = _ld(bias_base + rows[:, None] * sbr + cols[None, :], rmask[:, None] & (cols[None, :] < Tk), EVEN)
            p = _probabilities(q, k, bias, lse, rows, cols, Tq, Tk, scale, CAUSAL, EVEN)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        _st(DK + kv, (dk * scale).to(DK.dtype.element_ty), kvmask, EVEN)
        _st(DV + kv, dv.to(DV.dtype.element_ty), kvmask, EVEN)

    @triton.jit
    def _biased_attn_dq(Q, K, V, BIAS, sbh, sbr, boff, DO, LSE, DELTA, DQ, sqb, sqt, skb, skt, H, Tq, Tk,
                        scale: tl.constexpr, D, CAUSAL: tl.constexpr, DP: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BM + tl.arange(0, BM)
        dims = tl.arange(0, DP)   # D padded to a power of two
        rmask = rows < Tq
        qmask = rmask[:, None] & (dims[None, :] < D)
        qrows = b.to(tl.int64) * sqb + h * D + rows[:, None] * sqt + dims[None, :]
        q = _ld(Q + qrows, qmask, EVEN)
        do = _ld(DO + qrows, qmask, EVEN)
        lse = _ld(LSE + bh.to(tl.int64) * Tq + rows, rmask, EVEN)
        delta = _ld(DELTA + bh.to(tl.int64) * Tq + rows, rmask, EVEN)
        bias_rows = BIAS + h.to(tl.int64) * sbh + boff + rows[:, None] * sbr
        dq = tl.zeros([BM, DP], tl.float32)
        end = tl.minimum(Tk, (pid_m + 1) * BM) if CAUSAL else Tk   # later keys are masked for all these rows
        for start in range(0, end, BN):
            cols = start + tl.arange(0, BN)
            kvmask = (cols[:, None] < Tk) & (dims[None, :] < D)
            kv = b.to(tl.int64) * skb + h * D + cols[:, None] * skt + dims[None, :]
            k = _ld(K + kv, kvmask, EVEN)
            v = _ld(V + kv, kvmask, EVEN)
            bias = _ld(bias_rows + cols[None, :], rmask[:, None] & (cols[None, :] < Tk), EVEN)
            p = _probabilities(q, k, bias, lse, rows, cols, Tq, Tk, scale, CAUSAL, EVEN)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        _st(DQ + qrows, (dq * scale).to(DQ.dtype.element_ty), qmask, EVEN)

    @triton.jit
    def _biased_attn_dbias(Q, K, V, BIAS, sbh, sbr, boff, DO, LSE, DELTA, DB, sqb, sqt, skb, skt, B, H, Tq, Tk,
                           scale: tl.constexpr, D, CAUSAL: tl.constexpr, DP: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr):
        """One tile of the bias gradient, summed over the batch in registers: dbias = sum_b ds_b."""
        pid_m, pid_n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        dims = tl.arange(0, DP)   # D padded to a power of two
        rmask = rows < Tq
        tile = rmask[:, None] & (cols[None, :] < Tk)
        db_tile = DB + h.to(tl.int64) * Tq * Tk + rows[:, None] * Tk + cols[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        if (not CAUSAL) or pid_n * BN <= pid_m * BM + BM - 1:   # causal: a tile above the diagonal stays zero
            bias = _ld(BIAS + h.to(tl.int64) * sbh + boff + rows[:, None] * sbr + cols[None, :], tile, EVEN)
            qmask = rmask[:, None] & (dims[None, :] < D)
            kvmask = (cols[:, None] < Tk) & (dims[None, :] < D)
            for b in range(0, B):
                b64 = tl.cast(b, tl.int64)
                bh = b64 * H + h
                qrows = b64 * sqb + h * D + rows[:, None] * sqt + dims[None, :]
                kv = b64 * skb + h * D + cols[:, None] * skt + dims[None, :]
                q = _ld(Q + qrows, qmask, EVEN)
                do = _ld(DO + qrows, qmask, EVEN)
                k = _ld(K + kv, kvmask, EVEN)
                v = _ld(V + kv, kvmask, EVEN)
                lse = _ld(LSE + bh * Tq + rows, rmask, EVEN)
                delta = _ld(DELTA + bh * Tq + rows, rmask, EVEN)
                p = _probabilities(q, k, bias, lse, rows, cols, Tq, Tk, scale, CAUSAL, EVEN)
                acc += p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        _st(db_tile, acc, tile, EVEN)


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def diagonals(rel: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """(H, q_len, k_len) from rel (H, q_len + k_len - 1): out[h, i, j] = rel[h, j - i + q_len - 1], a bias that
    depends only on key position - query position (queries are the last q_len of k_len positions), contiguous."""
    return rel.unfold(1, k_len, 1).flip(1).contiguous()   # [h, a, j] = rel[h, a + j]; a: query q_len - 1 - a


def diagonal_sums(grad: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """The gradient of `diagonals` (H, q_len + k_len - 1): grad's diagonals summed as columns, no atomics. The
    gradient, rows reversed and padded by q_len zero columns, read row-major with one element fewer per row, has
    diagonal m of the original in column m."""
    n = q_len + k_len - 1
    padded = F.pad(grad.flip(1), (0, q_len))                       # (H, q_len, n + 1), zeros right
    return padded.flatten(1)[:, :q_len * n].view(-1, q_len, n).sum(1)


def _relative(bias: torch.Tensor) -> bool:
    """A bias by distance (H, Tq + Tk - 1), not by position (H, Tq, Tk)."""
    return bias.dim() == 2


def _dense(bias: torch.Tensor, Tq: int, Tk: int) -> torch.Tensor:
    return diagonals(bias, Tq, Tk) if _relative(bias) else bias


def _bias_layout(bias: torch.Tensor, Tq: int, Tk: int) -> tuple[int, int, int]:
    """(head stride, row stride, offset) at which the kernels read bias[h, row, col] (col stride 1): by position,
    row-major; by distance, rel[h, col - row + Tq - 1] (a row stride of -1)."""
    return (bias.size(1), -1, Tq - 1) if _relative(bias) else (Tq * Tk, Tk, 0)


def _logits(q, k, bias, scale, causal):
    """(B, H, Tq, Tk) fp32 logits of the reference path."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale + bias.float()
    if causal:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _forward_reference(q, k, v, bias, scale, causal):
    s = _logits(q, k, _dense(bias, q.size(1), k.size(1)), scale, causal)
    lse = torch.logsumexp(s, dim=-1)                                           # (B, H, Tq)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v.float())
    return o.to(q.dtype), lse * LOG2E


def _backward_reference(do, q, k, v, bias, o, lse, scale, causal):
    Tq, Tk = q.size(1), k.size(1)
    p = torch.exp(_logits(q, k, _dense(bias, Tq, Tk), scale, causal) - lse[..., None] / LOG2E)
    dof = do.float()
    delta = (dof * o.float()).sum(-1).transpose(1, 2)                          # (B, H, Tq)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, v.float())
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.float()) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale
    dbias = ds.sum(0)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            (diagonal_sums(dbias, Tq, Tk) if _relative(bias) else dbias).to(bias.dtype))


# (BM query rows, BN keys, warps, pipeline stages) of each kernel. Heads up to 64 wide: each kernel's fastest, within
# the sweep's noise, of benchmarks/biased_attention.py --sweep at t5-base's encoder shape on an H200
# (benchmarks/records/2026-11-29-h200-t5-biased-attention.json). Wider heads: smaller tiles, not measured.
BLOCKS = {"forward": {64: (128, 32, 8, 3), 128: (64, 32, 4, 3)},
          "dkdv": {64: (64, 64, 4, 3), 128: (64, 32, 4, 3)},
          "dq": {64: (64, 32, 4, 3), 128: (64, 32, 4, 3)},
          "dbias": {64: (128, 64, 8, 3), 128: (64, 64, 4, 3)}}


def _config(kernel: str, Tq: int, Tk: int, D: int, blocks: dict | None) -> tuple[tuple[int, int], dict]:
    """((BM, BN), the launch's keyword arguments) of `kernel`: its blocks from `blocks` (a sweep) or BLOCKS."""
    BM, BN, warps, stages = (blocks or {}).get(kernel) or BLOCKS[kernel][64 if D <= 64 else 128]
    even = Tq % BM == 0 and Tk % BN == 0 and Tq % BN == 0 and Tk % BM == 0 and D == _padded(D)
    return (BM, BN), dict(DP=_padded(D), BM=BM, BN=BN, EVEN=even, num_warps=warps, num_stages=stages)


def _triton_forward(q, k, v, bias, scale, causal, blocks=None):
    B, Tq, H, D = q.shape
    (BM, _), launch = _config("forward", Tq, k.size(1), D, blocks)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(Tq, BM), B * H)
    _wrap(_biased_attn_fwd)[grid](q, k, v, bias, *_bias_layout(bias, Tq, k.size(1)), o, lse, q.stride(0), q.stride(1),
                                  k.stride(0), k.stride(1), o.stride(0), o.stride(1), H, Tq, k.size(1), scale, D,
                                  CAUSAL=causal, **launch)
    return o, lse


def _triton_backward(do, q, k, v, bias, o, lse, scale, causal, blocks=None, bias_grad=True):
    B, Tq, H, D = q.shape
    Tk = k.size(1)
    do = do.contiguous()    # the kernels read it with q's strides
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()     # (B, H, Tq)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, bias, *_bias_layout(bias, Tq, Tk), do, lse, delta)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    (_, BN), launch = _config("dkdv", Tq, Tk, D, blocks)
    _wrap(_biased_attn_dkdv)[(triton.cdiv(Tk, BN), B * H)](*args, dk, dv, *strides, H, Tq, Tk, scale, D, CAUSAL=causal,
                                                      **launch)
    (BM, _), launch = _config("dq", Tq, Tk, D, blocks)
    _wrap(_biased_attn_dq)[(triton.cdiv(Tq, BM), B * H)](*args, dq, *strides, H, Tq, Tk, scale, D, CAUSAL=causal,
                                                         **launch)
    dbias = None
    if bias_grad:
        dbias = torch.empty(H, Tq, Tk, dtype=torch.float32, device=q.device)
        (BM, BN), launch = _config("dbias", Tq, Tk, D, blocks)
        grid = (triton.cdiv(Tq, BM), triton.cdiv(Tk, BN), H)
        _wrap(_biased_attn_dbias)[grid](*args, dbias, *strides, B, H, Tq, Tk, scale, D, CAUSAL=causal, **launch)
        dbias = (diagonal_sums(dbias, Tq, Tk) if _relative(bias) else dbias).to(bias.dtype)
    return dq, dk, dv, dbias


def _padded(D: int) -> int:
    """The head width the kernels compute with: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(D))


def _check(q, k, v, bias, causal):
    B, Tq, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (H, D):
        raise ValueError(f"biased_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                         "(B, T, H, D) of one batch, heads and width")
    if bias.shape not in ((H, Tq, k.size(1)), (H, Tq + k.size(1) - 1)):
        raise ValueError(f"biased_attention: bias {tuple(bias.shape)} is neither (heads, Tq, Tk) = "
                         f"{(H, Tq, k.size(1))} nor (heads, Tq + Tk - 1) = {(H, Tq + k.size(1) - 1)}")
    if causal and Tq != k.size(1):
        raise ValueError("biased_attention: causal attention needs as many queries as keys")


def _define(name: str, fn, fake):
    """The op `name` run by `fn`: a triton_op, whose Triton kernels and torch ops torch.compile traces into its graph
    (its generated code launches them: no custom-op dispatch on the host per call), or on a torch without triton_op
    an opaque custom op with `fake` for its shapes."""
    if hasattr(torch.library, "triton_op"):
        return torch.library.triton_op(name, fn, mutates_args=())
    op = torch.library.custom_op(name, fn, mutates_args=())
    op.register_fake(fake)
    return op


def _wrap(kernel):
    """A Triton kernel as torch.compile traces it inside a triton_op."""
    return torch.library.wrap_triton(kernel) if hasattr(torch.library, "wrap_triton") else kernel


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Tq, H, D), k, v (B, Tk, H, D), bias (H, Tq, Tk) -> o (B, Tq, H, D), lse (B, H, Tq) fp32 base 2."""
    if not _use_triton(q):
        return _forward_reference(q, k, v, bias, scale, causal)
    return _triton_forward(q.contiguous(), k.contiguous(), v.contiguous(), bias.contiguous(), scale, causal)


def _forward_fake(q, k, v, bias, scale, causal):
    B, Tq, H, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(B, H, Tq, dtype=torch.float32)


def _backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                 bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq, dk, dv (as q, k, v), dbias (as bias: summed over the batch; empty unless bias_grad)."""
    if not _use_triton(q):
        dq, dk, dv, dbias = _backward_reference(do, q, k, v, bias, o, lse, scale, causal)
    else:
        dq, dk, dv, dbias = _triton_backward(do, q, k, v, bias, o, lse, scale, causal, bias_grad=bias_grad)
    return dq, dk, dv, dbias if bias_grad else bias.new_empty(0)


def _backward_fake(do, q, k, v, bias, o, lse, scale, causal, bias_grad):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(bias) if bias_grad else bias.new_empty(0))


_OPS: tuple | None = None


def ops() -> tuple:
    """(the op, its backward op), defined on first use: defining a triton_op imports Inductor and Dynamo, which a
    process that never runs these kernels (generate, export, a CPU run) does not load. Call it before torch.compile
    traces a model that uses the op (T5.set_kernels does)."""
    global _OPS
    if _OPS is None:
        op = _define("trainbox::biased_attention", _forward, _forward_fake)
        op.register_autograd(_backward, setup_context=_setup_context)
        _OPS = op, _define("trainbox::biased_attention_bwd", _backward_op, _backward_fake)
    return _OPS


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, bias, o, lse)
    ctx.scale, ctx.causal = scale, causal
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _lse):
    q, k, v, bias, o, lse = ctx.saved_tensors
    bias_grad = ctx.needs_input_grad[3]
    dq, dk, dv, dbias = ops()[1](do, q, k, v, bias, o, lse, ctx.scale, ctx.causal, bias_grad)
    return dq, dk, dv, dbias if bias_grad else None, None, None



def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float = 1.0,
                     causal: bool = False) -> torch.Tensor:
    """softmax(scale * q k^T + bias (+ causal mask)) v for q (B, Tq, H, D), k, v (B, Tk, H, D) and a bias shared by
    the batch (its gradient summed over it) -> (B, Tq, H, D). The bias is by position, (H, Tq, Tk), or by distance,
    (H, Tq + Tk - 1): rel[h, key - query + Tk - 1] with the queries the last Tq of Tk positions (`diagonals`; T5's),
    which the kernels read along its diagonals, a few KiB a head. Contiguous q, k, v and an fp32 bias avoid copies."""
    _check(q, k, v, bias, causal)
    return ops()[0](q.contiguous(), k.contiguous(), v.contiguous(), bias.contiguous(), float(scale), bool(causal))[0]


def triton_attention_available(device: torch.device) -> bool:
    """The Triton kernels run here: a CUDA GPU of compute capability 8.0+ with Triton."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)

