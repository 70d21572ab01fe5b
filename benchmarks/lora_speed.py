"""LoRA / QLoRA throughput and peak memory: trainbox's loop vs a plain transformers Trainer + PEFT script.

    python benchmarks/lora_speed.py --record                               # H100: bf16 LoRA and 4-bit QLoRA
    python benchmarks/lora_speed.py --size small --steps 10 --modes lora   # quick check of the script

Both sides train the SAME model (a Llama-style config with random weights, ~0.5B parameters by default,
saved to a folder once), on the SAME token windows, with the same micro batch, sequence length, LoRA
(r=16, alpha=32, dropout 0.05, all-linear), non-reentrant gradient checkpointing, bf16 autocast over a
bf16 base (or NF4 + double quantisation + bf16 compute for QLoRA), fused AdamW, lr 2e-4, and `--steps`
optimizer steps. Each (implementation, mode) runs in its own process so peak memory
(torch.cuda.max_memory_allocated) is not shared. tokens/s is measured after `--warmup` steps.
Prints one JSON object (and writes it to --out) with each run and the ratio ours / Trainer per mode, then the
result record (common.Result: ours measured, the Trainer its baseline); --record also writes it to
benchmarks/records/. Needs: trainbox[finetune,quant] and a CUDA GPU. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import common

SIZES = {  # ~0.5B (Qwen2.5-0.5B-like widths, 32k vocab) and a tiny one for checking the script
    "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=2000),
}
LORA = dict(r=16, alpha=32, dropout=0.05)


def make_assets(root: Path, size: str, seq_len: int, n_windows: int) -> None:
    """Model folder (random weights, word-level tokenizer covering the vocabulary) and a token shard."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from trainbox.data.formats import write_shard

    model_dir = root / f"model-{size}"
    spec = SIZES[size]
    if not (model_dir / "config.json").is_file():
        vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, spec["vocab_size"])}}
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")),
                                      eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        torch.manual_seed(0)
        cfg = LlamaConfig(**spec, max_position_embeddings=max(4096, seq_len), tie_word_embeddings=True,
                          eos_token_id=0, bos_token_id=0, dtype="bfloat16")
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    data = root / f"tokens-{size}-{seq_len}.bin"
    if not data.is_file():  # Zipf-like ids, so the loss has something to learn
        rng = np.random.default_rng(0)
        ids = np.minimum(rng.zipf(1.2, size=n_windows * seq_len + 1), spec["vocab_size"] - 1)
        write_shard(data, ids.astype(np.uint16))


def _reset_peak() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    import torch
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def run_ours(root: Path, a) -> dict:
    import torch

    from trainbox.config import load_config
    from trainbox.train.loop import Trainer

    quant = ["quant.load_in_4bit=true"] if a.mode == "qlora" else []
    dtype = "train.dtype=bf16" if torch.cuda.is_available() else "train.dtype=fp32"  # CPU: smoke check only
    cfg = load_config("lora", [
        f"model.path={root / f'model-{a.size}'}", f"data.path={root / f'tokens-{a.size}-{a.seq_len}.bin'}",
        f"data.seq_len={a.seq_len}", f"train.micro_batch_size={a.micro_batch}",
        f"train.global_batch_size={a.micro_batch * a.accum}", f"train.max_steps={a.steps}",
        f"run.dir={root / 'runs'}", f"run.name=ours-{a.mode}-{a.size}", "run.resume=never",
        f"lora.r={LORA['r']}", f"lora.alpha={LORA['alpha']}", f"lora.dropout={LORA['dropout']}",
        "optim.lr=2e-4", "optim.warmup_steps=0", "train.checkpoint_every=0", "train.eval_every=0",
        "train.sample_tokens=0", f"monitor.log_every={a.warmup}", "monitor.port=0", dtype, *quant, *a.set])
    _reset_peak()
    trainer = Trainer(cfg)
    trainer.run()
    events = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [e["tokens_per_s"] for e in events if e.get("event") == "train" and e.get("tokens_per_s")
             and e["step"] > a.warmup]
    # equal tokens per window: the overall rate is the harmonic mean of the window rates
    tok_s = len(rates) / sum(1 / r for r in rates)
    return {"tokens_per_s": tok_s, "peak_memory_gib": _peak_gib(),
            "final_loss": [e["loss"] for e in events if e.get("event") == "train"][-1]}


