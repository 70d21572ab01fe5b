"""Hugging Face GPT-2 folders <-> our dense GPT (`model.family: gpt`), both directions.

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

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from trainbox import checkpoint
from trainbox.errors import CheckpointError, ConfigError
from trainbox.files import default_modes

SKIP_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older transformers versions
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_hf_folder(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and not (p / "COMPLETE").is_file()


def load_init_weights(path: str | Path, model: nn.Module, cfg) -> None:
    """`run.init_from`: a Hugging Face folder (the family's importer: GPT-2 here, Llama / Qwen2 in
    model/llama_hf.py) or one of our run directories / checkpoints."""
    from trainbox.model.spec import family
    if is_hf_folder(path):
        family(cfg.family).hf_importer()(path, model, cfg)
    else:
        checkpoint.load_weights(checkpoint.resolve(path), model)


# ----------------------------------------------------------------------------- HF -> ours


def check_hf_config(hf: dict, cfg, vocab_size: int, block_size: int, where: str) -> None:
    """Raise ConfigError naming the first `model.*` key that disagrees with the folder's config.json."""
    if hf.get("model_type") != "gpt2":
        raise ConfigError(f"run.init_from={where} holds a '{hf.get('model_type')}' model; only GPT-2 folders "
                          f"load into model.family=gpt", hint="Llama and Qwen2 folders: model.family=llama (full "
                                                                  "fine-tuning: trainbox train sft model.path=...); "
                                                                  "other causal LMs: model.family=hf model.path=...")
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


def read_hf_state(folder: Path) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's tensors as saved: model.safetensors, sharded safetensors (with their index) or
    pytorch_model.bin (tensors and plain values only)."""
    if (folder / "model.safetensors").is_file():
        state = load_file(str(folder / "model.safetensors"))
    elif (folder / "model.safetensors.index.json").is_file():
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        state = {}
        for shard in sorted(set(index["weight_map"].values())):
            state.update(load_file(str(folder / shard)))
    elif (folder / "pytorch_model.bin").is_file():
        try:   # tensors and plain values only: a pickle that would run code is refused
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError
            raise CheckpointError(f"{folder / 'pytorch_model.bin'} cannot be loaded safely: "
                                  f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__}",
                                  hint="use a folder with model.safetensors") from None
    else:
        raise CheckpointError(f"{folder} has a config.json but no model.safetensors or pytorch_model.bin",
                              hint="save the model with model.save_pretrained(folder)")
    return state


def load_hf_gpt2(folder: str | Path, model: nn.Module, cfg) -> None:
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


def copy_mapped(model: nn.Module, state: dict[str, torch.Tensor], vocab_rows: tuple[str, ...], folder: Path,
                what: str, hint: str) -> None:
    """Copy a Hugging Face folder's weights, already under our names, into `model`: the `vocab_rows` tensors
    padded with zero rows to our (padded) vocabulary; any other difference of names or shapes is refused."""
    own = model.state_dict()
    for name in vocab_rows:
        if name in state and state[name].shape[0] < own[name].shape[0]:
            pad = state[name].new_zeros(own[name].shape[0] - state[name].shape[0], state[name].shape[1])
            state[name] = torch.cat([state[name], pad])
    wrong = [f"{k} {tuple(state[k].shape)} vs ours {tuple(v.shape)}" for k, v in own.items()
             if k in state and state[k].shape != v.shape]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if wrong or missing or unexpected:
        raise CheckpointError(f"{folder} does not map onto {what}: shapes {wrong[:3]}, missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}", hint=hint)
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])


# ----------------------------------------------------------------------------- ours -> HF


def export_hf(run: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write a run's (or checkpoint's) weights as a Hugging Face GPT2LMHeadModel folder; returns it."""
    from trainbox.config import build_config
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.model.spec import build_model, pad_vocab

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
    with staged(out) as tmp:
        save_file(hf_state(model, tokenizer.vocab_size), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", hf_config(cfg.model, tokenizer, block))
        _write_json(tmp / "generation_config.json",
                    {"bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id})
        write_tokenizer(tokenizer, cfg.data.tokenizer, tmp, block)
    return out


def check_out(out: Path, force: bool) -> None:
    """Refuse to write into a folder that holds files, unless --force."""
    if out.exists() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} exists and is not empty", hint="choose another folder or pass --force")


@contextlib.contextmanager
def staged(out: Path):
    """A fresh staging folder beside `out` that replaces `out` (files readable by all) when the block succeeds;
    on any error it is removed and `out` stays as it was."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        default_modes(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
            "n_positions": block, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "dtype": "float32"}


def write_tokenizer(tokenizer, spec: str, folder: Path, block: int) -> None:
    """gpt2: vocab.json + merges.txt (the original files) and an equivalent tokenizer.json; else its tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from trainbox.data.tokenizer import EOT_TEXT, asset_path
    eot = EOT_TEXT
    if spec == "gpt2":
        shutil.copyfile(asset_path("encoder.json"), folder / "vocab.json")
        shutil.copyfile(asset_path("vocab.bpe"), folder / "merges.txt")
        tok = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOT_TEXT, special=True)])
        tok.save(str(folder / "tokenizer.json"))
        klass = "GPT2Tokenizer"
    else:
        shutil.copyfile(_tokenizer_file(spec), folder / "tokenizer.json")
        eot = (tokenizer.tok.id_to_token(tokenizer.eot_id) if hasattr(tokenizer, "tok")   # tokenizers' or transformers'
               else tokenizer.hf.convert_ids_to_tokens(tokenizer.eot_id))
        klass = "PreTrainedTokenizerFast"
    _write_json(folder / "tokenizer_config.json", {"tokenizer_class": klass, "bos_token": eot, "eos_token": eot,
                                                   "unk_token": eot, "model_max_length": block,
                                                   "add_prefix_space": False})
    _write_json(folder / "special_tokens_map.json", {"bos_token": eot, "eos_token": eot, "unk_token": eot})


