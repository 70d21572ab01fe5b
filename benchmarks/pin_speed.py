"""Pinning the host buffers of a sharded async checkpoint: trainbox's `parallel/staging.PinnedHost` against torch's
`_create_cpu_state_dict(pin_memory=True)`, which DCP's BlockingAsyncStager calls on its first stage.

    python benchmarks/pin_speed.py --recipe llama-8b --world 4 --procs 4 --record   # one rank of 4, 4 at once

Each of --procs processes holds one rank's shard of the recipe's model and AdamW state as FSDP holds them: fp32
DTensors, dim 0 split --world ways (the parameters, exp_avg and exp_avg_sq), on GPU `i % device count`. All
processes pin at the same moment, as the ranks of one host do after their first step. Per side and process: the
seconds to allocate and pin the buffers (in a thread, as the saver pins them), the host memory pinned, and one
staging copy into them (GPU to host, what a save makes training wait for). While a side pins, the process's
main thread runs a loop of 8192x8192 bf16 matmuls, each waited for, standing for a training step's launches and
waits: its rate against the same loop alone (every process running it, just before) and the longest time
between two of its iterations say how much the pinning holds training back. The sides alternate (torch, ours,
ours, torch, ...) for --rounds rounds, each side's buffers freed before the next. The result record
(common.Result, torch's side its baseline) follows the JSON: the slowest process of each side, per round.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import tempfile
import threading
import time

import common
import torch
import torch.multiprocessing as mp

from trainbox.parallel.staging import PIN_PIECE, PinnedHost, saver_threads


def shard_shapes(recipe: str, world: int, overrides: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, local shape) of each parameter of the recipe's model, dim 0 split as FSDP2 splits it (chunks of
    ceil(rows / world); the last rank's, the smallest, is not the case timed)."""
    from trainbox.config import load_config
    from trainbox.plan import run_vocab
    from trainbox.plan.count import build_meta

    cfg = load_config(recipe, overrides)
    model = build_meta(cfg, run_vocab(cfg))
    return [(n, (math.ceil(p.shape[0] / world), *p.shape[1:]) if p.dim() else ())
            for n, p in model.named_parameters()]


def rank_state(shapes, device) -> dict:
    """One rank's model and AdamW state as DTensors of a one-process mesh, as the saver's state_dict holds them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cuda", (1,))

    def dt(shape):
        return DTensor.from_local(torch.empty(shape, device=device), mesh, [Shard(0)], run_check=False)

    model = {n: dt(s) for n, s in shapes}
    optim = {n: {"step": torch.tensor(1.0), "exp_avg": dt(s), "exp_avg_sq": dt(s)} for n, s in shapes}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 3e-4, "params": list(model)}]}}


def torch_side(state, args):
    from torch.distributed._state_dict_utils import _create_cpu_state_dict
    return _create_cpu_state_dict(state, pin_memory=True), None


def our_side(state, args):
    pinned = PinnedHost(state, args.threads, piece=args.piece_mib << 20)
    return pinned.state, pinned


def gpu_loop(until, a: torch.Tensor) -> tuple[int, float, float]:
    """Matmuls, each waited for, until `until()` holds, as a training step's launches and waits stand for:
    (iterations, seconds, the longest time between two)."""
    n, t0 = 0, time.perf_counter()
    last, longest = t0, 0.0
    while not until():
        torch.mm(a, a)
        torch.cuda.synchronize()
        now = time.perf_counter()
        longest, last, n = max(longest, now - last), now, n + 1
    return n, last - t0, longest


def pin_beside_loop(side: str, state, args, a: torch.Tensor):
    """One side's pinning in a thread, as the saver pins, while this thread runs the GPU loop: (host state,
    PinnedHost or None, seconds to pin, the loop's (iterations, seconds, longest gap))."""
    out = {}

    def pin():
        t0 = time.perf_counter()
        out["host"], out["pinned"] = (torch_side if side == "torch" else our_side)(state, args)
        out["pin_s"] = time.perf_counter() - t0

    thread = threading.Thread(target=pin)
    thread.start()
    loop = gpu_loop(lambda: not thread.is_alive(), a)
    thread.join()
    return out["host"], out["pinned"], out["pin_s"], loop


