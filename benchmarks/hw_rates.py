"""The rates the plan's step-time model divides by (src/trainbox/plan/gpus.py's `Rates`), measured on this machine.

    python benchmarks/hw_rates.py --record                                   # one GPU: matmuls, memory, host read
    torchrun --nproc-per-node 2 benchmarks/hw_rates.py --record              # and NCCL between 2 GPUs
    torchrun --nproc-per-node 4 benchmarks/hw_rates.py --record              # ... between 4
    torchrun --nproc-per-node 2 benchmarks/hw_rates.py --device cpu --tiny   # gloo on a CPU, tiny sizes (the test's)

What it measures, each the median of --reps timed calls after warm-up (collectives: the slowest rank's):

- matmul: bf16 TFLOP/s (2 M N K / time) at a large square shape (the rate `Rates.matmul` holds), at gpt2-125m's
  and llama-8b's shapes, and the MoE experts' grouped matmuls (torch's grouped_mm over 8 experts of 12,288 rows,
  gpt2-125m's 8-expert MoE at micro-batch 48, and 64 of 256, the 128-expert one at expert parallelism 2 and
  micro-batch 16), forward shapes;
- memory: a fused AdamW step and the gradient-norm pass of the clip over 256M parameters, as the bytes the plan
  counts for it (plan/time.py's OPTIMIZER_BYTES a parameter) per second, and a plain copy's read + write bytes/s;
- collectives over the process group (torchrun; NCCL on GPUs, gloo on a CPU), as nccl-tests' bus bandwidth:
  all_reduce (DDP's 25 MiB bucket, the 8-expert MoE's dense fp32 gradients, 1 GiB), all_gather (a
  gathered bf16 block of gpt2-125m, llama-8b, the 128-expert MoE) and reduce_scatter (their fp32
  gradients), all_to_all_single (one MoE layer's dispatched rows at micro-batch 16, 48 and 120: tokens x top-2 x
  768 x 2 bytes);
- the host read: `.tolist()` of split sizes just exchanged by a small all_to_all_single, alone (its round trip)
  and with a queue of small matmuls behind it, against the same queue without the read: what the read costs a
  busy GPU, the figure `Rates.host_sync` holds.

It prints the figures as JSON, `rates` in Rates' units, then the result record; --record writes the record
(rank 0) to benchmarks/records/DATE-HARDWARE-hw-rates.json. Copy `rates` into plan/gpus.py's RATES with the
record's file name as the source.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import common
import torch
import torch.distributed as dist

from trainbox.plan.time import OPTIMIZER_BYTES

GB = 1e9
MB = 2**20

# (name, M, K, N): forward matmuls, x (M, K) @ w (K, N)
MATMULS = [("square 8192", 8192, 8192, 8192),
           ("gpt2-125m qkv", 16384, 768, 2304), ("gpt2-125m mlp up", 16384, 768, 3072),
           ("gpt2-125m mlp down", 16384, 3072, 768), ("gpt2-125m head", 16384, 768, 50304),
           ("llama-8b mlp up", 8192, 4096, 14336)]
# (name, experts, rows per expert, K, N): the experts' first grouped matmul
GROUPED = [("8 experts x 12288 rows", 8, 12288, 768, 3072), ("64 experts x 256 rows", 64, 256, 768, 3072),
           ("64 experts x 256 rows, down", 64, 256, 3072, 768)]
# bytes: (name, size); all_gather's size is the gathered output, reduce_scatter's the input, all_to_all's a rank's
# whole send buffer
ALL_REDUCE = [("ddp bucket 25 MiB", 25 * MB), ("8-expert moe dense grads fp32", 4 * 68_900_000), ("1 GiB", 1024 * MB)]
ALL_GATHER = [("gpt2-125m block bf16", 2 * 7_087_872), ("llama-8b block bf16", 2 * 218_112_000),
              ("128-expert moe block bf16", 2 * 611_000_000)]
REDUCE_SCATTER = [(n.replace("bf16", "fp32"), 2 * b) for n, b in ALL_GATHER]
ALL_TO_ALL = [(f"moe layer micro-batch {b}", b * 1024 * 2 * 768 * 2) for b in (16, 48, 120)]
TINY = 2**-14   # --tiny: every size and shape this much smaller (shapes by its cube root, at least 16)
# the names this torch gives the collectives FSDP runs (older ones: *_into_tensor, *_tensor)
ALL_GATHER_OP = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_OP = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(f, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Seconds of one call of f: the median of `reps` calls, each waited for."""
    for _ in range(warmup):
        f()
    sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds` (a collective ends when its slowest rank does)."""
    if not dist.is_initialized():
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def dim(n: int, tiny: bool) -> int:
    return max(16, round(n * TINY ** (1 / 3) / 16) * 16) if tiny else n


def grouped_call(x: torch.Tensor, w: torch.Tensor, rows: int):
    """(f, how): one grouped matmul of x's row blocks (`rows` each) by w's experts: torch's grouped_mm, or a loop over
    the experts where this device or dtype has no kernel."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    offs = torch.arange(1, w.size(0) + 1, device=x.device, dtype=torch.int32) * rows
    try:
        grouped(x, w, offs=offs)
        return (lambda: grouped(x, w, offs=offs)), "grouped_mm"
    except (RuntimeError, TypeError, NotImplementedError) as err:
        return (lambda: [x[i * rows:(i + 1) * rows] @ w[i] for i in range(w.size(0))],
                f"a loop over the experts ({str(err).splitlines()[0][:80]})")


def matmuls(device: torch.device, dtype: torch.dtype, tiny: bool, reps: int) -> dict:
    out = {}
    for name, m, k, n in MATMULS:
        m, k, n = dim(m, tiny), dim(k, tiny), dim(n, tiny)
        x, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        seconds = timed(functools.partial(torch.matmul, x, w), device, reps)
        out[name] = {"shape": [m, k, n], "tflops": 2 * m * k * n / seconds / 1e12}
    for name, e, rows, k, n in GROUPED:
        rows, k, n = dim(rows, tiny), dim(k, tiny), dim(n, tiny)
        x = torch.randn(e * rows, k, device=device, dtype=dtype)
        f, how = grouped_call(x, torch.randn(e, k, n, device=device, dtype=dtype), rows)
        out[name] = {"shape": [e, rows, k, n], "how": how,
                     "tflops": 2 * e * rows * k * n / timed(f, device, reps) / 1e12}
    return out


def memory(device: torch.device, tiny: bool, reps: int) -> dict:
    n = int(256e6 * (TINY if tiny else 1))
    src = torch.empty(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = 2 * 4 * n / timed(lambda: dst.copy_(src), device, reps)
    params = [torch.nn.Parameter(torch.zeros(n // 4, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
    adamw = OPTIMIZER_BYTES["fp32"] * n / timed(step, device, reps)
    return {"parameters": n, "adamw_bytes_per_s": adamw, "copy_bytes_per_s": copy}


def collectives(device: torch.device, world: int, tiny: bool, reps: int) -> dict:
    def size(b: int, unit: int) -> int:   # elements of `unit` bytes, a multiple of the world size
        n = max(world, int(b * (TINY if tiny else 1)) // unit)
        return n - n % world

    out: dict = {}

    def measure(kind: str, name: str, f, nbytes: int, bus: float) -> None:
        try:
            f()
        except (RuntimeError, ValueError) as err:   # a collective this backend lacks
            out.setdefault(kind, {})[name] = {"unsupported": str(err).splitlines()[0][:120]}
            return
        t = slowest(timed(f, device, reps), device)
        out.setdefault(kind, {})[name] = {"bytes": nbytes, "seconds": t, "bus_bytes_per_s": nbytes / t * bus}

    for name, b in ALL_REDUCE:
        x = torch.ones(size(b, 4), device=device)
        measure("all_reduce", name, lambda x=x: dist.all_reduce(x), 4 * x.numel(), 2 * (world - 1) / world)
    for name, b in ALL_GATHER:
        full = torch.empty(size(b, 2), device=device, dtype=torch.bfloat16)
        part = torch.ones(full.numel() // world, device=device, dtype=torch.bfloat16)
        measure("all_gather", name, lambda f=full, p=part: ALL_GATHER_OP(f, p), 2 * full.numel(),
                (world - 1) / world)
    for name, b in REDUCE_SCATTER:
        full = torch.ones(size(b, 4), device=device)
        part = torch.empty(full.numel() // world, device=device)
        measure("reduce_scatter", name, lambda f=full, p=part: REDUCE_SCATTER_OP(p, f), 4 * full.numel(),
                (world - 1) / world)
    for name, b in ALL_TO_ALL:
        send = torch.ones(size(b, 2), device=device, dtype=torch.bfloat16)
        recv = torch.empty_like(send)
        measure("all_to_all", name, lambda s=send, r=recv: dist.all_to_all_single(r, s), 2 * send.numel(),
                (world - 1) / world)
    return out


def host_read(device: torch.device, world: int, dtype: torch.dtype, tiny: bool, reps: int) -> dict:
    """The split sizes' read as expert parallelism makes it: a small exchange of per-expert counts, then `.tolist()`;
    alone, and behind a queue of 24 small matmuls against the same queue without the read."""
    counts = torch.arange(64 * world, device=device, dtype=torch.int64)   # 64 experts a rank
    recv = torch.empty_like(counts)

    def exchange():
        if world > 1:
            dist.all_to_all_single(recv, counts)
        else:
            recv.copy_(counts)

    def read():
        exchange()
        return recv.tolist()
    x = torch.randn(dim(4096, tiny), dim(768, tiny), device=device, dtype=dtype)
    w = torch.randn(dim(768, tiny), dim(768, tiny), device=device, dtype=dtype)

    def queue(with_read: bool):
        def f():
            for _ in range(8):     # a layer's work, then its read: 8 layers
                y = x
                for _ in range(3):
                    y = y @ w
                exchange()
                if with_read:
                    recv.tolist()
        return f
    alone = slowest(timed(read, device, reps), device)
    behind = slowest(timed(queue(True), device, reps), device)
    without = slowest(timed(queue(False), device, reps), device)
    return {"round_trip_s": alone, "cost_to_a_busy_gpu_s": max(0.0, (behind - without) / 8),
            "queue_with_reads_s": behind, "queue_without_s": without}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="every size 2^-14 of the real one: a check that it runs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    dtype = torch.bfloat16
    metrics: dict = {"processes": world, "device": args.device, "tiny": args.tiny, "reps": args.reps}
    metrics["matmul"] = matmuls(device, dtype, args.tiny, args.reps)
    metrics["memory"] = memory(device, args.tiny, args.reps)
    if world > 1:
        metrics["collectives"] = coll = collectives(device, world, args.tiny, args.reps)
    metrics["host_read"] = read = host_read(device, world, dtype, args.tiny, args.reps)
    rates = {"matmul": metrics["matmul"]["square 8192"]["tflops"] * 1e12,
             "memory": metrics["memory"]["adamw_bytes_per_s"], "host_sync": read["cost_to_a_busy_gpu_s"]}
    if world > 1:
        rates["all_reduce"] = coll["all_reduce"]["1 GiB"]["bus_bytes_per_s"]
        rates["all_to_all"] = coll["all_to_all"]["moe layer micro-batch 48"]["bus_bytes_per_s"]
    metrics["rates"] = rates
    if rank == 0:
        gpu = {"name": torch.cuda.get_device_name(device), "count": world} if device.type == "cuda" else None
        launch = f"torchrun --nproc-per-node {world}" if world > 1 else "python"
        flags = [*(["--device", "cpu"] if args.device == "cpu" else []), *(["--tiny"] if args.tiny else []),
                 *(["--reps", str(args.reps)] if args.reps != 20 else []), *(["--record"] if args.record else [])]
        result = common.Result(tool="hw_rates", what="hw-rates", gpu=gpu,
                               command=" ".join([launch, "benchmarks/hw_rates.py", *flags]),
                               software=common.software(), metrics=metrics,
                               notes="rates: what plan/gpus.py's Rates holds, in its units (FLOP/s, bytes/s, s)")
        common.emit(result, record=args.record and not args.tiny)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
