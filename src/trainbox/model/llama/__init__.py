"""Llama 3 / Mistral / Qwen2 / Qwen3 (`model.family: llama`): model.py, its options (config.py, model.llama),
its LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM mapping both ways (hf.py). The
plan takes its block from the model's own projections (the decoder block of model/memory.py)."""
from trainbox.model.llama.config import LlamaSection, check
from trainbox.model.spec import GGUF_TYPES, Family

FAMILY = Family(
    name="llama",
    summary="Llama 3 / Mistral / Qwen2 / Qwen3: grouped-query attention, RoPE, SwiGLU, RMSNorm; full fine-tuning "
            "of a folder",
    module="trainbox.model.llama.model", hf_module="trainbox.model.llama.hf",
    memory_module="trainbox.model.llama.memory", section=LlamaSection, check=check,
    options=frozenset({"fused_loss", "head_dim", "path"}),
    export="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM",
    gguf=GGUF_TYPES,
    packing=("flash", "flex", "sdpa"),
    scores=True,
    rollouts=True,
)
