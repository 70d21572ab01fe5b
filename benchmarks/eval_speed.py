"""lm-eval loglikelihood throughput: trainbox's adapter (`trainbox eval`) against lm-eval's own `hf` model, on the same
model and the same requests of a local multiple-choice task.

    PYTHONPATH=src python benchmarks/eval_speed.py --record                           # a GPU: gpt2-125m, llama-1b
    PYTHONPATH=src python benchmarks/eval_speed.py --models tiny,tiny-llama --docs 48 --warmup 8 --device cpu

It runs offline and needs lm-eval's own package only, not the packages its tasks and metrics load (datasets,
evaluate, sqlitedict, ...): on a machine without a network, carry the wheel and install it alone,

    pip download lm-eval==0.4.13 --no-deps -d wheels                    # where there is a network
    pip install --no-index --no-deps wheels/lm_eval-0.4.13-py3-none-any.whl   # on the GPU machine

Per model: random weights of the recipe's shape saved as a trainbox checkpoint (the run `trainbox eval` reads) and
exported with `trainbox export` (the folder lm-eval's hf model reads). The task is written by this tool as lm-eval
reads a local task (a YAML and its JSONL, in --task-dir when given): hellaswag's form and lengths, a context of
--context words and four endings of --ending words (spans of the embedded Shakespeare corpus, about 1.3 GPT-2 tokens
a word). Its loglikelihood requests are made here as lm-eval's multiple_choice task makes them from the YAML (one
(context, " " + ending) pair per choice; tests/test_eval_speed.py holds them equal to lm-eval's own), so no dataset
library is needed. Both backends answer the same requests through lm-eval's `loglikelihood` at the same
--batch-size, tokenisation, sorting and batching included: ours with fp32 weights under bf16 autocast on a GPU, as
`trainbox eval` runs; lm-eval's HFLM with its weights in --hf-dtype (bf16); fp32 both on a CPU. Each answers the
first --warmup documents untimed, then the next --docs documents --repeats times; documents/s is from the median
time. Accuracy is lm-eval's multiple-choice `acc` (the choice with the highest loglikelihood), with the largest
per-request loglikelihood difference between the two (in fp32 near 0; in bf16 rounding, and near-ties may flip).
Prints one JSON object, then a result record per model (common.Result, lm-eval's hf model as the baseline); --record
writes them to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import common

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # local folders only: never wait on a network the machine lacks

MODELS = {   # name -> (recipe, overrides)
    "gpt2-125m": ("gpt2-125m", []),
    "llama-1b": ("llama-1b", []),
    "tiny": ("tiny", ["data.tokenizer=gpt2", "model.n_layer=2", "model.n_head=2", "model.n_embd=64",
                      "data.seq_len=512"]),
    "tiny-llama": ("tiny", ["data.tokenizer=gpt2", "model.family=llama", "model.n_layer=2", "model.n_head=2",
                            "model.n_embd=64", "model.llama.n_kv_head=1", "data.seq_len=512"]),
}

TASK = """task: synthetic_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
DELIMITER = " "   # lm-eval's default target_delimiter, between a context and each choice


def write_task(folder: Path, docs: int, context: int, ending: int, seed: int = 0) -> list[dict]:
    """The multiple-choice task (synthetic_mc.yaml + synthetic_mc.jsonl) in `folder`; -> its documents."""
    from trainbox.data.embedded import split

    words = re.findall(r"\S+", " ".join(split("train")))
    rng = random.Random(seed)

    def span(n: int) -> str:
        n = max(1, int(rng.gauss(n, n / 4)))
        start = rng.randrange(len(words) - n)
        return " ".join(words[start:start + n])

    rows = [{"ctx": span(context), "endings": [span(ending) for _ in range(4)], "label": rng.randrange(4)}
            for _ in range(docs)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "synthetic_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "synthetic_mc.yaml").write_text(TASK.format(data=folder / "synthetic_mc.jsonl"))
    return rows


def requests(docs: list[dict], first_id: int = 0) -> list:
    """lm-eval's loglikelihood Instances for `docs`, as its multiple_choice task makes them from TASK."""
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood", doc=doc, arguments=(doc["ctx"], DELIMITER + ending), idx=i,
                     metadata=("synthetic_mc", first_id + d, 1))
            for d, doc in enumerate(docs) for i, ending in enumerate(doc["endings"])]


