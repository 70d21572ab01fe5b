"""What every objective gives the loop: `Part`, one micro-batch's share of a step, the `Objective` interface, and
`Runtime`, what the loop hands an objective of its run."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from trainbox.parallel.distributed import Dist


@dataclass
class Runtime:
    """The run as an objective sees it, from the trainer (train/loop.py)."""
    cfg: object                 # the resolved RunConfig
    model: torch.nn.Module      # the model itself (not its DDP wrapper)
    forward: Callable           # the strategy's forward (DDP, FSDP, compiled)
    reference: torch.nn.Module | None   # a frozen copy of the initial model, where the objective asked for one
    device: torch.device
    autocast: Callable          # a fresh autocast context
    dist: Dist
    train: object               # the datasets
    val: object | None
    tokenizer: object = None
    vocab: int = 0
    whole: Callable = nullcontext   # a context in which each rank holds the whole model (fsdp: every unit gathered)


@dataclass
class Part:
    """One micro-batch's share of a step. `loss` is scaled as the loop asks (its share of the step's mean over the
    global batch, times the world size that DDP divides by) and goes to backward; `stats` (the objective's
    `stat_names`, same scale) are summed over the micro-batches and ranks into the step's means."""
    loss: torch.Tensor
    aux: torch.Tensor | None = None               # the model's auxiliary loss (MoE balance), added by the loop
    stats: torch.Tensor | None = None
    model_stats: dict = field(default_factory=dict)   # the model's own logged values (Output.stats)


class Objective:
    """The loss of a step and the batch it needs; one per run, chosen once from train.objective."""

    name = "objective"
    sequences = 1                       # sequences one sample puts through the model (a pair: 2)
    unit = "sequences"                  # what a sample is, as reports name it
    stat_names: tuple[str, ...] = ()    # what Part.stats holds, logged with the loss
    eval_keys: tuple[str, ...] = ("val_loss", "val_bpb")   # what evaluate returns for the run state
    token_head = True                   # the token head (and its loss) runs over the sequences (the memory plan)

    def open_datasets(self, cfg, tokenizer, vocab: int):
        """(train, val) datasets whose `batch` gives this objective's micro-batches."""
        raise NotImplementedError

    def denominator(self, batches, step: int) -> int:
        """What the step's loss is a mean over (target tokens, pairs): a pure function of the step."""
        raise NotImplementedError

    def needs_initial_weights(self, cfg) -> bool:
        """Whether a resumed run must build its model from the initial weights before the checkpoint's are loaded."""
        return False

    @classmethod
    def frozen_copy(cls, cfg) -> bool:
        """Whether a frozen copy of the initial model must be built beside it (train/build.py)."""
        return False

    @classmethod
    def resolve(cls, cfg):
        """The run's config as this objective trains it (a new one where something changes; `cfg` is never
        changed): the pre-flight check applies it once, and config.yaml records the result."""
        return cfg

    def attach(self, run: Runtime) -> None:
        """Before the checkpoint's weights are loaded: what is taken from the initial model."""

    @classmethod
    def rollout_shape(cls, cfg, world: int) -> tuple[int, int, int, bool] | None:
        """For the memory plan: (rows a process samples together, their prompts' positions, their caches'
        positions, whether it samples through a copy of the linear layers' weights in the compute dtype), where the
        objective samples from the model before its steps; None: it does not."""
        return None

    @classmethod
    def repeats(cls, cfg) -> int:
        """Optimizer steps each global batch of data trains in a row (grpo: grpo.num_iterations)."""
        return 1

    @classmethod
    def sequences_of(cls, cfg) -> int:
        """Sequences one sample of `cfg`'s run puts through the model (the memory plan's count)."""
        return cls.sequences

    def step_batches(self, step: int, batches: list[dict]) -> list[dict]:
        """What a step trains on, from its micro-batches of data (on the device): the same, or what the objective
        makes of them before the step (grpo: its prompts' completions, sampled and scored)."""
        return batches

    def before_step(self, forward, batches: list[dict], rows: list[int] | None = None) -> None:
        """Before a step's micro-batches (every rank, in the autocast): what the step's losses share across them (the
        KL estimate of dpo.loss=kto). `rows`: how many leading rows of each batch are real (validation pads)."""

    def loss(self, forward, batch: dict, scale: float) -> Part:
        raise NotImplementedError

    def state(self, step: int):
        """What an exact resume at `step` needs of this rank beyond the weights and the data's order (grpo: the
        generation its next steps train on), picklable with tensors and plain values only; None: nothing. Every
        rank calls it at every checkpoint."""
        return None

    def load_state(self, states: list) -> None:
        """Every rank's `state` from the checkpoint resumed (in rank order, from a world of any size)."""

    def step_stats(self, values: dict) -> dict:
        """The logged values of a step (or a validation) from the sums of `stat_names`."""
        return values

    def evaluate(self, run: Runtime) -> dict:
        """Validation over the fixed slice of the trainer's val data; the same on every rank."""
        raise NotImplementedError

    def eval_line(self, res: dict) -> str:
        return f"val loss {res['val_loss']:.4f}"
