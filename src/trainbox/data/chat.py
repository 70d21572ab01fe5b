"""Chat data for supervised fine-tuning: records -> messages -> template text -> tokens + loss mask.

Records are JSON objects with either `messages` ([{role, content}], OpenAI style) or ShareGPT
`conversations` ([{from, value}]). They are rendered with a Jinja chat template: ChatML by default, or
the `chat_template` of a Hugging Face tokenizer folder (tokenizer_config.json or chat_template.jinja),
the same template `transformers`' apply_chat_template uses. A message's other fields (an assistant's
`tool_calls` or `reasoning_content`, a tool result's `tool_call_id` or `name`) and the record's `tools`
(function schemas) reach the template as apply_chat_template passes them, so tool calls train as the
template writes them.

The loss mask marks the tokens the model is trained on: an assistant message's content and its
end-of-turn marker, never the system/user turns or the assistant header. It is found by rendering
growing prefixes of the conversation (as axolotl and TRL do): the text an assistant message adds
after the generation prompt is that message's trainable span. A template that renders earlier turns
again once the conversation grows (Qwen3's drops the reasoning block of every answer before the last
question) has no such prefixes: the conversation is then rendered once, whole, as the model sees it at
inference, and each assistant span runs from the generation prompt's text before its content to the
end-of-turn marker after it. Each span is tokenized on its own, so a token never straddles a trained and
an untrained region.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from trainbox.errors import DataError, MissingDependency

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
BUILTIN = {"chatml": CHATML}

# ShareGPT speaker names -> roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool", "function_response": "tool",
                  "function_call": "assistant"}


def is_chat_record(rec: Any) -> bool:
    return isinstance(rec, dict) and (isinstance(rec.get("messages"), list)
                                      or isinstance(rec.get("conversations"), list))


def tools_of(rec: dict, where: str) -> list | None:
    """The record's `tools` (function schemas, as the template reads them), or None."""
    tools = rec.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: `tools` must be a list of function schemas (objects), got {tools!r:.80}")
    return tools


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # multi-part content: keep the text parts
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    raise DataError(f"{where}: message content must be a string, got {type(value).__name__}")


def messages_of(rec: dict, where: str) -> list[dict]:
    """Normalise a `messages` or ShareGPT `conversations` record to [{role, content, ...}]: content as text, a
    message's other fields (tool_calls, reasoning_content, tool_call_id, name) kept as they are."""
    if isinstance(rec.get("messages"), list):
        out = []
        for m in rec["messages"]:
            if not isinstance(m, dict) or "role" not in m:
                raise DataError(f"{where}: each of `messages` needs a `role` and `content`, got {m!r:.80}")
            out.append({**m, "role": str(m["role"]), "content": _content(m.get("content") or "", where)})
        return out
    out = []
    for m in rec["conversations"]:
        if not isinstance(m, dict) or "from" not in m:
            raise DataError(f"{where}: each of `conversations` needs `from` and `value`, got {m!r:.80}")
        role = SHAREGPT_ROLES.get(str(m["from"]).lower())
        if role is None:
            raise DataError(f"{where}: unknown ShareGPT speaker {m['from']!r}",
                            hint=f"use one of {', '.join(sorted(SHAREGPT_ROLES))}")
        out.append({"role": role, "content": _content(m.get("value") or "", where)})
    return out


@functools.cache
def _environment():
    """The Jinja environment transformers renders chat templates in (its apply_chat_template): sandboxed,
    trim_blocks and lstrip_blocks, {% break %} and {% continue %}, `{% generation %}` blocks (its marker of assistant
    text, rendered as they are), `strftime_now(format)` (today's date, as Llama 3.2's template asks), and a
    `tojson` that keeps non-ASCII text and the keys' order (Jinja's own escapes and sorts: tool schemas would read
    otherwise than at inference)."""
    try:
        import jinja2  # heavy: jinja2
        from jinja2.ext import Extension, loopcontrols  # heavy: jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # heavy: jinja2
    except ImportError:  # pragma: no cover - jinja2 ships with torch
        raise MissingDependency("jinja2", "hf", "rendering chat templates") from None

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


