"""Does train.eval_tasks cost step time beyond the evaluation itself? Step time with and without lm-eval tasks
every N steps, the evaluations' own time left out.

    PYTHONPATH=src python benchmarks/eval_tasks_overhead.py --threads 1 --record     # CPU, small GPT
    PYTHONPATH=src python benchmarks/eval_tasks_overhead.py --device cuda --preset gpu --steps 300 --every 50

Each trial trains the same model in this process, in two modes that alternate (off, tasks, off, tasks, ...) so that
drift in the machine's load hits both alike: "off" (no train.eval_tasks) and "tasks" (a local multiple-choice task
of --docs documents, written by this tool, every --every steps). A step's time is its Trainer.train_step call
(forward, backward, optimizer, the next batch's prefetch), timed by a wrapper in wall-clock and in this process's CPU
time (steadier where other processes share the cores); the evaluations run outside it. Reported after --warmup
steps: the median and mean step time of each mode, the median of the steps right after an evaluation (a cost the
evaluation would leave behind: cold caches, a model left in eval mode, memory to give back), and the evaluations'
own seconds. Prints one JSON object, then the result record (common.Result, mode "off" as the baseline); --record
writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import common

PRESETS = {
    "cpu": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "data.seq_len=128",
            "train.global_batch_size=8", "train.micro_batch_size=8"],
    "gpu": ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "data.seq_len=1024",
            "train.global_batch_size=16", "train.micro_batch_size=16"],
}

TASK = """task: overhead_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path, docs: int) -> Path:
    words = "king queen lord lady sword crown night day love death heart blood house court war peace".split()
    rng = random.Random(0)
    rows = [{"question": "ROMEO: " + " ".join(rng.choices(words, k=12)), "answer": i % 4,
             "choices": [" " + " ".join(rng.choices(words, k=3)) for _ in range(4)]} for i in range(docs)]
    (folder / "overhead_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "overhead_mc.yaml").write_text(TASK.format(data=folder / "overhead_mc.jsonl"))
    return folder / "overhead_mc.yaml"


def trial(overrides: list[str], task: Path | None, every: int, warmup: int) -> dict:
    """One run; -> per-step wall and CPU milliseconds of its train_step calls after `warmup` (whether an evaluation
    came right before each), and the evaluations' seconds."""
    import torch

    from trainbox.config import load_config
    from trainbox.train import loop

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rows, evals, after = [], [], [False]
    step_fn, eval_fn = loop.Trainer.train_step, loop.Trainer._evaluate_tasks

    def train_step(self, step):
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        out = step_fn(self, step)
        sync()
        if step >= warmup:
            rows.append((1000 * (time.perf_counter() - wall), 1000 * (time.process_time() - cpu), after[0]))
        after[0] = False
        return out

    def evaluate_tasks(self, step):
        seconds = eval_fn(self, step)
        evals.append(seconds)
        after[0] = True
        return seconds

    tasks = [f"train.eval_tasks=[{task}]", f"train.eval_tasks_every={every}"] if task else []
    loop.Trainer.train_step, loop.Trainer._evaluate_tasks = train_step, evaluate_tasks
    try:
        with tempfile.TemporaryDirectory() as tmp:
            loop.train(load_config(None, [*overrides, *tasks, f"run.dir={tmp}", "run.name=bench"]))
            events = [json.loads(x) for x in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()]
    finally:
        loop.Trainer.train_step, loop.Trainer._evaluate_tasks = step_fn, eval_fn
    if task and not any(e["event"] == "eval_tasks" for e in events):   # left out: "tasks" would time nothing
        raise SystemExit(f"eval_tasks_overhead: {task.name} scored nothing (left out: see the log above)")
    return {"wall": [r[0] for r in rows], "cpu": [r[1] for r in rows], "after_wall": [r[0] for r in rows if r[2]],
            "after_cpu": [r[1] for r in rows if r[2]], "evals": evals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--every", type=int, default=20, help="train.eval_tasks_every")
    ap.add_argument("--docs", type=int, default=32, help="documents of the task (4 requests each)")
    ap.add_argument("--rounds", type=int, default=3, help="trials per mode")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for training (train.threads)")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    args = ap.parse_args()
    import torch

    overrides = [*PRESETS[args.preset], "data.tokenizer=embedded:shakespeare-bpe", "optim.warmup_steps=10",
                 f"train.device={args.device}", f"train.max_steps={args.steps}", "train.eval_every=0",
                 "train.checkpoints=false", "train.sample_tokens=0", "train.eval_tokens=4096", "monitor.log_every=1",
                 "monitor.enabled=false", "monitor.progress=lines",
                 *([f"train.threads={args.threads}"] if args.threads else [])]
    runs: dict[str, list[dict]] = {"off": [], "tasks": []}
    with tempfile.TemporaryDirectory() as tmp:
        task = write_task(Path(tmp), args.docs)
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(trial(overrides, task if mode == "tasks" else None, args.every, args.warmup))
    def pooled(mode: str, key: str) -> list[float]:
        return [x for r in runs[mode] for x in r[key]]

    med = {(m, k): statistics.median(pooled(m, k)) for m in runs for k in ("wall", "cpu")}
    evals = pooled("tasks", "evals")
    metrics = {
        "steps": args.steps, "warmup": args.warmup, "every": args.every, "docs": args.docs, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "device": args.device,
        "median_step_ms": {m: round(med[m, "wall"], 3) for m in runs},
        "median_step_cpu_ms": {m: round(med[m, "cpu"], 3) for m in runs},
        "mean_step_ms": {m: round(statistics.fmean(pooled(m, "wall")), 3) for m in runs},
        "median_step_ms_right_after_an_evaluation": round(statistics.median(pooled("tasks", "after_wall")), 3),
        "median_step_cpu_ms_right_after_an_evaluation": round(statistics.median(pooled("tasks", "after_cpu")), 3),
        "steps_right_after_an_evaluation": len(pooled("tasks", "after_wall")),
        "overhead_pct_median": round(100 * (med["tasks", "wall"] - med["off", "wall"]) / med["off", "wall"], 2),
        "overhead_pct_median_cpu": round(100 * (med["tasks", "cpu"] - med["off", "cpu"]) / med["off", "cpu"], 2),
        "evaluation_seconds": {"median": round(statistics.median(evals), 3), "count": len(evals)}}
    med = {m: med[m, "wall"] for m in runs}
    print(json.dumps(metrics, indent=1))
    gpu = common.gpu_info() if args.device.startswith("cuda") else None
    common.emit(common.Result(
        tool="eval_tasks_overhead", what=f"preset-{args.preset}-eval-tasks-overhead", gpu=gpu,
        software=common.software("lm-eval"), overrides=overrides,
        notes="step time with train.eval_tasks against without, the evaluations' own time left out",
        metrics=metrics, baseline={"name": "no train.eval_tasks", "command": None,
                                   "metrics": {"median_step_ms": round(med["off"], 3)}}), args.record)


if __name__ == "__main__":
    main()
