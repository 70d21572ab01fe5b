"""Data parallelism with DistributedDataParallel (`train.parallel=ddp`, the default): every rank holds the whole
model, gradients are averaged over the ranks in the backward. On one process the model runs as it is.

With expert parallelism (`model.moe.expert_parallel`, parallel/expert.py) DDP averages the dense parameters
only; the expert shards are reduced over the ranks that hold the same shard before clipping."""
from __future__ import annotations

import functools
import inspect
import logging
from contextlib import nullcontext

import torch
import torch.nn as nn

from trainbox.optim.clip import clip_
from trainbox.parallel import ExpertCopies, experts_sharded
from trainbox.parallel.distributed import Dist


class DataParallel:
    """The strategy object the loop talks to: `forward`, `micro_batch(k, accum)`, `clip(max_norm)`."""

    name = "ddp"

    def __init__(self, model: nn.Module, dist: Dist, device: torch.device):
        self.model, self.ddp = model, None
        self.mesh_dims = {"replicate": dist.world}   # every rank holds the whole model
        self.collective = experts_sharded(model)   # a forward needs every rank (experts spread over them)
        self.sharded = self.collective   # expert shards: every rank writes its own (parallel/dcp.py)
        if dist.enabled:
            # no buffer broadcast before every forward: every buffer of our models is a constant (RoPE tables) or
            # set identically on every rank (the speedrun window, by set_step). torch 2.13 renamed the switch
            # (broadcast_buffers -> forward_sync_buffers); older torch has only the first
            args = inspect.signature(nn.parallel.DistributedDataParallel).parameters
            no_sync = {"forward_sync_buffers" if "forward_sync_buffers" in args else "broadcast_buffers": False}
            self.ddp = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)
        self.forward = self.ddp or model
        self.copies = ExpertCopies(model)

    def compile(self, cuda_graphs: bool = False) -> None:
        """torch.compile over the whole forward (DDP's bucketing stays outside the graph); `cuda_graphs`: the compiled
        forward and backward replayed as CUDA graphs (train.cuda_graphs)."""
        if self.ddp is not None:
            _drop_record_function_notice()
        self.forward = torch.compile(self.forward, mode="reduce-overhead" if cuda_graphs else None)

    def whole(self):
        """Each rank holds the whole model: nothing to gather (ShardedParallel.whole)."""
        return nullcontext()

    def micro_batch(self, k: int, accum: int):
        """Gradients are averaged over ranks only in the last micro-batch's backward. Under expert parallelism the
        first micro-batch after a build or a load sets the experts' 16-bit copies (parallel/expert.py)."""
        self.copies.before(k)
        return self.ddp.no_sync() if self.ddp is not None and k < accum - 1 else nullcontext()

    def after_step(self) -> None:
        """Expert parallelism: the experts' 16-bit copies set from the stepped weights (evaluation, the sample and
        the next step read them)."""
        self.copies.refresh()

    def clip(self, max_norm: float, optimizers: list[torch.optim.Optimizer]) -> torch.Tensor | None:
        """After the last backward: reduce the expert shards' gradients (expert parallelism), then clip by the
        norm of the whole gradient, in the optimizers' step where they take the scale (optim/clip.py)."""
        clip = functools.partial(clip_, optimizers=optimizers)
        if self.collective:   # expert shards: reduced over their replicas, each counted once in the norm
            from trainbox.parallel import expert  # heavy: torch.distributed.tensor, for expert parallelism only
            expert.sync_grads(self.model)
            clip = functools.partial(expert.clip_grad_norm_, self.model)
        if max_norm <= 0:
            return None
        params = [p for p in self.model.parameters() if p.grad is not None]
        return clip(params, max_norm)


class _RecordFunctionNotice(logging.Filter):
    """Drops Dynamo's "Profiler record function ... will be ignored" for torch's record_function (see below)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "Profiler record function %s will be ignored" and record.args
                    and record.args[0] is torch.autograd.profiler.record_function)


def _drop_record_function_notice() -> None:
    """DistributedDataParallel.forward runs inside torch.autograd.profiler.record_function, a label for profiler
    traces. Compiled, Dynamo leaves the label out of the graph and logs so on every rank at every start (keeping it,
    torch._dynamo.config.capture_profiler_record_function, fails on any graph break inside the region). Only the
    label goes, the work is traced as before: the notice is dropped, on the one logger that emits it."""
    logger = logging.getLogger("torch._dynamo.variables.ctx_manager")
    if not any(isinstance(f, _RecordFunctionNotice) for f in logger.filters):
        logger.addFilter(_RecordFunctionNotice())
