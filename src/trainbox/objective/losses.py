"""The preference losses as pure functions of per-sequence log-probabilities, one line of maths each.

    pc, pr   summed log-probabilities of the chosen and rejected responses' trained tokens under the policy
    rc, rr   the same under the reference (dpo, ipo)
    nc, nr   how many tokens each sum has

Each returns (loss per pair, chosen reward, rejected reward); the rewards are what TRL logs for the loss
(rewards/chosen, rewards/rejected), their difference the margin, `chosen > rejected` the accuracy.

    dpo    -(1 - e) log sigmoid(b d) - e log sigmoid(-b d),  d = (pc - rc) - (pr - rr)
           Rafailov et al. 2023, eq. 7; label smoothing e as conservative DPO (Mitchell 2023) and TRL's sigmoid
           loss; rewards b (pc - rc), b (pr - rr)
    ipo    (d' - 1 / (2 b))^2,  d' = (pc - rc) / nc - (pr - rr) / nr
           Azar et al. 2023, eq. 17 with tau = b, on per-token log-ratios as TRL (which checked the normalisation with
           the paper's authors); rewards as dpo
    simpo  -(1 - e) log sigmoid(s) - e log sigmoid(-s),  s = b pc / nc - b pr / nr - g
           Meng et al. 2024, eq. 6 (g: dpo.simpo_gamma); rewards b pc / nc, b pr / nr
    orpo   -pc / nc + l (-log sigmoid(log odds)),  log odds = log(p / (1 - p)) of the chosen minus the rejected's,
           p = exp(mean token log-prob); Hong et al. 2024, eqs. 2, 6-7 (l: dpo.orpo_lambda); rewards l pc / nc and
           l pr / nr

More of TRL's DPOTrainer loss types, by its names, on the same terms (c = b (pc - rc), r = b (pr - rr), the rewards
of each; d as dpo's; e: dpo.label_smoothing):

    hinge         relu(1 - b d)                                      (SLiC, Zhao et al. 2023)
    robust        (-(1 - e) log s(b d) + e log s(-b d)) / (1 - 2e)   (rDPO, Chowdhury et al. 2024)
    exo_pair      s(b d) (log s(b d) - log(1 - e)) + s(-b d) (log s(-b d) - log e), e > 0   (EXO, Ji et al. 2024)
    nca_pair      -log s(c) - log s(-c) / 2 - log s(-r) / 2          (NCA, Chen et al. 2024)
    bco_pair      -log s(c) - log s(-r)                              (BCO's pair form)
    sppo_hard     (c / b - 1 / (2b))^2 + (r / b + 1 / (2b))^2        (SPPO, hard labels; Wu et al. 2024)
    apo_zero      1 - s(c) + s(r)                                    (APO-zero, D'Oosterlinck et al. 2024, eq. 7)
    apo_down      s(c) + 1 - s(c - r)                                (APO-down, eq. 8)
    discopop      (1 - m) (-log s(b d)) + m exp(-b d), m = s(b d / tau)   (DiscoPOP, Lu et al. 2024; tau:
                  dpo.discopop_tau)
    sigmoid_norm  -log s(b d'), d' as ipo's per-token log-ratios

(TRL's aot and aot_unpaired sort the log-ratios across a batch, so a pair's loss would depend on which pairs share
its micro-batch: left out, as is its sft term.)

Unpaired examples (kto), each with its label (true: desirable), its policy and reference log-probabilities p, r and
the step's KL estimate z (objective/kto.py):

    kto    w_D (1 - sigmoid(b (p - r - z))) for a desirable example, w_U (1 - sigmoid(b (z - (p - r)))) for an
           undesirable one; Ethayarajh et al. 2024, eq. 7 (w_D, w_U: dpo.desirable_weight, dpo.undesirable_weight;
           z detached, as the paper and TRL); reward b (p - r)
    apo_zero_unpaired   the same without z: w_D (1 - sigmoid(b (p - r))), w_U sigmoid(b (p - r)) (TRL's KTO option)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainbox.config.preference import UNPAIRED_LOSSES

REFERENCE_FREE = ("simpo", "orpo")
UNPAIRED = UNPAIRED_LOSSES


def smoothed(logit: torch.Tensor, eps: float) -> torch.Tensor:
    """-log sigmoid(logit) with probability `eps` that the pair's labels are flipped."""
    loss = -F.logsigmoid(logit)
    return loss if not eps else (1 - eps) * loss - eps * F.logsigmoid(-logit)


