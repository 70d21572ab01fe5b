"""Hugging Face GPT-2 folders <-> the gpt family, both directions.

    trainbox export runs/gpt2 --format hf --out hf/gpt2      # load with GPT2LMHeadModel.from_pretrained
    trainbox train gpt2-125m run.init_from=hf/gpt2           # start a new run from a GPT-2 folder

Our parameter names are GPT2LMHeadModel's, so conversion is a rename-free copy plus four adjustments:
HF's Conv1D weights (in, out) are transposed to our nn.Linear's (out, in) and back (CONV1D_WEIGHTS);
the vocabulary rows are padded on import (50,257 -> 50,304; pad rows start at zero and are never
targets) and sliced back to the tokenizer's on export; position
rows are sliced when our block_size is shorter than the folder's n_positions; a model trained with
`model.bias=false` is exported with zero biases, which is the same function. Export writes config.json,
generation_config.json, model.safetensors and the tokenizer (vocab.json + merges.txt + tokenizer.json
for gpt2, the tokenizer.json otherwise) into a temporary folder that is renamed into place when complete.
Needs only model, checkpoint and tokenizer code; transformers itself is not required to write or read.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from trainbox import checkpoint
from trainbox.config import build_config
from trainbox.data.chat import template_for
from trainbox.data.tokenizer import get_tokenizer
from trainbox.errors import ConfigError
from trainbox.model.build import build_model, pad_vocab
from trainbox.model.gguf_file import GGUFModel
from trainbox.model.hf_folder import (
    cast,
    check_out,
    copy_mapped,
    dtype_name,
    no_merge,
    read_hf_state,
    staged,
    write_chat_template,
    write_generation,
    write_json,
    write_tokenizer,
)

SKIP_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older transformers versions
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


# ----------------------------------------------------------------------------- HF -> ours


def check_hf_config(hf: dict, cfg, vocab_size: int, block_size: int, where: str) -> None:
    """Raise ConfigError naming the first `model.*` key that disagrees with the folder's config.json."""
    if hf.get("model_type") != "gpt2":
        raise ConfigError(f"run.init_from={where} holds a '{hf.get('model_type')}' model; only GPT-2 folders "
                          f"load into model.family=gpt",
                          hint="Llama, Mistral, Qwen2 and Qwen3 folders: model.family=llama (full fine-tuning: "
                               "trainbox train sft model.path=...); other causal LMs: model.family=hf model.path=...")
    if cfg.family != "gpt":
        raise ConfigError(f"run.init_from={where} is a GPT-2 folder but model.family={cfg.family}",
                          hint="use model.family=gpt")
    pairs = [("n_layer", cfg.n_layer, hf.get("n_layer")), ("n_head", cfg.n_head, hf.get("n_head")),
             ("n_embd", cfg.n_embd, hf.get("n_embd"))]
    for key, ours, theirs in pairs:
        if ours != theirs:
            raise ConfigError(f"model.{key}={ours} but {where}/config.json has {key}={theirs}",
                              hint=f"set model.{key}={theirs}")
    checks = [
        (hf.get("n_inner") in (None, 4 * cfg.n_embd), f"n_inner={hf.get('n_inner')} (ours is 4 * n_embd)", None),
        (hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
         f"activation_function={hf.get('activation_function')} (ours is gelu_new, the tanh GELU)", None),
        (abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) < 1e-12,
         f"layer_norm_epsilon={hf.get('layer_norm_epsilon')} (ours is 1e-5)", None),
        (not hf.get("scale_attn_by_inverse_layer_idx", False) and hf.get("scale_attn_weights", True),
         "non-standard attention scaling (scale_attn_by_inverse_layer_idx / scale_attn_weights)", None),
        (cfg.bias, "biases in every layer", "set model.bias=true"),
        (hf.get("tie_word_embeddings", True) == cfg.tie_embeddings,
         f"tie_word_embeddings={hf.get('tie_word_embeddings', True)}",
         f"set model.tie_embeddings={str(hf.get('tie_word_embeddings', True)).lower()}"),
        (block_size <= hf.get("n_positions", 1024),
         f"n_positions={hf.get('n_positions')}, fewer than our block_size {block_size}",
         f"set model.block_size (or data.seq_len) <= {hf.get('n_positions')}"),
        (vocab_size >= hf["vocab_size"], f"vocab_size={hf['vocab_size']}, more than our {vocab_size}",
         f"use the folder's tokenizer (data.tokenizer=gpt2 for GPT-2) or set model.vocab_size>={hf['vocab_size']}"),
    ]
    for ok, what, hint in checks:
        if not ok:
            raise ConfigError(f"run.init_from={where}: the GPT-2 config has {what}, which our model section "
                              f"does not match", hint=hint or "this folder is not a standard GPT-2")


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A GPT-2 folder's weights under GPT2LMHeadModel's names (read_hf_state), the attention masks left out."""
    out = {}
    for k, v in read_hf_state(folder).items():
        if k.endswith(SKIP_SUFFIXES):
            continue
        # GPT2Model (no LM head) checkpoints, such as OpenAI's original upload, lack the "transformer." prefix
        out[k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"] = v
    return out


def import_hf(folder: str | Path, model: nn.Module, cfg) -> None:
    """Copy a GPT2LMHeadModel folder's weights into our GPT, padding vocab rows and slicing positions."""
    folder = Path(folder)
    hf = json.loads((folder / "config.json").read_text())
    check_hf_config(hf, cfg, model.vocab_size, model.block_size, str(folder))
    state = read_hf_weights(folder)
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:model.block_size]
    for k in state:
        if k.endswith(CONV1D_WEIGHTS):
            state[k] = state[k].t()
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    copy_mapped(model, state, ("transformer.wte.weight", "lm_head.weight"), folder, "our GPT",
                "the folder must hold a GPT2LMHeadModel")


