"""Fused GEMM + tanh-GELU epilogue kernels for the GPT-2 MLP, against cuBLAS + a separate elementwise kernel.

  fc_gelu(x, w)       -> (h, a):  h = x @ w.T (bf16),  a = gelu_tanh(h)            (c_fc forward)
  dgelu_mm(g, w2, h)  -> dh:      dh = (g @ w2) * gelu_tanh'(h)                       (c_proj -> c_fc backward)

Both round the fp32 accumulator to bf16 before the elementwise math, so that they agree bit for bit with the
unfused torch path (bf16 mm, then F.gelu / aten.gelu_backward) wherever the GEMM itself agrees.

  python benchmarks/gemm_gelu_epilogue.py [--reps 50]     # GPU: correctness at M=49152, C=768, H=3072 + timings, one JSON line
  TRITON_INTERPRET=1 python benchmarks/gemm_gelu_epilogue.py --small    # CPU interpreter: correctness on tiny shapes only

Progress goes to stderr; MLP_GEMM_DEBUG=1 also prints the traceback of every failing config.

Measured on an H100 (session 12, benchmarks/records/2026-11-26-session12.json): the fused kernels lose.
Forward 0.748 ms (best of 8 configurations, persistent TMA) against cuBLAS + Inductor's GELU kernel 0.525;
backward 0.929 against 0.651. The same Triton GEMMs without the epilogue take 0.339 and 0.449 ms, so the
GELU math, done per tile after the main loop and not overlapped with the next tile's loads, costs more
than the memory pass it saves. gpt2-125m keeps cuBLAS and a separate GELU kernel.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:  # libdevice (exact tanhf, like CUDA's and Inductor's) is not available in the interpreter
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover
    libdevice = None
USE_LIBDEVICE = libdevice is not None and not INTERPRET

# Epilogue modes (constexpr objects, so kernels may read them as globals).
EPI_NONE = tl.constexpr(0)   # out = A @ B
EPI_GELU = tl.constexpr(1)   # out = h = bf16(A @ B), out2 = gelu_tanh(h)
EPI_DGELU = tl.constexpr(2)  # out = gelu_tanh_backward(dy=bf16(A @ B), x=aux)

# Constants of aten's tanh-GELU (ActivationGeluKernel): kBeta = sqrt(2) * (2 / sqrt(pi)) * 0.5, kKappa = 0.044715,
# both float32. 3 * kKappa is a float32 product there, so it is formed the same way here.
K_BETA = tl.constexpr(float(np.float32(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5)))
K_KAPPA = tl.constexpr(float(np.float32(0.044715)))
K_3KAPPA = tl.constexpr(float(np.float32(3.0) * np.float32(0.044715)))


# ----------------------------------------------------------------------------------------------------------------
# Elementwise helpers (fp32 in, fp32 out)
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _tanh_libdevice(x):
    return libdevice.tanh(x)


@triton.jit
def _tanh_exp(x):
    # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow for any x.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


_tanh = _tanh_libdevice if USE_LIBDEVICE else _tanh_exp


@triton.jit
def _gelu_tanh(x):
    # Same operation order as aten's GeluCUDAKernelImpl (approximate='tanh').
    x_cube = x * x * x
    inner = K_BETA * (x + K_KAPPA * x_cube)
    return 0.5 * x * (1.0 + _tanh(inner))


@triton.jit
def _gelu_tanh_backward(dy, x):
    # Same operation order as aten's GeluBackwardCUDAKernelImpl (approximate='tanh').
    x_sq = x * x
    x_cube = x_sq * x
    inner = K_BETA * (x + K_KAPPA * x_cube)
    tanh_inner = _tanh(inner)
    left = 0.5 * x
    right = 1.0 + tanh_inner
    left_derivative = 0.5 * right
    right_derivative = left * (1.0 - tanh_inner * tanh_inner) * K_BETA * (1.0 + K_3KAPPA * x_sq)
    return dy * (left_derivative + right_derivative)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-tiles are swept over all column tiles before moving on (L2 reuse of A).
    tiles_per_group = GROUP_M * num_pid_n
    group_id = tile_id // tiles_per_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % tiles_per_group) % group_size_m
    pid_n = (tile_id % tiles_per_group) // group_size_m
    return pid_m, pid_n


# ----------------------------------------------------------------------------------------------------------------
# Kernel 1: one output tile per program, pointer loads (cp.async pipelined by the compiler)
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _mm_epilogue_kernel(
    a_ptr, b_ptr, out_ptr, out2_ptr, aux_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
):
    """C = A @ B (A (M,K), B (K,N) given by strides, fp32 accumulation), then per EPILOGUE:
    EPI_NONE:  out = C
    EPI_GELU:  out = h = bf16(C), out2 = gelu_tanh(h)
    EPI_DGELU: out = gelu_tanh_backward(bf16(C), aux)      (aux = h, the GELU input)
    out, out2 and aux are row-major (M, N) with row stride stride_cm."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows / columns past the edge wrap around, so the main loop needs no M/N masks; the epilogue masks them.
    rows = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    cols = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_offs = offs_m[:, None] * stride_cm + offs_n[None, :]
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if EPILOGUE == EPI_NONE:
        tl.store(out_ptr + c_offs, acc.to(out_ptr.dtype.element_ty), mask=c_mask)
    elif EPILOGUE == EPI_GELU:
        h = acc.to(tl.bfloat16)
        tl.store(out_ptr + c_offs, h, mask=c_mask)
        tl.store(out2_ptr + c_offs, _gelu_tanh(h.to(tl.float32)).to(tl.bfloat16), mask=c_mask)
    else:
        da = acc.to(tl.bfloat16).to(tl.float32)
        h = tl.load(aux_ptr + c_offs, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + c_offs, _gelu_tanh_backward(da, h).to(tl.bfloat16), mask=c_mask)


