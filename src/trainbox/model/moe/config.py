"""model.moe: the Mixture-of-Experts options (`model.family: moe`)."""
from __future__ import annotations

from pydantic import Field, model_validator

from trainbox.config.families import Section


class MoESection(Section):
    num_experts: int = Field(8, ge=1, le=2**16)
    top_k: int = Field(2, ge=1)
    capacity_factor: float = Field(0.0, ge=0, description="0 = dropless")
    lb_loss_weight: float = Field(0.01, ge=0)
    z_loss_weight: float = Field(0.0, ge=0)
    jitter_eps: float = Field(0.0, ge=0)
    every: int = Field(1, ge=1, description="every k-th block's MLP is an MoE FFN")
    expert_parallel: int = Field(1, ge=1, le=2**16, description="split the experts over this many ranks "
                                                               "(all-to-all dispatch); 1 = every rank holds every "
                                                               "expert")

    @model_validator(mode="after")
    def _top_k_le_experts(self) -> "MoESection":
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts={self.num_experts}")
        return self
