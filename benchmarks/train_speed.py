"""Training speed of any recipe, as JSON lines and a record (speed goals live here, never in tests).

    python benchmarks/train_speed.py gpt2-125m --data /tmp/corpus/modded/pyc --steps 30 [key=value ...]
    python benchmarks/train_speed.py gpt2-125m --data ... --nanogpt /path/to/nanoGPT --nanogpt-data DIR --record

Runs the real loop (trainbox.train.loop.Trainer) with monitor.log_every=1, so every step ends in one
host sync and the metrics.jsonl timestamps of consecutive steps are step times. Prints: GPU, torch,
commit, recipe, tokens per step, median step ms after warm-up, tokens/s, MFU, compile (first-step)
seconds, peak memory next to the memory plan's prediction of it (trainbox.plan, for this device and its
kernels), and the validation loss of the run's closing evaluation (train.eval_tokens).
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
import time

import common
from common import bench_config, run_events, run_nanogpt, seeded_script  # noqa: F401 (seeded_script: tests)


def run_ours(recipe: str, data: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    import torch

    from trainbox.train.loop import Trainer

    cfg = bench_config(recipe, steps, [f"data.path={data}", *overrides])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    trainer = Trainer(cfg)
    summary = trainer.run()   # ends with an evaluation on train.eval_tokens of validation data
    start, train = run_events(cfg)
    times = [b["time"] - a["time"] for a, b in zip(train, train[1:])][warmup:]
    step_s = statistics.median(times)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    peak = trainer.peak
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "who": "trainbox", "recipe": recipe, "gpu": gpu, "torch": torch.__version__, "commit": common.git_state()[0],
        "overrides": overrides, "tokens_per_step": tokens, "steps": steps, "median_step_ms": round(step_s * 1e3, 2),
        "tokens_per_s": round(tokens / step_s),
        "mfu": round(trainer.flops_per_token * tokens / step_s / peak, 4) if peak else None,
        "flops_per_token": trainer.flops_per_token,
        "first_step_s": round(train[0]["time"] - start["time"], 1), "wall_s": round(time.time() - t0, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "plan_peak_gib": round(planned_peak(trainer) / 2**30, 2),
        "final_loss": train[-1]["loss"], "val_loss": summary.get("val_loss"), "val_tokens": summary.get("val_tokens"),
        "losses": [round(e["loss"], 4) for e in train],  # every step's training loss: where a bad seed went wrong
    }


def planned_peak(trainer) -> int:
    """The memory plan's peak_allocated for this run on its device (what max_memory_allocated should show)."""
    from trainbox.train.memory import device_plan
    plan = device_plan(trainer.cfg, trainer.vocab, trainer.device, trainer.dtype, free=2**60,
                       world=trainer.dist.world)
    return plan.memory.peak_allocated


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
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-train-speed)")
    args = ap.parse_intermixed_args()
    base = None
    if args.nanogpt:  # first, while this process holds no GPU memory
        base = run_nanogpt(args.nanogpt, args.nanogpt_data, args.steps, args.warmup, shlex.split(args.nanogpt_args),
                           args.nanogpt_seed)
        print(json.dumps(base), flush=True)
    result = run_ours(args.recipe, args.data, args.steps, args.warmup, args.overrides)
    print(json.dumps(result), flush=True)
    if base is not None:
        if "median_step_ms" in base:
            print(json.dumps({"speedup_vs_nanogpt": round(base["median_step_ms"] / result["median_step_ms"], 3)}))
    skip = ("who", "recipe", "gpu", "torch", "commit", "overrides")
    common.emit(common.Result(
        tool="train_speed", what=args.what or f"{args.recipe}-train-speed", gpu=common.gpu_info(),
        software=common.software(), recipe=args.recipe, overrides=args.overrides,
        metrics={k: v for k, v in result.items() if k not in skip},
        baseline=None if base is None else {
            "name": "nanoGPT train.py", "command": f"train.py {args.nanogpt_args}".strip(),
            "metrics": {k: v for k, v in base.items() if k != "who"}}), args.record)


if __name__ == "__main__":
    main()
