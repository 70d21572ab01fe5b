"""The preference objective against its references: TRL's DPOTrainer (its own compute_loss on its own batch) for
the dpo and ipo losses, rewards and gradients of a tiny Llama in fp32; the published formulas of dpo with label
smoothing, ipo, simpo and orpo on hand-computed cases; and the pairs trainbox prepares against the token ids TRL
gives the same rows."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "tests"))
import hf_tiny  # noqa: E402

from trainbox.config import load_config  # noqa: E402
from trainbox.model.build import build_model, build_tokenizer, resolve_model  # noqa: E402
from trainbox.model.load import load_init_weights  # noqa: E402
from trainbox.objective import build_objective  # noqa: E402
from trainbox.objective.losses import pair_loss  # noqa: E402
from trainbox.objective.preference import sequence_logps  # noqa: E402

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_tiny.make_model(tmp_path_factory.mktemp("dpo") / "base", seed=3)


def trl_trainer(folder, rows, tmp_path, reference=None, **args):
    """TRL's DPOTrainer on `rows` as one batch: the policy from `folder`, the reference from `reference` (default:
    TRL's copy of the policy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32) if reference else None
    tok = AutoTokenizer.from_pretrained(folder)
    config = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), report_to=[],
                       use_cpu=True, bf16=False, fp16=False, max_length=None, seed=0, dataloader_drop_last=False,
                       **args)
    trainer = DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tok)
    return trainer


def ours(folder, cfg_overrides):
    cfg = resolve_model(load_config("dpo", [f"model.path={folder}", "train.device=cpu", "data.seq_len=64",
                                            *cfg_overrides]))
    tok = build_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.vocab_size, 64)
    load_init_weights(cfg.run.init_from, model, cfg.model)
    return cfg, model


def rows_of(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("loss, beta", [("dpo", 0.1), ("dpo", 0.5), ("ipo", 0.1)])
def test_loss_rewards_and_gradients_equal_trl(folder, tmp_path, loss, beta):
    """TRL's DPOTrainer.compute_loss on the batch its collator makes (a frozen reference model beside the policy),
    and our objective on the same token ids: the loss, the mean rewards, margin and accuracy, and every parameter's
    gradient within 1e-4 (fp32, CPU)."""
    rows = rows_of(hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=6, seed=1))
    trainer = trl_trainer(folder, rows, tmp_path, beta=beta, loss_type=["sigmoid" if loss == "dpo" else "ipo"])
    batch, reference_loss, theirs, metrics = hf_tiny.trl_step(trainer)

    cfg, model = ours(folder, [f"dpo.loss={loss}", f"dpo.beta={beta}", "dpo.reference=model"])
    from trainbox.objective import Runtime
    from trainbox.train.build import frozen_copy
    objective = build_objective(cfg)
    objective.attach(Runtime(cfg, model, model, frozen_copy(model, torch.float32), torch.device("cpu"),
                             None, None, None, None))
    ids, keep = batch["input_ids"], batch["completion_mask"].bool() & batch["attention_mask"].bool()
    ours_batch = {"x": ids[:, :-1], "y": ids[:, 1:], "loss_mask": keep[:, 1:]}
    pairs = len(rows)
    part = objective.loss(model, ours_batch, 1.0 / pairs)   # the mean over the pairs, one process
    part.loss.backward()
    assert part.loss.item() == pytest.approx(reference_loss.item(), abs=1e-4)
    stats = dict(zip(objective.stat_names, part.stats.tolist()))   # sums over the pairs x 1/pairs: means
    for mine, theirs_key in (("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"),
                             ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies"),
                             ("logp_chosen", "logps/chosen"), ("logp_rejected", "logps/rejected")):
        assert stats[mine] == pytest.approx(metrics[theirs_key], abs=1e-4), mine
    grads = dict(model.named_parameters())
    assert set(grads) == set(theirs)
    for name, p in grads.items():
        torch.testing.assert_close(p.grad, theirs[name], atol=1e-4, rtol=0, msg=name)
    assert max(g.abs().max().item() for g in theirs.values()) > 1e-3   # the gradients are not all ~0


