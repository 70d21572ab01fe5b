"""AdamW as every run builds it: weight decay on matrices only, fused on CUDA; with `optim.state_dtype: bf16`,
its two moments stored in bfloat16 (`BF16StateAdamW`).

A group that holds both FSDP2's DTensors and plain tensors (the dense part and the experts under expert
parallelism with fsdp) is stepped as two (`SplitAdamW`): torch's fused and foreach kernels take a list of one kind.

BF16StateAdamW keeps exp_avg and exp_avg_sq in bfloat16, 4 bytes of state a parameter instead of 8, while the
parameters stay fp32 master weights and the update stays fp32: each step reads the moments into fp32, runs
torch.optim.AdamW's own foreach arithmetic on them (decoupled weight decay, lerp of the first moment, the bias
corrections, eps outside the square root), updates the parameters with the fp32 moments and writes the moments
back rounded stochastically (`round_stochastic_`). Rounding to nearest (of v, or of sqrt(v)) loses every step's
change to a moment that is under half of bfloat16's spacing (2^-9 to 2^-8 of it): with beta2 = 0.999 (the lora
and dpo recipes) exp_avg_sq stops following gradients that shrink or grow, and the steps come out too small or
too large. A stochastic rounding is right in expectation, so the moments follow the fp32 ones at any beta, for a
little more noise a step. benchmarks/optim_state.py runs a recipe with fp32 and with bf16 state side by side.

On CUDA each parameter's step is one Triton kernel (kernels/adamw.py): the same arithmetic in registers, 20 bytes
a parameter read and written, against 28 for torch's fused fp32 AdamW; its random bits come from Philox keyed by
(step, group, parameter). Elsewhere (the CPU, a parameter the kernel does not take) torch's foreach ops update the
moments in pieces of at most CHUNK elements, grouped by device and dtype, so the fp32 working copies stay small
beside the state of billions of parameters; the random bits of a piece come from a generator seeded by (step,
group, parameter, piece). Either way, replicas of a parameter (DDP, the dense weights under expert
parallelism) round alike, and a resumed run rounds as the uninterrupted one. Sharded parameters (FSDP2's
DTensors) are updated through their local shards, the state kept as DTensors like the parameters' for sharded
checkpoints. The state keeps torch.optim.AdamW's keys (step, exp_avg, exp_avg_sq), so a checkpoint moves
between optim.state_dtype fp32 and bf16.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from trainbox.config import OptimSection
from trainbox.kernels import adamw as fused_adamw

MOMENTS = ("exp_avg", "exp_avg_sq")
# elements a foreach call updates together: the fp32 working copies (moments, bits) stay under 1 GiB
CHUNK = 1 << 26


def adamw_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float, lr: float) -> list[dict]:
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=weight_decay, lr=lr), dict(params=no_decay, weight_decay=0.0, lr=lr)]
    return [g for g in groups if g["params"]]


def state_sizes(opt: torch.optim.Optimizer, p: torch.Tensor) -> list[int]:
    """The bytes of each tensor of state `opt` will keep for a parameter whose local tensor is `p`, once it steps:
    AdamW's moments (two, three with amsgrad; in bfloat16 under BF16StateAdamW, else in p's dtype), none for an
    optimizer not known here. The scalar step is left out."""
    if isinstance(opt, BF16StateAdamW):
        return [p.numel() * 2] * len(MOMENTS)
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return [p.nbytes] * (len(MOMENTS) + bool(opt.defaults.get("amsgrad")))
    return []


def make_adamw(groups: list[dict], cfg: OptimSection, device: torch.device) -> torch.optim.Optimizer:
    if cfg.state_dtype == "bf16":
        return BF16StateAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    # fused AdamW is one kernel per step on CUDA; on CPU the default foreach path is exact and fast enough
    fused = device.type == "cuda"
    kind = SplitAdamW if any(len({_is_dtensor(p) for p in g["params"]}) > 1 for g in groups) else torch.optim.AdamW
    return kind(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)


class SplitAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step updates each group's DTensors and plain tensors as two groups with the group's
    hyper-parameters. The groups stay as built (the learning-rate schedule, checkpoints and their resume see the
    groups they always saw); only the step sees them split."""

    @torch.no_grad()
    def step(self, closure=None):
        built = self.param_groups
        self.param_groups = [{**g, "params": ps} for g in built
                             for ps in ([p for p in g["params"] if _is_dtensor(p)],
                                        [p for p in g["params"] if not _is_dtensor(p)]) if ps]
        try:
            return super().step(closure)
        finally:
            self.param_groups = built


