"""GPU checks of the training loop (run on a 2-GPU machine; prints one JSON object).

    python benchmarks/ddp_check.py DATA_PREFIX [--out DIR] [--steps 100] [--global-batch 128] [--record]

1. world-size invariance: gpt2-125m for --steps steps on 2 GPUs (`trainbox train --nproc 2`) against
   1 GPU with the same global batch (so twice the accumulation). Both consume the same global batches;
   per-step losses should agree within bf16 noise. Speed-up = 1-GPU step time / 2-GPU step time over
   the steps after the first 10 (compilation and warm-up excluded), from metrics.jsonl timestamps.
2. exact resume on GPU: 2 GPUs 0->40 straight (checkpoint at 20), and a second run that starts from a
   copy of that step-20 checkpoint and continues to 40; per-step losses of 21..40 are compared.

DATA_PREFIX is a token-file prefix (PREFIX_train_*.bin, optionally PREFIX_val_*.bin), e.g. FineWeb shards
from `trainbox data fineweb`. Never part of the test suite. The output is the result record (common.Result: the
2-GPU run measured, the 1-GPU run its baseline); --record also writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

RECIPE = ["gpt2-125m"]


def run_train(out: Path, name: str, nproc: int, overrides: list[str], log: Path) -> float:
    cmd = [sys.executable, "-m", "trainbox", "train", *(["--nproc", str(nproc)] if nproc > 1 else []),
           *RECIPE, *overrides, f"run.dir={out}", f"run.name={name}"]
    env = {**os.environ}
    if nproc == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return time.time() - t0


def train_events(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "train"]


def compare(a: list[dict], b: list[dict]) -> dict:
    la = {r["step"]: r["loss"] for r in a}
    lb = {r["step"]: r["loss"] for r in b}
    common = sorted(set(la) & set(lb))
    diffs = [abs(la[s] - lb[s]) for s in common]
    return {"steps_compared": len(common), "max_abs_diff": max(diffs), "mean_abs_diff": statistics.fmean(diffs),
            "bit_identical": all(d == 0 for d in diffs), "final_loss": [la[common[-1]], lb[common[-1]]],
            "first_loss": [la[common[0]], lb[common[0]]]}


def step_time(events: list[dict], skip: int = 10) -> float:
    t = {r["step"]: r["time"] for r in events}
    last = max(t)
    return (t[last] - t[skip]) / (last - skip)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="token-file prefix (PREFIX_train_*.bin)")
    p.add_argument("--out", default="ddp_check_runs")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=128, help="sequences of 1024 tokens per step")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--recipe", default="gpt2-125m", help="(a CPU smoke test of this script uses tiny)")
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides")
    p.add_argument("--no-resume", action="store_true", help="skip check 2 (speed and invariance only)")
    p.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    p.add_argument("--what", help="the record's slug (default: RECIPE-ddp-scaling)")
    args = p.parse_args()
    RECIPE[0] = args.recipe
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    common = [f"data.path={args.data}", f"train.global_batch_size={args.global_batch}",
              f"train.micro_batch_size={args.micro_batch}", "train.eval_every=0", "train.eval_tokens=262144",
              "train.sample_tokens=0", "monitor.log_every=1", "monitor.port=0", "optim.warmup_steps=10",
              f"train.compile={'false' if args.no_compile else 'true'}", *args.set]
    report: dict = {"recipe": args.recipe, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                    "compile": not args.no_compile}

    length = [f"train.max_steps={args.steps}", "train.checkpoint_every=0"]
    wall2 = run_train(out, "gpu2", 2, [*common, *length], out / "gpu2.log")
    wall1 = run_train(out, "gpu1", 1, [*common, *length], out / "gpu1.log")
    e2, e1 = train_events(out / "gpu2"), train_events(out / "gpu1")
    report["world_size_invariance"] = {
        **compare(e1, e2), "accum_1gpu": args.global_batch // args.micro_batch,
        "accum_2gpu": args.global_batch // (2 * args.micro_batch),
        "step_time_s_1gpu": step_time(e1), "step_time_s_2gpu": step_time(e2),
        "speedup_2gpu": step_time(e1) / step_time(e2),
        "tokens_per_s_1gpu": e1[-1]["tokens"] / e1[-1]["step"] / step_time(e1),
        "tokens_per_s_2gpu": e2[-1]["tokens"] / e2[-1]["step"] / step_time(e2),
        "wall_s": {"1gpu": wall1, "2gpu": wall2}}

    if args.no_resume:
        print(json.dumps(report, indent=1))
        (out / "ddp_check.json").write_text(json.dumps(report, indent=1))
        emit(report, args)
        return
    run_train(out, "straight", 2, [*common, "train.max_steps=40", "train.checkpoint_every=20",
                                   "train.keep_last=5"], out / "straight.log")
    ckpt = out / "straight" / "checkpoints" / "step_00000020"
    (out / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, out / "resumed" / "checkpoints" / ckpt.name)
    run_train(out, "resumed", 2, [*common, "train.max_steps=40", "train.checkpoint_every=20", "train.keep_last=5"],
              out / "resumed.log")
    resumed = train_events(out / "resumed")
    assert resumed[0]["step"] == 21, "the second run did not resume from step 20"
    report["gpu_exact_resume"] = compare(train_events(out / "straight"), resumed)
    print(json.dumps(report, indent=1))
    (out / "ddp_check.json").write_text(json.dumps(report, indent=1))
    emit(report, args)


def emit(report: dict, args) -> None:
    """The result record: 2 GPUs measured, 1 GPU with the same global batch its baseline."""
    inv = report["world_size_invariance"]
    common.emit(common.Result(
        tool="ddp_check", what=args.what or f"{args.recipe}-ddp-scaling", gpu=common.gpu_info(),
        software=common.software(), recipe=args.recipe, overrides=args.set, metrics=report,
        baseline={"name": "1 GPU, same global batch", "command": None,
                  "metrics": {"tokens_per_s": inv["tokens_per_s_1gpu"], "step_time_s": inv["step_time_s_1gpu"],
                              "accum": inv["accum_1gpu"]}}), args.record)


if __name__ == "__main__":
    main()
