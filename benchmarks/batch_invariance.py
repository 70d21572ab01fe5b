"""What "the same batches on 1 or N processes" comes to: how far runs of one recipe on 1, 2 and 4 processes (ddp and
fsdp) drift apart step by step, and whether that drift is floating-point summation order or more.

    python benchmarks/batch_invariance.py tiny --steps 100 --record                  # CPU: fp32, gloo
    python benchmarks/batch_invariance.py tiny --steps 100 --record                  # GPUs: bf16 autocast, NCCL
    python benchmarks/batch_invariance.py tiny train.dtype=bf16 --steps 60 --record  # CPU: bf16 autocast

Every run is `trainbox train [--nproc N] RECIPE`, as a user runs it, with the same global batch and the same
micro-batch (--micro-batch), so micro-batch k of a step holds the same samples on any number of processes and only
the order in which their gradients are summed differs: one process adds them one after another, DDP adds each
rank's own and then averages over the ranks, FSDP reduce-scatters every micro-batch over the ranks. Against the
one-process run of its precision (the reference), each run reports: the largest absolute difference of the weights
after steps 1, 2, 5, 10, 20, ... (and the tensor that holds it at the end), of the training loss and of the
gradient norm by step, of the gradient of step 1 elementwise (before clipping, relative to the gradient's largest
element), and both closing validation losses.

Controls, which tell rounding from a real difference:
- `order`: ONE process that sums the micro-batches of every step in reverse order. The same maths; if the drift
  of N processes is summation order, this run drifts as far from the reference.
- `fp64-*`: the reference and 2-process runs in float64 (every process's default dtype). Rounding starts over 8
  orders of magnitude smaller (until training's own amplification catches up); a different batch, scale or random
  stream would not.
- `sgd-*`: the reference and 2-process fsdp with SGD (momentum 0.9, --sgd-lr) in place of AdamW. AdamW divides
  each coordinate by the root of its own second moment, so where a gradient is near zero its last bits move the
  weight by a fraction of lr; SGD moves it by lr x gradient, and the runs stay as close as their gradients.
- `threads`: one process on one CPU thread (torchrun's workers run one each; a lone process uses all cores).
- `defect-*`: what a real bug looks like at this size: 2 fsdp processes where the last rank trains on one wrong
  sample of the global batch every step (`defect-sample`), or weighs its tokens 1% too much (`defect-scale`).

The controls and the measurements run inside the same CLI through a `sitecustomize` module that this tool puts on
every process's PYTHONPATH (torchrun's workers inherit it); the patches act only where BATCH_INVARIANCE_PATCH
names them. Weights and gradients are read from each run's rank 0 (FSDP's shards gathered), not from checkpoints.
The precision is the recipe's (train.dtype; auto: bf16 autocast on GPUs, fp32 on a CPU). On a CPU, train.dtype=bf16
runs bf16 autocast there (the product refuses it on a CPU; a patch lets it through). Under fsdp in bf16, FSDP
gathers bf16 weights, so those arms differ from one process by more than summation order (see the step-1 gradient).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ENV = "BATCH_INVARIANCE_PATCH"   # JSON: {"patches": [...], "dump": DIR, "steps": [...]} for the processes of a run

# arm -> (processes, train.parallel, patches, reference arm, extra overrides); "ref" is the reference itself
ARMS: dict[str, tuple[int, str, tuple[str, ...], str | None, tuple[str, ...]]] = {
    "ref": (1, "ddp", (), None, ()),
    "ddp-2": (2, "ddp", (), "ref", ()),
    "ddp-4": (4, "ddp", (), "ref", ()),
    "fsdp-2": (2, "fsdp", (), "ref", ()),
    "fsdp-4": (4, "fsdp", (), "ref", ()),
    "order": (1, "ddp", ("reverse",), "ref", ()),
    "threads": (1, "ddp", (), "ref", ("train.threads=1",)),
    "fp64-ref": (1, "ddp", ("float64",), None, ()),
    "fp64-ddp-2": (2, "ddp", ("float64",), "fp64-ref", ()),
    "fp64-fsdp-2": (2, "fsdp", ("float64",), "fp64-ref", ()),
    "fp64-order": (1, "ddp", ("float64", "reverse"), "fp64-ref", ()),
    "sgd-ref": (1, "ddp", ("sgd",), None, ()),
    "sgd-fsdp-2": (2, "fsdp", ("sgd",), "sgd-ref", ()),
    "defect-sample": (2, "fsdp", ("wrong_sample",), "ref", ()),
    "defect-scale": (2, "fsdp", ("wrong_scale",), "ref", ()),
}
DEFAULT_ARMS = list(ARMS)
GPU_ARMS = ["ref", "ddp-2", "ddp-4", "fsdp-2", "fsdp-4", "order", "fp64-ref", "fp64-fsdp-2", "defect-sample"]


# ----------------------------------------------------------------------------------------------- inside the runs

def apply_patches() -> None:
    """Called by the sitecustomize module in every process of a run: the patches BATCH_INVARIANCE_PATCH names, and
    the observer that writes rank 0's weights after the listed steps and the gradient of the first step."""
    spec = json.loads(os.environ[ENV])
    patches, dump, steps = set(spec["patches"]), Path(spec["dump"]), set(spec["steps"])
    import torch

    from trainbox.data import loader
    from trainbox.optim import build
    from trainbox.train import device as device_mod

    if "float64" in patches:          # every tensor the run creates without a dtype: weights, optimizer state
        torch.set_default_dtype(torch.float64)
    if "bf16_cpu" in patches:         # bf16 autocast on a CPU, which resolve_device refuses
        resolve = device_mod.resolve_device

        def resolve_bf16(cfg, local_rank=0):
            fp32 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"dtype": "fp32"})})
            device, _, resolved = resolve(fp32, local_rank)
            return device, torch.bfloat16, resolved
        from trainbox.train import preflight
        device_mod.resolve_device = preflight.resolve_device = resolve_bf16   # where the run's checks ask it
    if "sgd" in patches:
        build.make_adamw = lambda groups, cfg, device: torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9)
    if "reverse" in patches:          # the same micro-batches, summed last to first
        micro_batches = loader.BatchOrder.micro_batches
        loader.BatchOrder.micro_batches = lambda self, step: micro_batches(self, step)[::-1]
    if "wrong_sample" in patches:     # the last rank: the last sample of its share is the one after it
        global_indices = loader.BatchOrder.global_indices

        def shifted(self, step):
            ids = global_indices(self, step)
            if self.world > 1 and self.rank == self.world - 1:
                ids = ids.copy()
                ids[-1] = (ids[-1] + 1) % self.dataset.num_samples
            return ids
        loader.BatchOrder.global_indices = shifted
    if "wrong_scale" in patches:      # the last rank counts 1% fewer target tokens: its share weighs 1% more
        target_tokens = loader.BatchOrder.target_tokens
        loader.BatchOrder.target_tokens = lambda self, step: (
            round(target_tokens(self, step) / 1.01) if self.world > 1 and self.rank == self.world - 1
            else target_tokens(self, step))

    from trainbox.train import loop
    train_step = loop.Trainer.train_step

    def observed(self, step):
        if step == self.start_step == 0:   # the first step's gradient, before clipping
            clip = self.parallel.clip

            def dump_grad(max_norm):
                grads = {n: full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}
                if self.dist.is_main:
                    torch.save(grads, dump / "grad-1.pt")
                self.parallel.clip = clip
                return clip(max_norm)
            self.parallel.clip = dump_grad
        out = train_step(self, step)
        if step + 1 in steps:
            weights = {n: full(p) for n, p in self.model.named_parameters()}
            if self.dist.is_main:
                torch.save(weights, dump / f"weights-{step + 1}.pt")
        return out
    loop.Trainer.train_step = observed


