"""Atomic, verified checkpoints with everything an exact resume needs.

    checkpoints/step_00001000/
        model.safetensors   weights (trainable ones only for adapters; tied weights stored once)
        optimizer.pt        state of every optimizer (tensors and plain values only)
        trainer.json        step, epoch, loader position, tokens seen, run ids, config, versions
        rng.pt              python / numpy / torch CPU / CUDA RNG state of every rank (tensors and plain values)
        objective.pt        where the objective needs more to resume exactly (grpo in the middle of a generation):
                            every rank's, in rank order (tensors and plain values)
        COMPLETE            written last: JSON with the step and each file's size and sha256
    checkpoints/latest      name of the newest COMPLETE checkpoint

A save writes into `.tmp-step_X`, fsyncs every file, writes COMPLETE, renames the folder to `step_X`,
fsyncs the parent and only then moves `latest` and prunes old checkpoints. A crash at any moment
leaves the previous checkpoint untouched; loaders only ever pick folders that hold COMPLETE, and a `step_X`
without it (damage: no save leaves one) is reported like any other damaged checkpoint.

This package: the single-file layout and what every layout shares (here: saving, publishing, resolving,
loading; manifest.py: COMPLETE and verifying against it), a save that does not fit said plainly (room.py: disk
full, disk quota, a file over `ulimit -f`), and the sharded layout read back (sharded.py:
torch.distributed.checkpoint folders).

Loading never runs code from a checkpoint: weights are safetensors, the `.pt` files are read with
`torch.load(weights_only=True)`, trainer.json is JSON. `verify` checks every file against COMPLETE's sizes
and checksums, so a truncated, overwritten or bit-flipped file is found before anything is loaded, and
`newest_verified` falls back to the previous checkpoint that verifies.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from trainbox.checkpoint.manifest import (  # noqa: F401 - also the package's own names (checkpoint.verify, ...)
    FILES,
    NO_MARKER,
    SHARDED_DIR,
    SHARDED_FILES,
    STEP_RE,
    files_of,
    is_sharded,
    sha256,
    step_of,
    verify,
    write_manifest,
)
from trainbox.checkpoint.room import check_room, disk_cause, payload_bytes, save_error
from trainbox.errors import CheckpointError
from trainbox.files import atomic_write_text, default_modes, fsync_dir


class OtherShape(CheckpointError):
    """A checkpoint whose weights have other shapes than the model's. The message reads it as a resume would (the
    config changed since the save); `shapes` says only which tensors differ, for callers that start a new run."""

    def __init__(self, shapes: str, message: str, hint: str):
        super().__init__(message, hint)
        self.shapes = shapes


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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
    """This process's RNG states as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_steps(ckpt_root: Path) -> list[Path]:
    """Every `step_X` folder, COMPLETE or not, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def list_complete(ckpt_root: Path) -> list[Path]:
    """COMPLETE checkpoints, oldest first."""
    return [p for p in list_steps(ckpt_root) if (p / "COMPLETE").is_file()]


def latest(ckpt_root: Path) -> Path | None:
    """The newest COMPLETE checkpoint (by step; the `latest` pointer is for people and tools)."""
    done = list_complete(ckpt_root)
    return done[-1] if done else None


def newest_verified(ckpt_root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """-> (the newest checkpoint that verifies, [(newer step folder that did not, why), ...]). A `step_X` without
    COMPLETE is among them: a save writes in `.tmp-step_X` and renames it only after COMPLETE, so such a folder
    is always damage."""
    skipped = []
    for p in reversed(list_steps(ckpt_root)):
        try:
            verify(p)
            return p, skipped
        except CheckpointError as e:
            skipped.append((p, e.message))
    return None, skipped


def save(ckpt_root: Path, step: int, weights: dict[str, torch.Tensor], optimizers: list, trainer: dict,
         rngs: list[dict], keep_last: int, protect: Path | None = None, objective: list | None = None) -> Path:
    """Write one checkpoint atomically, point `latest` at it, keep the newest `keep_last`; `objective`: every
    rank's objective state, where any has one."""
    states = [o if isinstance(o, dict) else o.state_dict() for o in optimizers]
    files = {"model.safetensors": (payload_bytes(weights),
                                   lambda p: save_file(weights, str(p), metadata={"step": str(step)})),
             "optimizer.pt": (payload_bytes(states), lambda p: torch.save(states, p)),
             **small_files(trainer, rngs, objective)}
    return publish(write_staged(ckpt_root, step, files), ckpt_root, step, keep_last, protect)


