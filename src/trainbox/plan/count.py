"""Parameters of a run's model, counted exactly from a build on the meta device (shapes, no storage), and
split the ways the memory plan needs: trainable or frozen, expert or dense, owned by Muon or by AdamW, inside
the transformer blocks (the units that FSDP shards and activation checkpointing wraps) or outside them.

No family needs a parameter formula here: whatever `model.spec.build_model` builds is counted. A parameter is
an expert parameter when it lives in a `model.moe.GroupedLinear` (the stacked experts) or under a module path
component holding "expert" (other MoE layouts); the router is dense.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from trainbox.config import RunConfig
from trainbox.model.build import build_model, context_length
from trainbox.model.moe.experts import GroupedLinear
from trainbox.model.spec import family
from trainbox.optim.muon import split_params
from trainbox.parallel import apart, heads


@dataclass(frozen=True)
class Shapes:
    """The widths of one transformer block, read from the built model (decoder families without a formula of
    their own: their attention and MLP projections, by Hugging Face's Llama names where they exist)."""
    d: int              # model width
    q: int              # query (and attention output) width: heads x head width
    kv: int             # key (= value) width; < q under grouped-query attention
    ffn: int            # MLP hidden width
    gated: bool         # SwiGLU-style MLP (gate, up, down) rather than up, down
    heads: int
    lora_in: int = 0    # LoRA: the input widths of the adapted projections, summed
    lora_r: int = 0     # ... and their ranks, summed
    qk_norm: bool = False   # an RMSNorm over each head of q and of k (Qwen3's q_norm, k_norm)


# the names of a block's projections: Hugging Face's Llama (q_proj, ...) and torchtitan's (wq, w1, ...)
NAMES = {"q": ("q_proj", "wq"), "k": ("k_proj", "wk"), "gate": ("gate_proj", "w1"), "up": ("up_proj", "w3")}


@dataclass(frozen=True)
class ParamCount:
    total: int          # every parameter, tied ones once
    trainable: int      # requires_grad: these get gradients and optimizer state
    expert: int         # trainable parameters inside MoE experts (split over model.moe.expert_parallel ranks)
    muon: int           # trainable parameters Muon owns (optim.name=muon): one fp32 momentum each
    blocks: int         # parameters inside the transformer blocks (all of them)
    largest_block: int  # the largest block: one FSDP unit, gathered whole
    n_blocks: int
    frozen: int         # frozen parameters (a LoRA run's base)
    matmul: int         # trainable weights that matmuls read (autocast keeps a 16-bit copy of each)
    blocks_matmul: int  # of those, the ones inside the blocks
    apart: int = 0      # outside the blocks in FSDP units of their own (parallel/fsdp.apart: an untied table)
    head: int = 0       # an untied head: a unit of its own too (parallel.heads), gathered when it runs, then kept
    #                     gathered to its backward like the root, so counted in `root`
    head_frozen: bool = False   # the output head's weight does not train (a LoRA base's)
    frozen_linear: int = 0      # frozen weights of linear layers other than the output head: what 4/8-bit loading
    #                             quantizes (bitsandbytes through transformers keeps the head as it is)
    shapes: Shapes | None = None
    flops_per_token: float = 0.0   # the model's own training FLOPs per token at data.seq_len (0: it has none)

    @property
    def dense(self) -> int:
        """Trainable parameters outside the experts."""
        return self.trainable - self.expert

    @property
    def root(self) -> int:
        """Parameters outside the blocks and the units apart: final norm, head, a tied table, other embeddings."""
        return self.total - self.blocks - self.apart

    def as_dict(self) -> dict:
        return asdict(self)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the family's checkpoint_units(), else its longest ModuleList."""
    units = getattr(model, "checkpoint_units", None)
    if callable(units):
        return list(units())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _is_expert(name: str, module_path: list[nn.Module]) -> bool:
    if any(isinstance(m, GroupedLinear) for m in module_path):
        return True
    return any("expert" in part.lower() for part in name.split(".")[:-1])


def _named_with_modules(model: nn.Module):
    """(name, parameter, [modules from the root to its owner]) for every parameter, tied ones once."""
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str, path: list[nn.Module]):
        for pname, p in module.named_parameters(recurse=False):
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield f"{prefix}{pname}", p, [*path, module]
        for cname, child in module.named_children():
            yield from walk(child, f"{prefix}{cname}.", [*path, module])

    yield from walk(model, "", [])


