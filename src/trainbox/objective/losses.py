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

Unpaired examples (kto), each with its label (true: desirable), its policy and reference log-probabilities p, r and
the step's KL estimate z (objective/kto.py):

    kto    w_D (1 - sigmoid(b (p - r - z))) for a desirable example, w_U (1 - sigmoid(b (z - (p - r)))) for an
           undesirable one; Ethayarajh et al. 2024, eq. 7 (w_D, w_U: dpo.desirable_weight, dpo.undesirable_weight;
           z detached, as the paper and TRL); reward b (p - r)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

REFERENCE_FREE = ("simpo", "orpo")
UNPAIRED = ("kto",)


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


def pair_loss(cfg, pc, pr, rc, rr, nc, nr):
    """The loss the dpo section names, in fp32 -> (loss per pair, chosen reward, rejected reward)."""
    pc, pr, nc, nr = pc.float(), pr.float(), nc.float(), nr.float()
    if cfg.loss == "dpo":
        return dpo(pc, pr, rc.float(), rr.float(), nc, nr, cfg.beta, cfg.label_smoothing)
    if cfg.loss == "ipo":
        return ipo(pc, pr, rc.float(), rr.float(), nc, nr, cfg.beta)
    if cfg.loss == "simpo":
        return simpo(pc, pr, nc, nr, cfg.beta, cfg.simpo_gamma, cfg.label_smoothing)
    return orpo(pc, pr, nc, nr, cfg.orpo_lambda)


def kto(p, r, label, kl, beta: float, w_desirable: float, w_undesirable: float):
    """-> (loss per example, reward per example), in fp32; `label` bool, `kl` a detached scalar."""
    ratio = p.float() - r.float()
    loss = torch.where(label, w_desirable * (1 - torch.sigmoid(beta * (ratio - kl))),
                       w_undesirable * (1 - torch.sigmoid(beta * (kl - ratio))))
    return loss, beta * ratio
