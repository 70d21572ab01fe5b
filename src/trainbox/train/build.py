"""Building a run from the config and layout its pre-flight checks gave (train/preflight.py): the data side
(tokenizer, datasets, batch order, length) and the model side (model, kernel choice, activation checkpointing,
optimizers, DDP, torch.compile). train/loop.py calls these in that order, with the resume checks between them
(train/resume.py), so a run that cannot resume fails before any model is built."""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass

import torch
import torch._functorch.config as functorch_config
import torch.nn as nn

from trainbox.config import RunConfig
from trainbox.config.layout import RunLayout
from trainbox.data.loader import BatchOrder
from trainbox.errors import DataError
from trainbox.kernels import float8
from trainbox.kernels.choice import KernelChoice, choose
from trainbox.model.build import build_model, build_tokenizer, context_length, packs_examples
from trainbox.model.load import load_init_weights
from trainbox.model.spec import family
from trainbox.objective import Objective, build_objective
from trainbox.optim.build import build_optimizers
from trainbox.parallel import expert
from trainbox.parallel.ddp import DataParallel
from trainbox.parallel.distributed import Dist
from trainbox.parallel.fsdp import ShardedParallel
from trainbox.plan import run_vocab
from trainbox.train.recompute import apply_activation_checkpointing

log = logging.getLogger("trainbox")  # the library logger


def plan_length(cfg: RunConfig, batches: BatchOrder) -> int:
    """Total optimizer steps from train.max_steps, train.max_tokens or train.epochs (default 1 epoch)."""
    t = cfg.train
    tokens_per_step = t.global_batch_size * cfg.data.seq_len
    if t.max_steps is not None:
        return t.max_steps
    if t.max_tokens is not None:
        return max(1, t.max_tokens // tokens_per_step)
    return max(1, int(math.ceil((t.epochs or 1.0) * batches.steps_per_epoch)))


@dataclass
class RunData:
    cfg: RunConfig          # resolved: model.eot_id from the tokenizer where the family reads it and it is open
    tokenizer: object
    vocab: int              # the model's vocabulary (plan.run_vocab: hf's own, else the tokenizer's and the extras)
    train: object
    val: object | None
    batches: BatchOrder
    total: int


def build_data(cfg: RunConfig, layout: RunLayout, dist: Dist, objective: Objective | None = None) -> RunData:
    """`cfg` as the pre-flight checks resolved it (the family's resolution included), `layout` theirs; the datasets
    are the ones `objective` trains on (default: that of train.objective)."""
    tokenizer = build_tokenizer(cfg)
    if cfg.model.eot_id is None and family(cfg.model.family).supports("eot_id"):   # documents split at EOT
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"eot_id": tokenizer.eot_id})})
    vocab = run_vocab(cfg)   # a Hugging Face model's own (hf), which another data.tokenizer's ids may exceed
    objective = objective or build_objective(cfg)
    train, val = objective.open_datasets(cfg, tokenizer, vocab)
    batches = BatchOrder(train, layout.global_batch, layout.micro_batch, layout.world, dist.rank, cfg.run.seed,
                         objective.repeats(cfg))
    batches.check_nonempty()
    check_validation(val)   # evaluation runs at the end of every run that has validation data
    if val is None:
        log.warning(f"data: no validation data in data.path={cfg.data.path}: the run reports no validation loss; "
                    "give it some with data.val_path (token files, or text / JSONL tokenized as data.path is)")
    return RunData(cfg, tokenizer, vocab, train, val, batches, plan_length(cfg, batches))


def check_validation(val) -> None:
    """Refuse validation data without one complete sample at data.seq_len now, not after training."""
    if val is None or getattr(val, "num_samples", 1) > 0:
        return
    longest = max((len(a) for a in val.arrays), default=0)
    raise DataError(f"{val.name}: the validation data holds {val.num_tokens:,} tokens (the longest file "
                    f"{longest:,}), fewer than one sample of data.seq_len={val.seq_len} (+1) tokens, so the run "
                    "could not be evaluated",
                    hint=(f"lower data.seq_len (at most {longest - 1} here), or " if longest > 8 else "")
                    + "give more validation data (data.val_path, or a larger input to prepare)")


@dataclass
class RunModel:
    model: nn.Module
    kernels: KernelChoice
    optimizers: list
    parallel: object        # DataParallel (parallel/ddp.py) or ShardedParallel (parallel/fsdp.py)
    reference: nn.Module | None = None   # a frozen copy of the initial model (the preference objective's reference)
    init_source: str | None = None       # what run.init_from's weights were read from (load_init_weights)