@pytest.fixture(scope="module")
def policy(folder, tmp_path_factory):
    return hf_tiny.perturbed(folder, tmp_path_factory.mktemp("dpo") / "policy", seed=4)


TRL_LOSSES = [("hinge", {}), ("robust", {"label_smoothing": 0.2}), ("exo_pair", {"label_smoothing": 1e-3}),
              ("nca_pair", {}), ("bco_pair", {}), ("sppo_hard", {}), ("apo_zero", {}), ("apo_down", {}),
              ("discopop", {"discopop_tau": 0.3}), ("sigmoid_norm", {})]


@pytest.mark.parametrize("loss, extra", TRL_LOSSES, ids=[name for name, _ in TRL_LOSSES])
def test_the_further_trl_losses_equal_trl(folder, policy, tmp_path, loss, extra):
    """Each further loss type of TRL's DPOTrainer by its name, beta 0.5, a policy whose log-ratios against the
    reference are not 0: TRL's compute_loss on its own batch and our objective on the same ids give the same loss
    and every parameter's gradient within 1e-5 (fp32, CPU)."""
    rows = rows_of(hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=6, seed=1))
    trainer = trl_trainer(policy, rows, tmp_path, reference=folder, beta=0.5, loss_type=[loss], **extra)
    batch, reference_loss, theirs, _ = hf_tiny.trl_step(trainer)

    cfg, model = ours(policy, [f"dpo.loss={loss}", "dpo.beta=0.5", "dpo.reference=model",
                               *[f"dpo.{k}={v}" for k, v in extra.items()]])
    _, reference = ours(folder, [])
    from trainbox.objective import Runtime
    objective = build_objective(cfg)
    objective.attach(Runtime(cfg, model, model, reference.requires_grad_(False), torch.device("cpu"), None, None,
                             None, None))
    ids, keep = batch["input_ids"], batch["completion_mask"].bool() & batch["attention_mask"].bool()
    part = objective.loss(model, {"x": ids[:, :-1], "y": ids[:, 1:], "loss_mask": keep[:, 1:]}, 1.0 / len(rows))
    part.loss.backward()
    assert part.loss.item() == pytest.approx(reference_loss.item(), abs=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name], atol=1e-5, rtol=0, msg=name)
    assert max(g.abs().max().item() for g in theirs.values()) > 1e-3


