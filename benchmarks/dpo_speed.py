"""DPO throughput and peak memory, trainbox's loop against TRL's DPOTrainer, and the longest sequence that fits.

    python benchmarks/dpo_speed.py --record                       # one H100 (an H200 is capped at an H100's memory)
    python benchmarks/dpo_speed.py --size tiny --steps 4 --warmup 1 --seq-len 64 --micro-batch 2 \
        --max-len-size tiny --max-lens 64,128,256 --modes full,full-ref,lora    # a check of the script on a CPU

A GPU machine without network carries TRL and its dependencies as wheels (trl 1.16.0, datasets 5.2.0 and theirs,
fetched with `pip download trl==1.16.0 datasets==5.2.0 -d .whl` on a machine with the same Python) and installs
them first: `pip install --no-index --find-links .whl trl==1.16.0 datasets==5.2.0`.

Both sides train the SAME model folder, built once before any run (a Qwen2.5-0.5B-shaped Qwen2 config with random
weights: 24 layers, width 896, 14 heads, 2 key/value heads, SwiGLU 4,864, 151,936 ids, tied embeddings, q/k/v
biases) on the SAME preference pairs: plain-text rows of a word-level tokenizer (one id a word), each sequence
exactly --seq-len tokens (the prompt, the response, the end-of-text token), so neither side pads. Same micro-batch
of pairs (--micro-batch 4, 1,024 tokens: 8 sequences a forward), bf16 autocast over fp32 weights and AdamW (full
fine-tuning) or a bf16 frozen base with LoRA r=16, alpha 32, dropout 0.05, all-linear (lora), dropout off in the
policy as both sides do by default (TRL's disable_dropout, our dpo.disable_dropout), dpo loss with beta 0.1,
lr 5e-7 (LoRA 5e-6), no activation checkpointing on either side (--checkpointing: ours
train.activation_checkpointing=full or lora.gradient_checkpointing, TRL gradient_checkpointing without reentrancy),
`--steps` optimizer steps, tokens/s after `--warmup` steps (2 x pairs x seq_len tokens a step). Modes (--modes):

    full        every weight; the reference precomputed before the first step (ours: dpo.reference=precompute,
                TRL: precompute_ref_log_probs=True, precompute_ref_batch_size = the micro-batch); ours with
                model.fused_loss (the head and loss without the logits); TRL as it comes (no Liger kernels)
    full-ref    the same with the reference run beside the policy each step (ours: dpo.reference=model, a frozen
                bf16 copy; TRL: its reference model)
    lora        LoRA adapters (ours: model.family=hf with model.fused_loss), the reference the base with the
                adapters off on both sides
    full-packed full, ours with data.packing=true (--micro-batch rows of 2 x --seq-len holding whole pairs); TRL's
                run is full's (it pads each batch to its longest sequence)

--variable draws pairs of varied lengths (make_pairs) and compares pairs/s, and the tokens/s of the pairs' own
tokens, padding left out (tokens_per_s then counts each side's padded positions).

Each (side, mode) runs in its own process, so torch.cuda.max_memory_allocated is its own; on a GPU larger than an
H100 each process caps its allocator at an H100's memory (torch.cuda.set_per_process_memory_fraction). Our full
runs also give our memory plan's peak_allocated for the same run (plan_peak_gib, plan_error: the plan's 15% aim).

--loss kto measures KTO instead, against TRL's KTOTrainer: the same folder, unpaired rows of the same lengths (a
prompt and a completion, labelled desirable and undesirable in turn), --micro-batch counting examples, tokens/s
counting the examples' own sequences (each side also runs the mismatched sequences of its KL estimate, without
gradients), TRL's reference precomputed as DPO's (its precompute_ref_log_probs) in mode full.

--loss reward measures a reward model instead (train.objective=reward, the reward recipe), against TRL's
RewardTrainer on transformers' Qwen2ForSequenceClassification of the same folder (num_labels=1): the same pairs,
modes full and lora (no reference on either side; TRL's LoRA is PEFT's SEQ_CLS, the score head trained whole in
its modules_to_save, as ours is).

Then, for full DPO of a Llama-3.2-1B-shaped model (16 layers, width 2048, 128,256 ids) with one pair a step and
activation checkpointing on both sides, the longest of --max-lens that trains two steps on one GPU, each side, found
by bisection over the lengths (each its own process; ours with the plan's peak beside the measured one), and our
memory plan's verdict for each length on an H100.

Prints one JSON object with every run (wall_s: its seconds, start-up included), the ratios ours / TRL per mode
and the lengths, then the result record (common.Result: ours measured, TRL its baseline); --record writes it to
benchmarks/records/. The default invocation runs 4 processes, then about 5 for the lengths; `--max-lens ''` and
`--modes ''` run either part alone.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import common

LORA = dict(r=16, alpha=32, dropout=0.05)
SIZES = common.HF_SIZES
BETA = 0.1

def make_pairs(root: Path, vocab: int, seq_len: int, n: int, variable: bool = False) -> Path:
    """n pairs of words, each sequence exactly seq_len tokens: a prompt of seq_len // 2 words, a response of the
    rest less one, the end-of-text token (both sides append it to text responses). `variable`: lengths as real
    preference sets have them, a prompt of 16 to seq_len / 4 words and each response, drawn on its own, of 16 to
    the rest less one."""
    import numpy as np
    path = root / f"pairs-{vocab}-{seq_len}{'-variable' if variable else ''}.jsonl"
    if path.is_file():
        return path
    rng = np.random.default_rng(0)

    def words(k: int) -> str:
        return " ".join(f"w{i}" for i in rng.integers(1, vocab, size=k))
    with open(path, "w") as f:
        for _ in range(n):
            prompt = int(rng.integers(16, seq_len // 4 + 1)) if variable else seq_len // 2
            longest = seq_len - prompt - 1
            chosen, rejected = (int(rng.integers(16, longest + 1)) if variable else longest for _ in range(2))
            f.write(json.dumps({"prompt": words(prompt), "chosen": " " + words(chosen),
                                "rejected": " " + words(rejected)}) + "\n")
    return path


def pairs_per_s(trainer, events: list[dict], warmup: int) -> tuple[float, float]:
    """(pairs/s, tokens/s of the pairs' own tokens, padding left out) over the steps after `warmup`, from each
    logged step's rate and the pairs its global batch held."""
    import numpy as np
    pairs = trainer.train_data.pairs if hasattr(trainer.train_data, "row_pairs") else trainer.train_data
    kp, kc, kr = (np.asarray(k, dtype=np.int64) for k in pairs.kept)
    seconds = done = tokens = 0.0
    per_step = trainer.cfg.train.global_batch_size * trainer.cfg.data.seq_len * trainer.objective.sequences
    for e in events:
        if e.get("tokens_per_s") and e["step"] > warmup:
            ids = trainer.batches.global_indices(e["step"] - 1)
            if hasattr(trainer.train_data, "row_pairs"):
                ids = np.concatenate([trainer.train_data._pairs_of(int(r)) for r in ids])
            seconds += per_step / e["tokens_per_s"]
            done += len(ids)
            tokens += float((2 * kp[ids] + kc[ids] + kr[ids]).sum())
    return done / seconds, tokens / seconds


def make_examples(root: Path, vocab: int, seq_len: int, n: int) -> Path:
    """n unpaired rows of words, each sequence exactly seq_len tokens, desirable and undesirable in turn."""
    import numpy as np
    path = root / f"examples-{vocab}-{seq_len}.jsonl"
    if path.is_file():
        return path
    rng = np.random.default_rng(0)
    prompt, response = seq_len // 2, seq_len - seq_len // 2 - 1

    def words(k: int) -> str:
        return " ".join(f"w{i}" for i in rng.integers(1, vocab, size=k))
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": words(prompt), "completion": " " + words(response), "label": i % 2 == 0})
                    + "\n")
    return path


