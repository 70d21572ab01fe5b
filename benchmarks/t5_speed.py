"""T5 training speed: trainbox's T5 vs a plain loop over transformers' T5ForConditionalGeneration.

Both train the same model (HF's copy starts from our initial weights), on the same span-corrupted
batches (trainbox's loader + data/spans.py), with the same fused AdamW, gradient clipping and bf16
autocast; only the model code (and optionally torch.compile of ours) differs. Tokens are encoder
input tokens (data.seq_len per example; each example also has its decoder targets); MFU counts the
encoder and decoder FLOPs (T5.flops_per_token) against the GPU's bf16 dense peak. Prints one JSON object, then
the result record (common.Result: ours measured, transformers its baseline); --record also writes it to
benchmarks/records/.

    python benchmarks/make_corpus.py --out /tmp/corpus                  # the benchmark corpus
    python benchmarks/t5_speed.py --data /tmp/corpus/modded/pyc --recipe t5-base --steps 110 --compile --record
    python benchmarks/t5_speed.py --data /tmp/corpus/modded/pyc --trainer   # + `trainbox train`

Not part of the tests; needs `transformers` and a CUDA GPU (`--device cpu` with tiny `--set` overrides is
a smoke run of the script itself, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time

import common
import torch

from trainbox.config import load_config
from trainbox.data.loader import BatchOrder
from trainbox.data.sources import open_datasets
from trainbox.data.tokenizer import get_tokenizer
from trainbox.model.build import adapt_datasets, build_model, model_vocab_size
from trainbox.model.t5.hf import hf_config
from trainbox.optim.adamw import adamw_groups, make_adamw
from trainbox.train.device import PEAK_TFLOPS


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(cfg, steps: int, device: torch.device) -> tuple[list[dict], int, object]:
    """The first `steps` global batches of the run, on the device (one micro-batch per step)."""
    tok = get_tokenizer(cfg.data.tokenizer)
    vocab = model_vocab_size(cfg.model, tok.vocab_size)
    train, _ = adapt_datasets(cfg, tok, vocab, *open_datasets(cfg.data, tok, vocab))
    plan = BatchOrder(train, cfg.train.global_batch_size, cfg.train.global_batch_size, seed=cfg.run.seed)
    plan.check_nonempty()
    batches = [{k: v.to(device) for k, v in plan.micro_batches(s)[0].items()} for s in range(steps)]
    return batches, vocab, tok


def timed_loop(step_fn, batches: list[dict], warmup: int, device: torch.device) -> dict:
    """Run every batch; time the steps after `warmup` (compilation and autotuning excluded)."""
    losses = []
    sync(device)
    t0 = None
    for i, b in enumerate(batches):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        losses.append(step_fn(b["x"], b["y"]))
    sync(device)
    seconds = time.perf_counter() - t0
    losses = [float(x) for x in torch.stack(losses).tolist()]
    return {"seconds": seconds, "timed_steps": len(batches) - warmup, "loss_first": losses[0],
            "loss_last": losses[-1], "loss_mean_last10": sum(losses[-10:]) / len(losses[-10:]),
            "finite": all(math.isfinite(x) for x in losses)}


def make_step(model, forward, cfg, hf: bool, device: torch.device, graphs: bool = False):
    """`graphs`: `forward` replays CUDA graphs (as train.cuda_graphs). One micro-batch a step, so the optimizer
    reads the backward graph's gradients before the next replay overwrites them, and they are freed after it."""
    params = [(n, p) for n, p in model.named_parameters()]
    opt = make_adamw(adamw_groups(params, cfg.optim.weight_decay, cfg.optim.lr), cfg.optim, device)

    def step(x, y):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = forward(input_ids=x, labels=y).loss if hf else forward(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().clone()
    return step


def measure(name: str, model, forward, cfg, batches, warmup: int, hf: bool, flops_per_token: float, peak: float,
            device: torch.device, graphs: bool = False) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    res = timed_loop(make_step(model, forward, cfg, hf, device, graphs), batches, warmup, device)
    tokens = res["timed_steps"] * batches[0]["x"].numel()
    res.update(name=name, tokens_per_s=tokens / res["seconds"],
               target_tokens_per_s=res["timed_steps"] * batches[0]["y"].numel() / res["seconds"],
               mfu=tokens / res["seconds"] * flops_per_token / peak,
               max_memory_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               max_memory_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None)
    return res


def run_trainer(cfg_source: str, overrides: list[str], steps: int) -> dict:
    """The real `trainbox train` loop (metrics.jsonl's last window: tokens/s and MFU as users see them)."""
    from trainbox.train.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(cfg_source, [*overrides, f"run.dir={tmp}", "run.name=bench", f"train.max_steps={steps}",
                                       "train.eval_every=0", "train.checkpoint_every=0", "monitor.enabled=false",
                                       f"monitor.log_every={max(1, steps // 4)}", "train.eval_tokens=65536"])
        t0 = time.perf_counter()
        result = train(cfg)
        rows = [json.loads(line) for line in open(f"{tmp}/bench/metrics.jsonl")]
    last = [r for r in rows if r["event"] == "train" and "tokens_per_s" in r][-1]
    return {"name": "trainbox train (the loop)", "tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"],
            "wall_s": time.perf_counter() - t0, "loss_last": last["loss"], "val_loss": result.get("val_loss"),
            "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30
            if torch.cuda.is_available() else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="token-file prefix (PREFIX_train_*.bin), e.g. /tmp/corpus/modded/pyc")
    ap.add_argument("--recipe", default="t5-base")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10, help="untimed first steps (compilation)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (one micro-batch)")
    ap.add_argument("--compile", action="store_true", help="torch.compile our model (the recipes' default)")
    ap.add_argument("--cuda-graphs", action="store_true", help="with --compile: replay our compiled step as CUDA "
                    "graphs (as train.cuda_graphs)")
    ap.add_argument("--impl", choices=["both", "ours", "hf"], default="both")
    ap.add_argument("--hf-attn", default=None, help="transformers attn_implementation (default: its own choice)")
    ap.add_argument("--trainer", action="store_true", help="also time the real `trainbox train` loop")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides (key=value)")
    args = ap.parse_args()

    overrides = [f"data.path={args.data}", f"train.global_batch_size={args.batch}",
                 f"train.micro_batch_size={args.batch}",
                 f"train.dtype={'bf16' if args.device.startswith('cuda') else 'fp32'}", f"train.device={args.device}",
                 f"train.compile={str(args.compile).lower()}", *args.set,
                 *(["train.cuda_graphs=true"] if args.compile and args.cuda_graphs else [])]
    cfg = load_config(args.recipe, overrides)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    batches, vocab, tok = make_batches(cfg, args.steps, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), 989.0) * 1e12
    torch.manual_seed(cfg.run.seed)
    ours = build_model(cfg.model, vocab, cfg.data.seq_len).to(device)
    attention = ours.set_kernels(device).attention   # outside torch.compile, as the loop's set_step does
    init = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    fpt = ours.flops_per_token(cfg.data.seq_len)
    report = {"device": name, "recipe": args.recipe, "batch": args.batch, "seq_len": cfg.data.seq_len,
              "target_len": batches[0]["y"].shape[1], "vocab": vocab, "params": ours.num_params(),
              "flops_per_token": fpt, "peak_tflops": peak / 1e12, "steps": args.steps, "warmup": args.warmup,
              "attention": attention,
              "torch": torch.__version__, "results": []}
    if args.impl in ("both", "ours"):
        graphs = args.compile and args.cuda_graphs
        fwd = torch.compile(ours, mode="reduce-overhead" if graphs else None) if args.compile else ours
        label = " (compiled, CUDA graphs)" if graphs else " (compiled)" if args.compile else ""
        report["results"].append(measure(f"trainbox T5{label}", ours, fwd, cfg, batches, args.warmup, False, fpt,
                                         peak, device, graphs))
    del ours
    if args.impl in ("both", "hf"):
        from transformers import T5ForConditionalGeneration

        kw = {"attn_implementation": args.hf_attn} if args.hf_attn else {}
        hf = T5ForConditionalGeneration(hf_config_for(cfg, vocab, tok), **kw).to(device)
        if not cfg.model.tie_embeddings:  # transformers 5 builds the head tied; v1.1 has its own: untie first
            hf.lm_head.weight = torch.nn.Parameter(init["lm_head.weight"].clone())
        hf.load_state_dict(init, strict=True)
        report["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
        report["results"].append(measure("transformers T5ForConditionalGeneration", hf, hf, cfg, batches,
                                         args.warmup, True, fpt, peak, device))
    if args.trainer:
        report["results"].append(run_trainer(args.recipe, overrides, args.steps))
    ours_res = [r for r in report["results"] if r["name"].startswith("trainbox T5")]
    hf_res = [r for r in report["results"] if r["name"].startswith("transformers")]
    if ours_res and hf_res:  # same batches, same optimizer: the ratio of the model code alone
        report["speedup_vs_transformers"] = ours_res[0]["tokens_per_s"] / hf_res[0]["tokens_per_s"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    common.emit(common.Result(
        tool="t5_speed", what=f"{args.recipe}-speed", gpu=common.gpu_info() if device.type == "cuda" else None,
        software=common.software("transformers"), recipe=args.recipe, overrides=overrides,
        metrics={**{k: v for k, v in report.items() if k not in ("device", "torch", "recipe", "results")},
                 "results": [r for r in report["results"] if not r["name"].startswith("transformers")]},
        baseline={"name": hf_res[0]["name"], "command": None, "metrics": hf_res[0]} if hf_res else None),
        args.record)


def hf_config_for(cfg, vocab: int, tok):
    from trainbox.model.t5.model import T5

    with torch.device("meta"):
        shell = T5(cfg.model, vocab, cfg.data.seq_len)
    return hf_config(shell, tok.eot_id)


if __name__ == "__main__":
    main()
