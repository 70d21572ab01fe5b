"""What would make a plan fit (`MemoryPlan.suggestions`): the largest micro-batch, an activation-checkpointing mode,
fsdp, an expert-parallel degree (with ddp or fsdp), or more GPUs, each checked with the same memory model as the
plan itself; and, under expert parallelism, the largest micro-batch that fits (`MemoryPlan.fewer_exchanges`); for a
plan that fits with AdamW's fp32 moments, the larger micro-batch bf16 moments would fit where it is faster
(`MemoryPlan.smaller_state`: a change of numerics, so a hint beside the plan, never one of its ranked suggestions);
for a plan under fsdp that fits, its blocks kept gathered (and its gradients reduced once a step where that is
faster still) where that fits and is predicted at least GATHERED_GAIN faster (`MemoryPlan.kept_gathered`).
Every layout suggested is one config/layout.py accepts. Each carries its predicted step time (plan/time.py) where
the GPU has rates: the expert-parallel degree suggested is the fastest that fits, and the suggestions on the plan's
GPUs come fastest first, then those on more GPUs, fastest first."""
from __future__ import annotations

from dataclasses import replace

from trainbox.config import RunConfig, apply_overrides, build_config
from trainbox.config.layout import decide_layout, micro_batches
from trainbox.errors import ConfigError
from trainbox.model.spec import family
from trainbox.plan.memory import BYTES, MODES, Layout, MemoryPlan, Suggestion, memory
from trainbox.plan.time import StepTime, step_time

# the least predicted gain for which a plan that fits names its blocks kept gathered: under expert parallelism it
# saves FSDP's host work each micro-batch (1.18x and 1.19x measured, plan/time.py FSDP_GATHERED_HOST); a dense model
# saves a hidden gather (llama-1b on 2 H200s: 1%, 2026-11-30-2xh200-llama-1b-fsdp-2gpu-bf16-gathered-vs-torchtitan.json)
GATHERED_GAIN = 0.05
GATHERED = "train.reshard_after_forward=false"   # an fsdp layout's blocks kept gathered
ONCE = "train.grad_reduce=step"                  # ... and its gradients reduce-scattered once a step


class _Search:
    """Memory of variants of one plan (same model, same GPU): which fit, at which micro-batch."""

    def __init__(self, cfg: RunConfig, vocab: int, plan: MemoryPlan):
        self.cfg, self.vocab, self.plan = cfg, vocab, plan

    def needed(self, layout: Layout, micro: int, mode: str) -> int:
        return memory(self.cfg, self.plan.counts, self.vocab, self.plan.target, layout, micro, mode,
                      self.plan.kernels, BYTES[self.plan.dtype])[0].needed

    def largest(self, layout: Layout, mode: str, same_micro: bool = False) -> tuple[int, int] | None:
        """(micro-batch, needed) of the largest micro-batch that fits, or None: up to the plan's, and for another
        layout, where the step time is predicted, up to a rank's share of the global batch (fewer micro-batches
        gather fsdp's parameters and exchange the experts' rows fewer times a step, and the plan counts them)."""
        micro = self.plan.micro_batch
        if not same_micro and layout != self.plan.layout and self.plan.time is not None:
            micro = self.cfg.train.global_batch_size
        sizes = micro_batches(self.cfg.train.global_batch_size, layout.nproc, micro)
        for b in sizes[:1] if same_micro else sizes:
            if (needed := self.needed(layout, b, mode)) <= self.plan.target.memory:
                return b, needed
        return None

    def suggest(self, what: str, layout: Layout, mode: str, overrides: tuple[str, ...],
                same_micro: bool = False) -> Suggestion | None:
        found = self.largest(layout, mode, same_micro)
        if found is None:
            return None
        micro, needed = found
        if micro != self.plan.micro_batch:
            overrides = (*overrides, f"train.micro_batch_size={micro}")
        if mode != self.plan.checkpointing:
            overrides = (*overrides, f"train.activation_checkpointing={mode}")
        return Suggestion(what, overrides, layout.nproc, needed, self.time(layout, micro, mode))

    def time(self, layout: Layout, micro: int, mode: str) -> StepTime | None:
        return step_time(self.cfg, self.plan.counts, self.plan.target, layout, micro, mode, self.plan.sequences)


def _seconds(s: Suggestion) -> float:
    """A suggestion's predicted step time; one without (a GPU without rates) after those with."""
    return s.time.step if s.time is not None else float("inf")


