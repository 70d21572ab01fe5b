"""Atomic checkpoints with everything an exact resume needs.

    checkpoints/step_00001000/
        model.safetensors   weights (trainable ones only for adapters; tied weights stored once)
        optimizer.pt        state of every optimizer
        trainer.json        step, epoch, loader position, tokens seen, run ids, config, versions
        rng.pt              python / numpy / torch CPU / CUDA RNG state of every rank
        COMPLETE            written last
    checkpoints/latest      name of the newest COMPLETE checkpoint

A save writes into `.tmp-step_X`, fsyncs every file, writes COMPLETE, renames the folder to `step_X`,
fsyncs the parent and only then moves `latest` and prunes old checkpoints. A crash at any moment
leaves the previous checkpoint untouched; loaders only ever pick folders that hold COMPLETE.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from trainbox.data.formats import fsync_dir
from trainbox.errors import CheckpointError

STEP_RE = re.compile(r"^step_(\d{8,})$")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def model_state(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """State dict with shared tensors stored once (tied embeddings) and contiguous CPU copies."""
    names = {n for n, p in model.named_parameters() if p.requires_grad} if trainable_only else None
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if names is not None and name not in names:
            continue
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return out


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_complete(ckpt_root: Path) -> list[Path]:
    """COMPLETE checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir()
             if (m := STEP_RE.match(p.name)) and (p / "COMPLETE").is_file()]
    return [p for _, p in sorted(found)]


def latest(ckpt_root: Path) -> Path | None:
    """The newest COMPLETE checkpoint (by step; the `latest` pointer is for people and tools)."""
    done = list_complete(ckpt_root)
    return done[-1] if done else None


def save(ckpt_root: Path, step: int, weights: dict[str, torch.Tensor], optimizers: list, trainer: dict,
         rngs: list[dict], keep_last: int, protect: Path | None = None) -> Path:
    """Write one checkpoint atomically, point `latest` at it, keep the newest `keep_last`."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final, tmp = ckpt_root / name, ckpt_root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file(weights, str(tmp / "model.safetensors"), metadata={"step": str(step)})
        torch.save([o.state_dict() for o in optimizers], tmp / "optimizer.pt")
        torch.save(rngs, tmp / "rng.pt")
        (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1, default=str))
        for f in tmp.iterdir():
            _fsync_file(f)
        (tmp / "COMPLETE").write_text(f"{step}\n")
        _fsync_file(tmp / "COMPLETE")
        fsync_dir(tmp)
        if final.exists():  # an incomplete or older copy of the same step: out of the namespace, then gone
            stale = ckpt_root / f".del-{name}"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(ckpt_root)
        atomic_write_text(ckpt_root / "latest", name + "\n")
    except Exception as e:  # OSError, or torch/safetensors wrapping one (e.g. EFBIG, ENOSPC)
        shutil.rmtree(tmp, ignore_errors=True)
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise CheckpointError(f"saving checkpoint {final} failed: {why}; older checkpoints are kept",
                              hint="free disk space (df -h) and resume with the same command") from e
    prune(ckpt_root, keep_last, protect)
    return final


def prune(ckpt_root: Path, keep_last: int, protect: Path | None = None) -> None:
    """Delete all but the newest `keep_last` COMPLETE checkpoints; never `protect`; drop stale temp folders.

    A doomed checkpoint is first renamed out of the `step_*` namespace (one atomic rename), so a crash
    in the middle of deleting it can never leave a half-deleted folder that still looks COMPLETE."""
    done = list_complete(ckpt_root)
    for p in done[:-keep_last] if keep_last > 0 else []:
        if protect is None or p.resolve() != protect.resolve():
            doomed = ckpt_root / f".del-{p.name}"
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(p, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    for p in [*ckpt_root.glob(".tmp-step_*"), *ckpt_root.glob(".del-step_*")]:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def resolve(path: str | Path) -> Path:
    """A run directory, a checkpoints/ folder or a step folder -> the COMPLETE step folder."""
    p = Path(path)
    if (p / "COMPLETE").is_file():
        return p
    for root in (p / "checkpoints", p):
        found = latest(root)
        if found is not None:
            return found
    if p.is_dir() and STEP_RE.match(p.name):
        raise CheckpointError(f"checkpoint {p} is incomplete (no COMPLETE marker): its save was interrupted",
                              hint=f"use an earlier one: ls {p.parent}")
    raise CheckpointError(f"no complete checkpoint found at {p}",
                          hint="pass a run directory (runs/NAME), its checkpoints/ folder or a step_* folder")


def load_trainer(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer.json").read_text())


def load_weights(ckpt: Path, model: nn.Module, strict: bool = True) -> None:
    state = load_file(str(ckpt / "model.safetensors"))
    own = model.state_dict()
    # tied weights were stored once: fill the aliases from whichever name was kept
    missing = [k for k in own if k not in state]
    for k in missing:
        for alias in own:
            if alias in state and own[alias].data_ptr() == own[k].data_ptr():
                state[k] = state[alias]
                break
    own_shapes = {k: tuple(v.shape) for k, v in own.items()}
    wrong = [f"{k} {tuple(v.shape)} vs {own_shapes[k]}" for k, v in state.items()
             if k in own_shapes and tuple(v.shape) != own_shapes[k]]
    if wrong:
        raise CheckpointError(f"checkpoint {ckpt} holds a differently shaped model ({len(wrong)} tensors differ, "
                              f"e.g. {wrong[0]}): the config's model section changed since it was saved",
                              hint="start a new run with run.name=NEW_NAME (or run.resume=never), "
                                   "or restore the model settings of that run's config.yaml")
    result = model.load_state_dict(state, strict=False)
    if strict and (result.missing_keys or result.unexpected_keys):
        raise CheckpointError(f"checkpoint {ckpt} does not match the model: missing {result.missing_keys[:5]}, "
                              f"unexpected {result.unexpected_keys[:5]}",
                              hint="the run's config.yaml must describe the same model")


def load_optimizers(ckpt: Path, optimizers: list) -> None:
    states = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)
    if len(states) != len(optimizers):
        raise CheckpointError(f"{ckpt}: holds {len(states)} optimizer states, the run has {len(optimizers)}")
    for opt, st in zip(optimizers, states):
        opt.load_state_dict(st)


def load_rng(ckpt: Path, rank: int) -> dict | None:
    rngs = torch.load(ckpt / "rng.pt", map_location="cpu", weights_only=False)
    return rngs[rank] if rank < len(rngs) else None
