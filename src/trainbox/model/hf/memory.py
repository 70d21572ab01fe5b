"""The hf family's activations for the plan: the base model's decoder block (model/memory.py) with its projections
frozen and LoRA adapters beside them; checkpointing is Hugging Face's own (lora.gradient_checkpointing)."""
from __future__ import annotations

from trainbox.model.llama.memory import forward  # noqa: F401 - the same decoder block, read from the base


def checkpointing(cfg) -> str:
    """The recomputation the run gets: Hugging Face's gradient checkpointing keeps each layer's input only."""
    return "full" if cfg.lora.gradient_checkpointing else "none"
