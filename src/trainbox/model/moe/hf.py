"""The moe family's own folder: Hugging Face transformers has no GPT-2 MoE class, so `trainbox export RUN
--format hf` writes config.json (our model section), model.safetensors and the tokenizer, and
`from_pretrained(folder)` loads it.

    trainbox export runs/moe --format hf --out moe/      # trainbox.model.moe.hf.from_pretrained("moe/")
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainbox.checkpoint import load_weights, model_state
from trainbox.config import ModelSection
from trainbox.errors import CheckpointError
from trainbox.model.hf_folder import cast, check_out, no_merge, staged, write_tokenizer
from trainbox.model.load import load_for_inference
from trainbox.model.moe.model import FORMAT, MoEGPT


def save_pretrained(model: MoEGPT, folder: str | Path, dtype: str | None = None) -> None:
    """config.json (the model section, vocabulary and block size) and model.safetensors (our parameter names,
    fp32 or `dtype`, every expert, the tied head stored once) into `folder`."""
    folder = Path(folder)
    section = model.cfg.model_dump(mode="json")
    section["moe"]["expert_parallel"] = 1
    config = {"format": FORMAT, "loader": "trainbox.model.moe.hf.from_pretrained", "vocab_size": model.vocab_size,
              "block_size": model.block_size, "model": section}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = cast({k: v.float() for k, v in model_state(model).items()}, dtype)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def from_pretrained(folder: str | Path, device: str | torch.device = "cpu") -> MoEGPT:
    """The model in a folder written by `trainbox export RUN --format hf` of an moe run, in eval mode:

        from trainbox.model.moe.hf import from_pretrained
        model = from_pretrained("runs/moe-hf")
        logits = model(idx).logits        # (batch, 1, vocab): the next token's; model(idx, targets).loss
    """
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / 'config.json'} is unreadable: {e}") from None
    if config.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not a trainbox MoE folder (config.json format "
                              f"{config.get('format')!r}, expected {FORMAT!r})",
                              hint="write one with `trainbox export RUN --format hf` of a model.family=moe run")
    model = MoEGPT(ModelSection(**config["model"]), config["vocab_size"], config["block_size"])
    load_weights(folder, model)
    return model.to(device).eval()


def export(path: str, out: str, merge: bool = False, force: bool = False, dtype: str | None = None) -> list[str]:
    """`trainbox export` of an moe run. Hugging Face transformers has no GPT-2 MoE class, so the folder is the
    family's own (model/moe.py: save_pretrained): config.json, model.safetensors and the tokenizer, loaded by
    `trainbox.model.moe.hf.from_pretrained(folder)`."""
    no_merge(path, merge)
    model, tok, cfg = load_for_inference(path)
    target = Path(out)
    check_out(target, force)
    with staged(target) as tmp:
        save_pretrained(model, tmp, dtype)
        write_tokenizer(tok, cfg.data.tokenizer, tmp, model.block_size)
    return [f"wrote {target} (trainbox MoE format: config.json, model.safetensors, tokenizer); Hugging Face "
            f"transformers has no GPT-2 MoE class: load it with trainbox.model.moe.hf.from_pretrained({str(target)!r})"]