# ----------------------------------------------------------------------------------------------------------------
# Kernel 2: persistent (one program per SM), TMA loads/stores through device-side tensor descriptors
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _tma_tile_epilogue(acc, off_m, off_n, out_desc, out2_desc, aux_desc, EPILOGUE: tl.constexpr):
    if EPILOGUE == EPI_NONE:
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))
    elif EPILOGUE == EPI_GELU:
        h = acc.to(tl.bfloat16)
        out_desc.store([off_m, off_n], h)
        out2_desc.store([off_m, off_n], _gelu_tanh(h.to(tl.float32)).to(tl.bfloat16))
    else:
        da = acc.to(tl.bfloat16).to(tl.float32)
        h = aux_desc.load([off_m, off_n]).to(tl.float32)
        out_desc.store([off_m, off_n], _gelu_tanh_backward(da, h).to(tl.bfloat16))


@triton.jit
def _split_columns(x):
    # (R, C) -> left (R, C/2), right (R, C/2)
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def _mm_epilogue_tma_kernel(
    a_ptr, b_ptr, out_ptr, out2_ptr, aux_ptr,
    M, N, K,
    EPILOGUE: tl.constexpr, B_NK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Same contract as _mm_epilogue_kernel, for contiguous operands: A (M,K); B (N,K) if B_NK (nn.Linear weight,
    C = A @ B.T) else (K,N); out/out2/aux (M,N). EPI_SPLIT (1, 2 or 4) runs the epilogue on that many
    (BLOCK_M, BLOCK_N / EPI_SPLIT) column slices, to cut its register and shared-memory footprint.
    Out-of-range TMA loads read zeros and out-of-range stores are dropped, so ragged edges need no masks."""
    EPI_N: tl.constexpr = BLOCK_N // EPI_SPLIT
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_NK:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, EPI_N])
    out2_desc = tl.make_tensor_descriptor(out2_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, EPI_N])
    aux_desc = tl.make_tensor_descriptor(aux_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, EPI_N])

    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            if B_NK:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc)
        if EPI_SPLIT == 1:
            _tma_tile_epilogue(acc, off_m, off_n, out_desc, out2_desc, aux_desc, EPILOGUE)
        elif EPI_SPLIT == 2:
            acc0, acc1 = _split_columns(acc)
            _tma_tile_epilogue(acc0, off_m, off_n, out_desc, out2_desc, aux_desc, EPILOGUE)
            _tma_tile_epilogue(acc1, off_m, off_n + EPI_N, out_desc, out2_desc, aux_desc, EPILOGUE)
        else:
            tl.static_assert(EPI_SPLIT == 4, "EPI_SPLIT must be 1, 2 or 4")
            left, right = _split_columns(acc)
            acc0, acc1 = _split_columns(left)
            acc2, acc3 = _split_columns(right)
            _tma_tile_epilogue(acc0, off_m, off_n, out_desc, out2_desc, aux_desc, EPILOGUE)
            _tma_tile_epilogue(acc1, off_m, off_n + EPI_N, out_desc, out2_desc, aux_desc, EPILOGUE)
            _tma_tile_epilogue(acc2, off_m, off_n + 2 * EPI_N, out_desc, out2_desc, aux_desc, EPILOGUE)
            _tma_tile_epilogue(acc3, off_m, off_n + 3 * EPI_N, out_desc, out2_desc, aux_desc, EPILOGUE)


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False        # persistent TMA kernel instead of the one-tile-per-program pointer kernel
    epi_split: int = 1       # TMA kernel only
    flatten: bool = False    # TMA kernel only: flatten the tile and k loops into one pipelined loop

    @property
    def name(self):
        s = "tma_" if self.tma else ""
        s += f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}_g{self.group_m}"
        if self.tma and self.epi_split > 1:
            s += f"_split{self.epi_split}"
        if self.tma and self.flatten:
            s += "_flat"
        return s


_NUM_SMS = None


def _num_sms(device):
    global _NUM_SMS
    if _NUM_SMS is None:
        _NUM_SMS = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return _NUM_SMS


def _tma_scratch(size, alignment, stream):
    # Device-side tensor descriptors (tl.make_tensor_descriptor) need a global-memory workspace per launch.
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _mm_epilogue(a, b, b_nk, epilogue, aux, cfg):
    """a (M,K) @ (b.T if b_nk else b), with the given epilogue. Returns out (and out2 for EPI_GELU)."""
    assert a.dim() == 2 and b.dim() == 2 and a.dtype == b.dtype == torch.bfloat16
    M, K = a.shape
    N = b.shape[0] if b_nk else b.shape[1]
    assert (b.shape[1] if b_nk else b.shape[0]) == K
    out = torch.empty((M, N), device=a.device, dtype=torch.bfloat16)
    mode = epilogue.value
    out2 = torch.empty_like(out) if mode == EPI_GELU.value else out
    if mode == EPI_DGELU.value:
        assert aux.shape == (M, N) and aux.dtype == torch.bfloat16 and aux.is_contiguous()
    else:
        aux = out
    num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    meta = dict(EPILOGUE=mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.tma:
        assert a.is_contiguous() and b.is_contiguous(), "TMA kernel takes contiguous operands"
        assert K % 8 == 0 and N % 8 == 0, "TMA needs 16-byte aligned row strides"
        num_sms = _num_sms(a.device)
        _mm_epilogue_tma_kernel[(min(num_sms, num_tiles),)](
            a, b, out, out2, aux, M, N, K, B_NK=b_nk, EPI_SPLIT=cfg.epi_split, NUM_SMS=num_sms,
            FLATTEN=cfg.flatten, **meta)
    else:
        stride_bk, stride_bn = (b.stride(1), b.stride(0)) if b_nk else (b.stride(0), b.stride(1))
        _mm_epilogue_kernel[(num_tiles,)](
            a, b, out, out2, aux, M, N, K, a.stride(0), a.stride(1), stride_bk, stride_bn, out.stride(0),
            EVEN_K=K % cfg.block_k == 0, **meta)
    return (out, out2) if mode == EPI_GELU.value else out


def fc_gelu(x, w, cfg):
    """(h, a) with h = x @ w.T (w: nn.Linear weight (H, C)) and a = gelu_tanh(h), both bf16."""
    return _mm_epilogue(x, w, True, EPI_GELU, None, cfg)


def dgelu_mm(g, w2, h, cfg):
    """dh = (g @ w2) * gelu_tanh'(h) (w2: nn.Linear weight (C, H) of c_proj), bf16."""
    return _mm_epilogue(g, w2, False, EPI_DGELU, h, cfg)


def plain_mm(a, b, b_nk, cfg):
    return _mm_epilogue(a, b, b_nk, EPI_NONE, None, cfg)


# ----------------------------------------------------------------------------------------------------------------
# Checks and timing
# ----------------------------------------------------------------------------------------------------------------
def _ordered_bits(t):
    # bf16 bit patterns mapped to integers that are monotonic in the value (+0 and -0 both map to 0),
    # so the difference of two of them counts representable bf16 steps (ulps) between the values.
    i = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i + 32768), i)


