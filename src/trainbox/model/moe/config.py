"""model.moe: the Mixture-of-Experts options (`model.family: moe`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainbox.section import Section


class MoESection(Section):
    num_experts: int = Field(8, ge=1, le=2**16)
    top_k: int = Field(2, ge=1)
    capacity_factor: float = Field(0.0, ge=0, description="0 = dropless")
    lb_loss_weight: float = Field(0.01, ge=0)
    z_loss_weight: float = Field(0.0, ge=0)
    jitter_eps: float = Field(0.0, ge=0)
    every: int = Field(1, ge=1, description="every k-th block's MLP is an MoE FFN")
    expert_parallel: int = Field(1, ge=1, le=2**16, description="split the experts over this many ranks "
                                                               "(all-to-all dispatch; the dense part as "
                                                               "train.parallel says); 1 = every rank holds every "
                                                               "expert")
    exchange: Literal["uneven", "padded"] = Field(
        "uneven", description="expert parallelism's token exchange in training: uneven = only the kept rows, split "
                              "sizes read on the host; padded = capacity-sized buffers per expert, equal splits, no "
                              "host read (needs model.moe.capacity_factor > 0; evaluation stays uneven)")
    split_sizes: Literal["auto", "host", "graph"] = Field(
        "auto", description="the uneven exchange's split sizes under train.compile: host = read on the host between "
                            "compiled graphs; graph = kept in the compiled graph as symbolic sizes, one graph for the "
                            "forward and one for the backward; auto = graph on a GPU the step-time plan knows "
                            "(trainbox plan), else host")

    @model_validator(mode="after")
    def _consistent(self) -> "MoESection":
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts={self.num_experts}")
        if self.exchange == "padded" and self.capacity_factor == 0:
            raise ValueError("model.moe.exchange=padded sends capacity-sized buffers and needs a capacity: set "
                             "model.moe.capacity_factor > 0, or model.moe.exchange=uneven for dropless routing")
        return self
