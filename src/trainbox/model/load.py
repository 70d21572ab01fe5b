"""A model from what a run left behind: a checkpoint ready for inference (generate, export, eval), or the initial
weights of a new run (`run.init_from`: a Hugging Face folder, through its family's mapping, or a checkpoint)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from trainbox import checkpoint
from trainbox.checkpoint import OtherShape
from trainbox.config import RunConfig, build_config
from trainbox.errors import BadInput, CheckpointError, ConfigError
from trainbox.model.build import build_model, build_tokenizer, context_length, model_vocab_size
from trainbox.model.hf_folder import is_hf_folder
from trainbox.model.spec import family


def inference_device(name: str | None) -> torch.device:
    """The --device of generate, chat and eval: by default a CUDA GPU where one is visible, else the CPU; a device
    this machine does not have is refused (BadInput) before any weight is read."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise BadInput(f"--device {name}: trainbox runs on cpu, cuda or cuda:N", hint="drop --device for the default "
                       "(a CUDA GPU where one is visible, else the CPU)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = " (this torch is a CPU-only build)" if torch.version.cuda is None and torch.version.hip is None \
                else ""
            raise BadInput(f"--device {name}: no CUDA GPU is visible{build}",
                           hint="drop --device to run on the CPU, or see `trainbox doctor`")
        if device.index is not None and device.index >= count:
            raise BadInput(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}",
                           hint="name one of those, or drop --device for cuda:0")
    return device


def load_for_inference(path: str | Path, device: str | torch.device = "cpu", generates: bool = True):
    """Run directory or checkpoint -> (model, tokenizer, config) ready to sample (`generates`: a reward model, which
    only scores, is refused) or to export."""
    return load_verified(checkpoint.resolve(path), device, generates)


def load_verified(ckpt: Path, device: str | torch.device = "cpu", generates: bool = True):
    """A step folder that `checkpoint.resolve` returned (verified) -> (model, tokenizer, config)."""
    cfg: RunConfig = build_config(checkpoint.load_trainer(ckpt)["config"])
    if generates and cfg.train.objective == "reward":
        raise ConfigError(f"{ckpt} holds a reward model (train.objective=reward): it scores text, it does not "
                          "generate any", hint=f"export it to score with transformers or vLLM: trainbox export "
                                               f"{ckpt} --format hf --out FOLDER")
    tokenizer = build_tokenizer(cfg)
    vocab = model_vocab_size(cfg.model, tokenizer.vocab_size)
    model = build_model(cfg.model, vocab, context_length(cfg), run=cfg)
    checkpoint.load_weights(ckpt, model)
    return model.to(device), tokenizer, cfg


def load_init_weights(path: str | Path, model: nn.Module, cfg) -> str:
    """`run.init_from`: a Hugging Face folder (the family's import_hf: GPT-2, Llama / Mistral / Qwen2 /
    Qwen3) or one of our run directories / checkpoints. Returns what was read: the folder, or the checkpoint."""
    if is_hf_folder(path):
        family(cfg.family).hf().import_hf(path, model, cfg)
        return f"the Hugging Face folder {path}"
    try:
        ckpt = checkpoint.resolve(path)
    except CheckpointError as e:
        raise CheckpointError(f"run.init_from={path}: {e.message}", hint="run.init_from takes a run directory, "
                              "a checkpoint (a step_* folder) or a Hugging Face model folder") from None
    try:
        checkpoint.load_weights(ckpt, model)
    except OtherShape as e:   # a new run: a resume's reading and hint do not apply
        raise CheckpointError(f"run.init_from={path}: {e.shapes}",
                              hint=f"run.init_from loads a model of this run's shape: give the run the model "
                                   f"settings of the run that saved {ckpt} (its config.yaml), or drop run.init_from"
                              ) from None
    return str(ckpt)
