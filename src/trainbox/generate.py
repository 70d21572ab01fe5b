"""Sampling with a KV cache: temperature, top-k, top-p, max tokens, stop at end-of-text; `stream` yields the ids
one at a time over caches the caller keeps (`trainbox chat` keeps them across turns).

    trainbox generate runs/tiny --prompt "ROMEO:" --max-tokens 100 --temperature 0.8 --top-k 50 --seed 1

Needs only the model, a checkpoint and the tokenizer (never the training loop). The same seed on the
same device gives the same text: sampling draws from one seeded torch.Generator.
"""
from __future__ import annotations

from typing import Iterator

import torch

from trainbox.data.spans import encode_with_sentinels, split_spans
from trainbox.data.tokenizer import Tokenizer


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """(B, V) logits -> logits with everything outside top-k / the top-p nucleus set to -inf."""
    logits = logits / max(temperature, 1e-5)
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_token(logits: torch.Tensor, vocab: int, temperature: float, top_k: int | None, top_p: float | None,
               gen: torch.Generator) -> torch.Tensor:
    """(1, V) logits of the last position -> (1, 1) next id: greedy at temperature 0, else drawn from `gen`.
    Ids from `vocab` up (padded rows of the embedding) are never drawn."""
    logits = logits.float()
    logits[:, vocab:] = float("-inf")
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(filter_logits(logits, temperature, top_k, top_p).softmax(-1), 1, generator=gen)


@torch.no_grad()
def stream(model, ids: list[int], caches, pos: int, max_tokens: int, vocab: int, gen: torch.Generator,
           temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           stop: frozenset[int] = frozenset()) -> Iterator[int]:
    """Feed `ids` at positions pos.. through the model's KV `caches`, then yield one drawn id at a time (each
    fed back before the next is drawn) until `max_tokens` or an id in `stop`, which is yielded but not fed.
    The caller keeps the caches: after n ids yielded without a stop, positions up to pos + len(ids) + n - 1
    are filled."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    for _ in range(max(0, max_tokens)):
        nxt = next_token(model(x, caches=caches, pos=pos).logits[:, -1, :], vocab, temperature, top_k, top_p, gen)
        pos += x.size(1)
        token = int(nxt.item())
        yield token
        if token in stop:
            return
        x = nxt


@torch.no_grad()
def sample(model, tokenizer: Tokenizer, prompt: str, max_tokens: int = 100, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0,
           device: torch.device | str = "cpu", stop_at_eot: bool = True) -> str:
    """Generate a continuation of `prompt` (returned without the prompt)."""
    device = torch.device(device)
    model.eval()
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    limit = getattr(model, "block_size", len(ids) + max_tokens)
    ids = ids[-limit:]
    max_tokens = min(max_tokens, limit - len(ids))
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = next(model.parameters()).dtype
    caches = model.make_caches(1, len(ids) + max_tokens, dtype, device)
    stop = frozenset({tokenizer.eot_id}) if stop_at_eot else frozenset()
    out = list(stream(model, ids, caches, 0, max_tokens, tokenizer.vocab_size, gen, temperature, top_k, top_p, stop))
    return tokenizer.decode(out[:-1] if out and out[-1] in stop else out)


# ----------------------------------------------------------------------------- encoder-decoder (t5)


@torch.no_grad()
def decode_seq2seq(model, ids: list[int], max_tokens: int, eot_id: int, text_vocab: int, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                   device: torch.device | str = "cpu") -> list[int]:
    """Encoder-decoder decoding: the encoder runs once on `ids`; the decoder feeds one token per step
    through its key/value caches and draws the next token like `sample` (greedy at temperature 0).
    Ids in [text_vocab, start of the sentinels) are never drawn."""
    device = torch.device(device)
    model.eval()
    V, S = model.vocab_size, model.sentinel_tokens
    memory = model.encode(torch.tensor([ids], device=device))
    caches = model.make_decoder_caches(1, max(1, max_tokens), memory.size(1), memory.dtype, device)
    nxt = torch.tensor([[model.decoder_start_token_id]], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for pos in range(max(0, max_tokens)):
        logits = model.decode(nxt, memory, caches, pos)[:, -1, :].float()
        logits[:, text_vocab:V - S] = float("-inf")  # padding rows and the decoder start token
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(filter_logits(logits, temperature, top_k, top_p).softmax(-1), 1, generator=gen)
        token = int(nxt.item())
        if token == eot_id:
            break
        out.append(token)
    return out


def fill_spans(model, tokenizer: Tokenizer, prompt: str, max_tokens: int = 100, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               device: torch.device | str = "cpu") -> list[tuple[int, str]]:
    """T5: `prompt` holds <extra_id_K> markers; returns [(K, text the model generates for it), ...]."""

    V, S = model.vocab_size, model.sentinel_tokens
    ids = encode_with_sentinels(tokenizer, prompt, V, S) + [tokenizer.eot_id]
    out = decode_seq2seq(model, ids, max_tokens, tokenizer.eot_id, tokenizer.vocab_size, temperature, top_k, top_p,
                         seed, device)
    return [(k, tokenizer.decode(span)) for k, span in split_spans(out, V, S)]
