"""How the model is spread over the ranks: ddp.py or fsdp.py for the dense parameters (dcp.py: sharded checkpoints),
expert.py for the experts under either, as the run's layout says (config/layout.py: which strategy, how many ranks
share the experts)."""
from __future__ import annotations


def experts_sharded(model) -> bool:
    """Whether this rank holds a shard of the experts (expert.py's `shard_experts` sets `model.expert_shard`). Asked
    here, without importing expert.py, whose DTensors a run without expert parallelism never loads."""
    return getattr(model, "expert_shard", None) is not None


def keeps_split_sizes_in_graph(cfg, step) -> bool:
    """Whether this run keeps expert parallelism's split sizes in the compiled graph: as the step-time plan decided
    (`step`, plan/time.py's StepTime, from model.moe.split_sizes), or, without one (a CPU, a GPU without rates),
    where a compiled run with experts split over ranks asks for model.moe.split_sizes=graph."""
    if step is not None:
        return step.sizes_in_graph
    moe = cfg.model.moe
    return cfg.train.compile and moe.expert_parallel > 1 and moe.split_sizes == "graph"


def split_sizes_in_graph() -> None:
    """Before torch.compile, where model.moe.split_sizes says so (auto: where the plan has a step time, plan/time.py's
    StepTime.sizes_in_graph): the split sizes the uneven exchange reads on the host (expert.py's `_uneven`, one
    `tolist` per MoE layer and micro-batch) stay in the compiled graph as symbolic sizes (Dynamo's
    capture_scalar_outputs) instead of breaking it there. After each read the host goes on launching the graph's
    kernels, where it would otherwise enter Dynamo again for the rest of the layer while the GPU's queue is empty.
    Inductor runs the elementwise kernels it writes over tensors of those sizes slower (torch 2.11 sizes their blocks
    for 8,192 elements where it does not know a size), so the experts' GELU and regrouping gathers run as ATen's
    kernels instead (kernels/rows.py). A setting of the process, which runs the one model."""
    import torch._dynamo  # heavy: only where the run compiles

    from trainbox.kernels import rows  # heavy: the custom ops register with torch, only where the run compiles
    torch._dynamo.config.capture_scalar_outputs = True
    rows.use_opaque()


def apart(model) -> list:
    """Modules outside the blocks that FSDP shards as units of their own (the family's `embedding_units()`: an
    untied token table), so that the root, gathered through the whole step, holds only the final norm and the
    head."""
    return _listed(model, "embedding_units")


def heads(model) -> list:
    """The family's `head_units()`: an untied output head that FSDP shards as a unit of its own, out of the root,
    whose gradient would be reduced only after the whole backward."""
    return _listed(model, "head_units")


def _listed(model, units: str) -> list:
    listed = getattr(model, units, None)
    return list(listed()) if listed is not None else []


class ExpertCopies:
    """The experts' 16-bit copies (expert.py's keep_casts) kept equal to their weights, for either strategy: set by
    the first micro-batch after the model was built or loaded, and again after every optimizer step (evaluation,
    the sample and the next step read them). A no-op without expert parallelism."""

    def __init__(self, model):
        self.model, self.on, self.fresh = model, experts_sharded(model), False

    def before(self, k: int) -> None:
        """Before micro-batch k of a step."""
        if k == 0 and self.on and not self.fresh:
            self.refresh()

    def refresh(self) -> None:
        if self.on:
            from trainbox.parallel import expert  # heavy: torch.distributed.tensor, for expert parallelism only
            expert.refresh_casts(self.model)
            self.fresh = True
