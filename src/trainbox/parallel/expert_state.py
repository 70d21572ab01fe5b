"""Expert shards in checkpoints (expert parallelism, parallel/expert.py). Checkpoints are sharded (parallel/dcp.py):
`as_global` presents each rank's expert shard (weights and optimizer state) as a DTensor of the whole stacked tensor
over the expert mesh, [Replicate, Shard(0)], so every rank writes its own experts and DCP reshards on load
(`as_local` takes this rank's rows back) to any expert_parallel and world size. A single-file checkpoint of an
unsharded run is cut to this rank's shard by `shard_state` and `shard_optimizer_states`."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainbox.parallel.expert import ExpertShard, shard_of


def _indices(opt: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> its index in the optimizer's state_dict (torch numbers them in group order)."""
    out: dict[int, int] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            out.setdefault(id(p), len(out))
    return out


def as_global(model: nn.Module, state: dict) -> dict:
    """Expert parallelism: the expert shards of `state` ({"model": ..., "optim": ...} keyed by parameter name, as
    parallel/dcp.py builds it) as DTensors over the expert mesh: dimension 0 of the whole (E, ...) tensor split
    over an expert group, replicated across groups. torch.distributed.checkpoint then writes each shard once
    and loads into any expert-parallel degree, world size or a plain model. Unchanged without expert
    parallelism."""
    shard = shard_of(model)
    if shard is None:
        return state
    place = [Replicate(), Shard(0)]

    def wrap(t: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(t, shard.mesh, place, run_check=False)

    _map_experts(shard, state, wrap)
    return state


def as_local(model: nn.Module, state: dict) -> dict:
    """as_global undone (after a load): each expert entry this rank's shard again."""
    shard = shard_of(model)
    if shard is not None:
        _map_experts(shard, state, lambda t: t.to_local())
    return state


def _map_experts(shard: ExpertShard, state: dict, fn) -> None:
    weights = state["model"]
    for name in shard.params:
        if name in weights:
            weights[name] = fn(weights[name])
    for name, st in state.get("optim", {}).get("state", {}).items():
        p = shard.params.get(name)
        if p is not None:
            for key, v in st.items():
                if _is_expert_state(v, p) or getattr(v, "placements", None) is not None:
                    st[key] = fn(v)


def _is_expert_state(v, p: nn.Parameter) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.shape[1:] == p.shape[1:]


def shard_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full (unsharded) model state dict cut to this rank's experts; unchanged without expert parallelism."""
    shard = shard_of(model)
    if shard is None:
        return state
    return {k: shard.cut(v).clone() if k in shard.params and v.size(0) == shard.num_experts else v
            for k, v in state.items()}


def shard_optimizer_states(model: nn.Module, optimizers: list, states: list) -> list:
    """Optimizer state dicts of an unsharded model cut to this rank's experts: copies that own their memory (a
    loader may keep a state tensor as it is given, and a view would hold, and depend on, the whole tensor)."""
    shard = shard_of(model)
    if shard is None:
        return states
    out = []
    for opt, sd in zip(optimizers, states):
        index = _indices(opt)
        sd = {**sd, "state": dict(sd["state"])}
        for p in shard.params.values():
            i = index.get(id(p))
            if i in sd["state"]:
                sd["state"][i] = {k: shard.cut(v).clone() if _is_expert_state(v, p) and v.size(0) == shard.num_experts
                                  else v for k, v in sd["state"][i].items()}
        out.append(sd)
    return out
