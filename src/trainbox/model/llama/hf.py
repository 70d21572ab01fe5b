"""Hugging Face Llama, Mistral, Qwen2 and Qwen3 folders <-> the llama family (`model.family: llama`), both
directions.

    trainbox train sft model.path=FOLDER data.path=chat.jsonl     # shape, tokenizer and weights from FOLDER
    trainbox train llama-1b run.init_from=FOLDER                  # weights only; the recipe's shape must match
    trainbox export runs/sft --format hf --out hf/     # LlamaForCausalLM (qkv_bias: Qwen2, qk_norm: Qwen3;
                                                       # a Mistral folder's run: MistralForCausalLM; a reward
                                                       # model's run: *ForSequenceClassification)

Our parameter names are Hugging Face's and our RoPE uses its rotate_half convention, so the weights copy
across unchanged: no renames, no permutation of q_proj / k_proj rows. What the conversion does: it reads
config.json into the model section (`shape`: both the `rope_theta` + `rope_scaling` keys of transformers 4
and the `rope_parameters` of transformers 5; written back in the first form, which both read), refuses what
the family does not implement (other activations, sliding windows shorter than the context, biases beyond
Qwen2's q/k/v, other RoPE scalings), pads the vocabulary rows when ours is larger, and fills a tied head from the
embedding.
Weights come from model.safetensors or a sharded model.safetensors.index.json.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from trainbox.config.model import ModelSection
from trainbox.data.chat import template_for
from trainbox.data.tokenizer import pad_id
from trainbox.errors import ConfigError
from trainbox.model.gguf_file import GGUFModel
from trainbox.model.hf_folder import (
    TOKENIZER_FILES,
    cast,
    check_out,
    copy_mapped,
    dtype_name,
    no_merge,
    read_hf_state,
    staged,
    write_chat_template,
    write_generation,
    write_tokenizer,
)
from trainbox.model.llama.config import head_dim, intermediate_size, tokenizer_spec
from trainbox.model.load import load_for_inference

# Mistral is Llama's architecture with a sliding-window option: only folders whose window never binds are read
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

log = logging.getLogger("trainbox")


def read_config(folder: str | Path, key: str) -> dict:
    """FOLDER/config.json of a Llama, Mistral, Qwen2 or Qwen3 model; `key` names the setting that gave the folder."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{key}={folder}: no config.json there; model.family=llama reads a local Hugging Face "
                          "folder", hint="download it first (huggingface-cli download ID --local-dir DIR) and "
                                         "pass DIR")
    hf = json.loads(path.read_text())
    if hf.get("model_type") not in ARCHITECTURES:
        raise ConfigError(f"{key}={folder} holds a {hf.get('model_type')!r} model; model.family=llama supports "
                          "model_type llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 "
                          "(Qwen2ForCausalLM) and qwen3 (Qwen3ForCausalLM)",
                          hint="GPT-2 folders load into model.family=gpt (run.init_from); other causal LMs "
                               "train with LoRA through transformers: add model.family=hf to this command "
                               "(as the lora recipe does: trainbox train lora model.path=...)")
    return hf


