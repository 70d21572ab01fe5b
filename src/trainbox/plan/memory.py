"""The bytes per GPU of one layout of a run, by component (the components are in plan/__init__.py's docstring), and
the plan's types: Layout, Memory, Suggestion and MemoryPlan."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from trainbox.config import RunConfig
from trainbox.kernels.choice import attention_on, choose
from trainbox.model.memory import WHOLE_SHARE
from trainbox.model.spec import family
from trainbox.objective import memory_terms, rollout_terms
from trainbox.plan.activations import Activations, Kernels, Widths, family_activations, weight_copy_bytes
from trainbox.plan.count import ParamCount
from trainbox.plan.gpus import GiB, Target
from trainbox.plan.time import StepTime

MARGIN = 0.15
CONTEXT = int(0.5 * GiB)       # CUDA context, cuBLAS and cuDNN workspaces
NCCL = int(0.5 * GiB)          # NCCL's own buffers with several ranks
FRAGMENTATION = 0.08           # allocator slack while memory is ample: reserved beyond allocated at the peak
# the slack a run needs near the GPU's limit, where the allocator frees its cache and retries before it fails: every
# record run under a memory cap near its peak reserved 0.1% to 3.3% beyond what it allocated (the *-h100mem records)
PRESSURE = 0.035
MODES = ("none", "experts", "selective", "full")
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}



@dataclass(frozen=True)
class Layout:
    """What the memory model needs of a run's layout (config/layout.py's RunLayout) and of how FSDP runs it."""
    parallel: str = "ddp"              # ddp or fsdp
    nproc: int = 1
    expert_parallel: int = 1
    reshard_after_forward: bool = True
    side_stream_grads: bool = False    # fsdp: gradient shards in the reduce-scatter stream's own pool (HSDP, old torch)
    grad_reduce: str = "micro_batch"   # fsdp: gradients reduce-scattered every micro-batch, or once a step ("step")


@dataclass(frozen=True)
class Memory:
    """Bytes on one GPU."""
    params: int
    gradients: int
    optimizer: int
    activations: int
    comm: int
    overhead: int
    pools: int = 0      # FSDP's side-stream pools: held while memory is ample, given back under pressure
    cache: int = 0      # the allocator's slack beyond PRESSURE while memory is ample, given back under pressure
    reference: int = 0  # a frozen copy of the initial model beside it (the preference objective's reference)
    sampling: int = 0   # what sampling before a step (grpo) holds beyond the step's own peak
    kv_cache: int = 0   # of it: the sampling's KV caches (shown, already in `sampling`)
    sampling_copy: int = 0   # and the copy of the weights it samples through (grpo.sampling_copy; shown)

    @property
    def peak_allocated(self) -> int:
        return self.params + self.gradients + self.optimizer + self.activations + self.comm + self.reference \
            + self.sampling

    @property
    def needed(self) -> int:
        """What the run must have: the fit verdict, the suggestions and the pre-flight check hold this."""
        return self.peak_allocated + self.overhead

    @property
    def total(self) -> int:
        """What the GPU holds while memory is ample: max_memory_reserved() with the context and NCCL."""
        return self.needed + self.pools + self.cache

    def as_dict(self) -> dict:
        return {**asdict(self), "peak_allocated": self.peak_allocated, "needed": self.needed, "total": self.total}


@dataclass(frozen=True)
class Suggestion:
    """A change under which the run fits: config overrides, the number of GPUs, what it needs per GPU and its
    predicted step time (None where the GPU has no rates)."""
    what: str
    overrides: tuple[str, ...]
    nproc: int
    needed: int
    time: StepTime | None = None

    def command(self, recipe: str | None, overrides: list[str] | tuple[str, ...] = ()) -> str:
        """`trainbox train` with the run's own overrides, those of the same keys replaced by this change's."""
        mine = {o.split("=", 1)[0] for o in self.overrides}
        words = [recipe or "CONFIG", *(o for o in overrides if o.split("=", 1)[0] not in mine), *self.overrides]
        nproc = ["--nproc", str(self.nproc)] if self.nproc > 1 else []
        return " ".join(["trainbox", "train", *words, *nproc])


@dataclass(frozen=True)
class MemoryPlan:
    recipe: str | None
    target: Target
    layout: Layout
    micro_batch: int
    seq_len: int
    dtype: str
    compiled: bool
    checkpointing: str
    kernels: Kernels
    counts: ParamCount
    memory: Memory
    activations: Activations
    suggestions: tuple[Suggestion, ...] = field(default=())
    drops_unsent: bool = False   # expert parallelism with a capacity: dropped assignments are not sent
    # expert parallelism with several micro-batches a step: the largest micro-batch that fits, which cuts the
    # all-to-all exchanges and host reads of a step (one of each per MoE layer and micro-batch)
    fewer_exchanges: Suggestion | None = None
    # a plan that fits with AdamW's fp32 moments: the larger, faster micro-batch bf16 moments would fit (a hint)
    smaller_state: Suggestion | None = None
    # a plan under fsdp that fits with its blocks resharded after the forward: the same with them kept gathered, where
    # that fits and is predicted markedly faster (a hint)
    kept_gathered: Suggestion | None = None
    accumulation: int = 1   # micro-batches a step on each rank
    sequences: int = 1      # sequences a sample puts through the model (train.objective=dpo: a pair, two)
    unit: str = "sequences"   # what a sample is (pairs, prompts), as the report names a micro-batch's
    time: StepTime | None = None   # the predicted step time (plan/time.py); None where the GPU has no rates
    state_dtype: str = "fp32"   # optim.state_dtype: AdamW's moments
    base: str = "bf16"          # frozen weights: a LoRA base's linear layers in bf16, nf4 or int8 (quant.load_in_4bit
                                # / 8bit); fp32 where the family has no adapters (a reward model's token head)
    # host memory per GPU that sharded async checkpoints stage into (pinned on a GPU, parallel/dcp.py): its
    # parameters and optimizer state; 0 where checkpoints are single files (one process, ddp) or off
    staged: int = 0

    @property
    def fits(self) -> bool:
        return self.memory.needed <= self.target.memory

    def as_dict(self) -> dict:
        return {"recipe": self.recipe, "gpu": {"name": self.target.name, "memory": self.target.memory,
                                               "local": self.target.local,
                                               "rates": asdict(self.target.rates) if self.target.rates else None},
                "layout": asdict(self.layout), "micro_batch": self.micro_batch, "seq_len": self.seq_len,
                "dtype": self.dtype, "compiled": self.compiled, "activation_checkpointing": self.checkpointing,
                "kernels": asdict(self.kernels), "parameters": self.counts.as_dict(),
                "memory": self.memory.as_dict(), "activations": self.activations.as_dict(),
                "fits": self.fits, "margin": MARGIN,
                "accumulation": self.accumulation, "sequences": self.sequences,
                "time": self.time.as_dict() if self.time else None,
                "suggestions": [asdict(s) for s in self.suggestions],
                "fewer_exchanges": asdict(self.fewer_exchanges) if self.fewer_exchanges else None,
                "smaller_state": asdict(self.smaller_state) if self.smaller_state else None,
                "kept_gathered": asdict(self.kept_gathered) if self.kept_gathered else None,
                "staged_host_bytes": self.staged}


# ----------------------------------------------------------------------------- kernels and widths


def assumed_kernels(cfg: RunConfig, target: Target, flash: bool) -> Kernels:
    """The kernels a run would get on `target`: asked of kernels.choice on this machine's own device, else
    assumed from the GPU's generation (`flash`: trainbox[flash] is installed there)."""

    m, spec = cfg.model, family(cfg.model.family)
    if target.local:
        plan = choose(m, torch.device("cuda" if target.cuda else "cpu"), spec)
        return Kernels(plan.attention, plan.fused_loss, plan.fused_mlp, plan.fp8)
    fl = flash and target.hopper
    attention = attention_on(spec, m, flash=fl, flex=True)   # FlexAttention runs on every GPU of the table
    loss = "off" if not m.fused_loss else ("quack" if flash and target.lce else "triton")
    mlp = "off" if not m.fused_mlp else ("quack" if fl else "unfused")
    fp8 = "off" if not m.fp8_options else ("fp8" if target.fp8 else "bf16")
    return Kernels(attention, loss, mlp, fp8)


