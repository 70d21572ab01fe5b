"""Expert parallelism (`model.moe.expert_parallel=N`): the experts of every MoE layer split over N ranks.

    trainbox train --nproc 2 moe-gpt2-125m model.moe.num_experts=128 model.moe.expert_parallel=2

Layout. A DeviceMesh of shape (world / N, N): dimension "expert" is a group of N consecutive ranks, and the
rank at position s of its group holds experts [s * E/N, (s + 1) * E/N) of every MoE layer; dimension
"expert_replica" joins the ranks that hold the same shard. Everything else (attention, embeddings, norms, the
routers) is the dense part, spread as train.parallel says: whole on every rank under ddp, sharded over all ranks
under fsdp (parallel/fsdp.py, which leaves the experts to this module).

Tokens. Every rank routes its own micro-batch exactly as one process does (model/moe.py: top-k, the GShard
capacity order, the balance and z losses), so routing, drops and losses depend on neither N nor the world size.
Its assignment rows, sorted by expert and so by owner, go to their owners by one of two exchanges, which the
layout decides once from model.moe.exchange (config/layout.py; env.json and the start event record it):

- uneven (the default): the kept rows alone (dropped rows left out) in one all-to-all with uneven splits; the row
  counts per expert go first, an all-to-all of E integers and one host read for the split sizes; the owner
  regroups the rows by local expert, runs its experts as grouped matmuls and sends the results back with the
  reverse all-to-all. Evaluation, generation and dropless training always exchange this way.
- padded (training with a capacity): capacity-sized buffers in an all-to-all with equal splits, so nothing is
  counted, nothing is read on the host, and torch.compile captures the layer as one graph. Capacity is per
  expert over a source rank's own micro-batch: C = min(int(capacity_factor * k * N / E), N) rows (a token
  chooses an expert once); every rank trains micro-batches of the layout's shape, so C is the same on every rank
  without asking. A rank sends each owner (its local experts x C) rows, expert e's kept rows in slots 0 ..
  kept[e] - 1 and zeros after them; the owner runs each local expert over (sources x C) rows as two batched
  matmuls, pad rows included, and the reverse exchange brings every slot home, where only the kept ones are
  read: the pads' results are never used, so their gradient is zero and they add nothing to the experts'
  gradients. It moves E x C rows per rank each way where uneven moves the kept ones (at most k x N): up to
  capacity_factor times as many, more where routing drops. Which is faster is the host read's stall against
  the extra rows and pad compute, a GPU measurement (benchmarks/train_speed.py runs both side by side); uneven
  stays the default because it moves and computes the fewest rows and runs with every routing.

Both exchanges are autograd functions whose backward is the exchange the other way, and functional collectives,
whose outputs selective activation checkpointing keeps (train/recompute.py), so its recomputation exchanges
nothing again; full checkpointing exchanges again. The exchange is not overlapped with compute: on CPU (gloo)
there is nothing to measure it by.

Gradients. DDP (or FSDP's reduce-scatter) averages the dense gradients over all ranks and leaves the expert
parameters alone; after the last backward of a step `sync_grads` sums each shard's gradient over its replicas and
divides by the world size: the dense gradients' average, for parameters whose gradient already holds the
contributions of every rank of the expert group. `clip_grad_norm_` clips by the norm of the whole model, each
expert counted once.

Checkpoints of the expert shards: parallel/expert_state.py.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from trainbox.config.layout import RunLayout
from trainbox.kernels.accumulate import accumulate_
from trainbox.kernels.rows import take_rows
from trainbox.model.moe.model import MoEFFN, Sorted

log = logging.getLogger("trainbox")  # the library logger


@dataclass
class ExpertShard:
    """This rank's place in the expert layout, and the exchange that runs an MoE layer's experts."""

    size: int                   # N: ranks in an expert group
    index: int                  # this rank's position in its group: which shard it holds
    num_experts: int            # E of a whole layer
    world: int
    group: object               # the N ranks of this rank's expert group
    replicas: object | None     # the world / N ranks holding the same shard (None when world == N)
    params: dict[str, nn.Parameter] = field(default_factory=dict)   # sharded parameters by name
    mesh: object = None         # (expert_replica, expert) DeviceMesh: checkpoints see each shard's place in it
    exchange: str = "uneven"    # the training exchange the layout decided (model.moe.exchange): uneven or padded
    linears: list = field(default_factory=list)   # the sharded GroupedLinears, whose 16-bit copies keep_casts keeps
    cast_dtype: torch.dtype | None = None         # the autocast dtype of those copies (None: no copies kept)

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a full (E, ...) tensor."""
        return t[self.index * self.local:(self.index + 1) * self.local]

    def experts(self, m: MoEFFN, rows: torch.Tensor, s: Sorted) -> torch.Tensor:
        """MoEFFN's experts across the group: rows (k*N, C) sorted by expert as `s` describes them -> each row
        through its expert (zero for a dropped row). Training with a capacity under the padded exchange sends
        capacity-sized buffers; everything else (dropless routing, evaluation, generation) the kept rows alone."""
        if self.exchange == "padded" and s.capacity is not None:
            return self._padded(m, rows, s)
        return self._uneven(m, rows, s)

    def _uneven(self, m: MoEFFN, rows: torch.Tensor, s: Sorted) -> torch.Tensor:
        """The kept rows alone, in an all-to-all with uneven splits: the row counts per expert go first, then one
        host read of the split sizes, the only one of the layer."""
        S, El, kept = self.size, self.local, s.kept
        recv = _exchange(kept, None, None, self.group)   # rows for my experts, per source
        c = recv.view(S, El)                            # c[s, e]: rows from source s for local expert e
        out_rows, in_rows = torch.stack([c.sum(1), kept.view(S, El).sum(1)]).tolist()   # the host read
        idx, send = None, rows
        if s.keep is not None:   # the kept rows in order, the first kept[e] of expert e's group: sized by the host
            n = sum(in_rows)     # read above, where keep.nonzero() would read its size from the GPU once more
            shift = (s.counts.cumsum(0) - s.counts) - (kept.cumsum(0) - kept)
            idx = torch.repeat_interleave(shift, kept, output_size=n) + torch.arange(n, device=rows.device)
            send = rows[idx]
        got = _AllToAll.apply(send, out_rows, in_rows, self.group)   # by source, then by expert within a source
        # regroup by local expert: block (e, s) of the grouped rows starts at start[s, e] of what arrived
        total = sum(out_rows)
        flat = c.reshape(-1)
        start = (flat.cumsum(0) - flat).view(S, El).t().reshape(-1)
        sizes = c.t().reshape(-1)
        perm = torch.repeat_interleave(start - (sizes.cumsum(0) - sizes), sizes, output_size=total)
        perm = perm + torch.arange(total, device=perm.device)
        back = torch.empty_like(perm).scatter_(0, perm, torch.arange(total, device=perm.device))   # perm's inverse
        per_expert = c.sum(0)
        ids = torch.repeat_interleave(torch.arange(El, device=perm.device), per_expert, output_size=total)
        h = m.experts(_Permute.apply(got, perm, back), per_expert.cumsum(0).to(torch.int32), ids)
        h = _AllToAll.apply(_Permute.apply(h, back, perm), in_rows, out_rows, self.group)
        if idx is None:
            return h
        return h.new_zeros(rows.size(0), h.size(1)).index_copy(0, idx, h)

    def _padded(self, m: MoEFFN, rows: torch.Tensor, s: Sorted) -> torch.Tensor:
        """Capacity-sized buffers in an all-to-all with equal splits: no counts exchanged, nothing read on the host.

        Capacity is per expert over this rank's micro-batch: an expert takes at most C = min(capacity, N) of its
        N tokens' rows (a token chooses an expert once). Every rank of the group trains micro-batches of the
        layout's shape, so C, and so every buffer's size, is the same on every rank without asking. This rank
        sends each owner a buffer of (its local experts x C) rows: expert e's kept rows in slots 0.. kept[e] - 1,
        zeros after them. The owner runs its experts over (sources x C) rows each, pad rows included (zeros in;
        what comes out of them is never read, so their gradient is zero and adds nothing to the experts'), and
        the results come back by the reverse exchange to the slots they left from."""
        S, El, E, D = self.size, self.local, self.num_experts, rows.size(1)
        C = min(s.capacity, rows.size(0) // m.moe.top_k)
        if C == 0:   # every assignment dropped, on every rank alike (the same C)
            return rows.new_zeros(rows.shape)
        j = torch.arange(C, device=rows.device)
        # buffer row e * C + j holds sorted row start[e] + j while j < kept[e]; sorted row p, when kept, sits at
        # buffer row expert[p] * C + slot[p]: the two maps are each other's inverse on the kept rows
        start = s.counts.cumsum(0) - s.counts
        to_buffer = ((start.unsqueeze(1) + j).clamp(max=rows.size(0) - 1).reshape(-1),
                     (j < s.kept.unsqueeze(1)).reshape(-1))
        to_rows = ((s.expert * C + s.slot).clamp(max=E * C - 1), s.keep)
        send = _MaskedGather.apply(rows, *to_buffer, *to_rows)                 # (E * C, D): [owner, expert, slot]
        got = _AllToAll.apply(send, None, None, self.group)                   # (S * El * C, D): [source, expert, slot]
        x = got.view(S, El, C, D).transpose(0, 1).reshape(El, S * C, D)       # each local expert's rows together
        h = m.experts_padded(x)                                               # (El, S * C, D)
        h = h.view(El, S, C, D).transpose(0, 1).reshape(S * El * C, D)        # back to [source, expert, slot]
        h = _AllToAll.apply(h, None, None, self.group)                        # (E * C, D): this rank's own buffer
        return _MaskedGather.apply(h, *to_rows, *to_buffer)                   # (k*N, D), zero where dropped


class _Permute(torch.autograd.Function):
    """out = x[perm] for a permutation `perm` of x's rows whose inverse is `inverse`. The backward is the gather by
    the inverse, where autograd's would scatter-add (index_put with accumulate) into zeros."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(perm, inverse)
        return take_rows(x, perm)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        perm, inverse = ctx.saved_tensors
        return _Permute.apply(g, inverse, perm), None, None


class _MaskedGather(torch.autograd.Function):
    """out[i] = x[index[i]] where mask[i], else 0; `back_index`, `back_mask` the same map the other way (the pairs
    the masks keep are one bijection seen from either side). The backward is that map: a gather, no scatter-add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, back_index: torch.Tensor,
                back_mask: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index, mask, back_index, back_mask)
        return torch.where(mask.unsqueeze(1), x[index], x.new_zeros(()))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        index, mask, back_index, back_mask = ctx.saved_tensors
        return _MaskedGather.apply(g, back_index, back_mask, index, mask), None, None, None, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single, with uneven splits or (None) equal ones; the backward is the exchange the other way
    (splits swapped). A functional collective: selective activation checkpointing keeps its output
    (train/recompute.py), so the backward's recomputation exchanges nothing again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(g, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group))


