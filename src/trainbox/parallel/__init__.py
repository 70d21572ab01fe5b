"""How the model is spread over the ranks: ddp.py, fsdp.py (and dcp.py, its sharded checkpoints), expert.py."""
from __future__ import annotations


def shards(parallel: str, world: int) -> bool:
    """Whether a run shards its model with FSDP: train.parallel=fsdp over several processes. One process has
    nothing to shard; it runs the model whole, as under ddp (its checkpoints in one file)."""
    return parallel == "fsdp" and world > 1


def apart(model) -> list:
    """Modules outside the blocks that FSDP shards as units of their own (the family's `embedding_units()`: an
    untied token table), so that the root, gathered through the whole step, holds only the final norm and the
    head."""
    listed = getattr(model, "embedding_units", None)
    return list(listed()) if listed is not None else []