def diff_stats(out, ref):
    out, ref = out.detach(), ref.detach()
    ulp = (_ordered_bits(out) - _ordered_bits(ref)).abs()
    return {
        "max_abs": float((out.float() - ref.float()).abs().max()),
        "frac_differ": float((out != ref).float().mean()),
        "max_ulp": int(ulp.max()),
        "frac_gt_1ulp": float((ulp > 1).float().mean()),
        "nan": bool(torch.isnan(out).any()),
    }


def stats_ok(s, max_ulp=None, max_frac_gt_1ulp=1e-3):
    return (not s["nan"]) and (max_ulp is None or s["max_ulp"] <= max_ulp) and s["frac_gt_1ulp"] <= max_frac_gt_1ulp


def bench_ms(fn, reps, warmup=10):
    """Median over `reps` of the CUDA-event time of one call (back-to-back launches)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def log(*args):
    print("[gemm_gelu_epilogue]", *args, file=sys.stderr, flush=True)


def short_error(e):
    if os.environ.get("MLP_GEMM_DEBUG"):
        import traceback
        traceback.print_exception(e, file=sys.stderr)
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {(lines[-1] if lines else '')[:300]}"


def make_inputs(M, N, K, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device=device, dtype=torch.bfloat16)

    x = randn(M, K)                 # MLP input (after ln_2)
    w = randn(N, K, std=0.02)       # c_fc.weight (H, C)
    g = randn(M, K)                 # grad of the MLP output
    w2 = randn(K, N, std=0.02)      # c_proj.weight (C, H)
    return x, w, g, w2


def reference(x, w, g, w2):
    h = x @ w.t()
    a = F.gelu(h, approximate="tanh")
    da = g @ w2
    dh = torch.ops.aten.gelu_backward(da, h, approximate="tanh")
    return h, a, da, dh


def check_config(kind, cfg, x, w, g, w2, ref):
    """Run one config once and compare with the torch reference. Returns (outputs, correctness dict, ok).
    The GEMM accumulates in another order than cuBLAS, so bf16(acc) may differ by 1 ulp; a then follows h (by many
    ulps where gelu is flat relative to its value, h << 0), so `a` is gated on torch's gelu of our own h instead."""
    h_ref, a_ref, _, dh_ref = ref
    if kind == "fwd":
        h, a = fc_gelu(x, w, cfg)
        corr = {"h": diff_stats(h, h_ref), "a": diff_stats(a, a_ref),
                "a_vs_torch_gelu_of_own_h": diff_stats(a, F.gelu(h, approximate="tanh"))}
        ok = stats_ok(corr["h"], 1) and stats_ok(corr["a"]) and stats_ok(corr["a_vs_torch_gelu_of_own_h"], 1)
        return (h, a), corr, ok
    dh = dgelu_mm(g, w2, h_ref, cfg)   # same h as the reference: dh differs only through da's rounding
    corr = {"dh": diff_stats(dh, dh_ref)}
    return dh, corr, stats_ok(corr["dh"], 2)


