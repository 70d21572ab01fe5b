"""T5 v1.1 encoder-decoder family (`model.family: t5`), pretrained with span corruption.

Architecture (Raffel et al. 2020, with the v1.1 changes): no absolute positions; a learned scalar
bias per head and relative-position bucket is added to the attention logits (one table for the
encoder, one for the decoder, both held by the first block and shared by the others); T5's RMS
layer norm (no mean, no bias) before every sub-layer; gated-GELU feed-forward
`wo(gelu_tanh(wi_0 x) * wi_1 x)`; no biases anywhere; untied output head (`model.tie_embeddings:
false`; when tied, the decoder output is scaled by d_model^-0.5 as in the original T5).

T5 does not scale attention logits by 1/sqrt(d_kv) (the scale is folded into the initialisation of
q). Self-attention takes the position bias through F.scaled_dot_product_attention with `scale=1.0` and
the bias (plus the causal mask in the decoder) as an additive float mask (a CPU, `model.attention=sdpa`), or
on a CUDA GPU through kernels/biased_attention.py (the bias per head, its gradient summed over the batch
inside the kernel, causal in the decoder; not while decoding with a cache). Cross-attention has no bias:
SDPA's fused kernels.

Parameter names map 1:1 to Hugging Face's T5ForConditionalGeneration (`shared`, `encoder.block.N.
layer.0.SelfAttention.q`, `...relative_attention_bias`, `layer.1.DenseReluDense.wi_0`, `lm_head`...),
`encoder.embed_tokens` / `decoder.embed_tokens` being the same module as `shared`; `to_hf` writes a
folder transformers loads. Vocabulary: the tokenizer's ids, then (top of the padded vocabulary, as T5)
`sentinel_tokens` sentinels counting down from `vocab_size - 1` (<extra_id_0> is the last id) and,
just below them, the decoder start token (T5 starts from its pad id 0, which in our tokenizers is a
real token, hence a dedicated id). Batches come from span corruption (data/spans.py) through
`adapt_dataset`, which the loop applies to this family's datasets: x = encoder input, y = decoder
targets; the decoder input is y shifted right. `model.bias`, `head_dim` and `block_size` do not apply
(no biases; head width is model.t5.d_kv; positions are relative, so any length runs).

    trainbox train t5-small data.path=PREFIX          # T5 v1.1 small on shard files
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainbox.data.spans import span_corruption_dataset, span_lengths
from trainbox.kernels.biased_attention import biased_attention, diagonal_sums, diagonals
from trainbox.kernels.biased_attention import ops as biased_attention_ops
from trainbox.kernels.choice import KernelChoice, choose
from trainbox.model.layers import KVCache, Output, RMSNorm, cross_entropy, gelu_tanh
from trainbox.model.spec import family


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of `key position - query position`: exact for small distances, log-spaced up to
    max_distance, one bucket beyond. Bidirectional (encoder) uses half the buckets per direction."""
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:  # causal: only keys at or before the query exist
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # log(distance / max_exact) is only used where distance >= max_exact; clamp keeps log finite elsewhere
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