def run_trainer(root: Path, a) -> dict:
    """The reference: what a user writes with transformers + PEFT, no trainbox involved."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoModelForCausalLM,
        BitsAndBytesConfig,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    from trainbox.data.formats import read_shard

    ids = np.asarray(read_shard(root / f"tokens-{a.size}-{a.seq_len}.bin"), dtype=np.int64)
    n = (len(ids) - 1) // a.seq_len
    windows = [torch.from_numpy(ids[i * a.seq_len:(i + 1) * a.seq_len]) for i in range(n)]
    dataset = [{"input_ids": w, "labels": w, "attention_mask": torch.ones_like(w)} for w in windows]
    cuda = torch.cuda.is_available()
    kwargs = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if a.mode == "qlora":
        kwargs.update(device_map={"": 0}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16))
    _reset_peak()
    model = AutoModelForCausalLM.from_pretrained(root / f"model-{a.size}", **kwargs)
    gc = {"use_reentrant": False}
    if a.mode == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs=gc)
    model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    times: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times[state.global_step] = time.perf_counter()

    args = TrainingArguments(output_dir=str(root / "runs" / f"trainer-{a.mode}-{a.size}"),
                             per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=a.accum,
                             max_steps=a.steps, learning_rate=2e-4, lr_scheduler_type="cosine", bf16=cuda,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs=gc,
                             optim="adamw_torch_fused" if cuda else "adamw_torch", logging_steps=a.warmup,
                             save_strategy="no", report_to=[],
                             dataloader_num_workers=2, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                      callbacks=[Clock()])
    out = trainer.train()
    tokens = (a.steps - a.warmup) * a.micro_batch * a.accum * a.seq_len
    return {"tokens_per_s": tokens / (times[a.steps] - times[a.warmup]),
            "peak_memory_gib": _peak_gib(), "final_loss": out.training_loss}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="0.5b")
    p.add_argument("--modes", default="lora,qlora", help="comma list of lora, qlora")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from tokens/s")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--root", default="/tmp/trainbox-lora-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides for our run (e.g. train.compile=true)")
    p.add_argument("--worker", choices=["ours", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["lora", "qlora"], help=argparse.SUPPRESS)
    a = p.parse_args()
    root = Path(a.root)
    if a.worker:
        result = (run_ours if a.worker == "ours" else run_trainer)(root, a)
        print("RESULT " + json.dumps(result))
        return 0
    import torch
    root.mkdir(parents=True, exist_ok=True)
    make_assets(root, a.size, a.seq_len, n_windows=max(4 * a.steps * a.micro_batch * a.accum, 64))
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "size": a.size,
              "seq_len": a.seq_len, "micro_batch": a.micro_batch, "accum": a.accum, "steps": a.steps,
              "warmup": a.warmup, "lora": LORA, "ours_overrides": a.set, "runs": {}, "ratio": {}}
    for mode in a.modes.split(","):
        for worker in ("trainer", "ours"):
            cmd = [sys.executable, __file__, "--worker", worker, "--mode", mode, *sys.argv[1:]]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            line = next((x for x in proc.stdout.splitlines()[::-1] if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                report["runs"][f"{worker}-{mode}"] = {"error": proc.stderr[-3000:]}
                continue
            report["runs"][f"{worker}-{mode}"] = json.loads(line[7:])
        ours, ref = report["runs"].get(f"ours-{mode}", {}), report["runs"].get(f"trainer-{mode}", {})
        if "tokens_per_s" in ours and "tokens_per_s" in ref:
            report["ratio"][mode] = {"tokens_per_s": ours["tokens_per_s"] / ref["tokens_per_s"],
                                     "peak_memory": ours["peak_memory_gib"] / max(ref["peak_memory_gib"], 1e-9)}
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    modes = a.modes.split(",")
    runs = report["runs"]
    common.emit(common.Result(
        tool="lora_speed", what=f"lora-{a.size}-speed", gpu=common.gpu_info(),
        software=common.software("transformers", "peft", "bitsandbytes"), recipe="lora", overrides=a.set,
        metrics={**{k: v for k, v in report.items() if k not in ("device", "torch", "runs")},
                 **{m: runs.get(f"ours-{m}") for m in modes}},
        baseline={"name": "transformers Trainer + PEFT", "command": None,
                  "metrics": {m: runs.get(f"trainer-{m}") for m in modes}}), a.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
