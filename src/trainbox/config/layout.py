"""A run's layout, decided once: on how many processes and which kind of device, with which strategy for the dense
parameters (ddp, or fsdp where there is something to shard), over how many ranks each MoE layer's experts are split
(with either strategy), and the micro-batch and accumulation that keep the global batch (global = micro-batch x
accumulation x processes).

    layout = decide_layout(cfg, world=2, device="cuda", adapt_micro_batch=True)
    cfg = layout.applied(cfg)          # train.micro_batch_size as decided

Every caller asks this function: `trainbox train` (train/preflight.py, before the run directory is touched; under
--nproc N its launcher decides once and hands the workers the config it decided), `trainbox config validate
[--nproc N]`, `trainbox plan [--nproc N]` and the memory plan (plan/), whose suggestions are the layouts it accepts.
Every rule of a layout is checked here, with a message that names the key and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainbox.config.schema import RunConfig
from trainbox.errors import ConfigError
from trainbox.model.spec import either, family, which


@dataclass(frozen=True)
class RunLayout:
    """How a run is spread over its processes (recorded in env.json and the run's start event)."""

    world: int              # processes, all nodes together
    device: str             # the kind of device each process trains on: cuda or cpu
    strategy: str           # the dense parameters: ddp (whole on every rank) or fsdp (sharded over every rank)
    expert_parallel: int    # ranks each MoE layer's experts are split over (1: every rank holds all of them)
    micro_batch: int        # sequences per forward pass on one rank
    accumulation: int       # micro-batches per step on each rank
    global_batch: int       # sequences per optimizer step: micro_batch x accumulation x world
    expert_exchange: str = "none"   # expert parallelism's training exchange (model.moe.exchange): uneven or padded

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def applied(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with this layout's micro-batch (a new config; `cfg` itself when it already has it)."""
        if cfg.train.micro_batch_size == self.micro_batch:
            return cfg
        return cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": self.micro_batch})})

    def note(self, cfg: RunConfig) -> str | None:
        """What this layout changed in `cfg`, as one line for the user; None when nothing."""
        if cfg.train.micro_batch_size == self.micro_batch:
            return None
        per_rank = self.global_batch // self.world
        return (f"train.micro_batch_size={self.micro_batch} on {_processes(self.world)} (the recipe's "
                f"{cfg.train.micro_batch_size} does not divide the {per_rank} sequences per process); the global "
                f"batch stays {self.global_batch}")

    def describe(self) -> str:
        experts = (f", experts split over {self.expert_parallel} ranks ({self.expert_exchange} exchange)"
                   if self.expert_parallel > 1 else "")
        return (f"{self.strategy}{experts}, {_processes(self.world)} on {self.device}: global batch "
                f"{self.global_batch} = {self.micro_batch} x {self.accumulation} accumulation x {self.world}")


def _processes(n: int) -> str:
    return f"{n} process" + ("es" if n != 1 else "")


def micro_batches(global_batch: int, world: int, upto: int) -> list[int]:
    """The micro-batch sizes up to `upto` that hold `global_batch` on `world` processes (each dividing a process's
    share of it), largest first; [] where the global batch does not split over the processes."""
    share, rem = divmod(global_batch, world)
    if rem:
        return []
    return [b for b in range(min(upto, share), 0, -1) if share % b == 0]


def micro_batch_given(overrides) -> bool:
    """Whether the command line gives train.micro_batch_size (then it is taken as it is, not adapted)."""
    return any(o.split("=", 1)[0].strip() == "train.micro_batch_size" for o in overrides)


def decide_layout(cfg: RunConfig, world: int, device: str = "cpu", adapt_micro_batch: bool = False) -> RunLayout:
    """The layout of `cfg` on `world` processes training on `device` (cuda or cpu, as train/device.py resolved
    train.device), or a ConfigError naming the key and the fix. `adapt_micro_batch`: train.micro_batch_size was
    not given on the command line, so it is the largest size up to it that divides a process's share of the
    global batch; otherwise it must divide it."""
    if world < 1:
        raise ConfigError(f"--nproc {world}: the number of processes must be at least 1")
    t = cfg.train
    if world > 1 and t.device.startswith("cuda:"):
        raise ConfigError(f"train.device={t.device} puts all {world} processes on one GPU",
                          hint="use train.device=cuda: each process takes the GPU of its local rank")
    ep = _expert_parallel(cfg, world)
    micro = _micro_batch(cfg, world, adapt_micro_batch)
    strategy = "fsdp" if t.parallel == "fsdp" and world > 1 else "ddp"
    if t.eval_tasks and (strategy == "fsdp" or ep > 1):
        spread = "train.parallel=fsdp" if strategy == "fsdp" else f"model.moe.expert_parallel={ep}"
        raise ConfigError(f"train.eval_tasks runs lm-eval on rank 0 alone, which needs the whole model there; under "
                          f"{spread} on {_processes(world)} every forward needs every rank",
                          hint="drop train.eval_tasks and evaluate the checkpoints (`trainbox eval RUN --tasks "
                               "...`, which reads sharded ones), or train with train.parallel=ddp")
    return RunLayout(world=world, device=device, strategy=strategy, expert_parallel=ep, micro_batch=micro,
                     accumulation=t.global_batch_size // (micro * world), global_batch=t.global_batch_size,
                     expert_exchange=cfg.model.moe.exchange if ep > 1 else "none")


def _expert_parallel(cfg: RunConfig, world: int) -> int:
    """model.moe.expert_parallel where the run can use it."""
    n = cfg.model.moe.expert_parallel
    if n == 1:
        return 1
    where = f"model.moe.expert_parallel={n}"
    if not family(cfg.model.family).experts:
        experts = either(which(lambda f: f.experts))
        raise ConfigError(f"{where} applies to model.family={experts}, not {cfg.model.family}",
                          hint=f"drop model.moe.expert_parallel or set model.family={experts}")
    if cfg.model.moe.num_experts % n:
        raise ConfigError(f"{where} does not divide model.moe.num_experts={cfg.model.moe.num_experts}",
                          hint="choose a divisor of the number of experts")
    if world % n:
        raise ConfigError(f"{where} does not divide the run's {world} process(es)",
                          hint=f"use --nproc {n * max(1, world // n)} (a multiple of {n}), or a model.moe."
                               f"expert_parallel dividing {world}")
    if cfg.optim.name == "muon":
        raise ConfigError(f"{where} runs with optim.name=adamw: Muon's distributed step expects every rank to "
                          "hold the same parameters", hint="set optim.name=adamw")
    return n


def _micro_batch(cfg: RunConfig, world: int, adapt: bool) -> int:
    """The micro-batch that keeps train.global_batch_size on `world` processes (see decide_layout)."""
    g, m = cfg.train.global_batch_size, cfg.train.micro_batch_size
    per_rank, rem = divmod(g, world)
    if rem:
        raise ConfigError(f"train.global_batch_size={g} does not split over {world} processes",
                          hint=f"use --nproc with a divisor of {g}, or set train.global_batch_size to a multiple "
                               f"of {world}")
    if adapt:
        return micro_batches(g, world, m)[0]
    if per_rank % m:
        over = f" over {world} processes" if world > 1 else ""
        raise ConfigError(f"train.micro_batch_size={m} does not divide the {per_rank} sequences per process of "
                          f"train.global_batch_size={g}{over}",
                          hint=f"drop train.micro_batch_size (trainbox then picks one that fits) or give a divisor "
                               f"of {per_rank}; or set train.global_batch_size to a multiple of {m * world}")
    return m
