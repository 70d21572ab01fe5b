"""The memory plan of a run: bytes per GPU by component, whether it fits, what would make it fit, and the predicted
step time of each layout where the GPU's rates are known (plan/time.py), by which what would fit is ranked.

    trainbox plan moe-gpt2-125m model.moe.num_experts=128 --gpu H100 --nproc 2

One model of a run's memory, used by `trainbox plan`, `trainbox doctor RECIPE` and the pre-flight check of
`trainbox train` (train/memory.py). Per GPU, for a layout (train.parallel ddp or fsdp over --nproc ranks,
model.moe.expert_parallel); on a CPU per process, against its share of the host's available RAM, which the run's
processes on the host share (plan/gpus.py):

    parameters     fp32 master weights (4 bytes each): whole under ddp, 1/N under fsdp; under expert
                   parallelism 1/E of the experts, whole, with either strategy (E ranks hold disjoint experts;
                   FSDP ignores them and shards the rest); frozen weights as built (LoRA bases)
    gradients      fp32, one per trainable parameter held (sharded like the parameters), at the peak only where
                   the step has several micro-batches (the earlier ones' gradients are kept through the last);
                   under fsdp with train.grad_reduce=step and several micro-batches also the whole fp32 gradient
                   of what FSDP shards, which the micro-batches before the last accumulate unreduced
    optimizer      AdamW: two moments, fp32 (8 bytes) or bf16 (4, optim.state_dtype); Muon: one fp32 momentum
                   (4) for the matrices it owns
    activations    plan/activations.py: what the blocks, the head and the loss keep for the backward of one
                   micro-batch (by activation-checkpointing mode, dtype, attention kernel, fused loss), the
                   16-bit weight copies autocast keeps (under expert parallelism the experts' copies made once a
                   step, with either strategy), and the largest transient on top at the peak
    communication  ddp: the gradient buckets (a second fp32 copy of the gradients DDP reduces, DDP's default;
                   under expert parallelism the dense ones only, the experts are outside DDP); fsdp: the
                   bf16 blocks gathered in flight (two, or all of them with train.reshard_after_forward=false;
                   under expert parallelism without their experts, which FSDP does not gather),
                   the root (head, final norm, a tied table; an untied table is a unit apart) gathered with
                   its bf16 gradients through the backward, a block's bf16 gradients and two fp32
                   reduce-scatter inputs; expert parallelism: one layer's
                   all-to-all send and receive buffers (k x tokens rows each way, at the mean routing)
    overhead       outside PyTorch's allocator: the CUDA context (CONTEXT), NCCL's buffers with several
                   ranks (NCCL); and the caching allocator's slack near the GPU's limit (PRESSURE of the peak)
    cache          the allocator's further slack while memory is ample (to FRAGMENTATION of the peak), which it
                   gives back under pressure
    pools          under fsdp, the allocator pool of FSDP's all-gather stream, which the default stream does
                   not reuse while memory is ample: two gathered blocks and the root with the units apart in
                   bf16. The fp32 gradient shards are reduce-scattered into the compute stream's pool
                   (parallel/fsdp.py); where they cannot be (HSDP across nodes, a torch without FSDP's custom
                   reduce-scatter) the reduce-scatter stream's pool holds them too, beyond the peak where one
                   micro-batch a step leaves no gradients there (benchmarks/records/*-table-apart.json). Under
                   pressure the allocator frees the pools and retries

`peak_allocated` (all but the overhead, the pools and the cache) is what `torch.cuda.max_memory_allocated()`
reports during training; `needed` adds the overhead: what the run must have; `total` adds the pools and the
cache: what the GPU holds while memory is ample (`torch.cuda.max_memory_reserved()` with the context and
NCCL's buffers). The prediction aims at 15% of the measured peak (MARGIN): a run is said not to fit when
what it needs exceeds the GPU's memory, and the pre-flight check refuses a run only when even needed x
(1 - MARGIN) exceeds the free memory.
"""
from __future__ import annotations