def folder_context(folder: str | Path) -> int | None:
    """The positions FOLDER's model supports: its config.json's max_position_embeddings (None where it gives none, or
    where the folder is no longer there: a run whose weights are all in its checkpoints, which then samples within
    data.seq_len, said in a warning)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        log.warning(f"model.path={folder}: no config.json there to read the model's context from; sampling stays "
                    "within data.seq_len")
        return None
    return json.loads(path.read_text()).get("max_position_embeddings")


def shape(hf: dict, where: str) -> dict:
    """A Llama / Mistral / Qwen2 / Qwen3 config.json as our model keys (dotted) -> values; refuses what we do not
    implement."""
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    window = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None   # Mistral applies any it has
    refused = [(hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')} (ours is silu)"),
               (not hf.get("attention_bias", False), "attention_bias=true (biases on every attention projection)"),
               (not hf.get("mlp_bias", False), "mlp_bias=true"),
               (not hf.get("use_sliding_window", False), "use_sliding_window=true"),
               (window is None or window >= hf.get("max_position_embeddings", 0),
                f"sliding_window={window} (each position attends to the last {window} only; ours: the whole "
                f"context of max_position_embeddings={hf.get('max_position_embeddings')})"),
               (layer_types == {"full_attention"}, f"layer_types {sorted(layer_types)} (ours: full_attention)")]
    for ok, what in refused:
        if not ok:
            raise ConfigError(f"{where}/config.json has {what}, which model.family=llama does not implement",
                              hint="LoRA runs it through transformers: add model.family=hf to this command (as "
                                   f"the lora recipe does: trainbox train lora model.path={where})")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"{where}/config.json has RoPE scaling {rope_type!r}; model.family=llama implements "
                          "llama3 scaling and plain RoPE")
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    out = {"model.n_layer": hf["num_hidden_layers"], "model.n_head": n_head, "model.n_embd": n_embd,
           "model.head_dim": hf.get("head_dim") or n_embd // n_head,
           "model.llama.n_kv_head": hf.get("num_key_value_heads") or n_head,
           "model.llama.intermediate_size": hf["intermediate_size"],
           "model.llama.rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
           "model.llama.rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
           "model.llama.qkv_bias": hf["model_type"] == "qwen2", "model.llama.qk_norm": hf["model_type"] == "qwen3",
           "model.llama.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
           "model.llama.rope_scaling.rope_type": "llama3" if rope_type == "llama3" else "none"}
    if rope_type == "llama3":
        out.update({f"model.llama.rope_scaling.{k}": (int if k.startswith("original") else float)(rope[k])
                    for k in ROPE_KEYS})
    return out


def ours(cfg) -> dict:
    """The model section's effective values under the keys of `shape` (defaults filled in)."""
    lc, rs = cfg.llama, cfg.llama.rope_scaling
    out = {"model.n_layer": cfg.n_layer, "model.n_head": cfg.n_head, "model.n_embd": cfg.n_embd,
           "model.head_dim": head_dim(cfg), "model.llama.n_kv_head": lc.n_kv_head or cfg.n_head,
           "model.llama.intermediate_size": intermediate_size(cfg), "model.llama.rope_theta": lc.rope_theta,
           "model.llama.rms_norm_eps": lc.rms_norm_eps, "model.llama.qkv_bias": lc.qkv_bias,
           "model.llama.qk_norm": lc.qk_norm,
           "model.llama.tie_embeddings": lc.tie_embeddings, "model.llama.rope_scaling.rope_type": rs.rope_type}
    if rs.rope_type == "llama3":
        out.update({f"model.llama.rope_scaling.{k}": getattr(rs, k) for k in ROPE_KEYS})
    return out


def _same(a, b) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b)) if isinstance(a, float) or isinstance(b, float) else a == b


def _text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _explicit(model, key: str) -> bool:
    """Whether the config sets the dotted model key (`model.llama.n_kv_head`) rather than leaving its default."""
    *sections, name = key.split(".")[1:]
    node = model
    for part in sections:
        if part not in node.model_fields_set:
            return False
        node = getattr(node, part)
    return name in node.model_fields_set


def _set(data: dict, key: str, value) -> None:
    *sections, name = key.split(".")[1:]
    for part in sections:
        data = data[part]
    data[name] = value


def model_section(hf: dict, where: str) -> ModelSection:
    """A Llama / Mistral / Qwen2 / Qwen3 config.json as the llama family's model section: the folder's shape
    (`shape`) and vocabulary, every other key at its default."""
    data = ModelSection(family="llama").model_dump()
    for key, value in shape(hf, where).items():
        _set(data, key, value)
    data["vocab_size"] = hf["vocab_size"]
    return ModelSection.model_validate(data)


def resolve_from_folder(run):
    """model.path: the model section takes the folder's shape and vocabulary, run.init_from the folder (unless
    set). A shape key the config sets to another value than the folder's is refused."""
    folder = run.model.path
    hf = read_config(folder, "model.path")
    theirs, mine = shape(hf, folder), ours(run.model)
    for key, value in theirs.items():
        if _explicit(run.model, key) and not _same(mine.get(key), value):
            raise ConfigError(f"{key}={_text(mine.get(key))} but {folder}/config.json gives {_text(value)}",
                              hint=f"leave {key} unset: model.path gives the model its shape")
    if run.model.vocab_size is not None and run.model.vocab_size < hf["vocab_size"]:
        raise ConfigError(f"model.vocab_size={run.model.vocab_size} is smaller than {folder}'s {hf['vocab_size']}",
                          hint="leave model.vocab_size unset")
    data = run.model.model_dump()
    for key, value in theirs.items():
        _set(data, key, value)
    data["vocab_size"] = run.model.vocab_size or hf["vocab_size"]
    model = type(run.model).model_validate(data)
    return run.model_copy(update={"model": model,
                                  "run": run.run.model_copy(update={"init_from": run.run.init_from or folder})})


# ----------------------------------------------------------------------------- weights in


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights (hf_folder.read_hf_state) under HF's LlamaForCausalLM names."""
    state = read_hf_state(folder)
    # a LlamaModel without its head stores its keys without the "model." prefix; old ones keep RoPE tables
    return {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in state.items()
            if not k.endswith("rotary_emb.inv_freq")}


