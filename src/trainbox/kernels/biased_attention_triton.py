"""The Triton kernels of kernels/biased_attention.py (whose docstring says what they compute) and their launches.

The bias comes as a layout, (head stride, row stride, offset) at which bias[h, row, col] is read (col stride 1): by
position, row-major; by distance, along its diagonals (a row stride of -1). The bias gradient comes back by position,
(H, Tq, Tk) in fp32, summed over the batch; the op turns it into its bias's shape and dtype.
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

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


def _wrap(kernel):
    """A Triton kernel as torch.compile traces it inside a triton_op."""
    return torch.library.wrap_triton(kernel) if hasattr(torch.library, "wrap_triton") else kernel


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


def forward(q, k, v, bias, layout, scale, causal, blocks=None):
    """-> o (B, Tq, H, D), lse (B, H, Tq) fp32 base 2; `layout`: (head stride, row stride, offset) of the bias."""
    B, Tq, H, D = q.shape
    (BM, _), launch = _config("forward", Tq, k.size(1), D, blocks)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(Tq, BM), B * H)
    _wrap(_biased_attn_fwd)[grid](q, k, v, bias, *layout, o, lse, q.stride(0), q.stride(1),
                                  k.stride(0), k.stride(1), o.stride(0), o.stride(1), H, Tq, k.size(1), scale, D,
                                  CAUSAL=causal, **launch)
    return o, lse


def backward(do, q, k, v, bias, layout, o, lse, scale, causal, blocks=None, bias_grad=True):
    """-> dq, dk, dv, and the bias gradient by position (H, Tq, Tk) fp32, summed over the batch (None unless
    bias_grad)."""
    B, Tq, H, D = q.shape
    Tk = k.size(1)
    do = do.contiguous()    # the kernels read it with q's strides
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()     # (B, H, Tq)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, bias, *layout, do, lse, delta)
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
    return dq, dk, dv, dbias


def _padded(D: int) -> int:
    """The head width the kernels compute with: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(D))