def _tokenizer_file(spec: str) -> Path:
    from trainbox.data.tokenizer import asset_path
    if spec.startswith("embedded:"):
        return asset_path(f"{spec.split(':', 1)[1]}.json")
    p = Path(spec)
    return p / "tokenizer.json" if p.is_dir() else p


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _no_merge(path: str, merge: bool) -> None:
    if merge:
        raise ConfigError(f"--merge applies to LoRA runs (model.family=hf); {path} is not one")


def export_cli(path: str, out: str, merge: bool = False, force: bool = False) -> list[str]:
    """`trainbox export` of a gpt run: a GPT2LMHeadModel folder."""
    _no_merge(path, merge)
    written = export_hf(path, out, force=force)
    return [f"wrote {written} (Hugging Face format: config.json, model.safetensors, tokenizer)"]


def export_llama_cli(path: str, out: str, merge: bool = False, force: bool = False) -> list[str]:
    """`trainbox export` of a llama run: a LlamaForCausalLM (or, with q/k/v biases, Qwen2ForCausalLM) folder with
    the run's tokenizer: the files of its tokenizer folder (model.path's) copied, else written as for gpt."""
    from trainbox.generate import load_for_inference
    from trainbox.model.llama import tokenizer_spec
    from trainbox.model.llama_hf import write_hf

    _no_merge(path, merge)
    out = Path(out)
    check_out(out, force)
    model, tokenizer, cfg = load_for_inference(path)
    block = cfg.model.block_size or cfg.data.seq_len
    with staged(out) as tmp:
        arch = write_hf(model, cfg.model, tmp, tokenizer.eot_id, block)
        spec = Path(tokenizer_spec(cfg))
        if (spec / "tokenizer_config.json").is_file():  # a Hugging Face tokenizer folder: its files as they are
            for name in TOKENIZER_FILES:
                if (spec / name).is_file():
                    shutil.copyfile(spec / name, tmp / name)
        else:
            write_tokenizer(tokenizer, cfg.data.tokenizer, tmp, block)
    return [f"wrote {out} (Hugging Face {arch}: config.json, model.safetensors, tokenizer)"]


def export_t5_cli(path: str, out: str, merge: bool = False, force: bool = False) -> list[str]:
    """`trainbox export` of a t5 run: a T5ForConditionalGeneration folder."""
    from trainbox.generate import load_for_inference
    from trainbox.model.t5 import to_hf

    _no_merge(path, merge)
    model, tok, _ = load_for_inference(path)
    target = Path(out)
    if target.exists() and any(target.iterdir()) and not force:
        raise ConfigError(f"{target} exists and is not empty", hint="choose another --out or pass --force")
    to_hf(model, target, eos_token_id=tok.eot_id)
    default_modes(target)
    return [f"wrote {target} (Hugging Face T5ForConditionalGeneration: config.json, model.safetensors)"]


def export_moe_cli(path: str, out: str, merge: bool = False, force: bool = False) -> list[str]:
    """`trainbox export` of an moe run. Hugging Face transformers has no GPT-2 MoE class, so the folder is the
    family's own (model/moe.py: save_pretrained): config.json, model.safetensors and the tokenizer, loaded by
    `trainbox.model.moe.from_pretrained(folder)`."""
    from trainbox.generate import load_for_inference
    from trainbox.model.moe import save_pretrained

    _no_merge(path, merge)
    model, tok, cfg = load_for_inference(path)
    target = Path(out)
    check_out(target, force)
    with staged(target) as tmp:
        save_pretrained(model, tmp)
        write_tokenizer(tok, cfg.data.tokenizer, tmp, model.block_size)
    return [f"wrote {target} (trainbox MoE format: config.json, model.safetensors, tokenizer); Hugging Face "
            f"transformers has no GPT-2 MoE class: load it with trainbox.model.moe.from_pretrained({str(target)!r})"]
