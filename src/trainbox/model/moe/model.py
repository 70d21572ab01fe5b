"""Mixture-of-Experts GPT (`model.family: moe`): GPT-2 whose MLPs become routed expert FFNs.

Architecture choices (Switch Transformer, GShard, MegaBlocks, Megatron-Core), all set in `model.moe`:
- the dense GPT-2 of `gpt.py` (attention, norms, embeddings, KV cache) with block i's MLP replaced
  by an MoE FFN when i % every == 0 (Megatron's `moe_layer_freq`); other blocks keep the dense MLP;
- router: a bias-free linear map to `num_experts` logits, run in fp32; during training the router
  input is multiplied by uniform(1 - jitter_eps, 1 + jitter_eps) noise (Switch);
- top-k of the softmax probabilities; with k > 1 the k gates are renormalised to sum to 1 (Mixtral,
  Megatron's default), with k = 1 the gate is the raw probability, so the router still learns (Switch);
- experts: GPT-2 MLPs (d -> 4d, GELU(tanh), 4d -> d) stored stacked, (E, in, out), Conv1D layout;
- capacity: 0 = dropless. Otherwise each expert takes at most int(capacity_factor * top_k * T / E) of
  the micro-batch's T tokens, in GShard's priority order (every token's first choice before any
  second choice, earlier tokens first); a dropped assignment contributes nothing, so a token whose
  every assignment is dropped passes through the residual unchanged. Capacity applies in training
  only; evaluation and generation are dropless (a one-token decode step would otherwise drop all);
- losses: load balancing (E / (T * k)) * sum_i count_i * mean_prob_i per layer (MegaBlocks/Switch,
  1.0 at perfect balance) and the router z-loss mean(logsumexp(logits)^2) (ST-MoE), each averaged
  over MoE layers, weighted by lb_loss_weight / z_loss_weight and returned as `Output.aux_loss`.

Dispatch is vectorised: assignments are sorted by expert (a stable sort keeps the priority order), the
experts run as two grouped matmuls over the sorted rows (experts.py: `torch.nn.functional.grouped_mm` /
`torch._grouped_mm`; a loop over experts only where neither exists or the widths are not 16-byte aligned;
the second takes the GELU inside its autograd function, whose backward is one GELU-derivative pass over the
hidden; with model.fused_mlp on Hopper/Blackwell GPUs, QuACK's variable-length grouped GEMMs with the GELU
and its derivative in their epilogues, fused_mlp.moe_gelu_mlp), and the weighted results are gathered back
to token order; every index in the layer has an explicit gather (or one-hot matmul) backward, so no step
runs atomic scatter-adds. Shapes never depend on the
routing, so the layer compiles to one graph without host syncs. Dropped assignments are still computed with
gate 0: grouped matmuls cost T * k rows whatever the balance, fewer than a capacity-padded E * C buffer
whenever capacity_factor >= 1.

With `model.moe.expert_parallel` > 1 a rank holds a shard of the experts and `MoEFFN.parallel` runs them across
ranks (trainbox/parallel/expert.py: the kept rows, or with model.moe.exchange=padded capacity-sized buffers that
`experts_padded` runs as batched matmuls); routing, drops and losses stay this rank's own. Hugging Face has no GPT-2
MoE class: `trainbox export RUN --format hf` writes this family's own folder (`save_pretrained`), which
`from_pretrained` loads.

    trainbox train moe-gpt2-125m data.path=PREFIX model.moe.num_experts=64
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainbox.kernels.fused_mlp import moe_gelu_mlp
from trainbox.model.gpt.model import GPT
from trainbox.model.layers import KVCache, Output, autocast_dtype, gelu_tanh
from trainbox.model.moe.experts import GroupedLinear, recomputed

# Autograd turns an indexing `a[idx]` into a scatter-add (`index_put_(accumulate=True)`) in the backward: one atomic
# add per element, k*N rows landing on N. The two functions below state the backward of the layer's dispatch and
# combine explicitly, as gathers (experts.py's _ExpertBias does the same for the expert biases).


class _Dispatch(torch.autograd.Function):
    """Token rows -> assignment rows in expert order: out[p] = x[src[p]] (each token k times).

    src = token[order] and inverse = order^-1, so assignment a = j * N + n (token n's j-th choice) sits
    at row inverse[a]. Backward: token n's gradient is the sum of its k rows, gathered by `inverse`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(src, inverse)
        ctx.k = k
        return x[src]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        src, inverse = ctx.saved_tensors
        return _Combine.apply(g, src, inverse, ctx.k), None, None, None


class _Combine(torch.autograd.Function):
    """Assignment rows in expert order -> token rows: y[n] = sum_j h[inverse[j * N + n]] (the adjoint of
    _Dispatch). Backward: every row gets its token's gradient, gathered by `src`."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, src: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(src, inverse)
        ctx.k = k
        return h[inverse].view(k, -1, h.size(-1)).sum(dim=0)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        src, inverse = ctx.saved_tensors
        return _Dispatch.apply(g, src, inverse, ctx.k), None, None, None


def top_k(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs.topk(k) for a handful of experts as k max-reductions, which Inductor fuses into the router's
    softmax kernel (topk is a sort: two library kernels per layer and micro-batch)."""
    values, ids = [], []
    for _ in range(k):
        v, i = probs.max(dim=-1, keepdim=True)
        values.append(v)
        ids.append(i)
        probs = probs.scatter(-1, i, -1.0)  # below every probability: not chosen twice
    return torch.cat(values, dim=-1), torch.cat(ids, dim=-1)


class Sorted(NamedTuple):
    """A micro-batch's assignment rows sorted by expert, as the experts' dispatch sees them (priority order kept
    within each expert)."""

    expert: torch.Tensor            # (k*N,) each row's expert
    slot: torch.Tensor              # (k*N,) its place in its expert's group: the row is kept while slot < capacity
    counts: torch.Tensor            # (E,) rows routed to each expert
    kept: torch.Tensor              # (E,) rows each expert takes: counts, clamped to the capacity
    keep: torch.Tensor | None       # (k*N,) whether each row is kept (None: dropless)
    capacity: int | None            # rows an expert takes from this micro-batch (None: dropless)


class MoEFFN(nn.Module):
    """Router + top-k + capacity + experts. forward(x) -> y; `self.aux` holds this call's losses/stats."""

    fp32_input = True  # model.fused_norm: the norm before it returns fp32, for the fp32 router (as unfused)

    def __init__(self, n_embd: int, moe, bias: bool, dropout: float, fused: bool = False):
        super().__init__()
        self.moe = moe
        self.fused = fused and not bias  # model.fused_mlp: the experts as one op (fused_mlp.moe_gelu_mlp)
        self.router = nn.Linear(n_embd, moe.num_experts, bias=False)
        self.c_fc = GroupedLinear(moe.num_experts, n_embd, 4 * n_embd, bias)
        self.c_proj = GroupedLinear(moe.num_experts, 4 * n_embd, n_embd, bias)
        self.dropout = nn.Dropout(dropout)
        self.use_kernel = True  # tests switch to the loop-over-experts path
        self.recompute = False  # train.activation_checkpointing=experts (train/recompute.py): see experts()
        self.parallel = None    # set by trainbox.parallel.expert.shard_experts: this rank holds a shard of the experts
        self.aux: dict[str, torch.Tensor] = {}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, C) -> router logits (N, E) fp32, top-k expert ids (N, k), gates (N, k) fp32."""
        if self.training and self.moe.jitter_eps > 0:
            eps = self.moe.jitter_eps
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        probs = logits.softmax(dim=-1)
        top_p, top_e = top_k(probs, self.moe.top_k)
        gates = top_p / top_p.sum(dim=-1, keepdim=True) if self.moe.top_k > 1 else top_p
        return logits, top_e, gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        E, k = self.moe.num_experts, self.moe.top_k
        xf = x.reshape(-1, C)
        N = xf.size(0)
        logits, top_e, gates = self.route(xf)
        # assignment a = j * N + n is token n's j-th choice: this flat order is GShard's drop priority
        expert = top_e.t().reshape(-1)                                   # (k*N,)
        token = torch.arange(N, device=x.device).repeat(k)               # (k*N,)
        counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, expert, torch.ones_like(expert))
        # sorted by expert, priority kept; one-byte keys: a radix sort of one pass, not eight
        order = torch.argsort(expert.to(torch.uint8 if E <= 256 else torch.int32), stable=True)
        sorted_e = expert[order]
        offsets = counts.cumsum(0)
        slot = torch.arange(k * N, device=x.device) - (offsets - counts)[sorted_e]  # rank within its expert
        weight = gates.t().reshape(-1)[order]                            # (k*N,) fp32
        keep, kept, capacity = None, counts, None
        if self.training and self.moe.capacity_factor > 0:
            capacity = int(self.moe.capacity_factor * k * N / E)
            keep = slot < capacity                     # the first `capacity` rows of each expert's group
            kept = counts.clamp(max=capacity)
            weight = weight * keep
            dropped = 1.0 - keep.float().mean()
        else:
            dropped = torch.zeros((), device=x.device)
        dtype = autocast_dtype(x.device.type, x.dtype)
        src = token[order]                                               # token of each sorted row
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(k * N, device=x.device))
        rows = _Dispatch.apply(xf.to(dtype), src, inverse, k)                                    # (k*N, C)
        if self.parallel is not None:  # expert parallelism (trainbox.parallel.expert): experts on other ranks too
            h = self.parallel.experts(self, rows, Sorted(sorted_e, slot, counts, kept, keep, capacity))
        else:
            h = self.experts(rows, offsets.to(torch.int32), sorted_e)
        h = h * weight.unsqueeze(1)                                      # fp32: the gates
        y = _Combine.apply(h, src, inverse, k)                           # back to token order, sum the k
        self.aux = self._losses(logits, counts, dropped, N)
        # in the matmuls' dtype, as a Linear under autocast returns (x may be a norm's fp32 output)
        return self.dropout(y.to(dtype).view(B, T, C))

    def experts(self, rows: torch.Tensor, offsets: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (`offsets`: int32 cumulative row counts, `expert`: each row's index into this
        module's experts) -> each row through its expert's MLP. With `recompute` (experts.py's `recomputed`) only
        the rows are kept for the backward, which runs the hidden layer (c_fc and its GELU, 4C wide) again; the
        experts then run on torch's grouped matmuls, model.fused_mlp aside (its fused op keeps the hidden layer)."""
        if self.recompute and torch.is_grad_enabled():
            return recomputed(self._experts, rows, offsets, expert)
        if self.fused:
            return moe_gelu_mlp(rows, self.c_fc.weight_as(rows.dtype), self.c_proj.weight_as(rows.dtype), offsets)
        return self._experts(rows, offsets, expert)

    def _experts(self, rows: torch.Tensor, offsets: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(rows, offsets, expert, self.use_kernel)                                   # (rows, 4C)
        return self.c_proj(h, offsets, expert, self.use_kernel, gelu=True)                      # (rows, C)

    def experts_padded(self, x: torch.Tensor) -> torch.Tensor:
        """Equal groups of rows, x (experts, rows, C) -> each group through its expert's MLP (experts, rows, C), as
        two batched matmuls (equal groups need no offsets, so nothing is read on the host); with `recompute`, as
        `experts` says."""
        if self.recompute and torch.is_grad_enabled():
            return recomputed(self._experts_padded, x)
        El, R, C = x.shape
        if self.fused:   # QuACK's grouped GEMMs with offsets built on the device: every group R rows
            offsets = torch.arange(1, El + 1, device=x.device, dtype=torch.int32) * R
            w1, w2 = self.c_fc.weight_as(x.dtype), self.c_proj.weight_as(x.dtype)
            return moe_gelu_mlp(x.reshape(El * R, C), w1, w2, offsets).view(El, R, C)
        return self._experts_padded(x)

    def _experts_padded(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.bmm(x, self.c_fc.weight_as(x.dtype))                                          # (El, R, 4C)
        if self.c_fc.bias is not None:
            h = h + self.c_fc.bias.to(h.dtype).unsqueeze(1)
        y = torch.bmm(gelu_tanh(h), self.c_proj.weight_as(h.dtype))                             # (El, R, C)
        if self.c_proj.bias is not None:
            y = y + self.c_proj.bias.to(y.dtype).unsqueeze(1)
        return y

    def _losses(self, logits: torch.Tensor, counts: torch.Tensor, dropped: torch.Tensor, N: int) -> dict:
        E, k = self.moe.num_experts, self.moe.top_k
        mean_prob = logits.softmax(dim=-1).mean(dim=0)                  # (E,) differentiable
        balance = E / (N * k) * (counts.to(mean_prob.dtype) * mean_prob).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        return {"balance": balance, "z": z, "tokens_per_expert": counts.detach(), "dropped": dropped.detach()}


class MoEGPT(GPT):
    """GPT-2 with MoE FFNs in every `model.moe.every`-th block; forward adds aux_loss and stats."""

    family = "moe"
    masks_attention = False   # its forward takes no mask: routing sees whole rows

    def __init__(self, cfg, vocab_size: int, block_size: int):
        every = cfg.moe.every
        super().__init__(cfg, vocab_size, block_size,
                         make_mlp=lambda i: MoEFFN(cfg.n_embd, cfg.moe, cfg.bias, cfg.dropout, cfg.fused_mlp)
                         if i % every == 0 else None)
        self.moe_layers = [(i, b.mlp) for i, b in enumerate(self.transformer.h) if isinstance(b.mlp, MoEFFN)]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                caches: list[KVCache] | None = None, pos: int = 0, reduction: str = "mean",
                logits_to_keep: int = 1) -> Output:
        x = self.hidden(idx, caches, pos)
        if targets is None:  # inference: the last `logits_to_keep` positions' logits (0: all)
            return Output(logits=self.lm_head(x[:, -logits_to_keep:, :]))
        loss = self.head_loss(x, targets, loss_mask, reduction)
        aux = [m.aux for _, m in self.moe_layers]
        balance = torch.stack([a["balance"] for a in aux]).mean()
        z = torch.stack([a["z"] for a in aux]).mean()
        stats = {"moe_balance_loss": balance.detach(), "moe_z_loss": z.detach()}
        for (i, _), a in zip(self.moe_layers, aux):
            stats[f"moe.{i}.tokens_per_expert"] = a["tokens_per_expert"]
            stats[f"moe.{i}.balance_loss"] = a["balance"].detach()
            stats[f"moe.{i}.dropped_frac"] = a["dropped"]
        return Output(loss=loss, aux_loss=self.cfg.moe.lb_loss_weight * balance + self.cfg.moe.z_loss_weight * z,
                      stats=stats)

    def num_params(self, exclude_positions: bool = True) -> int:
        """Parameters of the whole model, the experts other ranks hold under expert parallelism included."""
        held = sum(m.c_fc.weight.size(0) for _, m in self.moe_layers)
        missing = len(self.moe_layers) * self.cfg.moe.num_experts - held
        return super().num_params(exclude_positions) + missing * self.expert_params()

    def expert_params(self) -> int:
        """Parameters of one expert (both linears, with biases), the same in every MoE layer."""
        m = self.moe_layers[0][1]
        return sum(p[0].numel() for lin in (m.c_fc, m.c_proj) for p in lin.parameters())

    def num_active_params(self) -> int:
        """Parameters used per token: everything except the (E - k) experts a token skips in each MoE layer."""
        skipped = (self.cfg.moe.num_experts - self.cfg.moe.top_k) * self.expert_params() * len(self.moe_layers)
        return self.num_params() - skipped

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active parameters (top_k experts, router included) plus attention, 12 * L * d * T."""
        return 6 * self.num_active_params() + 12 * self.cfg.n_layer * self.cfg.n_embd * seq_len


def build(cfg, vocab_size: int, block_size: int, run=None) -> MoEGPT:
    return MoEGPT(cfg, vocab_size, block_size)


# Hugging Face transformers has no GPT-2 MoE class: `trainbox export RUN --format hf` of an moe run writes this
# family's own folder, config.json + model.safetensors (+ the tokenizer), and `from_pretrained` reads it.
FORMAT = "trainbox-moe"
