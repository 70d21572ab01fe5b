"""Sharded data parallelism with FSDP2 (`train.parallel=fsdp`): parameters, gradients and optimizer state are
split over the ranks, and each block's parameters are all-gathered just before it runs.

    trainbox train llama-1b --nproc 2 train.parallel=fsdp

- The mesh: one dimension over all ranks on one node; across nodes a 2-D mesh (replicate, shard), HSDP:
  parameters are sharded inside a node (fast links) and replicated across nodes, so the all-gathers of the
  forward and backward stay inside a node and only one all-reduce of the gradient shards crosses nodes.
- Units: every block the family lists in `checkpoint_units()` is one `fully_shard` unit, an untied token table
  (`embedding_units()`) another, an untied head (`head_units()`) another, and the root holds the rest (final
  norm, a tied head and table). The root's gradient is reduced after the whole backward, a unit's as soon as
  the backward is through it: an untied head's (a quarter of llama-1b's parameters with Llama 3's vocabulary)
  then goes under the blocks' backward instead of after it, and it is gathered when it runs, not at the
  start of the forward. The last block keeps its parameters gathered after the forward (the backward needs
  them at once); `train.reshard_after_forward=false` keeps every block gathered (less traffic, more memory),
  and then also keeps them gathered between the micro-batches of one step.
- Gradient reduction: with several micro-batches a step, each unit's gradient is reduce-scattered after every
  micro-batch's backward (each rank keeps only its shard), or with `train.grad_reduce=step` once a step, after
  the last: until then every rank accumulates the whole fp32 gradient of what FSDP shards (4 bytes a parameter
  more), and the micro-batches before the last run no reduce-scatter and none of its hooks, as ddp reduces once
  a step.
- Gradient memory: FSDP reduce-scatters each unit's gradient on a side stream, and the caching allocator
  keeps what a stream allocated in that stream's own pool. The sharded gradients (fp32: one rank's share of
  4 bytes a parameter) would then sit in a pool that the forward's activations cannot use, so the peak of the
  forward and the peak of the backward would add up in reserved memory. On one node (no HSDP all-reduce
  stream) they are allocated in the compute stream's pool instead (grad_pool.py, `GradsOnComputeStream`), and
  the reserved memory is the larger of the two peaks, not their sum.
- Precision: on bf16 runs the gathered parameters are bf16 and gradients are reduced in fp32; the sharded
  parameters and the optimizer state stay fp32.
- torch.compile compiles each block (before sharding), as torchtitan does: FSDP's hooks stay outside the graphs.
- The global batch stays a pure function of (seed, step) and the gradient is averaged over the ranks like
  DDP's, so the loss of a step equals the DDP loss (tested: 2 processes under gloo against 1 process).
- `whole()` gathers every unit for a while: grpo samples its completions inside it, through a decoder over the
  model's modules that runs none of FSDP's hooks, so each rank samples alone (its rows stop when they stop).
- Checkpoints are sharded and written asynchronously with torch.distributed.checkpoint (parallel/dcp.py).
- With expert parallelism (`model.moe.expert_parallel=N`, parallel/expert.py) FSDP shards the dense parameters
  only: every `fully_shard` call ignores the experts' weights (`ignored_params`), which stay this rank's expert
  shard, whole, as under ddp. They run from their 16-bit copies made once a step, their gradients are summed over
  the ranks holding the same shard after the last backward, and the clipping norm counts the sharded dense
  gradients and every expert once (expert.clip_grad_norm_). Their optimizer state is split over the N ranks of an
  expert group, not over the replicas of a shard.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from trainbox.errors import ConfigError
from trainbox.kernels.float8 import after_step
from trainbox.optim.clip import clip_
from trainbox.parallel import ExpertCopies, apart, experts_sharded, heads
from trainbox.parallel.distributed import Dist


def mesh_shape(world: int, local_world: int) -> tuple[int, ...]:
    """(shard,) on one node, (replicate, shard) across nodes (HSDP)."""
    if local_world >= world or world % local_world:
        return (world,)
    return (world // local_world, local_world)


def units(model: nn.Module) -> list[nn.Module]:
    listed = getattr(model, "checkpoint_units", None)
    if listed is None:
        raise ConfigError(f"train.parallel=fsdp is not available for model.family={getattr(model, 'family', '?')}",
                          hint="use train.parallel=ddp")
    return list(listed())


class ShardedParallel:
    """The strategy object the loop talks to: `forward`, `micro_batch(k, accum)`, `clip(max_norm)`."""

    name = "fsdp"
    sharded = True      # checkpoints: every rank writes its shards (parallel/dcp.py)
    collective = True   # a forward needs every rank (the blocks' all-gathers)

    def __init__(self, model: nn.Module, dist: Dist, device: torch.device, dtype: torch.dtype,
                 reshard_after_forward: bool, compile: bool, float8: bool = False, grad_reduce: str = "micro_batch"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # heavy: torch.distributed.fsdp
        shape = mesh_shape(dist.world, dist.local_world)
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        self.mesh_dims = dict(zip(names, shape))   # logged: {"replicate": nodes, "shard": ranks a node} under HSDP
        low = dtype if dtype in (torch.bfloat16, torch.float16) else None
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)
        blocks = units(model)
        self.reshard_after_forward = reshard_after_forward
        self.once_a_step = grad_reduce == "step"
        self.experts = experts_sharded(model)
        shard = dict(mesh=self.mesh, mp_policy=policy, **_ignoring_experts(model))
        for i, block in enumerate(blocks):
            if compile:   # the block's forward only: FSDP's hooks run around it, outside the graph
                block.forward = torch.compile(block.forward)   # parameter names (so checkpoints) do not change
            fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **shard)
        for table in apart(model):   # gathered for the lookup and for its gradient at the end of the backward
            fully_shard(table, reshard_after_forward=reshard_after_forward, **shard)
        # the head, and the root (final norm, a tied head and table), stay gathered from forward to backward: the
        # head is needed again at once, and the fused loss keeps it for its backward
        for head in heads(model):
            fully_shard(head, reshard_after_forward=False, **shard)
        fully_shard(model, reshard_after_forward=False, **shard)
        if device.type == "cuda" and len(shape) == 1:
            from trainbox.parallel.grad_pool import grads_on_compute_stream  # heavy: torch.distributed.fsdp
            grads_on_compute_stream(model)
        self.model = self.forward = model
        self.float8 = float8
        self.copies = ExpertCopies(model)

    def after_step(self) -> None:
        """After the optimizer step: with float8 all-gathers, every weight's scale in one all-reduce; with expert
        parallelism, the experts' 16-bit copies set from the stepped weights."""
        if self.float8:
            after_step(self.model)
        self.copies.refresh()

    def compile(self) -> None:
        """Blocks were compiled before sharding; the rest of the model runs eagerly."""

    def whole(self):
        """Every unit gathered until the block ends (`gathered`), on every rank at once: a forward through the
        model's modules outside FSDP's hooks (the family's `rollout_model`: grpo's sampling) then needs no other
        rank, and runs as many times as this rank's rows need."""
        return gathered(self.model)

    def micro_batch(self, k: int, accum: int):
        """Before the last micro-batch, blocks stay gathered after their backward when memory was allowed
        for it (reshard_after_forward=false); gradients reduce-scatter after every micro-batch's backward, or
        after the last one's only (grad_reduce=step)."""
        if not self.reshard_after_forward and accum > 1:
            self.model.set_reshard_after_backward(k == accum - 1)
        if self.once_a_step and accum > 1:
            self.model.set_requires_gradient_sync(k == accum - 1)
        self.copies.before(k)
        return nullcontext()

    def clip(self, max_norm: float, optimizers: list[torch.optim.Optimizer]) -> torch.Tensor | None:
        """Clip by the norm of the whole (sharded) gradient, in the optimizers' step where they take the scale
        (optim/clip.py); returns the norm as a plain tensor. With expert parallelism the expert shards' gradients
        are first reduced over their replicas (parallel/expert.py)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.experts:
            from trainbox.parallel import expert  # heavy: torch.distributed.tensor, for expert parallelism only
            expert.sync_grads(self.model)
            return expert.clip_grad_norm_(self.model, params, max_norm) if max_norm > 0 else None
        return clip_(params, max_norm, optimizers) if max_norm > 0 else None


@contextmanager
def gathered(model: nn.Module):
    """Every FSDP unit's parameters of `model` gathered (in the compute dtype, as their forward gathers them) until
    the block ends, so that its modules can be called on their own; nothing where no unit is sharded."""
    from torch.distributed.fsdp import FSDPModule  # heavy: torch.distributed.fsdp
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()


def _ignoring_experts(model: nn.Module) -> dict:
    """fully_shard's keyword that leaves the expert shards (expert parallelism) out of FSDP; {} without them."""
    if not experts_sharded(model):
        return {}
    from torch.distributed.fsdp import fully_shard  # heavy: torch.distributed.fsdp
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise ConfigError(f"model.moe.expert_parallel with train.parallel=fsdp needs torch>=2.7 (fully_shard's "
                          f"ignored_params); this is torch {torch.__version__}",
                          hint="upgrade torch, or train with train.parallel=ddp")
    return {"ignored_params": set(model.expert_shard.params.values())}


def compute_pool_grads_available() -> bool:
    """Whether this torch lets FSDP's reduce-scatter allocate its output (FSDPModule.set_custom_reduce_scatter)."""
    from trainbox.parallel.grad_pool import available  # heavy: torch.distributed.fsdp
    return available()
