"""GGUF files (llama.cpp, Ollama, LM Studio) written by the GGML project's own Python package, `gguf` (the `gguf`
extra), the way llama.cpp's convert_hf_to_gguf.py writes them.

    trainbox export runs/sft --format gguf --gguf-type q8_0 --out sft-q8_0.gguf
    llama-cli -m sft-q8_0.gguf -cnv          # llama.cpp's chat, in the run's template, stopping at end of turn

A family that writes GGUF lists the types in its Family (`gguf`) and has `gguf_model(folder)` in its hf.py. The
export writes the family's Hugging Face folder first (its own export, in a temporary folder), then converts that
folder as the converter does: `gguf_model` gives the architecture, its hyperparameters and the tensors in
llama.cpp's layout under Hugging Face names; here the names become llama.cpp's through gguf's own tensor mapping,
each tensor gets the converter's type (1-D tensors, norms, biases and position embeddings F32; the rest f16, bf16,
q8_0 or, computed by the gguf package, llama.cpp's 5- and 4-bit blocks, the head then in q8_0 as llama-quantize keeps
it higher; a quantised row that is not a multiple of 32 values in f16 with a warning), and the tokenizer goes in as a
byte-level BPE (tokenizer.ggml.model gpt2: every token with its type, the merges, the pre-tokenizer by llama.cpp's
name: gpt-2, llama-bpe, qwen2, tekken) or, for Llama 2's and Mistral's BPE with byte fallback, as SentencePiece
(llama: every token with its type and a score from the merges' order, the space prefix), with the end-of-text and
end-of-turn ids and the chat template, read by gguf's SpecialVocab from the folder.
BOS and EOS are never added by llama.cpp's tokenizer: trainbox trains on the template's text alone.
"""
from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from trainbox.data.tokenizer import BYTE_TOKEN, merge_parts
from trainbox.errors import ConfigError, require
from trainbox.model.spec import GGUF_TYPES, either, which

log = logging.getLogger("trainbox")

TYPES = GGUF_TYPES   # what --gguf-type may name; a family lists those it writes (Family.gguf)
LOW_BITS = ("q5_1", "q5_0", "q4_1", "q4_0")   # their output matrix is q8_0, as llama-quantize keeps it higher

# the pre-tokenizer regexes of tokenizer.json -> llama.cpp's name for them (tokenizer.ggml.pre)
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_NUMBERS, QWEN2_NUMBERS = r"\p{N}{1,3}", r"\p{N}"   # the one difference of their regexes
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|NUMBERS| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# Mistral's tekken (Mistral Nemo, Ministral, Mistral Small 3): words by case, each digit alone
TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {SPLIT_REGEX.replace("NUMBERS", LLAMA3_NUMBERS): "llama-bpe",
                  SPLIT_REGEX.replace("NUMBERS", QWEN2_NUMBERS): "qwen2", GPT2_REGEX: "gpt-2", TEKKEN_REGEX: "tekken"}


@dataclass
class GGUFModel:
    """What a family's `gguf_model(folder)` gives: the llama.cpp architecture, its hyperparameters (GGUF keys
    without the `ARCH.` prefix: ints are written as uint32, floats as float32), the tensors under Hugging Face
    names in llama.cpp's layout, and tensors llama.cpp needs beyond them, under their GGUF names."""

    arch: str
    params: dict
    tensors: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def check_type(gguf_type: str, family_name: str, writes: tuple[str, ...]) -> None:
    """Refuse, before any work, a family that writes no GGUF or a type it does not write."""
    if not writes:
        raise ConfigError(f"model.family={family_name} has no GGUF mapping in trainbox (model.family="
                          f"{either(which(lambda f: bool(f.gguf)))} has)",
                          hint="export it with --format hf (a LoRA run with --merge); where llama.cpp has the "
                               "architecture, its convert_hf_to_gguf.py converts that folder")
    if gguf_type not in writes:
        raise ConfigError(f"--gguf-type {gguf_type} is not one model.family={family_name} writes: "
                          f"{', '.join(writes)}", hint=f"use --gguf-type {writes[0]}")