# ----------------------------------------------------------------------------- ours -> HF


def export_hf(run: str | Path, out: str | Path, force: bool = False, dtype: str | None = None) -> Path:
    """Write a run's (or checkpoint's) weights as a Hugging Face GPT2LMHeadModel folder (in `dtype`: fp32, bf16,
    fp16; default fp32) with the run's chat template and its stop ids; returns it."""
    ckpt = checkpoint.resolve(run)
    cfg = build_config(checkpoint.load_trainer(ckpt)["config"])
    if cfg.model.family != "gpt":
        raise ConfigError(f"{ckpt} is a model.family={cfg.model.family} run; --format hf exports the dense GPT "
                          f"family (GPT2LMHeadModel)", hint="export a model.family=gpt run")
    out = Path(out)
    check_out(out, force)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    block = cfg.model.block_size or cfg.data.seq_len
    model = build_model(cfg.model, cfg.model.vocab_size or pad_vocab(tokenizer.vocab_size), block)
    checkpoint.load_weights(ckpt, model)
    template = template_for(tokenizer, cfg.data.chat_template)
    with staged(out) as tmp:
        save_file(cast(hf_state(model, tokenizer.vocab_size), dtype), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        write_json(tmp / "config.json", {**hf_config(cfg.model, tokenizer, block), "dtype": dtype_name(dtype)})
        write_generation(tmp, tokenizer, template)
        write_tokenizer(tokenizer, cfg.data.tokenizer, tmp, block)
        write_chat_template(tmp, template)
    return out


def hf_state(model: nn.Module, vocab: int) -> dict[str, torch.Tensor]:
    """Our state dict under HF names: vocab rows sliced, absent biases as zeros, the tied head left out."""
    own = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {}
    for k, v in own.items():
        if k == "lm_head.weight" and model.cfg.tie_embeddings:
            continue  # HF re-ties lm_head to wte on load
        if k.endswith(CONV1D_WEIGHTS):
            v = v.t()
        out[k] = (v[:vocab] if k in ("transformer.wte.weight", "lm_head.weight") else v).contiguous()
    if not model.cfg.bias:
        for k, v in own.items():
            if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                out[k[:-len("weight")] + "bias"] = torch.zeros_like(v)
            elif k.endswith(CONV1D_WEIGHTS):
                out[k[:-len("weight")] + "bias"] = torch.zeros(v.shape[0])  # ours (out, in)
    return out


def hf_config(cfg, tokenizer, block: int) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": tokenizer.vocab_size,
            "n_positions": block, "n_ctx": block, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "dtype": "float32"}


def export(path: str, out: str, merge: bool = False, force: bool = False, dtype: str | None = None) -> list[str]:
    """`trainbox export` of a gpt run: a GPT2LMHeadModel folder."""
    no_merge(path, merge)
    written = export_hf(path, out, force=force, dtype=dtype)
    return [f"wrote {written} (Hugging Face GPT2LMHeadModel, {dtype_name(dtype)}: config.json, model.safetensors, "
            "generation_config.json, tokenizer with the chat template)"]


# ----------------------------------------------------------------------------- HF -> GGUF


def gguf_model(folder: Path) -> GGUFModel:
    """A GPT2LMHeadModel folder (written by export_hf) as llama.cpp's gpt2 architecture: its Conv1D weights
    transposed to (out, in), as convert_hf_to_gguf.py does; a tied head left out (llama.cpp reuses token_embd)."""
    hf = json.loads((Path(folder) / "config.json").read_text())
    state = {k: (v.t() if k.endswith(CONV1D_WEIGHTS) else v) for k, v in read_hf_weights(Path(folder)).items()}
    params = {"block_count": hf["n_layer"], "context_length": hf["n_positions"], "embedding_length": hf["n_embd"],
              "feed_forward_length": hf.get("n_inner") or 4 * hf["n_embd"], "attention.head_count": hf["n_head"],
              "attention.layer_norm_epsilon": float(hf["layer_norm_epsilon"])}
    return GGUFModel("gpt2", params, state)