def import_hf(folder: str | Path, model: nn.Module, cfg) -> None:
    """`run.init_from` of a Llama / Qwen2 / Qwen3 folder: its config must match the model section; weights copied,
    the vocabulary padded with zero rows where ours is larger."""
    folder = Path(folder)
    hf = read_config(folder, "run.init_from")
    for key, value in shape(hf, str(folder)).items():
        mine = ours(cfg).get(key)
        if not _same(mine, value):
            raise ConfigError(f"{key}={_text(mine)} but run.init_from={folder} has {_text(value)} in its config.json",
                              hint=f"set {key}={_text(value)}, or use model.path={folder}, which takes the shape "
                                   "from the folder")
    if model.vocab_size < hf["vocab_size"]:
        raise ConfigError(f"run.init_from={folder} has vocab_size={hf['vocab_size']}, more than our {model.vocab_size}",
                          hint=f"use the folder's tokenizer (data.tokenizer={folder}) or set "
                               f"model.vocab_size={hf['vocab_size']}")
    state = read_weights(folder)
    if cfg.llama.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if hasattr(model, "score"):   # a reward model on a causal folder: its score head starts as drawn (ScoreHead)
        state.setdefault("score.weight", model.score.weight.detach().clone())
    copy_mapped(model, state, ("model.embed_tokens.weight", "lm_head.weight"), folder, "our llama model",
                "the folder must hold a LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM")


# ----------------------------------------------------------------------------- weights out


def hf_config(cfg, vocab: int, block: int, source: dict | None = None, pad: int | None = None) -> dict:
    """config.json for our model section: Qwen2ForCausalLM with q/k/v biases, Qwen3ForCausalLM with q/k norms,
    else MistralForCausalLM where `source` (the config.json of model.path, where there is one) is a Mistral, else
    LlamaForCausalLM. Token ids and the context length come from `source`. A reward model's (`pad`: its padding
    id, data/tokenizer.py pad_id): the *ForSequenceClassification of the same, one label, scoring at the last
    token that is not `pad`."""
    lc, rs = cfg.llama, cfg.llama.rope_scaling
    model_type = "qwen2" if lc.qkv_bias else "qwen3" if lc.qk_norm else \
        "mistral" if (source or {}).get("model_type") == "mistral" else "llama"
    scaling = None
    context = block
    if rs.rope_type == "llama3":
        scaling = {"rope_type": "llama3", **{k: getattr(rs, k) for k in ROPE_KEYS}}
        context = max(block, int(rs.original_max_position_embeddings * rs.factor))
    out = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": vocab,
           "hidden_size": cfg.n_embd, "intermediate_size": intermediate_size(cfg),
           "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
           "num_key_value_heads": lc.n_kv_head or cfg.n_head, "head_dim": head_dim(cfg), "hidden_act": "silu",
           "max_position_embeddings": context, "rms_norm_eps": lc.rms_norm_eps, "rope_theta": lc.rope_theta,
           "rope_scaling": scaling, "tie_word_embeddings": lc.tie_embeddings, "initializer_range": 0.02,
           "attention_dropout": 0.0, "use_cache": True, "dtype": "float32"}
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif model_type == "mistral":
        out.update(sliding_window=None)   # every position attends to the whole context, as ours did
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    if model_type == "qwen3":
        out.update(attention_bias=False)   # every layer full attention: transformers reads it from sliding_window
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        if source and source.get(key) is not None:
            out[key] = source[key]
    if pad is not None:
        out.update(architectures=[ARCHITECTURES[model_type].replace("ForCausalLM", "ForSequenceClassification")],
                   num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, pad_token_id=pad)
    return out


def hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our weights under their (Hugging Face) names in fp32; a tied head is left out (transformers re-ties it), and
    a reward model's token head (its `score` is its head)."""
    drop = hasattr(model, "score") or model.cfg.llama.tie_embeddings
    return {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and drop)}


def write_hf(model: nn.Module, cfg, folder: Path, eot_id: int, block: int, dtype: str | None = None,
             pad: int | None = None) -> str:
    """model.safetensors (in `dtype`: fp32, bf16, fp16; default fp32), config.json and generation_config.json
    (model.path's, else end-of-text's ids) into `folder`; returns the architecture. `pad`: a reward model's
    padding id (hf_config)."""
    source_dir = Path(cfg.path) if cfg.path else None
    source = json.loads((source_dir / "config.json").read_text()) if source_dir and \
        (source_dir / "config.json").is_file() else {"bos_token_id": eot_id, "eos_token_id": eot_id}
    config = {**hf_config(cfg, model.vocab_size, block, source, pad), "dtype": dtype_name(dtype)}
    save_file(cast(hf_state(model), dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = source_dir / "generation_config.json" if source_dir else None
    if generation is not None and generation.is_file():
        (folder / "generation_config.json").write_text(generation.read_text())
    else:
        (folder / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}, indent=2) + "\n")
    return config["architectures"][0]


