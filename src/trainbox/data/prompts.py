"""Prompts for online reinforcement learning (train.objective=grpo): JSONL rows read whole into memory.

    {"prompt": "Solve: 12 x 7 =", "answer": "84"}                                      # text
    {"prompt": [{"role": "user", "content": "Solve: 12 x 7"}], "answer": "84"}         # messages

A text prompt is its tokens as they are; a message list is rendered in the chat template (the tokenizer's own, or
data.chat_template) and ends with the template's generation prompt, each span tokenized alone as SFT training
tokenizes a conversation. A prompt keeps its last data.seq_len - grpo.max_completion_len tokens. Every field other
than "prompt" is kept as it is and handed to the reward functions (objective/grpo.py), one value a completion.
The files are data.path and data.val_path (a .jsonl or .jsonl.gz file, or a folder of them); batches are the
prompts' indices (`prompt_index`), from which the objective samples its completions.
"""
from __future__ import annotations

from pathlib import Path

import torch

from trainbox.data.chat import generation_prompt_ids, messages_of, template_for, tools_of
from trainbox.data.readers import json_objects, list_input_files
from trainbox.errors import DataError


class PromptDataset:
    """The prompts of JSONL files, tokenized: `ids` a list a prompt, `rows` the rows themselves."""

    unit = "prompts"

    def __init__(self, path: str, label: str, tok, chat_template: str | None, budget: int, seq_len: int):
        self.name, self.seq_len, self.budget = f"{path} ({label} prompts)", seq_len, budget
        if not Path(path).exists():
            raise DataError(f"{label} prompts: {path} does not exist",
                            hint="give data.path (and data.val_path) a .jsonl file or a folder of them")
        files = [f for f in list_input_files([path]) if f.name.endswith((".jsonl", ".jsonl.gz"))]
        if not files:
            raise DataError(f"{path}: no .jsonl or .jsonl.gz file of prompts",
                            hint='grpo reads JSONL rows such as {"prompt": "...", "answer": "..."}')
        self.rows: list[dict] = []
        self.ids: list[list[int]] = []
        self.chat: list[bool] = []
        self.cut = 0
        template = None
        for f in files:
            for row, n in json_objects(f):
                where = f"{f}:{n}"
                prompt = row.get("prompt")
                if isinstance(prompt, str) and prompt:
                    ids = tok.encode(prompt)
                elif isinstance(prompt, list):
                    template = template or template_for(tok, chat_template)
                    ids = generation_prompt_ids(template, tok, messages_of({"messages": prompt}, where), where,
                                                tools_of(row, where))
                else:
                    raise DataError(f"{where}: a row needs 'prompt': text or a list of messages, got "
                                    f"{type(prompt).__name__ if prompt is not None else 'none'}",
                                    hint='{"prompt": "...", ...} or {"prompt": [{"role": "user", "content": "..."}]}')
                if not ids:
                    raise DataError(f"{where}: the prompt has no tokens")
                self.cut += len(ids) > budget
                self.ids.append(ids[-budget:])
                self.rows.append(row)
                self.chat.append(isinstance(prompt, list))
        if not self.rows:
            raise DataError(f"{path}: no prompts (every line is empty)")
        self.num_samples = len(self.rows)
        self.num_tokens = sum(len(i) for i in self.ids)
        self.arrays: list = []
        self.report = {"prompts": self.num_samples, "prompts_cut": self.cut}

    def describe(self) -> str:
        cut = f"; {self.cut:,} cut to their last {self.budget} tokens" if self.cut else ""
        return f"{self.name}: {self.num_samples:,} prompts, {self.num_tokens:,} tokens{cut}"

    def tail_tokens(self) -> int:
        return 0

    def target_count(self, indices) -> int:
        return len(indices)

    def batch(self, indices) -> dict[str, torch.Tensor]:
        return {"prompt_index": torch.as_tensor(indices, dtype=torch.int64).reshape(-1)}

    def columns(self, indices: list[int]) -> dict[str, list]:
        """The fields other than "prompt" of the rows `indices`, one list a field (None where a row lacks it)."""
        keys = dict.fromkeys(k for i in indices for k in self.rows[i] if k != "prompt")
        return {k: [self.rows[i].get(k) for i in indices] for k in keys}


def open_prompt_datasets(data, grpo, tok) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, val): the prompts of data.path and data.val_path (None without it)."""
    budget = data.seq_len - grpo.max_completion_len
    train = PromptDataset(data.path, "train", tok, data.chat_template, budget, data.seq_len)
    val = PromptDataset(data.val_path, "val", tok, data.chat_template, budget, data.seq_len) if data.val_path else None
    return train, val