def full(t):
    """A whole tensor on the host: an FSDP shard gathered over the ranks (every rank must call it)."""
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


SITECUSTOMIZE = f"""import os
if os.environ.get({ENV!r}):
    import sys
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    import batch_invariance
    batch_invariance.apply_patches()
"""


# ----------------------------------------------------------------------------------------------- the runs

def dump_steps(steps: int) -> list[int]:
    """Steps after which the weights are compared: 1, 2, 5, 10, 20, 30, ... and the last."""
    return sorted({s for s in (1, 2, 5, *range(10, steps + 1, 10), steps) if s <= steps})


def run_arm(name: str, root: Path, hook: Path, recipe: str, base: list[str], steps: int, patches: tuple[str, ...],
            log: Path) -> tuple[Path, float]:
    nproc, parallel, arm_patches, _, extra = ARMS[name]
    dump = root / f"{name}-dump"
    dump.mkdir()
    cmd = [sys.executable, "-m", "trainbox", "train", *(["--nproc", str(nproc)] if nproc > 1 else []), recipe, *base,
           f"train.parallel={parallel}", *extra, f"run.name={name}"]
    spec = {"patches": [*arm_patches, *patches], "dump": str(dump), "steps": dump_steps(steps)}
    env = {**os.environ, ENV: json.dumps(spec),
           "PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)}
    t0 = time.time()
    with open(log, "a") as f:
        f.write(f"\n=== {name}: {' '.join(cmd)}\n{ENV}={json.dumps(spec)}\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"arm {name} failed ({proc.returncode}): {' '.join(cmd)}; see {log}")
    return dump, time.time() - t0


def events(run_dir: Path) -> tuple[dict[int, dict], dict | None]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if r["event"] == "train"}
    evals = [r for r in rows if r["event"] == "eval"]
    return train, (evals[-1] if evals else None)


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest absolute elementwise difference over all tensors, and the tensor that holds it."""
    worst, where = 0.0, ""
    for name, t in a.items():
        d = float((t.double() - b[name].double()).abs().max())
        if d > worst or not where:
            worst, where = d, name
    return worst, where


def compare(name: str, root: Path, ref: str, steps: list[int]) -> dict:
    import torch
    load = lambda arm, f: torch.load(root / f"{arm}-dump" / f, weights_only=True)   # noqa: E731
    out: dict = {"vs": ref}
    weights = []
    for s in steps:
        d, where = max_diff(load(name, f"weights-{s}.pt"), load(ref, f"weights-{s}.pt"))
        weights.append(d)
    out["weight_max_abs_diff"] = weights
    out["weight_max_tensor"] = where
    mine, theirs = load(name, "grad-1.pt"), load(ref, "grad-1.pt")
    d, where = max_diff(mine, theirs)
    top = max(float(t.abs().max()) for t in theirs.values())
    num = sum(float((mine[n].double() - t.double()).norm() ** 2) for n, t in theirs.items()) ** 0.5
    den = sum(float(t.double().norm() ** 2) for t in theirs.values()) ** 0.5
    out["grad1"] = {"max_abs_diff": d, "tensor": where, "max_abs": top, "rel_to_max": d / top, "rel_norm": num / den}
    (a, a_eval), (b, b_eval) = events(root / name), events(root / ref)
    common_steps = sorted(set(a) & set(b))
    out["loss_abs_diff"] = [abs(a[s]["loss"] - b[s]["loss"]) for s in common_steps]
    out["grad_norm_rel_diff"] = [abs(a[s]["grad_norm"] - b[s]["grad_norm"]) / b[s]["grad_norm"]
                                 for s in common_steps if a[s].get("grad_norm") and b[s].get("grad_norm")]
    out["val_loss"] = [a_eval["val_loss"] if a_eval else None, b_eval["val_loss"] if b_eval else None]
    return out


def summary(arm: dict) -> dict:
    """The figures of an arm in one line: at the end, and the largest over the run."""
    return {"vs": arm["vs"], "weights_end": arm["weight_max_abs_diff"][-1],
            "weights_max": max(arm["weight_max_abs_diff"]), "weights_step1": arm["weight_max_abs_diff"][0],
            "loss_max": max(arm["loss_abs_diff"]), "loss_step1": arm["loss_abs_diff"][0],
            "grad1_rel_to_max": arm["grad1"]["rel_to_max"], "grad1_rel_norm": arm["grad1"]["rel_norm"],
            "val_loss_diff": (abs(arm["val_loss"][0] - arm["val_loss"][1]) if None not in arm["val_loss"] else None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of every run")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="train.micro_batch_size of every run (default: the global batch over the most processes)")
    ap.add_argument("--arms", default=None, help=f"comma-separated, from {', '.join(ARMS)} (default: all on a "
                                                 f"CPU; on GPUs {', '.join(GPU_ARMS)})")
    ap.add_argument("--sgd-lr", type=float, default=0.1, help="optim.lr of the sgd arms (where SGD is stable)")
    ap.add_argument("--keep", type=Path, help="keep the runs and dumps in this folder (default: a temporary one)")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-batch-invariance-DTYPE)")
    args = ap.parse_intermixed_args()

    gpu = common.gpu_info()
    arms = args.arms.split(",") if args.arms else [a for a in (GPU_ARMS if gpu else DEFAULT_ARMS)
                                                   if not gpu or ARMS[a][0] <= gpu["count"]]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; the arms are {', '.join(ARMS)}")
    for a in list(arms):   # every arm's reference runs first
        ref = ARMS[a][3]
        if ref and ref not in arms:
            arms.insert(0, ref)
    arms = sorted(set(arms), key=lambda a: (ARMS[a][3] is not None, list(ARMS).index(a)))
    most = max(ARMS[a][0] for a in arms)
    if gpu and most > gpu["count"]:
        raise SystemExit(f"arms {arms} need {most} GPUs; this machine has {gpu['count']}: pass --arms")

    from trainbox.config import load_config
    cfg = load_config(args.recipe, args.overrides)
    dtype = cfg.train.dtype if cfg.train.dtype != "auto" else "bf16" if gpu else "fp32"
    if dtype not in ("fp32", "bf16"):
        raise SystemExit(f"train.dtype={dtype}: this tool compares fp32 or bf16 runs")
    micro = args.micro_batch or cfg.train.global_batch_size // most
    low = ("bf16_cpu",) if dtype == "bf16" and not gpu else ()   # float64 arms run without autocast
    root = args.keep or Path(tempfile.mkdtemp(prefix="batch-invariance-"))
    root.mkdir(parents=True, exist_ok=True)
    hook = root / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # AdamW first (a recipe's Muon is refused under fsdp; the sgd arms replace AdamW), the command line's after it
    base = ["optim.name=adamw", *args.overrides, f"train.max_steps={args.steps}", f"train.micro_batch_size={micro}",
            "monitor.log_every=1", f"train.eval_every={args.steps}",
            "train.sample_tokens=0", "train.checkpoints=false", "monitor.port=0", "monitor.progress=lines",
            f"run.dir={root}"]
    log = root / "runs.log"
    wall = {}
    try:
        for a in arms:
            fp64 = "float64" in ARMS[a][2]
            extra = [f"train.dtype={dtype if gpu and not fp64 else 'fp32'}",
                     *([f"optim.lr={args.sgd_lr}"] if "sgd" in ARMS[a][2] else [])]
            _, wall[a] = run_arm(a, root, hook, args.recipe, [*base, *extra], args.steps, () if fp64 else low, log)
            print(f"{a}: {wall[a]:.0f} s", file=sys.stderr, flush=True)
        steps = dump_steps(args.steps)
        results = {a: compare(a, root, ARMS[a][3], steps) for a in arms if ARMS[a][3]}
        ref_train, ref_eval = events(root / "ref") if "ref" in arms else ({}, None)
    except BaseException:
        print(f"runs kept in {root}", file=sys.stderr)
        raise
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    metrics = {
        "dtype": dtype, "device": gpu["name"] if gpu else "cpu", "backend": "nccl" if gpu else "gloo",
        "steps": args.steps, "global_batch": cfg.train.global_batch_size, "micro_batch": micro, "lr": cfg.optim.lr,
        "warmup_steps": cfg.optim.warmup_steps, "weight_steps": steps,
        "summary": {a: summary(r) for a, r in results.items()},
        "ref_losses": [ref_train[s]["loss"] for s in sorted(ref_train)],
        "ref_val_loss": ref_eval["val_loss"] if ref_eval else None,
        "arms": {a: {"nproc": ARMS[a][0], "parallel": ARMS[a][1],
                     "patches": [*ARMS[a][2], *(() if "float64" in ARMS[a][2] else low)],
                     "overrides": list(ARMS[a][4]), "wall_s": round(wall[a], 1), **results.get(a, {})}
                 for a in arms},
    }
    common.emit(common.Result(
        tool="batch_invariance", what=args.what or f"{args.recipe}-batch-invariance-{dtype}", gpu=gpu,
        software=common.software(), recipe=args.recipe, overrides=args.overrides, metrics=metrics), args.record)


if __name__ == "__main__":
    main()
