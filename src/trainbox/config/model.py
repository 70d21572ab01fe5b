"""The model section of the RunConfig (model.*), assembled from the families: its generic keys (ModelBase), and each
family's own section (model/<family>/config.py) as a key of it. What a family reads or refuses is asked of the family
object (model/spec.py), never of its name."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, create_model, field_validator, model_validator

from trainbox.config.limits import MAX_POSITIONS, MAX_VOCAB
from trainbox.model.spec import OPTIONS, either, families, family, which
from trainbox.section import Section


class ModelBase(Section):
    """The model section's generic keys; ModelSection adds each family's own section (model.<family>)."""

    family: str = Field("gpt", description="the model family (a folder of src/trainbox/model)")
    n_layer: int = Field(12, ge=1, le=4096)
    n_head: int = Field(12, ge=1, le=4096)
    n_embd: int = Field(768, ge=8, le=2**20)
    head_dim: int | None = Field(None, ge=1, le=2**16, description="width of one head (default n_embd // "
                                                                   "n_head)")
    vocab_size: int | None = Field(None, ge=1, le=MAX_VOCAB, description="default: the tokenizer's (plus the family's "
                                   "extra ids), padded to a multiple of 64; at least that unpadded")
    block_size: int | None = Field(None, ge=1, le=MAX_POSITIONS, description="positions the model supports (default "
                                                                            "data.seq_len)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout probability in the blocks")
    bias: bool = Field(True, description="biases in the linear layers and norms (GPT-2's)")
    tie_embeddings: bool = Field(True, description="the output head shares the token embedding (llama: "
                                                   "model.llama.tie_embeddings)")
    logit_softcap: float = Field(15.0, ge=0, description="tanh soft-cap of the logits (0 = off)")
    window: int = Field(1792, ge=1, description="final attention window (tokens)")
    window_warmup_steps: int | None = Field(
        0, ge=0, description="steps over which the window grows (0: none; null: the whole run, "
                             "whatever train.max_steps is)")
    window_block: int = Field(1, ge=1, description="the window counts blocks of this many tokens: a query "
                              "sees its own block and those starting fewer than `window` tokens before it (1: "
                              "exactly the last `window` tokens; 128: modded-nanogpt's block-wise windows, faster "
                              "FlexAttention masks)")
    window_pattern: str | None = Field(
        None, description="one letter per layer: L = the window, S = half of it, - = no attention "
                          "(default: L everywhere)")
    attention: Literal["auto", "flash", "flex", "triton", "sdpa"] = Field(
        "auto", description="attention kernel. flash: FlashAttention-4 (Hopper/Blackwell GPUs, "
                            "pip install 'trainbox[flash]'; speedrun: the documents as variable-length sequences, "
                            "model.window_block 1); flex (speedrun): FlexAttention with a block mask (CUDA); triton "
                            "(t5): trainbox's Triton kernels for attention with a learned position bias (CUDA); "
                            "sdpa: PyTorch SDPA (speedrun: with an explicit mask, memory O(T^2); t5: the bias as a "
                            "mask); auto: flash where it is installed and usable, else flex (speedrun, CUDA) or "
                            "triton (t5, CUDA), else sdpa")
    eot_id: int | None = Field(None, ge=0, description="document separator token (default: the tokenizer's)")
    fp8_head: bool = Field(False, description="output head in FP8 (forward e4m3, gradient e5m2; needs FP8 tensor "
                                              "cores: H100, L40S). Faster, not free: it costs validation loss "
                                              "(docs/performance.md)")
    fp8_mlp: Literal["none", "down", "both"] = Field(
        "none", description="MLP matmuls in FP8: the down-projection, or both projections (needs "
                            "FP8 tensor cores: H100, L40S)")
    fp8_fallback: bool = Field(
        False, description="where the device has no FP8 tensor cores (a CPU, an A100), run the matmuls "
                           "of fp8_head and fp8_mlp in bf16 instead of refusing the run (the recipes that turn FP8 on "
                           "set it, so that they run anywhere)")
    lowp_residual: bool | None = Field(
        None, description="keep the residual stream in the autocast dtype (bf16) instead of fp32 "
                          "(default: the family's; it costs validation loss where the family's default is off, "
                          "docs/performance.md)")
    fused_loss: bool = Field(False, description="the head's matmul and the cross-entropy "
                                                "in one function that never keeps the logits (a Triton kernel on CUDA; "
                                                "the loop's summed loss on an H100/H200 with trainbox[flash]: "
                                                "QuACK's linear cross-entropy)")
    fused_norm: bool = Field(False, description="each residual add and the LayerNorm after it as one op "
                                                "whose backward is one pass (a Triton kernel on CUDA; torch ops "
                                                "elsewhere). Blocks under train.activation_checkpointing run unfused")
    fused_mlp: bool = Field(False, description="the MLP's GELU in its matmuls' epilogues: the "
                                               "up-projection writes GELU(h) with h, the backward's matmul applies "
                                               "GELU'(h); moe: every expert matmul a grouped variable-length GEMM "
                                               "(QuACK's GEMMs on Hopper/Blackwell GPUs, pip install "
                                               "'trainbox[flash]'; torch ops elsewhere). MLPs with biases "
                                               "(model.bias=true) run unfused")
    path: str | None = Field(None, description="hub id or local folder of a Hugging Face causal LM; llama: a "
                                               "local Llama, Mistral, Qwen2 or Qwen3 folder that gives the run its "
                                               "shape, tokenizer and initial weights (full fine-tuning)")

    @property
    def fp8_options(self) -> list[str]:
        """The FP8 settings this model asks for, as key=value (empty: none)."""
        return [o for o, on in (("model.fp8_head=true", self.fp8_head),
                                (f"model.fp8_mlp={self.fp8_mlp}", self.fp8_mlp != "none")) if on]

    @field_validator("family")
    @classmethod
    def _known_family(cls, name: str) -> str:
        if name not in families():
            raise ValueError(f"model.family={name!r} is not one of {', '.join(families())}")
        return name

    @model_validator(mode="after")
    def _family_rules(self) -> "ModelBase":
        """What the family does not read is refused where it is set away from its default, and the family's own
        rules hold (model/<family>/config.py)."""
        spec = family(self.family)
        fields = type(self).model_fields
        for name in OPTIONS:
            if not spec.supports(name) and getattr(self, name) != fields[name].default:
                users = which(lambda f, name=name: f.supports(name))
                raise ValueError(f"model.{name} applies to model.family={either(users)}, not {self.family}")
        if self.attention not in ("auto", *spec.attention):
            users = which(lambda f: self.attention in f.attention)
            raise ValueError(f"model.attention={self.attention} applies to model.family={either(users)}; "
                             f"{self.family} takes {', '.join(('auto', *spec.attention))}")
        for other in families().values():
            if other.section is None or other is spec:
                continue
            given = getattr(self, other.name).model_dump(exclude_defaults=True)
            if given:
                raise ValueError(f"model.{other.name}.{next(iter(given))} applies to model.family={other.name}, "
                                 f"not {self.family}")
        if self.fused_mlp and self.fp8_mlp != "none":
            raise ValueError("model.fused_mlp runs the MLP's matmuls in the autocast dtype, model.fp8_mlp in FP8: "
                             "set one of them off (model.fp8_mlp=none or model.fused_mlp=false)")
        if spec.check is not None:
            spec.check(self)
        return self


ModelSection = create_model(
    "ModelSection", __base__=ModelBase, __doc__="The model: its family, shape and options (model.*).",
    **{f.name: (f.section, Field(default_factory=f.section, description=f"model.family={f.name}: its own options"))
       for f in families().values() if f.section is not None})
