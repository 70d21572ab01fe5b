"""How much memory a run needs on its device, estimated from the config before any weight is allocated, and
the pre-flight check that refuses a run that does not fit (`train.memory_check`).

    parameters   counted exactly from a build on the meta device (no storage), fp32: 4 bytes each; one rank's
                 share of the experts under model.moe.expert_parallel
    gradients    4 bytes per parameter
    optimizer    AdamW: 2 fp32 moments (8 bytes) per parameter; Muon: 1 momentum (4 bytes) per matrix it owns,
                 AdamW's 8 for the rest (embeddings, head, scalars)
    activations  micro_batch x seq_len x layers x n_embd x ACT_BYTES, the usual estimate for a transformer block
                 without recomputation (Korthikanti et al. 2022: 34 bytes per element and layer with 16-bit
                 activations, attention scores not kept, as with flash / memory-efficient attention); in fp32
                 (every CPU run) twice that. train.activation_checkpointing=selective keeps about half,
                 full only each block's input (4 bytes, the fp32 residual) plus one block's worth
    logits       micro_batch x seq_len x vocab x 4 bytes x 2 (the fp32 logits and their gradient), none with
                 model.fused_loss

It is an estimate of the peak (allocator slack, the data loader, torch.compile's workspace and the CUDA
context come on top); the check compares it with what the device has free: MemAvailable of /proc/meminfo
on a CPU, torch.cuda.mem_get_info on a GPU. Hugging Face models (model.family=hf) are not estimated here.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from trainbox.config import RunConfig
from trainbox.errors import ConfigError

ACT_BYTES = 34   # per element (micro x seq x n_embd) and layer, 16-bit activations, no recomputation


@dataclass
class MemoryEstimate:
    """Bytes per component; `per_sample` is the part that grows with train.micro_batch_size."""
    params: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    n_params: int
    micro_batch: int

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.activations + self.logits

    @property
    def per_sample(self) -> float:
        return (self.activations + self.logits) / max(1, self.micro_batch)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def count_parameters(cfg: RunConfig, vocab: int) -> tuple[int, int]:
    """(parameters one rank holds, those Muon would own) of the run's model, built on the meta device (no memory);
    under model.moe.expert_parallel a rank holds its share of the experts."""
    from trainbox.model.spec import build_model
    with torch.device("meta"):
        model = build_model(cfg.model, vocab, cfg.model.block_size or cfg.data.seq_len, run=cfg)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    n = sum(p.numel() for _, p in params)
    if cfg.model.family == "moe" and cfg.model.moe.expert_parallel > 1:   # a rank holds 1/expert_parallel of them
        experts = model.expert_params() * len(model.moe_layers) * cfg.model.moe.num_experts
        n -= experts - experts // cfg.model.moe.expert_parallel
    muon = 0
    if cfg.optim.name == "muon":
        from trainbox.optim.muon import split_params
        muon = sum(p.numel() for _, p in split_params(model, params)["muon"])
    return n, muon


def estimate(cfg: RunConfig, vocab: int, dtype: torch.dtype = torch.float32) -> MemoryEstimate:
    """The run's memory on one device (one rank), in bytes per component; `dtype` is the compute dtype."""
    m, t = cfg.model, cfg.train
    n, muon = count_parameters(cfg, vocab)
    layers = m.n_layer + ((m.t5.num_decoder_layers or m.n_layer) if m.family == "t5" else 0)
    elements = t.micro_batch_size * cfg.data.seq_len * m.n_embd
    per_layer = ACT_BYTES * (2 if dtype == torch.float32 else 1)
    if t.activation_checkpointing == "full":
        act = elements * (4 * layers + per_layer)
    elif t.activation_checkpointing == "selective":
        act = elements * layers * per_layer // 2
    else:
        act = elements * layers * per_layer
    logits = 0 if m.fused_loss else t.micro_batch_size * cfg.data.seq_len * vocab * 4 * 2
    return MemoryEstimate(params=4 * n, gradients=4 * n, optimizer=4 * muon + 8 * (n - muon), activations=act,
                          logits=logits, n_params=n, micro_batch=t.micro_batch_size)


def available(device: torch.device) -> int | None:
    """Bytes the device has free now: MemAvailable on a CPU (Linux), free GPU memory on CUDA; None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(cfg: RunConfig, vocab: int, device: torch.device, dtype: torch.dtype,
                 free: int | None = None) -> MemoryEstimate | None:
    """Raise ConfigError when the run's estimate exceeds the device's free memory (`free`: measured if None)."""
    if not cfg.train.memory_check or cfg.model.family == "hf":
        return None
    est = estimate(cfg, vocab, dtype)
    free = available(device) if free is None else free
    if free is None or est.total <= free:
        return est
    where = "this machine's available RAM" if device.type == "cpu" else f"free on {device}"
    fits = math.floor((free - est.params - est.gradients - est.optimizer) / est.per_sample) if est.per_sample else 0
    lower = (f"lower train.micro_batch_size (at most {fits} fits by this estimate)" if fits >= 1
             else "lower train.micro_batch_size")
    raise ConfigError(
        f"this run needs about {gib(est.total)} on {device} ({est.n_params / 1e6:.1f}M parameters: weights "
        f"{gib(est.params)}, gradients {gib(est.gradients)}, optimizer state {gib(est.optimizer)}; activations "
        f"{gib(est.activations)} and logits {gib(est.logits)} at train.micro_batch_size={cfg.train.micro_batch_size}, "
        f"data.seq_len={cfg.data.seq_len}), more than the {gib(free)} {where}",
        hint=f"{lower}, or data.seq_len, or set train.activation_checkpointing=full, or train a smaller model "
             "(model.n_layer, model.n_embd); train.memory_check=false skips this check")
