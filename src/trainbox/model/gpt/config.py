"""The gpt family's own rule on the model section (it has no section of its own)."""
from __future__ import annotations


def check(m) -> None:
    """Heads split the width evenly (gpt and moe)."""
    if m.n_embd % m.n_head:
        raise ValueError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
