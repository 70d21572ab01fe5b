"""How the model is spread over the ranks: ddp.py, fsdp.py (and dcp.py, its sharded checkpoints), expert.py, as the
run's layout says (config/layout.py: which strategy, how many ranks share the experts)."""
from __future__ import annotations


def apart(model) -> list:
    """Modules outside the blocks that FSDP shards as units of their own (the family's `embedding_units()`: an
    untied token table), so that the root, gathered through the whole step, holds only the final norm and the
    head."""
    listed = getattr(model, "embedding_units", None)
    return list(listed()) if listed is not None else []
