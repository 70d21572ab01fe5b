"""grpo.rewards, made into callables (objective/grpo.py calls them): 'module:function', 'path/to/file.py:function',
or the directory of a reward model trained here (RewardRun), and the names the log gives them; `score` calls them on
a batch of completions and checks what each returns."""
from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Callable

import torch

from trainbox.data.preference import Example, encode_response, pair_template
from trainbox.data.tokenizer import pad_id
from trainbox.errors import ConfigError, TrainingFailed
from trainbox.model.load import load_for_inference


class RewardRun:
    """A reward model trained here (a `trainbox train reward` run directory or checkpoint) as a reward function: a
    completion is scored as that run scored a pair's response, its prompt and the completion encoded as the run's data
    were (its tokenizer and chat template; a text row ends with end-of-text), the score read at the last token other
    than its padding id; in batches of `batch` rows, without gradients, in the autocast of the caller (the policy
    run's). A sequence longer than the run's data.seq_len keeps its last tokens."""

    def __init__(self, path: str, device: torch.device, batch: int):
        model, tok, cfg = load_for_inference(path, device, generates=False)
        if cfg.train.objective != "reward":
            raise ConfigError(f"grpo.rewards: {path} holds a train.objective={cfg.train.objective} run, not a reward "
                              "model", hint="give a `trainbox train reward` run, or 'module:function'")
        self.model, self.tok, self.batch, self.device = model.eval().requires_grad_(False), tok, batch, device
        self.template = pair_template(tok, cfg.data.chat_template)
        self.pad, self.limit = pad_id(tok), cfg.data.seq_len
        self.__name__ = Path(path).name

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **rows) -> list[float]:
        rows_ids = []
        for k, (prompt, completion) in enumerate(zip(prompts, completions)):
            ex = Example(isinstance(prompt, list), prompt, completion, True)
            rows_ids.append(encode_response(ex, completion, self.tok, self.template, f"completion {k}",
                                            "completion")[0][-self.limit:])
        scores: list[float] = []
        for k in range(0, len(rows_ids), self.batch):
            part = rows_ids[k:k + self.batch]
            x = torch.full((len(part), max(map(len, part))), self.pad, dtype=torch.long)
            at = []
            for i, ids in enumerate(part):
                x[i, :len(ids)] = torch.tensor(ids)
                real = [j for j, t in enumerate(ids) if t != self.pad]
                at.append(real[-1] if real else len(ids) - 1)
            out = self.model(x.to(self.device), score_at=torch.tensor(at, device=self.device))
            scores += out.logits.float().tolist()
        return scores


def load_reward(spec: str, device: torch.device | None = None, batch: int = 64) -> Callable:
    """grpo.rewards' 'module:function', 'file.py:function' or a reward run's directory (or checkpoint) -> the function
    (ConfigError where it is none of them)."""
    if Path(spec).expanduser().is_dir():
        return RewardRun(str(Path(spec).expanduser()), device or torch.device("cpu"), batch)
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ConfigError(f"grpo.rewards: {spec!r} is not 'module:function', 'path/to/file.py:function' or a reward "
                          "run's directory")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(f"grpo.rewards: {spec!r}: no file {path}")
        key = f"trainbox_rewards_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(key)
        if module is None:
            found = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(found)
            sys.modules[key] = module
            try:
                found.loader.exec_module(module)
            except Exception as e:
                del sys.modules[key]
                raise ConfigError(f"grpo.rewards: {spec!r}: {path} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(f"grpo.rewards: {spec!r}: cannot import {target} ({e})",
                              hint="give an importable module, or the path of a .py file") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"grpo.rewards: {spec!r}: {target} has no function {name}")
    return fn


def reward_names(specs: list[str]) -> list[str]:
    """A name each for the log: the function's (a reward run's: its folder's), numbered where two share one."""
    names = [s.rpartition(":")[2] if ":" in s else Path(s).name for s in specs]
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def score(functions: list[Callable], specs: list[str], n: int, **batch) -> torch.Tensor:
    """(n, functions) float64 scores of `n` completions (NaN: not scored), each function called once with `batch`
    (TRL's keywords); a function that raises, returns another count, or a value that is not a finite number or None
    fails the run naming it (its grpo.rewards spec)."""
    out = torch.full((n, len(functions)), float("nan"), dtype=torch.float64)
    for k, (fn, spec) in enumerate(zip(functions, specs)):
        try:
            got = fn(**batch)
        except Exception as e:
            raise TrainingFailed(f"grpo.rewards {spec} raised {type(e).__name__}: {e}") from e
        got = list(got) if got is not None and not isinstance(got, (str, bytes)) else got
        if not isinstance(got, list) or len(got) != n:
            what = f"{len(got)} value(s)" if isinstance(got, list) else type(got).__name__
            raise TrainingFailed(f"grpo.rewards {spec} returned {what} for {n} completions: it must return a list of "
                                 "one number (or None) a completion")
        for i, v in enumerate(got):
            if v is None:
                continue
            try:
                out[i, k] = float(v)
            except (TypeError, ValueError):
                raise TrainingFailed(f"grpo.rewards {spec} returned {v!r} for completion {i}: give a number or "
                                     "None") from None
            if not math.isfinite(out[i, k]):
                raise TrainingFailed(f"grpo.rewards {spec} returned {v!r} for completion {i}: give a finite number "
                                     "or None")
    return out