def run_ours(folder: Path, data: Path, a) -> dict:
    import torch

    from trainbox.config import load_config
    from trainbox.train.loop import Trainer

    cuda = torch.cuda.is_available()
    mode = {"full": ["model.fused_loss=true"], "full-ref": ["model.fused_loss=true", "dpo.reference=model"],
            "full-packed": ["model.fused_loss=true", "data.packing=true"],
            "lora": ["model.family=hf", "model.fused_loss=true", f"lora.r={LORA['r']}", f"lora.alpha={LORA['alpha']}",
                     f"lora.dropout={LORA['dropout']}", "lora.gradient_checkpointing=false"]}[a.mode]
    checkpointing = ["train.activation_checkpointing=full"] if a.checkpointing and a.mode != "lora" else \
        ["lora.gradient_checkpointing=true"] if a.checkpointing else []
    reward = a.loss == "reward"
    cfg = load_config("reward" if reward else "dpo", [
        f"model.path={folder}", f"data.tokenizer={common.tokenizer_folder(folder.parent, a.size)}", f"data.path={data}",
        f"data.seq_len={a.seq_len}",
        f"train.micro_batch_size={a.micro_batch}", f"train.global_batch_size={a.micro_batch * a.accum}",
        f"train.max_steps={a.steps}", f"run.dir={a.root}/runs", f"run.name=ours-{a.loss}-{a.mode}-{a.size}-{a.seq_len}",
        "run.resume=never", f"data.cache_dir={a.root}/cache", *([] if reward else [f"dpo.beta={BETA}",
                                                                                    f"dpo.loss={a.loss}"]),
        f"optim.lr={5e-6 if a.mode == 'lora' else 5e-7}", "optim.warmup_steps=0", "train.checkpoints=false",
        "train.eval_every=0", "train.sample_tokens=0", "monitor.log_every=1", "monitor.port=0",
        "train.memory_check=false", "train.dtype=bf16" if cuda else "train.dtype=fp32", *mode, *checkpointing,
        *a.set])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    trainer.run()
    if not a.variable and a.mode != "full-packed":
        (chosen, _), (rejected, _) = trainer.train_data.sequences(0)
        assert len(chosen) == len(rejected) == a.seq_len, "our sequences are not seq_len"   # no padding
    events = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e.get("event") == "train"]
    rates = [e["tokens_per_s"] for e in train if e.get("tokens_per_s") and e["step"] > a.warmup]
    pairs, real = pairs_per_s(trainer, train, a.warmup) if a.loss == "dpo" and rates else (None, None)
    out = {"tokens_per_s": len(rates) / sum(1 / r for r in rates) if rates else None, "pairs_per_s": pairs,
           "real_tokens_per_s": real, "peak_memory_gib": common.peak_gib(),
           "losses": [e["loss"] for e in train], "reward_accuracy": train[-1].get("reward_accuracy"),
           "reward_margin": train[-1].get("reward_margin"),
           "attention": trainer.kernels.attention}
    if a.mode != "lora":   # the plan beside the measurement (full DPO: the plan's 15% aim)
        out["plan_peak_gib"] = common.planned_peak_gib(trainer)
        if out["peak_memory_gib"]:
            out["plan_error"] = out["plan_peak_gib"] / out["peak_memory_gib"] - 1
    return out