def _layouts(cfg: RunConfig, base: Layout, n: int) -> list[tuple[Layout, tuple[str, ...]]]:
    """The layouts on n GPUs the trainer runs, simplest first: as configured; fsdp (where the config is ddp); then
    each expert-parallel degree above the configured one, with ddp, then each with fsdp. Each fsdp layout that
    reshards its blocks after the forward is followed by its twin that keeps them gathered
    (train.reshard_after_forward=false: more memory, fewer gathers and, under expert parallelism, less host work a
    micro-batch), and by that twin with its gradients reduced once a step (train.grad_reduce=step). A layout is kept
    where config/layout.py accepts the config with its overrides (and the config still loads: no fsdp for t5, hf or
    Muon), in the strategy and degree it decides; the micro-batch is searched apart."""
    ddp = cfg.train.parallel == "ddp"
    to_ddp, to_fsdp = ((), ("train.parallel=fsdp",)) if ddp else (("train.parallel=ddp",), ())
    degrees = range(base.expert_parallel + 1, n + 1)
    changes = [(), *([to_fsdp] if ddp and n > 1 else [])]
    changes += [(*to_ddp, f"model.moe.expert_parallel={ep}") for ep in degrees]
    changes += [(*to_fsdp, f"model.moe.expert_parallel={ep}") for ep in degrees if n > 1]
    out = []
    for over in changes:
        try:
            run = decide_layout(build_config(apply_overrides(cfg.model_dump(mode="json"), list(over))), n, "cuda",
                                adapt_micro_batch=True)
        except ConfigError:
            continue
        layout = replace(base, nproc=n, parallel=run.strategy, expert_parallel=run.expert_parallel)
        out.append((layout, over))
        if layout.parallel == "fsdp" and layout.reshard_after_forward:
            out += _gathered(layout, over)
    return out


def _gathered(layout: Layout, over: tuple[str, ...]) -> list[tuple[Layout, tuple[str, ...]]]:
    """An fsdp layout's twins that keep the blocks gathered: reducing gradients as it does, and, where it reduces
    them every micro-batch, once a step (train.grad_reduce=step: the whole fp32 gradient of what FSDP shards kept
    until the last micro-batch, fewer collectives and hooks)."""
    twins = [(replace(layout, reshard_after_forward=False), (*over, GATHERED))]
    if layout.grad_reduce != "step":
        twins.append((replace(layout, reshard_after_forward=False, grad_reduce="step"), (*over, GATHERED, ONCE)))
    return twins


def suggestions(cfg: RunConfig, vocab: int, plan: MemoryPlan) -> list[Suggestion]:
    """What would fit, one of each kind: the largest micro-batch; an activation-checkpointing mode; fsdp at the
    plan's expert-parallel degree; a higher expert-parallel degree, with ddp or fsdp (on these GPUs, with the
    largest micro-batch that then fits); more GPUs (the fewest, with the simplest layout, mode and largest
    micro-batch that fit)."""
    search, lay, mode = _Search(cfg, vocab, plan), plan.layout, plan.checkpointing
    spec = family(cfg.model.family)
    later = MODES[MODES.index(mode) + 1:] if not spec.recompute else ()
    modes = (mode, *(m for m in later if m != "experts" or spec.experts))
    # a model with experts may keep only what enters them (train.activation_checkpointing=experts): a larger
    # micro-batch for one grouped matmul more, which competes on time with the first mode that fits
    recompute_experts = spec.experts and mode == "none"

    def first(what: str, options, modes=modes, same_micro=False) -> Suggestion | None:
        return next((s for m in modes for layout, over in options
                     if (s := search.suggest(what, layout, m, over, same_micro))), None)

    def fastest(what: str, options) -> Suggestion | None:
        """Of the options, each with the first mode that fits (and, for a model with experts, with the experts
        recomputed), the fastest (the first where none has a time)."""
        found = [s for option in options if (s := first(what, [option]))]
        if recompute_experts:
            found += [s for layout, over in options if (s := search.suggest(what, layout, "experts", over))]
        return min(found, key=_seconds, default=None)

    out = [search.suggest("micro-batch", lay, mode, ()),
           first("activation checkpointing", [(lay, ())], modes[1:], same_micro=True)]
    if not plan.target.cuda:   # processes on one machine share its RAM: sharding or more of them does not help
        return [s for s in out if s is not None]
    here = [(x, o) for x, o in _layouts(cfg, lay, lay.nproc) if o]   # all but the plan's own layout
    out += [first("fsdp", [(x, o) for x, o in here if x.expert_parallel == lay.expert_parallel]),
            fastest("expert parallelism", [(x, o) for x, o in here if x.expert_parallel != lay.expert_parallel])]
    for n in (2, 4, 8, 16, 32, 64):   # the fewest GPUs that fit; for an MoE also its best expert-parallel layout
        if n <= lay.nproc:
            continue
        options = _layouts(cfg, lay, n)
        found = first("more GPUs", options)
        if found:
            out.append(found)
            if not any(o.startswith("model.moe.expert_parallel") for o in found.overrides):
                out.append(fastest("more GPUs, experts split",
                                   [x for x in options if x[0].expert_parallel > lay.expert_parallel]))
            break
    return sorted((s for s in out if s is not None), key=lambda s: (s.nproc > lay.nproc, _seconds(s)))