def pinned_host_bytes() -> int | None:
    """What the caching host allocator holds (torch's side); None where torch does not say."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    s = stats()
    return s.get("reserved_bytes.current", s.get("allocated_bytes.current"))


def worker(i: int, args, shapes, barrier, results) -> None:
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _copy_state_dict

    from trainbox.parallel.staging import host_bytes

    device = torch.device("cuda", i % torch.cuda.device_count())
    torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(args.store, f"store-{i}"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    state = rank_state(shapes, device)
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    order = args.sides
    for r in range(args.rounds):
        for side in order if r % 2 == 0 else order[::-1]:
            barrier.wait()   # the GPU loop alone, every process at once: its rate without pinning
            deadline = time.perf_counter() + 2.0
            n, secs, _ = gpu_loop(lambda t=deadline: time.perf_counter() > t, a)
            alone = n / secs
            barrier.wait()
            host, pinned, pin_s, (n, secs, longest) = pin_beside_loop(side, state, args, a)
            held = pinned_host_bytes() if side == "torch" else pinned.nbytes
            barrier.wait()
            t0 = time.perf_counter()
            _copy_state_dict(state, host)
            torch.cuda.synchronize()
            stage_s = time.perf_counter() - t0
            results.put({"proc": i, "round": r, "side": side, "pin_s": round(pin_s, 2), "stage_s": round(stage_s, 3),
                         "loop_rate_while_pinning": round(n / secs / alone, 3), "loop_longest_gap_s": round(longest, 3),
                         "shard_gib": round(host_bytes(state) / 2**30, 2),
                         "pinned_gib": round(held / 2**30, 2) if held is not None else None})
            del host
            if pinned is not None:
                pinned.close()
            pinned = None
            gc.collect()
            if hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()   # torch's side: its pinned blocks go back to the system
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="llama-8b")
    ap.add_argument("--world", type=int, default=4, help="the FSDP degree whose rank shard is pinned")
    ap.add_argument("--procs", type=int, default=4, help="processes pinning at once (the ranks of one host)")
    ap.add_argument("--threads", type=int, help="our side's threads (default: as the saver picks them, "
                    "cores per process up to 8)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sides", nargs="+", choices=["torch", "ours"], default=["torch", "ours"],
                    help="one side alone (ours: a try of --threads or --piece-mib): nothing to compare or record")
    ap.add_argument("--piece-mib", type=int, default=PIN_PIECE >> 20,
                    help="our side's pieces: MiB registered at a time")
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides of the recipe")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pin_speed.py measures pinned (CUDA) host memory: run it on a machine with a GPU")
    args.threads = args.threads or saver_threads(args.procs)
    shapes = shard_shapes(args.recipe, args.world, args.set)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.procs), ctx.Queue()
    with tempfile.TemporaryDirectory() as store:
        args.store = store
        procs = [ctx.Process(target=worker, args=(i, args, shapes, barrier, results)) for i in range(args.procs)]
        for p in procs:
            p.start()
        rows = [results.get() for _ in range(args.procs * args.rounds * len(args.sides))]
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a pinning process failed (exit {p.exitcode})")
    for row in sorted(rows, key=lambda r: (r["round"], r["side"], r["proc"])):
        print(json.dumps(row))

    def side(name):
        mine = [r for r in rows if r["side"] == name]
        per_round = [max(r["pin_s"] for r in mine if r["round"] == k) for k in range(args.rounds)]
        return {"pin_s_slowest": per_round, "pin_s_median": round(statistics.median(per_round), 2),
                "stage_s_median": round(statistics.median(r["stage_s"] for r in mine), 3),
                "loop_rate_while_pinning": min(r["loop_rate_while_pinning"] for r in mine),
                "loop_rate_while_pinning_mean": round(statistics.mean(r["loop_rate_while_pinning"] for r in mine), 3),
                # the loop's time lost to the pinning: seconds it would have needed alone, less the pinning's
                "loop_s_lost_max": round(max(r["pin_s"] * (1 - r["loop_rate_while_pinning"]) for r in mine), 1),
                "loop_longest_gap_s": max(r["loop_longest_gap_s"] for r in mine),
                "shard_gib": mine[0]["shard_gib"], "pinned_gib": mine[0]["pinned_gib"],
                "pin_gib_per_s": round(mine[0]["shard_gib"] / statistics.median(per_round), 2)}

    if len(args.sides) < 2:   # one side alone: its figures, nothing to compare or record
        print(json.dumps(side(args.sides[0])))
        return
    ours, theirs = side("ours"), side("torch")
    metrics = {**ours, "procs": args.procs, "world": args.world, "threads": args.threads, "piece_mib": args.piece_mib,
               "speedup": round(theirs["pin_s_median"] / ours["pin_s_median"], 2)}
    result = common.Result(
        tool="pin_speed", what=f"{args.recipe}-rank-of-{args.world}-pin-{args.procs}-procs", gpu=common.gpu_info(),
        recipe=args.recipe, overrides=args.set, metrics=metrics,
        baseline={"name": "torch _create_cpu_state_dict(pin_memory=True)", "command": None, "metrics": theirs},
        notes=f"{args.procs} processes on one host, each one rank's shard of a {args.world}-way FSDP state; "
              f"our side with {args.threads} threads per process, pieces of {args.piece_mib} MiB")
    common.emit(result, record=args.record)


if __name__ == "__main__":
    main()