# ----------------------------------------------------------------------------- building


def shard_experts(model: nn.Module, layout: RunLayout, num_experts: int, dist_info,
                  device: torch.device) -> ExpertShard | None:
    """Keep this rank's shard of every MoE layer's experts (the layout's expert_parallel > 1, which
    config/layout.py has checked against the run), hand DDP the names it must ignore, and return the shard (also
    `model.expert_shard`); None when every rank holds every expert."""
    n = layout.expert_parallel
    if n == 1:
        return None
    mesh = init_device_mesh(device.type, (dist_info.world // n, n), mesh_dim_names=("expert_replica", "expert"))
    shard = ExpertShard(size=n, index=dist_info.rank % n, num_experts=num_experts,
                        world=dist_info.world, group=mesh.get_group("expert"),
                        replicas=mesh.get_group("expert_replica") if dist_info.world > n else None, mesh=mesh,
                        exchange=layout.expert_exchange)
    for name, m in model.named_modules():
        if isinstance(m, MoEFFN):
            for lin_name in ("c_fc", "c_proj"):
                lin = getattr(m, lin_name)
                shard.linears.append(lin)
                for pname in ("weight", "bias"):
                    p = getattr(lin, pname)
                    if p is None:
                        continue
                    new = nn.Parameter(shard.cut(p.detach()).clone(), requires_grad=p.requires_grad)
                    setattr(lin, pname, new)
                    shard.params[f"{name}.{lin_name}.{pname}"] = new
            m.parallel = shard
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(shard.params))
    model.expert_shard = shard
    return shard


def shard_of(model: nn.Module) -> ExpertShard | None:
    return getattr(model, "expert_shard", None)


def whole(model: nn.Module) -> bool:
    """Whether this rank holds every expert and so can run the model alone (else every rank of its expert group
    takes part in each forward: the end-of-run sample runs on all ranks)."""
    return shard_of(model) is None


# ----------------------------------------------------------------------------- 16-bit copies of the weights


def keep_casts(model: nn.Module, dtype: torch.dtype) -> None:
    """Under autocast to a 16-bit `dtype`: the expert weights' copies in that dtype made once per optimizer step
    (`refresh_casts`) instead of once per micro-batch and layer, and their gradients added straight into the
    fp32 weights' .grad (one add that reads the 16-bit gradient) instead of a cast to fp32 and an add. The values
    are those of a cast in every micro-batch: the same copies, the same 16-bit gradients summed in fp32. The copies
    take the memory that the backward keeps of every cast anyway (plan/memory.py counts them). A no-op without
    expert parallelism or in fp32."""
    shard = shard_of(model)
    if shard is not None and dtype != torch.float32:
        shard.cast_dtype = dtype


def refresh_casts(model: nn.Module) -> None:
    """The 16-bit copies set from the weights: at the first micro-batch after the model was built or loaded and
    after every optimizer step (parallel/ddp.py). The first call makes them; until then the layers cast."""
    shard = shard_of(model)
    if shard is None or shard.cast_dtype is None:
        return
    with torch.no_grad():
        for lin in shard.linears:
            if lin.cast is None:
                lin.cast = torch.empty_like(lin.weight, dtype=shard.cast_dtype)
                if lin.weight.requires_grad:
                    lin.cast.requires_grad_(True)
                    lin.cast.register_post_accumulate_grad_hook(functools.partial(_fold, lin.weight))
            lin.cast.copy_(lin.weight)


def _fold(weight: nn.Parameter, cast: torch.Tensor) -> None:
    """A micro-batch's gradient of the 16-bit copy, added into the fp32 weight's (autograd has just set it)."""
    g, cast.grad = cast.grad, None
    if weight.grad is None:
        weight.grad = g.to(weight.dtype, memory_format=torch.contiguous_format)
    else:
        accumulate_(weight.grad, g)


# ----------------------------------------------------------------------------- gradients


def sync_grads(model: nn.Module) -> None:
    """After a step's last backward: each expert shard's gradient summed over its replicas, divided by the world
    size. A no-op without expert parallelism."""
    shard = shard_of(model)
    if shard is None:
        return
    grads = []
    for p in shard.params.values():
        if p.grad is None:   # every rank takes part in the reduction, with or without rows for its experts
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if shard.replicas is not None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=shard.replicas)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
    for g in grads:
        g.div_(shard.world)


