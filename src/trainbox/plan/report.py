"""The plan as text: what `trainbox plan` and `trainbox doctor RECIPE` print (the CLI does the printing)."""
from __future__ import annotations

from trainbox.plan import MARGIN, MemoryPlan, StepTime, Suggestion
from trainbox.plan.gpus import GiB
from trainbox.plan.suggest import ONCE

OPTIMIZER = {"adamw": "AdamW: two {state} moments",
             "muon": "Muon: one fp32 momentum (matrices), AdamW's two {state} (rest)"}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _m(n: float) -> str:
    return f"{n / 1e6:,.1f}M"


def time_text(t: StepTime) -> str:
    return (f"{t.step:.2f} s a step, {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU (compute {t.compute:.2f} s, "
            f"exchanges {t.exchanges:.2f}, host {t.host:.2f}, weights {t.weights:.2f}, optimizer {t.optimizer:.2f}"
            f"{'; the split sizes in the compiled graph' if t.sizes_in_graph else ''})")


def _row(s: Suggestion, recipe: str | None, overrides) -> str:
    time = f"{s.time.step:7.2f} s {s.time.tokens_per_s_per_gpu:>9,.0f}  " if s.time is not None else ""
    return f"  {s.needed / GiB:6.1f}  {time}{s.what:<26}{s.command(recipe, overrides)}"


def layout_text(plan: MemoryPlan) -> str:
    lay, each = plan.layout, plan.target.each
    if plan.target.cuda:
        text = f"{lay.parallel} over {lay.nproc} GPUs" if lay.nproc > 1 else "one GPU"
    else:
        text = f"{lay.parallel} over {lay.nproc} CPU processes" if lay.nproc > 1 else "one process on this CPU"
    if lay.parallel == "fsdp":
        dense = "dense " if plan.counts.expert and lay.expert_parallel > 1 else ""   # FSDP ignores the experts
        text += f" ({dense}parameters, gradients and optimizer state 1/{lay.nproc} per {each}; " \
                f"reshard_after_forward={str(lay.reshard_after_forward).lower()}" \
                f"{'; gradients reduced once a step' if lay.grad_reduce == 'step' else ''})"
    if plan.counts.expert:
        text += f"; experts 1/{lay.expert_parallel} per {each}" if lay.expert_parallel > 1 else \
            f"; every expert on every {each}"
    return text


def _device_text(plan: MemoryPlan) -> str:
    """The header's device: the GPUs with each one's memory, or this CPU with the RAM each process has."""
    t, n = plan.target, plan.layout.nproc
    if t.cuda:
        gpus = f"{n} x {t.name}" if n > 1 else t.name
        origin = ("this machine" if t.local else "assumed") + (", capped by train.memory_limit_gib" if t.capped else "")
        return f"{gpus} ({t.gib:.1f} GiB each, {origin})"
    ram = f"{t.ram / GiB:.1f} GiB of RAM available to a run: MemAvailable"
    if t.processes == 1:
        return f"this CPU ({ram})"
    here = " of this CPU" if t.processes == n else f", {t.processes} on this CPU"
    return f"{n} processes{here} ({t.gib:.1f} GiB each of the {ram})"


