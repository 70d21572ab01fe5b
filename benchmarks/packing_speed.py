"""SFT throughput with data.packing on and off: tokens/s of the examples' own tokens through trainbox's loop, on the
same model and the same examples, and the loss per example at equal examples seen.

    python benchmarks/packing_speed.py --record                # H100: a Qwen2.5-0.5B-shaped llama model, seq 2048
    python benchmarks/packing_speed.py --size tiny             # CPU check of the script (no goal figure)

Assets, made offline and deterministically under --root (nothing is downloaded): a chat JSONL of --examples rows
and a held-out one of --heldout rows, whose lengths in tokens are log-uniform between --min-len and --max-len
(default 20 and 2,000: many short chats, a few long ones), the assistant repeating the user's words (something
attention inside the example can learn); a word-level tokenizer (one token a word, so the lengths are exact) and a
llama-family folder with random weights (0.5b: Qwen2.5-0.5B's shape, 24 layers of width 896, 14 query and 2
key/value heads, a 151,936-token vocabulary, tied head; tiny: 2 layers of width 64).

Two runs of `trainbox train sft` (the Trainer, each in its own process; no activation checkpointing: both fit an
H100 without it) over one epoch of the same examples, from the same weights:
    padded   data.packing=false: --global-batch rows, one example each
    packed   data.packing=true: rows packed by first-fit decreasing; the global batch is the multiple of the
             micro-batch nearest to --global-batch x rows / examples, so a step holds about as many examples and the
             two runs take about as many optimizer steps
tokens/s counts the examples' input positions (each example's tokens but its last; padding never), over the steps
after --warmup, from the steps' metrics.jsonl times. Then each trained model scores the held-out examples, one per
row: `loss_per_example` is the mean over examples of their mean token loss (equal examples seen: the two runs
should agree within the noise of their different batches); the packed run also scores them packed
(`packed_scoring_diff`: the same weights in packed rows and alone, equal up to bf16 rounding).

Prints the report as JSON, then the result record (common.Result: packed measured, padded its baseline);
--record writes it to benchmarks/records/. The goal (issue 47) is packed >= 1.8x padded tokens/s on an H100 with
the held-out loss per example equal. Needs: trainbox[finetune] (transformers, tokenizers); a CUDA GPU for the
goal's figures (on it: --set model.fused_loss=true keeps the 151,936-wide logits out of memory).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import common

SIZES = {  # transformers config keys of the model folder; `words`: the tokenizer's word vocabulary
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, max_position_embeddings=32768, words=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=576, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, max_position_embeddings=1024, words=512),
}
DEFAULTS = {"0.5b": dict(seq_len=2048, max_len=2000, examples=3000, heldout=200, global_batch=32, micro_batch=4),
            "tiny": dict(seq_len=256, max_len=250, examples=384, heldout=48, global_batch=16, micro_batch=4)}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_OVERHEAD = 6     # <|im_start|> role ... <|im_end|>, twice, in the built-in ChatML template


def make_chats(path: Path, n: int, seed: int, min_len: int, max_len: int, words: int) -> None:
    """`n` chats of log-uniform total length in [min_len, max_len] tokens: k user words, the assistant repeating
    them (cycling when its turn is longer)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            total = int(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))
            k = (total - CHAT_OVERHEAD + 1) // 2
            m = total - CHAT_OVERHEAD - k
            user = [f"w{min(int(rng.paretovariate(1.0)), words - 1)}" for _ in range(k)]
            reply = [user[i % k] for i in range(m)]
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(user)},
                                             {"role": "assistant", "content": " ".join(reply)}]}) + "\n")