def export(path: str, out: str, merge: bool = False, force: bool = False, dtype: str | None = None) -> list[str]:
    """`trainbox export` of a llama run: a LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases, Qwen3ForCausalLM
    with q/k norms, MistralForCausalLM for a Mistral folder's run; a reward model's *ForSequenceClassification) folder
    with
    the run's tokenizer (the files of its tokenizer folder, model.path's, copied; else written as for gpt), its
    chat template, and generation_config.json stopping at end-of-text and the end-of-turn token."""
    no_merge(path, merge)
    out = Path(out)
    check_out(out, force)
    model, tokenizer, cfg = load_for_inference(path, generates=False)
    block = model.block_size
    template = template_for(tokenizer, cfg.data.chat_template)
    with staged(out) as tmp:
        arch = write_hf(model, cfg.model, tmp, tokenizer.eot_id, block, dtype,
                        pad_id(tokenizer) if hasattr(model, "score") else None)
        write_generation(tmp, tokenizer, template, json.loads((tmp / "generation_config.json").read_text()))
        name = tokenizer_spec(cfg)
        spec = Path(name)   # a Hugging Face tokenizer folder: its files as they are (gpt2 is the built-in one, never
        builtin = name == "gpt2" or name.startswith("embedded:")   # a folder of that name where export runs)
        if not builtin and (spec / "tokenizer_config.json").is_file():
            for name in TOKENIZER_FILES:
                if (spec / name).is_file():
                    shutil.copyfile(spec / name, tmp / name)
        else:
            write_tokenizer(tokenizer, cfg.data.tokenizer, tmp, block)
        write_chat_template(tmp, template)
    return [f"wrote {out} (Hugging Face {arch}, {dtype_name(dtype)}: config.json, model.safetensors, "
            "generation_config.json, tokenizer with the chat template)"]


# ----------------------------------------------------------------------------- HF -> GGUF


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q_proj / k_proj rows from rotate_half's order (the halves of each head) to the interleaved pairs of
    llama.cpp's llama architecture (RoPE type NORM), as convert_hf_to_gguf.py's LlamaModel.permute does."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_factors(theirs: dict, dim: int) -> torch.Tensor:
    """Llama 3 RoPE scaling (`theirs`: a folder's `shape`) as the per-frequency divisors llama.cpp reads from
    rope_freqs.weight."""
    rope = {k: theirs[f"model.llama.rope_scaling.{k}"] for k in ROPE_KEYS}
    base = theirs["model.llama.rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = 2 * math.pi / freqs
    old = rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / rope["factor"] + smooth)
    return torch.where(wavelen < old / high, torch.ones_like(freqs),
                       torch.where(wavelen > old / low, torch.full_like(freqs, rope["factor"]), mid))


def gguf_model(folder: Path) -> GGUFModel:
    """A LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM folder (written by export) as
    llama.cpp's llama (Mistral's too, as llama.cpp's converter writes it), qwen2 or qwen3 architecture: llama's q/k
    rows permuted to interleaved RoPE pairs (qwen2 and qwen3 keep rotate_half: RoPE type NEOX; qwen3's q/k norms
    go as attn_q_norm / attn_k_norm), Llama 3 scaling as rope_freqs.weight, the hyperparameters as
    convert_hf_to_gguf.py writes them."""
    hf = read_config(folder, "export")
    theirs = shape(hf, str(folder))   # RoPE as transformers 4 (rope_scaling) or 5 (rope_parameters) writes it
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    dim = hf.get("head_dim") or hf["hidden_size"] // heads
    state = read_weights(Path(folder))
    arch = "llama" if hf["model_type"] == "mistral" else hf["model_type"]
    if arch == "llama":
        for k in state:
            if k.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
                state[k] = permute(state[k], heads if ".q_proj." in k else kv)
    params = {"block_count": hf["num_hidden_layers"], "context_length": hf["max_position_embeddings"],
              "embedding_length": hf["hidden_size"], "feed_forward_length": hf["intermediate_size"],
              "attention.head_count": heads, "attention.head_count_kv": kv,
              "rope.freq_base": theirs["model.llama.rope_theta"],
              "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]), "attention.key_length": dim,
              "attention.value_length": dim}
    if arch == "llama":
        params.update({"vocab_size": hf["vocab_size"], "rope.dimension_count": dim})
    extra = {"rope_freqs.weight": rope_factors(theirs, dim)} \
        if theirs["model.llama.rope_scaling.rope_type"] == "llama3" else {}
    return GGUFModel(arch, params, state, extra)
