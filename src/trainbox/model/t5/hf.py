"""The t5 family <-> Hugging Face T5ForConditionalGeneration folders: our parameter names are its own, so
`to_hf` writes config.json (a T5Config) and model.safetensors (tied aliases stored once) and transformers loads
the same model. `export` adds the run's tokenizer with T5's ids where the model has them (`write_t5_tokenizer`:
the sentinels, the decoder start as the pad token, end-of-text appended) and generation_config.json, so that
AutoTokenizer encodes a prompt to the ids `trainbox generate` feeds the encoder and `generate` decodes as ours does.

    trainbox export runs/t5-small --format hf --out hf/t5      # T5ForConditionalGeneration.from_pretrained
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, processors

from trainbox.data.spans import sentinel_id
from trainbox.errors import ConfigError
from trainbox.model.hf_folder import cast, dtype_name, no_merge, staged, write_json, write_tokenizer
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


def to_hf(model: T5, out: str | Path, eos_token_id: int, dtype: str | None = None,
          text_vocab: int | None = None) -> Path:
    """Write a folder that `T5ForConditionalGeneration.from_pretrained` loads with the same outputs and whose
    `generate` decodes as ours (config.json, generation_config.json, model.safetensors, names 1:1; `text_vocab`: the
    tokenizer's ids, above which generate draws only the sentinels). Written into a temporary folder, then
    renamed."""
    out = Path(out)
    with staged(out) as tmp:
        write_model(model, tmp, eos_token_id, dtype, text_vocab)
    return out


def generation_config(model: T5, eos_token_id: int, text_vocab: int | None) -> dict:
    """generation_config.json: the decoder start and end-of-text, and the ids generate.decode_seq2seq never draws
    (the padding ids between `text_vocab` and the sentinels, the decoder start) suppressed. transformers 5 sizes
    generate's decoder cache by the encoder's depth (T5Config's num_hidden_layers), which fails on a decoder
    deeper than the encoder: such a folder generates without the cache."""
    config = {"decoder_start_token_id": model.decoder_start_token_id, "pad_token_id": model.decoder_start_token_id,
              "eos_token_id": eos_token_id}
    if text_vocab is not None:
        config["suppress_tokens"] = list(range(text_vocab, model.vocab_size - model.sentinel_tokens))
    if t5_decoder_layers(model.cfg) > model.cfg.n_layer:
        config["use_cache"] = False
    return config


def write_model(model: T5, folder: Path, eos_token_id: int, dtype: str | None = None,
                text_vocab: int | None = None) -> None:
    """config.json, generation_config.json and model.safetensors of `model` into `folder`."""
    hf_config(model, eos_token_id).save_pretrained(folder)
    write_json(folder / "generation_config.json", generation_config(model, eos_token_id, text_vocab))
    state, seen = {}, set()
    for name, t in model.state_dict().items():  # tied aliases (embed_tokens, tied head) stored once
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        state[name] = t.detach().to("cpu", torch.float32).contiguous()
    state = cast(state, dtype)
    if dtype:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "dtype": dtype_name(dtype)}, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def t5_token_names(model: T5, text_vocab: int, vocab: dict[str, int]) -> tuple[dict[int, str], list[str]]:
    """The names of the ids the model has above the tokenizer's `text_vocab` ids (`vocab`: name -> id), and what a
    user must know where a name cannot be T5's own: <extra_id_K> at sentinel_id(K) (data/spans.py), <pad> at the
    decoder start, <unused_N> at each padding id between (never drawn: generation_config.json suppresses them). A
    name the tokenizer already holds as another id is encoded to that id by any tokenizer of the folder, so that slot
    takes a name of its own and the note says so."""
    V, S, start = model.vocab_size, model.sentinel_tokens, model.decoder_start_token_id
    names, notes, taken = {}, [], []
    for i in range(text_vocab, start):
        names[i] = next(n for n in (f"<unused_{i}>", f"<trainbox_unused_{i}>") if n not in vocab)
    names[start] = next(n for n in ("<pad>", "<decoder_start>", "<trainbox_pad>") if n not in vocab)
    for k in range(S):
        name = f"<extra_id_{k}>"
        if name in vocab:
            taken.append(k)
            name = f"<trainbox_extra_id_{k}>"
        names[sentinel_id(k, V)] = name
    if taken:
        first, last = taken[0], taken[-1]
        notes.append(f"note: the tokenizer has its own <extra_id_{first}>..<extra_id_{last}> tokens (ids "
                     f"{vocab[f'<extra_id_{first}>']}..), which are not the model's sentinels: in this folder the "
                     f"sentinels are <trainbox_extra_id_K> (<extra_id_0> is id {sentinel_id(0, V)}, counting down); "
                     "write prompts with those names for transformers, or use `trainbox generate`, which reads "
                     "<extra_id_K> as the sentinel")
    return names, notes


def write_t5_tokenizer(model: T5, tokenizer, spec: str, folder: Path) -> list[str]:
    """The run's tokenizer (tokenizer.json + tokenizer_config.json, as hf_folder.write_tokenizer writes it for gpt
    and llama) with the ids T5 adds above it named as t5_token_names says, end-of-text appended to every text (the
    encoder input trainbox trains and generates on ends with it), and pad_token the decoder start. Returns the notes
    a user must read (t5_token_names), each one line."""
    write_tokenizer(tokenizer, spec, folder, model.block_size)
    for file in ("vocab.json", "merges.txt"):   # gpt2's own files: a slow tokenizer from them would lack T5's ids
        (folder / file).unlink(missing_ok=True)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text_vocab, vocab = tokenizer.vocab_size, tok.get_vocab(with_added_tokens=True)
    if tok.get_vocab_size(with_added_tokens=True) != text_vocab or max(vocab.values()) != text_vocab - 1:
        raise ConfigError(f"tokenizer {spec} does not number its tokens 0..{text_vocab - 1}, so T5's ids cannot be "
                          "added above them", hint="train with a tokenizer whose ids are contiguous")
    names, notes = t5_token_names(model, text_vocab, vocab)
    tok.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i in sorted(names)])
    wrong = [f"{names[i]} got id {tok.token_to_id(names[i])}, the model's is {i}" for i in sorted(names)
             if tok.token_to_id(names[i]) != i]
    if wrong:
        raise ConfigError(f"tokenizer {spec}: T5's ids cannot be added at the model's ids: {'; '.join(wrong[:3])}",
                          hint="train with a tokenizer whose ids are contiguous")
    eot = tok.id_to_token(tokenizer.eot_id)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eot}", pair=f"$A {eot} $B {eot}",
                                                       special_tokens=[(eot, tokenizer.eot_id)])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("bos_token", None)   # T5 starts the decoder from the pad token and the encoder from the text
    sentinels = [names[sentinel_id(k, model.vocab_size)] for k in range(model.sentinel_tokens)]
    start = names[model.decoder_start_token_id]
    write_json(folder / "tokenizer_config.json", {**config, "tokenizer_class": "PreTrainedTokenizerFast",
                                                  "pad_token": start, "additional_special_tokens": sentinels})
    write_json(folder / "special_tokens_map.json", {"eos_token": eot, "unk_token": config["unk_token"],
                                                    "pad_token": start, "additional_special_tokens": sentinels})
    return notes


def export(path: str, out: str, merge: bool = False, force: bool = False, dtype: str | None = None) -> list[str]:
    """`trainbox export` of a t5 run: a T5ForConditionalGeneration folder with the run's tokenizer."""
    no_merge(path, merge)
    model, tok, cfg = load_for_inference(path)
    target = Path(out)
    if target.exists() and any(target.iterdir()) and not force:
        raise ConfigError(f"{target} exists and is not empty", hint="choose another --out or pass --force")
    with staged(target) as tmp:
        write_model(model, tmp, tok.eot_id, dtype, tok.vocab_size)
        notes = write_t5_tokenizer(model, tok, cfg.data.tokenizer, tmp)
    return [f"wrote {target} (Hugging Face T5ForConditionalGeneration: config.json, model.safetensors, "
            "generation_config.json, the run's tokenizer with the sentinels <extra_id_N> and <pad> at the model's "
            "ids)", *notes]
