"""`trainbox export`: a run or checkpoint written in the format inference engines read, by its family's own
mapping (model/<family>/hf.py: GPT2LMHeadModel, LlamaForCausalLM / Qwen2ForCausalLM, T5ForConditionalGeneration,
a PEFT adapter or merged model, the moe family's own folder).

    trainbox export runs/gpt2-125m --format hf --out hf/gpt2-125m
"""
from __future__ import annotations

from pathlib import Path

from trainbox import checkpoint
from trainbox.config import build_config
from trainbox.model.spec import family


def export(path: str | Path, out: str | Path | None = None, merge: bool = False, force: bool = False) -> list[str]:
    """Write the newest verified checkpoint of `path` (a run, its checkpoints folder or a step folder) to `out`
    (default: RUN-hf, or RUN-merged with `merge`); returns the lines saying what was written."""
    ckpt = checkpoint.resolve(path)
    spec = family(build_config(checkpoint.load_trainer(ckpt)["config"]).model.family)
    out = out or str(Path(str(path).rstrip("/")).name + ("-merged" if merge else "-hf"))
    return spec.hf().export(str(path), str(out), merge=merge, force=force)