def build_model_side(cfg: RunConfig, layout: RunLayout, vocab: int, device: torch.device, dist: Dist,
                     init_weights: bool, dtype: torch.dtype = torch.float32, reference: bool = False) -> RunModel:
    """The same initial weights on every rank (seeded before building); `init_weights`: load run.init_from.
    Spread over the ranks as `layout` says. Under fsdp the model is sharded before the optimizers are built, so
    their state is sharded too. Under fsdp or expert parallelism on a GPU it is built there: its random
    initialisation on the CPU takes minutes at billions of parameters, one thread a process under torchrun. The
    GPU's generator gives other, equally distributed, initial weights than the CPU's, the same on every rank.
    `reference`: keep a frozen copy of the initial model beside it (`frozen_copy`)."""
    torch.manual_seed(cfg.run.seed)
    sharded = layout.sharded   # (a sharded checkpoint of a larger world resumes unsharded)
    if cfg.train.parallel == "fsdp" and not sharded:
        log.warning("train.parallel=fsdp on one process shards nothing: the model runs whole, as under ddp "
                    "(launch several with trainbox train --nproc N)")
    split = sharded or layout.expert_parallel > 1
    on = device if split and device.type == "cuda" else torch.device("cpu")
    with on:
        model = build_model(cfg.model, vocab, context_length(cfg), run=cfg)
    source = load_init_weights(cfg.run.init_from, model, cfg.model) if init_weights and cfg.run.init_from else None
    if layout.expert_parallel > 1:
        expert.shard_experts(model, layout, cfg.model.moe.num_experts, dist, device)   # this rank's experts, DDP told
    model = model.to(device)
    if layout.expert_parallel > 1:
        expert.keep_casts(model, dtype)   # the experts' 16-bit copies, made once per step
    # as the models ask when they meet the device (the packed-row kernel: when they meet packed rows)
    kernels = choose(cfg.model, device, family(cfg.model.family), packed=packs_examples(cfg))
    frozen = frozen_copy(model, dtype) if reference else None
    if cfg.train.float8:
        float8.convert(model, fsdp=sharded)
    if cfg.train.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        allow_cached_autograd_functions()
    if sharded:
        parallel = ShardedParallel(model, dist, device, dtype, cfg.train.reshard_after_forward, cfg.train.compile,
                                   float8=cfg.train.float8, grad_reduce=cfg.train.grad_reduce)
        if frozen is not None:   # sharded like the policy: each block gathered for its forward, then freed
            ShardedParallel(frozen, dist, device, dtype, reshard_after_forward=True, compile=False)
    else:
        parallel = DataParallel(model, dist, device)
        if cfg.train.compile:
            parallel.compile(cuda_graphs=cfg.train.cuda_graphs)
    if cfg.train.compile and getattr(model, "recompute_custom_ops", False):
        parallel.forward = recomputing_custom_ops(parallel.forward)
    optimizers = build_optimizers(model, cfg.optim, device)
    if keeps_gradients(cfg, layout.accumulation):
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    return RunModel(model, kernels, optimizers, parallel, frozen, source)


def keeps_gradients(cfg: RunConfig, accumulation: int) -> bool:
    """Whether the gradients stay allocated between steps (built as zeros, zeroed after each step): under
    train.cuda_graphs with `accumulation` > 1 micro-batches a step, which accumulate into them. Else the first
    backward's gradients would be the graph's own buffers, which the next micro-batch's replay overwrites; with one
    micro-batch the optimizer reads them before the next replay."""
    return bool(cfg.train.cuda_graphs) and accumulation > 1


def frozen_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` that never trains: eval mode, no gradients, parameters in the autocast dtype `dtype` (the
    buffers, such as rotary tables, as they are). Under expert parallelism it holds the same experts' shard as the
    model, in an ExpertShard of its own over the same process groups (which are shared, not copied)."""
    shard = expert.shard_of(model)
    shared = {id(x): x for x in (shard.group, shard.replicas, shard.mesh)} if shard is not None else {}
    ref = copy.deepcopy(model, shared).requires_grad_(False).eval()
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    return ref


def recomputing_custom_ops(forward):
    """`forward`, run with torch's partitioner allowed to recompute in the backward any op that is not random or a
    matmul, custom ops included (by default only ops on its allow-list), so the graphs compiled during its calls are
    partitioned that way. Scoped to the run's forward: the process's other compiled code keeps torch's default.

    A model asks for it (`recompute_custom_ops`) when its layers run custom ops that gradient checkpointing must
    recompute: QLoRA's 4-bit matmuls (bitsandbytes' gemm_4bit). Banned from recompute, their outputs were saved for
    the backward in every checkpointed layer. A 0.5B model on an H200: peak 6.80 GiB banned, 2.48 GiB allowed (the
    Trainer's: 4.25), at 0.83x the tokens/s, the price of the recomputation that checkpointing asks for
    (benchmarks/records/2026-11-29-h200-lora-0.5b-speed{,-2}.json)."""
    def run(*args, **kwargs):
        with functorch_config.patch(ban_recompute_not_in_allowlist=False):
            return forward(*args, **kwargs)
    return run


def allow_cached_autograd_functions() -> None:
    """Let AOTAutograd's cache keep graphs that hold our torch.autograd.Functions (the fused loss, the FP8
    linear). By default it bypasses them, so every start traced and partitioned the model again (see
    docs/performance.md, compile cache). The Functions' forward and backward are traced into the cached
    graph, so a change to them changes its key."""
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):  # torch 2.7+
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
