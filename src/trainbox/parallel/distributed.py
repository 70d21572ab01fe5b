"""Process group from torchrun's environment; DDP; rank helpers. Every helper is a no-op on one process.

The loop receives a `Dist` built by the CLI (`trainbox.cli`) from torchrun's RANK / WORLD_SIZE / LOCAL_RANK (the CLI is
the only place that reads environment variables). NCCL on CUDA, gloo on CPU. Multi-node needs nothing
here: torchrun's c10d rendezvous sets MASTER_ADDR / MASTER_PORT and the ranks, `init_process_group`
reads them.

Control traffic (the per-step "does any rank want to stop?" vote, the "did the save succeed?" vote,
gathering RNG states) goes through a gloo group on CPU tensors. With NCCL as the main backend this
keeps every such check off the GPU stream: a CUDA all-reduce followed by `.item()` would make the host
wait for all queued GPU work at every step.

The timeout (`train.pg_timeout_s`) applies to both groups. It must cover the longest time one rank can
spend alone while the others wait in a collective: rank 0 writing a checkpoint, or an evaluation.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 0      # processes on this node (torchrun's LOCAL_WORLD_SIZE); 0: all of them
    node: int = 0             # this node's number: `trainbox train --node-rank`, else torchrun's GROUP_RANK
    ctrl: object = field(default=None, repr=False)   # gloo group for host-side votes (None: default group)
    timeout_s: int | None = None

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def __post_init__(self):
        self.local_world = self.local_world or self.world

    @classmethod
    def from_env(cls, env) -> "Dist":
        """From torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK in `env` (a mapping the
        caller passes, os.environ in the CLI; TRAINBOX_NODE_RANK, set by `trainbox train --node-rank`, names the
        node as the user did); one process where they are absent."""
        def get(name: str, default: int) -> int:
            value = env.get(name)
            return int(value) if value not in (None, "") else default
        return cls(rank=get("RANK", 0), world=get("WORLD_SIZE", 1), local_rank=get("LOCAL_RANK", 0),
                   local_world=get("LOCAL_WORLD_SIZE", 0), node=get("TRAINBOX_NODE_RANK", get("GROUP_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def init(self, device: torch.device, timeout_s: int) -> None:
        """Join the process group (gloo on CPU, NCCL on CUDA) plus a gloo control group when needed."""
        if not self.enabled:
            return
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, rank=self.rank, world_size=self.world, timeout=timeout, **kwargs)
        if dist.get_backend() != "gloo":
            self.ctrl = dist.new_group(backend="gloo", timeout=timeout)

    def describe(self) -> str:
        """Backend, size and timeouts as the live process groups report them (for the run log)."""
        if not self.enabled or not dist.is_initialized():
            return "single process"
        parts = []
        for label, group in (("main", dist.group.WORLD), ("control", self.ctrl)):
            if group is None:
                continue
            name = dist.get_backend(group)
            dev = torch.device("cuda" if name == "nccl" else "cpu")
            timeout = group._get_backend(dev).options._timeout.total_seconds()
            parts.append(f"{label} {name} timeout {timeout:.0f}s")
        return f"{self.world} processes; " + ", ".join(parts)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.ctrl)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks on the tensor's own device (main backend)."""
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's largest over ranks, on every rank. Host-only (the control group): never touches the
        GPU, so it adds no device synchronisation."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (stop votes, failed saves); host-only, so calling it
        every step costs no device synchronisation."""
        return self.max_over_ranks([1.0 if flag else 0.0])[0] > 0

    def gather_objects(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (over the control group)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def shutdown(self, graceful: bool = True) -> None:
        """Leave the process groups. After a normal end every rank first meets at a barrier, so no rank
        tears its connections down while another still uses them (seen as gloo aborting a rank at exit);
        after an error there is no barrier, since the other ranks may be gone."""
        if self.enabled and dist.is_initialized():
            if graceful:
                dist.barrier(group=self.ctrl)
            dist.destroy_process_group()
            self.ctrl = None
