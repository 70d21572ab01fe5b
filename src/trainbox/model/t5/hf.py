"""The t5 family <-> Hugging Face T5ForConditionalGeneration folders: our parameter names are its own, so
`to_hf` writes config.json (a T5Config) and model.safetensors (tied aliases stored once) and transformers loads
the same model.

    trainbox export runs/t5-small --format hf --out hf/t5      # T5ForConditionalGeneration.from_pretrained
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainbox.errors import ConfigError
from trainbox.files import default_modes
from trainbox.model.hf_folder import cast, dtype_name, no_merge
from trainbox.model.load import load_for_inference
from trainbox.model.t5.model import T5, t5_d_ff, t5_d_kv, t5_decoder_layers


def hf_config(model: T5, eos_token_id: int):
    """The transformers T5Config describing `model`, whose config.json says the model's own tie. transformers 5's
    T5Config turns the `tie_word_embeddings` it is given into `scale_decoder_outputs` (the tied head's d_model^-0.5)
    and sets `tie_word_embeddings` to True, which transformers 4 and T5 v1.1's own configs read as a tied, scaled
    head; it is set again after construction. (transformers 5 loads an untied folder untied: its checkpoint holds
    two different heads.)"""
    from transformers import T5Config  # optional: the `hf` extra

    cfg = model.cfg
    config = T5Config(vocab_size=model.vocab_size, d_model=cfg.n_embd, d_kv=t5_d_kv(cfg), d_ff=t5_d_ff(cfg),
                      num_layers=cfg.n_layer, num_decoder_layers=t5_decoder_layers(cfg), num_heads=cfg.n_head,
                      relative_attention_num_buckets=cfg.t5.relative_attention_num_buckets,
                      relative_attention_max_distance=cfg.t5.relative_attention_max_distance,
                      dropout_rate=cfg.dropout, layer_norm_epsilon=cfg.t5.layer_norm_eps,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=cfg.tie_embeddings,
                      decoder_start_token_id=model.decoder_start_token_id, pad_token_id=model.decoder_start_token_id,
                      eos_token_id=eos_token_id)
    config.tie_word_embeddings = cfg.tie_embeddings
    return config


def to_hf(model: T5, out: str | Path, eos_token_id: int, dtype: str | None = None) -> Path:
    """Write a folder that `T5ForConditionalGeneration.from_pretrained` loads with the same outputs
    (config.json + model.safetensors, names 1:1). Written into a temporary folder, then renamed."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf_config(model, eos_token_id).save_pretrained(tmp)
    state, seen = {}, set()
    for name, t in model.state_dict().items():  # tied aliases (embed_tokens, tied head) stored once
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        state[name] = t.detach().to("cpu", torch.float32).contiguous()
    state = cast(state, dtype)
    if dtype:
        config = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**config, "dtype": dtype_name(dtype)}, indent=2) + "\n")
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def export(path: str, out: str, merge: bool = False, force: bool = False, dtype: str | None = None) -> list[str]:
    """`trainbox export` of a t5 run: a T5ForConditionalGeneration folder."""
    no_merge(path, merge)
    model, tok, _ = load_for_inference(path)
    target = Path(out)
    if target.exists() and any(target.iterdir()) and not force:
        raise ConfigError(f"{target} exists and is not empty", hint="choose another --out or pass --force")
    to_hf(model, target, eos_token_id=tok.eot_id, dtype=dtype)
    default_modes(target)
    return [f"wrote {target} (Hugging Face T5ForConditionalGeneration: config.json, model.safetensors)"]
