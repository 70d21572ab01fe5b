"""Sampling with a KV cache: temperature, top-k, top-p, max tokens, stop at end-of-text; `stream` yields the ids
one at a time over caches the caller keeps (`trainbox chat` keeps them across turns).

    trainbox generate runs/tiny --prompt "ROMEO:" --max-tokens 100 --temperature 0.8 --top-k 50 --seed 1

Needs only the model, a checkpoint and the tokenizer (never the training loop). The same seed on the
same device gives the same text: sampling draws from one seeded torch.Generator. Text longer than the model's
context goes on as nanoGPT's `generate` does: each token is drawn from the last tokens that fit.

`rollout` samples completions of many prompts at once, for online RL objectives (GRPO draws G completions of each
prompt): the prompts are left-padded into one batch that goes through the KV caches together. Its sampling is
counter-based: the noise of a draw is a hash of (the row's seed, the token's index in the completion, the id), never
a shared generator, so a row's completion is the same in any batch, in any order, on any number of processes.
"""
from __future__ import annotations

import logging
from typing import Iterator

import torch

from trainbox.data.spans import encode_with_sentinels, split_spans
from trainbox.data.tokenizer import Tokenizer
from trainbox.errors import BadInput

log = logging.getLogger("trainbox")  # the library logger


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, max_tokens: int) -> None:
    """Refuse sampling options that mean nothing (BadInput, naming the option as the CLI spells it)."""
    bad = [(f"--temperature {temperature}", "0 (greedy) or more") if not temperature >= 0 else None,
           (f"--top-k {top_k}", "0 (off) or more") if top_k is not None and top_k < 0 else None,
           (f"--top-p {top_p}", "above 0 and at most 1 (1: off)") if top_p is not None and not 0 < top_p <= 1
           else None,
           (f"--max-tokens {max_tokens}", "0 or more") if max_tokens < 0 else None]
    bad = [b for b in bad if b]
    if bad:
        raise BadInput("; ".join(f"{opt}: must be {want}" for opt, want in bad))


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


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons' hash prospector): a bijective mix of 32-bit values held in int64, elementwise."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 32-bit x, in 16-bit halves, so no int64 product overflows (each stays below 2**49)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def gumbel_noise(seeds: torch.Tensor, t: int | torch.Tensor, V: int, device: torch.device | str) -> torch.Tensor:
    """(B, V) float32 Gumbel noise, a function of (seeds[r], t, id) alone: the noise of row r's draw at completion
    index t. The int64 seed's two 32-bit halves and t are mixed into two 32-bit row keys; id v's uniform comes from
    mix(mix(mix(v + c) ^ key1) ^ key2) (`_mix32`, in 32-bit integer ops), its top 23 bits as u = (2m + 1) / 2**24,
    strictly inside (0, 1) and exact in float32; the noise is -log(-log(u))."""
    seeds = seeds.to(device=device, dtype=torch.int64)
    key = _mix32(((seeds >> 32) & _M32) ^ 0x9E3779B9)
    key = _mix32(key ^ (seeds & _M32))
    key1 = _mix32(key ^ (t & _M32))
    key2 = _mix32(key1 ^ 0x85EBCA6B)
    ids = _mix32((torch.arange(V, device=device, dtype=torch.int64) + 0x27D4EB2F) & _M32)
    h = _mix32(_mix32(ids[None, :] ^ key1[:, None]) ^ key2[:, None])        # (B, V)
    u = ((h >> 9) * 2 + 1).float() / 2 ** 24
    return -torch.log(-torch.log(u))


_FUSED_NOISE = None


def fused_noise(seeds: torch.Tensor, t: torch.Tensor, V: int, device: torch.device) -> torch.Tensor:
    """gumbel_noise compiled (a CUDA GPU, the completion index a device tensor): Inductor makes the (B, V) hash one
    kernel, where eager runs some forty int64 kernels over B x V elements (2.2 ms a token for 64 rows of a
    151,936-id vocabulary on an H200, more than a 0.5B model's forward). The same integers; the logarithms are
    Triton's."""
    global _FUSED_NOISE
    if _FUSED_NOISE is None:
        _FUSED_NOISE = torch.compile(gumbel_noise, dynamic=False, fullgraph=True)
    return _FUSED_NOISE(seeds, t, V, device)


def draw(logits: torch.Tensor, seeds: torch.Tensor, t: int | torch.Tensor, vocab: int, temperature: float,
         top_k: int | None, top_p: float | None) -> torch.Tensor:
    """(B, V) logits -> (B,) ids: argmax at temperature 0, else the Gumbel-max draw from the filtered logits with
    `gumbel_noise(seeds, t)` (an exact sample of softmax(filtered logits); on a CUDA GPU with t a device tensor, its
    `fused_noise`). Ids from `vocab` up are never drawn."""
    logits = logits.float()
    if vocab < logits.size(-1):
        logits = logits.masked_fill(torch.arange(logits.size(-1), device=logits.device) >= vocab, float("-inf"))
    if temperature == 0:
        return logits.argmax(-1)
    filtered = filter_logits(logits, temperature, top_k, top_p)
    fused = logits.is_cuda and isinstance(t, torch.Tensor)
    return (filtered + (fused_noise if fused else gumbel_noise)(seeds, t, logits.size(-1), logits.device)).argmax(-1)


