"""Do our model and our loop train step for step like nanoGPT from the same weights on the same batches?

    python benchmarks/step_parity.py gpt2-125m --nanogpt .peers/nanoGPT --data /tmp/corpus/nanogpt/train.bin \
        --val /tmp/corpus/nanogpt/val.bin --eval-tokens 10485760 --steps 200 --seeds 1,2 \
        --arm nanogpt --arm trainer=data.path=/tmp/corpus/modded/pyc,optim.warmup_steps=20
    python benchmarks/step_parity.py --results a.json b.jsonl [--record]   # the summary of earlier runs

loss_parity.py compares whole runs from each side's own seeds; their spread (nanoGPT's validation loss after
200 steps ranges from 2.97 to 3.29 over 8 seeds) hides a systematic difference unless many seeds run. Here
every arm of a seed starts from one initialisation (nanoGPT's model.py, seeded; its weights loaded into ours)
and trains `--steps` steps on the same batches (random windows of the flat token file, as nanoGPT's get_batch
draws them, from numpy's generator seeded with (seed, step)), at the recipe's hyper-parameters (lr,
min_lr_ratio, weight decay, betas, eps, clip; global batch and sequence length). The arms:

    nanogpt[N=micro=M]   nanoGPT's GPT in a loop written as its train.py runs it: lr of step s from its
                         get_lr (warm-up --warmup, cosine to min_lr over --steps), AdamW (fused on CUDA)
                         with decay on matrices only, each micro-batch (--nano-micro, or M) under bf16
                         autocast, its mean loss / accumulation, clip_grad_norm_; compiled.
    NAME[=k=v,...]       our model from the recipe with those overrides, in the same loop, its loss as our
                         loop takes it (the micro-batch's summed loss / tokens per step).
    trainer[..][=k=v,..] our whole loop, trainbox.train.loop.Trainer.run(), with the loader's micro-batches
                         replaced by these batches (its lr schedule, optimizer, loss scaling, clipping,
                         compile and prefetch are its own); needs data.path= for its validation split.

So the first two kinds differ by the models' numerics alone (kernels, GELU form, rounding, summation
order) and `trainer` adds our loop. Each arm of each seed prints one line: every step's loss (the mean
over the global batch) and gradient norm before clipping and, with --val, the loss on the first
--eval-tokens of it in 1024-token windows, in order (a trainer arm's closing evaluation reads the same
windows through our loader). A summary line follows: per arm, the mean loss of each step over seeds, its
difference from nanoGPT's, and the paired differences of the validation losses.

`--record` writes the run lines and the summary as one record in benchmarks/records/ (the runs of several calls:
run each with --record, then `--results RECORD ... --record`). Measured on H200s: through 10 steps our model
stays within 0.003 of nanoGPT's loss over the first 6 steps and within 0.015 over 10, with or without our kernels
(6 seeds; benchmarks/records/2026-11-27-2xh200-gpt2-125m-step-parity-10-steps.json). After 200 steps the arms of a
seed part between steps 20 and 60 and end up to 0.09 apart either way, as nanoGPT does against itself at another
micro-batch (up to 0.064); over 8 seeds our whole loop ends 0.0002 below nanoGPT, 95% interval +-0.054
(benchmarks/records/2026-11-27-4xh200-gpt2-125m-step-parity.json).

nanoGPT's code is present locally (a checkout's model.py), never committed. `--device cpu` with a tiny
model (model.n_layer=2 ... and --no-compile; trainer arms also train.device=cpu train.dtype=fp32
train.compile=false) checks the script itself: there the arms agree to 1e-5 at every step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import common
import numpy as np
import torch
from common import bench_config, paired, run_events


def nanogpt_lr(it: int, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """nanoGPT train.py's get_lr."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay - warmup)))
    return min_lr + coeff * (lr - min_lr)


def nanogpt_config(GPTConfig, m, seq: int):
    """nanoGPT's GPTConfig for our model section `m` at sequence length `seq`."""
    return GPTConfig(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, block_size=seq,
                     vocab_size=m.vocab_size, bias=m.bias, dropout=0.0)


