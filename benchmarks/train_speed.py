"""Training speed of any recipe, as JSON lines and a record (speed goals live here, never in tests).

    python benchmarks/train_speed.py gpt2-125m --data /tmp/corpus/modded/pyc --steps 30 [key=value ...]
    python benchmarks/train_speed.py gpt2-125m --data ... --nanogpt /path/to/nanoGPT --nanogpt-data DIR --record
    python benchmarks/train_speed.py gpt2-125m --data ... --nproc 2 train.parallel=fsdp --baseline-overrides \
        train.parallel=ddp --record          # two of our own configurations side by side
    python benchmarks/train_speed.py moe-gpt2-125m --data ... --nproc 2 --memory-gib 80 model.moe.expert_parallel=2 \
        model.moe.exchange=padded --baseline-overrides model.moe.exchange=uneven   # as on 80 GB GPUs
    python benchmarks/train_speed.py llama-1b --data ... --nproc 2 train.parallel=fsdp train.micro_batch_size=2 \
        train.global_batch_size=4 model.llama.tie_embeddings=false model.vocab_size=128256 --titan= --record

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
With --titan="ARGS" the baseline is torchtitan (the installed package) through benchmarks/titan_speed.py, run
first on the same recipe, overrides, data, GPU count, steps and warm-up, ARGS added to its command line (e.g.
--titan="--local-batch 24"; the `=` because the string starts with a dash). The ratio is our tokens/s per GPU
over its; the record's software names its version.
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
    every_step = [b["time"] - a["time"] for a, b in zip(train, train[1:])]
    step_s = statistics.median(every_step[warmup:])
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    drops = dropped(train)
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
        # what a long run sees beside the median: stalls (a save, a collection, a straggling rank) raise these
        "mean_step_ms": round(statistics.mean(every_step[warmup:]) * 1e3, 2),
        "slowest_step_ms": round(max(every_step[warmup:]) * 1e3, 2),
        "tokens_per_s_per_gpu": round(tokens / step_s / nproc),
        "mfu": round(flops_per_token * tokens / step_s / (peak * nproc), 4) if peak else None,
        "flops_per_token": flops_per_token,
        "first_step_s": round(train[0]["time"] - start["time"], 1), "wall_s": round(time.time() - t0, 1),
        "peak_mem_gib": max(mem) if mem else None,   # the fullest rank's
        "peak_reserved_gib": max((e["peak_reserved_gib"] for e in train if "peak_reserved_gib" in e), default=None),
        "plan_peak_gib": round(planned_peak(cfg, nproc) / 2**30, 2) if torch.cuda.is_available() else None,
        "save_block_ms": around,   # per checkpoint step: what the save added to the step time around it
        "step_s": [round(t, 3) for t in every_step],   # every step's time after the first: where training stood
        "final_loss": train[-1]["loss"], "val_loss": summary.get("val_loss"), "val_tokens": summary.get("val_tokens"),
        "losses": [round(e["loss"], 4) for e in train],  # every step's training loss: where a bad seed went wrong
        **drops,
        **settled(drops.get("moe_dropped_frac"), every_step, warmup,
                  flops_per_token * tokens / (peak * nproc) if peak else None),
    }


def dropped(train: list[dict]) -> dict:
    """An MoE run with a capacity: the share of assignments dropped per logged step, averaged over the MoE layers
    (rank 0's micro-batch; expert parallelism leaves dropped rows out of the exchange, and so out of memory)."""
    per_step = [statistics.mean(v for k, v in e.items() if k.startswith("moe.") and k.endswith(".dropped_frac"))
                for e in train if any(k.endswith(".dropped_frac") for k in e)]
    if not per_step or not any(per_step):
        return {}
    return {"moe_dropped_frac": [round(f, 4) for f in per_step]}


SETTLED = 0.10   # a step whose router drops at most this share of the assignments


def settled(drops: list[float] | None, every_step: list[float], warmup: int, mfu_seconds: float | None) -> dict:
    """An MoE run with a capacity (`drops`: `dropped`'s share per step, every step logged): the median step over the
    steps after the warm-up whose router dropped at most SETTLED of the assignments. Expert parallelism computes only
    the kept ones, so the first steps of a run, before the balance loss spreads the tokens, run faster than the run
    will: the median alone would flatter it."""
    if not drops or len(drops) != len(every_step) + 1:
        return {}
    times = [t for i, t in enumerate(every_step) if i >= warmup and drops[i + 1] <= SETTLED]
    if not times:
        return {"settled_steps": 0}
    step = statistics.median(times)
    return {"settled_steps": len(times), "settled_median_step_ms": round(step * 1e3, 2),
            "settled_mfu": round(mfu_seconds / step, 4) if mfu_seconds else None}


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
    ap.add_argument("--titan", help='torchtitan as the baseline: benchmarks/titan_speed.py with these extra '
                                    'arguments, one string after `=`, e.g. --titan="--local-batch 24" (--titan= '
                                    'for none)')
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-train-speed)")
    ap.add_argument("--memory-gib", type=float, help="cap every process's GPU memory at this many GiB "
                                                     "(train.memory_limit_gib), both runs: as on a smaller GPU")
    ap.add_argument("--templates", choices=common.TEMPLATE_KINDS,
                    help="an experiment: Inductor's GEMM autotuning for these matmuls (common.inductor_templates), "
                         "in our run only, after any baseline; one process (--nproc 1)")
    ap.add_argument("--template-backends", default="TRITON", help="with --templates: TRITON or ATEN,TRITON")
    args = ap.parse_intermixed_args()
    if args.templates and args.nproc != 1:
        ap.error("--templates changes this process's compiler: --nproc 1")
    if sum(x is not None for x in (args.nanogpt, args.titan, args.baseline_overrides)) > 1:
        ap.error("one baseline a run: --nanogpt, --titan or --baseline-overrides")
    if args.memory_gib:
        args.overrides = [*args.overrides, f"train.memory_limit_gib={args.memory_gib:g}"]
    base = None
    if args.nanogpt:  # first, while this process holds no GPU memory
        base = run_nanogpt(args.nanogpt, args.nanogpt_data, args.steps, args.warmup, shlex.split(args.nanogpt_args),
                           args.nanogpt_seed)
        print(json.dumps(base), flush=True)
    if args.titan is not None:   # first too, and in its own processes (torchrun)
        base = run_titan(args)
        print(json.dumps(base), flush=True)
    if args.baseline_overrides is not None:
        base = run_ours(args.recipe, args.data, args.steps, args.warmup,
                        [*args.overrides, *shlex.split(args.baseline_overrides)], args.nproc)
        print(json.dumps(base), flush=True)
    if args.templates:
        common.inductor_templates(args.templates, args.template_backends)
    result = run_ours(args.recipe, args.data, args.steps, args.warmup, args.overrides, args.nproc)
    print(json.dumps(result), flush=True)
    skip = ("who", "recipe", "gpu", "torch", "commit", "overrides")
    metrics = {k: v for k, v in result.items() if k not in skip}
    if base is not None and base.get("who") == "torchtitan":
        metrics["speedup_vs_torchtitan"] = round(result["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)
        print(json.dumps({"speedup_vs_torchtitan": metrics["speedup_vs_torchtitan"]}))
    elif base is not None and "median_step_ms" in base:
        name = "baseline" if args.baseline_overrides is not None else "nanogpt"
        print(json.dumps({f"speedup_vs_{name}": round(base["median_step_ms"] / result["median_step_ms"], 3)}))
    common.emit(common.Result(
        tool="train_speed", what=args.what or f"{args.recipe}-train-speed", gpu=common.gpu_info(),
        software=common.software(*(["torchtitan"] if args.titan is not None else [])), recipe=args.recipe,
        overrides=args.overrides, metrics=metrics, baseline=baseline(args, base)), args.record)


def baseline(args, base: dict | None) -> dict | None:
    """The record's baseline: name, command and metrics of the run beside ours."""
    if base is None:
        return None
    if base.get("who") == "torchtitan":   # its name and command say which torchtitan ran, and how
        return {"name": base["name"], "command": base["command"],
                "metrics": {k: v for k, v in base.items() if k not in ("who", "name", "command")}}
    metrics = {k: v for k, v in base.items() if k != "who"}
    if args.baseline_overrides is not None:
        return {"name": "trainbox", "command": f"{args.recipe} {' '.join(args.overrides)} {args.baseline_overrides}",
                "metrics": metrics}
    return {"name": "nanoGPT train.py", "command": f"train.py {args.nanogpt_args}".strip(), "metrics": metrics}


def titan_command(args) -> list[str]:
    """benchmarks/titan_speed.py on our run's recipe, overrides, data, GPU count, steps and warm-up, then the
    --titan arguments (later flags win)."""
    return [sys.executable, str(common.HERE / "titan_speed.py"), args.recipe, "--data", args.data,
            "--ngpu", str(args.nproc), "--steps", str(args.steps), "--warmup", str(args.warmup), *args.overrides,
            *shlex.split(args.titan)]


def run_titan(args) -> dict:
    """torchtitan's run (titan_speed.py's JSON line, its last output line)."""
    proc = subprocess.run(titan_command(args), stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
