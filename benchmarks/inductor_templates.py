"""Inductor's GEMM autotuning for chosen matmuls only: an experiment switch of train_speed.py and profile_step.py
(`--templates grouped|mlp`), not a product setting.

Autotuning every matmul of moe-gpt2-125m (`TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1`) crashed with torch 2.11 on an H200: an
illegal memory access while it benchmarked Triton choices for the loss head's weight gradient (50304 x 49152 @ 49152
x 768), which poisons the process. This switch turns autotuning on where a matmul is lowered, for one kind only:

    grouped  the MoE experts' grouped matmuls (aten._grouped_mm): Inductor's Triton grouped template, autotuned
    mlp      the plain matmuls with an operand dimension of `width` (gpt2-125m's 4 * n_embd = 3072: the MLP's)

Inductor then fuses the neighbouring elementwise work (the GELU, its derivative, casts) into the chosen Triton
template's epilogue as it does under max-autotune. `backends` as Inductor's max_autotune_gemm_backends: TRITON
(the templates only) or ATEN,TRITON (the faster of the library kernel and the templates, each matmul).
"""
from __future__ import annotations

import sys

KINDS = ("grouped", "mlp")


def install(kind: str, backends: str = "TRITON", width: int = 3072):
    """From now on in this process, lower `kind`'s matmuls with GEMM autotuning over `backends`; returns a function
    that puts Inductor back as it was."""
    import torch
    import torch._inductor.config as inductor
    import torch._inductor.kernel.mm  # noqa: F401 - registers the matmul lowerings wrapped below
    import torch._inductor.kernel.mm_grouped  # noqa: F401
    from torch._inductor import lowering

    if kind not in KINDS:
        raise ValueError(f"--templates {kind}: one of {', '.join(KINDS)}")
    # graphs compiled before the switch (a baseline run in this process) are dropped: Dynamo would otherwise reuse
    # them for the next model of the same code and shapes, which would then never be lowered again
    torch._dynamo.reset()
    # inert while max_autotune is off, but part of the compiled-graph cache's key: a graph compiled without the
    # switch is never reused with it
    before = inductor.max_autotune_gemm_backends
    inductor.max_autotune_gemm_backends = backends
    aten = torch.ops.aten
    ops = [aten._grouped_mm.default] if kind == "grouped" else [aten.mm.default, aten.addmm.default]

    def chosen(args) -> bool:
        if kind == "grouped":
            return True
        dims = [str(d) for a in args if hasattr(a, "get_size") for d in a.get_size()]
        return str(width) in dims

    def wrap(op):
        base = lowering.lowerings[op]

        def tuned(*args, **kwargs):
            if not chosen(args):
                return base(*args, **kwargs)
            print(f"inductor_templates: autotuning {op} over {backends}", file=sys.stderr, flush=True)
            with inductor.patch(max_autotune_gemm=True, max_autotune_gemm_backends=backends,
                                benchmark_epilogue_fusion=False):
                return base(*args, **kwargs)

        lowering.lowerings[op] = tuned

    originals = {op: lowering.lowerings[op] for op in ops}
    for op in ops:
        wrap(op)

    def restore() -> None:
        lowering.lowerings.update(originals)
        inductor.max_autotune_gemm_backends = before
        torch._dynamo.reset()

    return restore