def export(hf, path: str, out: str, gguf_type: str, force: bool, name: str, merge: bool = False) -> list[str]:
    """`trainbox export --format gguf`: the family's Hugging Face folder (its mapping `hf`; with `merge`, the adapters
    folded into the base, `force` merging into a quantised base's weights), converted into the GGUF file `out` of
    `gguf_type`."""
    require("gguf", "gguf", "export --format gguf")
    out_path = Path(out)
    if out_path.is_dir():   # a folder: the file goes in it
        out_path = out_path / f"{name}-{gguf_type}.gguf"
    if out_path.exists() and not force:
        raise ConfigError(f"--out {out_path} exists", hint="choose another file or pass --force")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=f".{out_path.name}.") as tmp:
        folder = Path(tmp) / "hf"
        if merge:
            hf.export(path, str(folder), merge=True, force=force)
        else:
            hf.export(path, str(folder), force=True)
        staged = Path(tmp) / out_path.name
        summary = write(folder, staged, gguf_type, hf.gguf_model(folder), name)
        staged.replace(out_path)
    return [f"wrote {out_path} (GGUF {gguf_type}, general.architecture {summary['arch']}: {summary['tensors']} "
            f"tensors, {summary['tokens']:,} tokens, stops at {summary['stops']})"]


def write(folder: Path, out: Path, gguf_type: str, model: GGUFModel, name: str) -> dict:
    """The GGUF file `out` from `model` and the tokenizer files of the Hugging Face `folder`."""
    import gguf  # optional: gguf

    writer = gguf.GGUFWriter(str(out), model.arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{gguf_type.upper()}")
    for key, value in model.params.items():
        full = f"{model.arch}.{key}"
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(full, value)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, stops = _tokenizer(writer, folder, model.params.get("vocab_size"), gguf)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[model.arch.upper()], model.params["block_count"])
    renamed = [(hf_name if hf_name in model.extra else names.get_name(hf_name, try_suffixes=(".weight", ".bias")),
                hf_name, tensor) for hf_name, tensor in [*model.extra.items(), *model.tensors.items()]]
    tied = all(new != "output.weight" for new, _, _ in renamed)   # llama.cpp's head is then token_embd
    for new, hf_name, tensor in renamed:
        if new is None:
            raise ConfigError(f"{folder}: tensor {hf_name} has no llama.cpp name for architecture {model.arch}")
        data, qtype = _typed(new, tensor.float().numpy(), gguf_type, gguf, tied)
        writer.add_tensor(new, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"arch": model.arch, "tensors": len(renamed), "tokens": tokens, "stops": stops}


def _typed(name: str, data, gguf_type: str, gguf, tied: bool):
    """The converter's rule: 1-D tensors, norms, biases and position embeddings in F32, the rest in `gguf_type`;
    for the 4- and 5-bit types (LOW_BITS), llama-quantize's: the output matrix (the token embedding where the head is
    tied to it) one step higher, q8_0 (llama-quantize's q6_K, which the gguf package does not compute)."""
    types = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or name == "position_embd.weight":
        qtype = types.F32
    elif gguf_type in LOW_BITS and (name == "output.weight" or (tied and name == "token_embd.weight")):
        qtype = types.Q8_0
    else:
        qtype = getattr(types, gguf_type.upper())
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError as e:
        log.warning(f"{name}: {e}; written in f16")
        return gguf.quants.quantize(data, types.F16), types.F16


