"""The sharded layout of a checkpoint, read: torch.distributed.checkpoint (DCP) folders of every layout, loaded
into an FSDP model on any number of ranks or into a plain model on one process (`trainbox export`, `generate`,
a DDP resume), since DCP reshards on load; a single-file checkpoint loaded into a sharded model. Writing them
is a run's business (parallel/dcp.py: asynchronous saves that every rank joins).

    checkpoints/step_00001000/
        state/              DCP: .metadata + __R_K.distcp files, several per rank (weights and optimizer state)
        trainer.json, rng.pt, objective.pt, COMPLETE   as in every checkpoint (checkpoint/__init__.py)

Nothing from the checkpoint is unpickled as code: `.metadata` is read by an unpickler that rebuilds only
DCP's metadata classes, and non-tensor values by `torch.load(weights_only=True)`. A run whose state dict maps
its parameters onto another layout (expert shards as DTensors over the expert mesh, parallel/expert.py) passes
the two maps, `to_global` and `to_local`.
"""
from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element  # the default planner's own helper
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainbox import checkpoint
from trainbox.errors import CheckpointError


def state_dict(model: nn.Module, optimizers: list | None) -> dict:
    """{"model": ..., "optim": ...} keyed by parameter names: the same keys for FSDP and plain modules."""
    out = {"model": get_model_state_dict(model)}
    if optimizers:
        optim = get_optimizer_state_dict(model, optimizers)
        # each parameter's state in a dict of its own (torch hands out the optimizers' live ones): a layout that
        # maps the tensors for a save (parallel/expert.py's as_global) leaves the optimizers' state as it was
        optim["state"] = {k: dict(v) for k, v in optim["state"].items()}
        out["optim"] = optim
    return out


# ---------------------------------------------------------------------------------------------- loading
_SAFE_MODULES = ("torch.distributed.checkpoint.",)
_SAFE_GLOBALS = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("builtins", "slice"), ("torch", "device"), ("torch.serialization", "_get_layout"),
                 ("pathlib", "PosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata (dataclasses of torch.distributed.checkpoint, dtypes, sizes) and nothing else."""

    def find_class(self, module: str, name: str):
        if module.startswith(_SAFE_MODULES) or (module, name) in _SAFE_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                              torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise CheckpointError(f"{path} cannot be loaded safely: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_state(ckpt: Path, model: nn.Module, optimizers: list | None, to_global=None, to_local=None,
               cut=None) -> None:
    """Load a checkpoint's weights (and optimizer state when `optimizers` is given) into `model`, resharding
    from the layout it was saved with to the model's. The optimizers keep the hyper-parameters they were built
    with (a changed optim.* applies, see train/resume.py). `to_global(model, state) -> state` and
    `to_local(model, state)` map a run's own layout onto the saved names and back (expert parallelism); `cut`, a
    pair of functions (weights -> weights, optimizer state dicts -> optimizer state dicts), takes from a
    single-file checkpoint's whole tensors the part of them that the model keeps apart from its sharded ones (an
    expert shard)."""
    if not checkpoint.is_sharded(ckpt):
        _load_single(ckpt, model, optimizers, cut)
        return
    reader = _SafeReader(str(ckpt / checkpoint.SHARDED_DIR))
    reader.read_metadata()   # a damaged or unsafe .metadata is named here, before DCP's collectives
    state = state_dict(model, optimizers)
    if to_global is not None:
        state = to_global(model, state)
    one_process = not (tdist.is_available() and tdist.is_initialized())
    try:
        with warnings.catch_warnings():
            # one process reading every shard (export, generate, a resume on one process) is what trainbox means
            # here: DCP's warning that it assumes so ("torch.distributed is disabled ...") tells the user nothing
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, checkpoint_id=str(ckpt / checkpoint.SHARDED_DIR), storage_reader=reader,
                     planner=_SafePlanner(), no_dist=one_process)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP's CheckpointException: missing keys, size mismatch, ...
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {ckpt} does not match the model: {first}",
                              hint="the run's config.yaml must describe the same model; start a new run with "
                                   "run.name=NEW_NAME (or run.resume=never) to change it") from None
    if to_local is not None:
        to_local(model, state)
    set_model_state_dict(model, state["model"])
    if optimizers:
        with checkpoint.keep_hyperparameters(optimizers):
            set_optimizer_state_dict(model, optimizers, state["optim"])


def _load_single(ckpt: Path, model: nn.Module, optimizers: list | None, cut=None) -> None:
    """A single-file checkpoint (model.safetensors + optimizer.pt) into a sharded model: every rank reads the
    full tensors and keeps its shard."""
    full = StateDictOptions(full_state_dict=True)
    weights = load_file(str(ckpt / "model.safetensors"))
    if cut is not None:
        weights = cut[0](weights)
    names = list(get_model_state_dict(model).keys())
    for name in names:   # tied weights were stored once
        if name not in weights:
            alias = _tied_alias(model, name, weights)
            if alias is not None:
                weights[name] = weights[alias]
    set_model_state_dict(model, weights, options=full)
    if not optimizers:
        return
    states = checkpoint.load_safe(ckpt / "optimizer.pt")
    if not isinstance(states, list) or len(states) != len(optimizers):
        raise CheckpointError(f"{ckpt / 'optimizer.pt'}: holds a different number of optimizer states than the run")
    if cut is not None:
        states = cut[1](states)
    fqn = {id(p): n for n, p in model.named_parameters()}
    with checkpoint.keep_hyperparameters(optimizers):
        for opt, st in zip(optimizers, states):
            order = [fqn[id(p)] for g in opt.param_groups for p in g["params"]]
            saved = [i for g in st["param_groups"] for i in g["params"]]
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": [order[saved.index(i)] for i in g["params"]]} for g in st["param_groups"]]
            osd = {"state": {order[saved.index(i)]: s for i, s in st["state"].items()}, "param_groups": groups}
            set_optimizer_state_dict(model, opt, osd, options=full)


def _tied_alias(model: nn.Module, name: str, weights: dict) -> str | None:
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(name)
    for other, p in params.items():
        if other != name and p is target and other in weights:
            return other
    return None