def _is_dtensor(t: torch.Tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def round_stochastic_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator) -> None:
    """dst (bfloat16) <- src (fp32) rounded to one of its two bfloat16 neighbours, away from zero with probability
    (the 16 bits bfloat16 drops) / 2^16: right in expectation. Adds 16 random bits below bfloat16's last bit of the
    fp32 pattern and truncates them; the copy into dst is then exact."""
    bits = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    bits.add_(src.view(torch.int32)).bitwise_and_(-(1 << 16))
    dst.copy_(bits.view(torch.float32))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else `t`. DTensor is looked up where it is loaded: a process that never loaded
    torch.distributed.tensor (most of a second of imports) holds no DTensor."""
    return t.to_local() if _is_dtensor(t) else t


def _pieces(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A parameter's (param, grad, exp_avg, exp_avg_sq) as aligned flat pieces of at most CHUNK elements (whole
    when one of them is not contiguous)."""
    if tensors[0].numel() <= CHUNK or not all(t.is_contiguous() for t in tensors):
        return [tensors]
    return [list(piece) for piece in zip(*(t.view(-1).split(CHUNK) for t in tensors))]


class BF16StateAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (decoupled weight decay) with its moments stored in bfloat16; see the module docstring."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fused = fused   # one Triton kernel a parameter where kernels/adamw.py can run it (CUDA)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device].manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, group in enumerate(self.param_groups):
            work = []   # (key of the piece's random bits, [param, grad, exp_avg, exp_avg_sq], step)
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in MOMENTS:
                        state[name] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                if self.fused and fused_adamw.available(tensors[0], tensors[1]):
                    fused_adamw.adamw_bf16_state_(
                        *tensors, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                        weight_decay=group["weight_decay"], step=step, seed=_seed((step, g, i, 0), 0))
                    continue
                work += [((step, g, i, k), piece, step) for k, piece in enumerate(_pieces(tensors))]
            for chunk in _chunks(work):
                self._update(group, chunk)
        return loss

    def _update(self, group: dict, work: list) -> None:
        """torch.optim.AdamW's foreach step (_multi_tensor_adam, decoupled weight decay, CPU step counts) on fp32
        copies of the moments, which then go back to bfloat16. `work`: pieces of one device and dtype."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        params, grads, exp_avgs, exp_avg_sqs = (list(ts) for ts in zip(*(piece for _, piece, _ in work)))
        params32 = [p.float() for p in params]   # the parameters themselves where they are fp32
        grads = [t.float() for t in grads]
        m = [t.float() for t in exp_avgs]
        v = [t.float() for t in exp_avg_sqs]
        if wd != 0:
            torch._foreach_mul_(params32, 1 - lr * wd)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        del grads
        for moment, (fp32, stored) in enumerate(((m, exp_avgs), (v, exp_avg_sqs))):
            for (key, _, _), src, dst in zip(work, fp32, stored):
                round_stochastic_(dst, src, self._generator(src.device, _seed(key, moment)))
        steps = [step for _, _, step in work]
        step_size = [-(lr / (1 - beta1 ** s)) for s in steps]
        bias_correction2_sqrt = [(1 - beta2 ** s) ** 0.5 for s in steps]
        torch._foreach_sqrt_(v)
        torch._foreach_div_(v, bias_correction2_sqrt)
        torch._foreach_add_(v, eps)
        torch._foreach_addcdiv_(params32, m, v, step_size)
        for p, p32 in zip(params, params32):
            if p32 is not p:
                p.copy_(p32)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim.Optimizer's, the moments kept (or made) bfloat16: torch casts every floating state to its
        parameter's dtype, which would hold the whole state in fp32 at once. The step count goes to the CPU (fused
        AdamW keeps it on the GPU), where reading it costs no device sync."""
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {k: {n: v for n, v in s.items() if n not in MOMENTS}
                                                         for k, s in saved.items()}})
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = dict(zip(ids, (p for group in self.param_groups for p in group["params"])))
        for k, s in saved.items():
            p = params[k]
            if isinstance(s.get("step"), torch.Tensor):
                self.state[p]["step"] = s["step"].to(device="cpu", dtype=torch.float32)
            for name in MOMENTS:
                if name in s:
                    self.state[p][name] = s[name].to(device=p.device, dtype=torch.bfloat16)


def _seed(key: tuple[int, int, int, int], moment: int) -> int:
    """A generator seed (under 2^63) for one moment of one piece at one step."""
    step, group, index, piece = key
    return ((((step * 1_000_003 + group) * 1_000_003 + index) * 4099 + piece) * 2 + moment) % (1 << 63)


def _chunks(work: list) -> list[list]:
    """The pieces grouped by device and dtype, cut into runs of at most CHUNK elements."""
    by_kind: dict[tuple, list] = {}
    for w in work:
        p = w[1][0]
        by_kind.setdefault((p.device, p.dtype), []).append(w)
    out = []
    for items in by_kind.values():
        run, size = [], 0
        for w in items:
            n = w[1][0].numel()
            if run and size + n > CHUNK:
                out.append(run)
                run, size = [], 0
            run.append(w)
            size += n
        out.append(run)
    return out