def run_trl(folder: Path, data: Path, a) -> dict:
    """The reference: what a user writes with TRL, no trainbox involved."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer

    cuda = torch.cuda.is_available()
    kto, reward = a.loss == "kto", a.loss == "reward"
    lora = a.mode == "lora"
    dtype = torch.bfloat16 if lora and cuda else torch.float32
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=dtype) if reward else \
        AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    times: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times[state.global_step] = time.perf_counter()

    config, trainer_class = (KTOConfig, KTOTrainer) if kto else (RewardConfig, RewardTrainer) if reward else \
        (DPOConfig, DPOTrainer)
    loss = {} if reward else {"beta": BETA, "loss_type": "kto" if kto else ["sigmoid"],
                              "precompute_ref_log_probs": a.mode in ("full", "full-packed"),
                              "precompute_ref_batch_size": a.micro_batch}
    args = config(output_dir=f"{a.root}/runs/trl-{a.loss}-{a.mode}-{a.size}-{a.seq_len}",
                     per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=a.accum,
                     max_steps=a.steps, learning_rate=5e-6 if lora else 5e-7, lr_scheduler_type="linear",
                     warmup_steps=0, weight_decay=0.0, bf16=cuda, fp16=False, use_cpu=not cuda,
                     gradient_checkpointing=a.checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
                     optim="adamw_torch_fused" if cuda else "adamw_torch", logging_steps=1, save_strategy="no",
                     report_to=[], max_length=None, **loss, disable_dropout=True, dataloader_num_workers=2,
                     seed=0, disable_tqdm=True)
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                             target_modules="all-linear", task_type="SEQ_CLS" if reward else "CAUSAL_LM") \
        if lora else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = trainer_class(model=model, args=args, train_dataset=load_dataset("json", data_files=str(data))["train"],
                         processing_class=AutoTokenizer.from_pretrained(common.tokenizer_folder(folder.parent, a.size)),
                         peft_config=peft_config,
                         callbacks=[Clock()])
    example = trainer.train_dataset[0]
    own = example["completion_ids" if kto else "chosen_ids"]
    prompt = 0 if reward else len(example["prompt_ids"])   # the reward trainer's sequences hold their prompt
    assert a.variable or prompt + len(own) == a.seq_len, "TRL's sequences are not seq_len"
    out = trainer.train()
    seconds = times[a.steps] - times[a.warmup]
    done = (a.steps - a.warmup) * a.micro_batch * a.accum
    data = trainer.train_dataset
    mean = sum(2 * len(r.get("prompt_ids", [])) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in data) \
        / len(data) if not kto else None   # TRL draws pairs at random: its mean pair, for the tokens it trained
    return {"tokens_per_s": done * (1 if kto else 2) * a.seq_len / seconds, "pairs_per_s": done / seconds,
            "real_tokens_per_s": done * mean / seconds if mean else None, "peak_memory_gib": common.peak_gib(),
            "final_loss": out.training_loss}


def worker(a) -> dict:
    cap = common.cap_to_h100()
    folder = common.hf_model_folder(Path(a.root), a.size)
    pairs = a.steps * a.micro_batch * a.accum   # one epoch: the precomputed reference covers only these
    vocab = SIZES[a.size]["vocab_size"]
    data = make_examples(Path(a.root), vocab, a.seq_len, max(pairs, 2)) if a.loss == "kto" else \
        make_pairs(Path(a.root), vocab, a.seq_len, max(pairs * (6 if a.variable else 1), 2), a.variable)
    return {**(run_ours if a.worker == "ours" else run_trl)(folder, data, a), "memory_cap_gib": cap}


def longest(side: str, a) -> dict:
    """The longest of --max-lens at which `side` trains two steps of full DPO of --max-len-size, one pair a step
    (activation checkpointing, the reference precomputed), by bisection over the lengths: each run says whether
    that length fits, so the runs needed are about log2 of the lengths' count."""
    lengths = sorted(int(x) for x in a.max_lens.split(","))
    lo, hi, runs = -1, len(lengths), {}   # lengths[lo] fits, lengths[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        n = lengths[mid]
        res = common.spawn_side(__file__, side, "full", [
            "--size", a.max_len_size, "--seq-len", str(n), "--micro-batch", "1", "--accum", "1", "--steps", "2",
            "--warmup", "0", "--checkpointing", "--root", a.root, *(["--set", *a.set] if a.set else [])], a.timeout)
        runs[n] = {k: res[k] for k in ("peak_memory_gib", "plan_peak_gib", "plan_error", "error", "wall_s",
                                       "memory_cap_gib") if k in res}
        lo, hi = (mid, hi) if "error" not in res else (lo, mid)
        if "error" in res and res["error"] != "out of memory":
            break   # a failure that is not memory says nothing about the longer lengths
    return {"longest": lengths[lo] if lo >= 0 else None, "tried": runs}


