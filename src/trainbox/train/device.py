"""The device a run trains on: which one, in which dtype, what the config asks of it, and its peak FLOP/s.

Everything here fails before any work with a ConfigError that names the setting (a bf16 run on a CPU,
an FP8 head without FP8 tensor cores, a GPU recipe on a machine without one, train.device=cuda where no GPU is
visible; train/preflight.py asks resolve_device with the run's other checks), except an out-of-memory in a
step or an evaluation (CUDA's, or a CPU allocation that fails), which is turned into one TrainingFailed
that says which setting to lower. The memory a run needs is checked before that, in train/memory.py.
"""
from __future__ import annotations

import re
import resource
import warnings
from pathlib import Path

import torch

from trainbox.config import RunConfig
from trainbox.errors import ConfigError, TrainingFailed
from trainbox.kernels.flash import require_flash
from trainbox.kernels.float8 import require_float8
from trainbox.kernels.fp8 import fp8_supported
from trainbox.monitor.console import log

# bf16 dense peak TFLOP/s per device, for MFU (override: train.peak_tflops)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0,
               "MI300X": 1307.0, "MI325X": 1307.0, "MI250X": 383.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


def resolve_device(cfg: RunConfig, local_rank: int = 0) -> tuple[torch.device, torch.dtype, RunConfig]:
    """-> (device, dtype, the config resolved for them) of the process at `local_rank` on its machine: a new
    RunConfig where something had to change (FP8 matmuls as plain ones under model.fp8_fallback); `cfg` itself is
    never changed. Nothing is set up here: the trainer makes the device current (use_device)."""
    want = cfg.train.device
    if want == "auto":
        if cfg.requires_gpu and not torch.cuda.is_available():
            raise gpu_recipe_on_cpu(cfg)
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={cfg.train.device} but no CUDA GPU is visible",
                              hint="use train.device=cpu, or check `trainbox doctor`")
        device = torch.device("cuda", local_rank if want == "cuda" else int(want.split(":")[1]))
    else:
        device = torch.device(want)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(cfg.train.dtype)
    if dtype is None:  # auto
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if dtype != torch.float32 and device.type == "cpu":
        raise ConfigError(f"train.dtype={cfg.train.dtype} needs a GPU; on CPU training runs in fp32",
                          hint="use train.dtype=auto or train.dtype=fp32")
    fp8 = cfg.model.fp8_options
    if fp8:
        if not fp8_supported(device):
            name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
            if not cfg.model.fp8_fallback:
                raise ConfigError(f"{' and '.join(fp8)} needs a GPU with FP8 tensor cores (compute capability 8.9+: "
                                  f"L4, L40S, H100, H200); this run is on {device}{name}",
                                  hint=f"drop {' and '.join(o.split('=')[0] for o in fp8)} (the matmuls then run in "
                                       "bf16), or set model.fp8_fallback=true to do so only where FP8 is missing")
            # the recipe asks for FP8 where there is FP8: plain matmuls here, said once
            log.warning(f"{' and '.join(fp8)}: {device}{name} has no FP8 tensor cores, so these matmuls run in "
                        f"{str(dtype).removeprefix('torch.')} (model.fp8_fallback)")
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"fp8_head": False, "fp8_mlp": "none"})})
    if cfg.train.compile == "auto":
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"compile": cfg.train.compiled(device.type == "cuda")})})
    if cfg.train.float8:
        require_float8(device)
    if cfg.model.attention == "flash":
        require_flash(device, dtype)
    if cfg.monitor.memory_snapshot and device.type != "cuda":
        raise ConfigError(f"monitor.memory_snapshot={cfg.monitor.memory_snapshot} records CUDA's caching allocator; "
                          f"this run is on {device.type}", hint="drop monitor.memory_snapshot, or run on a CUDA GPU")
    return device, dtype, cfg


def use_device(device: torch.device, dtype: torch.dtype, limit_gib: float = 0) -> None:
    """Make `device` this process's current one and set its float32 matmul precision for `dtype` (the trainer, once
    the pre-flight checks have resolved them); `limit_gib` (train.memory_limit_gib): the most its allocator takes."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_float32_matmuls(dtype)
        if limit_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gib * 2**30 / total), device)
    elif limit_gib:
        log.warning(f"train.memory_limit_gib={limit_gib:g} caps a GPU's memory; this run trains on {device}, "
                    "which it leaves alone")


# Inductor's advice when a compiled graph has float32 matmuls on a GPU with TF32 and TF32 is off
TF32_ADVICE = "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"


def set_float32_matmuls(dtype: torch.dtype) -> None:
    """The precision of the float32 matmuls on a GPU (env.json records it as float32_matmul_precision).

    Under bf16/fp16 autocast the float32 matmuls left outside it (the MoE router's, for one) take TF32 tensor cores
    ("high"), as nanoGPT's train.py sets them. train.dtype=fp32 asks for float32 maths, so its matmuls stay IEEE
    float32 ("highest"), and Inductor's advice to turn TF32 on (a UserWarning at each compiled start) is not shown
    for it. This is torch.set_float32_matmul_precision, not the per-backend fp32_precision setters: after one of
    those torch refuses to read the global setting (torch.get_float32_matmul_precision, which Inductor reads)."""
    if dtype == torch.float32:
        torch.set_float32_matmul_precision("highest")
        warnings.filterwarnings("ignore", re.escape(TF32_ADVICE), UserWarning, r"torch\._inductor")
    else:
        torch.set_float32_matmul_precision("high")


def peak_flops(cfg: RunConfig, device: torch.device) -> float | None:
    if cfg.train.peak_tflops:
        return cfg.train.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


def gpu_recipe_on_cpu(cfg: RunConfig) -> ConfigError:
    name = cfg.recipe or "this config"
    return ConfigError(
        f"{name} is made for a GPU (requires_gpu) and no CUDA GPU is visible on this machine",
        hint=f"run it on a GPU machine (`trainbox doctor {name}` says what is missing), or try it small on this CPU: "
             f"trainbox train {name} train.device=cpu train.compile=false train.micro_batch_size=4 data.seq_len=256 "
             "(and model.n_layer / model.n_embd to shrink the model); the memory check then says whether it fits")


# the messages of a CPU allocation that fails (c10's DefaultCPUAllocator; "not enough memory" on Windows)
CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")


def is_out_of_memory(e: BaseException) -> bool:
    """A CUDA out-of-memory, or a CPU allocation that failed."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in CPU_OOM))


def out_of_memory(e: Exception, step: int, micro_batch: int, device: torch.device,
                  last_checkpoint: Path | None, during: str = "step") -> TrainingFailed:
    if device.type == "cuda":
        what, peak = "GPU out of memory", torch.cuda.max_memory_allocated(device)
    else:
        what, peak = "out of memory (RAM)", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return TrainingFailed(
        f"{what} in {during} {step} at train.micro_batch_size={micro_batch} "
        f"(peak {peak / 2**30:.1f} GiB): {str(e).splitlines()[0]}",
        hint=f"lower train.micro_batch_size (e.g. {max(1, micro_batch // 2)}): the global batch and the maths of a "
             "step stay the same, only the accumulation grows; or lower data.seq_len, set "
             "train.activation_checkpointing=full, or train a smaller model; "
             f"the last good checkpoint is {last_checkpoint or 'none'}")
