"""Group Relative Policy Optimization (train.objective=grpo): online reinforcement learning from reward functions
(Shao et al. 2024, DeepSeekMath; TRL's GRPOTrainer).

    trainbox train grpo model.path=FOLDER data.path=prompts.jsonl grpo.rewards=[rewards.py:correct]
    trainbox train grpo model.family=hf model.path=FOLDER data.path=prompts.jsonl grpo.rewards=[...]   # LoRA

A step takes train.global_batch_size prompts (data/prompts.py) and, before its micro-batches, samples
grpo.num_generations completions of each from the model as it stands (generate.py `rollout`: every completion of the
process's step at once, or grpo.generation_batch_size of them, through the KV caches, in eval mode and the
autocast), up to grpo.max_completion_len tokens or an end (end of text, or the chat template's end of turn, which
the completion keeps). A completion's draws depend on (run.seed, the step, the prompt's index, its number in the
group) alone, so a step samples the same completions on any number of processes, in any batch and after a resume.
Under train.parallel=fsdp every unit is gathered for the sampling (the strategy's `whole`) and the model decodes
through the family's `rollout_model`, which runs none of FSDP's hooks: each process samples its own rows alone.
With grpo.sampling_copy the decoder reads a copy of the linear layers' weights in the compute dtype, LoRA's
adapters merged and a quantized base dequantized, made at each sampling (the family's `sampling_model`); the
log-probabilities trained are the training forward's own, so the copy changes which tokens are drawn only by its
rounding.

Rewards: each function of grpo.rewards scores the rank's completions of the step in one go (TRL's signature:
prompts, completions, completion_ids and the rows' other fields as keyword lists); an entry that is a directory is a
reward model trained here (`trainbox train reward`; objective/rewards.py), which scores a completion as it scored
responses. A completion's reward is the weighted sum of its scores (None: not scored, left out; a completion no
function scores has no reward and trains with advantage 0). Its advantage is its reward minus its group's mean
reward, divided by the group's standard deviation (grpo.scale_rewards=group, + 1e-4), the step's (batch) or nothing
(none); a group's completions are sampled, scored and trained on one process.

Generations: each step's completions are trained on for grpo.num_iterations optimizer steps in a row (TRL's
num_iterations; the data order repeats each global batch that many times, so an epoch takes that many times the
steps); they are sampled at the first of them, which keeps each token's log-probability (pi_old) as its forward
computes it. A checkpoint in the middle of a generation holds it (objective.pt: every rank's completions, scores,
advantages and pi_old), so a resume continues it exactly, on any number of processes.

Loss: the clipped surrogate a token, -min(ratio x A, clip(ratio, 1 - grpo.epsilon, 1 + grpo.epsilon_high) x A),
ratio = exp(logp - pi_old): at the first step of a generation pi_old is logp.detach(), the ratio 1 in value and the
gradient -A x grad logp; at the later ones the clip binds where the policy has moved (grpo.delta also caps the
unclipped ratio). grpo.importance_sampling_level=sequence (GSPO) takes the ratio of a completion's mean
log-probability, the same for each of its tokens. logp is the token's log-probability at grpo.temperature (the
logits divided by it, as sampled). With grpo.beta > 0, beta x k3 x ratio is added a token, k3 = exp(ref - logp) -
(ref - logp) - 1 the estimate of the KL divergence from the reference (ref its log-probability: a frozen copy of the
initial model; LoRA: the base with its adapters off), times the ratio so that its gradient is the unbiased one of
the reverse KL (DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default). The tokens trained are the
completion's (its end included); grpo.loss makes them a step's loss: dapo, the mean over every completion token of
the step (counted over the ranks); grpo, each completion's mean, then the mean over the step's completions; dr_grpo,
the sum over the step's completions x grpo.max_completion_len. Two losses change the token's term too, as TRL's of
their names: cispo, -min(ratio, grpo.epsilon_high) x A x logp with the weight held constant (MiniMax-M1), as dapo's
mean; sapo, -sigmoid(tau (ratio - 1)) x 4 / tau x A, a soft gate in place of the clip (tau by the advantage's sign),
as grpo's mean.

Logged with the loss: reward (the mean over scored completions), reward_std (the mean of the groups' standard
deviations), zero_std (the share of groups whose completions all scored the same: no signal), completion_len,
truncated (the share cut at max_completion_len), sample_s (the seconds a process spent sampling the step's
completions, a mean over the processes; 0 at the later steps of a generation), reward_NAME for each function, kl
where beta > 0 (its mean over the step's trained tokens), clipped where grpo.num_iterations > 1 (the share of the
step's trained tokens whose clipped term is taken). Validation
(data.val_path): one completion for each of up to train.eval_tokens / data.seq_len prompts, drawn with seeds fixed
by the prompt, so evaluations compare: val_reward, val_completion_len.
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext

import torch

from trainbox.data.chat import template_for, token_of
from trainbox.data.prompts import PromptDataset, open_prompt_datasets
from trainbox.data.tokenizer import pad_id
from trainbox.errors import ConfigError
from trainbox.generate import rollout
from trainbox.kernels.fused_ce import host_trained_rows
from trainbox.model.spec import family
from trainbox.objective.base import Objective, Part, Runtime
from trainbox.objective.generation import (
    Generation,
    Row,
    group_advantages,
    old_logps,
    row_seed,
    training_rows,
)
from trainbox.objective.preference import eval_mode
from trainbox.objective.rewards import load_reward, reward_names, score

log = logging.getLogger("trainbox")

ROW_STATS = ("completions", "scored", "reward", "reward_std", "zero_std", "completion_len", "truncated", "sample_s")


class Grpo(Objective):
    name = "grpo"
    unit = "prompts"
    eval_keys = ("val_reward", "val_completion_len")

    def __init__(self, cfg, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.cfg, self.g = cfg, cfg.grpo
        self.device, self.dtype = device or torch.device("cpu"), dtype or torch.float32
        self.sequences = self.g.num_generations
        if not self.g.rewards:
            raise ConfigError("train.objective=grpo needs at least one reward function",
                              hint="grpo.rewards=[module:function] or grpo.rewards=[path/to/file.py:function]")
        self.functions = [load_reward(s, self.device, cfg.train.micro_batch_size * self.g.num_generations)
                          for s in self.g.rewards]
        self.names = reward_names(self.g.rewards)
        self._warned_unscored = False
        self.weights = torch.tensor(self.g.reward_weights or [1.0] * len(self.functions), dtype=torch.float64)
        self.stat_names = ROW_STATS + ("tokens", "kl", "clipped") + tuple(f"{k}_{n}" for n in self.names
                                                                         for k in ("reward", "scored"))
        self.adapters = family(cfg.model.family).adapters
        self.run: Runtime | None = None
        self.stop: frozenset[int] = frozenset()
        self.pad = 0
        self._denominator: tuple[int, int] | None = None   # (step, the step's count its loss is a mean over)
        self.generation: Generation | None = None   # the completions the current steps train on

    @classmethod
    def repeats(cls, cfg) -> int:
        return cfg.grpo.num_iterations

    @classmethod
    def rollout_shape(cls, cfg, world: int) -> tuple[int, int, int, bool]:
        """A process's completions of a step, or grpo.generation_batch_size of them; prompts of at most data.seq_len
        - grpo.max_completion_len tokens, caches of data.seq_len positions; the weights' copy of grpo.sampling_copy."""
        rows = -(-cfg.train.global_batch_size // world) * cfg.grpo.num_generations
        together = min(cfg.grpo.generation_batch_size or rows, rows)
        return together, cfg.data.seq_len - cfg.grpo.max_completion_len, cfg.data.seq_len, cfg.grpo.sampling_copy

    @classmethod
    def sequences_of(cls, cfg) -> int:
        return cfg.grpo.num_generations

    @classmethod
    def frozen_copy(cls, cfg) -> bool:
        return cfg.grpo.beta > 0 and not family(cfg.model.family).adapters

    def needs_initial_weights(self, cfg) -> bool:
        return self.frozen_copy(cfg)

    @classmethod
    def resolve(cls, cfg):
        """No end-of-run sample (train.sample_tokens resolves to 0): the prompts' completions are the samples."""
        if not cfg.train.sample_tokens:
            return cfg
        return cfg.model_copy(update={"train": cfg.train.model_copy(update={"sample_tokens": 0})})

    # ------------------------------------------------------------------ data
    def open_datasets(self, cfg, tokenizer, vocab: int):
        train, val = open_prompt_datasets(cfg.data, self.g, tokenizer)
        for ds in (train, val):
            if ds is not None:
                log.info(ds.describe())
        ends = {tokenizer.eot_id}
        if any(train.chat):
            end = token_of(tokenizer, template_for(tokenizer, cfg.data.chat_template).end_mark)
            ends |= {end} if end is not None else set()
        self.stop, self.pad = frozenset(ends), pad_id(tokenizer)
        log.info(f"grpo: {self.g.num_generations} completions a prompt, up to {self.g.max_completion_len} tokens, "
                 f"ending at id {' or '.join(map(str, sorted(ends)))}; rewards: {', '.join(self.g.rewards)}")
        return train, val

    def attach(self, run: Runtime) -> None:
        self.run = run
        g = self.g   # the token step compiled where asked, or (auto) where the run compiles its training forward
        self.compiled_sampling = g.compile_sampling is True or (g.compile_sampling == "auto"
                                                                and run.cfg.train.compile is True)

    def denominator(self, batches, step: int) -> int:
        assert self._denominator is not None and self._denominator[0] == step, "step_batches runs first"
        return self._denominator[1]

    # ------------------------------------------------------------------ sampling and scoring
    def _sample(self, ds: PromptDataset, indices: list[int], seeds: list[int]) -> list[list[int]]:
        """The completions of prompts `indices`, one a seed, by the model as it stands (eval mode, no gradients)."""
        run, g = self.run, self.g
        with eval_mode(run.model), run.autocast():
            return rollout(run.model, [ds.ids[i] for i in indices], seeds, g.max_completion_len,
                           run.tokenizer.vocab_size, self.stop, g.temperature, g.top_k, g.top_p, self.pad,
                           copy_weights=g.sampling_copy, compiled=self.compiled_sampling)

    def _score(self, ds: PromptDataset, indices: list[int], completions: list[list[int]]) -> torch.Tensor:
        """(N, functions) float64 scores of each completion (NaN: not scored) by each reward function."""
        tok = self.run.tokenizer
        texts = [tok.decode(c[:-1] if c and c[-1] in self.stop else c) for c in completions]
        prompts = [ds.rows[i]["prompt"] for i in indices]
        chat = [ds.chat[i] for i in indices]
        shown = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        with self.run.autocast():   # a reward model runs in the run's autocast
            return score(self.functions, self.g.rewards, len(indices), prompts=prompts, completions=shown,
                         completion_ids=completions, **ds.columns(indices))

    def _rewards(self, scores: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each completion's scores, NaN where no function scored it."""
        total = (scores.nan_to_num(0.0) * self.weights).sum(1)
        return torch.where(scores.isnan().all(1), float("nan"), total)

    def _batch_std(self, rewards: torch.Tensor) -> float:
        """The sample standard deviation of the step's scored rewards over every rank (grpo.scale_rewards=batch)."""
        ok = rewards[~rewards.isnan()]
        sums = torch.tensor([ok.sum(), (ok ** 2).sum(), len(ok)], dtype=torch.float64, device=self.run.device)
        s, q, n = self.run.dist.all_reduce_sum(sums).tolist()
        return math.sqrt(max(q - s * s / n, 0.0) / (n - 1)) if n > 1 else 0.0

    def _generate(self, ds: PromptDataset, step: int, keys: list[tuple[int, int]]) -> Generation:
        """The completions of `keys` (prompt index, number in its group; groups of num_generations in a row),
        sampled by the model as it stands at `step`, scored, with their advantages."""
        run, g, G = self.run, self.g, self.g.num_generations
        indices = [i for i, _ in keys]
        seeds = [row_seed(run.cfg.run.seed, step, i, j) for i, j in keys]
        together = g.generation_batch_size or len(indices)
        start = time.perf_counter()
        with run.whole():
            completions = [c for k in range(0, len(indices), together)
                           for c in self._sample(ds, indices[k:k + together], seeds[k:k + together])]
        seconds = time.perf_counter() - start   # the completions are on the host: the sampling has finished
        scores = self._score(ds, indices, completions)
        rewards = self._rewards(scores)
        batch_std = self._batch_std(rewards) if g.scale_rewards == "batch" else None
        adv, std = group_advantages(rewards, G, g.scale_rewards, batch_std)
        rows = {k: Row(c, scores[n], float(rewards[n]), float(adv[n]), float(std[n]),
                       not (c and c[-1] in self.stop))
                for n, (k, c) in enumerate(zip(keys, completions))}
        return Generation(step // g.num_iterations, rows, seconds)

    def step_batches(self, step: int, batches: list[dict]) -> list[dict]:
        """The step's completions as training rows in place of its prompts' indices: sampled and scored at the first
        step of a generation, the same at its other grpo.num_iterations - 1 steps (with their pi_old)."""
        run, g, G = self.run, self.g, self.g.num_generations
        ds: PromptDataset = run.train
        keys = [[(int(i), j) for i in b["prompt_index"].tolist() for j in range(G)] for b in batches]
        gen = self.generation
        fresh = gen is None or gen.index != step // g.num_iterations or \
            any(k not in gen.rows for part in keys for k in part)
        if fresh:
            if step % g.num_iterations:   # a resume from a checkpoint without its generation (never written so)
                log.warning(f"grpo: step {step + 1} is in the middle of a generation the checkpoint does not hold: "
                            "it samples the step's completions anew")
            gen = self.generation = self._generate(ds, step, [k for part in keys for k in part])
            if g.num_iterations > 1:   # the first step's forwards keep each micro-batch's log-probabilities
                gen.parts = (keys, [None] * len(keys))
        else:   # the data order repeats the batch: the same micro-batches, whose first forwards kept pi_old
            assert gen.parts is None or gen.parts[0] == keys, "a generation's micro-batches changed"
        out = []
        for part in keys:
            rows = [gen.rows[k] for k in part]
            prompts = [ds.ids[i] for i, _ in part]
            b = self.micro_batch(prompts, [r.completion for r in rows],
                                 torch.tensor([r.advantage for r in rows]), torch.tensor([r.truncated for r in rows]))
            if not fresh and gen.parts is None:
                b["old_logps"] = old_logps(prompts, rows, b["x"].shape)
            r = torch.tensor([row.reward for row in rows], dtype=torch.float64)
            s = torch.stack([row.scores for row in rows])
            std = torch.tensor([row.std for row in rows], dtype=torch.float64)
            group_std = std.view(-1, G)[:, 0]
            b["row_stats"] = torch.tensor(
                [len(rows), (~r.isnan()).sum(), r.nan_to_num(0.0).sum(), std.nansum(),
                 (group_std.nan_to_num(0.0) == 0).sum() * G, sum(len(row.completion) for row in rows),
                 sum(row.truncated for row in rows), gen.seconds if fresh and not out else 0.0]
                + [v for k in range(s.size(1)) for v in (s[:, k].nan_to_num(0.0).sum(), (~s[:, k].isnan()).sum())],
                dtype=torch.float32)
            out.append(b)
        tokens = torch.tensor([float(sum(b["loss_mask"].sum() for b in out))], dtype=torch.float64,
                              device=run.device)
        tokens = int(run.dist.all_reduce_sum(tokens).item())
        global_rows = run.cfg.train.global_batch_size * G
        self._denominator = (step, {"dapo": tokens, "cispo": tokens, "grpo": global_rows, "sapo": global_rows,
                                    "dr_grpo": global_rows * g.max_completion_len}[g.loss])
        sent = []
        for n, b in enumerate(out):
            b["token_count"] = torch.tensor(float(tokens))
            rows_of = host_trained_rows(b["y"], b["loss_mask"])
            d = {k: v.to(run.device, non_blocking=True) for k, v in b.items()}
            d["rows"] = (rows_of.to(run.device), b["y"].numel())
            if gen.parts is not None:
                d["part"] = n
                if not fresh:
                    d["old_logps"] = gen.parts[1][n]
            sent.append(d)
        return sent

    def state(self, step: int):
        """In the middle of a generation (the next step reuses it): this rank's rows, with their pi_old."""
        gen = self.generation
        if gen is None or step % self.g.num_iterations == 0 or gen.index != step // self.g.num_iterations:
            return None
        return gen.state([len(self.run.train.ids[i]) for i, _ in gen.rows])

    def load_state(self, states: list) -> None:
        """Every rank's rows of the generation saved, whichever rank trains each now."""
        self.generation = Generation.merged(states) or self.generation

    def micro_batch(self, prompts: list[list[int]], completions: list[list[int]], advantages: torch.Tensor,
                    truncated: torch.Tensor) -> dict[str, torch.Tensor]:
        """Training rows of completions (on the host): training_rows, with each row's advantage and the weight of
        its tokens in the step's loss (grpo.loss=grpo or sapo: 1 / its trained tokens; else 1)."""
        b = training_rows(prompts, completions, self.cfg.data.seq_len, self.pad)
        if self.g.mask_truncated_completions:
            b["loss_mask"] &= ~truncated[:, None]
        n = b["loss_mask"].sum(1)
        weight = 1.0 / n.clamp(min=1) if self.g.loss in ("grpo", "sapo") else torch.ones(len(n))
        b["weight"] = (weight * (n > 0)).float()
        b["advantages"] = advantages.float()
        return b

    # ------------------------------------------------------------------ the loss
    def _token_logps(self, forward, b: dict) -> tuple[torch.Tensor, object]:
        temp = {"temperature": self.g.temperature} if self.g.temperature != 1 else {}
        out = forward(b["x"], b["y"], loss_mask=b["loss_mask"], reduction="none", **temp)
        return -out.loss.float(), out

    @torch.no_grad()
    def _reference_logps(self, b: dict) -> torch.Tensor:
        run = self.run
        model = run.reference if run.reference is not None else run.model
        with eval_mode(model), (model.adapters_off() if self.adapters else nullcontext()):
            return self._token_logps(model, b)[0]

    def loss(self, forward, b: dict, scale: float) -> Part:
        g = self.g
        ref = self._reference_logps(b) if g.beta > 0 else None   # first: its transients go first
        logp, out = self._token_logps(forward, b)
        old = b.get("old_logps")
        if old is None and "part" in b:   # the generation's first step: pi_old for its later ones
            self.generation.parts[1][b["part"]] = logp.detach()
        mask = b["loss_mask"].float() * b["weight"][:, None]
        log_ratio = logp - (logp.detach() if old is None else old)   # first step: 0, with the gradient of logp
        if g.importance_sampling_level == "sequence":   # GSPO: the completion's mean, for each of its tokens
            trained = b["loss_mask"].float()
            log_ratio = ((log_ratio * trained).sum(1) / trained.sum(1).clamp(min=1))[:, None]
        ratio = torch.exp(log_ratio)
        adv = b["advantages"][:, None]
        low, high = 1 - g.epsilon, 1 + (g.epsilon if g.epsilon_high is None else g.epsilon_high)
        if g.loss == "cispo":   # the weight capped, held constant: the gradient goes through logp alone
            per_token = -ratio.clamp(max=g.epsilon_high).detach() * adv * logp
            low, high = 0.0, g.epsilon_high   # `clipped`: the weights capped (none below)
        elif g.loss == "sapo":   # a soft gate of slope 1 at ratio 1, by the advantage's sign
            tau = torch.where(adv > 0, g.sapo_temperature_pos, g.sapo_temperature_neg)
            per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
            low, high = -math.inf, math.inf   # nothing clipped
        else:
            capped = ratio if g.delta is None else ratio.clamp(max=g.delta)
            per_token = -torch.minimum(capped * adv, ratio.clamp(low, high) * adv)
        kl = None
        if ref is not None:
            d = ref - logp
            kl = torch.exp(d) - d - 1
            per_token = per_token + g.beta * kl * ratio
        world = self.run.dist.world
        kl_sum = (kl.detach() * b["loss_mask"]).sum() if kl is not None else torch.zeros((), device=logp.device)
        with torch.no_grad():   # tokens whose clipped term is taken (their gradient is 0)
            clipped = (((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))).expand_as(logp)
            clipped = (clipped & b["loss_mask"]).sum()
        rs = b["row_stats"]
        stats = torch.cat([rs[:len(ROW_STATS)], b["loss_mask"].sum().view(1).float(), kl_sum.view(1).float(),
                           clipped.view(1).float(), rs[len(ROW_STATS):]]) * world
        return Part((per_token * mask).sum() * scale, out.aux_loss, stats, out.stats)

    def step_stats(self, values: dict) -> dict:
        """The step's means; reward is None (logged empty) where no reward function scored any completion, which
        is warned of once: those completions train with advantage 0, so such a step changes nothing."""
        n = max(values["completions"], 1)
        if values["completions"] and not values["scored"] and not self._warned_unscored:
            self._warned_unscored = True
            log.warning(f"grpo: no reward function scored any of the step's {int(values['completions'])} completions "
                        f"(each returned None for every one): they train with advantage 0, so the step changes "
                        f"nothing, and its reward is logged empty. Check grpo.rewards: {', '.join(self.g.rewards)}")
        out = {"reward": values["reward"] / values["scored"] if values["scored"] else None,
               "reward_std": values["reward_std"] / n,
               "zero_std": values["zero_std"] / n, "completion_len": values["completion_len"] / n,
               "truncated": values["truncated"] / n, "sample_s": values["sample_s"] / self.run.dist.world}
        if self.g.beta > 0:
            out["kl"] = values["kl"] / max(values["tokens"], 1)
        if self.g.num_iterations > 1:
            out["clipped"] = values["clipped"] / max(values["tokens"], 1)
        for name in self.names:
            if values[f"scored_{name}"]:
                out[f"reward_{name}"] = values[f"reward_{name}"] / values[f"scored_{name}"]
        return out

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def evaluate(self, run: Runtime) -> dict:
        ds: PromptDataset = run.val
        n = min(ds.num_samples, max(1, run.cfg.train.eval_tokens // ds.seq_len))
        mine = list(range(n))[run.dist.rank::run.dist.world]
        chunk = run.cfg.train.micro_batch_size * self.g.num_generations
        sums = torch.zeros(4, dtype=torch.float64, device=run.device)   # reward, scored, completion tokens, prompts
        with run.whole():   # every rank at once, whatever its share of the prompts
            sampled = [(idx, self._sample(ds, idx, [row_seed(run.cfg.run.seed, -1, i, 0) for i in idx]))
                       for idx in (mine[k:k + chunk] for k in range(0, len(mine), chunk))]
        for idx, completions in sampled:
            rewards = self._rewards(self._score(ds, idx, completions))
            sums += torch.tensor([rewards.nan_to_num(0.0).sum(), (~rewards.isnan()).sum(),
                                  sum(len(c) for c in completions), len(idx)], dtype=torch.float64,
                                 device=run.device)
        total = run.dist.all_reduce_sum(sums).tolist()
        return {"val_reward": total[0] / max(total[1], 1), "val_completion_len": total[2] / max(total[3], 1),
                "val_prompts": int(total[3])}

    def eval_line(self, res: dict) -> str:
        return (f"val reward {res['val_reward']:.4f}, completion length {res['val_completion_len']:.1f} over "
                f"{res['val_prompts']} prompts")