def epilogue_exactness(kind, cfg, x, w, g, w2, h_ref, outs):
    """Compare the fused epilogue with torch's elementwise op applied to our own GEMM result (removes the
    accumulation-order difference from the comparison, so only the GELU arithmetic is left)."""
    if kind == "fwd":
        h, a = outs
        h_plain = plain_mm(x, w, True, cfg)
        return {"h_plain_triton_vs_fused": diff_stats(h_plain, h),
                "a_vs_torch_gelu_of_own_h": diff_stats(a, F.gelu(h, approximate="tanh"))}
    da = plain_mm(g, w2, False, cfg)
    da_ref = g @ w2
    return {"da_plain_triton_vs_cublas": diff_stats(da, da_ref),
            "dh_vs_torch_gelu_backward_of_own_da": diff_stats(
                outs, torch.ops.aten.gelu_backward(da, h_ref, approximate="tanh"))}


# ----------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------
def gpu_configs():
    c = Config
    # (128x128x64 w4 s4 left out: ptxas spills 380 B (fwd) / 1.8 KB (bwd) at 255 registers.)
    return [
        c(128, 256, 64, 8, 3),
        c(128, 128, 64, 8, 3),
        c(128, 128, 64, 8, 4),
        c(256, 128, 64, 8, 3),
        c(128, 256, 64, 8, 3, tma=True, epi_split=2),
        c(128, 256, 64, 8, 3, tma=True, epi_split=4),
        c(128, 128, 64, 8, 4, tma=True, epi_split=2),
        c(128, 256, 64, 8, 3, tma=True, epi_split=4, flatten=True),
    ]


