"""The devices a plan is made for: a table of GPUs by name, the local GPU, this machine's RAM, or a given size.

A CPU's RAM is the host's available memory (MemAvailable of /proc/meminfo: free memory and the page cache the kernel
can drop, what a run can have; the pre-flight check holds a run to the same figure), shared by the run's processes
on the host: each one's share is the memory a plan holds a process to (`Target.shared`). A GPU is each process's own.

Memory is what `torch.cuda.get_device_properties(i).total_memory` reports for the card (a little below the
marketing figure: an "80 GB" H100 shows 79.1 GiB). `hopper` marks the cards where `trainbox[flash]` runs
FlashAttention-4 and QuACK's kernels, `fp8` those with FP8 tensor cores, `lce` those where QuACK's linear
cross-entropy runs (compute capability 9.0).

`Rates` are what the step-time model (plan/time.py) divides by: the dense bf16 matmul rate at large shapes, the
bus bandwidth of NCCL's all-reduce and all-to-all between the GPUs of one node, the memory bandwidth, and what a
host read after an all-to-all costs. benchmarks/hw_rates.py measures each of them on a machine; `source` says
where each kind's come from.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainbox.checkpoint.room import host_available
from trainbox.errors import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class Rates:
    """What one GPU of a kind sustains, and where each figure comes from."""
    matmul: float       # FLOP/s of a bf16 matmul at large shapes (dense, 8192 x 8192 x 8192)
    all_reduce: float   # bytes/s: NCCL all-reduce bus bandwidth between GPUs of one node (nccl-tests' busbw)
    all_to_all: float   # bytes/s: all_to_all_single bus bandwidth at the expert exchanges' sizes
    memory: float       # bytes/s: HBM read + write bandwidth a fused optimizer reaches
    host_sync: float    # seconds a host read (`.tolist()`) after a small all-to-all costs a GPU with work queued
    source: str         # the record or document each figure comes from
    # (GPUs, all_reduce, all_to_all) measured at other GPU counts of one node: the links' bus bandwidth grows with
    # the ring's length (2 H200s: 318 and 209 GB/s, 4: 343 and 253)
    links: tuple[tuple[int, float, float], ...] = ()

    def at(self, gpus: int) -> Rates:
        """These rates with the links measured at the largest count up to `gpus` (the smallest above it where none
        is)."""
        counts = sorted(self.links)
        if not counts:
            return self
        below = [c for c in counts if c[0] <= gpus]
        _, all_reduce, all_to_all = below[-1] if below else counts[0]
        return replace(self, all_reduce=all_reduce, all_to_all=all_to_all)


# Measured on 2 and 4 H200s of one host (benchmarks/hw_rates.py: 2026-11-28-2xh200-hw-rates.json and
# 2026-11-28-4xh200-hw-rates.json): the matmul rate, memory bandwidth and host read are the two records' mean, the
# links each count's own. H100 SXM: the same GH100 chip and NVLink 4 fabric, so the same matmul rate and links,
# with the memory bandwidth scaled by HBM's (3.35 against 4.8 TB/s); not yet measured on an H100.
MEASURED = "benchmarks/records/2026-11-28-{2,4}xh200-hw-rates.json"
H200_LINKS = ((2, 317.9e9, 209.5e9), (4, 343.5e9, 253.1e9))
HOPPER_SXM = dict(matmul=765e12, all_reduce=H200_LINKS[0][1], all_to_all=H200_LINKS[0][2], host_sync=55e-6,
                  links=H200_LINKS)
RATES = {
    "H100": Rates(memory=2.32e12 * 3.35 / 4.8, source=f"H200's ({MEASURED}), memory scaled by HBM's bandwidth",
                  **HOPPER_SXM),
    "H200": Rates(memory=2.32e12, source=MEASURED, **HOPPER_SXM),
}


@dataclass(frozen=True)
class Target:
    name: str
    memory: int            # bytes of one device
    cuda: bool = True      # a GPU (else this machine's CPU and RAM)
    hopper: bool = False
    fp8: bool = False
    lce: bool = False
    local: bool = False    # the device this process sees (kernels are then asked, not assumed)
    rates: Rates | None = None   # what the step-time model divides by; None: no time is predicted
    capped: bool = False         # memory is train.memory_limit_gib, below the card's
    ram: int = 0           # a CPU: the host's available RAM, which its processes share
    processes: int = 1     # a CPU: the run's processes on the host; `memory` is each one's share of `ram`

    def limited(self, gib: float) -> Target:
        """This GPU with its memory capped at `gib` GiB (train.memory_limit_gib; 0 or above the card's: as it is)."""
        if not self.cuda or not gib or gib * GiB >= self.memory:
            return self
        return replace(self, memory=int(gib * GiB), capped=True)

    def shared(self, processes: int) -> Target:
        """This CPU with its RAM shared by `processes` processes of one host, each one's share as the memory; a GPU
        as it is (each process has one of its own)."""
        if self.cuda:
            return self
        return replace(self, memory=self.ram // max(1, processes), processes=max(1, processes))

    @property
    def gib(self) -> float:
        return self.memory / GiB

    @property
    def each(self) -> str:
        """What the memory is of: one GPU, or one process of a CPU."""
        return "GPU" if self.cuda else "process"


def _gpu(name: str, gib: float, hopper: bool = False, fp8: bool = False, lce: bool = False) -> Target:
    return Target(name, int(gib * GiB), hopper=hopper, fp8=fp8, lce=lce, rates=RATES.get(name))


def rates_of(device_name: str) -> Rates | None:
    """The rates of a kind named in a device name ("NVIDIA H100 80GB HBM3" -> H100's); None for another kind."""
    words = device_name.upper().replace("-", " ").split()
    return next((r for kind, r in RATES.items() if kind in words and "NVL" not in words and "PCIE" not in words),
                None)


GPUS = {t.name: t for t in (
    _gpu("H100", 79.1, hopper=True, fp8=True, lce=True),        # H100 SXM 80 GB
    _gpu("H100-NVL", 93.1, hopper=True, fp8=True, lce=True),
    _gpu("H200", 139.8, hopper=True, fp8=True, lce=True),
    _gpu("GH200", 94.5, hopper=True, fp8=True, lce=True),
    _gpu("B200", 178.4, hopper=True, fp8=True),
    _gpu("A100-80GB", 79.2),
    _gpu("A100-40GB", 39.4),
    _gpu("L40S", 44.4, fp8=True),
    _gpu("L4", 22.0, fp8=True),
    _gpu("A10G", 22.0),
    _gpu("RTX4090", 23.6, fp8=True),
    _gpu("MI300X", 191.5),
    _gpu("MI325X", 255.5),
)}


def gpu(name: str) -> Target:
    """A GPU of the table by name (case and '-' / '_' / spaces ignored: h100, a100_80gb, 'RTX 4090')."""
    key = name.upper().replace("_", "-").replace(" ", "")
    found = {k.replace("-", ""): t for k, t in GPUS.items()}.get(key.replace("-", ""))
    if found is None:
        raise ConfigError(f"--gpu {name}: not a GPU this plan knows ({', '.join(GPUS)})",
                          hint="name one of them, or give the memory of one GPU with --gpu-mem GiB")
    return found


def sized(gib: float) -> Target:
    """A GPU of `gib` GiB about which nothing else is known (kernels as on a GPU without trainbox[flash])."""
    if not gib > 0:
        raise ConfigError(f"--gpu-mem {gib}: the memory of one GPU in GiB must be positive")
    return Target(f"{gib:g} GiB GPU", int(gib * GiB))


def local_gpu() -> Target | None:
    """The GPU this process would train on (device 0), or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    cap = (props.major, props.minor)
    return Target(props.name, int(props.total_memory), hopper=cap >= (9, 0), fp8=cap >= (8, 9), lce=cap == (9, 0),
                  local=True, rates=rates_of(props.name))


def local_cpu(ram: int | None = None) -> Target:
    """This machine's CPU, with the RAM a run can have (`ram` bytes, else MemAvailable now; 0 where unknown) for one
    process: `Target.shared` splits it among more."""
    ram = (host_available() or 0) if ram is None else ram
    return Target("CPU (RAM)", ram, cuda=False, local=True, ram=ram)
