"""GRPO step time and peak memory, trainbox's loop against TRL's GRPOTrainer (transformers generation, no vLLM).

    python benchmarks/grpo_speed.py --record                       # one H100 (an H200 is capped at an H100's memory)
    python benchmarks/grpo_speed.py --size tiny --steps 3 --warmup 1 --prompt-len 16 --completion-len 8 \\
        --modes full,lora                                           # a check of the script on a CPU
    python benchmarks/grpo_speed.py --sides ours --set grpo.sampling_copy=false   # ours through the model's weights
    python benchmarks/grpo_speed.py --sides ours --profile-sampling  # where a sampling's time goes, ms a token

Both sides train the SAME model folder (dpo_speed.py's: a Qwen2.5-0.5B-shaped Qwen2 with random weights and a
word-level tokenizer, one id a word, 0 end-of-text) on the SAME prompts (--prompt-len words each), with the same
reward function (`reward` below: the share of a completion's ids that are even, a pure function of the ids). A
step: --prompts prompts x --generations completions of up to --completion-len tokens, sampled at temperature 1
from the model as it stands, then trained (grpo.loss=dapo, TRL's default loss, beta 0: no reference, --iterations
policy updates a generation: grpo.num_iterations, TRL's num_iterations; default one) in micro-batches of
--micro-prompts prompts (--micro-prompts x --generations completions a forward); bf16 autocast over fp32 weights
and AdamW (full), or a bf16 frozen base with LoRA r=16, alpha 32, dropout 0.05, all-linear (lora), or that on a
4-bit base (qlora: NF4, double quantization, bf16 compute, on both sides); lr 1e-6 (LoRA 1e-5); activation
checkpointing on neither side
(--checkpointing: on both; TRL's GRPOConfig turns it on by default, which is set off here). A model of random weights
draws end-of-text about once in 150k ids, so on both sides nearly every completion is --completion-len tokens: the
work of a step is the same. TRL samples a step's completions in one generate (its generation_batch_size, the
default: every completion of the step), as ours does (grpo.generation_batch_size, default the same).

Measured: seconds a step after --warmup steps (ours from the logged rate, TRL from a callback's clock after CUDA
syncs), completion tokens a second (a step's completions' own tokens over its time), peak allocated memory, and the
mean completion length each side logged, and our memory plan's peak (plan_peak_gib: its sampling row counts the
KV caches and the prefill of a step's completions). Each (side, mode) runs in its own process, capped at an H100's
memory on a larger GPU. Prints one JSON report, then the result record (common.Result: ours measured, TRL its baseline);
--record writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import common

LORA = dict(r=16, alpha=32, dropout=0.05)   # dpo_speed.py's


def reward(prompts, completions, completion_ids=None, **rows):
    """The share of a completion's ids that are even (TRL's signature; ours passes the same)."""
    return [sum(i % 2 == 0 for i in c) / max(len(c), 1) for c in completion_ids]


def make_prompts(root: Path, vocab: int, words: int, n: int) -> Path:
    import numpy as np
    path = root / f"prompts-{vocab}-{words}.jsonl"
    if path.is_file():
        return path
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in rng.integers(1, vocab, size=words))}) + "\n")
    return path


def run_ours(folder: Path, data: Path, a) -> dict:
    import torch

    from trainbox.config import load_config
    from trainbox.train.loop import Trainer

    cuda = torch.cuda.is_available()
    lora = ["model.family=hf", f"lora.r={LORA['r']}", f"lora.alpha={LORA['alpha']}", f"lora.dropout={LORA['dropout']}",
            f"lora.gradient_checkpointing={str(a.checkpointing).lower()}",
            *(["quant.load_in_4bit=true"] if a.mode == "qlora" else [])] if a.mode != "full" else []
    cfg = load_config("grpo", [
        f"model.path={folder}", f"data.tokenizer={common.tokenizer_folder(folder.parent, a.size)}", f"data.path={data}",
        f"data.seq_len={a.prompt_len + a.completion_len}", f"grpo.max_completion_len={a.completion_len}",
        f"grpo.num_generations={a.generations}", f"grpo.rewards=[{Path(__file__).resolve()}:reward]",
        f"grpo.num_iterations={a.iterations}",
        f"train.micro_batch_size={a.micro_prompts}", f"train.global_batch_size={a.prompts}",
        f"train.max_steps={a.steps}", f"run.dir={a.root}/runs", f"run.name=ours-grpo-{a.mode}-{a.size}",
        "run.resume=never", f"optim.lr={1e-6 if a.mode == 'full' else 1e-5}", "optim.warmup_steps=0",
        "train.checkpoints=false", "train.eval_every=0", "monitor.log_every=1", "monitor.port=0",
        "train.memory_check=false", "train.dtype=bf16" if cuda else "train.dtype=fp32", *lora,
        *(["lora.gradient_checkpointing=true"] if a.mode != "full" else ["train.activation_checkpointing=full"])
        * a.checkpointing, *a.set])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    profiled = profile_sampling(a.warmup + 1, a.completion_len, cuda) if a.profile_sampling else None
    trainer.run()
    planned = common.planned_peak_gib(trainer) if cuda else None
    events = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e.get("event") == "train"]
    per_step = cfg.train.global_batch_size * cfg.data.seq_len * a.generations   # what tokens_per_s counts
    seconds = [per_step / e["tokens_per_s"] for e in train if e.get("tokens_per_s") and e["step"] > a.warmup]
    length = sum(e["completion_len"] for e in train if e["step"] > a.warmup) / max(len(seconds), 1)
    step_s = sum(seconds) / len(seconds) if seconds else None
    sampling = [e["sample_s"] for e in train if e["step"] > a.warmup]
    return {"step_s": step_s, "completion_tokens_per_s": a.prompts * a.generations * length / step_s if step_s else
            None, "completion_len": length, "sample_s": sum(sampling) / len(sampling) if sampling else None,
            "peak_memory_gib": common.peak_gib(), "plan_peak_gib": planned, "rewards": [e["reward"] for e in train],
            **({"sampling_profile": profiled} if profiled is not None else {})}


def profile_sampling(call: int, tokens: int, cuda: bool) -> dict:
    """Puts the `call`-th sampling of the run (objective/grpo.py's rollout) under torch.profiler; the dict returned
    is filled when it has run: its wall time, the GPU's busy time, and the kernels by kind and the top ones, in ms a
    token (the GPU kernels' own time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import trainbox.objective.grpo as grpo

    plain, calls, out = grpo.rollout, [0], {}

    def rollout(*args, **kw):
        calls[0] += 1
        if calls[0] != call:
            return plain(*args, **kw)
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            start = time.perf_counter()
            result = plain(*args, **kw)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        rows = [(e.self_device_time_total / 1e3 / tokens, e.count // tokens, e.key[:120]) for e in prof.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
        per_kind = {"kernels": sum(r[0] for r in rows)}
        kernels = rows
        out.update(wall_ms_per_token=round(wall * 1e3 / tokens, 3),
                   gpu_busy_ms_per_token=round(sum(per_kind.values()), 3),
                   ms_per_token_by_kind={k: round(v, 3) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
                   top_kernels=[(round(ms, 3), n, name) for ms, n, name in sorted(kernels, reverse=True)[:25]])
        return result

    grpo.rollout = rollout
    return out


def run_trl(folder: Path, data: Path, a) -> dict:
    """The reference: what a user writes with TRL, no trainbox involved."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    lora = a.mode != "full"
    # QLoRA as lora_speed.py loads it; GRPOTrainer prepares a 4-bit model for training itself (TRL's
    # prepare_peft_model: PEFT's prepare_model_for_kbit_training)
    quant = dict(device_map={"": 0}, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16)) if a.mode == "qlora" else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if lora and cuda else torch.float32,
                                                 **quant)
    times: dict[int, float] = {}
    history: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times[state.global_step] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            history.append({**(logs or {}), "step": state.global_step})

    accum = a.prompts // a.micro_prompts
    args = GRPOConfig(output_dir=f"{a.root}/runs/trl-grpo-{a.mode}-{a.size}",
                      per_device_train_batch_size=a.micro_prompts * a.generations, gradient_accumulation_steps=accum,
                      num_generations=a.generations, max_completion_length=a.completion_len, temperature=1.0,
                      beta=0.0, loss_type="dapo", num_iterations=a.iterations, max_steps=a.steps,
                      learning_rate=1e-5 if lora else 1e-6,
                      lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, bf16=cuda, fp16=False,
                      use_cpu=not cuda, optim="adamw_torch_fused" if cuda else "adamw_torch", logging_steps=1,
                      save_strategy="no", report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0,
                      gradient_checkpointing=a.checkpointing,
                      gradient_checkpointing_kwargs={"use_reentrant": False} if a.checkpointing else None)
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                             target_modules="all-linear", task_type="CAUSAL_LM") if lora else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=load_dataset("json", data_files=str(data))["train"],
                          processing_class=AutoTokenizer.from_pretrained(
                              common.tokenizer_folder(folder.parent, a.size)),
                          peft_config=peft_config, callbacks=[Clock()])
    trainer.train()
    step_s = (times[a.steps] - times[a.warmup]) / (a.steps - a.warmup)
    lengths = [e["completions/mean_length"] for e in history if "completions/mean_length" in e and e["step"] > a.warmup]
    length = sum(lengths) / len(lengths) if lengths else None
    return {"step_s": step_s, "completion_tokens_per_s": a.prompts * a.generations * length / step_s if length else
            None, "completion_len": length, "peak_memory_gib": common.peak_gib(),
            "rewards": [e.get("reward") for e in history if "reward" in e]}


def worker(a) -> dict:
    cap = common.cap_to_h100()
    folder = common.hf_model_folder(Path(a.root), a.size)
    data = make_prompts(Path(a.root), common.HF_SIZES[a.size]["vocab_size"], a.prompt_len, a.prompts * a.steps)
    return {**(run_ours if a.worker == "ours" else run_trl)(folder, data, a), "memory_cap_gib": cap}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(common.HF_SIZES), default="0.5b")
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the time")
    p.add_argument("--prompts", type=int, default=8, help="prompts a step")
    p.add_argument("--micro-prompts", type=int, default=2, help="prompts a micro-batch")
    p.add_argument("--generations", type=int, default=8, help="completions a prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--iterations", type=int, default=1, help="policy updates a generation (grpo.num_iterations, "
                                                               "TRL's num_iterations); --warmup a multiple of it")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on both sides (TRL's "
                                                                "GRPOConfig turns it on by default; off here unless "
                                                                "given, on both)")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--sides", default="trl,ours", help="which sides run (a side left out is not compared)")
    p.add_argument("--root", default="/tmp/trainbox-grpo-bench")
    p.add_argument("--record", action="store_true")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides for our runs")
    p.add_argument("--profile-sampling", action="store_true", help="profile our first sampling after --warmup "
                                                                   "steps: its kernels in ms a token, in our result")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["full", "lora", "qlora"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a)))
        return 0
    Path(a.root).mkdir(parents=True, exist_ok=True)
    shared = ["--size", a.size, "--steps", str(a.steps), "--warmup", str(a.warmup), "--prompts", str(a.prompts),
              "--micro-prompts", str(a.micro_prompts), "--generations", str(a.generations), "--prompt-len",
              str(a.prompt_len), "--completion-len", str(a.completion_len), "--root", a.root,
              "--iterations", str(a.iterations),
              *(["--checkpointing"] if a.checkpointing else []),
              *(["--profile-sampling"] if a.profile_sampling else []),
              *(["--set", *a.set] if a.set else [])]
    report = {k: getattr(a, k) for k in ("size", "steps", "warmup", "prompts", "micro_prompts", "generations",
                                         "prompt_len", "completion_len", "checkpointing", "iterations")}
    report.update(lora=LORA, ours_overrides=a.set, runs={}, ratio={})
    modes = [m for m in a.modes.split(",") if m]
    for mode in modes:
        for side in a.sides.split(","):
            report["runs"][f"{side}-{mode}"] = common.spawn_side(__file__, side, mode, shared, a.timeout)
            print(json.dumps({f"{side}-{mode}": report["runs"][f"{side}-{mode}"]}), file=sys.stderr, flush=True)
        ours, ref = report["runs"].get(f"ours-{mode}", {}), report["runs"].get(f"trl-{mode}", {})
        if ours.get("completion_tokens_per_s") and ref.get("completion_tokens_per_s"):
            report["ratio"][mode] = {"completion_tokens_per_s": ours["completion_tokens_per_s"]
                                     / ref["completion_tokens_per_s"],
                                     "step_s": ours["step_s"] / ref["step_s"],
                                     "peak_memory": ours["peak_memory_gib"] / ref["peak_memory_gib"]
                                     if ref["peak_memory_gib"] else None}
    gpu = common.gpu_info()
    report["device"] = gpu["name"] if gpu else "cpu"
    print(json.dumps(report, indent=1))
    runs = report["runs"]
    common.emit(common.Result(
        tool="grpo_speed", what=f"grpo-{a.size}-speed" + (f"-{a.iterations}-updates" if a.iterations > 1 else ""),
        gpu=gpu,
        software=common.software("transformers", "peft", "trl"), recipe="grpo",
        overrides=[*([f"grpo.num_iterations={a.iterations}"] if a.iterations > 1 else []), *a.set],
        metrics={**{k: v for k, v in report.items() if k not in ("device", "runs")},
                 **{m: runs.get(f"ours-{m}") for m in modes}},
        baseline={"name": "TRL GRPOTrainer", "command": None, "metrics": {m: runs.get(f"trl-{m}") for m in modes}}),
        a.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
