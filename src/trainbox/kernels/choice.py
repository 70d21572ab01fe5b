"""Which kernel runs each part of a model on a device: decided in one place.

`choose(model_cfg, device, spec)` returns a KernelChoice; `spec` is the model family (model/spec.py), which says
which attention kernels it can run. The models ask it once, when they first meet their device (GPT.set_kernels,
SpeedrunGPT's backend); the trainer asks it when it builds the model and records the plan in env.json and the
run's start event; `trainbox doctor RECIPE` prints it for the machine it runs on, and the memory plan asks
`attention_on` for a GPU it is not running on.

    attention   flash  FlashAttention-4 (model.attention=flash, or auto where `trainbox[flash]` runs: Hopper or
                       Blackwell; speedrun only with model.window_block=1)
                flex   FlexAttention with a block mask (speedrun on a CUDA GPU of compute capability 8.0+)
                triton trainbox's Triton attention with a learned bias shared by the batch (t5's self-attention,
                       kernels/biased_attention.py; a CUDA GPU of compute capability 8.0+ with Triton): t5-base's
                       compiled step is faster on it than on SDPA with the bias as a mask (docs/performance.md)
                sdpa   PyTorch's scaled_dot_product_attention (speedrun: with an explicit mask, memory O(T^2))
                or the family's own (`Family.own_attention`: hf, the Hugging Face model's)
    fused_loss  quack  QuACK's linear cross-entropy for the loop's summed loss (H100/H200 with QuACK), Triton
                       otherwise on CUDA; torch: the same function in torch ops (CPU); off
    fused_norm  triton (CUDA) or torch; off
    fused_mlp   quack  QuACK's GEMMs with the GELU in their epilogues (Hopper/Blackwell with QuACK); torch (CPU);
                unfused (a GPU without QuACK: plain linears, faster there than the op's torch path); off
    fp8         fp8 (FP8 tensor cores), bf16 (model.fp8_fallback where they are missing), off
    packed      attention inside each example of a packed row (data.packing, kernels/packed.py): flash
                (FlashAttention-4's variable-length kernels), flex (a FlexAttention document mask, CUDA 8.0+), sdpa
                (a dense block-diagonal mask: CPU, the reference), hf (transformers' own, model/hf/model.py); the
                first of the family's `Family.packing` that model.attention allows and that runs here; off where
                the run's rows are not packed examples
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from trainbox.errors import ConfigError
from trainbox.kernels.biased_attention import triton_attention_available
from trainbox.kernels.flash import flash_available, require_flash
from trainbox.kernels.fp8 import fp8_supported
from trainbox.kernels.fused_ce import quack_lce_available
from trainbox.kernels.fused_mlp import quack_available


@dataclass(frozen=True)
class KernelChoice:
    attention: str
    fused_loss: str
    fused_norm: str
    fused_mlp: str
    fp8: str
    packed: str = "off"

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in asdict(self).items())


def flex_available(device: torch.device) -> bool:
    """FlexAttention runs on CUDA GPUs of compute capability 8.0+ (Triton kernels)."""
    if device.type != "cuda":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401 - optional: a feature this torch may lack
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def attention_on(spec, cfg, flash: bool, flex: bool) -> str:
    """The attention kernel family `spec` runs for model section `cfg` where FlashAttention-4 (`flash`) and
    Triton's kernels, FlexAttention's and trainbox's own (`flex`), can run or not: the first the family lists that
    model.attention allows and that runs."""
    if not spec.attention:
        return spec.own_attention
    eligible = spec.flash_eligible(cfg) if spec.flash_eligible else True
    if "flash" in spec.attention and flash and eligible and cfg.attention in ("auto", "flash"):
        return "flash"
    if "flex" in spec.attention and flex and cfg.attention in ("auto", "flex"):
        return "flex"
    if "triton" in spec.attention and flex and cfg.attention in ("auto", "triton"):
        return "triton"
    return "sdpa"


def _attention(cfg, device: torch.device, spec) -> str:
    if cfg.attention == "flash":
        require_flash(device)   # refuses, saying why, where it cannot run
    if cfg.attention == "triton" and not triton_attention_available(device):
        raise ConfigError(f"model.attention=triton runs trainbox's Triton kernels, which need a CUDA GPU of compute "
                          f"capability 8.0+ with Triton; this run's device is {device}",
                          hint="set model.attention=auto (or sdpa): PyTorch's attention with the bias as a mask")
    return attention_on(spec, cfg, flash=cfg.attention == "flash" or flash_available(device),
                        flex=flex_available(device))


def packed_on(spec, cfg, device: torch.device) -> str:
    """The kernel family `spec` runs on packed rows on `device` (kernels/packed.py, or hf: transformers' own): the first
    of `spec.packing` that model.attention allows and that runs here; off for a family that cannot pack."""
    for kernel in spec.packing:
        if kernel == "flash" and cfg.attention in ("auto", "flash") and flash_available(device):
            return kernel
        if kernel == "flex" and cfg.attention in ("auto", "flex") and flex_available(device):
            return kernel
        if kernel in ("sdpa", "hf"):
            return kernel
    return "off"


def _fused_loss(cfg, device: torch.device) -> str:
    if not cfg.fused_loss:
        return "off"
    if device.type != "cuda":
        return "torch"
    return "quack" if quack_lce_available(device) else "triton"


def _fused_mlp(cfg, device: torch.device) -> str:
    if not cfg.fused_mlp:
        return "off"
    if device.type != "cuda":
        return "torch"
    return "quack" if quack_available(device) else "unfused"


def _fp8(cfg, device: torch.device) -> str:
    if not cfg.fp8_options:
        return "off"
    # where fp8 cannot run, the fp8 matmuls run in the compute dtype: bf16 under a GPU's autocast, fp32 on a CPU
    return "fp8" if fp8_supported(device) else ("bf16" if device.type == "cuda" else "fp32")


def choose(cfg, device: torch.device, spec, packed: bool = False) -> KernelChoice:
    """The kernels a model of ModelSection `cfg` and family `spec` runs on `device` (raises where
    model.attention=flash cannot run); `packed`: its rows are packed examples (model/build.py packs_examples)."""
    return KernelChoice(attention=_attention(cfg, device, spec), fused_loss=_fused_loss(cfg, device),
                      fused_norm="off" if not cfg.fused_norm else ("triton" if device.type == "cuda" else "torch"),
                      fused_mlp=_fused_mlp(cfg, device), fp8=_fp8(cfg, device),
                      packed=packed_on(spec, cfg, device) if packed else "off")
