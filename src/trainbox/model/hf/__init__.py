"""Hugging Face causal LMs with LoRA and QLoRA (`model.family: hf`): model.py (PEFT, bitsandbytes), the adapter
or merged export (hf.py), the plan's formula (memory.py). Its options are the run's lora.* and quant.* sections."""
from trainbox.model.spec import GGUF_TYPES, Family

FAMILY = Family(
    name="hf",
    summary="any transformers causal LM (model.path), LoRA adapters on a frozen, optionally 4/8-bit base",
    module="trainbox.model.hf.model", hf_module="trainbox.model.hf.hf", memory_module="trainbox.model.hf.memory",
    options=frozenset({"path", "fused_loss"}), own_attention="hf", packing=("hf",),
    fsdp="LoRA trains small adapters on a frozen base: use train.parallel=ddp",
    recompute="use lora.gradient_checkpointing (Hugging Face's own)",
    export="PEFT adapter or merged model (a reward model: merged, *ForSequenceClassification)", adapters=True,
    scores=True,
    rollouts=True,
    gguf=GGUF_TYPES,   # of the merged model, for the bases hf.py's GGUF_BASES lists
    lowp_residual=True,   # the residual stream in the base's dtype: bf16 on a GPU (4/8-bit bases: fp32, plan/memory.py)
    packages=(("transformers", "finetune"), ("peft", "finetune")),
)