def dtype_bytes(cfg: RunConfig, target: Target) -> tuple[str, int]:
    want = cfg.train.dtype
    if not target.cuda:
        return "fp32", 4
    if want == "auto":
        want = "bf16"
    return want, BYTES[want]


# ----------------------------------------------------------------------------- memory of one layout


def memory(cfg: RunConfig, counts: ParamCount, vocab: int, target: Target, layout: Layout, micro: int, mode: str,
           kernels: Kernels, a: int) -> tuple[Memory, Activations]:
    """Bytes on one GPU of `layout`, at micro-batch `micro`, checkpointing `mode`, `a`-byte matmul operands. The
    objective decides how many sequences a sample puts through the model (a preference pair: two) and whether a
    frozen copy of the model runs beside it (`memory_terms`: its parameters in the autocast dtype, spread like the
    model's: sharded under fsdp, its experts this rank's shard under expert parallelism; a precomputed reference
    and LoRA's base with its adapters off cost nothing)."""
    m, world, ep = cfg.model, layout.nproc, layout.expert_parallel
    sequences, copy = memory_terms(cfg)
    rows = micro * sequences
    fsdp = layout.parallel == "fsdp"
    spec = family(m.family)
    lowp = m.lowp_residual if m.lowp_residual is not None else spec.lowp_residual
    if cfg.quant.quantized:   # prepare_model_for_kbit_training's fp32 norms carry an fp32 residual stream
        lowp = False
    r = a if (fsdp or lowp) else 4
    widths = Widths(a=a, r=r, cuda=target.cuda, compiled=cfg.train.compiled(target.cuda),
                    expert_parallel=ep,
                    head_limit=target.memory // WHOLE_SHARE)
    held = counts.dense + counts.expert / ep                    # trainable parameters a rank computes with
    shard = world if fsdp else 1
    # ... and keeps: fsdp shards what it manages over all ranks (every trainable parameter, or under expert
    # parallelism the dense ones: it ignores the experts, whose shard a rank keeps whole as under ddp)
    managed = counts.trainable if ep == 1 else counts.dense
    sharded = managed / world if fsdp else 0
    local = sharded + (counts.expert / ep if ep > 1 else 0) if fsdp else held
    muon = counts.muon * local / max(1, counts.trainable)
    acts = family_activations(cfg, counts, vocab, rows, mode, widths, kernels, autocast_copies=not fsdp)
    # FSDP's 16-bit weights are the gathered ones (communication); autocast's copies are there outside fsdp
    copies = 0 if fsdp else weight_copy_bytes(counts, widths, mode)
    if copies and ep > 1 and mode == "none":   # the experts' casts: the copies below instead
        copies -= int(counts.expert * a)
    # under expert parallelism the experts' 16-bit copies live through the step (expert.keep_casts), a rank's shard
    # of them, in every mode
    if ep > 1 and a < 4:
        copies += int(counts.expert / ep * a)
    acts = replace(acts, weight_copies=copies)
    comm = 0.0
    if world > 1 and not fsdp:   # DDP's gradient buckets: the dense parameters only under expert parallelism
        comm += 4 * (counts.dense if ep > 1 else held)
    if fsdp:
        # one block as FSDP gathers it: under expert parallelism without its experts, which FSDP ignores
        unit = counts.largest_block - (counts.expert / max(1, counts.n_blocks) if ep > 1 else 0)
        # bf16 weights gathered: two blocks in flight (or all of them) and the root, which stays gathered with its
        # bf16 gradients through the backward; a block's bf16 gradients and two fp32 reduce-scatter inputs
        gathered = 2 * (2 * unit + counts.root) if layout.reshard_after_forward else 2 * managed
        comm += gathered + 2 * counts.root + (2 + 2 * 4) * unit
    if ep > 1 and spec.experts:
        comm += 4 * m.moe.top_k * rows * cfg.data.seq_len * m.n_embd * a   # dispatch and combine, both ways
    # frozen bases: bf16 on a GPU; 4/8-bit loading quantizes the linear layers (NF4: 4.5 bits with its scales) and
    # PEFT's prepare_model_for_kbit_training casts the rest (embeddings, norms, the head) to fp32. A family without
    # adapters keeps its frozen weights (a reward model's token head) in fp32 as the rest
    frozen = (counts.frozen_linear * (0.5625 if cfg.quant.load_in_4bit else 1)
              + 4 * (counts.frozen - counts.frozen_linear)) if cfg.quant.quantized else \
        counts.frozen * (a if spec.adapters else 4)
    params = 4 * local + frozen / shard
    overhead = pools = cache = 0
    # the peak is at the start of the last micro-batch's backward: gradients are there only where earlier
    # micro-batches of the step left them (the loop sets them to None after each step), or where the
    # activations are smaller than they are (then the end of the backward is the peak)
    accum = -(-cfg.train.global_batch_size // (micro * world))
    grads = 4 * local if accum > 1 or acts.peak < 4 * local else 0
    if fsdp and accum > 1 and layout.grad_reduce == "step":   # the whole fp32 gradient of what FSDP shards, kept
        grads += 4 * managed                                   # until the last micro-batch reduces it
    # the frozen copy is spread like the model: under expert parallelism its experts are this rank's shard, whole
    whole = counts.total - counts.expert if ep > 1 else counts.total
    reference = a * (whole / shard + (counts.expert / ep if ep > 1 else 0)) if copy else 0
    # AdamW's two moments, 4 or 2 bytes each (optim.state_dtype); Muon's one fp32 momentum
    optimizer = 4 * muon + (4 if cfg.optim.state_dtype == "bf16" else 8) * (local - muon)
    peak = params + grads + optimizer + acts.peak + comm + reference
    kept = 4 * local if cfg.train.cuda_graphs and accum > 1 else 0   # train/build.py keeps_gradients
    kv, weights, sampling = _sampling(cfg, counts, vocab, world, a, fsdp, kept)
    if sampling:   # the weights, the optimizer state and the reference stay; the step's gradients are gone
        sampling = max(0.0, params + optimizer + reference + sampling - peak)
        peak += sampling
    if target.cuda:
        overhead = CONTEXT + (NCCL if world > 1 else 0) + PRESSURE * peak
        cache = (FRAGMENTATION - PRESSURE) * peak
        if fsdp:
            pools = (4 * sharded if layout.side_stream_grads and not grads else 0) \
                + 2 * (2 * unit + counts.root + counts.apart)
    mem = Memory(params=int(params), gradients=int(grads), optimizer=int(optimizer),
                 activations=acts.peak, comm=int(comm), overhead=int(overhead), pools=int(pools), cache=int(cache),
                 reference=int(reference), sampling=int(sampling), kv_cache=int(kv),
                 sampling_copy=int(weights))
    return mem, acts


def _sampling(cfg: RunConfig, counts: ParamCount, vocab: int, world: int, a: int, fsdp: bool,
              kept_grads: float) -> tuple[float, float, float]:
    """(KV caches, the weights' copy, all) bytes that sampling before a step holds beside the weights, the optimizer
    state and the reference (Objective.rollout_shape; 0 where the objective samples nothing): each row's keys and
    values at every block for the caches' positions in the autocast dtype, the prefill's largest transients (a
    block's input and residual, q, k, v and the attention's output, the MLP's hidden widths) over the prompts, the
    draw's fp32 logits (three: the logits, the filtered and the probabilities), the gradients where
    train.cuda_graphs keeps them,
    under fsdp every unit gathered (the whole model in the autocast dtype: `whole()`), and the copy of the linear
    layers' weights it samples through (grpo.sampling_copy: a LoRA base's layers merged, and a 4- or 8-bit base's
    fp32 head; fp32 weights trained under autocast cast, which fsdp's gathered ones are already)."""
    shape = rollout_terms(cfg, world)
    s = counts.shapes
    if shape is None or s is None:
        return 0.0, 0.0, 0.0
    rows, prompt, positions, copies = shape
    kv = rows * positions * counts.n_blocks * 2 * s.kv * a
    prefill = rows * prompt * (2 * s.d + 2 * s.q + 2 * s.kv + (3 if s.gated else 2) * s.ffn) * a
    draw = 3 * 4 * rows * vocab
    gathered = a * counts.total if fsdp else 0
    weights = 0
    if copies and counts.frozen_linear:
        weights = a * (counts.frozen_linear + (vocab * s.d if cfg.quant.quantized else 0))
    elif copies and a < 4 and not fsdp:
        weights = a * counts.matmul
    return kv, weights, kv + prefill + draw + kept_grads + gathered + weights


# ----------------------------------------------------------------------------- the plan
