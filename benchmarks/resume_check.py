"""Does a run resumed on another number of GPUs continue where the uninterrupted run goes?

    python benchmarks/resume_check.py llama-1b --data /tmp/corpus/modded/pyc --nproc 2 --resume-nproc 1 \
        --steps 40 --cut 20 train.parallel=fsdp model.vocab_size=128256 --record

Trains RECIPE on --nproc processes for --steps steps with a checkpoint at step --cut (`trainbox train --nproc N`,
as a user runs it), then resumes that checkpoint on --resume-nproc processes with the same command and
`run.resume=` (a sharded checkpoint is resharded to the new world size on load). Prints one JSON object: both
runs' training losses after the cut, their largest and mean absolute difference, and, as the scale that
difference is read against, the mean absolute change of the uninterrupted run's loss from one step to the next
(the step-to-step noise of the batches). --resume-override changes the resumed run only, e.g. its expert layout
(`--nproc 4 --resume-nproc 2 model.moe.expert_parallel=4 --resume-override model.moe.expert_parallel=2`).
On a CPU in fp32 the difference is zero to rounding
(tests/test_fsdp.py holds it to 1e-5); on a GPU in bf16 nondeterministic kernels and a different reduction
order make it small but not zero, and the record keeps both curves to judge it by.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "train":
            out[e["step"]] = e["loss"]
    return out


def train(recipe: str, nproc: int, args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "trainbox", "train", "--nproc", str(nproc), recipe, *args], check=True)


def compare(straight: dict[int, float], resumed: dict[int, float], cut: int, steps: int) -> dict:
    after = [s for s in range(cut + 1, steps + 1) if s in straight and s in resumed]
    if not after:
        raise SystemExit(f"no step after the cut (step {cut}) was logged by both runs")
    diffs = [abs(resumed[s] - straight[s]) for s in after]
    run = [straight[s] for s in sorted(straight)]
    return {"steps_compared": len(after), "max_abs_diff": max(diffs), "mean_abs_diff": statistics.fmean(diffs),
            "step_to_step_change": statistics.fmean(abs(b - a) for a, b in zip(run, run[1:])),
            "straight": [round(straight[s], 5) for s in after], "resumed": [round(resumed[s], 5) for s in after]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--data", required=True, help="token-file prefix for data.path")
    ap.add_argument("--nproc", type=int, default=2, help="processes of the uninterrupted run")
    ap.add_argument("--resume-nproc", type=int, default=1, help="processes of the resumed run")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cut", type=int, default=20, help="the step whose checkpoint is resumed")
    ap.add_argument("--resume-override", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of the resumed run only, repeatable (model.moe.expert_parallel=2: a new "
                         "expert layout)")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-resume-NPROC-to-RESUME_NPROC)")
    args = ap.parse_intermixed_args()
    if not 0 < args.cut < args.steps:
        raise SystemExit(f"--cut {args.cut} must lie between 0 and --steps {args.steps}")
    root = Path(tempfile.mkdtemp(prefix="resume-check-"))
    try:
        common_args = [f"data.path={args.data}", f"train.max_steps={args.steps}", f"train.checkpoint_every={args.cut}",
                       "monitor.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "monitor.port=0",
                       f"run.dir={root}", *args.overrides]
        train(args.recipe, args.nproc, [*common_args, "run.name=straight"])
        cut = root / "straight" / "checkpoints" / f"step_{args.cut:08d}"
        train(args.recipe, args.resume_nproc, [*common_args, "run.name=resumed", f"run.resume={cut}",
                                              *args.resume_override])
        result = compare(losses(root / "straight"), losses(root / "resumed"), args.cut, args.steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"nproc": args.nproc, "resume_nproc": args.resume_nproc, "steps": args.steps, "cut": args.cut,
              "resume_overrides": args.resume_override, **result}
    print(json.dumps(result), flush=True)
    common.emit(common.Result(
        tool="resume_check", what=args.what or f"{args.recipe}-resume-{args.nproc}-to-{args.resume_nproc}",
        gpu=common.gpu_info(), software=common.software(), recipe=args.recipe, overrides=args.overrides,
        metrics=result), args.record)


if __name__ == "__main__":
    main()