class _Diagonals(torch.autograd.Function):
    """The position bias (H, q_len, k_len) laid along the diagonals of rel (H, q_len + k_len - 1), T5's bias depending
    only on key position - query position (kernels/biased_attention.py `diagonals`). Autograd's own backward of the
    gather adds each of the q_len x k_len gradients into its diagonal with an atomic add: thousands of them on each
    of a few hundred addresses, 2 ms a micro-batch for t5-base on an H200; this one sums the diagonals as columns
    (`diagonal_sums`, no atomics)."""

    @staticmethod
    def forward(ctx, rel: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
        ctx.q_len, ctx.k_len = q_len, k_len
        return diagonals(rel, q_len, k_len)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return diagonal_sums(grad, ctx.q_len, ctx.k_len), None, None


class Attention(nn.Module):
    """Multi-head attention without biases or 1/sqrt(d) scaling; `kv` given = cross-attention."""

    def __init__(self, cfg, relative_bias: bool, bidirectional: bool):
        super().__init__()
        t5, d = cfg.t5, cfg.n_embd
        self.n_head, self.d_kv, self.bidirectional = cfg.n_head, t5_d_kv(cfg), bidirectional
        self.num_buckets, self.max_distance = t5.relative_attention_num_buckets, t5.relative_attention_max_distance
        inner = self.n_head * self.d_kv
        self.q, self.k, self.v = (nn.Linear(d, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, d, bias=False)
        self.dropout = cfg.dropout
        self.causal = not bidirectional   # the decoder's self-attention (cross-attention has no mask)
        self.kernel = "sdpa"              # triton: kernels/biased_attention.py (set by T5.set_kernels)
        if relative_bias:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, self.n_head)

    def relative_bias(self, q_len: int, k_len: int, device) -> torch.Tensor:
        """(H, q_len + k_len - 1): the bias of each distance key - query, most negative first, where the queries are
        the last q_len of k_len positions (what the Triton kernels take)."""
        distance = torch.arange(1 - k_len, q_len, device=device)
        buckets = relative_position_bucket(distance, self.bidirectional, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).t()

    def position_bias(self, q_len: int, k_len: int, device) -> torch.Tensor:
        """(1, H, q_len, k_len) additive bias, contiguous (SDPA's fused kernel takes a mask only with unit stride in
        its last dimension): each distance looked up once, then laid along its diagonal."""
        return _Diagonals.apply(self.relative_bias(q_len, k_len, device), q_len, k_len).unsqueeze(0)

    def fused(self, cache: KVCache | None, kv: torch.Tensor | None) -> bool:
        """Whether this call runs the Triton kernel (it takes the bias and its own causal mask): self-attention
        over a whole sequence on a GPU that runs it."""
        return self.kernel == "triton" and cache is None and kv is None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, kv: torch.Tensor | None = None,
                cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        """With a cache (decoding): self-attention appends the new keys/values at `pos`; cross-attention
        projects the encoder output once (at pos 0) and reuses it."""
        B, T, _ = x.shape
        if self.fused(cache, kv):   # bias (H, 2T - 1) by distance, fp32; the kernel applies the causal mask
            shape = (B, T, self.n_head, self.d_kv)
            y = biased_attention(self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape), bias,
                                 1.0, self.causal)                                          # (B, T, H, D)
            return self.o(y.reshape(B, T, self.n_head * self.d_kv))
        src = x if kv is None else kv
        S = src.size(1)
        # (B, T, H * D) -> (B, H, T, D)
        q = self.q(x).view(B, T, self.n_head, self.d_kv).transpose(1, 2)
        if cache is not None and kv is not None and pos > 0:
            k, v = cache.k, cache.v
        else:
            k = self.k(src).view(B, S, self.n_head, self.d_kv).transpose(1, 2)
            v = self.v(src).view(B, S, self.n_head, self.d_kv).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(0 if kv is not None else pos, k, v)
        mask = bias.to(q.dtype).contiguous() if bias is not None else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(B, T, self.n_head * self.d_kv))