class ChatTemplate:
    """A Jinja chat template rendered the way transformers does (`_environment`)."""

    def __init__(self, source: str, name: str = "chatml", bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateSyntaxError  # heavy: jinja2

        def raise_exception(msg):
            raise DataError(f"chat template {name}: {msg}")

        try:
            self.template = _environment().from_string(source, globals={"raise_exception": raise_exception})
        except TemplateSyntaxError as e:
            raise DataError(f"chat template {name}: line {e.lineno}: {e.message}",
                            hint="fix the template, or use data.chat_template=chatml") from None
        self.name, self.source = name, source
        self.extra = {"bos_token": bos_token, "eos_token": eos_token}

    @functools.cached_property
    def end_mark(self) -> str:
        """The text the template puts after an assistant message's content ("<|im_end|>" for ChatML, "<|eot_id|>" for
        Llama 3), whitespace stripped: what a model trained on the template emits to end its turn ("" if nothing)."""
        probe = "\x00"
        grown = self.grown_spans([{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}])
        if grown is None:
            raise DataError(f"chat template {self.name} renders a question and its answer as no prefix of what it "
                            "renders for the question alone, so the answer's tokens cannot be found for the loss "
                            "mask", hint="use a template whose generation prompt starts every answer "
                                         "(data.chat_template=chatml, or a .jinja file)")
        trained = "".join(text for text, is_trained in grown if is_trained)
        return trained.split(probe, 1)[-1].strip()

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    **self.extra)

    def spans(self, messages: list[dict], where: str = "record", tools: list | None = None
              ) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, trained) spans; trained spans are assistant output: by growing
        prefixes, or located in the whole rendering where the template renders earlier turns again (module
        docstring). `tools`: the record's function schemas."""
        grown = self.grown_spans(messages, tools)
        out = grown if grown is not None else self.located_spans(messages, where, tools)
        trained = "".join(t for t, on in out if on)
        for i, m in enumerate(messages):   # a template that writes no tool calls would train such a turn as nothing
            for call in m.get("tool_calls") or []:
                name = (call.get("function", call) if isinstance(call, dict) else {}).get("name")
                if not isinstance(name, str) or name not in trained:
                    raise DataError(f"{where}: message {i + 1}'s tool call {name or call!r:.60} is not in what chat "
                                    f"template {self.name} renders for it", hint="use the model's own chat template "
                                    "(one that writes tool calls), or leave tool_calls out of the data")
        return out

    def grown_spans(self, messages: list[dict], tools: list | None = None) -> list[tuple[str, bool]] | None:
        """`spans` by growing prefixes; None where a longer conversation renders an earlier turn otherwise."""
        out: list[tuple[str, bool]] = []
        prev = ""
        for i, m in enumerate(messages):
            full = self.render(messages[: i + 1], tools=tools)
            if m["role"] == "assistant":
                gen = self.render(messages[:i], add_generation_prompt=True, tools=tools)
                if not gen.startswith(prev) or not full.startswith(gen):
                    return None
                out += [(gen[len(prev):], False), (full[len(gen):], True)]
            else:
                if not full.startswith(prev):
                    return None
                out.append((full[len(prev):], False))
            prev = full
        return [(t, trained) for t, trained in out if t]

    def located_spans(self, messages: list[dict], where: str = "record", tools: list | None = None
                      ) -> list[tuple[str, bool]]:
        """`spans` of the whole rendering: each assistant span runs from the end of its generation prompt's text
        (what add_generation_prompt adds before it, a span of its own, as by growing prefixes) past its content to
        the end-of-turn marker and the line breaks after it."""
        whole, end_mark = self.render(messages, tools=tools), self.end_mark
        out: list[tuple[str, bool]] = []
        at = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], tools=tools)
            header = self.render(messages[:i], add_generation_prompt=True, tools=tools)[len(before):]
            start = whole.find(header, at)
            body = whole.find(m["content"], start + len(header)) if start >= 0 else -1
            end = whole.find(end_mark, body + len(m["content"])) if body >= 0 else -1
            if end < 0:
                raise DataError(f"{where}: chat template {self.name} renders earlier turns again, and assistant "
                                f"message {i + 1} is not in its rendering of the whole conversation as given "
                                f"(the template rewrites it, as Qwen3's drops the reasoning of earlier answers)",
                                hint="give the reasoning in a reasoning_content field, or one answer per record")
            end += len(end_mark)
            while end < len(whole) and whole[end] in "\r\n":
                end += 1
            out += [(whole[at:start], False), (header, False), (whole[start + len(header):end], True)]
            at = end
        out.append((whole[at:], False))
        return [(t, trained) for t, trained in out if t]


