"""lm-eval loglikelihood throughput: trainbox's adapter (`trainbox eval`) against lm-eval's own `hf` model, on the same
model and the same multiple-choice task.

    PYTHONPATH=src python benchmarks/eval_speed.py --record                           # a GPU: gpt2-125m, llama-1b
    PYTHONPATH=src python benchmarks/eval_speed.py --models tiny,tiny-llama --docs 48 --device cpu   # a CPU check

Per model: random weights of the recipe's shape saved as a trainbox checkpoint (the run `trainbox eval` reads) and
exported with `trainbox export` (the folder lm-eval's hf model reads). The task is local and synthetic, with
hellaswag's lengths: a context of --context words and four endings of --ending words, spans of the embedded
Shakespeare corpus (about 1.3 GPT-2 tokens a word); 4 loglikelihood requests a document. Both backends run it through
lm_eval.simple_evaluate at the same --batch-size, in bf16 on a GPU (ours: autocast over fp32 weights, as
`trainbox eval` runs; hf: its weights in --hf-dtype) and fp32 on a CPU, each once on a few documents first (warm-up).
Timed: the loglikelihood call of each backend (tokenisation included). Documents/s = documents / those seconds. Both
accuracies and the largest per-request loglikelihood difference are printed (in fp32 the accuracies are equal; in
bf16 near-ties may flip). Prints one JSON object, then a result record per model (common.Result, lm-eval's hf model
as the baseline); --record writes them to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path

import common

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


def write_task(folder: Path, docs: int, context: int, ending: int, seed: int = 0) -> Path:
    """The synthetic multiple-choice task (YAML + JSONL) in `folder`; -> the YAML."""
    from trainbox.data.embedded import split

    words = re.findall(r"\S+", " ".join(split("train")))
    rng = random.Random(seed)

    def span(n: int) -> str:
        n = max(1, int(rng.gauss(n, n / 4)))
        start = rng.randrange(len(words) - n)
        return " ".join(words[start:start + n])

    rows = [{"ctx": span(context), "endings": [" " + span(ending) for _ in range(4)], "label": rng.randrange(4)}
            for _ in range(docs)]
    (folder / "synthetic_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "synthetic_mc.yaml").write_text(TASK.format(data=folder / "synthetic_mc.jsonl"))
    return folder / "synthetic_mc.yaml"


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
    export(run, root / f"{name}-hf")
    return run, root / f"{name}-hf"


def timed(lm) -> dict:
    """Wrap `lm.loglikelihood` to add its seconds to the returned dict's "seconds"."""
    clock = {"seconds": 0.0}
    inner = lm.loglikelihood

    def loglikelihood(requests, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = inner(requests, *args, **kwargs)
        sync()
        clock["seconds"] += time.perf_counter() - t0
        return out

    lm.loglikelihood = loglikelihood
    return clock


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(lm, task: Path, docs: int, warmup: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task.parent), include_defaults=False)
    lm_eval.simple_evaluate(model=lm, tasks=["synthetic_mc"], task_manager=manager, limit=warmup)
    clock = timed(lm)
    res = lm_eval.simple_evaluate(model=lm, tasks=["synthetic_mc"], task_manager=manager, limit=docs,
                                  log_samples=True)
    lls = [r[0][0] for s in res["samples"]["synthetic_mc"] for r in s["resps"]]
    return {"docs_per_s": round(docs / clock["seconds"], 2), "seconds": round(clock["seconds"], 3),
            "acc": res["results"]["synthetic_mc"]["acc,none"], "loglikelihoods": lls}


def bench(name: str, args, root: Path) -> dict:
    import torch
    from lm_eval.models.huggingface import HFLM

    from trainbox.eval.adapter import TrainboxLM
    from trainbox.model.load import load_for_inference

    run, hf = make_run(name, root)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    model, tokenizer, _ = load_for_inference(run, device)
    autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if gpu else None
    ours = measure(TrainboxLM(model, tokenizer, batch_size=args.batch_size, autocast=autocast), args.task, args.docs,
                   args.warmup)
    del model
    if gpu:
        torch.cuda.empty_cache()
    ref_lm = HFLM(pretrained=str(hf), dtype=args.hf_dtype if gpu else "float32", batch_size=args.batch_size,
                  device=str(device))
    ref = measure(ref_lm, args.task, args.docs, args.warmup)
    diff = max(abs(a - b) for a, b in zip(ours.pop("loglikelihoods"), ref.pop("loglikelihoods")))
    return {"ours": ours, "hf": ref, "speedup": round(ours["docs_per_s"] / ref["docs_per_s"], 3),
            "max_abs_loglikelihood_diff": round(diff, 6),
            "dtype": "bf16 autocast vs hf " + args.hf_dtype if gpu else "fp32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-125m,llama-1b", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--docs", type=int, default=2000, help="documents timed (4 requests each)")
    ap.add_argument("--warmup", type=int, default=64, help="documents of the untimed first run")
    ap.add_argument("--context", type=int, default=60, help="mean words of a context")
    ap.add_argument("--ending", type=int, default=20, help="mean words of an ending")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hf-dtype", default="bfloat16", help="lm-eval hf's dtype on a GPU (its default is the "
                    "folder's, float32)")
    ap.add_argument("--device", default=None, help="default: cuda when there is one")
    ap.add_argument("--record", action="store_true", help="write the result records to benchmarks/records/")
    args = ap.parse_args()
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        args.task = write_task(root, args.docs + args.warmup, args.context, args.ending)
        for name in args.models.split(","):
            out[name] = bench(name, args, root)
            print(json.dumps({name: out[name]}), flush=True)
    settings = {"docs": args.docs, "context_words": args.context, "ending_words": args.ending,
                "batch_size": args.batch_size, "device": args.device}
    print(json.dumps({"benchmark": "eval_speed", **settings, "results": out}, indent=1))
    gpu = common.gpu_info() if args.device.startswith("cuda") else None
    for name, r in out.items():
        common.emit(common.Result(
            tool="eval_speed", what=f"{name}-eval-speed", gpu=gpu, software=common.software("lm-eval", "transformers"),
            recipe=MODELS[name][0], overrides=MODELS[name][1],
            notes="random weights; synthetic multiple-choice task of hellaswag's lengths (eval_speed.py docstring)",
            metrics={**settings, "docs_per_s": r["ours"]["docs_per_s"], "seconds": r["ours"]["seconds"],
                     "acc": r["ours"]["acc"], "speedup_vs_lm_eval_hf": r["speedup"], "dtype": r["dtype"],
                     "max_abs_loglikelihood_diff": r["max_abs_loglikelihood_diff"]},
            baseline={"name": "lm-eval hf model", "command": None, "metrics": r["hf"]}), args.record)


if __name__ == "__main__":
    main()