def nanogpt_weights(nano) -> dict:
    """A nanoGPT model's state dict as ours loads it: its causal-mask buffers (only where torch lacks SDPA)
    are not weights."""
    return {k: v.clone() for k, v in nano.state_dict().items() if not k.endswith(".attn.bias")}


def batch(data: np.ndarray, seed: int, step: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = np.random.default_rng([seed, step]).integers(0, len(data) - seq - 1, rows)
    block = torch.from_numpy(np.stack([data[i:i + seq + 1] for i in starts]).astype(np.int64))
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def train(model, kind: str, batches, micro: int, hp, args, device: torch.device) -> dict:
    """`kind` nanogpt: model(x, y) -> (logits, mean loss); ours: model(x, y, reduction="sum").loss. `hp`: the
    recipe's optim section (lr, min_lr_ratio, weight decay, betas, eps, clip)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                            fused=device.type == "cuda")
    fwd = torch.compile(model) if args.compile else model
    amp = (lambda: torch.autocast("cuda", torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    losses, norms, times = [], [], []
    for step, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = nanogpt_lr(step, hp.lr, hp.lr * hp.min_lr_ratio, args.warmup, args.steps)
        if hasattr(model, "set_step"):
            model.set_step(step, args.steps)
        tokens = x.numel()
        accum, rest = divmod(x.size(0), micro)
        if accum == 0 or rest:
            raise SystemExit(f"micro-batch {micro} does not divide the global batch of {x.size(0)} rows")
        total = torch.zeros((), device=device)
        for k in range(accum):
            xs = x[k * micro:(k + 1) * micro].to(device, non_blocking=True)
            ys = y[k * micro:(k + 1) * micro].to(device, non_blocking=True)
            with amp():
                if kind == "nanogpt":
                    loss = fwd(xs, ys)[1] / accum
                else:
                    loss = fwd(xs, ys, reduction="sum").loss.float() / tokens
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
        norms.append(float(norm))
        times.append(time.perf_counter() - t0)
    return {"losses": [round(v, 5) for v in losses], "grad_norms": [round(v, 4) for v in norms],
            "median_step_ms": round(statistics.median(times[1:] or times) * 1e3, 1)}


def train_trainer(weights: dict, batches, recipe: str, overrides: list[str], args) -> tuple[dict, torch.nn.Module]:
    """Our whole loop (trainbox.train.loop.Trainer.run) from `weights` on `batches`: the loader's micro-batches
    are replaced by the given ones, everything else (schedule, optimizer, loss scaling, clipping, compile,
    prefetch) is the loop's own. Its closing evaluation is kept as `trainer_val_loss`."""
    from trainbox.train.loop import Trainer

    cfg = bench_config(recipe, args.steps, [*args.overrides, f"train.eval_tokens={args.eval_tokens or 1}",
                                            *overrides], prefix="step-parity-")

    class Fed(Trainer):
        def setup(self):
            super().setup()
            self.model.load_state_dict(weights, strict=True)   # in place: the optimizer holds these tensors
            micro, accum = self.plan.micro_batch, self.plan.accum
            self.plan.micro_batches = lambda step: [
                {"x": batches[step][0][k * micro:(k + 1) * micro], "y": batches[step][1][k * micro:(k + 1) * micro]}
                for k in range(accum)]

    trainer = Fed(cfg)
    summary = trainer.run()
    _, train = run_events(cfg)
    times = [b["time"] - a["time"] for a, b in zip(train, train[1:])]
    return ({"losses": [round(e["loss"], 5) for e in train], "grad_norms": [round(e["grad_norm"], 4) for e in train],
             "median_step_ms": round(statistics.median(times[1:] or times) * 1e3, 1),
             "micro_batch": cfg.train.micro_batch_size, "trainer_val_loss": summary.get("val_loss")}, trainer.model)


@torch.no_grad()
def evaluate(model, kind: str, val: np.ndarray, tokens: int, seq: int, micro: int, device: torch.device) -> float:
    """Mean loss over the first `tokens // seq` windows of `val`, in order (the windows our loader makes)."""
    amp = (lambda: torch.autocast("cuda", torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    n = min(tokens // seq, (len(val) - 1) // seq)
    was = model.training
    model.eval()
    total = 0.0
    for i in range(0, n, micro):
        rows = torch.from_numpy(np.stack([val[j * seq:j * seq + seq + 1] for j in range(i, min(i + micro, n))])
                                .astype(np.int64)).to(device)
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        with amp():
            loss = model(x, y)[1] if kind == "nanogpt" else model(x, y).loss
        total += float(loss) * len(rows)
    model.train(was)
    return total / n


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition("=")
    return name, [o for o in rest.split(",") if o]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?")
    ap.add_argument("--results", nargs="+", help="only summarise the runs in these records or JSON-lines files")
    ap.add_argument("--nanogpt", help="path to a nanoGPT checkout (its model.py)")
    ap.add_argument("--data", help="a flat uint16 token file, e.g. nanoGPT's train.bin")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seeds", default="1337")
    ap.add_argument("--arm", action="append", default=[],
                    help="nanogpt, or NAME[=key=value,...]: our model with those overrides (default: nanogpt, ours)")
    ap.add_argument("--nano-micro", type=int, default=16, help="nanoGPT's micro-batch (its reference run: 16)")
    ap.add_argument("--warmup", type=int, default=20, help="nanoGPT's warmup_iters (its lr_decay_iters: --steps)")
    ap.add_argument("--val",
                    help="a flat uint16 validation file (nanoGPT's val.bin): every arm's loss on it at the end")
    ap.add_argument("--eval-tokens", type=int, default=0, help="tokens of --val to evaluate, from its start")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--record", action="store_true", help="write the runs and their summary to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-step-parity)")
    ap.add_argument("overrides", nargs="*", help="key=value for every one of our arms (and the shapes of both)")
    args = ap.parse_intermixed_args()
    if args.results:
        runs = [run for _, run in common.read_runs(args.results) if "arm" in run]
        print(json.dumps(summary(runs)))
        if args.record:
            recipe = args.recipe or next((json.loads(Path(f).read_text()).get("recipe") for f in args.results
                                          if f.endswith(".json")), None)
            record(runs, recipe, args, common.measured_where(args.results))
        return
    if not (args.recipe and args.nanogpt and args.data):
        ap.error("a recipe, --nanogpt and --data are needed (or --results)")
    sys.path.insert(0, str(Path(args.nanogpt).resolve()))
    from model import GPT as NanoGPT  # nanoGPT's model.py
    from model import GPTConfig

    from trainbox.config import load_config
    from trainbox.model.build import build_model
    from trainbox.train.build import allow_cached_autograd_functions

    device = torch.device(args.device)
    if args.compile:
        allow_cached_autograd_functions()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True   # as nanoGPT's train.py
    data = np.memmap(args.data, dtype=np.uint16, mode="r")
    val = np.memmap(args.val, dtype=np.uint16, mode="r") if args.val else None
    arms = [parse_arm(a) for a in args.arm or ["nanogpt", "ours"]]
    base = load_config(args.recipe, list(args.overrides))
    m, seq, rows = base.model, base.data.seq_len, base.train.global_batch_size
    nano_cfg = nanogpt_config(GPTConfig, m, seq)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        batches = [batch(data, seed, s, rows, seq) for s in range(args.steps)]
        torch.manual_seed(seed)
        with contextlib.redirect_stdout(sys.stderr):   # its parameter count
            nano = NanoGPT(nano_cfg)
        weights = nanogpt_weights(nano)
        del nano
        for name, overrides in arms:
            torch.manual_seed(0)
            torch._dynamo.reset()
            line = {"benchmark": "step_parity", "seed": seed, "arm": name, "overrides": overrides,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
            if name.startswith("trainer"):
                res, model = train_trainer(weights, batches, args.recipe, overrides, args)
                line.update(res)
                kind, micro = "ours", res["micro_batch"]
            else:
                if name.startswith("nanogpt"):   # nanogpt[NAME=micro=N]: another micro-batch, the same maths
                    model = NanoGPT(nano_cfg)
                    kind = "nanogpt"
                    micro = args.nano_micro
                    if overrides:
                        key, _, value = overrides[0].partition("=")
                        if key != "micro" or len(overrides) > 1:
                            raise SystemExit(f"--arm {name}: a nanoGPT arm takes micro=N alone, not {overrides}")
                        micro = int(value)
                else:
                    cfg = load_config(args.recipe, [*args.overrides, *overrides])
                    model = build_model(cfg.model, m.vocab_size, seq)
                    kind, micro = "ours", cfg.train.micro_batch_size
                model.load_state_dict(weights, strict=True)
                model = model.to(device)
                line.update(micro_batch=micro, **train(model, kind, batches, micro, base.optim, args, device))
            if name.startswith("trainer") and val is not None:   # its closing evaluation: the same windows
                line["val_loss"] = round(res["trainer_val_loss"], 5)
            elif val is not None:
                line["val_loss"] = round(evaluate(model, kind, val, args.eval_tokens, seq, micro, device), 5)
            print(json.dumps(line), flush=True)
            results.append(line)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(summary(results)))
    if args.record:
        record(results, args.recipe, args)


def record(runs: list[dict], recipe: str | None, args, where: dict | None = None) -> None:
    """The runs and their summary as a result record in benchmarks/records/; the nanogpt arm is the baseline.
    `where`: Result fields of the machine the runs ran on (default: this one)."""
    where = where or {"gpu": common.gpu_info(), "software": common.software()}
    nano = [r for r in runs if r["arm"] == "nanogpt"]
    vals = [r["val_loss"] for r in nano if "val_loss" in r]
    baseline = None if not nano else {
        "name": "nanogpt arm: nanoGPT's model.py in its train.py loop", "command": None,
        "metrics": {"seeds": [r["seed"] for r in nano], "mean_val_loss": round(statistics.mean(vals), 4) if vals
                    else None, "median_step_ms": [r.get("median_step_ms") for r in nano]}}
    common.emit(common.Result(
        tool="step_parity", what=args.what or f"{recipe}-step-parity", **where,
        recipe=recipe, overrides=list(args.overrides),
        metrics={"steps": max(len(r["losses"]) for r in runs), "arms": list(dict.fromkeys(r["arm"] for r in runs)),
                 "seeds": sorted({r["seed"] for r in runs}), "summary": summary(runs), "runs": runs},
        baseline=baseline), record=True)


def summary(results: list[dict]) -> dict:
    """Per arm, the mean over seeds of each step's loss, and of its difference from nanoGPT's (same seeds)."""
    names = list(dict.fromkeys(r["arm"] for r in results))
    by = {n: {r["seed"]: r["losses"] for r in results if r["arm"] == n} for n in names}
    vals = {n: {r["seed"]: r["val_loss"] for r in results if r["arm"] == n and "val_loss" in r} for n in names}
    out = {"benchmark": "step_parity", "summary": True,
           "mean_loss": {n: [round(statistics.mean(c), 4) for c in zip(*by[n].values())] for n in names}}
    if "nanogpt" in by:
        ref = by["nanogpt"]
        out["minus_nanogpt"] = {n: [round(statistics.mean(c), 4) for c in zip(*(
            [a - b for a, b in zip(losses, ref[seed])] for seed, losses in by[n].items() if seed in ref))]
            for n in names if n != "nanogpt"}
        out["val_minus_nanogpt"] = {n: paired([v - vals["nanogpt"][s] for s, v in vals[n].items()
                                               if s in vals["nanogpt"]]) for n in names if n != "nanogpt" and vals[n]}
    return out


if __name__ == "__main__":
    main()
