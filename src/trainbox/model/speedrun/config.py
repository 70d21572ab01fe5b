"""The speedrun family's own rules on the model section (its options are generic model.* keys)."""
from __future__ import annotations


def check(m) -> None:
    if m.attention == "flash" and m.window_block != 1:
        raise ValueError(f"model.attention=flash counts the window in tokens; model.window_block={m.window_block} "
                         f"needs model.attention=flex (or set model.window_block=1)")
    if m.window_pattern is not None and (len(m.window_pattern) != m.n_layer or set(m.window_pattern) - set("LS-")):
        raise ValueError(f"model.window_pattern={m.window_pattern!r} must have one letter per layer ({m.n_layer}), "
                         f"each L (long window), S (short) or - (no attention)")


def flash_eligible(m) -> bool:
    """FlashAttention-4's windows count tokens: it computes the document-causal windows of window_block=1."""
    return m.window_block == 1