@torch.no_grad()
def rollout(model, prompts: list[list[int]], seeds: list[int], max_tokens: int, vocab: int, stop: frozenset[int],
            temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
            pad: int = 0, graphs: bool = True, copy_weights: bool = False,
            compiled: bool = False) -> list[list[int]]:
    """Completions of B prompts drawn together: each row's ids up to and including its first id in `stop`, or
    `max_tokens` ids where none was drawn. Row r draws with seeds[r] (`draw`), so its completion does not depend on
    the other rows. The prompts are left-padded with `pad` to the longest (P tokens); one prefill, then one forward
    per token over all rows, through KV caches of P + max_tokens positions (in the autocast dtype where one is on);
    padded positions are never attended to and each row's positions count from its own first token, so its logits
    are those of its prompt alone. A row that has stopped is fed `pad` until every row has (read every 8 tokens).
    Needs a family whose forward takes `attend` and `position_ids` with caches (llama, hf); the model runs in eval
    mode and gets its mode back.

    A model whose forward takes its cache position as a device tensor (`static_decode`: llama) decodes with shapes
    that do not change from token to token, over the whole cache; on a CUDA GPU (and `graphs`) that token step (the
    forward, the draw and the bookkeeping) is captured once in a CUDA graph and replayed for every token, which
    takes the host's kernel launches out of the loop. A model may hand over another module over its own weights to
    decode (`rollout_model`: the llama family's decoder over its modules, which runs none of FSDP's hooks; for the
    hf family's Llama and Qwen models, the same decoder over transformers' and PEFT's modules, model/hf/view.py);
    the model itself is put in eval mode. With `copy_weights`, it decodes through the model's `sampling_model`:
    the linear layers' weights copied in the compute dtype as they stand, LoRA's adapters merged and a quantized
    base dequantized, which the token steps read without a cast or an adapter's matmuls; the copy is freed on
    return. With `compiled` (a static-decode model), the one-token forward runs through torch.compile (the prefill
    does not), over caches whose length is rounded up to a multiple of CACHE_ROUND: a later rollout with prompts of
    another length, or through another copy of the weights, reuses the compiled code."""
    check_sampling(temperature, top_k, top_p, max_tokens)
    B = len(prompts)
    if len(seeds) != B:
        raise BadInput(f"rollout: {B} prompts but {len(seeds)} seeds (one seed a row)")
    if any(not p for p in prompts):
        raise BadInput(f"rollout: prompt {[not p for p in prompts].index(True)} is empty (each row needs a token)")
    if B == 0 or max_tokens == 0:
        return [[] for _ in prompts]
    P = max(len(p) for p in prompts)
    runner = model.rollout_model() if hasattr(model, "rollout_model") else model   # the module that decodes
    limit = getattr(runner, "block_size", None)
    if limit and P + max_tokens > limit:
        raise BadInput(f"rollout: the longest prompt ({P} tokens) and max_tokens={max_tokens} exceed the model's "
                       f"{limit}-token context")
    param = next(runner.parameters())
    device = param.device
    # the caches hold what the forward computes: the autocast dtype where one is on (fp32 weights trained in bf16)
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else param.dtype
    if copy_weights and hasattr(model, "sampling_model"):
        runner = model.sampling_model(dtype)
    left = torch.tensor([P - len(p) for p in prompts], device=device)                # (B,) pads before each row
    x = torch.tensor([[pad] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    attend = torch.arange(P + max_tokens, device=device)[None, :] >= left[:, None]   # (B, P + max_tokens)
    seed_ids = torch.tensor(seeds, dtype=torch.int64, device=device)
    stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    static = bool(getattr(runner, "static_decode", False))
    compiled = compiled and static
    decode = compiled_step(runner) if compiled else runner   # the one-token forward
    slots = -(-(P + max_tokens) // CACHE_ROUND) * CACHE_ROUND if compiled else P + max_tokens   # the caches' length
    if slots > P + max_tokens:   # positions past the last token: never written, never attended to
        attend = torch.cat([attend, attend.new_zeros(B, slots - P - max_tokens)], 1)
    # the state of a token step, changed in place by it: the ids fed, the cache slot, each row's position, the
    # completion's index, what is drawn, each row's length, which rows have stopped
    st = {"x": x, "pos": torch.zeros((), dtype=torch.long, device=device), "positions": -left[:, None],
          "t": torch.zeros((), dtype=torch.long, device=device),
          "out": torch.full((B, max_tokens), pad, dtype=torch.long, device=device),
          "length": torch.full((B,), max_tokens, dtype=torch.long, device=device),
          "done": torch.zeros(B, dtype=torch.bool, device=device)}
    host = {"pos": 0}   # the cache slot of a model that takes it as an int

    def step() -> None:
        T = st["x"].size(1)
        positions = (st["positions"] + torch.arange(T, device=device)).clamp(min=0)
        pos = st["pos"] if static and T == 1 else host["pos"]
        forward = decode if static and T == 1 else runner
        with torch.autocast(device.type, dtype=dtype, enabled=autocast, cache_enabled=False):
            logits = forward(st["x"], caches=caches, pos=pos, position_ids=positions, attend=attend).logits[:, -1, :]
        done = st["done"]
        nxt = draw(logits, seed_ids, st["t"], vocab, temperature, top_k, top_p).masked_fill(done, pad)
        st["out"].index_copy_(1, st["t"].view(1), nxt[:, None])
        stopped = ~done & (nxt[:, None] == stop_ids).any(1)
        st["length"].copy_(torch.where(stopped, st["t"] + 1, st["length"]))
        done.logical_or_(stopped)
        st["pos"].add_(T)
        st["positions"].add_(T)
        st["t"].add_(1)
        host["pos"] += T
        if T == 1:
            st["x"].copy_(nxt[:, None])
        else:
            st["x"] = nxt[:, None].clone()

    was_training = model.training
    model.eval()
    try:
        caches = runner.make_caches(B, slots, dtype, device)
        step()   # the prefill and the first token
        replay = step
        if static and graphs and device.type == "cuda" and max_tokens > 2 and not bool(st["done"].all()):
            replay = _captured(step, st)
        for t in range(1, max_tokens):
            if t % 8 == 1 and bool(st["done"].all()):   # a host read every 8 tokens: stopped rows cost little
                break
            replay()
    finally:
        model.train(was_training)
    return [row[:n] for row, n in zip(st["out"].tolist(), st["length"].tolist())]


CACHE_ROUND = 128   # a compiled token step's caches hold a multiple of this many positions


def compiled_step(runner):
    """`runner` (a static-decode module) under torch.compile, fixed shapes. Compiled code is kept per forward's code
    and guarded on the shapes and types it was traced with, so another module of the same layout (the next
    sampling's copy of the weights) runs it again without a recompile."""
    return torch.compile(runner, dynamic=False)


def _captured(step, st: dict):
    """`step` captured in a CUDA graph -> a function that replays it. It runs twice first on a side stream (to
    settle its allocations), from a copy of the state that is put back afterwards: the cache slot it writes is
    written again, with the same keys and values, by the first replay."""
    saved = {k: v.clone() for k, v in st.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
            for k, v in saved.items():
                st[k].copy_(v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


@torch.no_grad()
def sample(model, tokenizer: Tokenizer, prompt: str, max_tokens: int = 100, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0,
           device: torch.device | str = "cpu", stop_at_eot: bool = True) -> str:
    """Generate a continuation of `prompt` (returned without the prompt): `max_tokens` tokens, fewer only where
    the end-of-text token stops it. Past the model's context (`block_size`) the window slides: the caches are
    filled again from the last half-context of tokens, so each token is drawn from at least that many before it
    (a warning says so once)."""
    check_sampling(temperature, top_k, top_p, max_tokens)
    device = torch.device(device)
    model.eval()
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    limit = getattr(model, "block_size", None) or len(ids) + max_tokens
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = next(model.parameters()).dtype
    stop = frozenset({tokenizer.eot_id}) if stop_at_eot else frozenset()
    out: list[int] = []
    keep, warned = limit - 1, False   # the first window holds as much of the prompt as leaves room for one token
    while len(out) < max_tokens and not (out and out[-1] in stop):
        window = (ids + out)[-keep:]
        n = min(max_tokens - len(out), limit - len(window))
        if len(window) < len(ids) + len(out) and not warned:
            warned = True
            log.warning(f"the prompt and the text exceed the model's {limit}-token context: each token is drawn "
                        f"from the last {max(1, limit // 2)} to {limit - 1} tokens before it")
        caches = model.make_caches(1, len(window) + n, dtype, device)
        out += stream(model, window, caches, 0, n, tokenizer.vocab_size, gen, temperature, top_k, top_p, stop)
        keep = max(1, limit // 2)
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
    check_sampling(temperature, top_k, top_p, max_tokens)

    V, S = model.vocab_size, model.sentinel_tokens
    ids = encode_with_sentinels(tokenizer, prompt, V, S) + [tokenizer.eot_id]
    out = decode_seq2seq(model, ids, max_tokens, tokenizer.eot_id, tokenizer.vocab_size, temperature, top_k, top_p,
                         seed, device)
    return [(k, tokenizer.decode(span)) for k, span in split_spans(out, V, S)]
