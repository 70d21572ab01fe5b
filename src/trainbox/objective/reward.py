"""Reward modeling (train.objective=reward): a score head on a causal model, trained on preference pairs so that the
chosen response scores higher than the rejected one (the Bradley-Terry loss of Ouyang et al. 2022; TRL's
RewardTrainer).

    trainbox train reward model.path=FOLDER data.path=prefs.jsonl
    trainbox export runs/reward --format hf --out rm/     # Qwen2ForSequenceClassification, LlamaFor..., num_labels=1

The pairs are the preference objective's (data/preference.py, data/pairs.py: text rows end with end-of-text, chat
rows are the whole conversation in the template), a micro-batch of B pairs one forward of 2B sequences, chosen then
rejected. A sequence's reward is the score head (model/build.py ScoreHead, a linear map of the final hidden state
to one value) at its last token that is not the padding id (data/tokenizer.py pad_id: the tokenizer's pad token,
else end-of-text), as transformers' *ForSequenceClassification reads it, so the export scores as training did.
The loss of a pair is -log sigmoid(r_chosen - r_rejected), plus reward.center_coefficient x (r_chosen +
r_rejected)^2 where it is set; a step's loss is the mean over the global batch's pairs.

Logged with the loss: reward_chosen, reward_rejected, reward_margin, reward_accuracy (the share of pairs whose chosen
response scores higher). Validation: val_loss, val_reward_accuracy, val_reward_margin, val_reward_chosen and
val_reward_rejected, over up to train.eval_tokens / (2 x data.seq_len) validation pairs.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from trainbox.data.pairs import open_pair_datasets
from trainbox.data.tokenizer import pad_id
from trainbox.objective.base import Part, Runtime
from trainbox.objective.preference import Preference, without_dropout

log = logging.getLogger("trainbox")

STATS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, center: float | None) -> torch.Tensor:
    """Each pair's loss (fp32): -log sigmoid(chosen - rejected), plus center x (chosen + rejected)^2."""
    loss = -F.logsigmoid(chosen - rejected)
    return loss + center * (chosen + rejected) ** 2 if center else loss


class Reward(Preference):
    name = "reward"
    stat_names = STATS
    token_head = False   # the score head reads one position a sequence

    def __init__(self, cfg, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(cfg, device, dtype)
        self.needs_reference = False
        self.disable_dropout = cfg.reward.disable_dropout
        self.center = cfg.reward.center_coefficient

    @classmethod
    def frozen_copy(cls, cfg) -> bool:
        return False

    @classmethod
    def resolve(cls, cfg):
        """No end-of-run sample (train.sample_tokens resolves to 0): a reward model scores text, its token head is
        the initial one. reward.disable_dropout: model.dropout and lora.dropout at 0."""
        cfg = without_dropout(cfg) if cfg.reward.disable_dropout else cfg
        if not cfg.train.sample_tokens:
            return cfg
        return cfg.model_copy(update={"train": cfg.train.model_copy(update={"sample_tokens": 0})})

    def open_datasets(self, cfg, tokenizer, vocab: int):
        train, val = open_pair_datasets(cfg.data, cfg.reward, tokenizer, vocab)
        pad = pad_id(tokenizer)
        for ds in (train, val):
            if ds is not None:
                ds.score_pad = pad
                log.info(ds.describe())
        log.info(f"reward: each sequence scored at its last token other than id {pad} (the padding id)")
        return train, val

    def attach(self, run: Runtime) -> None:
        super().attach(run)   # a Hugging Face model's own dropout off (reward.disable_dropout); no reference

    def loss(self, forward, batch: dict, scale: float) -> Part:
        out = forward(batch["x"], score_at=batch["score_at"])
        chosen, rejected = out.logits.float().chunk(2)
        per_pair = reward_loss(chosen, rejected, self.center)
        stats = torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                             (chosen > rejected).sum()]).detach().float()
        return Part(per_pair.sum() * scale, out.aux_loss, stats * scale, out.stats)

    def eval_line(self, res: dict) -> str:
        return (f"val loss {res['val_loss']:.4f} (reward), accuracy {res['val_reward_accuracy']:.3f}, margin "
                f"{res['val_reward_margin']:.4f} over {res['val_pairs']} pairs")