def planned_longest(a) -> dict:
    """Our memory plan's verdict for each length (one H100), as `trainbox plan` gives it."""
    from trainbox.config import load_config
    from trainbox.model.build import resolve_model
    from trainbox.plan import gpu, make_plan, run_vocab
    folder = common.hf_model_folder(Path(a.root), a.max_len_size)
    out = {}
    for n in (int(x) for x in a.max_lens.split(",")):
        tokenizer = common.tokenizer_folder(folder.parent, a.max_len_size)
        cfg = resolve_model(load_config("dpo", [f"model.path={folder}", f"data.seq_len={n}",
                                                f"data.tokenizer={tokenizer}", "train.micro_batch_size=1",
                                                "train.global_batch_size=1", "train.activation_checkpointing=full",
                                                "model.fused_loss=true"]))
        plan = make_plan(cfg, run_vocab(cfg), gpu("H100"), suggest=False)
        out[n] = {"peak_gib": round(plan.memory.peak_allocated / 2**30, 2),
                  "needed_gib": round(plan.memory.needed / 2**30, 2), "fits": plan.fits}
    return out


TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "reward": "RewardTrainer"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="0.5b")
    p.add_argument("--modes", default="full,lora", help="comma list of full, full-ref, full-packed, lora ('' skips "
                                                         "them); full-packed: ours with data.packing=true (rows of "
                                                         "2 x --seq-len, --micro-batch of them), TRL as in full")
    p.add_argument("--variable", action="store_true", help="pairs of varied lengths (make_pairs); compare pairs/s")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from tokens/s")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--loss", choices=["dpo", "kto", "reward"], default="dpo",
                   help="kto: unpaired examples, TRL's KTOTrainer; reward: a reward model, TRL's RewardTrainer")
    p.add_argument("--micro-batch", type=int, default=4, help="pairs a forward (2 x that many sequences); kto: "
                                                              "examples")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on both sides")
    p.add_argument("--max-len-size", choices=list(SIZES), default="1b")
    p.add_argument("--max-lens", default="16384,32768,65536,131072",
                   help="the lengths the search bisects ('' skips it)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take (start-up included)")
    p.add_argument("--root", default="/tmp/trainbox-dpo-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides for our runs (e.g. train.compile=true)")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--build", nargs="*", choices=list(SIZES), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["full", "full-ref", "full-packed", "lora"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a)))
        return 0
    if a.build is not None:
        for size in a.build:
            common.hf_model_folder(Path(a.root), size)
        return 0
    Path(a.root).mkdir(parents=True, exist_ok=True)
    shared = ["--size", a.size, "--loss", a.loss, "--seq-len", str(a.seq_len), "--micro-batch", str(a.micro_batch),
              "--accum", str(a.accum), "--steps", str(a.steps), "--warmup", str(a.warmup), "--root", a.root,
              *(["--checkpointing"] if a.checkpointing else []), *(["--variable"] if a.variable else []),
              *(["--set", *a.set] if a.set else [])]
    report = {"size": a.size, "loss": a.loss, "seq_len": a.seq_len,
              f"micro_batch_{'examples' if a.loss == 'kto' else 'pairs'}": a.micro_batch, "accum": a.accum,
              "steps": a.steps, "warmup": a.warmup, "checkpointing": a.checkpointing, "beta": BETA, "lora": LORA,
              "variable": a.variable, "ours_overrides": a.set, "runs": {}, "ratio": {}}
    modes = [m for m in a.modes.split(",") if m]
    if modes or a.max_lens:   # the folders, once, before any run
        subprocess.run([sys.executable, __file__, "--build", *(a.size,) * bool(modes),
                        *(a.max_len_size,) * bool(a.max_lens), "--root", a.root], check=True)
    for mode in modes:
        for side in ("trl", "ours"):
            if side == "trl" and mode == "full-packed" and "trl-full" in report["runs"]:
                report["runs"]["trl-full-packed"] = report["runs"]["trl-full"]   # TRL's run is the same
                continue
            report["runs"][f"{side}-{mode}"] = common.spawn_side(__file__, side, mode, shared, a.timeout)
            print(json.dumps({f"{side}-{mode}": report["runs"][f"{side}-{mode}"]}), file=sys.stderr, flush=True)
        ours, ref = report["runs"][f"ours-{mode}"], report["runs"][f"trl-{mode}"]
        if ours.get("tokens_per_s") and ref.get("tokens_per_s"):
            report["ratio"][mode] = {"tokens_per_s": ours["tokens_per_s"] / ref["tokens_per_s"],
                                     "pairs_per_s": ours["pairs_per_s"] / ref["pairs_per_s"]
                                     if ours.get("pairs_per_s") and ref.get("pairs_per_s") else None,
                                     "peak_memory": ours["peak_memory_gib"] / ref["peak_memory_gib"]
                                     if ref["peak_memory_gib"] else None}   # (none measured on a CPU)
    if a.max_lens:
        report["longest"] = {"size": a.max_len_size, "ours": longest("ours", a), "trl": longest("trl", a),
                             "plan_h100": planned_longest(a)}
    gpu = common.gpu_info()   # only now: this process holds no GPU memory while the runs measure theirs
    report["device"] = gpu["name"] if gpu else "cpu"
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    runs = report["runs"]
    common.emit(common.Result(
        tool="dpo_speed", what=f"{a.loss}-{a.size}-speed{'-variable' if a.variable else ''}", gpu=gpu,
        software=common.software("transformers", "peft", "trl"), recipe="reward" if a.loss == "reward" else "dpo",
        overrides=a.set,
        metrics={**{k: v for k, v in report.items() if k not in ("device", "runs")},
                 **{m: runs.get(f"ours-{m}") for m in modes},
                 **({"longest_ours": report["longest"]["ours"]["longest"]} if a.max_lens else {})},
        baseline={"name": f"TRL {TRAINERS[a.loss]}", "command": None,
                  "metrics": {**{m: runs.get(f"trl-{m}") for m in modes},
                              **({"longest": report["longest"]["trl"]["longest"]} if a.max_lens else {})}}),
        a.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
