"""Tokenizing for `trainbox prepare`, in worker processes: work items of raw entries (JSON lines, text files)
-> per entry (starts_document, [ids per key], loss mask or None). EncodePool keeps the input order with a
bounded number of items in flight; with one worker it encodes in this process. Ordinary text goes through
fastokens where tokenizer.fast_encoder gives one (GPT-2, byte-level BPE tokenizer.json files), through tiktoken or
`tokenizers` otherwise: the same ids.
"""
from __future__ import annotations

import base64
import collections
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from trainbox.data.chat import encode_chat, load_template
from trainbox.data.readers import decode_utf8, parse_json_line
from trainbox.data.tokenizer import GPT2_PATTERN, GPT2Tokenizer, HFTokenizer, Tokenizer, get_tokenizer, gpt2_ranks
from trainbox.errors import DataError

try:  # a dependency, with wheels for the common platforms; tiktoken or `tokenizers` do the work where it has none
    import fastokens
except ImportError:  # pragma: no cover
    fastokens = None

# text that the pre-tokenizers and normalizers treat specially: fast_encoder's check of a tokenizer.json
PROBE = ("Hello  world\n\n\tx 1234567 3.14 don't I'LL naïve café ß ﬁ İ ǅ e\u0301 日本語 한국어 ١٢ Ⅻ 😀 \u00a0 \u3000 "
         "<|endoftext|> </s> <s> <|im_start|> a   \r\n  end  ")


class FastEncoder:
    """A tokenizer's ordinary text through fastokens (Rust), in a fraction of the CPU time of tiktoken or
    `tokenizers`, for `prepare`'s bulk encoding; special-token strings in a text are text, as in encode_ordinary.

    fastokens spreads batches and long texts over threads, which a forked process lacks and then waits for forever.
    `encoded` records that this process has encoded (EncodePool then starts its workers from a fork server); a built
    encoder that has not encoded forks safely.
    """

    encoded = False   # process state: whether fastokens' threads may exist here

    def __init__(self, tok):
        self.tok = tok

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (uint32): views into one flat buffer, no Python int per token."""
        FastEncoder.encoded = True
        ids, offsets = self.tok.encode_batch_flat(texts, add_special_tokens=False, split_special_tokens=True)
        ids, offsets = np.frombuffer(ids, np.uint32), np.frombuffer(offsets, np.uint64).tolist()
        return [ids[a:b] for a, b in zip(offsets, offsets[1:])]


def fast_encoder(tok: Tokenizer) -> tuple[FastEncoder | None, str]:
    """(a FastEncoder giving `tok`'s ids, "") or (None, why there is none).

    GPT-2: built from the shipped ranks (tests hold its ids equal to tiktoken's). A tokenizer.json: fastokens reads
    the byte-level BPEs (GPT-2, Llama 3, Qwen2 style) and refuses what it does not support; what it reads must
    give `tokenizers`' ids on PROBE."""
    if fastokens is None:
        return None, "fastokens is not installed (pip install fastokens)"
    if isinstance(tok, GPT2Tokenizer):
        with tempfile.TemporaryDirectory(prefix="trainbox-gpt2-") as folder:
            path = Path(folder) / "gpt2.tiktoken"   # tiktoken's rank file: base64 of the token's bytes, its id
            path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for t, i in gpt2_ranks().items()))
            fast = fastokens.Tokenizer.from_tiktoken(str(path), pattern=GPT2_PATTERN, special_tokens={})
        return FastEncoder(fast), ""
    if not isinstance(tok, HFTokenizer):
        return None, f"fastokens does not encode {type(tok).__name__}"
    try:
        fast = fastokens.Tokenizer.from_json_str(tok.tok.to_str())
    except ValueError as e:
        return None, f"fastokens cannot read {tok.name} ({e})"
    # encode_ordinary: one short text starts no thread, so the check leaves this process safe to fork
    try:
        ids = fast.encode_ordinary(PROBE).ids
    except ValueError as e:   # e.g. a byte its vocabulary lacks, which `tokenizers` drops
        return None, f"fastokens cannot encode a probe text with {tok.name} ({e})"
    if ids != tok.encode_texts([PROBE])[0]:
        return None, f"fastokens' ids for {tok.name} differ from tokenizers' on a probe text"
    return FastEncoder(fast), ""


_WORKER: dict = {}