def make_run(name: str, root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Random weights of the model's shape as a trainbox run (a checkpoint at step 1) and its Hugging Face export."""
    import torch

    from trainbox import checkpoint
    from trainbox.config import load_config
    from trainbox.config.load import public_dict
    from trainbox.export import export
    from trainbox.model.build import build_model, build_tokenizer, model_vocab_size

    recipe, overrides = MODELS[name]
    cfg = load_config(recipe, [*overrides, f"run.dir={root}", f"run.name={name}", "model.dropout=0.0"])
    torch.manual_seed(seed)
    vocab = model_vocab_size(cfg.model, build_tokenizer(cfg).vocab_size)
    model = build_model(cfg.model, vocab, cfg.model.block_size or cfg.data.seq_len, run=cfg)
    run = root / name
    checkpoint.save(run / "checkpoints", 1, checkpoint.model_state(model), [],
                    {"step": 1, "config": public_dict(cfg)}, [checkpoint.rng_state()], keep_last=1)
    del model
    export(run, root / f"{name}-hf")
    return run, root / f"{name}-hf"


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(lm, warmup: list, timed: list, docs: int, repeats: int) -> dict:
    """`lm.loglikelihood` on `warmup`, then `repeats` times on `timed`; -> documents/s (median), acc, the answers."""
    lm.loglikelihood(warmup, disable_tqdm=True)
    seconds = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = lm.loglikelihood(timed, disable_tqdm=True)
        sync()
        seconds.append(time.perf_counter() - t0)
    lls = [lp for lp, _ in out]
    labels = [timed[4 * d].doc["label"] for d in range(docs)]
    acc = statistics.fmean(max(range(4), key=lambda i: lls[4 * d + i]) == labels[d] for d in range(docs))
    median = statistics.median(seconds)
    return {"docs_per_s": round(docs / median, 2), "seconds": round(median, 3),
            "seconds_each": [round(s, 3) for s in seconds], "acc": round(acc, 4), "loglikelihoods": lls}


def bench(name: str, args, docs: list[dict]) -> dict:
    import torch
    from lm_eval.models.huggingface import HFLM

    from trainbox.eval.adapter import TrainboxLM
    from trainbox.model.load import load_for_inference

    run, hf = make_run(name, args.root)
    gpu = torch.device(args.device).type == "cuda"
    warmup, timed = requests(docs[:args.warmup]), requests(docs[args.warmup:], args.warmup)
    model, tokenizer, _ = load_for_inference(run, torch.device(args.device))
    autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if gpu else None
    ours = measure(TrainboxLM(model, tokenizer, batch_size=args.batch_size, autocast=autocast), warmup, timed,
                   args.docs, args.repeats)
    del model
    if gpu:
        torch.cuda.empty_cache()
    ref_lm = HFLM(pretrained=str(hf), dtype=args.hf_dtype if gpu else "float32", batch_size=args.batch_size,
                  device=args.device)
    ref = measure(ref_lm, warmup, timed, args.docs, args.repeats)
    del ref_lm
    if gpu:
        torch.cuda.empty_cache()
    diff = max(abs(a - b) for a, b in zip(ours.pop("loglikelihoods"), ref.pop("loglikelihoods"), strict=True))
    return {"ours": ours, "hf": ref, "speedup": round(ours["docs_per_s"] / ref["docs_per_s"], 3),
            "max_abs_loglikelihood_diff": round(diff, 6),
            "dtype": f"bf16 autocast vs hf {args.hf_dtype}" if gpu else "fp32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-125m,llama-1b", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--docs", type=int, default=3000, help="documents timed (4 requests each)")
    ap.add_argument("--warmup", type=int, default=64, help="documents answered first, untimed")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes over the documents (the median is kept)")
    ap.add_argument("--context", type=int, default=60, help="mean words of a context")
    ap.add_argument("--ending", type=int, default=20, help="mean words of an ending")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hf-dtype", default="bfloat16", help="lm-eval hf's dtype on a GPU (its default is the "
                    "folder's, float32)")
    ap.add_argument("--device", default=None, help="default: cuda when there is one")
    ap.add_argument("--task-dir", default=None, help="keep the task's YAML and JSONL here (default: a temporary "
                    "folder)")
    ap.add_argument("--record", action="store_true", help="write the result records to benchmarks/records/")
    args = ap.parse_args()
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.root = Path(tmp)
        docs = write_task(Path(args.task_dir or tmp), args.warmup + args.docs, args.context, args.ending)
        settings = {"docs": args.docs, "repeats": args.repeats, "context_words": args.context,
                    "ending_words": args.ending, "batch_size": args.batch_size, "device": args.device}
        for name in args.models.split(","):
            out[name] = bench(name, args, docs)
            print(json.dumps({name: out[name]}), flush=True)
            emit(name, out[name], settings, args)   # each model's record as soon as it is measured
            for path in args.root.iterdir():   # the next model's weights need the disk
                if path.name.startswith(name):
                    shutil.rmtree(path)
    print(json.dumps({"benchmark": "eval_speed", **settings, "results": out}, indent=1))


def emit(name: str, r: dict, settings: dict, args) -> None:
    """One model's result record (printed; written with --record)."""
    gpu = common.gpu_info() if args.device.startswith("cuda") else None
    common.emit(common.Result(
        tool="eval_speed", what=f"{name}-eval-speed", gpu=gpu, software=common.software("lm-eval", "transformers"),
        recipe=MODELS[name][0], overrides=MODELS[name][1],
        notes="random weights; local multiple-choice task of hellaswag's form and lengths, the same "
              "loglikelihood requests to both (eval_speed.py docstring)",
        metrics={**settings, "docs_per_s": r["ours"]["docs_per_s"], "seconds": r["ours"]["seconds"],
                 "seconds_each": r["ours"]["seconds_each"], "acc": r["ours"]["acc"],
                 "speedup_vs_lm_eval_hf": r["speedup"], "dtype": r["dtype"],
                 "max_abs_loglikelihood_diff": r["max_abs_loglikelihood_diff"]},
        baseline={"name": "lm-eval hf model", "command": None, "metrics": r["hf"]}), args.record)


if __name__ == "__main__":
    main()
