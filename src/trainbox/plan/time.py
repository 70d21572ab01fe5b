"""The step time of a layout: compute at the GPU's matmul rate, exchanges at its links' bandwidth, the host reads of
expert parallelism, and the optimizer at its memory bandwidth (plan/gpus.py's `Rates`).

    trainbox plan moe-gpt2-125m model.moe.num_experts=128 --gpu H100 --nproc 2

Per rank, for a step of `accumulation` micro-batches of `micro` sequences:

    compute     the model's FLOPs per token (its flops_per_token) x the micro-batch's tokens, the dense part at
                rate x DENSE x d / (d + WIDTH) at width d (x the family's speed, where its memory module gives
                one: t5) and the experts' grouped matmuls (6 x top_k x an expert's parameters per MoE layer)
                at rate x EXPERTS; full activation checkpointing runs the blocks' forward twice, experts the
                experts' first grouped matmul (7 grouped matmuls a layer, 6 without it); train.float8
                runs the blocks' linears FLOAT8 times faster
    ddp         the fp32 gradients all-reduced once a step (the dense ones under expert parallelism), 2(n-1)/n of
                their bytes at all_reduce x COLLECTIVES; DDP overlaps it with the last micro-batch's backward,
                all but the last bucket
    fsdp        per micro-batch: the bf16 parameters all-gathered for the forward and again for the backward
                (once with train.reshard_after_forward=false) and the fp32 gradients reduce-scattered (on the
                last micro-batch only with train.grad_reduce=step, the others adding theirs into the whole fp32
                gradient at the memory bandwidth), (n-1)/n of
                their bytes at all_reduce x COLLECTIVES, overlapped with the micro-batch's compute; the first
                block's and the root's gathers are not (an untied head, a unit of its own, is not the root's);
                the copies around them at the memory bandwidth (the gathered weights copied out beside the
                compute, the gradients cast into the reduce-scatter's input before it).
                Under expert parallelism FSDP ignores the experts: all of this counts the other parameters only
                (the first block's gather too)
    experts     expert parallelism, with either strategy, per MoE layer per micro-batch: the routed rows (tokens x
                top_k x n_embd, bf16) dispatched and combined in the forward and both again in the backward, (E-1)/E
                of them crossing at all_to_all x EXCHANGES, not overlapped (after fsdp's micro-batch, where it
                runs); one host read of the split sizes (host_sync each), after which the host launches the
                layer's work: a micro-batch takes at least HOST per MoE layer, the host's time to run the layer's
                forward and backward (GRAPH_HOST where the split sizes stay in the compiled graph: step_time,
                model.moe.split_sizes); with selective or full activation checkpointing the
                recomputed layer reads them again in the backward (RECOMPUTE_HOST each). Under
                model.moe.exchange=padded, capacity_factor times the rows are sent and computed and nothing
                is read back: the host runs ahead of the GPU and sets no floor (the padded step on 2 H200s is
                the GPU's compute and exchanges, 2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-padded-vs-uneven-
                h100mem.json). Under fsdp the uneven exchange also waits on FSDP's hooks: FSDP_HOST per
                FSDP unit (each block and the root) per micro-batch, which the host cannot run ahead of
                (FSDP_GATHERED_HOST with train.reshard_after_forward=false: no gather for the backward, no
                reshard; train.grad_reduce=step takes FSDP_GATHERED_HOST, the reduce-scatters' part, off every
                micro-batch but the last).
                Once a step, after the last backward, each expert shard's fp32 gradients summed over the
                r = n / E ranks that hold it, 2(r-1)/r of their bytes at all_reduce x COLLECTIVES, not
                overlapped (none where n = E)
    weights     at the memory bandwidth, outside fsdp: every micro-batch, autocast's 16-bit copies of the trainable
                matmul weights (4 bytes read, 2 written) and the backward's fp32 gradients of them (2 read, 4
                written); from the second micro-batch on, every gradient added into .grad (8 read, 4 written). Under
                expert parallelism the experts' copies are made once a step and their gradients added by one kernel
                each micro-batch (parallel/expert.py, kernels/accumulate.py: 6 read, 4 written); under fsdp these
                two expert terms are all (FSDP gathers 16-bit weights and casts the gradients it reduce-scatters)
    optimizer   OPTIMIZER_BYTES per parameter a rank updates (ddp: every one it holds; fsdp: its 1/n share of
                what FSDP manages, and its experts under expert parallelism) (with optim.state_dtype=bf16, the
                bytes of kernels/adamw.py's step), at its memory bandwidth

    step = accumulation x (micro-batch) + the exposed all-reduces (ddp's, the expert replicas') + weights + optimizer

The plan counts every routed assignment; with a capacity, expert parallelism's uneven exchange computes and sends
only the kept ones, so a run whose router drops assignments can take less (the 128-expert runs on 4 H200s that
dropped 45% of them: 10-19% less than predicted; one that dropped 28-64% over its first 12 steps, with the split
sizes in the compiled graph: 31% less; the slowest rank, not the mean, sets the step).
tests/test_plan_time.py holds the prediction to within TOLERANCE of every step time in benchmarks/records/ whose
configuration the plan rebuilds, and the calibration constants below to the records they come from. The
links' rates are those measured at the layout's GPU count (plan/gpus.py's `Rates.at`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from trainbox.config import RunConfig
from trainbox.model.spec import family
from trainbox.plan.count import ParamCount
from trainbox.plan.gpus import Target

TOLERANCE = 0.25

# Calibration: shares of plan/gpus.py's rates, each solved again from the records it names by tests/test_plan_time.py
# (which says what each becomes when new rates go into RATES).
# The share of the matmul rate a compiled model's dense FLOPs reach (attention, norms and loss included) at a large
# width; at width d it is DENSE x d / (d + WIDTH): a block's elementwise work (norms, activations, residual adds,
# casts) grows with d per token where its matmuls grow with d^2, so it takes WIDTH / d of the matmuls' time. From
# the gpt2-125m, speedrun-124m and -350m, llama-1b and llama-8b steps on H100s and H200s (768 to 4,096 wide).
DENSE = 0.81
WIDTH = 200
# the share the experts' grouped matmuls reach, with their dispatch, sort and combine: the 8-expert MoE on one
# H100 and one H200 (2026-11-27-h100-moe-gpt2-125m-*.json, *-h200-moe-gpt2-125m-1gpu-baseline.json)
EXPERTS = 0.49
# how much faster train.float8 (torchao's Float8Linear) runs the blocks' linears: llama-8b on 4 H200s and llama-1b
# on 2 (2026-11-28-4xh200-llama-8b-fsdp-4gpu-float8.json, 2026-11-27-2xh200-llama-1b-fsdp-2gpu-float8-200-seed1.json)
FLOAT8 = 1.22
# the share of the all-reduce bus bandwidth FSDP's and DDP's collectives reach beside the compute: the NCCL time a
# step of llama-1b under fsdp on 2 H200s (2026-11-27-2xh200-llama-1b-fsdp-2gpu-profile.json, comm_ms_per_step)
COLLECTIVES = 0.47
# the share of the all-to-all bus bandwidth the expert exchanges reach: the NCCL time a step of the 128-expert MoE
# at expert parallelism 2, one micro-batch of 48 (2026-11-27-2xh200-moe-gpt2-125m-128x-ep2-profile.json)
EXCHANGES = 0.73
# seconds of host work per MoE layer and micro-batch under expert parallelism (its forward and backward), which
# the GPU cannot run ahead of: the 128-expert MoE at expert parallelism 2 under ddp, 15 micro-batches of 16 a step,
# measured 1.58 to 1.97 s a step on three hosts (2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-2gpu-vs-de3474f.json and
# three 2026-11-29-2xh200-moe-gpt2-125m-128x-ep2-*-h100mem.json); the host sets the pace, so the host's speed
# spreads the step. The median of those four gives 8.25 ms; with issue 49's two figures of the same run on H100s
# (95,000 and 128,000 tokens/s per GPU: 11.9 and 8.2 ms) the median of the six is 8.3, and 8.4 keeps the slower
# H100 host within TOLERANCE
HOST = 8.4e-3
# seconds a recomputed MoE layer (train.activation_checkpointing) under the uneven exchange adds per micro-batch:
# its forward runs again in the backward and reads the split sizes again there, so the GPU's queue drains once more
# per layer: the 128-expert MoE at expert parallelism 2, selective, micro-batch 48
# (2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-bf16-mb48-selective-h100mem.json: 1.69x the step without it)
RECOMPUTE_HOST = 15e-3
# seconds of host work per FSDP unit and micro-batch (its hooks around the forward and backward: the gathers and
# their copies, the reshards, the reduce-scatters) that the GPU waits for under fsdp with expert parallelism's uneven
# exchange, whose host reads drain the GPU's queue once per MoE layer: what fsdp adds to ddp's step at the same
# micro-batch, the 128-expert MoE at expert parallelism 2, 13 units, two pairs each run in one call: bf16 moments at
# micro-batch 40, 1016 against 819 ms (2.5 ms), and fp32 moments at 16, 2050 against 1778 ms (1.5 ms)
# (2026-11-29-2xh200-moe-gpt2-125m-128x-ep2-fsdp-vs-ddp-bf16-mb40-h100mem.json and -fsdp-vs-ddp-mb16-h100mem.json)
FSDP_HOST = 2.0e-3
# FSDP_HOST with the blocks kept gathered from forward to backward and between micro-batches
# (train.reshard_after_forward=false): each unit's hooks still run and its gradient is still reduce-scattered every
# micro-batch, but nothing is gathered again for the backward or freed after the forward. Solved from what keeping
# them gathered saved in two pairs of the 128-expert MoE at expert parallelism 2 with fsdp on 2 H200s, each pair on
# one host: fp32 moments at micro-batch 20, 1191 against 1407 ms (0.6 ms), and bf16 moments at 40, 825 against 984 ms
# (0.0 ms: there it saved all of FSDP_HOST); the median of the two
# (2026-11-30-2xh200-moe-gpt2-125m-128x-ep2-fsdp-mb20-gathered-h100mem.json, -fsdp-gathered-bf16-mb40-h100mem.json).
# What is left is the reduce-scatters' part: train.grad_reduce=step, which runs them on the last micro-batch only,
# saved 0.24 and 0.66 ms a unit and micro-batch at micro-batch 20 in two pairs (each order once, one host:
# -fsdp-mb20-gathered-once-h100mem.json, -fsdp-mb20-gathered-vs-once-h100mem.json); with bf16 moments at micro-batch
# 40 the pairs split (-1.0 and -0.4 ms; four single runs +0.4), within that host's spread
FSDP_GATHERED_HOST = 0.3e-3
# seconds of host work per MoE layer and micro-batch with the split sizes in the compiled graph, in place of HOST:
# the host still waits for each read, then runs on through the compiled graph instead of entering Dynamo's next one.
# Solved from the ratio of two runs of the 128-expert MoE at expert parallelism 2 on 2 H200s capped at an H100's
# memory, each pair on one host (the host's speed spreads both halves alike): fsdp at micro-batch 20, 1898 against
# 2286 ms (2026-11-29-2xh200-moe-gpt2-125m-128x-ep2-fsdp-mb20-sizes-in-graph-h100mem.json), 6.3 ms; ddp at 16,
# 1254.5 against 1415.5 ms (measured alike, with no record kept of that pair), 7.2 ms. 6.8 lies between: each ratio
# within 6%, and fsdp at 20 stays ahead of ddp at 16, as the host-read runs measured and both pairs' ratios imply
GRAPH_HOST = 6.8e-3
# bytes a fused AdamW step reads and writes per parameter: parameter, gradient and two moments read (16), the
# parameter and moments written (12), the gradient read again by the norm clip (4)
OPTIMIZER_BYTES = {"fp32": 32, "bf16": 24}   # bf16 moments: 2 bytes each read and written, not 4
DDP_BUCKET = 25 * 2**20   # DDP's bucket: the last one is reduced after the backward


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step on each rank, by part (what the parts are: this module's docstring)."""
    step: float
    compute: float       # the step's compute, every micro-batch
    exchanges: float     # communication not hidden behind compute (ddp, fsdp, expert all-to-all)
    host: float          # expert parallelism: host reads, and time the GPU waits on the host
    optimizer: float
    communication: float   # every exchange's time, hidden or not (what a profile's NCCL kernels add up to)
    weights: float         # the weight casts and gradient additions of every micro-batch (outside fsdp)
    tokens_per_s_per_gpu: float
    sizes_in_graph: bool = False   # the uneven exchange's split sizes in the compiled graph (model.moe.split_sizes)

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
    plan/gpus.py's RATES) or the model has no FLOP count. Under expert parallelism's uneven exchange, compiled, with
    the split sizes where model.moe.split_sizes puts them (`StepTime.sizes_in_graph` says which the step assumes):
    auto and graph keep them in the compiled graph, which measured faster at every layout paired with them read on
    the host (the 128-expert MoE at micro-batches 16, 20 and 30; the 8-expert recipe in a pair of each order,
    2026-11-30-2xh200-moe-gpt2-125m-ep2-graph-opaque-vs-host.json and -2.json). The model counts the graph's gain
    only where the host paces the step (GRAPH_HOST against HOST)."""
    if target.rates is None or not target.cuda or not counts.flops_per_token:
        return None
    moe = cfg.model.moe
    uneven = layout.expert_parallel > 1 and moe_layers(cfg) and not (moe.exchange == "padded" and moe.capacity_factor)
    in_graph = bool(uneven and cfg.train.compile and moe.split_sizes in ("auto", "graph"))
    t = _step_time(cfg, counts, target, layout, micro, checkpointing, sequences, GRAPH_HOST if in_graph else HOST)
    return replace(t, sizes_in_graph=in_graph)


def _step_time(cfg: RunConfig, counts: ParamCount, target: Target, layout, micro: int, checkpointing: str,
               sequences: int, host_per_layer: float) -> StepTime:
    """step_time with `host_per_layer` seconds of host work per MoE layer and micro-batch (HOST or GRAPH_HOST)."""
    rates = target.rates.at(layout.nproc)
    m, seq, ep = cfg.model, cfg.data.seq_len, layout.expert_parallel
    parallel, nproc, reshard_after_forward = layout.parallel, layout.nproc, layout.reshard_after_forward
    accumulation = max(1, cfg.train.global_batch_size // (micro * nproc))
    # fsdp's reduce-scatters a micro-batch, over the step: every micro-batch's, or the last one's (grad_reduce=step)
    reduces = 1 / accumulation if layout.grad_reduce == "step" else 1.0
    n_moe = moe_layers(cfg)
    tokens = micro * seq * sequences                    # one micro-batch on one rank
    expert_flops = 6 * counts.expert * m.moe.top_k / m.moe.num_experts if n_moe else 0.0
    dense_flops = counts.flops_per_token - expert_flops
    if checkpointing == "full":   # the blocks' forward again in the backward: a third of their FLOPs
        dense_flops *= 1 + counts.blocks_matmul / max(1, counts.matmul) / 3
        expert_flops *= 4 / 3
    elif checkpointing == "experts":   # the experts' first grouped matmul again: 7 of them, 6 without
        expert_flops *= 7 / 6
    # a family whose FLOPs run slower than a GPT's says by how much (its memory module's `speed`: t5)
    speed = getattr(family(m.family).memory(), "speed", lambda model: 1.0)(m)
    width = counts.shapes.d if counts.shapes is not None else m.n_embd
    float8 = 1 + (FLOAT8 - 1) * counts.blocks_matmul / max(1, counts.matmul) if cfg.train.float8 else 1
    dense_rate = speed * rates.matmul * DENSE * width / (width + WIDTH) * float8
    # the padded exchange (model.moe.exchange=padded) sends and computes every expert's whole capacity, pads
    # included: capacity_factor times the routed rows, no host read
    padded = ep > 1 and n_moe and m.moe.exchange == "padded" and m.moe.capacity_factor > 0
    pad = m.moe.capacity_factor if padded else 1.0
    compute = tokens * (dense_flops / dense_rate + pad * expert_flops / (rates.matmul * EXPERTS))

    link = rates.all_reduce * COLLECTIVES
    fsdp = parallel == "fsdp"
    local_experts = counts.expert / ep if ep > 1 else 0.0   # a rank's experts, outside fsdp's sharding
    micro_s, host, comm = compute, 0.0, 0.0             # a micro-batch, its GPU's wait on the host, its exchanges
    if fsdp and nproc > 1:
        # what FSDP manages: every parameter, or under expert parallelism all but the experts, which it ignores
        managed = counts.total - (counts.expert if ep > 1 else 0)
        block = counts.largest_block - (counts.expert / max(1, counts.n_blocks) if ep > 1 else 0)
        gathers = 2 if reshard_after_forward else 1
        comm = (2 * gathers + 4 * reduces) * managed * (nproc - 1) / nproc / link
        # the first block's and the root's gather start the step (an untied head's runs under the last block)
        first = 2 * (block + counts.root - counts.head) * (nproc - 1) / nproc / link
        # the copies around them: the gathered parameters copied out on the compute stream (2 bytes read, 2
        # written), the bf16 gradients cast into the reduce-scatter's fp32 input on its stream (2 read, 4 written)
        # or, before the last micro-batch under grad_reduce=step, added into the whole fp32 gradient (6 read, 4)
        copy_out = 4 * gathers * managed / rates.memory
        copy_in = (6 * reduces + 10 * (1 - reduces)) * managed / rates.memory
        micro_s = max(compute + copy_out, comm + copy_in) + first
    if ep > 1 and n_moe:
        rows = tokens * m.moe.top_k * pad
        exchange = 4 * n_moe * rows * m.n_embd * 2 * (ep - 1) / ep / (rates.all_to_all * EXCHANGES)
        busy = micro_s                                  # the compute, with fsdp's exchanges beside it
        # the padded exchange reads nothing back, so the host runs ahead of the GPU and sets no floor
        micro_s = (busy + exchange if padded
                   else max(busy + exchange, n_moe * host_per_layer) + n_moe * rates.host_sync)
        # the recomputed layers read their split sizes again (experts recomputes after the exchange: nothing to read)
        if checkpointing in ("selective", "full") and not padded:
            micro_s += n_moe * RECOMPUTE_HOST
        if fsdp and nproc > 1 and not padded:   # FSDP's hooks, after the host reads; the reduce-scatters' part
            # (FSDP_GATHERED_HOST) on the last micro-batch only under grad_reduce=step
            unit = (FSDP_HOST if reshard_after_forward else FSDP_GATHERED_HOST) - FSDP_GATHERED_HOST * (1 - reduces)
            micro_s += (counts.n_blocks + 1) * unit
        host = micro_s - busy - exchange
        comm += exchange
    all_reduce = exposed = 0.0
    if parallel == "ddp" and nproc > 1:
        grads = 4 * (counts.dense if ep > 1 else counts.trainable)
        all_reduce = grads * 2 * (nproc - 1) / nproc / link
        last = min(DDP_BUCKET, grads) * 2 * (nproc - 1) / nproc / link
        exposed = max(all_reduce - 2 / 3 * compute, last)
    if ep > 1 and nproc > ep:   # each expert shard's fp32 gradients summed over its replicas, after the last backward
        replicas = nproc // ep
        summed = 4 * local_experts * 2 * (replicas - 1) / replicas / link
        all_reduce += summed
        exposed += summed
    updated = (counts.trainable / nproc if ep == 1 else counts.dense / nproc + local_experts) if fsdp \
        else counts.dense + counts.expert / ep
    optimizer = OPTIMIZER_BYTES[cfg.optim.state_dtype] * updated / rates.memory
    if fsdp:   # FSDP gathers 16-bit weights and reduce-scatters its gradients: only the experts' part is left
        weights = expert_weight_bytes(cfg, counts, ep, accumulation) / rates.memory if ep > 1 else 0.0
    else:
        weights = weight_bytes(cfg, counts, ep, accumulation) / rates.memory
    step = accumulation * micro_s + exposed + weights + optimizer
    return StepTime(step=step, compute=accumulation * compute,
                    exchanges=accumulation * (micro_s - compute - host) + exposed,
                    host=accumulation * host, optimizer=optimizer,
                    communication=accumulation * comm + all_reduce, weights=weights,
                    tokens_per_s_per_gpu=accumulation * tokens / step)


def weight_bytes(cfg: RunConfig, counts: ParamCount, ep: int, accumulation: int) -> float:
    """Bytes a step of `accumulation` micro-batches moves per rank outside fsdp for the weights themselves (the
    module docstring's `weights`): autocast's casts and their gradients' casts where the run trains in 16 bits, and
    the gradients added up over the micro-batches."""
    sixteen = cfg.train.dtype != "fp32"
    if ep > 1:   # the dense weights as below; the experts' as expert_weight_bytes counts them
        cast = 12 * (counts.matmul - counts.expert) * accumulation if sixteen else 0.0
        return cast + 12 * counts.dense * (accumulation - 1) + expert_weight_bytes(cfg, counts, ep, accumulation)
    cast = 12 * counts.matmul * accumulation if sixteen else 0.0
    return cast + 12 * counts.trainable * (accumulation - 1)


def expert_weight_bytes(cfg: RunConfig, counts: ParamCount, ep: int, accumulation: int) -> float:
    """Bytes a step moves per rank for a rank's experts under expert parallelism, with either strategy: their 16-bit
    copies made once a step where the run trains in 16 bits (expert.keep_casts: 4 bytes read, 2 written) and their
    gradients added into .grad by one kernel each micro-batch (kernels/accumulate.py: 6 read, 4 written)."""
    local_experts = counts.expert / ep
    return (6 * local_experts if cfg.train.dtype != "fp32" else 0.0) + 10 * local_experts * accumulation
