"""`trainbox eval`: lm-eval tasks on a run, a checkpoint or a Hugging Face folder, recorded in RUN/eval/<time>.json.

    trainbox eval runs/gpt2-125m --tasks hellaswag,arc_easy --limit 500
    trainbox eval runs/tiny --tasks path/to/my_task.yaml             # a local task: its YAML and data files
    trainbox eval hf/gpt2-125m --tasks lambada_openai                # a Hugging Face folder

A run or checkpoint (its newest verified checkpoint; sharded ones included) is scored by trainbox's adapter
(eval/adapter.py) on the model's own forward and KV cache, its fp32 weights under autocast where --dtype is bf16 or
fp16 (the default on a GPU with bf16), as it trains; a Hugging Face folder by lm-eval's own `hf` model with its
weights in that dtype, as lm-eval would score it. Everything that can be refused is refused before the model is
loaded, with exit code 2: no lm-eval installed, an unknown task, a task whose data does not load, a checkpoint that
fails verification, a model without a causal decoder (t5).
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainbox import checkpoint
from trainbox.config import build_config
from trainbox.errors import BadInput, CheckpointError
from trainbox.eval import results as records
from trainbox.model.hf_folder import is_hf_folder
from trainbox.model.load import inference_device, load_verified
from trainbox.model.spec import family, which
from trainbox.rundir.runs import git_commit

EXTRA = "eval"


@dataclass
class Report:
    """What an evaluation returns: lm-eval's results (with the `trainbox` section), its table, the file written."""

    results: dict
    table: str
    path: Path | None
    samples: dict = field(default_factory=dict)   # lm-eval's per-document records, when asked for


def require_lm_eval(what: str = "trainbox eval") -> None:
    """BadInput (exit 2) naming the extra to install when lm-eval is missing."""
    if importlib.util.find_spec("lm_eval") is None:
        raise BadInput(f"{what} needs lm-eval (the Python package 'lm_eval'), which is not installed",
                       hint=f"pip install 'trainbox[{EXTRA}]'")


def refuse_non_causal(family_name: str, kinds: dict[str, str]) -> None:
    """A family without a causal decoder cannot answer lm-eval's requests through the adapter."""
    if family(family_name).generate == "causal":
        return
    generating = [t for t, k in kinds.items() if k == "generate_until"]
    what = (f"task {', '.join(generating)} generates text (generate_until), which needs a causal decoder"
            if generating else "trainbox's lm-eval adapter scores causal decoders")
    raise BadInput(f"{what}, and model.family={family_name} has none (an encoder-decoder); the adapter serves "
                   f"model.family={', '.join(which(lambda f: f.generate == 'causal'))}",
                   hint="export it (`trainbox export RUN`) and evaluate the folder with lm-eval's seq2seq model: "
                        "lm-eval run --model hf --model_args pretrained=FOLDER,backend=seq2seq --tasks ...")


def evaluate(source: str | Path, tasks: list[str], include: list[str] | tuple = (), limit: float | None = None,
             batch_size: int = 32, device: str | None = None, dtype: str = "auto", num_fewshot: int | None = None,
             out: str | Path | None = None, log_samples: bool = False) -> Report:
    """Run lm-eval `tasks` on `source` (run directory, checkpoint folder or Hugging Face folder); write the record to
    `out` (default: the run's eval/ folder; a Hugging Face folder's own eval/ folder)."""
    require_lm_eval()
    device = inference_device(device)
    source = Path(source)
    hf = is_hf_folder(source)
    ckpt = None if hf else _verified(source)
    cfg = None if ckpt is None else build_config(checkpoint.load_trainer(ckpt)["config"])
    from trainbox.eval import tasks as task_specs  # optional: lm_eval

    with task_specs.quiet():
        manager, names = task_specs.resolve(tasks, include)
        kinds = task_specs.output_types(manager, names)
    if cfg is not None:
        refuse_non_causal(cfg.model.family, kinds)
    torch_dtype = _dtype(dtype, device)
    t0 = time.time()
    if hf:
        model, model_args = "hf", {"pretrained": str(source), "dtype": str(torch_dtype).removeprefix("torch.")}
    else:
        from trainbox.eval.adapter import TrainboxLM  # optional: lm_eval

        net, tokenizer, cfg = load_verified(ckpt, device)
        # fp32 weights under autocast, as the model trains: its kernels (fused norms, MLPs) see what they know
        autocast = None if torch_dtype == torch.float32 else lambda: torch.autocast(device.type, torch_dtype)
        model, model_args = TrainboxLM(net, tokenizer, batch_size=batch_size, autocast=autocast), None
    results = _simple_evaluate(model, model_args, names, manager, limit, batch_size, device, num_fewshot, log_samples)
    samples = results.pop("samples", None) or {}
    results["trainbox"] = {
        "source": str(source), "model": "lm-eval hf" if hf else "trainbox", "checkpoint": str(ckpt) if ckpt else None,
        "step": checkpoint.load_trainer(ckpt)["step"] if ckpt else None, "family": cfg.model.family if cfg else None,
        "git_commit": git_commit(), "device": str(device), "dtype": str(torch_dtype).removeprefix("torch.") +
        (" (autocast)" if not hf and torch_dtype != torch.float32 else ""),
        "batch_size": batch_size, "limit": limit, "seconds": round(time.time() - t0, 3),
        "scores": records.scores(results)}
    folder = Path(out) if out else (source if hf else run_dir_of(ckpt)) / "eval"
    return Report(results, table(results), records.write(folder, results), samples)


def _simple_evaluate(model, model_args, names, manager, limit, batch_size, device, num_fewshot, log_samples) -> dict:
    import lm_eval  # optional: lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names, task_manager=manager,
                                   limit=limit, batch_size=batch_size, device=str(device), num_fewshot=num_fewshot,
                                   log_samples=log_samples)


def table(results: dict) -> str:
    """lm-eval's tables of the results (and of the groups, where there are any)."""
    from lm_eval.utils import make_table  # optional: lm_eval

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def run_dir_of(ckpt: Path) -> Path:
    """The run a step folder belongs to (RUN/checkpoints/step_X -> RUN); for a step folder elsewhere, the folder
    holding it (nothing is written inside a checkpoint)."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def _verified(source: Path) -> Path:
    if not source.exists():
        raise BadInput(f"{source} does not exist", hint="give a run directory, a checkpoint folder (step_*) or a "
                                                        "Hugging Face model folder")
    try:
        return checkpoint.resolve(source)
    except CheckpointError as e:
        raise BadInput(e.message, hint=e.hint or "evaluate an earlier checkpoint: ls RUN/checkpoints") from None


def _dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on a GPU that has it, fp32 otherwise."""
    if name == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
