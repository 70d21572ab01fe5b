"""The llama family's decoder over a LoRA run's own modules: how a Llama, Mistral, Qwen2 or Qwen3 model of
`model.family: hf` samples (generate.py `rollout`, which grpo draws its completions with).

transformers' forward with PEFT's adapters runs eagerly, one kernel launch at a time: decoding a token of a 0.5B model
for 64 rows takes about 60 ms on an H200, nearly all of it the host's launches. The llama family decodes with a KV
cache whose position is a device tensor (`static_decode`), so its whole token step is captured in one CUDA graph and
replayed. `llama_view` builds that decoder (model/llama/model.py `decoder_over`) with the hf model's own modules in
place of every module holding weights: each projection is PEFT's LoRA layer (base layer and adapters, quantized or
not), each norm, the embedding and the head are transformers' own. No weight is copied, so the view samples from
the adapters as they stand after every optimizer step, PEFT's `disable_adapter` holds for it, and it costs no
memory. Its modules run as the hf model's mode sets them (the model, not the view, is put in eval mode to sample:
no adapter dropout).

grpo.sampling_copy samples through `merged_linear`'s decoder instead, made for each sampling: every projection one
matmul over a copy of its effective weight in the compute dtype (the base, dequantized where 4- or 8-bit, plus the
adapters), where the view runs the base's matmul (a 4-bit one dequantizes at every token) and the adapters' two.

The llama family's blocks, attention and rotary positions are ours; tests/test_hf_view.py holds the view's logits
equal to transformers' (within 1e-5, fp32) for each architecture, with adapters, padding and caches."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from trainbox.errors import ConfigError
from trainbox.model.llama.hf import ARCHITECTURES, model_section
from trainbox.model.llama.model import Llama, Weights, cast_linear, decoder_over

log = logging.getLogger("trainbox")
QUANTIZED = ("Params4bit", "Int8Params")   # bitsandbytes' 4- and 8-bit weights (PEFT tells them by these names)


def merged_linear(dtype: torch.dtype):
    """`decoder_over`'s `linear` for a LoRA run's layers: a PEFT LoRA layer's effective weight, its base's
    (dequantized where 4- or 8-bit) plus each active adapter's scaling x B @ A (PEFT's `get_delta_weight`, what
    its forward adds), summed in fp32 and copied in `dtype`; a quantized layer without adapters dequantized; else
    `cast_linear`'s copy (None where the weights are in `dtype` already)."""
    from peft.tuners.lora import LoraLayer  # optional: peft (a LoRA run has it)
    from peft.utils.integrations import dequantize_module_weight  # optional: peft
    cast = cast_linear(dtype)

    def copy(module: nn.Module) -> Weights | None:
        lora = isinstance(module, LoraLayer)
        base = module.get_base_layer() if lora else module
        if not lora and type(getattr(base, "weight", None)).__name__ not in QUANTIZED:
            return cast(module)
        weight = dequantize_module_weight(base).detach().to(torch.float32, copy=True)   # never the base's own
        if lora and not module.disable_adapters and not module.merged:
            for name in module.active_adapters:
                if name in module.lora_A:
                    weight += module.get_delta_weight(name).float()
        bias = None if base.bias is None else base.bias.detach().to(dtype)
        return Weights(weight.to(dtype), bias)
    return copy


def llama_view(model, linear=None) -> Llama | None:
    """The llama family's decoder over `model`'s modules (an HFCausalLM), with `decoder_over`'s `linear`; None where
    its architecture is not one the llama family runs (the model then samples through transformers)."""
    conf = model.hf_config.to_dict()
    if conf.get("model_type") not in ARCHITECTURES:
        return None
    try:
        section = model_section(conf, model.path)
    except ConfigError as e:   # a sliding window, a RoPE scaling or biases the llama family does not implement
        log.info(f"sampling {model.path} through transformers: {e.message}")
        return None
    return decoder_over(section, conf["vocab_size"], model.block_size, model.peft.get_base_model(), linear)