def clip_grad_norm_(model: nn.Module, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model: with expert parallelism, the norm counts the dense
    gradients once (the same on every rank under ddp; under fsdp DTensor shards, their norm taken over the shards)
    and every expert shard once. Returns the norm as a plain tensor."""
    shard = shard_of(model)
    if shard is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    from torch.distributed.tensor import DTensor  # heavy: torch.distributed.tensor (loaded by the first save)
    experts = {id(p) for p in shard.params.values()}
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad]
    device = next(iter(shard.params.values())).device
    expert_sq = _squares([p.grad for p in with_grad if id(p) in experts], device)
    dist.all_reduce(expert_sq, group=shard.group)     # the group holds every shard once
    total = (_squares([p.grad for p in with_grad if id(p) not in experts], device) + expert_sq).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:   # a DTensor's own shard, scaled in place
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.dtype))
    return total


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squared entries of `grads`, plain tensors and DTensors (FSDP's shards: squared over the whole
    tensor they are shards of), as a plain fp32 tensor."""
    from torch.distributed.tensor import DTensor  # heavy: torch.distributed.tensor (loaded by the first save)
    out = torch.zeros((), device=device)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if plain:
        out = out + torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in plain]).sum()
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if sharded:
        out = out + torch.nn.utils.get_total_norm(sharded).full_tensor().float() ** 2
    return out
