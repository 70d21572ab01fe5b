"""Tiny Hugging Face models for the LoRA tests: random weights, a small BPE tokenizer with a ChatML
template, saved to a folder exactly as `save_pretrained` writes them. Nothing is downloaded. Also the chat
templates and the tool-calling record the chat-data tests share."""
from __future__ import annotations

import json
import random
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "one two three four five six seven eight nine ten plus minus equals what is the sum of and".split()

# Qwen3's rule, written small: an answer after the last question opens with an empty reasoning block, an earlier
# one is rendered without it and without any reasoning its text holds; so a longer conversation renders the
# earlier answers otherwise
REASONING = ("{%- set ns = namespace(last=messages|length - 1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
             "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}"
             "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}{%- if loop.index0 > ns.last %}"
             "{{- '<think>\n\n</think>\n\n' + m.content }}{%- else %}{{- m.content.split('</think>')[-1] }}{%- endif %}"
             "{{- '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
             "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

# a template that writes function schemas and tool calls (Qwen2.5's way, written small)
TOOLS = ("{%- if tools %}{{- '<|im_start|>system\n# Tools\n' }}{%- for t in tools %}{{- t | tojson + '\n' }}"
         "{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}{%- for m in messages %}{%- if m.role == 'assistant' %}"
         "{{- '<|im_start|>assistant\n' + m.content }}{%- for c in m.tool_calls or [] %}{{- '<tool_call>\n' }}"
         "{{- {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{{- '\n</tool_call>' }}"
         "{%- endfor %}{{- '<|im_end|>\n' }}{%- elif m.role == 'tool' %}"
         "{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}{%- else %}"
         "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
TOOL_RECORD = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}],
    "messages": [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "tool_call_id": "0", "content": '{"temp": 21}'},
                 {"role": "assistant", "content": "21 degrees."}]}


MIXED = "He said: «It's 2024», HTTPServer's readyAPI?\n\n  Übergrößen 123456 i.e./etc/ CamelCase  \tend.\r\n"


