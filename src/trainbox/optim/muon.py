"""Muon (`optim.name: muon`): MomentUm Orthogonalized by Newton-schulz (Keller Jordan et al., 2024).

For every hidden weight matrix W with gradient G:

    buf   <- m * buf + (1 - m) * G                      momentum (m warms up from muon_momentum_start)
    U     <- (1 - m) * G + m * buf                      Nesterov look-ahead
    O     <- zeropower(U)                               ~ the orthogonal polar factor U V^T of U = U S V^T
    W     <- (1 - lr * wd) * W - lr * sqrt(max(1, rows / cols)) * O

`zeropower` comes from ZEROPOWER: `newton_schulz5` (the quintic iteration of modded-nanogpt, in bf16 on a GPU;
its fixed coefficients trade exactness for speed: singular values land in roughly [0.7, 1.2]),
`polar_express` (Amsel et al. 2025: a different optimal polynomial per iteration) and `svd`
(the exact polar factor in fp32, the slow reference). Embeddings, the output head, norms and scalars are
not hidden matrices: they go to AdamW, each kind with its own learning rate.

Each same-shape group is orthogonalised as one batch (a batched matmul per iteration, not a loop over
matrices). Under torch.distributed, gradients are already averaged (DDP); rank r orthogonalises the r-th
of `world` equal slices of each group and the results are all-gathered, so every rank applies the same
update as one process would, for 1/world of the orthogonalisation work. Momentum buffers are kept on
every rank, so rank 0's optimizer state (the one checkpointed) is complete.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from trainbox.config import OptimSection
from trainbox.errors import ConfigError
from trainbox.optim.adamw import make_adamw

# ----------------------------------------------------------------------------- zeropower registry

ZEROPOWER: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {}

NS5_COEFFS = (3.4445, -4.7750, 2.0315)
# Polar Express, 5 iterations, safety factor 1.02 (Amsel, Persson, Musco, Gower 2025; as used in modded-nanogpt)
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def register_zeropower(name: str):
    """Add an orthogonalisation function `f(G, steps) -> O` (G of shape (..., rows, cols)) to ZEROPOWER."""
    def deco(fn):
        ZEROPOWER[name] = fn
        return fn
    return deco


def _odd_polynomial_iteration(G: torch.Tensor, coeffs: list[tuple[float, float, float]], norm_scale: float):
    """X <- a X + b (X X^T) X + c (X X^T)^2 X on the wide orientation (rows <= cols) so X X^T is small. In bf16 on a
    GPU (tensor cores); in fp32 on a CPU, whose bf16 matmuls are slower (3.3x at 32 wide, 1.3x at 96)."""
    X = G.bfloat16() if G.is_cuda else G.float()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    # spectral norm <= Frobenius norm, so after this every singular value is in [0, 1]
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * norm_scale + 1e-7)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if tall else X


@register_zeropower("newton_schulz5")
def newton_schulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Quintic Newton-Schulz with fixed coefficients (3.4445, -4.7750, 2.0315)."""
    return _odd_polynomial_iteration(G, [NS5_COEFFS] * steps, 1.0)


