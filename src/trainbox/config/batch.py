"""The micro-batch a run trains with on N processes: the global batch holds (global = micro x accumulation x
processes), so `trainbox train --nproc N` and `trainbox plan --nproc N` pick the same one."""
from __future__ import annotations

from trainbox.errors import ConfigError


def micro_batch_on(cfg, nproc: int, given: bool) -> int:
    """train.micro_batch_size on `nproc` processes. Where the command line did not give it (`given`), the largest
    micro-batch up to the recipe's own that divides a process's share of train.global_batch_size; a given one that
    does not divide it, or a global batch that does not split over the processes, is refused."""
    t = cfg.train
    per_rank, rem = divmod(t.global_batch_size, nproc)
    if rem:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} does not split over {nproc} processes",
                          hint=f"use --nproc with a divisor of {t.global_batch_size}, or set "
                               f"train.global_batch_size to a multiple of {nproc}")
    if given:
        if per_rank % t.micro_batch_size:
            raise ConfigError(f"train.micro_batch_size={t.micro_batch_size} does not divide the "
                              f"{per_rank} sequences per process of train.global_batch_size="
                              f"{t.global_batch_size} over {nproc} processes",
                              hint="drop train.micro_batch_size (trainbox then picks one that fits) or give a "
                                   f"divisor of {per_rank}")
        return t.micro_batch_size
    return max(m for m in range(1, min(t.micro_batch_size, per_rank) + 1) if per_rank % m == 0)


def given_on_command_line(overrides) -> bool:
    return any(o.split("=", 1)[0].strip() == "train.micro_batch_size" for o in overrides)
