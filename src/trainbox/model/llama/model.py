"""Llama family (`model.family: llama`): Llama 2/3, Mistral, Qwen2 and Qwen3 models, parameter names as Hugging
Face's LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

    trainbox train llama-1b data.path=PREFIX                        # Llama 3.2 1B shape, random init
    trainbox train sft model.path=FOLDER data.path=chat.jsonl       # full fine-tuning of a HF folder

Architecture (Touvron et al. 2023, Llama 3 2024): token embedding; pre-RMSNorm blocks of grouped-query
attention (`model.llama.n_kv_head` key/value heads, each shared by n_head / n_kv_head query heads) with
rotary positions, and a SwiGLU MLP, down(silu(gate(x)) * up(x)); a final RMSNorm; an output head, untied
unless `model.llama.tie_embeddings`. No biases, except Qwen2's on q, k and v (`model.llama.qkv_bias`). Qwen3
normalizes each head of q and k (an RMSNorm over the head's width) before the rotation (`model.llama.qk_norm`).

RoPE rotates the two halves of each head against each other (Hugging Face's rotate_half convention), so
q_proj and k_proj load from and export to Hugging Face folders as they are, with no permutation of their
rows. Llama 3.1's frequency scaling (`model.llama.rope_scaling.rope_type=llama3`) stretches the low
frequencies. The angles are computed once per forward from the positions, for all layers, outside any compiled
graph (no tables kept in buffers, so a model built on the meta device needs nothing recomputed). Attention is PyTorch
SDPA with enable_gqa (k and v are never repeated in memory); with `model.fused_loss` the head and the cross-entropy
are one function that never keeps the logits, as in the gpt family.

Packed rows (data.packing: several fine-tuning examples in one row, data/packing.py) come with `doc_ids` and
`position_ids`: RoPE rotates each token by its position inside its example, and attention stays inside each
example (kernels/packed.py: FlashAttention-4's variable-length kernels, a FlexAttention document mask, or SDPA with
a block-diagonal mask, as kernels/choice.py `packed_on` picks), so every example computes what it computes alone.

Each block is one module of `model.layers` (`checkpoint_units()`): activation checkpointing and
per-block sharding wrap them. With `model.path` set, the run takes its shape, tokenizer and initial
weights from that Hugging Face folder and reads chat JSONL through the fine-tuning data path (data/sft.py)
with assistant-only loss: `resolve`, `tokenizer` and `open_datasets` below; without it they are those of
every pretraining family. Conversion to and from Hugging Face folders: model/llama_hf.py.
"""
from __future__ import annotations

import math
from itertools import chain

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainbox.data.sft import load_hf_tokenizer, open_finetuning_datasets
from trainbox.data.sft import reads_examples as sft_examples
from trainbox.data.sources import open_datasets as open_token_datasets
from trainbox.data.tokenizer import get_tokenizer
from trainbox.kernels.choice import packed_on
from trainbox.kernels.flash import half_precision
from trainbox.kernels.fused_ce import head_cross_entropy
from trainbox.kernels.packed import DocMask, doc_attention, doc_mask
from trainbox.model.layers import (
    KVCache,
    Output,
    RMSNorm,
    cached_attention,
    cross_entropy,
    init_normal_,
    scaled_residual_init_,
)
from trainbox.model.llama.config import head_dim, intermediate_size, tokenizer_spec
from trainbox.model.llama.hf import folder_context, resolve_from_folder
from trainbox.model.spec import family


