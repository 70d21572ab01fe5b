"""GRPO's rows, apart from its objective (objective/grpo.py): a generation's completions as its steps train them
(`Row`, `Generation`), group advantages, the training rows of prompts and completions with their pi_old, and each
completion's sampling seed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SHAPE = 64   # training rows are padded to a multiple of this many positions (few compiled shapes)


@dataclass
class Row:
    """One completion of a generation, as the generation's steps train it."""
    completion: list[int]
    scores: torch.Tensor          # (functions,) float64; NaN: not scored
    reward: float                 # the weighted sum; NaN: not scored
    advantage: float
    std: float                    # its group's reward standard deviation
    truncated: bool
    old: torch.Tensor | None = None   # its tokens' log-probabilities at the generation's first step (host, fp32)


@dataclass
class Generation:
    """The completions that grpo.num_iterations steps in a row train on: this rank's, keyed by (prompt index, number
    in its group). `parts`: the keys of each micro-batch and, as the first step's forwards computed them, their
    log-probabilities on the device ((rows, positions) each; the later steps' pi_old)."""
    index: int                    # step // grpo.num_iterations
    rows: dict[tuple[int, int], Row]
    seconds: float = 0.0          # spent sampling them
    parts: tuple[list, list] | None = None

    def state(self, prompt_lengths: list[int]) -> dict:
        """Its rows for a checkpoint, each with its pi_old (copied to the host from `parts`; `prompt_lengths`: each
        row's prompt's, in the order of `rows`)."""
        at = dict(zip(self.rows, prompt_lengths))
        for part, logps in zip(*self.parts) if self.parts is not None else ():
            if logps is not None:
                logps = logps.float().cpu()
                for r, key in enumerate(part):
                    row = self.rows[key]
                    row.old = logps[r, at[key] - 1:at[key] - 1 + len(row.completion)].clone()
        return {"generation": self.index,
                "rows": [{"prompt": i, "j": j, "completion": r.completion, "scores": r.scores, "reward": r.reward,
                          "advantage": r.advantage, "std": r.std, "truncated": r.truncated, "old": r.old}
                         for (i, j), r in self.rows.items()]}

    @classmethod
    def merged(cls, states: list) -> "Generation | None":
        """Every rank's `state` as one generation (pi_old in the rows), or None where none was saved."""
        states = [s for s in states if s is not None]
        if not states:
            return None
        rows = {(d["prompt"], d["j"]): Row(list(d["completion"]), d["scores"], d["reward"], d["advantage"], d["std"],
                                           d["truncated"], d["old"])
                for s in states for d in s["rows"]}
        return cls(states[0]["generation"], rows)


def group_advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) rewards, NaN where not scored, in groups of `group` consecutive rows -> (advantages, each row's group
    standard deviation): reward minus the group's mean over its scored rows, divided by the group's (sample)
    standard deviation + 1e-4 (scale=group), by `batch_std` + 1e-4 (batch) or not at all (none); 0 where not
    scored."""
    g = rewards.view(-1, group)
    n = (~g.isnan()).sum(1, keepdim=True)
    mean = g.nansum(1, keepdim=True) / n
    std = (((g - mean) ** 2).nansum(1, keepdim=True) / (n - 1)).sqrt()
    adv = g - mean
    if scale == "group":
        adv = adv / (std + 1e-4)
    elif scale == "batch":
        adv = adv / (batch_std + 1e-4)
    return adv.reshape(-1).nan_to_num(0.0), std.expand_as(g).reshape(-1)


def training_rows(prompts: list[list[int]], completions: list[list[int]], seq_len: int, pad: int
                  ) -> dict[str, torch.Tensor]:
    """Each prompt followed by its completion, one row each, right-padded with `pad` to the longest (rounded up to
    a multiple of SHAPE, at most seq_len): x, y (the next tokens) and loss_mask (on the completion's tokens)."""
    n = [len(p) + len(c) - 1 for p, c in zip(prompts, completions)]
    T = min(seq_len, -(-max(n) // SHAPE) * SHAPE)
    x = torch.full((len(n), T), pad, dtype=torch.int64)
    y = torch.full((len(n), T), pad, dtype=torch.int64)
    mask = torch.zeros(len(n), T, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = torch.tensor(p + c, dtype=torch.int64)
        x[i, :n[i]], y[i, :n[i]] = ids[:-1], ids[1:]
        mask[i, len(p) - 1:n[i]] = True
    return {"x": x, "y": y, "loss_mask": mask}


def old_logps(prompts: list[list[int]], rows: list[Row], shape: torch.Size) -> torch.Tensor:
    """(rows, positions) pi_old of training_rows' layout from each row's kept log-probabilities (0 elsewhere)."""
    out = torch.zeros(shape, dtype=torch.float32)
    for r, (p, row) in enumerate(zip(prompts, rows)):
        out[r, len(p) - 1:len(p) - 1 + len(row.completion)] = row.old
    return out


def row_seed(seed: int, step: int, index: int, j: int) -> int:
    """The sampling seed of completion j of prompt `index` at `step` (-1: validation): a pure function of the four."""
    return hash((seed, step, index, j)) & (2**63 - 1)
