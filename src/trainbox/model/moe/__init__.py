"""Mixture-of-Experts GPT (`model.family: moe`): model.py, its options (config.py, model.moe), its own export
folder (hf.py), its memory formula (memory.py)."""
from trainbox.model.gpt.config import check
from trainbox.model.moe.config import MoESection
from trainbox.model.spec import Family

FAMILY = Family(
    name="moe",
    summary="GPT-2 whose MLPs are routed expert FFNs (top-k, capacity, balance and z losses)",
    module="trainbox.model.moe.model", hf_module="trainbox.model.moe.hf", memory_module="trainbox.model.moe.memory",
    section=MoESection, check=check,
    options=frozenset({"attention", "fused_loss", "fused_norm", "fused_mlp", "lowp_residual", "dropout", "bias",
                       "tie_embeddings"}),
    attention=("flash", "sdpa"), experts=True, steps=True,
    export="trainbox MoE folder (trainbox.model.moe.hf.from_pretrained)",
)
