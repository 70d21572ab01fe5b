"""`trainbox chat`: a conversation with a causal model in the run's chat template, streamed token by token.

    trainbox chat runs/sft                                     # type a message and Enter; /reset clears the history
    printf 'what is two plus two\\nand three\\n' | trainbox chat runs/sft --temperature 0   # one answer a line

The template is the run's (data/chat.py's template_for: data.chat_template, else the tokenizer's own, else ChatML).
A turn ends at the template's end-of-turn token (<|im_end|> for ChatML, <|eot_id|> for Llama 3; matched as text
where the tokenizer has no single token for it) or at end-of-text, or after max_tokens.

The KV cache is kept across turns, for every causal family: each turn renders the whole conversation and
tokenizes it as SFT training does (each template span on its own), then feeds only the tokens past the longest
prefix the cache already holds. The model's answer stays in the cache as it was generated wherever its
re-tokenization equals it (the usual case), so a turn feeds its new user message and the template's markers. The
caches grow with the conversation up to the model's context (model/build.py context_length: a model trained from
scratch, its block size; a fine-tune of a Hugging Face folder, the folder's own), and a conversation longer than
that drops its oldest turns, said once per turn it happens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from trainbox import checkpoint
from trainbox.config import build_config
from trainbox.data.chat import ChatTemplate, generation_prompt_ids, template_for, token_of
from trainbox.errors import BadCheckpoint, CheckpointError, ConfigError
from trainbox.generate import check_sampling, stream
from trainbox.model.load import load_for_inference
from trainbox.model.spec import family

log = logging.getLogger("trainbox")

FIRST_ROOM = 2048   # positions of a conversation's first caches, where the model's context is longer


@dataclass
class Reply:
    """One answer: its text (without the end-of-turn marker), its ids, and why it ended: end_of_turn,
    end_of_text or max_tokens."""

    text: str
    ids: list[int]
    stopped: str


class ChatSession:
    """A conversation with `model` in `template`; `turn(text)` streams the answer to one user message."""

    def __init__(self, model, tokenizer, template: ChatTemplate, system: str | None = None,
                 temperature: float = 0.7, top_k: int | None = None, top_p: float | None = None,
                 max_tokens: int = 256, seed: int = 0):
        check_sampling(temperature, top_k, top_p, max_tokens)
        self.model, self.tokenizer, self.template = model.eval(), tokenizer, template
        self.system, self.temperature, self.top_k, self.top_p = system, temperature, top_k, top_p
        self.max_tokens = max_tokens
        self.end_text = template.end_mark
        self.end_id = token_of(tokenizer, self.end_text)
        self.stop = frozenset({tokenizer.eot_id} | ({self.end_id} if self.end_id is not None else set()))
        param = next(model.parameters())
        self.limit = int(getattr(model, "block_size", 2048))   # the model's context (model/build.py context_length)
        self.dtype, self.device = param.dtype, param.device
        self.room = 0                 # the positions the caches have: grown as the conversation needs (`_grow`)
        self.caches = None
        self.gen = torch.Generator(device=param.device).manual_seed(seed)
        self.cached: list[int] = []   # the ids whose keys and values the caches hold, position by position
        self.reused = 0               # how many of them the last turn kept
        self.last: Reply | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays); the cache is reused where the next prompt allows."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return generation_prompt_ids(self.template, self.tokenizer, messages)

    def _fit(self) -> list[int]:
        """The prompt ids of the conversation, its oldest turns dropped while it leaves no room to answer."""
        ids = self.prompt_ids(self.messages)
        first = 1 if self.system else 0
        dropped = 0
        while len(ids) + 1 > self.limit and len(self.messages) - first > 1:
            del self.messages[first:first + 2]   # the oldest user message and its answer
            dropped += 1
            ids = self.prompt_ids(self.messages)
        if dropped:
            log.warning(f"the conversation exceeded the model's {self.limit}-token context: dropped its "
                        f"{dropped} oldest turn(s)")
        return ids[-(self.limit - 1):]

    def _grow(self, need: int) -> None:
        """Caches of at least `need` positions: new ones where the current ones are shorter, of twice their length
        (at least FIRST_ROOM, at most the model's context), which hold nothing yet. A model whose context is long
        (a folder's tens of thousands of positions) gets caches as long as its conversation, not as its context."""
        if need <= self.room:
            return
        self.room = min(self.limit, max(need, 2 * self.room, FIRST_ROOM))
        self.caches = self.model.make_caches(1, self.room, self.dtype, self.device)
        self.cached = []

    def turn(self, text: str) -> Iterator[str]:
        """Add a user message and stream the answer's text as it is generated; `self.last` is the Reply."""
        self.messages.append({"role": "user", "content": text})
        ids = self._fit()
        budget = min(self.max_tokens, self.limit - len(ids))
        self._grow(len(ids) + max(0, budget))
        common = 0
        for a, b in zip(self.cached, ids[:-1]):   # at least one id is fed: its logits give the first token
            if a != b:
                break
            common += 1
        self.reused = common
        crop = getattr(self.caches, "crop", None)   # a cache that tracks its own length (transformers') is cut
        if crop is not None:
            crop(common)
        out: list[int] = []
        stopped, shown, fed = "max_tokens", "", 0   # fed: how many of `out` went through the model
        tokens = stream(self.model, ids[common:], self.caches, common, budget, self.tokenizer.vocab_size, self.gen,
                        self.temperature, self.top_k, self.top_p, self.stop)
        for token in tokens:
            fed = len(out)   # the stream feeds each id before it draws the next
            if token in self.stop:
                stopped = "end_of_turn" if token == self.end_id else "end_of_text"
                break
            out.append(token)
            text = self.tokenizer.decode(out)
            if self.end_id is None and self.end_text and self.end_text in text:   # a marker of several tokens
                stopped = "end_of_turn"
                break
            ready = self._printable(text)
            if len(ready) > len(shown):
                yield ready[len(shown):]
                shown = ready
        tokens.close()
        self.cached = ids + out[:fed] if budget > 0 else self.cached[:common]
        answer = self.tokenizer.decode(out)
        if self.end_id is None and self.end_text:
            answer = answer.split(self.end_text, 1)[0]
        if len(answer) > len(shown):
            yield answer[len(shown):]
        self.messages.append({"role": "assistant", "content": answer})
        self.last = Reply(answer, out, stopped)

    def _printable(self, text: str) -> str:
        """What may be shown of the answer so far: not a trailing partial UTF-8 character, nor a tail that may
        be the start of a several-token end-of-turn marker."""
        text = text.rstrip("\ufffd")
        if self.end_id is None and self.end_text:
            for n in range(min(len(self.end_text), len(text)), 0, -1):
                if text.endswith(self.end_text[:n]):
                    return text[:-n]
        return text


def open_chat(path: str | Path, device: str, **options) -> ChatSession:
    """A ChatSession with the newest verified checkpoint of `path` (a run or a step folder); refused before any
    weights are read when the checkpoint does not verify or the family does not generate causally."""
    try:
        ckpt = checkpoint.resolve(path)
    except CheckpointError as e:
        raise BadCheckpoint(e.message, e.hint) from None
    name = build_config(checkpoint.load_trainer(ckpt)["config"]).model.family
    if family(name).generate != "causal":
        raise ConfigError(f"{path} is a model.family={name} run, which fills spans rather than continuing a "
                          "conversation", hint=f"use trainbox generate {path} --prompt '... <extra_id_0> ...'")
    model, tokenizer, cfg = load_for_inference(ckpt, device)
    return ChatSession(model, tokenizer, template_for(tokenizer, cfg.data.chat_template), **options)