def make_assets(root: Path, a) -> Path:
    """The model folder (config.json, random weights, tokenizer) and the chat files; -> the folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SIZES[a.size])
    words = spec.pop("words")
    folder, tok_folder = root / f"model-{a.size}", root / f"tokenizer-{a.size}"
    if not (tok_folder / "tokenizer.json").is_file():
        vocab = {t: i for i, t in enumerate(SPECIALS + ["user", "assistant", "system"])}
        vocab.update({f"w{i}": len(vocab) + i for i in range(words)})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                additional_special_tokens=SPECIALS[1:]).save_pretrained(tok_folder)
        # its own folder, read as the generic class: beside a qwen2 config.json, transformers would rebuild it as
        # Qwen2's byte-level BPE, which has no word-level vocabulary
        conf = json.loads((tok_folder / "tokenizer_config.json").read_text())
        (tok_folder / "tokenizer_config.json").write_text(json.dumps({**conf,
                                                                      "tokenizer_class": "PreTrainedTokenizerFast"}))
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        cfg = Qwen2Config(**spec, eos_token_id=0, bos_token_id=0)
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    for name, n, seed in (("chat", a.examples, 0), ("heldout", a.heldout, 1)):
        path = root / f"{name}-{a.size}-{n}-{a.min_len}-{a.max_len}.jsonl"
        if not path.is_file():
            make_chats(path, n, seed, a.min_len, a.max_len, words)
    return folder


def chat_paths(root: Path, a) -> tuple[Path, Path]:
    return (root / f"chat-{a.size}-{a.examples}-{a.min_len}-{a.max_len}.jsonl",
            root / f"heldout-{a.size}-{a.heldout}-{a.min_len}-{a.max_len}.jsonl")


def packed_global_batch(root: Path, a) -> tuple[int, dict]:
    """The packed run's global batch (about --global-batch examples a step) and the packing of the training set."""
    import numpy as np

    from trainbox.config import load_config
    from trainbox.data.packing import first_fit_decreasing
    from trainbox.data.sft import load_hf_tokenizer, prepare_sft
    cfg = load_config("sft", run_overrides(root, a, "plan", packing=True))
    folder = prepare_sft(cfg.data.path, load_hf_tokenizer(cfg.data.tokenizer), cfg.data)
    lengths = np.diff(np.load(folder / "starts.npy")) - 1
    rows = len(first_fit_decreasing(lengths, a.seq_len))
    per_row = len(lengths) / rows
    batch = a.micro_batch * max(1, round(a.global_batch / per_row / a.micro_batch))
    return batch, {"examples": len(lengths), "rows": rows, "examples_per_row": per_row,
                   "fill": float(lengths.sum()) / (rows * a.seq_len)}


def run_overrides(root: Path, a, name: str, packing: bool, global_batch: int | None = None) -> list[str]:
    chat, heldout = chat_paths(root, a)
    return [f"model.path={root / f'model-{a.size}'}", f"data.tokenizer={root / f'tokenizer-{a.size}'}",
            f"data.path={chat}", f"data.val_path={heldout}",
            "data.chat_template=chatml", f"data.packing={str(packing).lower()}", f"data.seq_len={a.seq_len}",
            f"data.cache_dir={root / 'cache'}", f"train.global_batch_size={global_batch or a.global_batch}",
            f"train.micro_batch_size={a.micro_batch}", "train.epochs=1", f"run.dir={root / 'runs'}",
            f"run.name={name}", "run.resume=never", "optim.lr=1e-4", "optim.warmup_steps=5", "train.eval_every=0",
            "train.checkpoints=false", "train.sample_tokens=0", "monitor.log_every=1", "monitor.port=0",
            "train.activation_checkpointing=none", *a.set]


def example_losses(model, ds, rows, device, autocast, packed: bool) -> list[float]:
    """Mean token loss of every held-out example: one per row (`packed` False) or in packed rows."""
    import torch

    from trainbox.data.packing import ExampleDataset, packed_inputs
    data = ExampleDataset(ds.tokens, ds.mask, ds.starts, ds.seq_len, ds.pad_id, packed=packed)
    out: dict[int, float] = {}
    model.eval()
    for r0 in range(0, data.num_samples, rows):
        idx = list(range(r0, min(r0 + rows, data.num_samples)))
        b = {k: v.to(device) for k, v in data.batch(idx).items()}
        with torch.no_grad(), autocast():
            loss = model(b["x"], b["y"], b["loss_mask"], reduction="none", **packed_inputs(b)).loss.float()
        docs = b["doc_ids"] if packed else torch.zeros_like(b["x"])
        for j, r in enumerate(idx):
            for k, e in enumerate(data.row_examples[data.row_offsets[r]:data.row_offsets[r + 1]].tolist()):
                sel = (docs[j] == k) & b["loss_mask"][j]
                out[e] = float(loss[j][sel].mean())
    return [out[e] for e in sorted(out)]