def render_spans(template: ChatTemplate, messages: list[dict], where: str = "record", tools: list | None = None
                 ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant output (for tokenizers that map
    tokens back to characters)."""
    text, spans = "", []
    for piece, trained in template.spans(messages, where, tools):
        if trained:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    return text, spans


def tokenizer_template(hf, name: str) -> ChatTemplate | None:
    """The chat template of a loaded Hugging Face tokenizer (its `chat_template`), if it has one."""
    source = getattr(hf, "chat_template", None)
    if isinstance(source, dict):   # named templates: take "default"
        source = source.get("default")
    if not source:
        return None
    return ChatTemplate(source, name, bos_token=getattr(hf, "bos_token", None) or "",
                        eos_token=getattr(hf, "eos_token", None) or "")


def encode_chat(template: ChatTemplate, tokenizer, messages: list[dict], where: str = "record",
                tools: list | None = None) -> tuple[list[int], list[int]]:
    """-> (token ids, loss mask of 0/1), the mask 1 exactly on assistant tokens."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in template.spans(messages, where, tools):
        piece = tokenizer.encode(text)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


def generation_prompt_ids(template: ChatTemplate, tokenizer, messages: list[dict], where: str = "the conversation",
                          tools: list | None = None) -> list[int]:
    """`messages` and the template's generation prompt as token ids, tokenized as SFT training tokenizes a
    conversation (each template span alone): what a model answers from (`trainbox chat`, grpo's prompts)."""
    pieces = [text for text, _ in template.spans(messages, where, tools)] if messages else []
    whole = template.render(messages, tools=tools)
    pieces.append(template.render(messages, add_generation_prompt=True, tools=tools)[len(whole):])
    return [i for piece in pieces if piece for i in tokenizer.encode(piece)]


def load_template(tokenizer_spec: str, name: str | None = None) -> ChatTemplate:
    """A built-in template by name, else the tokenizer folder's chat template, else ChatML."""
    if name:
        if name in BUILTIN:
            return ChatTemplate(BUILTIN[name], name)
        path = Path(name)
        if path.is_file():  # a .jinja file
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path))
        raise DataError(f"unknown chat template {name!r}", hint=f"use {', '.join(BUILTIN)} or a .jinja file")
    found = hf_chat_template(tokenizer_spec)
    return found if found is not None else ChatTemplate(CHATML, "chatml")


def hf_chat_template(tokenizer_spec: str) -> ChatTemplate | None:
    """The chat template that ships with a Hugging Face tokenizer folder, if any."""
    p = Path(tokenizer_spec)
    folder = p if p.is_dir() else p.parent
    if tokenizer_spec in ("gpt2",) or tokenizer_spec.startswith("embedded:") or not folder.is_dir():
        return None
    cfg: dict = {}
    if (folder / "tokenizer_config.json").is_file():
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    source = cfg.get("chat_template")
    if isinstance(source, list):  # named templates: take "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not source:
        return None

    def tok(v):
        return v.get("content", "") if isinstance(v, dict) else (v or "")
    return ChatTemplate(source, str(folder), bos_token=tok(cfg.get("bos_token")), eos_token=tok(cfg.get("eos_token")))


def template_for(tokenizer, name: str | None = None) -> ChatTemplate:
    """The chat template of a run: data.chat_template when set (`name`), else the tokenizer's own (a transformers
    tokenizer's chat_template, or the one beside a tokenizer.json), else ChatML."""
    if name:
        return load_template("", name)
    hf = getattr(tokenizer, "hf", None)   # a transformers tokenizer (data/sft.py's HFModelTokenizer)
    found = tokenizer_template(hf, tokenizer.name) if hf is not None else hf_chat_template(tokenizer.name)
    return found if found is not None else ChatTemplate(CHATML, "chatml")


def token_of(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer encodes it as one token (special tokens such as <|im_end|> included),
    else None."""
    if not text:
        return None
    if tokenizer.decode([tokenizer.eot_id]) == text:
        return tokenizer.eot_id
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == text else None