def fewer_exchanges(cfg: RunConfig, vocab: int, plan: MemoryPlan) -> Suggestion | None:
    """Under expert parallelism every micro-batch exchanges its tokens with an all-to-all per MoE layer, after a
    host read of the split sizes, both ways: the largest micro-batch that fits (up to one a step) where it is
    larger than the plan's, else None."""
    lay = plan.layout
    search = _Search(cfg, vocab, plan)
    for b in micro_batches(cfg.train.global_batch_size, lay.nproc, cfg.train.global_batch_size):
        if b <= plan.micro_batch:
            return None
        if (needed := search.needed(lay, b, plan.checkpointing)) <= plan.target.memory:
            return Suggestion("fewer exchanges", (f"train.micro_batch_size={b}",), lay.nproc, needed,
                              search.time(lay, b, plan.checkpointing))
    return None


def smaller_state(cfg: RunConfig, vocab: int, plan: MemoryPlan) -> Suggestion | None:
    """With optim.state_dtype=bf16 AdamW's moments take 4 bytes a parameter instead of 8: the largest micro-batch
    that then fits in the plan's layout, where it is larger than the plan's and the predicted step faster; else None
    (Muon, moments already bf16, or a GPU without rates)."""
    if cfg.optim.name != "adamw" or cfg.optim.state_dtype != "fp32" or plan.time is None:
        return None
    bf16 = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"state_dtype": "bf16"})})
    search, lay = _Search(bf16, vocab, plan), plan.layout
    # a plan that recomputes its experts only to fit a larger micro-batch may keep them with the memory saved
    modes = (plan.checkpointing, "none") if plan.checkpointing == "experts" else (plan.checkpointing,)
    found = []
    for mode in modes:
        for b in micro_batches(cfg.train.global_batch_size, lay.nproc, cfg.train.global_batch_size):
            if b <= plan.micro_batch:
                break
            if (needed := search.needed(lay, b, mode)) <= plan.target.memory:
                time = search.time(lay, b, mode)
                if time.step < plan.time.step:
                    over = ("optim.state_dtype=bf16", f"train.micro_batch_size={b}",
                            *((f"train.activation_checkpointing={mode}",) if mode != plan.checkpointing else ()))
                    found.append(Suggestion("bf16 moments", over, lay.nproc, needed, time))
                break
    return min(found, key=_seconds, default=None)


def kept_gathered(cfg: RunConfig, vocab: int, plan: MemoryPlan) -> Suggestion | None:
    """A plan under fsdp that reshards its blocks after the forward, with them kept gathered instead
    (train.reshard_after_forward=false, at the plan's micro-batch; with the gradients also reduced once a step where
    that is faster still): the fastest twin that fits, where its step is predicted at least GATHERED_GAIN shorter;
    else None (another strategy, one GPU, already gathered, or a GPU without rates)."""
    lay = plan.layout
    if lay.parallel != "fsdp" or lay.nproc < 2 or not lay.reshard_after_forward or plan.time is None:
        return None
    search, best = _Search(cfg, vocab, plan), None
    for gathered, over in _gathered(lay, ()):
        needed = search.needed(gathered, plan.micro_batch, plan.checkpointing)
        time = search.time(gathered, plan.micro_batch, plan.checkpointing)
        if needed <= plan.target.memory and time.step <= (1 - GATHERED_GAIN) * plan.time.step \
                and (best is None or time.step < best.time.step):
            best = Suggestion("blocks kept gathered", over, lay.nproc, needed, time)
    return best
