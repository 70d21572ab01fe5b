"""Export a LoRA run (`model.family: hf`) in Hugging Face formats, and as GGUF.

    trainbox export runs/lora --format hf --out adapter/            # PEFT adapter: PeftModel.from_pretrained
    trainbox export runs/lora --format hf --merge --out merged/     # base + adapter in the base's precision
    trainbox export runs/lora --format gguf --out lora-f16.gguf     # merged, as llama.cpp's converter writes it

The adapter is written by PEFT itself (`adapter_config.json` + `adapter_model.safetensors`, the base
named by `model.path`), with the tokenizer beside it. `--merge` reloads the base unquantised in the
precision it is stored in (`dtype="auto"`), folds the adapter in (`merge_and_unload`) and saves a plain
transformers model. A run trained on a 4-bit or 8-bit base is refused for merging unless `force`: the
adapter learned to correct a quantised base, so merging into the full-precision weights changes the
function; with `force` the base is reloaded in bf16 for the merge, as is common practice for QLoRA.
Every export is written into a temporary folder next to `out` and renamed into place. GGUF is the merged model
converted by the family that has the base's architecture (`gguf_model`: Llama, Mistral, Qwen2, Qwen3 as the llama
family writes them, GPT-2 as the gpt family does); another base is refused before any weights are read
(`check_gguf`).
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainbox import checkpoint
from trainbox.config import RunConfig, build_config
from trainbox.data.chat import template_for
from trainbox.data.sft import load_hf_tokenizer
from trainbox.data.tokenizer import pad_id
from trainbox.errors import ConfigError, require
from trainbox.files import default_modes
from trainbox.model.build import add_score_head
from trainbox.model.gguf_file import GGUFModel
from trainbox.model.gpt import hf as gpt_hf
from trainbox.model.hf.model import build_hf
from trainbox.model.hf_folder import DTYPES, write_chat_template, write_generation
from trainbox.model.llama import hf as llama_hf

log = logging.getLogger("trainbox")


def load_lora_run(path: str | Path, dtype) -> tuple:
    """Run directory or checkpoint -> (HFCausalLM with the trained adapter on CPU, RunConfig, checkpoint)."""
    ckpt = checkpoint.resolve(path)
    cfg: RunConfig = build_config(checkpoint.load_trainer(ckpt)["config"])
    if cfg.model.family != "hf":
        raise ConfigError(f"{ckpt} is a model.family={cfg.model.family} run, not a LoRA (hf) run")
    model = build_hf(cfg, dtype=dtype, quantize=False)
    add_score_head(model, cfg.model, cfg)
    checkpoint.load_weights(ckpt, model)
    return model.eval(), cfg, ckpt


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"--out {out} exists and is not a folder")
        shutil.rmtree(out)
    tmp.rename(out)


def export_lora_hf(path: str | Path, out: str | Path, merge: bool = False, force: bool = False,
                   dtype: str | None = None) -> dict:
    """Write the adapter (PEFT format) or, with `merge`, a merged model to `out` (in `dtype`: fp32, bf16, fp16;
    default the base's own). Both carry the run's chat template; the merged model's generation_config.json stops
    at end-of-text and the end-of-turn token. Returns a summary."""
    require("peft", "finetune", "exporting a LoRA run")
    ckpt = checkpoint.resolve(path)
    cfg = build_config(checkpoint.load_trainer(ckpt)["config"])
    if dtype and not merge:
        raise ConfigError(f"--dtype {dtype} applies to a whole model; a PEFT adapter is written as trained",
                          hint="add --merge to write the base with the adapter folded in, in that dtype")
    quantized = cfg.quant.quantized
    reward = cfg.train.objective == "reward"
    if reward and not merge:
        raise ConfigError(f"{ckpt} holds a reward model (train.objective=reward): its score head is not an adapter, "
                          "so it is written with the adapters merged, as a *ForSequenceClassification model",
                          hint=f"add --merge: trainbox export {path} --format hf --merge")
    if merge and quantized and not force:
        bits = 4 if cfg.quant.load_in_4bit else 8
        raise ConfigError(f"{ckpt} was trained on a {bits}-bit quantised base; merging its adapter into the "
                          f"full-precision base changes what the adapter corrects, so it is refused",
                          hint="export the adapter alone (--format hf without --merge), or pass --force to merge "
                               "into the base reloaded in bf16")
    load_dtype = DTYPES[dtype] if dtype else torch.bfloat16 if (merge and quantized) else "auto"
    model, cfg, ckpt = load_lora_run(ckpt, load_dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if merge:
            merged = model.peft.merge_and_unload()
            merged.save_pretrained(tmp, safe_serialization=True)
            kind, dt = "merged model", str(next(merged.parameters()).dtype).replace("torch.", "")
        else:
            model.peft.save_pretrained(tmp)
            kind, dt = "PEFT adapter", "fp32"
        tok_src = cfg.data.tokenizer if cfg.data.tokenizer != "gpt2" else cfg.model.path
        tokenizer = load_hf_tokenizer(tok_src)
        tokenizer.hf.save_pretrained(tmp)
        if reward:
            kind = f"merged reward model ({as_sequence_classifier(tmp, model.score.weight, pad_id(tokenizer))})"
        template = template_for(tokenizer, cfg.data.chat_template)
        write_chat_template(tmp, template)
        if merge:
            source = tmp / "generation_config.json"
            write_generation(tmp, tokenizer, template, json.loads(source.read_text()) if source.is_file() else None)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(f"exported {kind} of {ckpt} to {out} ({dt})")
    return {"checkpoint": str(ckpt), "out": str(out), "kind": kind, "dtype": dt, "base": cfg.model.path,
            "merged": merge}


def as_sequence_classifier(folder: Path, score: torch.Tensor, pad: int) -> str:
    """Turn a saved causal LM (`folder`: config.json and its safetensors files) into the *ForSequenceClassification
    of its architecture with one label and `score` as its head, scoring at the last token that is not `pad`: the
    token head leaves the weights, score.weight joins them (in the weights' dtype). Returns the architecture."""
    config = json.loads((folder / "config.json").read_text())
    arch = [a.replace("ForCausalLM", "ForSequenceClassification").replace("LMHeadModel", "ForSequenceClassification")
            for a in config.get("architectures") or []]
    config.update(architectures=arch, num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
                  pad_token_id=pad)
    files = sorted(folder.glob("*.safetensors"))
    dtype = None
    for f in files:
        state = load_file(f)
        dtype = dtype or next(iter(state.values())).dtype
        if state.pop("lm_head.weight", None) is not None:
            save_file(state, f, metadata={"format": "pt"})
    weight = score.detach().to("cpu", dtype or torch.float32).contiguous()
    index = folder / "model.safetensors.index.json"
    if index.is_file():   # sharded: the head in a file of its own, named in the index
        save_file({"score.weight": weight}, folder / "score.safetensors", metadata={"format": "pt"})
        mapping = json.loads(index.read_text())
        mapping["weight_map"].pop("lm_head.weight", None)
        mapping["weight_map"]["score.weight"] = "score.safetensors"
        index.write_text(json.dumps(mapping, indent=2) + "\n")
    else:
        state = load_file(folder / "model.safetensors")
        save_file({**state, "score.weight": weight}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ", ".join(arch)


def export(path: str, out: str, merge: bool = False, force: bool = False, dtype: str | None = None) -> list[str]:
    """`trainbox export` of a LoRA run: the PEFT adapter, or the model with the adapter merged (--merge)."""
    res = export_lora_hf(checkpoint.resolve(path), out, merge=merge, force=force, dtype=dtype)
    default_modes(Path(res["out"]))
    lines = [f"wrote {res['kind']} ({res['dtype']}) to {res['out']} from {res['checkpoint']}"]
    if not res["merged"]:
        lines.append(f"load it with: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({res['base']!r}), "
                     f"{res['out']!r})")
    return lines


# ----------------------------------------------------------------------------- GGUF

# the bases whose merged folder converts to GGUF, by config.json's model_type: the family that writes it
GGUF_BASES = {**{t: llama_hf for t in llama_hf.ARCHITECTURES}, "gpt2": gpt_hf}


def check_gguf(cfg: RunConfig) -> None:
    """Refuse, before any weights are read, a base (model.path) whose architecture trainbox does not convert to GGUF,
    or one the llama family does not implement as it is configured (a sliding window that binds)."""
    require("transformers", "finetune", "exporting a LoRA run")
    from transformers import AutoConfig  # optional: transformers

    try:
        base = AutoConfig.from_pretrained(cfg.model.path).to_dict()
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the config.json of the run's base {cfg.model.path}: "
                          f"{str(e).splitlines()[0]}", hint="GGUF export reads the base the run was trained on: "
                                                            "model.path must still be there") from None
    model_type = base.get("model_type")
    if model_type not in GGUF_BASES:
        raise ConfigError(f"the run's base {cfg.model.path} is a {model_type!r} model; trainbox writes GGUF for "
                          f"{', '.join(sorted(GGUF_BASES))} bases",
                          hint="export with --format hf --merge; where llama.cpp has the architecture, its "
                               "convert_hf_to_gguf.py converts that folder")
    if GGUF_BASES[model_type] is llama_hf:
        llama_hf.shape(base, str(cfg.model.path))


def gguf_model(folder: Path) -> GGUFModel:
    """The merged folder (export with merge) as the family of its architecture converts it."""
    model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    return GGUF_BASES[model_type].gguf_model(folder)