@pytest.mark.parametrize("form", ["messages", "implicit", "text"])
def test_prepared_pairs_equal_trl_tokens(folder, tmp_path, form):
    """Our prompt, chosen and rejected ids for each form of row equal those TRL tokenizes from the same rows (for
    the implicit form, from TRL's own extraction of the shared prompt), and the loss mask covers each response."""
    from trainbox.data.preference import encode_pair, pair_of, pair_template

    path = hf_tiny.make_preference_file(tmp_path / f"{form}.jsonl", n=8, form=form, seed=2)
    rows = rows_of(path)
    trainer = trl_trainer(folder, rows, tmp_path)
    cfg = resolve_model(load_config("dpo", [f"model.path={folder}", "train.device=cpu"]))
    tok = build_tokenizer(cfg)
    template = pair_template(tok, None)
    for n, (row, theirs) in enumerate(zip(rows, trainer.train_dataset)):
        p, c, cm, r, rm = encode_pair(pair_of(row, f"row {n}"), tok, template, f"row {n}")
        assert (p, c, r) == (theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"]), n
        assert all(cm) and all(rm)   # one assistant turn a response: every response token trains


# ----------------------------------------------------------------------------- the published formulas


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def losses(loss: str, **kw):
    cfg = load_config("dpo", ["model.path=x", f"dpo.loss={loss}", *[f"dpo.{k}={v}" for k, v in kw.items()]]).dpo
    t = torch.tensor
    # two pairs: summed log-probs of chosen and rejected responses under the policy and the reference, and lengths
    pc, pr, rc, rr = t([-6.0, -4.0]), t([-9.0, -3.5]), t([-7.0, -4.5]), t([-8.0, -3.0])
    nc, nr = t([3, 2]), t([3, 5])
    return [x.tolist() for x in pair_loss(cfg, pc, pr, rc, rr, nc, nr)]


def test_dpo_with_label_smoothing_equals_its_formula():
    """Rafailov et al. eq. 7 with conservative DPO's label smoothing e: -(1-e) log s(b d) - e log s(-b d)."""
    b, e = 0.5, 0.1
    loss, chosen, rejected = losses("dpo", beta=b, label_smoothing=e)
    for i, (pc, pr, rc, rr) in enumerate([(-6, -9, -7, -8), (-4, -3.5, -4.5, -3)]):
        d = (pc - rc) - (pr - rr)
        assert loss[i] == pytest.approx(-(1 - e) * math.log(sigmoid(b * d)) - e * math.log(sigmoid(-b * d)), abs=1e-6)
        assert (chosen[i], rejected[i]) == pytest.approx((b * (pc - rc), b * (pr - rr)), abs=1e-6)


def test_ipo_equals_its_formula():
    """Azar et al. eq. 17 with tau = beta, on the per-token log-ratios (as TRL): (d' - 1/(2 tau))^2."""
    tau = 0.25
    loss, _, _ = losses("ipo", beta=tau)
    for i, (pc, pr, rc, rr, nc, nr) in enumerate([(-6, -9, -7, -8, 3, 3), (-4, -3.5, -4.5, -3, 2, 5)]):
        d = (pc - rc) / nc - (pr - rr) / nr
        assert loss[i] == pytest.approx((d - 1 / (2 * tau)) ** 2, abs=1e-6)


def test_simpo_equals_its_formula():
    """Meng et al. 2024 eq. 6: -log s(b/|yw| log p(yw|x) - b/|yl| log p(yl|x) - g); first pair by hand:
    b = 2, g = 0.5: 2 x (-6/3) - 2 x (-9/3) - 0.5 = 1.5, -log s(1.5) = log(1 + e^-1.5) = 0.2014133."""
    loss, chosen, rejected = losses("simpo", beta=2.0, simpo_gamma=0.5)
    assert loss[0] == pytest.approx(0.2014133, abs=1e-6)
    assert loss[1] == pytest.approx(-math.log(sigmoid(2 * (-4 / 2) - 2 * (-3.5 / 5) - 0.5)), abs=1e-6)
    assert (chosen[0], rejected[0]) == pytest.approx((-4.0, -6.0))


def test_orpo_equals_its_formula():
    """Hong et al. 2024 eqs. 2, 6-7: L_SFT + l L_OR, L_SFT the chosen response's mean token NLL, L_OR = -log s(log
    odds(yw) - log odds(yl)), odds(y) = P / (1 - P) with P = exp(mean token log-prob). First pair by hand: P_w = e^-2,
    P_l = e^-3, log odds ratio = (-2 - log(1 - e^-2)) - (-3 - log(1 - e^-3)) = 1.0943..."""
    lam = 0.1
    loss, chosen, rejected = losses("orpo", orpo_lambda=lam)
    lw, ll = -2.0, -3.0
    ratio = (lw - math.log(1 - math.exp(lw))) - (ll - math.log(1 - math.exp(ll)))
    assert ratio == pytest.approx(1.0943, abs=1e-4)
    assert loss[0] == pytest.approx(2.0 - lam * math.log(sigmoid(ratio)), abs=1e-6)
    assert (chosen[0], rejected[0]) == pytest.approx((lam * lw, lam * ll))


def test_sequence_logprob_is_the_sum_over_trained_tokens(folder):
    """The objective's log-probability of a sequence equals log_softmax of the Hugging Face model's logits, gathered
    at the targets and summed over the masked positions (the slow, obvious reference)."""
    from transformers import AutoModelForCausalLM
    cfg, model = ours(folder, [])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 300, (4, 24), generator=g)
    y = torch.randint(0, 300, (4, 24), generator=g)
    mask = torch.rand(4, 24, generator=g) > 0.4
    logps, n, _ = sequence_logps(model, {"x": x, "y": y, "loss_mask": mask})
    token = torch.log_softmax(hf(input_ids=x).logits.float(), -1).gather(-1, y[..., None])[..., 0]
    torch.testing.assert_close(logps, (token * mask).sum(-1), atol=1e-5, rtol=0)
    assert n.tolist() == mask.sum(-1).tolist()