def make_tokenizer(folder: Path, vocab_size: int = 320, chat_template: str | None = CHATML, split: str | None = None):
    """A byte-level BPE: GPT-2's pre-tokenizer, or a `split` regex before a regex-free byte level (Llama 3's way)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # with a split regex, merges are learnt across every boundary, so that a regex that cuts otherwise tokenizes
    # otherwise
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    mixed = [] if split is None else [MIXED] * 20   # what a split regex cuts otherwise than GPT-2's
    tok.train_from_iterator([" ".join(rng.choices(WORDS, k=12)) for _ in range(300)] + ["user assistant system"]
                            + mixed, trainer=trainer)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


# Mistral's template (v0.1, v0.2): the beginning-of-text token in the text, [INST] in plain text, answers end at </s>
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
           "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
           "{{ m['content'] + eos_token }}{% endif %}{% endfor %}")


def make_sentencepiece_tokenizer(folder: Path, legacy: bool | None = None, vocab_size: int = 100):
    """A Llama 2 / Mistral tokenizer.json as transformers converts a SentencePiece BPE model: <unk> <s> </s>, the 256
    byte-fallback tokens, then pieces ("▁" marks a space) with every split of a piece into two pieces as a merge,
    the pieces' order; a normalizer that puts "▁" before the text and for every space. `legacy` goes in
    tokenizer_config.json (transformers then marks the first word only, unless true)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, LlamaTokenizerFast

    rng = random.Random(0)
    marker = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learn = Tokenizer(models.BPE())
    learn.normalizer = marker
    learn.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    learn.train_from_iterator([" ".join(rng.choices(WORDS, k=12)) for _ in range(300)] + ["[INST] [/INST]"] * 3,
                              trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {p: i for i, p in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for piece in sorted(learn.get_vocab(), key=learn.get_vocab().get):
        vocab.setdefault(piece, len(vocab))
    merges = [(p[:i], p[i:]) for p in vocab if p not in specials and not p.startswith("<0x")
              for i in range(1, len(p)) if p[:i] in vocab and p[i:] in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = marker
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    fast = LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = MISTRAL
    fast.save_pretrained(folder)
    if legacy is not None:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps({**config, "legacy": legacy}))
    return AutoTokenizer.from_pretrained(folder)


def make_model(folder: Path, arch: str = "llama", vocab_size: int = 320, seed: int = 0,
               legacy: bool | None = None) -> Path:
    """A 2-layer, width-32 causal LM with random weights and its tokenizer, saved to `folder`; mistral: 4 heads of
    16 sharing 2 key/value heads, no sliding window, the SentencePiece tokenizer (`legacy` as there)."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    folder = Path(folder)
    tok = make_sentencepiece_tokenizer(folder, legacy) if arch == "mistral" else make_tokenizer(folder, vocab_size)
    torch.manual_seed(seed)
    if arch == "mistral":
        cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                            sliding_window=None, rope_theta=1e6, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
        model = MistralForCausalLM(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=256,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
        model = GPT2LMHeadModel(cfg)
    model.save_pretrained(folder)
    return folder


def make_chat_file(path: Path, n: int = 96, seed: int = 0) -> Path:
    """Arithmetic chats: the assistant's answer is a function of the question, so the loss can fall."""
    rng = random.Random(seed)
    names = WORDS[:10]
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(5), rng.randrange(5)
            msgs = [{"role": "user", "content": f"what is {names[a]} plus {names[b]}"},
                    {"role": "assistant", "content": f"{names[a]} plus {names[b]} equals {names[a + b]}"}]
            if rng.random() < 0.3:
                msgs = [{"role": "system", "content": "the sum"}] + msgs
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def make_preference_file(path: Path, n: int = 64, form: str = "messages", seed: int = 0) -> Path:
    """Arithmetic preferences: the chosen answer is the right sum, the rejected one a wrong sum. `form`: "text"
    ({"prompt", "chosen", "rejected"} strings), "messages" (TRL's conversational form with an explicit prompt) or
    "implicit" (chosen and rejected conversations that share the user's turn)."""
    rng = random.Random(seed)
    names = WORDS[:10]
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(5), rng.randrange(5)
            wrong = rng.choice([k for k in range(10) if k != a + b])
            question = f"what is {names[a]} plus {names[b]}"
            good, bad = f"{names[a]} plus {names[b]} equals {names[a + b]}", f"it equals {names[wrong]}"
            if form == "text":
                row = {"prompt": question + " ?", "chosen": " " + good, "rejected": " " + bad}
            elif form == "messages":
                row = {"prompt": [{"role": "user", "content": question}],
                       "chosen": [{"role": "assistant", "content": good}],
                       "rejected": [{"role": "assistant", "content": bad}]}
            else:
                user = {"role": "user", "content": question}
                row = {"chosen": [user, {"role": "assistant", "content": good}],
                       "rejected": [user, {"role": "assistant", "content": bad}]}
            f.write(json.dumps(row) + "\n")
    return path


def make_unpaired_file(path: Path, n: int = 64, form: str = "messages", seed: int = 0, desirable: float = 0.5) -> Path:
    """Unpaired arithmetic feedback (TRL's unpaired form): each row one answer, desirable (label true) when it is the
    right sum, with probability `desirable`. `form`: "text" or "messages"."""
    rng = random.Random(seed)
    names = WORDS[:10]
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(5), rng.randrange(5)
            good = rng.random() < desirable
            answer = a + b if good else rng.choice([k for k in range(10) if k != a + b])
            question = f"what is {names[a]} plus {names[b]}"
            reply = f"{names[a]} plus {names[b]} equals {names[answer]}" if good else f"it equals {names[answer]}"
            if form == "text":
                row = {"prompt": question + " ?", "completion": " " + reply, "label": good}
            else:
                row = {"prompt": [{"role": "user", "content": question}],
                       "completion": [{"role": "assistant", "content": reply}], "label": good}
            f.write(json.dumps(row) + "\n")
    return path


def trl_step(trainer):
    """A TRL trainer's own loss on the first batch its collator makes, with its backward, in training mode ->
    (the batch, the loss, each parameter's gradient by name, the metrics it logged for that batch)."""
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    return batch, loss, grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def perturbed(folder: Path, out: Path, seed: int, scale: float = 0.05) -> Path:
    """A copy of the model folder with every weight moved by scale x N(0, 1) noise drawn from `seed`, its tokenizer
    and template beside: a policy whose log-ratios against `folder` are not 0."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())
    return out
