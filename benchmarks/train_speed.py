"""Training speed of any recipe, as one JSON line (speed goals live here, never in tests).

    python benchmarks/train_speed.py gpt2-125m --data /tmp/corpus/modded/pyc --steps 30 [key=value ...]
    python benchmarks/train_speed.py gpt2-125m --data ... --nanogpt /path/to/nanoGPT --nanogpt-data DIR

Runs the real loop (trainbox.train.loop.Trainer) with monitor.log_every=1, so every step ends in one
host sync and the metrics.jsonl timestamps of consecutive steps are step times. Prints: GPU, torch,
commit, recipe, tokens per step, median step ms after warm-up, tokens/s, MFU, compile (first-step)
seconds, peak memory, and the validation loss of the run's closing evaluation (train.eval_tokens).
With --nanogpt it also runs nanoGPT's train.py (code present locally, never committed) on the same
token stream and prints its line (step time and validation loss), parsed from nanoGPT's own log.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bench_config(recipe: str, steps: int, overrides: list[str], prefix: str = "speed-"):
    """The recipe for a measured run of `steps` steps in a temporary run directory: every step logged (one
    host sync each, so consecutive metrics.jsonl timestamps are step times), no evaluation, checkpoint or
    sample before the end, the monitor on a free port."""
    from trainbox.config import load_config
    return load_config(recipe, [f"train.max_steps={steps}", "monitor.log_every=1", "train.eval_every=0",
                                "train.checkpoint_every=0", "train.sample_tokens=0",
                                f"run.dir={tempfile.mkdtemp(prefix=prefix)}", "monitor.port=0", *overrides])


def run_events(cfg) -> tuple[dict, list[dict]]:
    """A finished run's start event and its train events (one per step), from its metrics.jsonl."""
    events = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(e for e in events if e["event"] == "start"), [e for e in events if e["event"] == "train"]


def run_ours(recipe: str, data: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    import torch

    from trainbox.runs import _git_commit
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
        "who": "trainbox", "recipe": recipe, "gpu": gpu, "torch": torch.__version__, "commit": _git_commit(),
        "overrides": overrides, "tokens_per_step": tokens, "steps": steps, "median_step_ms": round(step_s * 1e3, 2),
        "tokens_per_s": round(tokens / step_s), "mfu": round(trainer.flops_per_token * tokens / step_s / peak, 4) if peak else None,
        "flops_per_token": trainer.flops_per_token,
        "first_step_s": round(train[0]["time"] - start["time"], 1), "wall_s": round(time.time() - t0, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "final_loss": train[-1]["loss"], "val_loss": summary.get("val_loss"), "val_tokens": summary.get("val_tokens"),
        "losses": [round(e["loss"], 4) for e in train],  # every step's training loss: where a bad seed went wrong
    }


NANOGPT_SEED = "torch.manual_seed(1337 + seed_offset)"  # nanoGPT's train.py fixes its seed in this line


def seeded_script(repo: str, seed: int) -> str:
    """A copy of nanoGPT's train.py beside it with the seed `seed` (its config has no seed key); -> its name.
    It stays in the local peer checkout, which is never committed."""
    text = (Path(repo) / "train.py").read_text()
    if NANOGPT_SEED not in text:
        raise SystemExit(f"{repo}/train.py has no line {NANOGPT_SEED!r}: cannot set nanoGPT's seed")
    name = f"train_seed{seed}_{os.getpid()}.py"
    (Path(repo) / name).write_text(text.replace(NANOGPT_SEED, f"torch.manual_seed({seed} + seed_offset)"))
    return name


def run_nanogpt(repo: str, data_dir: str, steps: int, warmup: int, extra: list[str], seed: int = 1337,
                env: dict | None = None) -> dict:
    """nanoGPT's train.py on DATA_DIR/{train,val}.bin (GPT-2 124M defaults), parsed from its log; a seed
    other than its own 1337 runs from a copy with that seed (seeded_script). `env` (default: this process's)
    is the run's environment, e.g. with CUDA_VISIBLE_DEVICES; several runs may share one checkout at once."""
    out_dir = tempfile.mkdtemp(prefix="nanogpt-out-")
    # nanoGPT reads data/<dataset>/ relative to its own folder: point it at ours through a symlink of this
    # run's own (a shared name would be replaced under a run that is reading it)
    dataset = f"bench-{os.getpid()}-{seed}"
    link = Path(repo) / "data" / dataset
    link.unlink(missing_ok=True)
    link.symlink_to(Path(data_dir).resolve())
    script = "train.py" if seed == 1337 else seeded_script(repo, seed)
    args = [sys.executable, script, f"--dataset={dataset}", f"--max_iters={steps}", "--eval_interval=100000",
            "--log_interval=1", "--eval_iters=1", "--always_save_checkpoint=False", f"--out_dir={out_dir}",
            *extra]
    t0 = time.time()
    try:
        proc = subprocess.run(args, cwd=repo, env=env or {**os.environ}, capture_output=True, text=True)
    finally:
        link.unlink(missing_ok=True)
        shutil.rmtree(out_dir, ignore_errors=True)  # nanoGPT's checkpoint of the final eval (1.5 GB for 124M)
        if script != "train.py":
            (Path(repo) / script).unlink(missing_ok=True)
    out = proc.stdout + proc.stderr
    iters = [(int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4)))
             for m in re.finditer(r"iter (\d+): loss ([\d.]+), time ([\d.]+)ms, mfu (-?[\d.]+)%", out)]
    if not iters:
        return {"who": "nanogpt", "seed": seed, "error": out[-2000:]}
    times = [t for _, _, t, _ in iters][warmup:]
    evals = {int(m.group(1)): float(m.group(2))
             for m in re.finditer(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", out)}
    return {"who": "nanogpt", "seed": seed, "median_step_ms": statistics.median(times), "final_loss": iters[-1][1],
            "mfu_reported": iters[-1][3], "first_step_ms": iters[0][2], "wall_s": round(time.time() - t0, 1),
            "val_loss": evals.get(steps), "evals": evals, "losses": [loss for _, loss, _, _ in iters]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--data", required=True, help="token-file prefix for data.path")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--nanogpt", help="path to a nanoGPT checkout (baseline)")
    ap.add_argument("--nanogpt-data", help="folder with nanoGPT's train.bin / val.bin")
    ap.add_argument("--nanogpt-args", default="", help='one string, e.g. "--batch_size=16 --gradient_accumulation_steps=30"')
    ap.add_argument("--nanogpt-seed", type=int, default=1337, help="nanoGPT's seed (its train.py fixes 1337)")
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


if __name__ == "__main__":
    main()