def small_files(trainer: dict, rngs: list[dict], objective: list | None = None) -> dict:
    """rng.pt and trainer.json (and objective.pt where given), as `write_staged` takes them: name -> (bytes it needs
    at least, writer)."""
    text = json.dumps(trainer, indent=1, default=str)
    out = {"rng.pt": (payload_bytes(rngs), lambda p: torch.save(rngs, p)),
           "trainer.json": (len(text.encode()), lambda p: p.write_text(text))}
    if objective is not None:
        out["objective.pt"] = (payload_bytes(objective), lambda p: torch.save(objective, p))
    return out


def write_staged(ckpt_root: Path, step: int, files: dict, more: int = 0) -> Path:
    """Write `files` (name -> (bytes it needs at least, writer(path))) into a fresh `.tmp-step_X` and return it.
    `more`: bytes that others write there too (a sharded save's shards). Each file gets the mode a new file gets
    under the umask (0644 under 022), whatever its writer chose. Refused before anything is written when they
    surely cannot fit (`check_room`); a failure removes the folder and raises `save_failed`'s error."""
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-{final.name}"
    need = {name: n for name, (n, _) in files.items()}
    writing = None
    try:
        tmp = staging_dir(ckpt_root, step)
        check_room(ckpt_root, final, need, more)
        for writing, (_, write) in files.items():
            write(tmp / writing)
        default_modes(tmp)   # safetensors writes 0600: another user (the host's, for a container's run) reads these
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # OSError, or torch/safetensors wrapping one (EFBIG, ENOSPC: errno lost)
        raise save_failed(e, tmp, final, ckpt_root, sum(need.values()) + more, writing) from e
    return tmp


