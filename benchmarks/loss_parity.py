"""Is our validation loss no worse than nanoGPT's at equal hyper-parameters? Several seeds a side, one verdict.

    python benchmarks/loss_parity.py gpt2-125m --data /tmp/corpus/modded/pyc --steps 300 --seeds 1337,1,2 \
        --nanogpt .peers/nanoGPT --nanogpt-data /tmp/corpus/nanogpt --nanogpt-seeds 1337,1338,1339 \
        --nanogpt-args '--batch_size=16 --gradient_accumulation_steps=30 --warmup_iters=20
                        --lr_decay_iters=300 --eval_interval=300 --eval_iters=640' optim.warmup_steps=20

One pair of runs cannot answer it: after 200 steps of gpt2-125m nanoGPT's own validation loss ranges from 2.97
to 3.29 over 8 seeds (benchmarks/records/2026-11-27-4xh200-gpt2-125m-step-parity.json). Each side here trains
once per seed, through benchmarks/train_speed.py: ours in its own process with run.seed=S, nanoGPT from a copy of
its train.py with the seed replaced (it fixes torch.manual_seed(1337); the copy lives in the local peer checkout,
never committed, and is removed after the run). Prints one JSON object: every run's validation loss and step
time, each side's mean and standard deviation, the difference of the means (ours - nanoGPT) with its Welch 95%
interval, and a verdict:

    "no worse"      ours' mean is at most nanoGPT's;
    "worse"         the whole interval lies above zero;
    "inconclusive"  neither: more seeds or more steps are needed.

A whole comparison rarely fits one sitting on a lent GPU (each gpt2-125m run of 200 steps takes 4-5 minutes).
`--only ours` / `--only nanogpt` runs one side and prints each run as a JSON line; `--results FILE ...`
then reads the runs from any number of files (JSON lines, other lines skipped, or records) and prints the
comparison. `--record` writes the runs (and the comparison, when there is one) as a record in benchmarks/records/:

    python benchmarks/loss_parity.py gpt2-125m --data ... --seeds 1 --only ours optim.warmup_steps=20 > a.jsonl
    python benchmarks/loss_parity.py --results a.jsonl b.jsonl c.jsonl --record

On a machine of several GPUs, `--gpus 0,1` runs as many seeds at once, each on its own GPU
(CUDA_VISIBLE_DEVICES); the runs are independent, so this changes their wall time only. Every run line
carries its training loss at every step (`losses`), to see where a high seed went wrong.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shlex
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common
from common import run_nanogpt, t975, verdict

HERE = Path(__file__).resolve().parent


def compare(ours: list[float], theirs: list[float]) -> dict:
    """Means, standard deviations, ours - theirs with a Welch 95% interval, and the verdict."""
    if len(ours) < 2 or len(theirs) < 2:
        raise ValueError("need at least two runs a side for a spread")
    m1, m2 = statistics.mean(ours), statistics.mean(theirs)
    v1, v2 = statistics.variance(ours) / len(ours), statistics.variance(theirs) / len(theirs)
    diff, se = m1 - m2, math.sqrt(v1 + v2)
    df = (v1 + v2) ** 2 / (v1 ** 2 / (len(ours) - 1) + v2 ** 2 / (len(theirs) - 1)) if se > 0 else float("inf")
    half = t975(df) * se
    return {"mean": {"ours": round(m1, 4), "nanogpt": round(m2, 4)},
            "stdev": {"ours": round(statistics.stdev(ours), 4), "nanogpt": round(statistics.stdev(theirs), 4)},
            "difference": round(diff, 4), "interval_95": [round(diff - half, 4), round(diff + half, 4)],
            "welch_df": round(df, 1), "verdict": verdict(diff, half)}


def _last_json(out: str, who: str) -> dict:
    for line in reversed(out.splitlines()):
        if line.startswith("{") and f'"who": "{who}"' in line:
            return json.loads(line)
    raise SystemExit(f"no result line from {who}:\n{out[-2000:]}")


def read_results(paths: list[str]) -> list[dict]:
    """The run lines ({"who": "trainbox" | "nanogpt", "val_loss": ...}) in these files (JSON lines or records), in
    order."""
    runs = []
    for where, run in common.read_runs(paths):
        if run.get("who") not in ("trainbox", "nanogpt"):
            continue
        if not isinstance(run.get("val_loss"), (int, float)):
            raise SystemExit(f"{where}: a {run['who']} run without a validation loss: {json.dumps(run)[:300]}")
        runs.append(run)
    return runs


def summary(runs: list[dict], **meta) -> dict:
    ours = [r["val_loss"] for r in runs if r["who"] == "trainbox"]
    theirs = [r["val_loss"] for r in runs if r["who"] == "nanogpt"]
    if len(ours) < 2 or len(theirs) < 2:
        raise SystemExit(f"need at least two runs a side, got {len(ours)} of ours and {len(theirs)} of nanoGPT's")
    return {"benchmark": "loss_parity", **meta,
            "runs": [{k: r.get(k) for k in ("who", "seed", "val_loss", "median_step_ms")} for r in runs],
            **compare(ours, theirs)}


def val_coverage(runs: list[dict], nanogpt_data: str) -> float:
    """The share of the validation tokens our runs evaluated (the first train.eval_tokens of them, in order;
    nanoGPT averages random windows of all of them, so anything short of all compares different text)."""
    total = (Path(nanogpt_data) / "val.bin").stat().st_size // 2  # uint16 tokens
    return min(r.get("val_tokens") or 0 for r in runs if r["who"] == "trainbox") / max(1, total)


def run_on_gpus(jobs: list, gpus: list[str]) -> list:
    """Call each job(env) with this process's environment, at most len(gpus) at once, each while it holds one
    GPU (CUDA_VISIBLE_DEVICES=that GPU), which no other job holds meanwhile; results in the order of `jobs`.
    No GPUs: one job after another in the environment as it is."""
    if not gpus:
        return [job({**os.environ}) for job in jobs]
    free: queue.Queue = queue.Queue()
    for gpu in gpus:
        free.put(gpu)

    def run(job):
        gpu = free.get()
        try:
            return job({**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
        finally:
            free.put(gpu)

    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        return list(pool.map(run, jobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?")
    ap.add_argument("overrides", nargs="*", help="key=value for our runs (nanoGPT takes --nanogpt-args)")
    ap.add_argument("--results", nargs="+", metavar="FILE", help="compare the run lines saved in these files")
    ap.add_argument("--only", choices=["ours", "nanogpt"], help="run one side and print its run lines")
    ap.add_argument("--data", help="token-file prefix for data.path")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time median")
    ap.add_argument("--seeds", default="1337,1,2", help="our seeds (run.seed), comma-separated")
    ap.add_argument("--nanogpt", help="path to a nanoGPT checkout")
    ap.add_argument("--nanogpt-data", help="folder with nanoGPT's train.bin / val.bin")
    ap.add_argument("--nanogpt-seeds", default="1337,1338,1339")
    ap.add_argument("--nanogpt-args", default="")
    ap.add_argument("--gpus", default="", help="GPU ids, comma-separated: run that many seeds at once, one per GPU")
    ap.add_argument("--record", action="store_true", help="write the runs (and comparison) to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-loss-parity)")
    args = ap.parse_intermixed_args()
    if args.results:
        runs = read_results(args.results)
        print(json.dumps(summary(runs, results=args.results)))
        if args.record:
            recipe = args.recipe or next((r["recipe"] for r in runs if r.get("recipe")), None)
            record(runs, recipe, args, common.measured_where(args.results))
        return
    need = {"recipe": args.recipe, "--data": args.data} if args.only != "nanogpt" else {}
    if args.only != "ours":
        need.update({"--nanogpt": args.nanogpt, "--nanogpt-data": args.nanogpt_data})
    if missing := [k for k, v in need.items() if not v]:
        ap.error(f"{', '.join(missing)} required (or --results FILE ... to compare saved runs)")
    warmup = min(args.warmup, args.steps // 2)
    printed = threading.Lock()

    def report(res: dict) -> dict:
        with printed:
            print(json.dumps(res), file=sys.stdout if args.only else sys.stderr, flush=True)
        return res

    def nanogpt_job(seed: int):
        def job(env: dict) -> dict:
            res = run_nanogpt(args.nanogpt, args.nanogpt_data, args.steps, warmup, shlex.split(args.nanogpt_args),
                              seed, env=env)
            if "error" in res or res.get("val_loss") is None:
                raise SystemExit(f"nanoGPT seed {seed} gave no validation loss at step {args.steps} "
                                 f"(set --eval_interval={args.steps} in --nanogpt-args): {res.get('error', '')[-500:]}")
            return report(res)
        return job

    def ours_job(seed: int):
        def job(env: dict) -> dict:  # one process each
            cmd = [sys.executable, str(HERE / "train_speed.py"), args.recipe, "--data", args.data, "--steps",
                   str(args.steps), "--warmup", str(warmup), *args.overrides, f"run.seed={seed}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            return report({**_last_json(proc.stdout + proc.stderr, "trainbox"), "seed": seed})
        return job

    jobs = [nanogpt_job(int(s)) for s in args.nanogpt_seeds.split(",")] if args.only != "ours" else []
    jobs += [ours_job(int(s)) for s in args.seeds.split(",")] if args.only != "nanogpt" else []
    runs = run_on_gpus(jobs, [g for g in args.gpus.split(",") if g])
    if not args.only:
        cover = val_coverage(runs, args.nanogpt_data)
        if cover < 0.95:  # a prefix of the validation text need not be as hard as the whole
            print(f"warning: our runs evaluated {cover:.1%} of the validation tokens; nanoGPT's random windows "
                  f"cover all of them: raise train.eval_tokens", file=sys.stderr)
        print(json.dumps(summary(runs, recipe=args.recipe, steps=args.steps, overrides=args.overrides,
                                 nanogpt_args=args.nanogpt_args, our_val_coverage=round(cover, 4))))
    if args.record:
        record(runs, args.recipe, args)


def record(runs: list[dict], recipe: str | None, args, where: dict | None = None) -> None:
    """The runs (every line, per-step losses included) and, with two or more a side, their comparison, as a result
    record in benchmarks/records/; nanoGPT's runs are the baseline. `where`: Result fields of the machine the runs
    ran on (default: this one)."""
    where = where or {"gpu": common.gpu_info(), "software": common.software()}
    sides = {who: [r for r in runs if r["who"] == who] for who in ("trainbox", "nanogpt")}
    both = all(len(v) >= 2 for v in sides.values())
    comparison = {k: v for k, v in summary(runs).items() if k not in ("benchmark", "runs")} if both else None
    nano = [r["val_loss"] for r in sides["nanogpt"]]
    common.emit(common.Result(
        tool="loss_parity", what=args.what or f"{recipe or 'nanogpt'}-loss-parity", **where,
        recipe=recipe, overrides=list(args.overrides),
        baseline={"name": "nanoGPT train.py", "command": f"train.py {args.nanogpt_args}".strip(),
                  "metrics": {"seeds": [r["seed"] for r in sides["nanogpt"]], "val_loss": nano}} if nano else None,
        metrics={"comparison": comparison, "runs": runs}), record=True)


if __name__ == "__main__":
    main()
