"""Dense GPT-2 (`model.family: gpt`): model.py, its GPT2LMHeadModel mapping (hf.py), its memory formula (memory.py)."""
from trainbox.model.gpt.config import check
from trainbox.model.spec import GGUF_TYPES, Family

FAMILY = Family(
    name="gpt",
    summary="GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, head tied to the embedding",
    module="trainbox.model.gpt.model", hf_module="trainbox.model.gpt.hf", memory_module="trainbox.model.gpt.memory",
    check=check,
    options=frozenset({"attention", "fused_loss", "fused_norm", "fused_mlp", "fp8_head", "fp8_mlp", "lowp_residual",
                       "dropout", "bias", "tie_embeddings"}),
    attention=("flash", "sdpa"), export="GPT2LMHeadModel", gguf=GGUF_TYPES, steps=True,
    packing=("flash", "flex", "sdpa"),
)