def _tokenizer(writer, folder: Path, rows: int | None, gguf) -> tuple[int, str]:
    """tokenizer.ggml.*: FOLDER/tokenizer.json as a byte-level BPE (tokenizer.ggml.model gpt2, with SpecialVocab's
    merges) or, for a BPE with byte fallback (Llama 2's and Mistral's, converted from SentencePiece), as llama.cpp's
    SentencePiece tokenizer (`llama`, `_sentencepiece`); ids past the tokenizer's up to the model's rows as unused
    [PADi] tokens; SpecialVocab's ids and chat template; end-of-turn as eot_token_id. Returns the token count and
    the stop tokens' names."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"{folder}: the tokenizer is a {model.get('type')} model; GGUF export writes BPE "
                          "tokenizers: byte-level (GPT-2, Llama 3, Qwen2, trainbox's own) or with byte fallback "
                          "(Llama 2, Mistral)")
    pieces = model.get("byte_fallback", False)
    vocab = tok.get_vocab(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()
    rows = max(rows or 0, max(vocab.values()) + 1)
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(rows):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        if pieces and by_id[i] == model.get("unk_token"):
            types.append(gguf.TokenType.UNKNOWN)
        elif i in added:
            special = added[i].special or (by_id[i].startswith("<|") and by_id[i].endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        elif pieces and BYTE_TOKEN.fullmatch(by_id[i]):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    if pieces:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(_sentencepiece(spec, tokens, folder))
        writer.add_add_space_prefix(_space_prefix(folder))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer(spec.get("pre_tokenizer"), folder))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    quiet = logging.getLogger("gguf.vocab")   # it reads add_bos / add_eos from the post-processor: set just below
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        special = gguf.SpecialVocab(folder, load_merges=not pieces)
    finally:
        quiet.setLevel(level)
    special.add_special_token.update(bos=False, eos=False)   # the template's text is all the model was trained on
    special.add_to_gguf(writer, quiet=True)
    generation = json.loads((folder / "generation_config.json").read_text())
    eos = generation.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    turn = [i for i in eos if i != special.special_token_ids.get("eos")]
    if turn:
        writer.add_eot_token_id(turn[0])
    return rows, ", ".join(tokens[i] for i in eos)


def _sentencepiece(spec: dict, tokens: list[str], folder: Path) -> list[float]:
    """Each token's score for llama.cpp's SentencePiece tokenizer, which joins the adjacent pair whose joined piece
    scores highest: minus the rank of the first merge of tokenizer.json that makes it (the merge the Hugging Face
    tokenizer applies first), 0 for a piece no merge makes (characters, bytes, special tokens). transformers'
    converter lists a piece's merges in the order of the SentencePiece scores, so the two tokenizers agree."""
    rank: dict[str, int] = {}
    for r, merge in enumerate(spec["model"].get("merges") or []):
        rank.setdefault("".join(merge_parts(merge)), r)
    if not rank:
        raise ConfigError(f"{folder}/tokenizer.json: a BPE with byte fallback and no merges")
    return [-float(rank[t]) if t in rank else 0.0 for t in tokens]


def _space_prefix(folder: Path) -> bool:
    """llama.cpp's add_space_prefix: whether the folder's tokenizer puts its word marker ("\u2581") before text that
    follows a special token, as llama.cpp then does after every special token and at the start of every text.
    Asked of the tokenizer inference engines load, transformers' AutoTokenizer (which rewrites a Llama tokenizer's
    spacing by its `legacy` setting); of `tokenizers` where transformers is not installed. A chat template's text
    opens with a special token and has one before every turn, so the chat tokenizes as in training; a tokenizer
    that marks only a text's first word (transformers' `legacy: false`) differs from llama.cpp on that one word, of
    a text that does not open with a special token."""
    try:
        from transformers import AutoTokenizer  # optional: transformers
    except ImportError:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        special = next((a.content for a in tok.get_added_tokens_decoder().values() if a.special), "")
        pieces = tok.encode(special + "a", add_special_tokens=False).tokens[1 if special else 0:]
    else:
        hf = AutoTokenizer.from_pretrained(folder)
        special = hf.bos_token or hf.eos_token or next(iter(hf.all_special_tokens), "")
        pieces = hf.convert_ids_to_tokens(hf.encode(special + "a", add_special_tokens=False))[1 if special else 0:]
    return "".join(pieces).startswith("\u2581")


def pre_tokenizer(pre: dict | None, folder: Path) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for a tokenizer.json pre_tokenizer: GPT-2's byte-level regex, or the
    Split regexes of Llama 3, Qwen2 and Mistral's tekken before a regex-free ByteLevel."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    regex = None
    for step in steps:
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            regex = GPT2_REGEX
        elif step.get("type") == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
    name = PRE_TOKENIZERS.get(regex)
    if name is None:
        raise ConfigError(f"{folder}: the tokenizer's pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp name "
                          f"(known: GPT-2's byte-level regex, the Split regexes of Llama 3, Qwen2 and tekken)",
                          hint="export with --format hf and convert with llama.cpp's convert_hf_to_gguf.py")
    return name
