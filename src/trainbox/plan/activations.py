"""Activation memory of one micro-batch on one GPU: the family's own formula (model/<family>/memory.py, written
with the pieces of model/memory.py), its head and loss, the 16-bit weight copies autocast keeps, and the largest
transient at the peak. `tests/test_plan.py` holds the result to the bytes that saved-tensor hooks count in real
forwards of every family, and the whole plan to the H100 peaks in benchmarks/records/."""
from __future__ import annotations

from dataclasses import replace

from trainbox.model.memory import Activations, Kernels, Widths, head_bytes
from trainbox.model.spec import family
from trainbox.objective import objective_class
from trainbox.plan.count import ParamCount


def family_activations(cfg, counts: ParamCount, vocab: int, micro: int, mode: str, w: Widths, kern: Kernels,
                       autocast_copies: bool = True) -> Activations:
    """One micro-batch of `micro` sequences of data.seq_len tokens, on one GPU. `autocast_copies`: the weights
    are fp32 and autocast casts them (else they are used as they are: fp32 runs, FSDP's bf16 parameters)."""
    memory = family(cfg.model.family).memory()
    w = replace(w, autocast=autocast_copies)
    f = memory.forward(cfg, counts, micro, mode, w, kern)
    blocks = f.blocks * (getattr(memory, "COMPILE_FACTOR", 1.0) if w.compiled else 1.0)
    fp8_head = cfg.model.fp8_head and kern.fp8 == "fp8"
    head_tokens = f.head_tokens if objective_class(cfg).token_head else 0   # a reward model's score head: no logits
    head_saved, head_transient = head_bytes(head_tokens, f.width, vocab, w, kern, f.softcap, fp8_head, w.compiled,
                                            frozen=counts.frozen > 0 and counts.head_frozen)
    # one block's backward: the gradient of its largest intermediates, and under recomputation the block itself
    workspace = 2 * w.a * f.head_tokens * (f.widest or 4 * f.width) + (f.recompute if mode != "none" else 0)
    return Activations(blocks=int(blocks), other=int(f.other + head_saved), weight_copies=0,
                       transient=int(max(head_transient, workspace)))


def weight_copy_bytes(counts: ParamCount, w: Widths, mode: str) -> int:
    """16-bit copies of the matmul weights that autocast makes and the backward keeps: 2 bytes per weight in
    matrices (not embedding tables: a lookup casts nothing), none when the weights are already 16-bit (FSDP)
    or in fp32 runs. Activation checkpointing recomputes the casts inside the blocks (experts: the experts')."""
    if w.a == 4 or counts.matmul == 0:
        return 0
    recast = {"none": 0, "experts": counts.expert}.get(mode, counts.blocks_matmul)
    return int((counts.matmul - recast) * w.a)


