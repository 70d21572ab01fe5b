"""A real preference-tuning run on a CPU: SFT, then DPO, of a Llama-shaped model on the embedded Shakespeare.

    python benchmarks/dpo_real_run.py --record                                   # the recorded run
    python benchmarks/dpo_real_run.py --size tiny --sft-steps 40 --sft-rows 400 --dpo-steps 30 --dpo-lr 1e-4 \
        --pairs 240 --val-pairs 64 --seq-len 64                                   # the quick version the test runs

1. A Llama folder with random weights (LlamaForCausalLM, `--size`) and the embedded Shakespeare BPE
   (2,048 ids) as its tokenizer.
2. `trainbox train sft model.path=FOLDER` on the training plays as plain-text rows (every token trained),
   then `trainbox export` of that run to a Hugging Face folder.
3. Preference pairs from the held-out plays (data/embedded.py's VAL_WORKS, never seen in step 2): the prompt is
   a few lines, the chosen response the line that follows it, the rejected one the same line with its words
   shuffled. Julius Caesar and Macbeth give the training pairs, Twelfth Night the validation pairs.
4. `trainbox train dpo model.path=SFT_FOLDER` on them (dpo.loss=dpo, the precomputed reference), with evaluation
   on the validation pairs.

Prints the record (common.Result): the SFT run's losses, and the DPO run's reward accuracy, margin and summed
log-probability of the chosen responses at its start and end (means over the first and last logged windows) and
its validation reward accuracy per evaluation; the runs' loss.png (DPO: with reward accuracy and rewards
panels) stay in --root, and --record copies the DPO run's to docs/figures/ under the record's name. The chosen
responses' log-probability against the initial model's, on the same pairs, is reward_chosen / beta (train: the
last window; validation: each evaluation). Runs the real CLI in subprocesses, as a user would.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

FIGURES = common.REPO / "docs" / "figures"   # where --record puts the DPO run's loss.png

SIZES = {  # Llama shapes: (layers, width, heads, key/value heads, MLP width)
    "small": (4, 128, 4, 2, 384),
    "tiny": (2, 64, 4, 2, 128),
}


def make_folder(out: Path, size: str, seq_len: int) -> Path:
    """A LlamaForCausalLM with random weights and the embedded Shakespeare BPE, saved as save_pretrained does."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from trainbox.data.tokenizer import asset_path

    tok = PreTrainedTokenizerFast(tokenizer_file=str(asset_path("shakespeare-bpe.json")), eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    layers, width, heads, kv, ffn = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq_len,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def sft_rows(path: Path, limit: int | None = None, chars: int = 600) -> int:
    """The training plays as plain-text rows of about `chars` characters, cut at line ends (the first `limit`)."""
    from trainbox.data import embedded
    rows = []
    for text in embedded.split("train"):
        piece = []
        for line in text.splitlines(keepends=True):
            piece.append(line)
            if sum(map(len, piece)) >= chars:
                rows.append(json.dumps({"text": "".join(piece)}) + "\n")
                piece = []
    path.write_text("".join(rows[:limit]))
    return len(rows[:limit])


def preference_rows(works: list[str], path: Path, seed: int, seq_len: int, limit: int | None = None,
                    context: int = 4) -> int:
    """Pairs from these held-out plays: up to `context` lines as the prompt (as many as fit half of seq_len), the
    next line (chosen) and that line with its words shuffled (rejected), one pair every `context + 1` lines (the
    first `limit`)."""
    from trainbox.data import embedded
    from trainbox.data.tokenizer import get_tokenizer
    tok = get_tokenizer("embedded:shakespeare-bpe")
    rng, n = random.Random(seed), 0
    with open(path, "w") as f:
        for work in works:
            lines = [ln.strip() for ln in embedded.works()[work].splitlines() if ln.strip()]
            for i in range(context, len(lines), context + 1):
                words = lines[i].split()
                if len(words) < 4:
                    continue
                shuffled = words[:]
                while shuffled == words:
                    rng.shuffle(shuffled)
                before = lines[i - context:i]
                while len(before) > 1 and len(tok.encode("\n".join(before) + "\n")) > seq_len // 2:
                    before = before[1:]
                prompt = "\n".join(before) + "\n"
                f.write(json.dumps({"prompt": prompt, "chosen": lines[i], "rejected": " ".join(shuffled)}) + "\n")
                n += 1
                if n == limit:
                    return n
    return n


def trainbox(*args: str, log: Path) -> None:
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "trainbox", *args], stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"trainbox {' '.join(args)} exited {proc.returncode}; see {log}")


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def window_mean(train: list[dict], key: str, first: bool, k: int = 10) -> float:
    """The mean of `key` over the first (or last) k steps that logged it."""
    logged = [e[key] for e in train if key in e]
    return statistics.fmean(logged[:k] if first else logged[-k:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="small")
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--dpo-steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--dpo-lr", type=float, default=2e-5)
    p.add_argument("--sft-rows", type=int, default=None, help="at most this many SFT rows (default: all)")
    p.add_argument("--pairs", type=int, default=None, help="at most this many training pairs (default: all)")
    p.add_argument("--val-pairs", type=int, default=256, help="validation pairs")
    p.add_argument("--root", default="/tmp/trainbox-dpo-real-run")
    p.add_argument("--reuse-sft", action="store_true", help="keep --root's SFT model from an earlier run (DPO only)")
    p.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    a = p.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = make_folder(root / "base", a.size, a.seq_len)
    docs = sft_rows(root / "shakespeare-train.jsonl", a.sft_rows)
    pairs = preference_rows(["julius_caesar", "macbeth"], root / "prefs-train.jsonl", 0, a.seq_len, a.pairs)
    val_pairs = preference_rows(["twelfth_night"], root / "prefs-val.jsonl", 1, a.seq_len, a.val_pairs)
    common_args = [f"run.dir={root / 'runs'}", "run.resume=never", f"data.cache_dir={root / 'cache'}",
                   "monitor.port=0", "monitor.log_every=1", "train.sample_tokens=0", f"data.seq_len={a.seq_len}"]
    sft = [f"model.path={base}", f"data.path={root / 'shakespeare-train.jsonl'}", "run.name=sft",
           f"train.max_steps={a.sft_steps}", "train.global_batch_size=32", "train.micro_batch_size=16",
           "train.activation_checkpointing=none", "optim.lr=3e-3", "optim.warmup_steps=20", "optim.weight_decay=0.1",
           "train.eval_every=0", "train.checkpoint_every=0", *common_args]
    reused = a.reuse_sft and (root / "sft-hf" / "config.json").is_file()
    if not reused:
        trainbox("train", "sft", *sft, log=root / "sft.log")
        trainbox("export", str(root / "runs" / "sft"), "--format", "hf", "--out", str(root / "sft-hf"), "--force",
                 log=root / "export.log")
    shutil.rmtree(root / "runs" / "dpo", ignore_errors=True)
    dpo = [f"model.path={root / 'sft-hf'}", f"data.path={root / 'prefs-train.jsonl'}",
           f"data.val_path={root / 'prefs-val.jsonl'}", "run.name=dpo", f"train.max_steps={a.dpo_steps}",
           "train.global_batch_size=16", "train.micro_batch_size=8", f"optim.lr={a.dpo_lr}", "optim.warmup_steps=10",
           f"dpo.beta={a.beta}", f"train.eval_every={max(1, a.dpo_steps // 4)}",
           f"train.eval_tokens={2 * a.seq_len * val_pairs}", "train.checkpoint_every=0", *common_args]
    trainbox("train", "dpo", *dpo, log=root / "dpo.log")
    sft_train, dpo_train = events(root / "runs" / "sft", "train"), events(root / "runs" / "dpo", "train")
    dpo_eval = events(root / "runs" / "dpo", "eval")
    metrics = {
        "size": a.size, "seq_len": a.seq_len, "sft_documents": docs, "train_pairs": pairs, "val_pairs": val_pairs,
        "sft": {"steps": len(sft_train), "first_loss": sft_train[0]["loss"], "final_loss": sft_train[-1]["loss"],
                "reused": reused},
        "dpo": {"steps": a.dpo_steps, "beta": a.beta, "lr": a.dpo_lr,
                "reward_accuracy_first": dpo_train[0]["reward_accuracy"],
                "reward_accuracy_start": window_mean(dpo_train, "reward_accuracy", True),
                "reward_accuracy_end": window_mean(dpo_train, "reward_accuracy", False),
                "reward_margin_end": window_mean(dpo_train, "reward_margin", False),
                "reward_chosen_start": window_mean(dpo_train, "reward_chosen", True),
                "reward_chosen_end": window_mean(dpo_train, "reward_chosen", False),
                "reward_rejected_end": window_mean(dpo_train, "reward_rejected", False),
                "logp_chosen_start": window_mean(dpo_train, "logp_chosen", True),
                "logp_chosen_end": window_mean(dpo_train, "logp_chosen", False),
                "logp_rejected_start": window_mean(dpo_train, "logp_rejected", True),
                "logp_rejected_end": window_mean(dpo_train, "logp_rejected", False),
                "first_loss": dpo_train[0]["loss"], "final_loss": dpo_train[-1]["loss"],
                "val": [{"step": e["step"], "reward_accuracy": e["val_reward_accuracy"],
                         "reward_margin": e["val_reward_margin"], "reward_chosen": e["val_reward_chosen"],
                         "reward_rejected": e["val_reward_rejected"], "loss": e["val_loss"]} for e in dpo_eval]},
        "loss_png": {"sft": str(root / "runs" / "sft" / "loss.png"), "dpo": str(root / "runs" / "dpo" / "loss.png")},
        "wall_s": round(time.perf_counter() - start, 1),   # the SFT's included unless it was reused
    }
    result = common.Result(
        tool="dpo_real_run", what=f"dpo-shakespeare-{a.size}", software=common.software("transformers"),
        recipe="dpo", overrides=[o for o in dpo if not o.startswith(("model.path", "data.", "run.", "monitor."))],
        notes="SFT (recipe sft) of a random-weight Llama on the embedded Shakespeare's training plays, then DPO "
              "(recipe dpo) on pairs from the held-out plays: chosen the true next line, rejected its words shuffled",
        metrics=metrics)
    if a.record:   # the DPO run's loss.png beside the documentation (records/ holds JSON records only)
        figure = FIGURES / (Path(result.file_name()).stem + "-loss.png")
        figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / "runs" / "dpo" / "loss.png", figure)
        metrics["loss_png"]["dpo"] = str(figure.relative_to(common.REPO))
    common.emit(result, a.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