def rope_frequencies(dim: int, theta: float, scaling, device=None) -> torch.Tensor:
    """The (dim / 2,) inverse frequencies of RoPE, with Llama 3.1's scaling when scaling.rope_type is llama3:
    wavelengths longer than original / low_freq_factor are stretched by `factor`, shorter than original /
    high_freq_factor kept, and those between interpolated smoothly (as Hugging Face's llama3 rope)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    if scaling.rope_type == "none":
        return inv
    old, lo, hi = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / scaling.factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by the (T, D/2) angles, or (B, 1, T, D/2) ones of packed rows: the first half of each
    head against the second (rotate_half)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, head_dim: int, qkv_bias: bool,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.q_proj = nn.Linear(n_embd, n_head * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(n_embd, n_kv_head * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(n_embd, n_kv_head * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_head * head_dim, n_embd, bias=False)
        if qk_norm_eps is not None:   # Qwen3: each head of q and k normalized over its width
            self.q_norm, self.k_norm = RMSNorm(head_dim, qk_norm_eps), RMSNorm(head_dim, qk_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                pos: int = 0, docs: DocMask | None = None, attend: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, H * D) -> (B, T, H, D), each head normalized where the model does (qk_norm), -> (B, H, T, D)
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cached_attention(q, k, v, cache, pos, attend) if docs is None else doc_attention(q, k, v, docs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Head(nn.Linear):
    """The output head (no bias). head(x) gives the logits; head(x, targets, loss_mask, reduction) the loss of the
    head fused with the cross-entropy (kernels/fused_ce.py), which never keeps the logits. The loss, too, is a call
    of this module, not a read of its weight, so FSDP can shard an untied head as a unit of its own
    (`head_units`, parallel/fsdp.py): its gradient is then reduced as soon as the backward has it, under the
    blocks' backward, not after the whole backward with the root's."""

    def __init__(self, n_embd: int, vocab_size: int):
        super().__init__(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                reduction: str = "mean") -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return head_cross_entropy(x, self.weight, targets, loss_mask, 0.0, reduction)


class Block(nn.Module):
    """One transformer layer: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg):
        super().__init__()
        lc = cfg.llama
        self.input_layernorm = RMSNorm(cfg.n_embd, lc.rms_norm_eps)
        self.self_attn = Attention(cfg.n_embd, cfg.n_head, lc.n_kv_head or cfg.n_head, head_dim(cfg), lc.qkv_bias,
                                   lc.rms_norm_eps if lc.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, lc.rms_norm_eps)
        self.mlp = MLP(cfg.n_embd, intermediate_size(cfg))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                pos: int = 0, docs: DocMask | None = None, attend: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, pos, docs, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama / Qwen2 / Qwen3. `cfg` is a ModelSection; `vocab_size` and `block_size` are already resolved."""

    family = "llama"
    masks_attention = True   # forward(..., visible=, position_ids=): rows of any layout (eval/adapter.py)
    static_decode = True     # forward(x, caches=, pos=device tensor, position_ids=, attend=): generate.py rollout

    def __init__(self, cfg, vocab_size: int, block_size: int):
        super().__init__()
        self.cfg, self.vocab_size, self.block_size = cfg, vocab_size, block_size
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(vocab_size, cfg.n_embd),
            layers=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            norm=RMSNorm(cfg.n_embd, cfg.llama.rms_norm_eps),
        ))
        self.lm_head = Head(cfg.n_embd, vocab_size)
        if cfg.llama.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        init_normal_(self)
        scaled_residual_init_(self, "o_proj.weight", cfg.n_layer)
        scaled_residual_init_(self, "down_proj.weight", cfg.n_layer)
        self.packed_kernel: str | None = None   # the kernel of packed rows, decided on the first (kernels/choice.py)

    @torch.compiler.disable   # traced, Inductor would recompute the frequencies, cos and sin in every layer's rotation
    def rope(self, pos: int, T: int, device: torch.device,
             positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions pos..pos+T-1, (T, head_dim / 2) in fp32, shared by every layer; of packed rows'
        (B, T) `positions`, (B, 1, T, head_dim / 2). Computed outside any compiled graph, once a forward, so each
        layer's rotation reads them (inside the graph, Inductor fuses their pow, cos and sin into every layer's
        kernel instead, per element)."""
        lc = self.cfg.llama
        inv = rope_frequencies(head_dim(self.cfg), lc.rope_theta, lc.rope_scaling, device)
        if positions is not None:
            angles = positions[:, None, :, None].float() * inv
            return angles.cos(), angles.sin()
        angles = torch.outer(torch.arange(pos, pos + T, device=device, dtype=torch.float32), inv)
        return angles.cos(), angles.sin()

    def doc_mask(self, doc_ids: torch.Tensor) -> DocMask:
        """Packed rows' attention mask for every layer, in the kernel kernels/choice.py picks for the device."""
        if self.packed_kernel is None:
            self.packed_kernel = packed_on(family(self.cfg.family), self.cfg, doc_ids.device)
        # the final norm's weight: in the root FSDP unit, so gathered (in the compute dtype) when this runs
        return doc_mask(doc_ids, self.packed_kernel, half_precision(doc_ids.device, self.model.norm.weight.dtype))

    def hidden(self, idx: torch.Tensor, caches: list[KVCache] | None = None, pos: int = 0,
               doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               visible: torch.Tensor | None = None, attend: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope(pos, idx.size(1), idx.device, position_ids)
        docs = self.doc_mask(doc_ids) if doc_ids is not None else None if visible is None else \
            DocMask("sdpa", dense=visible[:, None])
        x = self.model.embed_tokens(idx)
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, caches[i] if caches else None, pos, docs, attend)
        return self.model.norm(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                caches: list[KVCache] | None = None, pos: int = 0, reduction: str = "mean",
                doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 1, visible: torch.Tensor | None = None,
                score_at: torch.Tensor | None = None, attend: torch.Tensor | None = None,
                temperature: float = 1.0) -> Output:
        """Packed rows: `doc_ids` (B, T), each token's example in its row, and `position_ids` (B, T), its position
        inside that example (data/packing.py). Rows of any other layout: `visible` (B, T, T) bool, True where a
        query sees a key, with `position_ids` (eval/adapter.py's contexts shared by their continuations). Without
        targets: the logits of the last `logits_to_keep` positions (0: all), as Hugging Face's forward. A reward
        model's `score_at` (B,): each row's score at that position, in `logits`. With `caches`, left-padded rows
        (generate.py `rollout`): `attend` (B, S_max) bool, True where a cache position holds a real token, and
        `position_ids` (B, T) counting from each row's first real token; the cache slots are pos..pos+T-1. The loss
        at a `temperature` is that of the logits divided by it (the head has no bias, so the final hidden state is
        divided instead: grpo's log-probabilities at its sampling temperature)."""
        x = self.hidden(idx, caches, pos, doc_ids, position_ids, visible, attend)
        if score_at is not None:
            return Output(logits=self.score(x[torch.arange(x.size(0), device=x.device), score_at]))
        if targets is None:
            return Output(logits=self.lm_head(x[:, -logits_to_keep:, :]))
        if temperature != 1:
            x = x / temperature
        if self.cfg.fused_loss:
            loss = self.lm_head(x, targets, loss_mask, reduction)
        else:
            loss = cross_entropy(self.lm_head(x), targets, loss_mask, reduction)
        return Output(loss=loss)

    def checkpoint_units(self) -> list[nn.Module]:
        """The blocks that train.activation_checkpointing wraps (and per-block sharding shards)."""
        return list(self.model.layers)

    def embedding_units(self) -> list[nn.Module]:
        """The token table when it is not the head's weight: FSDP shards it as its own unit (parallel/fsdp.py)."""
        return [] if self.cfg.llama.tie_embeddings else [self.model.embed_tokens]

    def head_units(self) -> list[nn.Module]:
        """The head when it is not the token table: FSDP shards it as its own unit, kept gathered from its forward
        to its backward (parallel/fsdp.py)."""
        return [] if self.cfg.llama.tie_embeddings else [self.lm_head]

    def make_caches(self, batch: int, max_len: int, dtype, device) -> list[KVCache]:
        kv = self.cfg.llama.n_kv_head or self.cfg.n_head
        return [KVCache(batch, kv, max_len, head_dim(self.cfg), dtype, device) for _ in range(self.cfg.n_layer)]

    def rollout_model(self) -> Llama:
        """What generate.py `rollout` runs: a decoder over this model's modules (`decoder_over`), which runs none of
        the hooks FSDP puts on the blocks. Under FSDP the caller holds every unit gathered (grpo: the strategy's
        `whole`), so one process samples alone, for as many tokens as its rows need. Built once."""
        if "_rollout" not in self.__dict__:
            self.__dict__["_rollout"] = decoder_over(self.cfg, self.vocab_size, self.block_size, self)
        return self.__dict__["_rollout"]

    def sampling_model(self, dtype: torch.dtype) -> Llama:
        """`rollout_model` with a copy of the linear layers' weights in `dtype` where they are in another (fp32
        weights trained under autocast), made now: a token step then casts none of them."""
        return decoder_over(self.cfg, self.vocab_size, self.block_size, self, cast_linear(dtype))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as torchtitan counts them (get_nparams_and_flops): 6 x the parameters other
        than the token embedding (a tied head, being the embedding, is not counted), plus 12 * L * H * D * T for
        attention (the full T x T score matrix, causal masking not subtracted)."""
        non_embedding = self.num_params() - self.model.embed_tokens.weight.numel()
        return 6 * non_embedding + 12 * self.cfg.n_layer * self.cfg.n_head * head_dim(self.cfg) * seq_len


class Hookless(nn.Module):
    """`module`'s own forward, without the hooks registered on it (FSDP's gather and free around a unit such as an
    untied token table or head): the decoder's way to run a module whose weights the caller holds gathered."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module.forward(*args, **kwargs)


