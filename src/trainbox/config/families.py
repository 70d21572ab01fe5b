"""The model families' own config sections (model.moe, model.t5, model.llama), and the base every section of the
RunConfig tree (config/schema.py) derives from."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class MoESection(Section):
    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    capacity_factor: float = Field(0.0, ge=0, description="0 = dropless")
    lb_loss_weight: float = Field(0.01, ge=0)
    z_loss_weight: float = Field(0.0, ge=0)
    jitter_eps: float = Field(0.0, ge=0)
    every: int = Field(1, ge=1, description="every k-th block's MLP is an MoE FFN")
    expert_parallel: int = Field(1, ge=1, description="split the experts over this many ranks (all-to-all "
                                                      "dispatch); 1 = every rank holds every expert")

    @model_validator(mode="after")
    def _top_k_le_experts(self) -> "MoESection":
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts={self.num_experts}")
        return self


class T5Section(Section):
    """T5 v1.1 shapes and its span-corruption objective (`model.family: t5`)."""

    d_ff: int | None = Field(None, ge=1, description="gated-GELU hidden width (default 2 x n_embd)")
    d_kv: int | None = Field(None, ge=1, description="width of one attention head (default n_embd // n_head)")
    num_decoder_layers: int | None = Field(None, ge=1, description="default model.n_layer (encoder layers)")
    relative_attention_num_buckets: int = Field(32, ge=2)
    relative_attention_max_distance: int = Field(128, ge=2)
    layer_norm_eps: float = Field(1e-6, gt=0)
    sentinel_tokens: int = Field(100, ge=1, description="sentinel ids added above the tokenizer's vocabulary")
    noise_density: float = Field(0.15, gt=0, lt=1, description="fraction of tokens masked by span corruption")
    mean_noise_span_length: float = Field(3.0, ge=1, description="mean length of a masked span")


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
    """Llama / Qwen2 options (`model.family: llama`); model.n_layer, n_head, n_embd and head_dim give the shape."""

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
    tie_embeddings: bool = Field(False, description="the output head shares the token embedding (Llama 3.2 1B "
                                                    "and 3B, small Qwen2 models); model.tie_embeddings is the "
                                                    "gpt family's")