def _init_worker(tokenizer_spec: str, chat_template: str | None, chat: bool, keys: list[str],
                 pooled: bool = False, fast: bool = False) -> None:
    """`_WORKER["fast"]` is the encoder EncodePool was given (inherited through a fork); a worker started from a fork
    server or spawned builds its own where EncodePool had one (`fast`)."""
    if pooled:  # the worker processes are the parallelism: fastokens runs on one thread in each
        os.environ.update(FASTOKENS_BPE_THREADS="1", RAYON_NUM_THREADS="1")
    tok = get_tokenizer(tokenizer_spec)
    if "fast" not in _WORKER:
        _WORKER["fast"] = fast_encoder(tok)[0] if fast else None
    _WORKER.update(tok=tok, chat=chat, keys=keys)
    if chat:
        _WORKER["template"] = load_template(tokenizer_spec, chat_template)


def _parse(entry: tuple) -> tuple:
    if entry[0] == "json":
        return parse_json_line(entry[1], entry[2], entry[3], _WORKER["keys"], _WORKER["chat"])
    return "text", [decode_utf8(entry[1], entry[3], entry[4])], entry[2]


def _encode_item(item: list) -> list | tuple:
    """Parse and tokenize one work item -> per entry (starts_document, [ids per key], mask or None).

    A DataError comes back as ("error", message, hint): exceptions lose their hint when pickled.
    """
    try:
        return _encode_parsed([_parse(e) for e in item])
    except DataError as e:
        return ("error", e.message, e.hint)


def _encode_parsed(item: list) -> list:
    tok = _WORKER["tok"]
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.int32
    out: list = [None] * len(item)
    plain = [(i, e) for i, e in enumerate(item) if e[0] == "text"]
    if plain:
        flat = [t for _, e in plain for t in e[1]]
        ids = _encode_texts(tok, flat, _WORKER.get("fast"))
        j = 0
        for i, e in plain:
            k = len(e[1])
            out[i] = (e[2], [np.asarray(x).astype(dtype, copy=False) for x in ids[j:j + k]], None)
            j += k
    for i, e in enumerate(item):
        if e[0] == "chat":
            ids, mask = encode_chat(_WORKER["template"], tok, e[1], e[2], e[3])
            out[i] = (True, [np.asarray(ids, dtype=dtype)], np.asarray(mask, dtype=np.uint8))
    return out


def _encode_texts(tok, texts: list[str], fast: FastEncoder | None = None) -> list:
    """Token ids of ordinary text (special-token strings are plain text, as in encode_ordinary)."""
    if fast is not None:
        try:
            return fast.encode(texts)
        except ValueError:  # a text fastokens refuses (a byte the vocabulary lacks): the reference below decides
            pass
    enc = getattr(tok, "enc", None)
    if enc is not None and hasattr(enc, "encode_to_numpy"):
        # tiktoken straight into a numpy buffer: no Python int per token. With no special token allowed
        # and none disallowed, `encode` is exactly `encode_ordinary`. A plain loop, not
        # encode_ordinary_batch, which starts a thread pool per call: the parallelism is the processes.
        return [enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=()) for t in texts]
    if isinstance(tok, HFTokenizer):
        return tok.encode_texts(texts)
    return [tok.encode(t) for t in texts]


class EncodePool:
    """Ordered, bounded map: at most `depth` items in flight (Pool.imap would read the whole input)."""

    def __init__(self, workers: int, initargs: tuple, fast: FastEncoder | None = None):
        """`fast`: the tokenizer's fast encoder (fast_encoder, built once by the caller), or None."""
        self.pool = None
        _WORKER.clear()
        _WORKER["fast"] = fast
        if workers > 1:
            # fork is quickest, and the workers inherit `fast`; but once fastokens has encoded here, its threads
            # would be missing in a forked worker: then the workers start from a fork server and build their own
            linux = sys.platform.startswith("linux")
            fork = linux and not FastEncoder.encoded
            ctx = mp.get_context("fork" if fork else "forkserver" if linux else "spawn")
            self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(*initargs, True, fast is not None))
        else:
            _init_worker(*initargs)
        self.depth = 2 * workers + 2

    def map(self, items: Iterator) -> Iterator:
        if self.pool is None:
            for item, meta in items:
                yield _encode_item(item), meta
            return
        pending: collections.deque = collections.deque()
        for item, meta in items:
            pending.append((self.pool.apply_async(_encode_item, (item,)), meta))
            # hand on finished results at once (progress, and a slow input such as a pipe keeps flowing)
            while pending and (len(pending) >= self.depth or pending[0][0].ready()):
                res, m = pending.popleft()
                yield res.get(), m
        while pending:
            res, m = pending.popleft()
            yield res.get(), m

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


