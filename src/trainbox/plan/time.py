"""The step time of a layout: compute at the GPU's matmul rate, exchanges at its links' bandwidth, the host reads of
expert parallelism, and the optimizer at its memory bandwidth (plan/gpus.py's `Rates`).

    trainbox plan moe-gpt2-125m model.moe.num_experts=128 --gpu H100 --nproc 2

Per rank, for a step of `accumulation` micro-batches of `micro` sequences:

    compute     the model's FLOPs per token (its flops_per_token) x the micro-batch's tokens, the dense part at
                rate x DENSE (x the family's SPEED, where its memory module gives one: t5) and the experts'
                grouped matmuls (6 x top_k x an expert's parameters per MoE layer)
                at rate x EXPERTS; full activation checkpointing runs the blocks' forward twice; train.float8
                runs the blocks' linears FLOAT8 times faster
    ddp         the fp32 gradients all-reduced once a step (the dense ones under expert parallelism), 2(n-1)/n of
                their bytes at all_reduce x COLLECTIVES; DDP overlaps it with the last micro-batch's backward,
                all but the last bucket
    fsdp        per micro-batch: the bf16 parameters all-gathered for the forward and again for the backward
                (once with train.reshard_after_forward=false) and the fp32 gradients reduce-scattered, (n-1)/n of
                their bytes at all_reduce x COLLECTIVES, overlapped with the micro-batch's compute; the first
                block's gather is not
    experts     expert parallelism, per MoE layer per micro-batch: the routed rows (tokens x top_k x n_embd, bf16)
                dispatched and combined in the forward and both again in the backward, (E-1)/E of them crossing
                at all_to_all x EXCHANGES, not overlapped; one host read of the split sizes (host_sync each), after
                which the host launches the layer's work: a micro-batch takes at least HOST per MoE layer, the
                host's time to run the layer's forward and backward
    optimizer   OPTIMIZER_BYTES per parameter a rank updates, at its memory bandwidth

    step = accumulation x (micro-batch) + ddp's exposed all-reduce + optimizer

The plan counts every routed assignment; with a capacity, expert parallelism computes and sends only the kept
ones, so a run whose router drops assignments takes less. tests/test_plan_time.py holds the prediction to within
TOLERANCE of every step time in benchmarks/records/ whose configuration the plan rebuilds, and the calibration
constants below to the records they come from.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from trainbox.config import RunConfig
from trainbox.model.spec import family
from trainbox.plan.count import ParamCount
from trainbox.plan.gpus import Target

TOLERANCE = 0.25

# Calibration, each against benchmarks/records/ (tests/test_plan_time.py fits them again and compares):
# the share of the matmul rate a compiled model's dense FLOPs reach (attention, norms and loss included):
# gpt2-125m, llama-1b, llama-8b and speedrun-124m steps on H100s and H200s
DENSE = 0.66
# the share the experts' grouped matmuls reach, with their dispatch, sort and combine: the 8-expert MoE on one
# H100 and one H200 (2026-11-27-h100-moe-gpt2-125m-*.json, 2026-11-28-h200-moe-gpt2-125m-1gpu-baseline.json)
EXPERTS = 0.50
# train.float8 (torchao's Float8Linear) on the blocks' linears: llama-8b on 4 H200s in float8 against bf16
FLOAT8 = 1.3
# the share of the all-reduce bus bandwidth FSDP's and DDP's collectives reach beside the compute: llama-1b under
# fsdp on 2 H200s moved 4.96 GB a step in 40.3 ms of NCCL kernels (2026-11-27-2xh200-llama-1b-fsdp-2gpu-profile)
COLLECTIVES = 0.31
# the share of the all-to-all bus bandwidth the expert exchanges reach: the 128-expert MoE at expert parallelism 2,
# one micro-batch of 48, 26.0 ms of NCCL kernels a step (2026-11-27-2xh200-moe-gpt2-125m-128x-ep2-profile.json)
EXCHANGES = 0.46
# seconds of host work per MoE layer and micro-batch under expert parallelism (its forward and backward), which
# the GPU cannot run ahead of: the 128-expert MoE at expert parallelism 2, micro-batch 16, 15 micro-batches a step
# (2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-2gpu-vs-de3474f.json: 1,970 ms)
HOST = 10.5e-3
# bytes a fused AdamW step reads and writes per parameter: parameter, gradient and two moments read (16), the
# parameter and moments written (12), the gradient read again by the norm clip (4)
OPTIMIZER_BYTES = 32
DDP_BUCKET = 25 * 2**20   # DDP's bucket: the last one is reduced after the backward


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step on each rank, by part (what the parts are: this module's docstring)."""
    step: float
    compute: float       # the step's compute, every micro-batch
    exchanges: float     # communication not hidden behind compute (ddp, fsdp, expert all-to-all)
    host: float          # expert parallelism: host reads, and time the GPU waits on the host
    optimizer: float
    tokens_per_s_per_gpu: float

    def as_dict(self) -> dict:
        return asdict(self)


