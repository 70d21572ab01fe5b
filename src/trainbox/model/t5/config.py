"""model.t5: T5 v1.1 shapes and its span-corruption objective (`model.family: t5`)."""
from __future__ import annotations

from pydantic import Field

from trainbox.section import Section


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
