"""Every check `trainbox train` makes before any work, in one function that `trainbox config validate` calls too.

    checked = preflight(cfg, world=2, adapt_micro_batch=True)   # or a ConfigError naming the key and the fix

In order: the keys the recipe requires and the family's resolution (llama with model.path: the folder's shape), the
objective's (dpo.disable_dropout), data.packing on examples for a family that cannot pack them (model/spec.py
Family.check_packing), the device (train/device.py: train.device=cuda without a GPU, a GPU recipe on a CPU, bf16 on a
CPU, FP8 without FP8 tensor cores, ...), the run's layout on `world` processes (config/layout.py: micro-batch,
accumulation, strategy, expert parallelism) and train.cuda_graphs on it, model.vocab_size against the tokenizer,
what train.eval_tasks needs (lm-eval, a causal model: eval/training.py), and monitor.host where this process
serves the monitor. `trainbox train` runs it before the run directory is touched or data downloaded (under
--nproc N, in the launcher before any worker starts); the trainer takes its result. What needs the data or the
device's free memory (a sample at data.seq_len, the memory plan) is checked by the trainer before the model is
built (train/build.py, train/memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainbox.config import RunConfig
from trainbox.config.layout import RunLayout, decide_layout
from trainbox.errors import ConfigError
from trainbox.eval.training import check as check_eval_tasks
from trainbox.model.build import build_tokenizer, check_packing, check_vocab_size, resolve_model
from trainbox.monitor.server import check_host
from trainbox.objective import resolve_objective
from trainbox.train.device import resolve_device


@dataclass(frozen=True)
class Preflight:
    """A run that passed its checks: what it trains with."""

    cfg: RunConfig          # resolved: the family's resolution, the device's (FP8 fallback), the layout's micro-batch
    layout: RunLayout
    device: torch.device
    dtype: torch.dtype


def preflight(cfg: RunConfig, world: int, local_rank: int = 0, adapt_micro_batch: bool = False,
              serves_monitor: bool = True) -> Preflight:
    """Check `cfg` for the process at `local_rank` of a run on `world` processes; `adapt_micro_batch`: the command
    line did not give train.micro_batch_size (config/layout.py); `serves_monitor`: this process would serve the
    monitor (rank 0). `cfg` itself is never changed."""
    resolved = resolve_objective(resolve_model(cfg))
    check_packing(resolved)
    device, dtype, resolved = resolve_device(resolved, local_rank)
    layout = decide_layout(resolved, world, device.type, adapt_micro_batch)
    resolved = graphs_resolved(layout.applied(resolved), layout)
    if resolved.model.vocab_size is not None:   # else the model's vocabulary is the tokenizer's
        check_vocab_size(resolved.model, build_tokenizer(resolved), cfg)
    check_eval_tasks(resolved)
    if serves_monitor and resolved.monitor.enabled:
        check_host(resolved.monitor)
    return Preflight(resolved, layout, device, dtype)


def graphs_resolved(cfg: RunConfig, layout: RunLayout) -> RunConfig:
    """`cfg` with train.cuda_graphs decided for `layout`. true is refused where graphs cannot run: several
    processes, or a device other than a CUDA GPU (the config itself refuses it without train.compile or for another
    objective). auto is made true where they can run, a compiled next-token run in one process on a CUDA GPU
    (train.compile already resolved for the device), and false elsewhere."""
    t = cfg.train
    if t.cuda_graphs is True:
        if layout.world > 1:
            raise ConfigError(f"train.cuda_graphs runs in one process; this run has {layout.world}",
                              hint="drop train.cuda_graphs, or train on one GPU")
        if layout.device != "cuda":
            raise ConfigError(f"train.cuda_graphs replays torch.compile's graphs on a CUDA GPU; this run is on "
                              f"{layout.device}", hint="drop train.cuda_graphs")
    if t.cuda_graphs != "auto":
        return cfg
    on = layout.device == "cuda" and layout.world == 1 and t.compile is True and t.objective == "next_token"
    return cfg.model_copy(update={"train": t.model_copy(update={"cuda_graphs": on})})
