"""Hugging Face model folders, as every family's mapping (model/<family>/hf.py) reads and writes them: what a folder
holds, its tensors, copying mapped weights into a model, writing a folder atomically, the tokenizer files, and what
inference engines need to stop where the model was trained to stop (generation_config.json's eos_token_id list of
end-of-text and end-of-turn ids, the run's chat template in tokenizer_config.json)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from trainbox.data.chat import ChatTemplate, token_of
from trainbox.data.tokenizer import EOT_TEXT, asset_path
from trainbox.errors import CheckpointError, ConfigError
from trainbox.files import default_modes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def is_hf_folder(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and not (p / "COMPLETE").is_file()


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


def write_tokenizer(tokenizer, spec: str, folder: Path, block: int) -> None:
    """gpt2: vocab.json + merges.txt (the original files) and an equivalent tokenizer.json; else its tokenizer.json."""

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
        shutil.copyfile(tokenizer_file(spec), folder / "tokenizer.json")
        eot = (tokenizer.tok.id_to_token(tokenizer.eot_id) if hasattr(tokenizer, "tok")   # tokenizers' or transformers'
               else tokenizer.hf.convert_ids_to_tokens(tokenizer.eot_id))
        klass = "PreTrainedTokenizerFast"
    write_json(folder / "tokenizer_config.json", {"tokenizer_class": klass, "bos_token": eot, "eos_token": eot,
                                                   "unk_token": eot, "model_max_length": block,
                                                   "add_prefix_space": False})
    write_json(folder / "special_tokens_map.json", {"bos_token": eot, "eos_token": eot, "unk_token": eot})


# --dtype of `trainbox export --format hf`: the weights' dtype in model.safetensors and config.json
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cast(state: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """Floating-point tensors in `dtype` (fp32, bf16, fp16; None: as they are), contiguous on the CPU."""
    to = DTYPES[dtype] if dtype else None
    return {k: (v.to(to) if to is not None and v.is_floating_point() else v).cpu().contiguous()
            for k, v in state.items()}


def dtype_name(dtype: str | None, default: str = "float32") -> str:
    """config.json's name of a --dtype (float32, bfloat16, float16)."""
    return str(DTYPES[dtype]).replace("torch.", "") if dtype else default


def stop_ids(tokenizer, template: ChatTemplate, also: list[int] | int | None = None) -> list[int]:
    """The ids a generation must stop at: `also` (a source folder's eos_token_id), end-of-text, and the template's
    end-of-turn token where the tokenizer has one token for it; each once, in that order."""
    found = [also] if isinstance(also, int) else list(also or [])
    found += [tokenizer.eot_id, token_of(tokenizer, template.end_mark)]
    return list(dict.fromkeys(int(i) for i in found if i is not None))


def write_generation(folder: Path, tokenizer, template: ChatTemplate, source: dict | None = None) -> list[int]:
    """generation_config.json: `source` (a base model's generation_config.json) with eos_token_id the list of
    stop_ids, so transformers, vLLM and TGI stop at the end of a turn; returns that list."""
    config = dict(source or {"bos_token_id": tokenizer.eot_id})
    eos = stop_ids(tokenizer, template, config.get("eos_token_id"))
    config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    write_json(folder / "generation_config.json", config)
    return eos


def write_chat_template(folder: Path, template: ChatTemplate) -> None:
    """The run's chat template into tokenizer_config.json (and chat_template.jinja where the folder has one, which
    transformers prefers), so apply_chat_template and the engines render what the model was trained on."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config["chat_template"] = template.source
    write_json(path, config)
    if (folder / "chat_template.jinja").is_file():
        (folder / "chat_template.jinja").write_text(template.source)


def tokenizer_file(spec: str) -> Path:
    if spec.startswith("embedded:"):
        return asset_path(f"{spec.split(':', 1)[1]}.json")
    p = Path(spec)
    return p / "tokenizer.json" if p.is_dir() else p


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def no_merge(path: str, merge: bool) -> None:
    if merge:
        raise ConfigError(f"--merge applies to LoRA runs (model.family=hf); {path} is not one")
