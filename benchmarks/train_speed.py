"""Training speed of any recipe, as JSON lines and a record (speed goals live here, never in tests).

    python benchmarks/train_speed.py gpt2-125m --data /tmp/corpus/modded/pyc --steps 30 [key=value ...]
    python benchmarks/train_speed.py gpt2-125m --data ... --nanogpt /path/to/nanoGPT --nanogpt-data DIR --record
    python benchmarks/train_speed.py gpt2-125m --data ... --nproc 2 train.parallel=fsdp --baseline-overrides \
        train.parallel=ddp --record          # two of our own configurations side by side
    python benchmarks/train_speed.py moe-gpt2-125m --data ... --nproc 2 --memory-gib 80 model.moe.expert_parallel=2 \
        model.moe.exchange=padded --baseline-overrides model.moe.exchange=uneven   # as on 80 GB GPUs

Runs the real loop (trainbox.train.loop.Trainer) with monitor.log_every=1, so every step ends in one
host sync and the metrics.jsonl timestamps of consecutive steps are step times. Prints: GPU, torch,
commit, recipe, tokens per step, median step ms after warm-up, tokens/s, MFU, compile (first-step)
seconds, peak memory next to the memory plan's prediction of it (trainbox.plan, for this device and its
kernels), what each checkpoint added to the step time around it, and the validation loss of the run's
closing evaluation (train.eval_tokens).
With --nanogpt it also runs nanoGPT's train.py (code present locally, never committed) on the same
token stream and prints its line (step time and validation loss), parsed from nanoGPT's own log. The last
output is the result record (common.Result, nanoGPT as its baseline); --record also writes it to
benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time

import common
from common import bench_config, bench_overrides, run_events, run_nanogpt, seeded_script  # noqa: F401 (seeded_script: tests)


def run_ours(recipe: str, data: str, steps: int, warmup: int, overrides: list[str], nproc: int = 1) -> dict:
    import torch

    from trainbox.train.loop import Trainer

    cfg = bench_config(recipe, steps, [f"data.path={data}", *overrides])
    t0 = time.time()
    if nproc > 1:   # `trainbox train --nproc N` as a user runs it; the figures come back from metrics.jsonl
        args = bench_overrides(steps, cfg.run.dir, [f"data.path={data}", *overrides])
        subprocess.run([sys.executable, "-m", "trainbox", "train", "--nproc", str(nproc), recipe, *args], check=True)
        summary = {}
        for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e.get("event") == "eval":
                summary = {"val_loss": e["val_loss"], "val_tokens": e.get("val_tokens")}
        flops_per_token = peak = None
    else:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(cfg)
        summary = trainer.run()   # ends with an evaluation on train.eval_tokens of validation data
        flops_per_token, peak = trainer.flops_per_token, trainer.peak
    start, train = run_events(cfg)
    flops_per_token = start.get("flops_per_token", flops_per_token)
    peak = start.get("peak_flops", peak)
    times = [b["time"] - a["time"] for a, b in zip(train, train[1:])][warmup:]
    step_s = statistics.median(times)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    mem = [e["peak_mem_gib"] for e in train if "peak_mem_gib" in e]
    every, t_of = cfg.train.checkpoint_every, {e["step"]: e["time"] for e in train}
    around = {}   # a save at step s: the longer of the two step times around it, less the median step
    for s in sorted(t_of):
        if every and s % every == 0 and s < steps and {s - 1, s, s + 1} <= t_of.keys():
            longest = max(t_of[s] - t_of[s - 1], t_of[s + 1] - t_of[s])
            around[s] = round((longest - step_s) * 1e3, 1)
    return {
        "who": "trainbox", "recipe": recipe, "gpu": gpu, "torch": torch.__version__, "commit": common.git_state()[0],
        "overrides": overrides, "nproc": nproc, "tokens_per_step": tokens, "steps": steps,
        "median_step_ms": round(step_s * 1e3, 2), "tokens_per_s": round(tokens / step_s),
        "tokens_per_s_per_gpu": round(tokens / step_s / nproc),
        "mfu": round(flops_per_token * tokens / step_s / (peak * nproc), 4) if peak else None,
        "flops_per_token": flops_per_token,
        "first_step_s": round(train[0]["time"] - start["time"], 1), "wall_s": round(time.time() - t0, 1),
        "peak_mem_gib": max(mem) if mem else None,   # the fullest rank's
        "peak_reserved_gib": max((e["peak_reserved_gib"] for e in train if "peak_reserved_gib" in e), default=None),
        "plan_peak_gib": round(planned_peak(cfg, nproc) / 2**30, 2) if torch.cuda.is_available() else None,
        "save_block_ms": around,   # per checkpoint step: what the save added to the step time around it
        "final_loss": train[-1]["loss"], "val_loss": summary.get("val_loss"), "val_tokens": summary.get("val_tokens"),
        "losses": [round(e["loss"], 4) for e in train],  # every step's training loss: where a bad seed went wrong
        **dropped(train),
    }


def dropped(train: list[dict]) -> dict:
    """An MoE run with a capacity: the share of assignments dropped per logged step, averaged over the MoE layers
    (rank 0's micro-batch; expert parallelism leaves dropped rows out of the exchange, and so out of memory)."""
    per_step = [statistics.mean(v for k, v in e.items() if k.startswith("moe.") and k.endswith(".dropped_frac"))
                for e in train if any(k.endswith(".dropped_frac") for k in e)]
    if not per_step or not any(per_step):
        return {}
    return {"moe_dropped_frac": [round(f, 4) for f in per_step]}


def planned_peak(cfg, nproc: int) -> int:
    """The memory plan's peak_allocated for this run on this machine's GPU (what max_memory_allocated shows)."""
    from trainbox.plan import make_plan, plan_target, run_vocab
    return make_plan(cfg, run_vocab(cfg), plan_target(cfg), nproc).memory.peak_allocated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--data", required=True, help="token-file prefix for data.path")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--nanogpt", help="path to a nanoGPT checkout (baseline)")
    ap.add_argument("--nanogpt-data", help="folder with nanoGPT's train.bin / val.bin")
    ap.add_argument("--nanogpt-args", default="",
                    help='one string, e.g. "--batch_size=16 --gradient_accumulation_steps=30"')
    ap.add_argument("--nanogpt-seed", type=int, default=1337, help="nanoGPT's seed (its train.py fixes 1337)")
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs): `trainbox train --nproc N`")
    ap.add_argument("--baseline-overrides", help='our own run with these overrides instead as the baseline, one '
                                                 'string, e.g. "train.parallel=ddp" (same machine, same call)')
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-train-speed)")
    ap.add_argument("--memory-gib", type=float, help="cap every process's GPU memory at this many GiB "
                                                     "(train.memory_limit_gib), both runs: as on a smaller GPU")
    args = ap.parse_intermixed_args()
    if args.memory_gib:
        args.overrides = [*args.overrides, f"train.memory_limit_gib={args.memory_gib:g}"]
    base = None
    if args.nanogpt:  # first, while this process holds no GPU memory
        base = run_nanogpt(args.nanogpt, args.nanogpt_data, args.steps, args.warmup, shlex.split(args.nanogpt_args),
                           args.nanogpt_seed)
        print(json.dumps(base), flush=True)
    if args.baseline_overrides is not None:
        base = run_ours(args.recipe, args.data, args.steps, args.warmup,
                        [*args.overrides, *shlex.split(args.baseline_overrides)], args.nproc)
        print(json.dumps(base), flush=True)
    result = run_ours(args.recipe, args.data, args.steps, args.warmup, args.overrides, args.nproc)
    print(json.dumps(result), flush=True)
    if base is not None:
        if "median_step_ms" in base:
            name = "baseline" if args.baseline_overrides is not None else "nanogpt"
            print(json.dumps({f"speedup_vs_{name}": round(base["median_step_ms"] / result["median_step_ms"], 3)}))
    skip = ("who", "recipe", "gpu", "torch", "commit", "overrides")
    common.emit(common.Result(
        tool="train_speed", what=args.what or f"{args.recipe}-train-speed", gpu=common.gpu_info(),
        software=common.software(), recipe=args.recipe, overrides=args.overrides,
        metrics={k: v for k, v in result.items() if k not in skip},
        baseline=None if base is None else {
            "name": "trainbox", "command": f"{args.recipe} {' '.join(args.overrides)} {args.baseline_overrides}",
            "metrics": {k: v for k, v in base.items() if k != "who"}} if args.baseline_overrides is not None else {
            "name": "nanoGPT train.py", "command": f"train.py {args.nanogpt_args}".strip(),
            "metrics": {k: v for k, v in base.items() if k != "who"}}), args.record)


if __name__ == "__main__":
    main()