def format_plan(plan: MemoryPlan, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The plan as a table per GPU (on a CPU per process), the verdict, and what would fit."""
    t, c, mem, acts, k = plan.target, plan.counts, plan.memory, plan.activations, plan.kernels
    lay, each = plan.layout, plan.target.each
    lines = [f"{plan.recipe or 'config'} on {_device_text(plan)}",
             f"  layout       {layout_text(plan)}",
             f"  batch        micro-batch {plan.micro_batch}"
             + (f" {plan.unit} ({plan.micro_batch * plan.sequences} sequences)" if plan.sequences > 1 else "")
             + f" x {plan.seq_len:,} tokens, {plan.dtype}, "
             f"{'compiled' if plan.compiled else 'eager'}, activation checkpointing {plan.checkpointing}",
             f"  kernels      attention {k.attention}, fused loss {k.fused_loss}, fused MLP {k.fused_mlp}, fp8 {k.fp8}"
             + ("" if t.local or not t.hopper or k.attention == "flash" else
                " (--flash: as with trainbox[flash] installed there)"),
             f"  parameters   {_m(c.total)}" + (f" ({_m(c.expert)} in experts, {_m(c.total - c.expert)} dense)"
                                                if c.expert else "")
             + (f", {_m(c.trainable)} trainable" if c.frozen else ""),
             "",
             f"  {'per ' + each:<22}{'GiB':>8}"]
    comm = {"ddp": "DDP's gradient buckets", "fsdp": "gathered blocks, reduce-scatter buffers"}[lay.parallel]
    if lay.expert_parallel > 1:
        comm += ", all-to-all buffers"
    base = ("bf16 frozen base" if plan.base == "bf16" else "fp32 frozen weights" if plan.base == "fp32" else
            f"frozen base: {plan.base} linear layers, the rest fp32 (prepare_model_for_kbit_training)")
    rows = [("parameters", mem.params, "fp32" + (f", {base}" if c.frozen else "")),
            ("gradients", mem.gradients, "fp32" if mem.gradients else
             "none at the peak: one micro-batch a step, gradients are made in its backward"),
            ("optimizer state", mem.optimizer,
             OPTIMIZER["muon" if c.muon else "adamw"].format(state=plan.state_dtype)),
            ("activations", mem.activations,
             f"blocks {_gib(acts.blocks)}, head and loss {_gib(acts.other)}, weight copies "
             f"{_gib(acts.weight_copies)}, transient {_gib(acts.transient)}"),
            ("communication", mem.comm, comm if mem.comm else ""),
            *([("reference", mem.reference, "a frozen copy of the initial model (dpo.reference=model)")]
              if mem.reference else []),
            *([("sampling", mem.sampling, f"above the step's peak while completions are sampled (KV caches "
                                          f"{_gib(mem.kv_cache).strip()} GiB"
                                          + (f", the weights' copy {_gib(mem.sampling_copy).strip()} GiB"
                                             if mem.sampling_copy else "") + ")")] if mem.sampling else []),
            ("peak allocated", mem.peak_allocated, "torch.cuda.max_memory_allocated() during training"
             if t.cuda else ""),
            ("overhead", mem.overhead, "CUDA context, NCCL, allocator slack" if t.cuda else ""),
            ("needed", mem.needed, f"of {t.gib:.1f} GiB")]
    if mem.pools:
        which = "the all-gather and reduce-scatter streams' pools" if plan.layout.side_stream_grads \
            else "the all-gather stream's pool"
        rows.append(("+ FSDP's pools", mem.pools, f"{which}, held while memory is ample (total "
                                                  f"{_gib(mem.total).strip()} GiB), given back under pressure"))
    lines += [f"  {name:<22}{_gib(n):>8}   {note}".rstrip() for name, n, note in rows]
    verdict = "fits" if plan.fits else "does not fit"
    lines += ["", f"{verdict}: {mem.needed / GiB:.1f} of {t.gib:.1f} GiB per {each} "
                  f"(the prediction aims at {MARGIN:.0%} of the measured peak)"]
    if plan.time is not None and plan.fits:
        lines += [f"step time: {time_text(plan.time)}", f"  (plan/time.py; rates of {t.name}: {t.rates.source})"]
    if plan.staged:
        n = lay.nproc
        lines += [f"host memory: sharded checkpoints keep each {each}'s parameters and "
                  f"optimizer state in host memory{' (pinned)' if t.cuda else ''} to write them in the background: "
                  f"{plan.staged / GiB:.1f} GiB each" + (f", {plan.staged * n / GiB:.1f} GiB where all {n} share "
                                                          f"one host" if n > 1 else "")]
    if plan.drops_unsent:
        lines += ["experts: every routed assignment counted; under expert parallelism the ones the capacity drops "
                  "are not sent, so a step whose router drops assignments holds less"]
    if (f := plan.fewer_exchanges) is not None:
        lines += ["", f"expert parallelism: {plan.accumulation} micro-batches a step, each with an all-to-all "
                      "exchange per MoE layer, both ways (uneven: with a host read of its split sizes); fewer, "
                      f"larger ones exchange less often (GiB per {each}"
                  + (", predicted step time, tokens/s per GPU" if f.time else "") + "):",
                  _row(f, plan.recipe, overrides)]
    if (f := plan.kept_gathered) is not None:
        lines += ["", "fsdp: with the blocks kept gathered from forward to backward and between micro-batches "
                      "(train.reshard_after_forward=false), nothing is gathered again for the backward and FSDP's "
                      "hooks do less each micro-batch"
                  + ("; with the gradients reduce-scattered once a step (train.grad_reduce=step), less still"
                     if ONCE in f.overrides else "")
                  + f"; that fits (GiB per {each}, predicted step time, tokens/s per GPU):",
                  _row(f, plan.recipe, overrides)]
    smaller = []
    if (f := plan.smaller_state) is not None:
        smaller = ["", "with AdamW's moments in bf16 (optim.state_dtype=bf16: 4 bytes a parameter instead of 8, "
                       "rounded stochastically; a change of numerics) a larger micro-batch fits"
                   + ("" if plan.fits else " in the first of these layouts")
                   + f" (GiB per {each}, predicted step time, tokens/s per GPU):", _row(f, plan.recipe, overrides)]
    if plan.fits:
        lines += smaller
    if plan.suggestions:
        timed = plan.suggestions[0].time is not None
        lines += ["", f"what would fit, fastest first (GiB per {each}, predicted step time, tokens/s per GPU):"
                  if timed else f"what would fit (GiB per {each}):"]
        lines += [_row(s, plan.recipe, overrides) for s in plan.suggestions]
        lines += smaller
    elif not plan.fits:
        lines += ["", "nothing tried fits: a smaller model (model.n_layer, model.n_embd), a shorter data.seq_len, "
                      + ("or a GPU with more memory" if t.cuda else "or fewer processes on this host")]
    return "\n".join(lines)