def worker(root: Path, a) -> dict:
    import numpy as np
    import torch

    from trainbox.config import load_config
    from trainbox.train.loop import Trainer
    packed = a.worker == "packed"
    cfg = load_config("sft", run_overrides(root, a, a.worker, packed, a.run_global_batch))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    trainer.run()
    events = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    train = [e for e in events if e["event"] == "train"]
    ds, order = trainer.train_data, trainer.batches
    positions = np.diff(ds.starts) - 1
    row_positions = np.add.reduceat(positions[ds.row_examples], ds.row_offsets[:-1])
    rows_examples = np.diff(ds.row_offsets)
    times = {e["step"]: e["time"] for e in train}
    last = max(times)
    first = min(a.warmup, last - 2)   # the timed steps are first + 1 .. last
    steps = range(first + 1, last + 1)
    tokens = sum(int(row_positions[order.global_indices(s - 1)].sum()) for s in steps)
    examples = sum(int(rows_examples[order.global_indices(s - 1)].sum()) for s in steps)
    seconds = times[last] - times[first]
    val = trainer.val_data
    alone = example_losses(trainer.model, val, a.micro_batch, trainer.device, trainer.autocast, packed=False)
    result = {"steps": last, "global_batch": cfg.train.global_batch_size, "rows": ds.num_samples,
              "fill": ds.report["fill"], "examples_per_step": float(rows_examples.sum()) / ds.num_samples
              * cfg.train.global_batch_size, "tokens_per_s": tokens / seconds, "examples_per_s": examples / seconds,
              "loss_per_example": float(np.mean(alone)), "train_loss_last": train[-1]["loss"],
              "kernels": start["kernels"],
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    if packed:
        inside = example_losses(trainer.model, val, a.micro_batch, trainer.device, trainer.autocast, packed=True)
        result["packed_scoring_diff"] = float(np.max(np.abs(np.array(inside) - np.array(alone))))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="0.5b")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int)
    p.add_argument("--examples", type=int)
    p.add_argument("--heldout", type=int)
    p.add_argument("--global-batch", type=int, help="the padded run's global batch (examples a step)")
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from tokens/s")
    p.add_argument("--root", default="/tmp/trainbox-packing-bench")
    p.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    p.add_argument("--set", nargs="*", default=[], help="overrides for both runs (e.g. train.compile=true)")
    p.add_argument("--worker", choices=["packed", "padded"], help=argparse.SUPPRESS)
    p.add_argument("--run-global-batch", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    for k, v in DEFAULTS[a.size].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    root = Path(a.root)
    if a.worker:
        print("RESULT " + json.dumps(worker(root, a)))
        return 0
    import torch
    root.mkdir(parents=True, exist_ok=True)
    make_assets(root, a)
    packed_batch, packing = packed_global_batch(root, a)
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "size": a.size,
              "seq_len": a.seq_len, "lengths": [a.min_len, a.max_len], "examples": a.examples, "heldout": a.heldout,
              "micro_batch": a.micro_batch, "warmup": a.warmup, "packing": packing, "overrides": a.set, "runs": {}}
    for name, batch in (("padded", a.global_batch), ("packed", packed_batch)):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", name, "--run-global-batch", str(batch)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = next((x for x in proc.stdout.splitlines()[::-1] if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            report["runs"][name] = {"error": (proc.stdout + proc.stderr)[-3000:]}
            continue
        report["runs"][name] = json.loads(line[7:])
    packed, padded = report["runs"].get("packed", {}), report["runs"].get("padded", {})
    if "tokens_per_s" in packed and "tokens_per_s" in padded:
        report["speedup"] = packed["tokens_per_s"] / padded["tokens_per_s"]
        report["loss_per_example_rel_diff"] = (packed["loss_per_example"] - padded["loss_per_example"]) \
            / padded["loss_per_example"]
    print(json.dumps(report, indent=1))
    cpu = "" if torch.cuda.is_available() else "CPU check of the script at a tiny size, not the H100 goal's figures. "
    common.emit(common.Result(
        tool="packing_speed", what=f"sft-{a.size}-packing-speed", gpu=common.gpu_info(),
        software=common.software("transformers"), recipe="sft", overrides=a.set,
        notes=cpu + "tokens/s counts the examples' input positions, padding excluded; loss_per_example: held-out "
                    "examples scored one per row after one epoch",
        metrics={**{k: v for k, v in report.items() if k not in ("device", "runs")}, **packed},
        baseline={"name": "data.packing=false (padded)", "command": None, "metrics": padded}), a.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