from dataclasses import replace

from trainbox.config import RunConfig
from trainbox.config.layout import decide_layout
from trainbox.config.load import apply_overrides
from trainbox.errors import ConfigError
from trainbox.model.build import build_tokenizer, model_vocab_size
from trainbox.model.spec import family
from trainbox.objective import memory_terms, objective_class
from trainbox.parallel.fsdp import compute_pool_grads_available
from trainbox.plan.activations import Kernels
from trainbox.plan.count import count_parameters
from trainbox.plan.gpus import GPUS, Target, gpu, local_cpu, local_gpu, sized
from trainbox.plan.memory import (
    BYTES,
    CONTEXT,
    FRAGMENTATION,
    MARGIN,
    MODES,
    NCCL,
    PRESSURE,
    Layout,
    Memory,
    MemoryPlan,
    Suggestion,
    assumed_kernels,
    dtype_bytes,
    memory,
)
from trainbox.plan.suggest import fewer_exchanges, kept_gathered, smaller_state, suggestions
from trainbox.plan.time import StepTime, step_time

__all__ = ["BYTES", "CONTEXT", "FRAGMENTATION", "GPUS", "MARGIN", "MODES", "NCCL", "PRESSURE", "Kernels", "Layout",
           "Memory", "MemoryPlan", "StepTime", "Suggestion", "Target", "assumed_kernels", "dtype_bytes", "gpu",
           "local_cpu", "local_gpu", "make_plan", "memory", "plan_run", "run_vocab", "sized"]


def make_plan(cfg: RunConfig, vocab: int, target: Target, nproc: int = 1, kernels: Kernels | None = None,
              flash: bool = False, suggest: bool = True, dtype: str | None = None,
              side_stream_grads: bool | None = None, local_world: int | None = None) -> MemoryPlan:
    """The plan of `cfg` on `nproc` GPUs of one node like `target`, in the layout decide_layout gives it there
    (its train.micro_batch_size as it is: `trainbox plan --nproc N` applies the one train --nproc N picks first)
    (`kernels`: what runs, else assumed_kernels; `dtype`: bf16, fp16 or fp32 as the run resolved it, else from
    train.dtype and the target; `side_stream_grads`: whether FSDP's gradient shards keep a pool of their own,
    else as this torch does). On a CPU target each process has its share of the host's RAM: it is shared by the
    `local_world` processes of the run on this host (else `nproc`: all on one)."""
    t = cfg.train
    target = target.limited(t.memory_limit_gib).shared(local_world or nproc)
    spec = family(cfg.model.family)
    run = decide_layout(cfg, nproc, "cuda" if target.cuda else "cpu")
    ep = run.expert_parallel
    if side_stream_grads is None:
        side_stream_grads = not compute_pool_grads_available()
    layout = Layout(run.strategy, nproc, ep, t.reshard_after_forward, side_stream_grads, t.grad_reduce)
    counts = count_parameters(cfg, vocab)
    kernels = kernels or assumed_kernels(cfg, target, flash)
    own = getattr(spec.memory(), "checkpointing", None)   # a family that recomputes in its own way (hf)
    mode = own(cfg) if own is not None else t.activation_checkpointing
    dtype = dtype or dtype_bytes(cfg, target)[0]
    mem, acts = memory(cfg, counts, vocab, target, layout, run.micro_batch, mode, kernels, BYTES[dtype])
    compiled = t.compiled(target.cuda)
    sequences = memory_terms(cfg)[0]
    time = step_time(cfg, counts, target, layout, run.micro_batch, mode, sequences)
    plan = MemoryPlan(cfg.recipe, target, layout, run.micro_batch, cfg.data.seq_len, dtype, compiled, mode, kernels,
                counts, mem, acts, drops_unsent=ep > 1 and cfg.model.moe.capacity_factor > 0,
                accumulation=run.accumulation, sequences=sequences, unit=objective_class(cfg).unit, time=time,
                state_dtype=cfg.optim.state_dtype,
                base="nf4" if cfg.quant.load_in_4bit else "int8" if cfg.quant.load_in_8bit else
                "bf16" if family(cfg.model.family).adapters else "fp32",
                staged=mem.params + mem.optimizer if cfg.train.checkpoints and (
                    layout.parallel == "fsdp" or ep > 1) else 0)
    if suggest and not plan.fits:
        plan = replace(plan, suggestions=tuple(suggestions(cfg, vocab, plan)))
    elif suggest and ep > 1:
        plan = replace(plan, fewer_exchanges=fewer_exchanges(cfg, vocab, plan))
    if suggest and plan.fits:
        plan = replace(plan, smaller_state=smaller_state(cfg, vocab, plan),
                       kept_gathered=kept_gathered(cfg, vocab, plan))
    elif suggest and plan.suggestions and plan.suggestions[0].time is not None:
        plan = replace(plan, smaller_state=_smaller_state_of(plan.suggestions[0], cfg, vocab, target, kernels, flash,
                                                            dtype, side_stream_grads))
    return plan


