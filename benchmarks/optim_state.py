"""AdamW's moments stored in fp32 against bf16 (optim.state_dtype): the same run twice, losses side by side.

    PYTHONPATH=src python benchmarks/optim_state.py --recipe tiny --steps 300 --set optim.name=adamw --record
    PYTHONPATH=src python benchmarks/optim_state.py --recipe moe-gpt2-125m --data /tmp/corpus/modded/pyc \
        --nproc 2 --steps 300 --set model.moe.num_experts=128 model.moe.expert_parallel=2 optim.warmup_steps=30 \
        train.eval_tokens=1048576 --record

Each side runs the real loop (trainbox.train.loop.Trainer; with --nproc N, `trainbox train --nproc N`) for --steps
steps from the same seed and batches, every step logged, no checkpoint, one evaluation at the end on
train.eval_tokens of validation data; only optim.state_dtype differs. Per side: the final training loss, the mean
over the last tenth of the steps, the closing validation loss, the median step time and the peak memory
(GPU); and the largest gap between the two loss curves. The MoE command above: 128 experts (7.3B parameters) split
over 2 GPUs, where both sides fit the recipe's micro-batch on H200s (`trainbox plan ... --gpu H200 --nproc 2`), the
warm-up cut to 30 steps so that 300 steps reach the full learning rate. The last output is the result record
(common.Result, the fp32 side its baseline); --record also writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import common
from common import bench_config, bench_overrides, run_events

# the runs end with one evaluation and write no checkpoint: only the two curves and their memory differ
FIXED = ["train.eval_every=0", "train.checkpoints=false", "train.sample_tokens=0", "monitor.enabled=false"]


def run_side(recipe: str, steps: int, overrides: list[str], nproc: int) -> dict:
    """One run with `overrides` -> its loss curve, closing validation loss, step time and peak memory."""
    import torch

    from trainbox.train.loop import Trainer

    cfg = bench_config(recipe, steps, [*FIXED, *overrides], prefix="optim-state-")
    if nproc > 1:   # `trainbox train --nproc N` as a user runs it; the figures come back from metrics.jsonl
        args = bench_overrides(steps, str(cfg.run.dir), [*FIXED, *overrides])
        subprocess.run([sys.executable, "-m", "trainbox", "train", "--nproc", str(nproc), recipe, *args], check=True)
        val = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        val_loss = next((e["val_loss"] for e in reversed(val) if e.get("event") == "eval"), None)
    else:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        val_loss = Trainer(cfg).run().get("val_loss")
    _, train = run_events(cfg)
    losses = [e["loss"] for e in train]
    tail = max(1, len(losses) // 10)
    times = [b["time"] - a["time"] for a, b in zip(train, train[1:])][min(5, len(train) // 10):]
    mem = [e["peak_mem_gib"] for e in train if "peak_mem_gib" in e]
    return {"final_loss": round(losses[-1], 4), "last_tenth_mean_loss": round(statistics.mean(losses[-tail:]), 4),
            "val_loss": round(val_loss, 4) if val_loss is not None else None,
            "median_step_ms": round(1e3 * statistics.median(times), 1) if times else None,
            "peak_mem_gib": max(mem) if mem else None, "losses": [round(x, 4) for x in losses]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--data", help="token-file prefix for data.path (the recipe's own without it)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs): `trainbox train --nproc N`")
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides for both sides")
    ap.add_argument("--notes", default="", help="what the record should say about the machine")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-optim-state-bf16)")
    args = ap.parse_args()
    overrides = [*([f"data.path={args.data}"] if args.data else []), *args.set]
    sides = {}
    for dtype in ("fp32", "bf16"):
        sides[dtype] = run_side(args.recipe, args.steps, [*overrides, f"optim.state_dtype={dtype}"], args.nproc)
        print(json.dumps({"state_dtype": dtype, **{k: v for k, v in sides[dtype].items() if k != "losses"}}),
              file=sys.stderr, flush=True)
    fp32, bf16 = sides["fp32"], sides["bf16"]
    gaps = [abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])]
    metrics = {**bf16, "max_loss_gap": round(max(gaps), 4),
               "val_loss_minus_fp32": round(bf16["val_loss"] - fp32["val_loss"], 4)
               if None not in (bf16["val_loss"], fp32["val_loss"]) else None, "nproc": args.nproc}
    common.emit(common.Result(
        tool="optim_state", what=args.what or f"{args.recipe}-optim-state-bf16", gpu=common.gpu_info(),
        recipe=args.recipe, overrides=[*overrides, "optim.state_dtype=bf16"], notes=args.notes,
        baseline={"name": "the same run with optim.state_dtype=fp32", "command": None, "metrics": fp32},
        metrics=metrics), args.record)


if __name__ == "__main__":
    main()
