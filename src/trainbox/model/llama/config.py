"""model.llama: Llama / Qwen2 / Qwen3 options (`model.family: llama`), and the family's own rules on the model
section."""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from trainbox.section import Section


class RopeScalingSection(Section):
    """RoPE frequency scaling for long contexts (`model.llama.rope_scaling`), as Hugging Face's rope_scaling."""

    rope_type: Literal["none", "llama3"] = Field(
        "none", description="llama3: Llama 3.1's scaling (low frequencies divided by factor, high ones kept, "
                            "a smooth ramp between); none: plain RoPE")
    factor: float = Field(8.0, ge=1, description="llama3: how much the low frequencies are stretched")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above original / this are scaled")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below original / this are kept")
    original_max_position_embeddings: int = Field(8192, ge=1, description="llama3: the context length the model "
                                                                           "was pretrained at")

    @model_validator(mode="after")
    def _high_above_low(self) -> "RopeScalingSection":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.llama.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor}")
        return self


class LlamaSection(Section):
    """Llama / Qwen2 / Qwen3 options (`model.family: llama`); model.n_layer, n_head, n_embd and head_dim give the
    shape."""

    n_kv_head: int | None = Field(None, ge=1, description="key/value heads of grouped-query attention (default "
                                                          "model.n_head); model.n_head must be a multiple of it")
    intermediate_size: int | None = Field(None, ge=1, description="SwiGLU hidden width (default 8/3 x model.n_embd "
                                                                  "rounded up to a multiple of 256, as Llama's)")
    rope_theta: float = Field(500000.0, gt=0, description="RoPE base (Llama 3: 500000; Llama 2, Qwen2: 10000 or "
                                                          "1000000)")
    rope_scaling: RopeScalingSection = Field(default_factory=RopeScalingSection)
    rms_norm_eps: float = Field(1e-5, gt=0)
    qkv_bias: bool = Field(False, description="biases on the q, k and v projections (Qwen2; exported as "
                                              "Qwen2ForCausalLM)")
    qk_norm: bool = Field(False, description="an RMSNorm over each head of q and of k before RoPE (Qwen3; exported "
                                             "as Qwen3ForCausalLM)")
    tie_embeddings: bool = Field(False, description="the output head shares the token embedding (Llama 3.2 1B "
                                                    "and 3B, small Qwen2 models); model.tie_embeddings is the "
                                                    "gpt family's")


def check(m) -> None:
    """The llama family's rules on the model section (raised as ValueError, shown with the key)."""
    if m.head_dim is None and m.n_embd % m.n_head:
        raise ValueError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
    if m.n_head % (m.llama.n_kv_head or m.n_head):
        raise ValueError(f"model.n_head={m.n_head} is not a multiple of model.llama.n_kv_head={m.llama.n_kv_head}")
    if m.llama.qk_norm and m.llama.qkv_bias:
        raise ValueError("model.llama.qk_norm and model.llama.qkv_bias together match no Hugging Face architecture "
                         "(Qwen3 has the first, Qwen2 the second): set one")


def intermediate_size(cfg) -> int:
    """model.llama.intermediate_size, or Llama's rule: 8/3 x n_embd rounded up to a multiple of 256."""
    return cfg.llama.intermediate_size or 256 * math.ceil(int(8 * cfg.n_embd / 3) / 256)


def head_dim(cfg) -> int:
    return cfg.head_dim or cfg.n_embd // cfg.n_head


def tokenizer_spec(run) -> str:
    """Where the run's tokenizer comes from: data.tokenizer, or model.path's folder when data.tokenizer is the
    default (gpt2)."""
    return run.model.path if run.model.path and run.data.tokenizer == "gpt2" else run.data.tokenizer