def shapes_of(block: nn.Module, cfg) -> Shapes:
    """A block's widths by its projections' names (NAMES), or by the config's n_embd / n_head and an MLP of
    4 x n_embd where those names are missing."""
    lin: dict[str, nn.Linear] = {}
    lora_in = lora_r = 0
    for name, m in block.named_modules():
        if isinstance(m, nn.Linear) and ".lora_" not in name:   # a LoRA-wrapped projection: its base_layer
            lin[name.replace(".base_layer", "").rsplit(".", 1)[-1]] = m
        base = getattr(m, "base_layer", None)
        if isinstance(base, nn.Linear) and hasattr(m, "lora_A"):
            lora_in += base.in_features
            lora_r += sum(a.out_features for a in m.lora_A.values())

    def find(kind: str) -> nn.Linear | None:
        return next((lin[n] for n in NAMES[kind] if n in lin), None)

    q, k, gate, up = find("q"), find("k"), find("gate"), find("up")
    d = q.in_features if q is not None else cfg.n_embd
    heads = cfg.n_head
    hf = getattr(getattr(block, "self_attn", None), "config", None)
    if hf is not None:
        heads = getattr(hf, "num_attention_heads", heads)
    return Shapes(d=d, q=q.out_features if q is not None else d, kv=(k or q).out_features if (k or q) else d,
                  ffn=up.out_features if up is not None else 4 * d, gated=gate is not None and up is not None,
                  heads=heads, lora_in=lora_in, lora_r=lora_r,
                  qk_norm=any(name.rsplit(".", 1)[-1] == "q_norm" for name, _ in block.named_modules()))


def build_meta(cfg: RunConfig, vocab: int) -> nn.Module:
    """The run's model on the meta device, with every expert present (model.moe.expert_parallel=1). The fused
    kernels' switches are off: they change no parameter, and their compiler registrations take seconds."""
    spec = family(cfg.model.family)
    update = {"fused_norm": False, "fused_mlp": False}
    if spec.supports("eot_id") and cfg.model.eot_id is None:
        update["eot_id"] = 0
    if spec.experts:
        update["moe"] = cfg.model.moe.model_copy(update={"expert_parallel": 1})
    model_cfg = cfg.model.model_copy(update=update)
    run = cfg.model_copy(update={"model": model_cfg})
    own = spec.hook("build_meta")   # a family that builds from its own description (hf: a folder's config.json)
    if own is not None:
        return own(run)
    with torch.device("meta"):
        return build_model(model_cfg, vocab, context_length(run), run=run)


@functools.lru_cache(maxsize=32)
def _count_cached(cfg_json: str, vocab: int) -> ParamCount:
    return _count(RunConfig.model_validate_json(cfg_json), vocab)


def count_parameters(cfg: RunConfig, vocab: int) -> ParamCount:
    """The parameters of the run's model (cached per config: the suggestions ask the same model many times)."""
    keep = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": 1})})
    return _count_cached(keep.model_dump_json(), vocab)


def _count(cfg: RunConfig, vocab: int) -> ParamCount:
    model = build_meta(cfg, vocab)
    params = list(_named_with_modules(model))
    trainable = [(n, p, path) for n, p, path in params if p.requires_grad]
    muon = 0
    if cfg.optim.name == "muon":
        muon = sum(p.numel() for _, p in split_params(model, [(n, p) for n, p, _ in trainable])["muon"])
    blocks = blocks_of(model)
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    matmul = _matmul_weights(model)
    shapes = shapes_of(blocks[0], cfg.model) if blocks else None
    flops = getattr(model, "flops_per_token", None)
    return ParamCount(
        total=sum(p.numel() for _, p, _ in params),
        trainable=sum(p.numel() for _, p, _ in trainable),
        expert=sum(p.numel() for n, p, path in trainable if _is_expert(n, path)),
        muon=muon, blocks=sum(sizes), largest_block=max(sizes, default=0), n_blocks=len(blocks),
        frozen=sum(p.numel() for _, p, _ in params if not p.requires_grad),
        matmul=sum(p.numel() for p in matmul.values() if p.requires_grad),
        blocks_matmul=sum(p.numel() for i, p in matmul.items() if p.requires_grad and i in in_blocks),
        apart=sum(p.numel() for m in apart(model) for p in m.parameters()),
        head=sum(p.numel() for m in heads(model) for p in m.parameters()), shapes=shapes,
        head_frozen=any(not m.weight.requires_grad for name, m in model.named_modules()
                        if name.rsplit(".", 1)[-1] == "lm_head" and isinstance(m, nn.Linear)),
        frozen_linear=sum(m.weight.numel() for name, m in model.named_modules()
                          if isinstance(m, nn.Linear) and not m.weight.requires_grad
                          and name.rsplit(".", 1)[-1] != "lm_head"),
        flops_per_token=float(flops(cfg.data.seq_len)) if callable(flops) else 0.0)


def _matmul_weights(model: nn.Module) -> dict[int, nn.Parameter]:
    """The weights matmuls read: those of linear layers (and stacked experts) and an output head tied to an
    embedding; embedding tables read by lookup alone are not among them."""
    out = {id(m.weight): m.weight for m in model.modules() if isinstance(m, (nn.Linear, GroupedLinear))}
    return {i: p for i, p in out.items() if p.dim() >= 2}