def _smaller_state_of(first: Suggestion, cfg: RunConfig, vocab: int, target: Target, kernels: Kernels | None,
                      flash: bool, dtype: str | None, side_stream_grads: bool | None) -> Suggestion | None:
    """smaller_state of the plan's fastest suggestion, applied: its bf16-moment micro-batch, with its other
    overrides and GPU count (None where it has none)."""
    applied = RunConfig.model_validate(apply_overrides(cfg.model_dump(), list(first.overrides)))
    again = make_plan(applied, vocab, target, first.nproc, kernels, flash, suggest=False, dtype=dtype,
                      side_stream_grads=side_stream_grads)
    hint = smaller_state(applied, vocab, again) if again.fits else None
    if hint is None:
        return None
    keys = {o.split("=", 1)[0] for o in hint.overrides}
    return replace(hint, overrides=(*(o for o in first.overrides if o.split("=", 1)[0] not in keys), *hint.overrides),
                   nproc=first.nproc)


def run_vocab(cfg: RunConfig) -> int:
    """The model's vocabulary: model.vocab_size, else the tokenizer's plus the family's extra ids, padded."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    own = family(cfg.model.family).hook("plan_vocab")   # a family whose vocabulary is its model's own (hf)
    return own(cfg) if own is not None else model_vocab_size(cfg.model, build_tokenizer(cfg).vocab_size)


def plan_target(cfg: RunConfig, gpu_name: str | None = None, gpu_mem: float | None = None) -> Target:
    """The device to plan for: a GPU named (--gpu), one of gpu_mem GiB (--gpu-mem), else the one the run would
    train on here: this machine's GPU, or its CPU where train.device says so or there is no GPU."""
    if gpu_name and gpu_mem:
        raise ConfigError("--gpu and --gpu-mem both name the GPU to plan for: give one of them")
    if gpu_name:
        return gpu(gpu_name)
    if gpu_mem:
        return sized(gpu_mem)
    device = cfg.train.device
    found = local_gpu() if device != "cpu" else None
    if found is not None:
        return found
    if device.startswith("cuda") or (cfg.requires_gpu and device == "auto"):
        name = cfg.recipe or "CONFIG"
        raise ConfigError(f"{name} trains on a GPU and this machine has none: say which GPU to plan for",
                          hint=f"trainbox plan {name} --gpu H100 (or --gpu-mem 80); {', '.join(GPUS)} are known; "
                               "train.device=cpu plans it on this CPU")
    return local_cpu()


def plan_run(cfg: RunConfig, nproc: int = 1, gpu_name: str | None = None, gpu_mem: float | None = None,
             flash: bool = False) -> MemoryPlan:
    """The plan `trainbox plan` prints: `cfg` on `nproc` GPUs of plan_target's kind (`flash`: assume
    trainbox[flash] on a named GPU)."""
    return make_plan(cfg, run_vocab(cfg), plan_target(cfg, gpu_name, gpu_mem), nproc, flash=flash)
