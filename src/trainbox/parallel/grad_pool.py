"""FSDP's reduce-scatter writing the sharded gradients into the compute stream's pool (parallel/fsdp.py's docstring
says why). Apart from fsdp.py, which the memory plan imports in every run's pre-flight check: this module loads
torch.distributed.fsdp, with the DTensor package most of a second, which a run that shards nothing never needs."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

try:   # FSDP's interface for a custom reduce-scatter, in a private module; older torch has none
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:
    ReduceScatter = object


def available() -> bool:
    """Whether this torch lets FSDP's reduce-scatter allocate its output (FSDPModule.set_custom_reduce_scatter)."""
    return ReduceScatter is not object and hasattr(FSDPModule, "set_custom_reduce_scatter")


def grads_on_compute_stream(model: nn.Module) -> None:
    """Every FSDP unit of `model` reduce-scatters into memory of the compute stream's pool (see parallel/fsdp.py's
    docstring). Where this torch has no custom reduce-scatter hook the gradients stay in the side stream's
    pool, which is correct, only larger."""
    if available():
        comm = GradsOnComputeStream(torch.cuda.current_stream())
        for m in model.modules():
            if hasattr(m, "set_custom_reduce_scatter"):
                m.set_custom_reduce_scatter(comm)


class GradsOnComputeStream(ReduceScatter):
    """FSDP's reduce-scatter, with its output (the sharded gradients) taken from the compute stream's pool.

    Safe because FSDP makes the reduce-scatter stream wait for the compute stream just before it allocates the
    output, so no block the compute stream freed can still be in use there; and the output is marked as used on
    the reduce-scatter stream (`record_stream`), so when it is freed the allocator hands it out again only after
    that stream's work on it is done."""

    def __init__(self, compute: torch.cuda.Stream):
        self.compute = compute

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        here = torch.cuda.current_stream(device)
        if here == self.compute:   # the reduce-scatter input, copied in on the compute stream
            return torch.empty(*size, dtype=dtype, device=device)
        with torch.cuda.stream(self.compute):
            out = torch.empty(*size, dtype=dtype, device=device)
        out.record_stream(here)
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        return torch.distributed.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                                       async_op=async_op)