class Weights(nn.Module):
    """A linear layer over weight and bias tensors of its own, none of them parameters: a sampling decoder's copy of
    a linear layer (`decoder_over` with `linear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def cast_linear(dtype: torch.dtype):
    """`decoder_over`'s `linear` for plain layers: an nn.Linear's weights copied in `dtype` (`Weights`), or None
    where they are in it already (the decoder then reads them as they are: nothing is copied)."""
    def copy(module: nn.Module) -> Weights | None:
        if not isinstance(module, nn.Linear) or module.weight.dtype == dtype:
            return None
        bias = None if module.bias is None else module.bias.detach().to(dtype)
        return Weights(module.weight.detach().to(dtype), bias)
    return copy


def decoder_over(cfg, vocab_size: int, block_size: int, source: nn.Module, linear=None) -> Llama:
    """A Llama of model section `cfg` whose every module holding weights is `source`'s module of the same name (our
    names are LlamaForCausalLM's), run without its hooks (`Hookless`): built on the meta device, it holds no weight
    of its own and reads the source's as they stand. Its blocks, attention and rotary positions are this module's,
    so it runs none of the source's hooks (FSDP's) or wrappers (transformers' forward, with PEFT's adapters inside
    its layers).

    With `linear` (source module -> a module or None), each linear layer (the projections and the head) is what it
    gives for the source's layer where it gives one: generate.py `rollout`'s copy of the weights in the compute
    dtype (`cast_linear`; model/hf/view.py `merged_linear` with LoRA's adapters merged), made as they stand."""
    with torch.device("meta"):
        view = Llama(cfg, vocab_size, block_size)
    owners = [name for name, m in view.named_modules() if next(m.parameters(recurse=False), None) is not None]
    for name in owners:
        parent, _, attr = name.rpartition(".")
        module = source.get_submodule(name)
        made = linear(module) if linear is not None and isinstance(view.get_submodule(name), nn.Linear) else None
        setattr(view.get_submodule(parent) if parent else view, attr, Hookless(module) if made is None else made)
    left = [n for n, t in chain(view.named_parameters(), view.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"the decoder over {type(source).__name__} has weights of its own: {left[:3]}")
    return view


def build(cfg, vocab_size: int, block_size: int, run=None) -> Llama:
    return Llama(cfg, vocab_size, block_size)


# ----------------------------------------------------------------------------- model.path: a Hugging Face folder


def resolve(run):
    """With model.path: the run's shape, vocabulary and run.init_from from the folder (model/llama_hf.py)."""
    return resolve_from_folder(run) if run.model.path else run


def context(run) -> int | None:
    """With model.path: the folder's own context (its max_position_embeddings), which the fine-tune's data.seq_len
    does not limit; else None (the model supports data.seq_len positions, or model.block_size)."""
    return folder_context(run.model.path) if run.model.path else None


def tokenizer(run):
    """model.path's own tokenizer (transformers, with its chat template), else data.tokenizer as for every
    pretraining family."""
    return load_hf_tokenizer(tokenizer_spec(run)) if run.model.path else get_tokenizer(run.data.tokenizer)


def open_datasets(run, tokenizer, vocab_size: int):
    """With model.path: chat / text JSONL through the fine-tuning path (data/sft.py, loss on assistant tokens
    only), as model.family=hf reads it; else data.path's token files or text."""
    if run.model.path:
        return open_finetuning_datasets(run.data, tokenizer, vocab_size)
    return open_token_datasets(run.data, tokenizer, vocab_size)


def reads_examples(run) -> bool:
    """With model.path, chat / text JSONL is read as whole examples (data/sft.py), so data.packing applies."""
    return bool(run.model.path) and sft_examples(run.data)
