"""How the model is spread over the ranks: ddp.py, fsdp.py (and dcp.py, its sharded checkpoints), expert.py."""
from __future__ import annotations


def shards(parallel: str, world: int) -> bool:
    """Whether a run shards its model with FSDP: train.parallel=fsdp over several processes. One process has
    nothing to shard; it runs the model whole, as under ddp (its checkpoints in one file)."""
    return parallel == "fsdp" and world > 1
