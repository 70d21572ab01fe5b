"""`trainbox export`: a run or checkpoint written in the format inference engines read, by its family's own
mapping (model/<family>/hf.py: GPT2LMHeadModel, LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM, T5ForConditionalGeneration, a PEFT adapter or merged model, the moe family's own folder), or as a
GGUF file (model/gguf_file.py) for the families that declare GGUF types.

    trainbox export runs/gpt2-125m --format hf --out hf/gpt2-125m --dtype bf16
    trainbox export runs/sft --format gguf --gguf-type q8_0 --out sft-q8_0.gguf

What can be refused is refused before any weights are read, in one message: a checkpoint that does not verify,
a family without GGUF or a GGUF type it does not write, options of the other format, the `gguf` extra missing, an
--out that is, holds or lies inside the checkpoint or the run's base model folder (--force would replace it).
"""
from __future__ import annotations

from pathlib import Path

from trainbox import checkpoint
from trainbox.config import build_config
from trainbox.errors import BadCheckpoint, CheckpointError, ConfigError, require
from trainbox.model import gguf_file
from trainbox.model.hf_folder import DTYPES
from trainbox.model.spec import family

FORMATS = ("hf", "gguf")


def export(path: str | Path, out: str | Path | None = None, merge: bool = False, force: bool = False,
           format: str = "hf", dtype: str | None = None, gguf_type: str | None = None) -> list[str]:
    """Write the newest verified checkpoint of `path` (a run, its checkpoints folder or a step folder) to `out`
    (default: RUN-hf, RUN-merged with `merge`, RUN-TYPE.gguf for gguf); returns the lines saying what was written.
    `dtype` (fp32, bf16, fp16) is the weights' dtype of --format hf; `gguf_type` (model.spec.GGUF_TYPES: f16 to
    q4_0) GGUF's."""
    try:
        ckpt = checkpoint.resolve(path)
    except CheckpointError as e:
        raise BadCheckpoint(e.message, e.hint) from None
    cfg = build_config(checkpoint.load_trainer(ckpt)["config"])
    name = cfg.model.family
    spec = family(name)
    run = Path(str(path).rstrip("/")).name
    if format not in FORMATS:
        raise ConfigError(f"--format {format} is not one of {', '.join(FORMATS)}")
    default = run + ("-merged" if merge else "-hf") if format == "hf" else f"{run}-{gguf_type or 'f16'}.gguf"
    out = Path(out or default)
    sources = [(ckpt, "the checkpoint it exports")]
    if cfg.model.path and Path(cfg.model.path).is_dir():
        sources.append((Path(cfg.model.path), "the run's base model (model.path)"))
    for source, what in sources:   # --force replaces --out: never with what the export reads
        o, src = out.resolve(), source.resolve()
        if o == src or o in src.parents or src in o.parents:
            where = "is" if o == src else "holds" if o in src.parents else "is inside"
            raise ConfigError(f"--out {out} {where} {what}, {source}: the export would write over what it reads",
                              hint=f"choose an --out outside it, e.g. the default {default}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if format == "hf":
        if gguf_type is not None:
            raise ConfigError(f"--gguf-type {gguf_type} applies to --format gguf", hint="drop it, or add --format gguf")
        return spec.hf().export(str(path), str(out), merge=merge, force=force, dtype=dtype)
    if cfg.train.objective == "reward":
        raise ConfigError(f"{ckpt} holds a reward model (train.objective=reward), and GGUF files hold language "
                          "models (llama.cpp generates with them)",
                          hint=f"export it with --format hf: a *ForSequenceClassification folder that transformers "
                               f"and vLLM score with (trainbox export {path} --format hf)")
    gguf_type = gguf_type or "f16"
    gguf_file.check_type(gguf_type, name, spec.gguf)
    for flag, given in (("--merge", merge), (f"--dtype {dtype}", dtype)):
        if given:
            raise ConfigError(f"{flag} applies to --format hf; GGUF's precision is --gguf-type",
                              hint=f"drop {flag.split()[0]}")
    require("gguf", "gguf", "export --format gguf")
    mapping = spec.hf()
    if spec.adapters:   # GGUF holds whole weights: the adapters merged into a base of an architecture that converts
        mapping.check_gguf(cfg)
    return gguf_file.export(mapping, str(path), str(out), gguf_type, force, run, merge=spec.adapters)