def dpo(pc, pr, rc, rr, nc, nr, beta: float, eps: float = 0.0):
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    return smoothed(chosen - rejected, eps), chosen, rejected


def ipo(pc, pr, rc, rr, nc, nr, beta: float):
    d = (pc - rc) / nc.clamp(min=1) - (pr - rr) / nr.clamp(min=1)
    return (d - 1 / (2 * beta)) ** 2, beta * (pc - rc), beta * (pr - rr)


def simpo(pc, pr, nc, nr, beta: float, gamma: float, eps: float = 0.0):
    chosen, rejected = beta * pc / nc.clamp(min=1), beta * pr / nr.clamp(min=1)
    return smoothed(chosen - rejected - gamma, eps), chosen, rejected


def orpo(pc, pr, nc, nr, lam: float):
    lc, lr = pc / nc.clamp(min=1), pr / nr.clamp(min=1)   # mean token log-probs, < 0
    log_odds = (lc - lr) - (torch.log1p(-torch.exp(lc)) - torch.log1p(-torch.exp(lr)))
    return -lc - lam * F.logsigmoid(log_odds), lam * lc, lam * lr


def trl_pair(name: str, pc, pr, rc, rr, nc, nr, beta: float, eps: float, tau: float):
    """One of TRL's further loss types (the module docstring) -> (loss per pair, chosen reward, rejected reward)."""
    c, r = beta * (pc - rc), beta * (pr - rr)
    z = c - r   # b d
    if name == "hinge":
        loss = torch.relu(1 - z)
    elif name == "robust":
        loss = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    elif name == "exo_pair":
        loss = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + \
            torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))
    elif name == "nca_pair":
        loss = -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    elif name == "bco_pair":
        loss = -F.logsigmoid(c) - F.logsigmoid(-r)
    elif name == "sppo_hard":
        loss = (c / beta - 0.5 / beta) ** 2 + (r / beta + 0.5 / beta) ** 2
    elif name == "apo_zero":
        loss = 1 - torch.sigmoid(c) + torch.sigmoid(r)
    elif name == "apo_down":
        loss = torch.sigmoid(c) + 1 - torch.sigmoid(c - r)
    elif name == "discopop":
        m = torch.sigmoid(z / tau)
        loss = -F.logsigmoid(z) * (1 - m) + torch.exp(-z) * m
    elif name == "sigmoid_norm":
        loss = -F.logsigmoid(beta * ((pc - rc) / nc.clamp(min=1) - (pr - rr) / nr.clamp(min=1)))
    else:
        raise ValueError(f"no preference loss {name!r}")
    return loss, c, r


def pair_loss(cfg, pc, pr, rc, rr, nc, nr):
    """The loss the dpo section names, in fp32 -> (loss per pair, chosen reward, rejected reward)."""
    pc, pr, nc, nr = pc.float(), pr.float(), nc.float(), nr.float()
    if cfg.loss == "dpo":
        return dpo(pc, pr, rc.float(), rr.float(), nc, nr, cfg.beta, cfg.label_smoothing)
    if cfg.loss == "ipo":
        return ipo(pc, pr, rc.float(), rr.float(), nc, nr, cfg.beta)
    if cfg.loss == "simpo":
        return simpo(pc, pr, nc, nr, cfg.beta, cfg.simpo_gamma, cfg.label_smoothing)
    if cfg.loss == "orpo":
        return orpo(pc, pr, nc, nr, cfg.orpo_lambda)
    return trl_pair(cfg.loss, pc, pr, rc.float(), rr.float(), nc, nr, cfg.beta, cfg.label_smoothing,
                    cfg.discopop_tau)


def kto(p, r, label, kl, beta: float, w_desirable: float, w_undesirable: float):
    """-> (loss per example, reward per example), in fp32; `label` bool, `kl` a detached scalar (None:
    apo_zero_unpaired)."""
    ratio = p.float() - r.float()
    if kl is None:
        return torch.where(label, w_desirable * (1 - torch.sigmoid(beta * ratio)),
                           w_undesirable * torch.sigmoid(beta * ratio)), beta * ratio
    loss = torch.where(label, w_desirable * (1 - torch.sigmoid(beta * (ratio - kl))),
                       w_undesirable * (1 - torch.sigmoid(beta * (kl - ratio))))
    return loss, beta * ratio