class SelfAttentionLayer(nn.Module):
    def __init__(self, cfg, relative_bias: bool, bidirectional: bool):
        super().__init__()
        self.SelfAttention = Attention(cfg, relative_bias, bidirectional)
        self.layer_norm = RMSNorm(cfg.n_embd, cfg.t5.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        return x + self.dropout(self.SelfAttention(self.layer_norm(x), bias, cache=cache, pos=pos))


class CrossAttentionLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.EncDecAttention = Attention(cfg, relative_bias=False, bidirectional=True)
        self.layer_norm = RMSNorm(cfg.n_embd, cfg.t5.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, cache: KVCache | None = None,
                pos: int = 0) -> torch.Tensor:
        # no position bias between decoder and encoder positions (T5 adds zeros)
        return x + self.dropout(self.EncDecAttention(self.layer_norm(x), None, kv=memory, cache=cache, pos=pos))


class GatedGelu(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, d_ff = cfg.n_embd, t5_d_ff(cfg)
        self.wi_0 = nn.Linear(d, d_ff, bias=False)
        self.wi_1 = nn.Linear(d, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(gelu_tanh(self.wi_0(x)) * self.wi_1(x)))


class FeedForwardLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.DenseReluDense = GatedGelu(cfg)  # Hugging Face's name, kept for the 1:1 weight mapping
        self.layer_norm = RMSNorm(cfg.n_embd, cfg.t5.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.DenseReluDense(self.layer_norm(x)))


class Block(nn.Module):
    """Encoder block: [self-attention, FF]; decoder block: [causal self-attention, cross-attention, FF]."""

    def __init__(self, cfg, is_decoder: bool, relative_bias: bool):
        super().__init__()
        self.is_decoder = is_decoder
        layers = [SelfAttentionLayer(cfg, relative_bias, bidirectional=not is_decoder)]
        if is_decoder:
            layers.append(CrossAttentionLayer(cfg))
        self.layer = nn.ModuleList([*layers, FeedForwardLayer(cfg)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor | None = None,
                caches: tuple[KVCache, KVCache] | None = None, pos: int = 0) -> torch.Tensor:
        x = self.layer[0](x, bias, caches[0] if caches else None, pos)
        if self.is_decoder:
            x = self.layer[1](x, memory, caches[1] if caches else None, pos)
        return self.layer[-1](x)


class Stack(nn.Module):
    """The encoder or the decoder: embeddings (shared), blocks, final norm."""

    def __init__(self, cfg, n_layer: int, is_decoder: bool, embed_tokens: nn.Embedding):
        super().__init__()
        self.is_decoder = is_decoder
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList([Block(cfg, is_decoder, relative_bias=i == 0) for i in range(n_layer)])
        self.final_layer_norm = RMSNorm(cfg.n_embd, cfg.t5.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor | None = None,
                caches: list[tuple[KVCache, KVCache]] | None = None, pos: int = 0) -> torch.Tensor:
        """`ids` sit at positions pos..pos+T-1; with caches, earlier positions come from the caches."""
        T = ids.size(1)
        x = self.dropout(self.embed_tokens(ids))
        attention = self.block[0].layer[0].SelfAttention
        if attention.fused(caches[0][0] if caches else None, None):
            bias = attention.relative_bias(T, T, ids.device)        # (H, 2T - 1): the kernels read its diagonals
        else:
            bias = attention.position_bias(T, pos + T, ids.device)  # (1, H, T, pos + T)
            if self.is_decoder:
                bias = bias + torch.full((T, pos + T), float("-inf"), device=ids.device).triu(pos + 1)
        for i, block in enumerate(self.block):
            x = block(x, bias, memory, caches[i] if caches else None, pos)
        return self.dropout(self.final_layer_norm(x))


class T5(nn.Module):
    """T5 v1.1. `cfg` is a ModelSection (T5 settings in cfg.t5); `vocab_size` includes the sentinels."""

    family = "t5"

    def __init__(self, cfg, vocab_size: int, block_size: int):
        super().__init__()
        self.cfg, self.vocab_size, self.block_size = cfg, vocab_size, block_size
        self.sentinel_tokens = cfg.t5.sentinel_tokens
        self.decoder_start_token_id = vocab_size - 1 - self.sentinel_tokens
        self.shared = nn.Embedding(vocab_size, cfg.n_embd)
        self.encoder = Stack(cfg, cfg.n_layer, is_decoder=False, embed_tokens=self.shared)
        self.decoder = Stack(cfg, t5_decoder_layers(cfg), is_decoder=True, embed_tokens=self.shared)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.shared.weight
        self.kernels: KernelChoice | None = None

    def set_step(self, step: int, total: int | None = None) -> None:
        """Called by the loop before each step, outside torch.compile: picks the attention kernel."""
        self.set_kernels(self.shared.weight.device)

    def set_kernels(self, device: torch.device) -> KernelChoice:
        """The kernels for `device`, decided once (kernels.choice.choose): self-attention triton or sdpa."""
        if self.kernels is not None:
            return self.kernels
        self.kernels = plan = choose(self.cfg, device, family(self.cfg.family))
        if plan.attention == "triton":
            biased_attention_ops()   # defined here, before torch.compile traces the model
        for stack in (self.encoder, self.decoder):
            for block in stack.block:
                block.layer[0].SelfAttention.kernel = plan.attention
        return plan

    @torch.no_grad()
    def init_weights(self) -> None:
        """Mesh TensorFlow's T5 initialisation (as Hugging Face's): variance-scaled by fan-in, with the
        attention's missing 1/sqrt(d_kv) folded into q. One change: the untied head also starts at
        d_model^-0.5 (Hugging Face: 1.0), so the first logits have unit scale and the initial loss is
        about ln(vocab) rather than several times it."""
        d, d_ff, inner = self.cfg.n_embd, t5_d_ff(self.cfg), self.cfg.n_head * t5_d_kv(self.cfg)
        std = {"q": (d * t5_d_kv(self.cfg)) ** -0.5, "k": d ** -0.5, "v": d ** -0.5, "o": inner ** -0.5,
               "wi_0": d ** -0.5, "wi_1": d ** -0.5, "wo": d_ff ** -0.5, "relative_attention_bias": d ** -0.5,
               "shared": 1.0, "lm_head": d ** -0.5}
        for name, p in self.named_parameters():
            parts = name.split(".")
            if parts[-2] in ("layer_norm", "final_layer_norm"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std[parts[-2]])

    def shift_right(self, targets: torch.Tensor) -> torch.Tensor:
        """Decoder inputs: the start token, then the targets without their last token (teacher forcing)."""
        start = targets.new_full((targets.size(0), 1), self.decoder_start_token_id)
        return torch.cat([start, targets[:, :-1]], dim=1)

    def encode(self, idx: torch.Tensor) -> torch.Tensor:
        self.set_kernels(idx.device)
        return self.encoder(idx)

    def decode(self, decoder_ids: torch.Tensor, memory: torch.Tensor, caches=None, pos: int = 0) -> torch.Tensor:
        """Decoder token ids (at positions pos..) + encoder output -> logits over the vocabulary."""
        self.set_kernels(decoder_ids.device)
        x = self.decoder(decoder_ids, memory, caches, pos)
        if self.cfg.tie_embeddings:  # original T5: tied head scaled by d_model^-0.5
            x = x * self.cfg.n_embd ** -0.5
        return self.lm_head(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                caches=None, pos: int = 0, reduction: str = "mean",
                decoder_input_ids: torch.Tensor | None = None) -> Output:
        """idx: encoder input (B, S); targets: decoder targets (B, T). Returns the loss, or the logits
        for `decoder_input_ids` when no targets are given."""
        if decoder_input_ids is None:
            if targets is None:
                raise ValueError("T5.forward needs targets or decoder_input_ids")
            decoder_input_ids = self.shift_right(targets)
        logits = self.decode(decoder_input_ids, self.encode(idx))
        if targets is None:
            return Output(logits=logits)
        return Output(loss=cross_entropy(logits, targets, loss_mask, reduction), logits=logits)

    def make_decoder_caches(self, batch: int, max_len: int, memory_len: int, dtype, device) -> list:
        """Per decoder block: (self-attention cache of max_len positions, cross-attention cache)."""
        H, D = self.cfg.n_head, t5_d_kv(self.cfg)
        return [(KVCache(batch, H, max_len, D, dtype, device), KVCache(batch, H, memory_len, D, dtype, device))
                for _ in range(t5_decoder_layers(self.cfg))]

    def checkpoint_units(self) -> list[nn.Module]:
        """The blocks that train.activation_checkpointing wraps (encoder, then decoder)."""
        return [*self.encoder.block, *self.decoder.block]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per encoder input token (what the loop counts as tokens): 6 x (matmul
        parameters x the positions they apply to) + attention scores, over one example of
        `seq_len` encoder tokens and the decoder length span corruption gives it, divided by seq_len."""

        _, dec_len = span_lengths(seq_len, self.cfg.t5.noise_density, self.cfg.t5.mean_noise_span_length)
        d, d_ff, inner = self.cfg.n_embd, t5_d_ff(self.cfg), self.cfg.n_head * t5_d_kv(self.cfg)
        attn, ff = 4 * d * inner, 3 * d * d_ff
        n_enc, n_dec = self.cfg.n_layer, t5_decoder_layers(self.cfg)
        matmul = (n_enc * (attn + ff) * seq_len                       # encoder blocks
                  + n_dec * (attn + 2 * d * inner + ff) * dec_len      # decoder self-attn, cross q/o, FF
                  + n_dec * 2 * d * inner * seq_len                    # cross-attention k/v over the encoder
                  + d * self.vocab_size * dec_len)                     # output head
        scores = 2 * inner * (n_enc * seq_len * seq_len + n_dec * (dec_len * dec_len + dec_len * seq_len))
        return 3 * (2 * matmul + 2 * scores) / seq_len


def t5_d_kv(cfg) -> int:
    return cfg.t5.d_kv or cfg.n_embd // cfg.n_head


def t5_d_ff(cfg) -> int:
    return cfg.t5.d_ff or 2 * cfg.n_embd


def t5_decoder_layers(cfg) -> int:
    return cfg.t5.num_decoder_layers or cfg.n_layer


def extra_ids(cfg) -> int:
    """Ids this family adds above the tokenizer's vocabulary: the sentinels and the decoder start."""
    return cfg.t5.sentinel_tokens + 1


def build(cfg, vocab_size: int, block_size: int, run=None) -> T5:
    return T5(cfg, vocab_size, block_size)


def adapt_dataset(cfg, tokenizer, dataset, vocab_size: int, split: str):
    """Packed token windows -> span-corrupted (encoder input, decoder target) examples (data/spans.py)."""

    return span_corruption_dataset(dataset, cfg.model.t5, cfg.data.seq_len, vocab_size, tokenizer.eot_id,
                                   seed=cfg.run.seed, split=split)
