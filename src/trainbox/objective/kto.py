"""KTO (dpo.loss=kto): preference tuning on unpaired examples, each completion judged desirable or not (Ethayarajh et
al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"; TRL's KTOTrainer).

    trainbox train dpo dpo.loss=kto model.path=FOLDER data.path=feedback.jsonl      # {"prompt", "completion", "label"}
    trainbox train dpo dpo.loss=kto model.path=FOLDER data.path=prefs.jsonl         # pairs: 2 examples each

dpo.loss=apo_zero_unpaired (TRL's KTO option) is the same loss without z: no mismatched forward.

An example's reward is beta x its log-ratio (policy over reference, summed over the completion's trained tokens);
its loss compares that log-ratio with z, the policy's KL divergence from the reference, estimated from mismatched
prompts and completions (each example's prompt with another example's completion: data/pairs.py UnpairedDataset):

    z = max(0, mean over the step's examples of (policy - reference log-probability of the mismatched sequence))

computed once a step over the whole global batch, before its micro-batches, without gradients (as the paper and TRL
detach it) and summed over the ranks: a step's z, and so its loss, is the same on any number of processes and
micro-batches. TRL estimates z within each micro-batch instead; with one micro-batch on one process the two are
the same, which tests/test_kto.py holds against TRL's own loss. The reference is the dpo section's (precompute:
both sequences of every example computed once and stored; model: a frozen copy; LoRA: the base), as for pairs.

Logged (means over the step's desirable or undesirable examples, as TRL's rewards/chosen and rewards/rejected):
reward_chosen, reward_rejected, reward_margin, logp_chosen, logp_rejected, kl (z), desirable (their share of the
step). Validation: val_loss, val_reward_margin, val_reward_chosen, val_reward_rejected and val_kl, z estimated over
the validation slice.
"""
from __future__ import annotations

import logging

import torch

from trainbox.kernels.fused_ce import trained_rows
from trainbox.objective.base import Part
from trainbox.objective.losses import kto
from trainbox.objective.preference import Preference, sequence_logps

log = logging.getLogger("trainbox")

SUMS = ("reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected", "chosen", "rejected", "kl")


def mismatched(batch: dict) -> dict:
    """The KL estimate's sequences of an example batch, as a batch of their own."""
    return {"x": batch["kl_x"], "y": batch["kl_y"], "loss_mask": batch["kl_loss_mask"]}


class Kto(Preference):
    name = "kto"
    sequences = 1   # the examples' own sequences carry gradients; the mismatched ones run without (before_step)
    stat_names = SUMS
    eval_keys = ("val_loss", "val_reward_margin", "val_kl")
    val_stats = ("reward_margin", "reward_chosen", "reward_rejected", "kl")

    def __init__(self, cfg, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(cfg, device, dtype)
        self.kl = torch.zeros((), device=self.device)   # the step's z, set by before_step
        self.uses_kl = cfg.dpo.loss == "kto"            # apo_zero_unpaired has none

    def open_datasets(self, cfg, tokenizer, vocab: int):
        train, val = super().open_datasets(cfg, tokenizer, vocab)
        d, u = train.desirable, train.num_samples - train.desirable
        wd, wu = self.dpo.desirable_weight, self.dpo.undesirable_weight
        ratio = wd * d / max(wu * u, 1e-9)
        if not 1 <= ratio <= 4 / 3 + 1e-9:   # the paper's eq. 8 and advice, as TRL warns
            log.info(f"warning: kto: {d:,} desirable and {u:,} undesirable examples weigh {ratio:.2f} to 1 at "
                     f"dpo.desirable_weight={wd:g}, dpo.undesirable_weight={wu:g}; the paper advises 1 to 4/3: e.g. "
                     f"dpo.undesirable_weight={wd * d / u:.3g}" if d and u else
                     f"warning: kto: every training example is {'desirable' if d else 'undesirable'}; the loss then "
                     "only moves the rewards against the KL estimate")
        return train, val

    def _both(self, reference):
        return lambda batch: torch.cat([reference(batch), reference(mismatched(batch))])

    @torch.no_grad()
    def before_step(self, forward, batches: list[dict], rows: list[int] | None = None) -> None:
        """z over every example of the step on every rank: the policy's and the reference's log-probabilities of
        the mismatched sequences (the reference's from the batch where precomputed)."""
        if not self.uses_kl:
            return
        sums = torch.zeros(2, device=self.device)   # sum of log-ratios, examples
        for k, b in enumerate(batches):
            seqs = mismatched(b)
            B = len(b["label"])
            with trained_rows(*b.get("kl_rows", (None, 0))):
                policy = sequence_logps(forward, seqs)[0]
                ref = b["ref_logps"][B:] if "ref_logps" in b else self.reference_forward(seqs)
            n = B if rows is None else rows[k]
            sums += torch.stack([(policy - ref.float())[:n].sum(), policy.new_tensor(float(n))])
        if self.dist is not None:
            self.dist.all_reduce_sum(sums)
        self.kl = (sums[0] / sums[1].clamp(min=1)).clamp(min=0)

    def loss(self, forward, batch: dict, scale: float) -> Part:
        label = batch["label"]
        B = len(label)
        ref = batch.get("ref_logps")
        ref = ref[:B] if ref is not None else self.reference_forward(batch)   # first: its transients go first
        logps, _, out = sequence_logps(forward, batch)
        per, reward = kto(logps, ref, label, self.kl if self.uses_kl else None, self.dpo.beta,
                          self.dpo.desirable_weight, self.dpo.undesirable_weight)
        good = label.float()
        bad = 1 - good
        stats = torch.stack([(reward * good).sum(), (reward * bad).sum(), (logps * good).sum(), (logps * bad).sum(),
                             good.sum(), bad.sum(), self.kl * B]).detach().float()
        return Part(per.sum() * scale, out.aux_loss, stats * scale, out.stats)

    def step_stats(self, values: dict) -> dict:
        """Means over the desirable and the undesirable examples (left out where a step has none)."""
        good, bad = values["chosen"], values["rejected"]
        out = {"desirable": good / max(good + bad, 1e-12), **({"kl": values["kl"]} if self.uses_kl else {})}
        for side, n in (("chosen", good), ("rejected", bad)):
            if n > 0:
                out[f"reward_{side}"] = values[f"reward_{side}"] / n
                out[f"logp_{side}"] = values[f"logp_{side}"] / n
        if good > 0 and bad > 0:
            out["reward_margin"] = out["reward_chosen"] - out["reward_rejected"]
        return out

    def eval_line(self, res: dict) -> str:
        parts = [f"val loss {res['val_loss']:.4f} ({self.dpo.loss})"]
        parts += [f"{name} {res[key]:.4f}" for name, key in (("reward margin", "val_reward_margin"), ("kl", "val_kl"))
                  if res.get(key) is not None]
        return ", ".join(parts) + f" over {res['val_examples']} examples"
