"""T5 v1.1 (`model.family: t5`): model.py, its options (config.py, model.t5), its T5ForConditionalGeneration
mapping (hf.py), its memory formula (memory.py). Span corruption (data/spans.py) makes its examples."""
from trainbox.model.spec import Family
from trainbox.model.t5.config import T5Section

FAMILY = Family(
    name="t5",
    summary="T5 v1.1 encoder-decoder: relative position bias, RMSNorm, gated-GELU, span corruption",
    module="trainbox.model.t5.model", hf_module="trainbox.model.t5.hf", memory_module="trainbox.model.t5.memory",
    section=T5Section, options=frozenset({"dropout", "tie_embeddings", "attention"}), attention=("sdpa", "triton"),
    steps=True,
    fsdp="its relative position bias lives in the first block and every block reads it, so it cannot be sharded "
         "per block; use train.parallel=ddp (t5-base fits one GPU)",
    generate="spans", export="T5ForConditionalGeneration",
)
