"""How the model is spread over the ranks: ddp.py, fsdp.py (and dcp.py, its sharded checkpoints), expert.py, as the
run's layout says (config/layout.py: which strategy, how many ranks share the experts)."""
from __future__ import annotations


def experts_sharded(model) -> bool:
    """Whether this rank holds a shard of the experts (expert.py's `shard_experts` sets `model.expert_shard`). Asked
    here, without importing expert.py, whose DTensors a run without expert parallelism never loads."""
    return getattr(model, "expert_shard", None) is not None


def apart(model) -> list:
    """Modules outside the blocks that FSDP shards as units of their own (the family's `embedding_units()`: an
    untied token table), so that the root, gathered through the whole step, holds only the final norm and the
    head."""
    listed = getattr(model, "embedding_units", None)
    return list(listed()) if listed is not None else []
