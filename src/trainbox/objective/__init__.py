"""Training objectives: the loss of a step and the batch it needs, one unit each, chosen once from train.objective.

    next_token   pretraining and SFT: the token loss over the data's windows, masked where the data has a
                 loss mask (next_token.py)
    dpo          preference pairs, chosen and rejected in one forward: dpo, ipo, simpo, orpo (preference.py,
                 the losses in losses.py, the pairs in data/preference.py and data/pairs.py); under
                 dpo.loss=kto, unpaired examples judged desirable or not (kto.py)
    reward       a reward model: a score head trained on the same pairs, the chosen response to score higher
                 (reward.py)
    grpo         online reinforcement learning: completions sampled from the model for each prompt, scored by
                 reward functions, each trained on its advantage over its group (grpo.py, the prompts in
                 data/prompts.py, the sampling in generate.py rollout)

The loop (train/loop.py) asks the run's objective for its datasets, the denominator of a step's mean, each
micro-batch's loss and logged values, and the validation; the memory plan asks `memory_terms` and `rollout_terms`.
Objectives call the family's own forward, so every causal family trains with every objective (reward: every family
whose forward scores, `Family.scores`) and no objective names a family.
"""
from __future__ import annotations

import torch

from trainbox.objective.base import Objective, Part, Runtime  # noqa: F401
from trainbox.objective.grpo import Grpo
from trainbox.objective.kto import Kto
from trainbox.objective.losses import UNPAIRED
from trainbox.objective.next_token import NextToken
from trainbox.objective.preference import Preference
from trainbox.objective.reward import Reward

OBJECTIVES = {"next_token": NextToken, "dpo": Preference, "reward": Reward, "grpo": Grpo}


def objective_class(cfg) -> type[Objective]:
    """train.objective's class; dpo.loss=kto's examples have their own."""
    return Kto if cfg.train.objective == "dpo" and cfg.dpo.loss in UNPAIRED else OBJECTIVES[cfg.train.objective]


def build_objective(cfg, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Objective:
    """The objective of train.objective for a run on `device` in `dtype` (the autocast dtype)."""
    return objective_class(cfg)(cfg, device, dtype)


def resolve_objective(cfg):
    """`cfg` as train.objective trains it (Objective.resolve): the pre-flight check's, once."""
    return objective_class(cfg).resolve(cfg)


def memory_terms(cfg) -> tuple[int, bool]:
    """For the memory plan: (sequences a sample puts through the model with gradients, whether a frozen copy of
    the initial model is kept beside it)."""
    cls = objective_class(cfg)
    return cls.sequences_of(cfg), cls.frozen_copy(cfg)


def rollout_terms(cfg, world: int) -> tuple[int, int, int, bool] | None:
    """For the memory plan: what the objective samples before its steps (Objective.rollout_shape), or None."""
    return objective_class(cfg).rollout_shape(cfg, world)
