"""The grpo section of a run's config: online reinforcement learning from rewards (objective/grpo.py reads it;
RunConfig checks where it applies)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainbox.config.limits import MAX_POSITIONS
from trainbox.section import Section


class GrpoSection(Section):
    """Group Relative Policy Optimization (train.objective=grpo): completions sampled from the policy, scored by the
    reward functions, each trained on its advantage over its group."""

    rewards: list[str] = Field(
        default_factory=list, description="the reward functions, each 'module:function' (an importable module), "
                                          "'path/to/file.py:function', or the directory of a reward model trained "
                                          "here (a `trainbox train reward` run or checkpoint). A function takes "
                                          "prompts, completions (text; for message prompts, [{'role': "
                                          "'assistant', 'content': text}]), completion_ids and every other field of "
                                          "the prompt rows as keyword lists, one item a completion, and returns one "
                                          "float (or None: not scored) a completion, as TRL's GRPOTrainer calls them")
    reward_weights: list[float] | None = Field(None, description="one weight a reward function (default: 1 each); "
                                                                 "a completion's reward is the weighted sum")
    num_generations: int = Field(8, ge=2, le=1024, description="completions sampled for each prompt (the group whose "
                                                               "mean reward is each one's baseline)")
    max_completion_len: int = Field(256, ge=1, le=MAX_POSITIONS, description="tokens a completion may have; a prompt "
                                                                            "keeps its last data.seq_len - this many")
    temperature: float = Field(1.0, gt=0, le=100, description="the sampling temperature; the log-probabilities "
                                                             "trained are those of the logits divided by it, as TRL "
                                                             "computes them")
    generation_batch_size: int | None = Field(None, ge=1, description="completions sampled together on a process "
                                                                    "(one forward a token for all of them; their "
                                                                    "KV caches are held together); default: all of "
                                                                    "its step's, as TRL's generation_batch_size")
    sampling_copy: bool = Field(True, description="sample through a copy of the linear layers' weights in the "
                                                  "compute dtype, made at each sampling: LoRA's adapters merged into "
                                                  "it, a 4- or 8-bit base dequantized, fp32 weights cast once, so a "
                                                  "token step runs one matmul a layer (as TRL's vLLM holds its own "
                                                  "bf16 weights). It holds 2 bytes a weight (bf16) while sampling, "
                                                  "which `trainbox plan` counts; false: sample through the model's "
                                                  "own weights")
    compile_sampling: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the sampling's token step (the decoder's forward for one token; Inductor "
                            "fuses its norms, rotations, casts and residual adds, which otherwise run as a thousand "
                            "small kernels a token); its caches' length rounded up to a multiple of 128 so that "
                            "prompts of other lengths reuse the compiled step. auto: where train.compile is on")
    top_k: int | None = Field(None, ge=1, description="sample from the k likeliest tokens (default: all)")
    top_p: float | None = Field(None, gt=0, le=1, description="sample from the nucleus of this probability mass "
                                                             "(default: all)")
    beta: float = Field(0.0, ge=0, le=100, description="the weight of the KL divergence from the reference (the "
                                                      "initial model; LoRA: the base) added to every token's loss, "
                                                      "estimated as exp(ref - logp) - (ref - logp) - 1 times the "
                                                      "importance ratio (its gradient the unbiased one, as TRL's "
                                                      "use_bias_correction_kl); 0: no reference is kept (TRL's "
                                                      "default)")
    loss: Literal["dapo", "grpo", "dr_grpo", "cispo", "sapo"] = Field(
        "dapo", description="a token's loss and how they make a step's. dapo: the clipped surrogate, the mean over "
                            "every completion token of the step (Yu et al. 2025; TRL's default); grpo: each "
                            "completion's token mean, then the mean over completions (Shao et al. 2024); dr_grpo: "
                            "their sum over completions x max_completion_len (Liu et al. 2025); cispo: the importance "
                            "weight, capped at grpo.epsilon_high and not trained through, times the advantage and the "
                            "log-probability, as dapo's mean (MiniMax-M1, ScaleRL); sapo: a soft gate, sigmoid(tau x "
                            "(ratio - 1)) x 4 / tau in place of the clipped ratio (tau: grpo.sapo_temperature_pos "
                            "or _neg by the advantage's sign), as grpo's mean (Gao et al. 2025); each as TRL's "
                            "loss_type of that name")
    sapo_temperature_pos: float = Field(1.0, gt=0, le=100, description="grpo.loss=sapo: the gate's temperature for "
                                                                      "a positive advantage")
    sapo_temperature_neg: float = Field(1.05, gt=0, le=100, description="grpo.loss=sapo: the gate's temperature for "
                                                                       "an advantage of 0 or less")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="the importance ratio pi / pi_old a token trains with. token: its own (GRPO); sequence: "
                             "the geometric mean of its completion's token ratios, one for all its tokens (GSPO, "
                             "Zheng et al. 2025), as TRL's option of this name. At one update a generation the "
                             "ratio is 1 in value and the advantage's gradient is the same at both levels; they "
                             "differ in the KL term's correction (beta > 0)")
    num_iterations: int = Field(1, ge=1, le=1024, description="optimizer steps on each generation (mu, TRL's "
                                                              "num_iterations): the step's prompts and completions "
                                                              "train this many steps in a row, each token's ratio "
                                                              "pi / pi_old taken against its log-probability at the "
                                                              "first and clipped (grpo.epsilon); an epoch takes this "
                                                              "many times the steps")
    epsilon: float = Field(0.2, ge=0, lt=1, description="the clip of the importance ratio below: a token's ratio "
                                                       "counts down to 1 - epsilon for a negative advantage (binds "
                                                       "only where grpo.num_iterations > 1)")
    epsilon_high: float | None = Field(None, ge=0, le=100, description="the clip above: up to 1 + epsilon_high for a "
                                                                      "positive advantage (default: grpo.epsilon; "
                                                                      "DAPO's clip-higher: 0.28); grpo.loss=cispo: "
                                                                      "the cap of the importance weight itself")
    delta: float | None = Field(None, gt=1, le=100, description="two-sided clipping (INTELLECT-2, TRL's delta): the "
                                                               "unclipped ratio is capped at delta too (default: "
                                                               "none)")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="an advantage is the reward minus its group's mean, divided by group: the group's "
                             "standard deviation; batch: the step's; none: nothing (Dr. GRPO)")
    mask_truncated_completions: bool = Field(False, description="completions cut at max_completion_len (no end of "
                                                                "text drawn) train no token (DAPO's advice)")

    @model_validator(mode="after")
    def _weights_match(self) -> "GrpoSection":
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"grpo.reward_weights has {len(self.reward_weights)} weight(s) for "
                             f"{len(self.rewards)} reward function(s) in grpo.rewards: give one each")
        if self.loss == "cispo" and self.epsilon_high is None:   # TRL would cap the weight at epsilon, 0.2
            raise ValueError("grpo.loss=cispo caps each token's importance weight at grpo.epsilon_high, which has no "
                             "default here: set it (ScaleRL's choice: grpo.epsilon_high=5.0)")
        return self
