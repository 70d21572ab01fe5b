"""Bytes autograd keeps for a backward, measured: the oracle the memory plan's activation counts are tested against
(tests/test_plan.py, tests/expert_parallel_worker.py).

    kept = Kept([*model.parameters(), *model.buffers()])   # storages left out: the weights themselves
    with kept.hooks():
        model(x, y)
    kept.add_caches(caches)                                # what a selective-checkpointing policy cached
    kept.total
"""
from __future__ import annotations

import torch


class Kept:
    """Every storage the saved-tensor hooks see (counted once, at its size), those of `skip` left out."""

    def __init__(self, skip=()):
        self.skip = {t.untyped_storage().data_ptr() for t in skip if t is not None}
        self.seen: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in self.skip:
            self.seen[st.data_ptr()] = max(self.seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.add, lambda t: t)

    def add_caches(self, caches: list) -> None:
        """The tensors selective checkpointing's policies cached (their contexts' `storage`, observed)."""
        for cache in caches:
            for outputs in cache.values():
                for out in outputs.values():
                    for wrapped in out if isinstance(out, (tuple, list)) else [out]:
                        if isinstance(getattr(wrapped, "val", None), torch.Tensor):
                            self.add(wrapped.val)

    @property
    def total(self) -> int:
        return sum(self.seen.values())