@register_zeropower("polar_express")
def polar_express(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Polar Express: per-iteration optimal coefficients (the last one repeats past 5 steps)."""
    coeffs = [POLAR_EXPRESS_COEFFS[min(i, len(POLAR_EXPRESS_COEFFS) - 1)] for i in range(steps)]
    return _odd_polynomial_iteration(G, coeffs, 1.02)


@register_zeropower("svd")
def svd_polar(G: torch.Tensor, steps: int = 0) -> torch.Tensor:
    """Exact polar factor U V^T from an fp32 SVD (slow; the reference the iterations approximate)."""
    U, _, Vh = torch.linalg.svd(G.float(), full_matrices=False)
    return U @ Vh


def get_zeropower(name: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    if name not in ZEROPOWER:
        raise ConfigError(f"optim.muon_zeropower={name!r} is not one of {', '.join(ZEROPOWER)}")
    return ZEROPOWER[name]


# ----------------------------------------------------------------------------- the optimizer


def momentum_at(step: int, start: float, final: float, warmup_steps: int) -> float:
    """Momentum grows linearly from `start` to `final` over the first `warmup_steps` steps."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return final
    frac = step / warmup_steps
    return (1 - frac) * start + frac * final


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices (dim >= 2; leading dims are a batch of matrices, e.g. MoE experts).

    Give one param group per parameter shape (build_muon_optimizers does), so that the distributed
    all-gather moves same-shaped tensors.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, momentum_start: float = 0.85,
                 momentum_warmup_steps: int = 300, nesterov: bool = True, weight_decay: float = 0.0,
                 zeropower: str = "newton_schulz5", ns_steps: int = 5):
        get_zeropower(zeropower)  # fail early on a bad name
        defaults = dict(lr=lr, momentum=momentum, momentum_start=momentum_start,
                        momentum_warmup_steps=momentum_warmup_steps, nesterov=nesterov,
                        weight_decay=weight_decay, zeropower=zeropower, ns_steps=ns_steps, step=0)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if any(p.dim() < 2 for p in group["params"]):
                raise ValueError("Muon only takes matrices (dim >= 2); give vectors and scalars to AdamW")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params, rank, world)
            group["step"] += 1
        return loss

    def _step_group(self, group: dict, params: list[torch.Tensor], rank: int, world: int) -> None:
        """One update of a group of same-shape matrices, orthogonalised as one batch.

        The batch of n matrices is cut into `world` equal slices (zero matrices pad the last one; their
        update is zero and is dropped): rank r orthogonalises slice r, and an all-gather gives every
        rank all n results. One batched iteration per group instead of one per matrix: a 12-layer GPT's
        72 matrices take 2 batched launches of each kernel instead of 72 small ones.
        """
        m = momentum_at(group["step"], group["momentum_start"], group["momentum"], group["momentum_warmup_steps"])
        grads = [p.grad for p in params]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            bufs.append(state["momentum_buffer"])
        torch._foreach_lerp_(bufs, grads, 1 - m)
        directions = torch._foreach_lerp(grads, bufs, m) if group["nesterov"] else bufs
        n = len(params)
        per = -(-n // world)
        batch = torch.stack(directions)
        if per * world > n:
            batch = torch.cat([batch, batch.new_zeros(per * world - n, *batch.shape[1:])])
        zeropower = get_zeropower(group["zeropower"])
        rows, cols = params[0].size(-2), params[0].size(-1)
        own = zeropower(batch[rank * per:(rank + 1) * per], group["ns_steps"])
        own = (own * math.sqrt(max(1.0, rows / cols))).to(params[0].dtype)
        if world > 1:
            gathered = own.new_empty(per * world, *own.shape[1:])
            dist.all_gather_into_tensor(gathered, own.contiguous())
            own = gathered
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])  # decoupled weight decay
        torch._foreach_add_(params, list(own[:n].unbind(0)), alpha=-group["lr"])


# ----------------------------------------------------------------------------- parameter split


def split_params(model: nn.Module, params: list[tuple[str, nn.Parameter]]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """-> {"muon": hidden matrices, "embed": embedding tables, "head": output head, "scalar": the rest}."""
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    split = defaultdict(list)
    for name, p in params:
        if id(p) in embed_ids:
            split["embed"].append((name, p))      # a tied head is the embedding: it trains as one
        elif id(p) in head_ids:
            split["head"].append((name, p))
        elif p.dim() >= 2:
            split["muon"].append((name, p))
        else:
            split["scalar"].append((name, p))
    return split


def build_muon_optimizers(model: nn.Module, params: list[tuple[str, nn.Parameter]], cfg: OptimSection,
                          device: torch.device) -> list[torch.optim.Optimizer]:
    """[Muon over hidden matrices, AdamW over embeddings (embed_lr), head (head_lr), scalars (scalar_lr)]."""

    get_zeropower(cfg.muon_zeropower)
    split = split_params(model, params)
    if not split["muon"]:
        raise ConfigError("optim.name=muon but the model has no hidden matrices to give Muon",
                          hint="use optim.name=adamw for this model")
    by_shape = defaultdict(list)  # one group per shape: the distributed all-gather needs equal shapes
    for _, p in split["muon"]:
        by_shape[tuple(p.shape)].append(p)
    muon = Muon([dict(params=ps) for ps in by_shape.values()], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                momentum_start=cfg.muon_momentum_start, momentum_warmup_steps=cfg.muon_momentum_warmup_steps,
                weight_decay=cfg.weight_decay, zeropower=cfg.muon_zeropower, ns_steps=cfg.muon_ns_steps)
    lrs = dict(embed=cfg.embed_lr or cfg.lr, head=cfg.head_lr or cfg.lr, scalar=cfg.scalar_lr or cfg.lr)
    groups = [dict(params=[p for _, p in split[kind]], lr=lrs[kind],
                   weight_decay=0.0 if kind == "scalar" else cfg.weight_decay, name=kind)
              for kind in ("embed", "head", "scalar") if split[kind]]
    return [muon, make_adamw(groups, cfg, device)] if groups else [muon]
