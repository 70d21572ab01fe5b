"""GPU check of the pretraining families: short bf16 + torch.compile runs through the real training loop.

    python benchmarks/gpu_models_check.py --data data/fineweb10B/fineweb            # shard-file prefix
    python benchmarks/gpu_models_check.py --data PREFIX --runs gpt2-125m --steps 100 --batch 32

Each run is `trainbox train RECIPE` for `--steps` steps (global batch `--batch` x 1024 tokens, micro-batch
16, bf16 autocast, compiled) in its own process, so compile caches and peak memory never mix. The
numbers come from the run's own metrics.jsonl (the loop's tokens/s and MFU, first window with
compilation excluded) and the process's torch.cuda.max_memory_allocated. Prints one JSON object.
Runs: gpt2-125m and moe-gpt2-125m (8 experts, top-2, dropless) by default; `--runs moe-128e` adds the
issue's command (128 experts, capacity factor 2, lb weight 0.05) with MoE in every 4th block so that it
fits one GPU. Always adds a bf16 check of the grouped-matmul MoE layer against its loop-over-experts path.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "gpt2-125m": ("gpt2-125m", []),
    "moe-gpt2-125m": ("moe-gpt2-125m", []),
    # the command with MoE in every 4th block: all 12 would be 7.3B parameters, ~117 GB of fp32
    # weights, gradients and AdamW states, more than one GPU holds (DDP replicates; nothing shards them)
    "moe-128e": ("moe-gpt2-125m", ["model.moe.num_experts=128", "model.moe.capacity_factor=2", "model.moe.top_k=2",
                                   "model.moe.lb_loss_weight=0.05", "train.micro_batch_size=16", "model.moe.every=4"]),
}
DEFAULT_RUNS = ["gpt2-125m", "moe-gpt2-125m"]


def one_run(recipe: str, extra: list[str], data: str, steps: int, batch: int, out_dir: Path) -> dict:
    """Train in this process (called as a child) and summarise metrics.jsonl."""
    import torch

    from trainbox.config import load_config
    from trainbox.train.loop import train

    overrides = [f"data.path={data}", f"train.max_steps={steps}", f"train.global_batch_size={batch}",
                 "train.micro_batch_size=16", "train.dtype=bf16", "train.compile=true", "train.eval_every=0",
                 "train.eval_tokens=262144", "train.checkpoint_every=0", "train.sample_tokens=0",
                 "monitor.enabled=false", "monitor.log_every=10", "optim.warmup_steps=10",
                 f"run.dir={out_dir}", "run.name=check", *extra]
    cfg = load_config(recipe, overrides)
    torch.cuda.reset_peak_memory_stats()
    result = train(cfg)
    rows = [json.loads(line) for line in (out_dir / "check" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("event") == "train"]
    windows = [r for r in train_rows if r.get("tokens_per_s")][1:]  # the first window holds compilation
    tok_s = statistics.median(r["tokens_per_s"] for r in windows)
    losses = [r["loss"] for r in train_rows]
    last = train_rows[-1]
    summary = {
        "recipe": recipe, "overrides": extra, "steps": steps, "tokens_per_step": batch * cfg.data.seq_len,
        "step_time_s": batch * cfg.data.seq_len / tok_s, "tokens_per_s": tok_s,
        "mfu": statistics.median(r["mfu"] for r in windows if r.get("mfu") is not None),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss_first10": statistics.mean(losses[:10]), "loss_last10": statistics.mean(losses[-10:]),
        "val_loss": result.get("val_loss"), "gpu": torch.cuda.get_device_name(),
    }
    summary["loss_falling"] = summary["loss_last10"] < summary["loss_first10"] - 0.5
    moe = {k: v for k, v in last.items() if k.startswith("moe")}
    if moe:
        summary["moe_last_step"] = {k: v for k, v in moe.items() if "tokens_per_expert" not in k}
        summary["moe_tokens_per_expert_layer0"] = moe.get("moe.0.tokens_per_expert")
    return summary


def grouped_vs_loop() -> dict:
    """The MoE layer on CUDA in bf16: grouped-matmul path against the loop-over-experts path."""
    import torch

    from trainbox.config import MoESection
    from trainbox.model.moe import MoEFFN

    torch.manual_seed(0)
    layer = MoEFFN(768, MoESection(num_experts=8, top_k=2), bias=True, dropout=0.0).cuda()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(4, 1024, 768, device="cuda")
    res = []
    for use_kernel in (True, False):
        layer.use_kernel = use_kernel
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)
        y.float().square().mean().backward()
        res.append((y.float(), xi.grad.float(), layer.c_fc.weight.grad.float()))
    rel = [float((a - b).norm() / b.norm()) for a, b in zip(*res)]
    return {"rel_diff_out_dx_dW": rel, "ok": max(rel) < 2e-2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="token files: shard prefix (PREFIX_train_*.bin) or one .bin")
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32, help="global batch in sequences of 1024 tokens")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        recipe, extra = RUNS[args.child]
        summary = one_run(recipe, extra, args.data, args.steps, args.batch, Path(args.out))
        print("RESULT " + json.dumps(summary))
        return 0
    report = {"runs": {}}
    for name in args.runs:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run([sys.executable, __file__, "--data", args.data, "--steps", str(args.steps),
                                   "--batch", str(args.batch), "--child", name, "--out", tmp],
                                  capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        report["runs"][name] = json.loads(line[7:]) if line else {"error": proc.stderr[-3000:]}
        print(f"{name}: {json.dumps(report['runs'][name])}", file=sys.stderr)
    report["moe_grouped_vs_loop_bf16"] = grouped_vs_loop()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