def staging_dir(ckpt_root: Path, step: int) -> Path:
    """A fresh, empty `.tmp-step_X` folder: a save writes there and `publish` renames it."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".tmp-step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, ckpt_root: Path, step: int, keep_last: int, protect: Path | None = None) -> Path:
    """Make a fully written staging folder the checkpoint of `step`: fsync every file, write COMPLETE, rename
    to `step_X`, fsync the parent, move `latest`, prune. A crash at any moment leaves the previous one intact."""
    name = f"step_{step:08d}"
    final = ckpt_root / name
    try:
        for f in files_of(tmp):
            _fsync_file(tmp / f)
        write_manifest(tmp, step)
        for d in {tmp, *(p for p in tmp.rglob("*") if p.is_dir())}:
            fsync_dir(d)
        if final.exists():  # an incomplete or older copy of the same step: out of the namespace, then gone
            stale = ckpt_root / f".del-{name}"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(ckpt_root)
        atomic_write_text(ckpt_root / "latest", name + "\n")
    except Exception as e:  # noqa: BLE001 - reported as one CheckpointError
        raise save_failed(e, tmp, final, ckpt_root) from e
    prune(ckpt_root, keep_last, protect)
    return final


def save_failed(e: BaseException, tmp: Path, final: Path, ckpt_root: Path, need: int = 0,
                writing: str | None = None) -> CheckpointError:
    """The error of a failed save, its staging folder `tmp` removed (see `disk_cause` for `need`, `writing`)."""
    cause = disk_cause(e, tmp, ckpt_root, need, writing)
    shutil.rmtree(tmp, ignore_errors=True)
    return save_error(e, cause, final, ckpt_root)


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


def resolve(path: str | Path, on_skip=None) -> Path:
    """A run directory, a checkpoints/ folder or a step folder -> the COMPLETE step folder that verifies.

    A step folder must verify itself; in a run or checkpoints folder the newest checkpoint that verifies is
    taken, and `on_skip(path, why)` hears of each newer one that did not."""
    p = Path(path)
    if (p / "COMPLETE").is_file():
        verify(p)
        return p
    for root in (p / "checkpoints", p):
        if not list_steps(root):
            continue
        found, skipped = newest_verified(root)
        for bad, why in skipped:
            if on_skip is not None:
                on_skip(bad, why)
        if found is None:
            raise CheckpointError(f"none of the {len(skipped)} checkpoints in {root} verifies; the newest: "
                                  f"{skipped[0][1]}", hint="start over with run.resume=never, or restore "
                                  "the files from a copy")
        return found
    if p.is_dir() and STEP_RE.match(p.name):
        raise CheckpointError(f"checkpoint {p} has {NO_MARKER}", hint=f"use an earlier one: ls {p.parent}")
    raise CheckpointError(f"no complete checkpoint found at {p}",
                          hint="pass a run directory (runs/NAME), its checkpoints/ folder or a step_* folder")


def load_trainer(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / "trainer.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt / 'trainer.json'} is unreadable: {e}") from None


def load_weights(ckpt: Path, model: nn.Module, strict: bool = True, adapt=None) -> None:
    """The checkpoint's weights into `model` (a plain or an FSDP-sharded module), whichever layout it has;
    `adapt(state) -> state` first (expert parallelism: this rank's shard)."""
    if is_sharded(ckpt) or is_fsdp(model):
        from trainbox.checkpoint import sharded  # heavy: torch.distributed.checkpoint, for sharded layouts only
        sharded.load_state(ckpt, model, None)
        return
    try:
        state = load_file(str(ckpt / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError
        raise CheckpointError(f"{ckpt / 'model.safetensors'} is unreadable: {str(e)[:300]}") from None
    if adapt is not None:
        state = adapt(state)
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
        shapes = f"checkpoint {ckpt} holds a differently shaped model ({len(wrong)} tensors differ, e.g. {wrong[0]})"
        raise OtherShape(shapes, f"{shapes}: the config's model section changed since it was saved",
                         hint="start a new run with run.name=NEW_NAME (or run.resume=never), "
                              "or restore the model settings of that run's config.yaml")
    result = model.load_state_dict(state, strict=False)
    if strict and (result.missing_keys or result.unexpected_keys):
        raise CheckpointError(f"checkpoint {ckpt} does not match the model: missing {result.missing_keys[:5]}, "
                              f"unexpected {result.unexpected_keys[:5]}",
                              hint="the run's config.yaml must describe the same model")


def is_fsdp(model: nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) sharded `model`. Asked without importing torch.distributed.fsdp (with the
    DTensor package it loads, most of a second at every start): only that package makes FSDP modules, so while it
    is not loaded no module is one."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def load_safe(path: Path):
    """torch.load that only rebuilds tensors and plain values: a pickle that would run code is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} cannot be loaded safely: {first[:300]}",
                              hint="trainbox loads only tensors and plain values from checkpoints; "
                                   "use another checkpoint") from None


def load_optimizers(ckpt: Path, optimizers: list, adapt=None) -> None:
    """Load the optimizer states, then set every hyper-parameter (lr, betas, eps, weight decay, ...) back to
    what the optimizers were built with: a changed optim.* on resume applies (see train/resume.py). `adapt(states)
    -> states` runs first (expert parallelism: this rank's shard)."""
    if is_sharded(ckpt):
        raise CheckpointError(f"{ckpt} is sharded: load it with checkpoint.sharded.load_state")
    states = load_safe(ckpt / "optimizer.pt")
    if not isinstance(states, list) or len(states) != len(optimizers):
        raise CheckpointError(f"{ckpt / 'optimizer.pt'}: holds {len(states) if isinstance(states, list) else 0} "
                              f"optimizer states, the run has {len(optimizers)}")
    if adapt is not None:
        states = adapt(states)
    with keep_hyperparameters(optimizers):
        for opt, st in zip(optimizers, states):
            opt.load_state_dict(st)


@contextlib.contextmanager
def keep_hyperparameters(optimizers: list):
    """Loading optimizer state inside this keeps every group's hyper-parameters as the optimizers were built."""
    built = []
    for opt in optimizers:
        hyper = {*opt.defaults, "initial_lr"} - {"params", "step"}   # not per-group state (Muon's step count)
        built.append([{k: v for k, v in g.items() if k in hyper} for g in opt.param_groups])
    yield
    for opt, groups in zip(optimizers, built):
        for group, hyper in zip(opt.param_groups, groups):
            group.update(hyper)


def load_objective(ckpt: Path) -> list | None:
    """Every rank's objective state saved with `ckpt` (None where it has none)."""
    path = ckpt / "objective.pt"
    return load_safe(path) if path.is_file() else None


def load_rng(ckpt: Path, rank: int) -> dict | None:
    rngs = load_safe(ckpt / "rng.pt")
    return rngs[rank] if rank < len(rngs) else None
