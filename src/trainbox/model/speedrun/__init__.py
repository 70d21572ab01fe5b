"""Speedrun GPT (`model.family: speedrun`), after modded-nanogpt: model.py (its attention rule is kernels/doc_mask.py),
its memory formula (memory.py). No Hugging Face class exists for it: its checkpoints are its portable form."""
from trainbox.model.spec import Family
from trainbox.model.speedrun.config import check, flash_eligible

FAMILY = Family(
    name="speedrun",
    summary="modded-nanogpt's GPT: RoPE, QK-norm, ReLU^2, value embeddings, U-net skips, document-causal windows",
    module="trainbox.model.speedrun.model", memory_module="trainbox.model.speedrun.memory",
    check=check, flash_eligible=flash_eligible,
    options=frozenset({"attention", "fused_loss", "fp8_head", "fp8_mlp", "lowp_residual", "logit_softcap", "window",
                       "window_warmup_steps", "window_block", "window_pattern", "eot_id", "head_dim"}),
    attention=("flash", "flex", "sdpa"), lowp_residual=True, steps=True,
)