def moe_layers(cfg: RunConfig) -> int:
    """MoE layers of the model: every model.moe.every-th block of a family with experts, else none."""
    if not family(cfg.model.family).experts:
        return 0
    return len(range(0, cfg.model.n_layer, cfg.model.moe.every))


def step_time(cfg: RunConfig, counts: ParamCount, target: Target, layout, micro: int, checkpointing: str,
              sequences: int = 1) -> StepTime | None:
    """The step time of `cfg` in `layout` (plan/memory.py's Layout) on GPUs like `target`, at micro-batch `micro`
    with `sequences` sequences a sample; None where the target has no rates (a CPU, a GPU kind without an entry in
    plan/gpus.py's RATES) or the model has no FLOP count."""
    rates = target.rates
    if rates is None or not target.cuda or not counts.flops_per_token:
        return None
    m, seq, ep = cfg.model, cfg.data.seq_len, layout.expert_parallel
    parallel, nproc, reshard_after_forward = layout.parallel, layout.nproc, layout.reshard_after_forward
    accumulation = max(1, cfg.train.global_batch_size // (micro * nproc))
    n_moe = moe_layers(cfg)
    tokens = micro * seq * sequences                    # one micro-batch on one rank
    expert_flops = 6 * counts.expert * m.moe.top_k / m.moe.num_experts if n_moe else 0.0
    dense_flops = counts.flops_per_token - expert_flops
    if checkpointing == "full":   # the blocks' forward again in the backward: a third of their FLOPs
        dense_flops *= 1 + counts.blocks_matmul / max(1, counts.matmul) / 3
        expert_flops *= 4 / 3
    # a family whose FLOPs run slower than a GPT's says by how much (its memory module's SPEED: t5)
    speed = getattr(family(m.family).memory(), "SPEED", 1.0)
    dense_rate = speed * rates.matmul * DENSE * (1 + (FLOAT8 - 1) * counts.blocks_matmul / max(1, counts.matmul)
                                         if cfg.train.float8 else 1)
    compute = tokens * (dense_flops / dense_rate + expert_flops / (rates.matmul * EXPERTS))

    link = rates.all_reduce * COLLECTIVES
    micro_s, host = compute, 0.0
    if parallel == "fsdp" and nproc > 1:
        gathers = 2 if reshard_after_forward else 1
        moved = (2 * gathers + 4) * counts.total * (nproc - 1) / nproc
        first = 2 * (counts.largest_block + counts.root) * (nproc - 1) / nproc / link
        micro_s = max(compute, moved / link) + first
    if ep > 1 and n_moe:
        rows = tokens * m.moe.top_k
        exchange = 4 * n_moe * rows * m.n_embd * 2 * (ep - 1) / ep / (rates.all_to_all * EXCHANGES)
        waits = n_moe * rates.host_sync
        micro_s = max(compute + exchange, n_moe * HOST) + waits
        host = micro_s - compute - exchange
    exposed = 0.0
    if parallel == "ddp" and nproc > 1:
        grads = 4 * (counts.dense if ep > 1 else counts.trainable)
        all_reduce = grads * 2 * (nproc - 1) / nproc / link
        last = min(DDP_BUCKET, grads) * 2 * (nproc - 1) / nproc / link
        exposed = max(all_reduce - 2 / 3 * compute, last)
    updated = counts.trainable / nproc if parallel == "fsdp" else counts.dense + counts.expert / ep
    optimizer = OPTIMIZER_BYTES * updated / rates.memory
    step = accumulation * micro_s + exposed + optimizer
    return StepTime(step=step, compute=accumulation * compute,
                    exchanges=accumulation * (micro_s - compute - host) + exposed,
                    host=accumulation * host, optimizer=optimizer,
                    tokens_per_s_per_gpu=accumulation * tokens / step)
