"""The dpo and reward sections of a run's config: preference tuning's loss, its strengths, the reference and the
prompt budget (objective/preference.py and objective/kto.py read it; RunConfig checks which keys apply to which
loss), and reward modeling's (objective/reward.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainbox.config.limits import MAX_POSITIONS
from trainbox.section import Section

UNPAIRED_LOSSES = ("kto", "apo_zero_unpaired")   # dpo.loss on unpaired examples (objective/kto.py)


def prompt_budget():
    """max_prompt_len of the dpo and reward sections: the truncation rule of their pairs (data/preference.py fit)."""
    return Field(None, ge=1, le=MAX_POSITIONS, description="a pair longer than data.seq_len loses the start of its "
                                                           "prompt down to this many tokens, then the ends of its "
                                                           "responses (default: half of data.seq_len)")


class DpoSection(Section):
    """Preference tuning (train.objective=dpo): the loss, its strengths, the reference and the prompt budget."""

    loss: Literal["dpo", "ipo", "simpo", "orpo", "kto", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair",
                  "sppo_hard", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "apo_zero_unpaired"] = Field(
        "dpo", description="dpo: -log sigmoid(beta x the log-ratio margin against the reference) (Rafailov et al. "
                           "2023; TRL's sigmoid loss); ipo: (margin of the per-token log-ratios - 1/(2 beta))^2 (Azar "
                           "et al. 2023, length-normalised as TRL); simpo: reference-free, -log sigmoid(beta x the "
                           "margin of the mean token log-probs - simpo_gamma) (Meng et al. 2024); orpo: "
                           "reference-free, the chosen response's mean token loss + orpo_lambda x -log sigmoid(log "
                           "odds ratio) (Hong et al. 2024); kto: unpaired examples, each desirable or not, "
                           "weight x (1 - sigmoid(beta x (its log-ratio - KL))) for a desirable one and (1 - sigmoid("
                           "beta x (KL - its log-ratio))) for an undesirable one, KL estimated over the step's "
                           "mismatched prompts and completions (Ethayarajh et al. 2024; TRL's KTOTrainer); "
                           "apo_zero_unpaired: kto's examples without the KL term (TRL's KTO option). TRL's "
                           "DPOTrainer loss types by its names: hinge, robust, exo_pair, nca_pair, bco_pair, "
                           "sppo_hard, apo_zero, apo_down, discopop, sigmoid_norm (objective/losses.py)")
    beta: float = Field(0.1, gt=0, le=100, description="dpo, kto: the strength of the reference (0.1 to 0.5 usual); "
                                                      "ipo: tau; simpo: the reward scale (2 to 2.5 in its paper)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo, simpo, robust, exo_pair: the probability "
                                                                  "that a pair's labels are flipped (conservative "
                                                                  "DPO; exo_pair needs more than 0: 1e-3 in its "
                                                                  "paper)")
    discopop_tau: float = Field(0.05, gt=0, le=100, description="discopop: the temperature of its mix of the "
                                                               "logistic and the exponential loss")
    simpo_gamma: float = Field(0.5, ge=0, le=100, description="simpo: the target margin between the chosen and the "
                                                             "rejected reward")
    orpo_lambda: float = Field(0.1, gt=0, le=100, description="orpo: the weight of the odds-ratio term beside the "
                                                             "chosen response's token loss")
    desirable_weight: float = Field(1.0, gt=0, le=100, description="kto: the weight of a desirable example's loss "
                                                                  "(lambda_D)")
    undesirable_weight: float = Field(1.0, gt=0, le=100, description="kto: the weight of an undesirable example's "
                                                                    "loss (lambda_U); the paper advises lambda_D n_D "
                                                                    "/ (lambda_U n_U) between 1 and 4/3, which the "
                                                                    "run's log checks against the data")
    reference: Literal["precompute", "model"] = Field(
        "precompute", description="dpo, ipo, kto: where the reference log-probabilities come from. precompute: the "
                                  "initial model's, computed once before training and stored beside the prepared "
                                  "data (reused by later runs and resumes of the same weights and data); model: a "
                                  "frozen copy of the initial model run beside the policy every step. LoRA "
                                  "(model.family=hf): the base with its adapters switched off, no copy")
    disable_dropout: bool = Field(
        True, description="train the policy without dropout (model.dropout and lora.dropout resolve to 0), as TRL's "
                          "DPOConfig does by default: the reference's log-probabilities are taken without it, and "
                          "dropout in the policy alone adds noise to every log-ratio")
    max_prompt_len: int | None = prompt_budget()


class RewardSection(Section):
    """Reward modeling (train.objective=reward): a score head on the model, trained on preference pairs."""

    center_coefficient: float | None = Field(
        None, ge=0, le=100, description="the weight of the mean squared sum of a pair's two rewards added to the "
                                        "loss, which keeps the rewards centred on 0 (TRL's "
                                        "center_rewards_coefficient; 0.01 in Eisenstein et al. 2023); none: no term")
    max_prompt_len: int | None = prompt_budget()
    disable_dropout: bool = Field(
        True, description="train without dropout (model.dropout and lora.dropout resolve to 0, and a Hugging Face "
                          "model's own dropout is off), as TRL's RewardConfig does by default")
