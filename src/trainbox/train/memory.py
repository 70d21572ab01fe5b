"""The pre-flight memory check (`train.memory_check`): before any weight is allocated, the run's memory plan
(trainbox.plan: parameters, gradients, optimizer state, activations, communication, overhead per device) is
held against what the device has free: on a CPU each process's share of MemAvailable of /proc/meminfo (the
run's processes on this host share its RAM; `trainbox plan` holds a run to the same figure), on a GPU
torch.cuda.mem_get_info. A run is refused when even the low end of the plan's error margin, needed x
(1 - plan.MARGIN), exceeds it; the message says what would fit. A family built from its own description
(`build_meta`: model.family=hf, a Hugging Face folder) is not checked here: its size is only known once its
folder is read (`trainbox plan` counts it from its config).
"""
from __future__ import annotations

import torch

from trainbox.checkpoint.room import host_available
from trainbox.config import RunConfig
from trainbox.errors import ConfigError
from trainbox.kernels.choice import choose
from trainbox.model.spec import family
from trainbox.plan import MARGIN, MemoryPlan, Target, local_cpu, make_plan
from trainbox.plan.activations import Kernels
from trainbox.plan.gpus import rates_of

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def available(device: torch.device) -> int | None:
    """Bytes the device has free now: MemAvailable on a CPU (Linux), free GPU memory on CUDA; None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available()


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def device_plan(cfg: RunConfig, vocab: int, device: torch.device, dtype: torch.dtype, free: int, world: int = 1,
                local_world: int | None = None) -> MemoryPlan:
    """The plan of this run on `device` (its kernels as kernels.choice picks them there), against `free` bytes: a
    GPU's, or a CPU's RAM shared by the run's `local_world` processes on this host (else all `world`)."""
    cuda = device.type == "cuda"
    if cuda:
        props = torch.cuda.get_device_properties(device)
        cap = (props.major, props.minor)
        target = Target(props.name, free, hopper=cap >= (9, 0), fp8=cap >= (8, 9), lce=cap == (9, 0), local=True,
                        rates=rates_of(props.name))   # the step time: where the host paces it (train/loop.py)
    else:
        target = local_cpu(free)
    k = choose(cfg.model, device, family(cfg.model.family))
    kernels = Kernels(k.attention, k.fused_loss, k.fused_mlp, k.fp8)
    # a CPU has no streams, so FSDP's gradient shards have no pool of their own there (asked of this torch on a GPU)
    return make_plan(cfg, vocab, target, world, kernels=kernels, dtype=DTYPES.get(dtype, "fp32"),
                     side_stream_grads=False if not cuda else None, local_world=local_world)


def check_memory(cfg: RunConfig, vocab: int, device: torch.device, dtype: torch.dtype, free: int | None = None,
                 world: int = 1, local_world: int | None = None) -> MemoryPlan | None:
    """Raise ConfigError when the run's plan exceeds the device's free memory beyond the plan's margin (`free`:
    measured if None, a GPU's or this host's RAM; `world`: processes the run is spread over; `local_world`: those
    on this host, which share a CPU's RAM, else all of them). Returns the plan, or None when not checked."""
    if not cfg.train.memory_check or family(cfg.model.family).hook("build_meta") is not None:
        return None
    free = available(device) if free is None else free
    if free is None:
        return None
    if device.type == "cuda" and cfg.train.memory_limit_gib:   # the allocator's cap (train/device.py: use_device)
        free = min(free, int(cfg.train.memory_limit_gib * 2**30))
    plan = device_plan(cfg, vocab, device, dtype, free, world, local_world)
    mem, share = plan.memory, plan.target.memory   # a CPU: this process's share of the host's RAM
    if mem.needed * (1 - MARGIN) <= share:
        return plan
    t = cfg.train
    n = plan.target.processes
    where = f"free on {device}" if device.type != "cpu" else "this machine's available RAM" if n == 1 else \
        f"per process of this machine's available RAM ({gib(free)} shared by the run's {n} processes on it)"
    fixes = []
    for s in plan.suggestions:
        if s.what == "micro-batch":
            fixes.append(f"lower {s.overrides[0].replace('=', ' (at most ')} fits by this plan)")
        elif s.nproc == world:
            fixes.append(" ".join(s.overrides))
    if not any(f.startswith("lower train.micro_batch_size") for f in fixes):
        fixes.insert(0, "lower train.micro_batch_size")
    if t.activation_checkpointing != "full" and not any("activation_checkpointing" in f for f in fixes):
        fixes.append("set train.activation_checkpointing=full")
    more = [s for s in plan.suggestions if s.nproc > world]
    if more:
        fixes.append(f"spread it over --nproc {more[0].nproc} ({' '.join(more[0].overrides) or 'as it is'})")
    raise ConfigError(
        f"this run needs about {gib(mem.needed)} on {device} ({plan.counts.total / 1e6:.1f}M parameters: weights "
        f"{gib(mem.params)}, gradients {gib(mem.gradients)}, optimizer state {gib(mem.optimizer)}; activations "
        f"{gib(mem.activations)} at train.micro_batch_size={t.micro_batch_size}, data.seq_len={cfg.data.seq_len}"
        + (f"; communication {gib(mem.comm)}" if mem.comm else "")
        + (f"; overhead {gib(mem.overhead)}" if mem.overhead else "")
        + f"), more than the {gib(share)} {where}",
        hint=f"{', or '.join(fixes)}, or data.seq_len, or a smaller model (model.n_layer, model.n_embd); "
             f"`trainbox plan {cfg.recipe or 'CONFIG'} ...` shows the whole plan; train.memory_check=false skips "
             "this check")
