"""Compile-cache benchmark: run a recipe twice with the same TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR and
report how long each run spent compiling (the containers keep these directories on a volume, so only the
first run of an image should pay for compilation). Needs a GPU for a meaningful number.

    python benchmarks/compile_cache.py speedrun-124m train.max_steps=20 --cache /tmp/tb-compile-cache [--record]

Compile time of a run = wall time of its first optimizer step (where torch.compile traces, lowers and
autotunes; the loop's "compiling" phase) minus the median time of its later steps. Both runs start from a
fresh run directory (resume=never) with an EMPTY cache directory for the first run. Prints one JSON object:
{"first_compile_s", "second_compile_s", "speedup", ...}, then the result record (common.Result: the second run
measured, the cold first run its baseline); --record also writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common


def first_step_and_median(metrics: Path) -> tuple[float, float, float]:
    """Timestamps of the step events in metrics.jsonl -> (time to the first step from the loop's start,
    median step, the first step's end as a wall-clock time)."""
    start, steps = None, []
    for line in metrics.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") == "start" and start is None:
            start = ev["time"]
        elif ev.get("event") == "train" and "time" in ev:
            steps.append((ev["step"], ev["time"]))
    if start is None or len(steps) < 3:
        raise SystemExit(f"{metrics} has too few step events: use monitor.log_every=1 and >= 5 steps")
    first = steps[0][1] - start
    per_step = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(steps[1:], steps[2:])]
    return first, statistics.median(per_step), steps[0][1]


def one_run(recipe: str, overrides: list[str], run_dir: Path, cache: Path, name: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    cmd = [sys.executable, "-m", "trainbox", "train", recipe, *overrides, "train.compile=true", "monitor.log_every=1",
           "train.eval_every=0", "train.checkpoint_every=0", "train.sample_tokens=0", "run.resume=never",
           f"run.dir={run_dir}", f"run.name={name}"]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    first, median, first_end = first_step_and_median(run_dir / name / "metrics.jsonl")
    # launch_to_first_step_s: from starting the process to its first optimizer step done (imports, data,
    # model, compilation or the cache's loading, the step itself): how long a (re)start takes to train
    return {"wall_s": round(wall, 2), "launch_to_first_step_s": round(first_end - t0, 2),
            "first_step_s": round(first, 3), "median_step_s": round(median, 4), "compile_s": round(first - median, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default="speedrun-124m")
    p.add_argument("overrides", nargs="*", default=["train.max_steps=20"])
    p.add_argument("--cache", type=Path, default=None, help="cache directory (emptied first; default: a temp dir)")
    p.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    p.add_argument("--what", help="the record's slug (default: RECIPE-compile-cache)")
    args = p.parse_intermixed_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="tb-compile-cache-"))
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="tb-compile-runs-") as runs:
        first = one_run(args.recipe, args.overrides, Path(runs), cache, "cold")
        second = one_run(args.recipe, args.overrides, Path(runs), cache, "warm")
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    result = {"recipe": args.recipe, "overrides": args.overrides, "cache_dir": str(cache),
              "cache_mib": round(size / 2**20, 1), "first_compile_s": first["compile_s"],
              "second_compile_s": second["compile_s"],
              "speedup": round(first["compile_s"] / max(second["compile_s"], 1e-6), 2),
              "first": first, "second": second}
    print(json.dumps(result, indent=1))
    common.emit(common.Result(
        tool="compile_cache", what=args.what or f"{args.recipe}-compile-cache", gpu=common.gpu_info(),
        software=common.software(), recipe=args.recipe, overrides=args.overrides,
        metrics={k: v for k, v in result.items() if k not in ("recipe", "overrides")},
        baseline={"name": "cold start (empty cache)", "command": None, "metrics": first}), args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
