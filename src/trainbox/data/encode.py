"""Tokenizing for `trainbox prepare`, in worker processes: work items of raw entries (JSON lines, text files)
-> per entry (starts_document, [ids per key], loss mask or None). EncodePool keeps the input order with a
bounded number of items in flight; with one worker it encodes in this process. GPT-2's ordinary text goes
through fastokens where it is installed (tokenizer.fast_gpt2), tiktoken otherwise: the same ids.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import os
import sys
from typing import Iterator

import numpy as np

from trainbox.data import tokenizer as tokenizers
from trainbox.data.chat import encode_chat, load_template
from trainbox.data.readers import decode_utf8, parse_json_line
from trainbox.data.tokenizer import get_tokenizer
from trainbox.errors import DataError

_WORKER: dict = {}


def _init_worker(tokenizer_spec: str, chat_template: str | None, chat: bool, keys: list[str],
                 pooled: bool = False) -> None:
    if pooled:  # the worker processes are the parallelism: fastokens runs on one thread in each
        os.environ.update(FASTOKENS_BPE_THREADS="1", RAYON_NUM_THREADS="1")
    fast = tokenizers.fast_gpt2() if tokenizer_spec == "gpt2" else None
    _WORKER.update(tok=get_tokenizer(tokenizer_spec), fast=fast, chat=chat, keys=keys)
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
            ids, mask = encode_chat(_WORKER["template"], tok, e[1], e[2])
            out[i] = (True, [np.asarray(ids, dtype=dtype)], np.asarray(mask, dtype=np.uint8))
    return out


def _encode_texts(tok, texts: list[str], fast=None) -> list:
    """Token ids of ordinary text (special-token strings are plain text, as in encode_ordinary)."""
    if fast is not None:
        # one flat uint32 buffer and the texts' offsets into it: no Python int per token
        ids, offsets = fast.encode_batch_flat(texts)
        ids, offsets = np.frombuffer(ids, np.uint32), np.frombuffer(offsets, np.uint64).tolist()
        return [ids[a:b] for a, b in zip(offsets, offsets[1:])]
    enc = getattr(tok, "enc", None)
    if enc is not None and hasattr(enc, "encode_to_numpy"):
        # tiktoken straight into a numpy buffer: no Python int per token. With no special token allowed
        # and none disallowed, `encode` is exactly `encode_ordinary`. A plain loop, not
        # encode_ordinary_batch, which starts a thread pool per call: the parallelism is the processes.
        return [enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=()) for t in texts]
    hf = getattr(tok, "tok", None)
    if hf is not None and hasattr(hf, "encode_special_tokens"):
        # `tokenizers` matches added tokens even in plain text; a literal "<|endoftext|>" in a web page must
        # not become a document boundary, so special-token strings are encoded as text here (and the
        # shared tokenizer is restored for chat rendering and other users).
        before, hf.encode_special_tokens = hf.encode_special_tokens, True
        try:
            return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
        finally:
            hf.encode_special_tokens = before
    return [tok.encode(t) for t in texts]


class EncodePool:
    """Ordered, bounded map: at most `depth` items in flight (Pool.imap would read the whole input)."""

    def __init__(self, workers: int, initargs: tuple):
        self.pool = None
        if workers > 1:
            # fork is quickest, but fastokens' threads, once started, would be missing in a forked worker
            fork = sys.platform.startswith("linux") and not tokenizers.FAST_STARTED
            ctx = mp.get_context("fork" if fork else "forkserver" if sys.platform.startswith("linux") else "spawn")
            self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(*initargs, True))
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


