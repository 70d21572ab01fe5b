"""Where a training step's GPU time goes: kernels grouped by kind, as one JSON line.

    python benchmarks/profile_step.py gpt2-125m --data /tmp/corpus/modded/pyc [key=value ...]
    python benchmarks/profile_step.py gpt2-125m --data PREFIX --sdpa cudnn train.micro_batch_size=32 --record
    torchrun --standalone --nproc_per_node 2 benchmarks/profile_step.py llama-1b --data PREFIX train.parallel=fsdp

Builds the real Trainer, runs `--warmup` optimizer steps (compilation), times `--steps` more with the
device synchronised only at their ends, then records `--profile` steps under torch.profiler. Prints:
step ms, tokens/s, MFU, the share of GPU time per kind (matmul, attention, fused elementwise
(Triton), optimizer, copies, communication, other), the GPU-busy fraction of the step, the top
kernels in ms per step, and the GPU's idle time inside the profiled steps with its largest gaps (the
kernels on either side and the host ops that ran meanwhile: where the host, not the GPU, set the pace),
and how much of the communication kernels' time ran under other kernels (hidden) or alone (exposed).
Under torchrun every rank trains and profiles the same steps and rank 0 reports.
`--sdpa` pins PyTorch's attention backend for the whole run (tracing included); `--trace FILE` writes rank 0's
profiled steps as a Chrome trace (chrome://tracing, Perfetto) for a look at the timeline itself. The output is
the result record (common.Result); --record also writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import common

KINDS = [  # first match wins
    ("attention", r"flash|fmha|attn|attention|sdpa|cudnn"),
    ("matmul", r"gemm|nvjet|sm90_xmma|sm80_xmma|cutlass|wgmma|matmul"),
    ("communication", r"nccl|allreduce|all_reduce|reduce_scatter|all_gather"),
    ("optimizer", r"adam|multi_tensor_apply|foreach"),
    ("fused elementwise (triton)", r"^triton"),
    ("copy", r"memcpy|memset|copy|Memcpy|Memset"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def kernel_times(rows, steps: int, cuda: bool) -> tuple[dict[str, float], list, dict[str, float]]:
    """From the profiler's key_averages(): GPU ms per step by kind, the kernels as (ms per step, calls per step,
    name), and each optimizer's GPU span (torch annotates Optimizer.step#Name.step). Only kernels count: CPU-side
    ops and the GPU-side ranges of user annotations (FSDP's "FSDP::all_gather (...)", c10d's
    "nccl:_all_gather_base" around its kernel) are left out, or the time under them would count twice."""
    import torch  # heavy: the profiler's device types (the rest of this module's arithmetic imports without it)
    per_kind: dict[str, float] = defaultdict(float)
    kernels = []
    optimizer_ms: dict[str, float] = {}
    for evt in rows:
        on_gpu = evt.device_type == torch.autograd.DeviceType.CUDA
        if evt.key.startswith("Optimizer.step#") and on_gpu:
            name = evt.key.split("#")[1].split(".")[0]
            optimizer_ms[name] = round(evt.self_device_time_total / 1e3 / steps, 1)
        if cuda and (not on_gpu or getattr(evt, "is_user_annotation", False)
                     or evt.key.startswith(("Optimizer.", "ProfilerStep"))):
            continue
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = evt.self_cuda_time_total
        if us <= 0:
            continue
        ms = us / 1e3 / steps
        per_kind[kind_of(evt.key)] += ms
        kernels.append((ms, evt.count // steps, evt.key[:120]))
    return per_kind, kernels, optimizer_ms


def idle_gaps(kernels: list[tuple[float, float, str]], host: list[tuple[float, float, str]], top: int = 8):
    """GPU idle time between the first and the last kernel, and its largest gaps.

    kernels: (start_us, end_us, name) of GPU kernels (any stream: overlapping kernels count as busy);
    host: (start_us, end_us, name) of top-level host ops. -> (idle_us, [[gap_ms, kernel before, kernel
    after, [the host ops that overlap the gap most]], ...] largest first)."""
    if not kernels:
        return 0.0, []
    ks = sorted(kernels)
    busy_until, last = ks[0][1], ks[0][2]
    gaps = []
    for start, end, name in ks[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, busy_until, start, last, name))
        if end >= busy_until:
            busy_until, last = end, name
    gaps.sort(key=lambda g: -g[0])
    out = []
    for gap, a, b, before, after in gaps[:top]:
        overlap: dict[str, float] = defaultdict(float)
        for s, e, name in host:
            if min(e, b) > max(s, a):
                overlap[name] += min(e, b) - max(s, a)
        names = [n[:80] for n, _ in sorted(overlap.items(), key=lambda kv: -kv[1])[:3]]
        out.append([round(gap / 1e3, 2), before[:80], after[:80], names])
    return sum(g[0] for g in gaps), out


def _union(intervals: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def communication_overlap(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """Of the GPU time of communication kernels (NCCL: FSDP's all-gathers and reduce-scatters, DDP's all-reduces,
    expert parallelism's all-to-alls), how much ran while other kernels ran (hidden) and how much alone
    (exposed: the step waited for it). kernels: (start_us, end_us, name) of GPU kernels. -> microseconds."""
    comm = _union([(s, e) for s, e, n in kernels if kind_of(n) == "communication"])
    work = _union([(s, e) for s, e, n in kernels if kind_of(n) != "communication"])
    hidden, i, j = 0.0, 0, 0
    while i < len(comm) and j < len(work):   # the two sorted, disjoint lists intersected
        hidden += max(0.0, min(comm[i][1], work[j][1]) - max(comm[i][0], work[j][0]))
        if comm[i][1] < work[j][1]:
            i += 1
        else:
            j += 1
    total = sum(e - s for s, e in comm)
    return {"compute_us": sum(e - s for s, e in work), "comm_us": total, "comm_hidden_us": hidden,
            "comm_exposed_us": total - hidden}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--data", required=True)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", type=int, default=2)
    ap.add_argument("--sdpa", choices=["default", "flash", "cudnn", "efficient", "math"], default="default")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-profile)")
    ap.add_argument("--trace", help="write rank 0's profiled steps as a Chrome trace (JSON) to this file")
    ap.add_argument("--templates", choices=common.TEMPLATE_KINDS,
                    help="an experiment: Inductor's GEMM autotuning for these matmuls (common.inductor_templates)")
    ap.add_argument("--template-backends", default="TRITON", help="with --templates: TRITON or ATEN,TRITON")
    args = ap.parse_intermixed_args()
    if args.templates:
        common.inductor_templates(args.templates, args.template_backends)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from trainbox.config import load_config
    from trainbox.parallel.distributed import Dist
    from trainbox.train.loop import Trainer

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}.get(args.sdpa)
    ctx = sdpa_kernel([backend]) if backend is not None else nullcontext()
    dist = Dist.from_env(os.environ)
    # one run directory for every rank (torchrun gives them one run id)
    run_dir = Path(tempfile.gettempdir()) / f"prof-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}"
    cfg = load_config(args.recipe, [f"data.path={args.data}", "train.eval_every=0", "train.checkpoint_every=0",
                                    "train.sample_tokens=0", "monitor.enabled=false", f"run.dir={run_dir}",
                                    *args.overrides])
    trainer = Trainer(cfg, dist=dist)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    trainer.setup()
    trainer.model.train()
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    step = 0
    with ctx:
        t0 = time.time()
        for _ in range(args.warmup):
            loss, _, _ = trainer.train_step(step)
            step += 1
        loss.item()
        warm_s = time.time() - t0
        sync()
        t0 = time.time()
        for _ in range(args.steps):
            loss, _, _ = trainer.train_step(step)
            step += 1
        sync()
        step_s = (time.time() - t0) / args.steps
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            t1 = time.time()
            for _ in range(args.profile):
                trainer.train_step(step)
                step += 1
            sync()
            prof_s = (time.time() - t1) / args.profile
    if args.trace and dist.is_main:
        prof.export_chrome_trace(args.trace)
    per_kind, kernels, optimizer_ms = kernel_times(prof.key_averages(), args.profile, cuda)
    busy = sum(per_kind.values())
    kernels.sort(reverse=True)
    idle: dict = {}
    if cuda:
        try:  # diagnostics only: never lose the figures above to a profiler API difference
            evts = prof.events()
            gpu = [(e.time_range.start, e.time_range.end, e.name) for e in evts
                   if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                   and not e.name.startswith(("Optimizer.", "ProfilerStep"))]
            host = [(e.time_range.start, e.time_range.end, e.name) for e in evts
                    if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None
                    and not e.name.startswith("ProfilerStep")]
            idle_us, gaps = idle_gaps(gpu, host)
            split = {k.replace("_us", "_ms_per_step"): round(v / 1e3 / args.profile, 1)
                     for k, v in communication_overlap(gpu).items()}
            idle = {"gpu_idle_ms_per_step": round(idle_us / 1e3 / args.profile, 1), **split, "largest_gaps": gaps}
        except Exception as e:  # noqa: BLE001
            idle = {"idle_gaps_error": repr(e)[:300]}
    # tokens: the global batch, computed by dist.world GPUs
    mfu = trainer.flops_per_token * tokens / step_s / (trainer.peak * dist.world) if trainer.peak else None
    result = {
        "recipe": args.recipe, "overrides": args.overrides, "sdpa": args.sdpa,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "tokens_per_step": tokens,
        "warmup_s": round(warm_s, 1), "step_ms": round(step_s * 1e3, 1), "tokens_per_s": round(tokens / step_s),
        "tokens_per_s_per_gpu": round(tokens / step_s / dist.world),
        "mfu": round(mfu, 4) if mfu else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "profiled_step_ms": round(prof_s * 1e3, 1), "gpu_busy_ms": round(busy, 1),
        "optimizer_gpu_ms": optimizer_ms,
        "share": {k: round(v / busy, 4) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "ms_per_kind": {k: round(v, 1) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [[round(ms, 2), n, name] for ms, n, name in kernels[:args.top]],
        **idle,
    }
    if not dist.is_main:   # every rank ran and profiled the same steps; rank 0 reports its own
        trainer.dist.shutdown(True)
        return
    print(json.dumps(result), flush=True)
    common.emit(common.Result(
        tool="profile_step", what=args.what or f"{args.recipe}-profile", gpu=common.gpu_info(),
        software=common.software(), recipe=args.recipe, overrides=args.overrides,
        metrics={k: v for k, v in result.items() if k not in ("recipe", "overrides", "gpu", "torch")}), args.record)
    trainer.dist.shutdown(True)


if __name__ == "__main__":
    main()