def small_configs():
    c = Config
    return [
        c(64, 64, 32, 4, 2),
        c(32, 128, 32, 4, 2, group_m=2),
        c(64, 64, 32, 4, 2, tma=True),
        c(64, 128, 32, 4, 2, group_m=2, tma=True, epi_split=2),
        c(32, 128, 32, 4, 2, tma=True, epi_split=4),
        c(32, 64, 32, 4, 2, tma=True, flatten=True),
    ]


def _interpreter_compat():
    """Test-only shims for three gaps of Triton 3.6's interpreter (TRITON_INTERPRET=1); the GPU path is untouched.
    1. Scalars are 1-element arrays, turned into loop bounds with int(array), which NumPy >= 2.4 rejects
       ("only 0-dimensional arrays can be converted to Python scalars"): take the single element explicitly.
    2. tl.dot multiplies bf16 operands as their raw uint16 bit patterns: widen them to float32 first
       (exact), then accumulate in float32 as the tensor cores do.
    3. float32 -> bf16 casts truncate; the GPU (and torch) round to nearest even: do that."""
    from triton.runtime import interpreter
    if getattr(interpreter, "_mlp_gemm_compat", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    builder_cls = type(interpreter.interpreter_builder)
    create_dot = builder_cls.create_dot

    def _widen_bf16(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def _create_dot(self, a, b, d, *args, **kwargs):
        return create_dot(self, _widen_bf16(a), _widen_bf16(b), d, *args, **kwargs)

    cast_impl = builder_cls.cast_impl

    def _cast_impl(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16          # round half to even
        nan = np.isnan(src.data)
        out = np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)  # keep NaNs quiet NaNs
        return interpreter.TensorHandle(out, tl.bfloat16)

    interpreter._patch_lang_tensor = _patch_lang_tensor
    builder_cls.create_dot = _create_dot
    builder_cls.cast_impl = _cast_impl
    interpreter._mlp_gemm_compat = True


def run_small():
    """CPU / interpreter correctness check on tiny shapes (one even, one with ragged M, N and K)."""
    if INTERPRET:
        _interpreter_compat()
    else:
        log("warning: --small is meant to run with TRITON_INTERPRET=1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    triton.set_allocator(_tma_scratch)
    result = {"mode": "small", "device": str(device), "torch": torch.__version__, "triton": triton.__version__,
              "tanh_impl": "libdevice" if USE_LIBDEVICE else "exp", "shapes": {}}
    all_ok = True
    for (M, N, K) in [(256, 192, 64), (200, 136, 48)]:
        x, w, g, w2 = make_inputs(M, N, K, device)
        ref = reference(x, w, g, w2)
        shape_res = {}
        for cfg in small_configs():
            for kind in ("fwd", "bwd"):
                key = f"{kind}:{cfg.name}"
                t0 = time.time()
                try:
                    outs, corr, ok = check_config(kind, cfg, x, w, g, w2, ref)
                    corr.update(epilogue_exactness(kind, cfg, x, w, g, w2, ref[0], outs))
                    shape_res[key] = {"ok": ok, **corr}
                except Exception as e:  # report and go on
                    ok = False
                    shape_res[key] = {"ok": False, "error": short_error(e)}
                all_ok &= ok
                log(f"M={M} N={N} K={K} {key}: {'ok' if ok else 'FAIL'} ({time.time() - t0:.1f}s)",
                    "" if ok else json.dumps(shape_res[key]))
        result["shapes"][f"{M}x{N}x{K}"] = shape_res
    result["ok"] = all_ok
    print(json.dumps(result))
    return 0 if all_ok else 1


def run_gpu(reps, res, shape=(49152, 768, 3072), configs=None, device="cuda"):
    """Correctness at the real shape, then timings; fills `res` as it goes (printed even if a step dies)."""
    t_start = time.time()
    device = torch.device(device)
    triton.set_allocator(_tma_scratch)
    M, K, N = shape
    flops = 2.0 * M * N * K
    configs = gpu_configs() if configs is None else configs

    def entry(ms):
        return {"ms": round(ms, 4), "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    res.update({"gpu": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
                "torch": torch.__version__, "triton": triton.__version__, "shape": {"M": M, "K": K, "N": N},
                "flops_per_call": flops, "tanh_impl": "libdevice" if USE_LIBDEVICE else "exp", "reps": reps})
    x, w, g, w2 = make_inputs(M, N, K, device)
    ref = reference(x, w, g, w2)
    h_ref, a_ref, da_ref, dh_ref = ref
    sync()

    # --- baselines: cuBLAS alone, cuBLAS + torch.compile'd elementwise kernel, cuBLAS + eager elementwise --------
    log("baselines")
    base = res["baseline"] = {}
    base["cublas_mm_fwd"] = entry(bench_ms(lambda: x @ w.t(), reps))
    base["cublas_mm_bwd"] = entry(bench_ms(lambda: g @ w2, reps))
    base["fwd_cublas_plus_eager_gelu"] = entry(bench_ms(lambda: F.gelu(x @ w.t(), approximate="tanh"), reps))
    base["bwd_cublas_plus_eager_gelu_backward"] = entry(bench_ms(
        lambda: torch.ops.aten.gelu_backward(g @ w2, h_ref, approximate="tanh"), reps))
    try:  # each elementwise op compiled alone, so that Inductor emits it as one Triton kernel
        t0 = time.time()
        import torch._inductor.config as inductor_config
        inductor_config.compile_threads = 1  # two tiny kernels: a worker pool would cost more than it saves
        gelu_c = torch.compile(lambda t: F.gelu(t, approximate="tanh"), dynamic=False, fullgraph=True)
        gelu_bwd_c = torch.compile(lambda dy, t: torch.ops.aten.gelu_backward(dy, t, approximate="tanh"),
                                   dynamic=False, fullgraph=True)
        res["elementwise_compiled_vs_eager"] = {
            "gelu": diff_stats(gelu_c(h_ref), a_ref),
            "gelu_backward": diff_stats(gelu_bwd_c(da_ref, h_ref), dh_ref)}
        log(f"torch.compile of the elementwise kernels: {time.time() - t0:.1f}s")
        base["compiled_gelu"] = entry(bench_ms(lambda: gelu_c(h_ref), reps))
        base["compiled_gelu_backward"] = entry(bench_ms(lambda: gelu_bwd_c(da_ref, h_ref), reps))
        base["fwd_cublas_plus_compiled_gelu"] = entry(bench_ms(lambda: gelu_c(x @ w.t()), reps))
        base["bwd_cublas_plus_compiled_gelu_backward"] = entry(bench_ms(lambda: gelu_bwd_c(g @ w2, h_ref), reps))
    except Exception as e:
        base["compiled_error"] = short_error(e)
    for k, v in base.items():
        log(f"  {k}: {v}")

    # --- fused Triton kernels ----------------------------------------------------------------------------------
    separate_key = {"fwd": ("fwd_cublas_plus_compiled_gelu", "fwd_cublas_plus_eager_gelu"),
                    "bwd": ("bwd_cublas_plus_compiled_gelu_backward", "bwd_cublas_plus_eager_gelu_backward")}
    for kind in ("fwd", "bwd"):
        variants = {}
        out = res[kind] = {"variants": variants, "best": None}
        for cfg in configs:
            rec = variants[cfg.name] = {"config": asdict(cfg)}
            t0 = time.time()
            try:
                _, corr, ok = check_config(kind, cfg, x, w, g, w2, ref)  # first call compiles
                rec.update(compile_and_check_s=round(time.time() - t0, 1), correct=ok, correctness=corr)
                fn = (lambda c=cfg: fc_gelu(x, w, c)) if kind == "fwd" else (lambda c=cfg: dgelu_mm(g, w2, h_ref, c))
                rec.update(entry(bench_ms(fn, reps)))
                sync()
                best = out["best"]
                if ok and (best is None or rec["ms"] < variants[best]["ms"]):
                    out["best"] = cfg.name
            except Exception as e:  # compile error, out of shared memory, ...: report and go on
                rec["error"] = short_error(e)
            log(f"{kind} {cfg.name}: " + (f"{rec['ms']} ms {rec['tflops']} TFLOP/s correct={rec['correct']} "
                                         f"({rec['compile_and_check_s']}s)" if "ms" in rec else rec.get("error", "")))
        best = out["best"]
        if best is None:
            continue
        best_cfg = Config(**variants[best]["config"])
        out.update(best_ms=variants[best]["ms"], best_tflops=variants[best]["tflops"],
                   best_correctness=variants[best]["correctness"])
        compiled, eager = (base.get(k) for k in separate_key[kind])
        if compiled is not None:
            out["separate_ms"] = compiled["ms"]
            out["saving_ms_per_call"] = round(compiled["ms"] - out["best_ms"], 4)
        out["saving_vs_eager_elementwise_ms_per_call"] = round(eager["ms"] - out["best_ms"], 4)
        # Diagnostics with the best config: the epilogue vs torch's op on our own GEMM result, and the same
        # GEMM without epilogue (how much of the gap to cuBLAS is the GEMM itself).
        try:
            outs = fc_gelu(x, w, best_cfg) if kind == "fwd" else dgelu_mm(g, w2, h_ref, best_cfg)
            out["epilogue_exactness"] = epilogue_exactness(kind, best_cfg, x, w, g, w2, h_ref, outs)
            del outs
            mm_fn = (lambda: plain_mm(x, w, True, best_cfg)) if kind == "fwd" else (
                lambda: plain_mm(g, w2, False, best_cfg))
            out["triton_mm_only_best_config"] = entry(bench_ms(mm_fn, reps))
        except Exception as e:
            out["diagnostics_error"] = short_error(e)
        log(f"{kind} best {best}: {out['best_ms']} ms, saving {out.get('saving_ms_per_call')} ms/call, "
            f"same GEMM without epilogue {out.get('triton_mm_only_best_config')}")

    res["tma_compiled"] = any("ms" in v for k in ("fwd", "bwd") for n, v in res[k]["variants"].items()
                              if n.startswith("tma_"))
    res["best_fused"] = {k: res[k]["best"] for k in ("fwd", "bwd")}
    res["saving_ms_per_call"] = {k: res[k].get("saving_ms_per_call") for k in ("fwd", "bwd")}
    res["wall_s"] = round(time.time() - t_start, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes, correctness only (use with TRITON_INTERPRET=1)")
    p.add_argument("--reps", type=int, default=50, help="timed repetitions per variant (median reported)")
    args = p.parse_args()
    if args.small:
        return run_small()
    if not torch.cuda.is_available():
        log("no CUDA device: run with --small under TRITON_INTERPRET=1 for the CPU correctness check")
        return 2
    res = {}
    try:
        run_gpu(args.reps, res)
        return 0
    except BaseException as e:  # e.g. a kernel fault poisons the CUDA context: still report what was measured
        res["fatal_error"] = short_error(e)
        return 1
    finally:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    sys.exit(main())
