"""dpo.loss=kto, preference tuning on unpaired examples, against its references: TRL's KTOTrainer (its own
compute_loss on its own batch: the loss, the KL estimate, the rewards and every gradient of a tiny Llama in fp32),
the paper's formula by hand, and the examples trainbox prepares against the token ids TRL gives the same rows;
the data (unpaired rows, pairs read as examples, the mismatched partners, the errors); and `trainbox train dpo
dpo.loss=kto` end to end, on one process and on two, whose losses are the same."""
from __future__ import annotations

import json
import math
import sys

import nodes
import numpy as np
import pytest
import torch
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "tests"))
import hf_tiny  # noqa: E402

from trainbox.config import load_config  # noqa: E402
from trainbox.data import preference  # noqa: E402
from trainbox.data.pairs import UnpairedDataset, open_pair_datasets  # noqa: E402
from trainbox.errors import ConfigError, DataError  # noqa: E402
from trainbox.model.build import build_model, build_tokenizer, resolve_model  # noqa: E402
from trainbox.model.load import load_init_weights  # noqa: E402
from trainbox.objective import Runtime, build_objective  # noqa: E402
from trainbox.objective.kto import Kto  # noqa: E402
from trainbox.objective.losses import kto  # noqa: E402

NOISE_SEED = 4   # a policy whose KL estimate on the test rows is positive (0.49): not clamped


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_tiny.make_model(tmp_path_factory.mktemp("kto") / "base", seed=3)


@pytest.fixture(scope="module")
def policy(folder, tmp_path_factory):
    return hf_tiny.perturbed(folder, tmp_path_factory.mktemp("kto") / "policy", NOISE_SEED)


def rows_of(path):
    return [json.loads(line) for line in open(path)]


def ours(folder, *overrides):
    cfg = resolve_model(load_config("dpo", [f"model.path={folder}", "train.device=cpu", "data.seq_len=64",
                                            "dpo.loss=kto", *overrides]))
    tok = build_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.vocab_size, 64)
    load_init_weights(cfg.run.init_from, model, cfg.model)
    return cfg, model


def trl_trainer(policy, folder, rows, tmp_path, **args):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), report_to=[],
                       use_cpu=True, bf16=False, fp16=False, max_length=None, seed=0, **args)
    datasets = pytest.importorskip("datasets")
    return KTOTrainer(model=model, ref_model=ref, args=config, train_dataset=datasets.Dataset.from_list(rows),
                      processing_class=AutoTokenizer.from_pretrained(folder))


@pytest.mark.parametrize("loss, beta, wd, wu", [("kto", 0.1, 1.0, 1.0), ("kto", 0.5, 1.0, 1.3),
                                                 ("apo_zero_unpaired", 0.3, 1.2, 1.0)])
def test_loss_kl_rewards_and_gradients_equal_trl(folder, policy, tmp_path, loss, beta, wd, wu):
    """TRL's KTOTrainer.compute_loss on the batch its collator makes (its mismatched KL sequences, a reference model
    beside the policy), and our objective on the same token ids as one micro-batch on one process: the loss, the KL
    estimate (positive here, so not clamped), the mean rewards and log-probabilities of the desirable and the
    undesirable examples, and every parameter's gradient within 1e-4 (fp32, CPU)."""
    pytest.importorskip("trl")
    rows = rows_of(hf_tiny.make_unpaired_file(tmp_path / "feedback.jsonl", n=6, seed=1))
    assert {r["label"] for r in rows} == {True, False}
    trainer = trl_trainer(policy, folder, rows, tmp_path, beta=beta, desirable_weight=wd, undesirable_weight=wu,
                          loss_type=loss)
    batch, reference_loss, theirs, metrics = hf_tiny.trl_step(trainer)
    assert metrics["kl"] > 0.01 if loss == "kto" else metrics["kl"] == 0   # apo_zero_unpaired: no KL term

    cfg, model = ours(policy, f"dpo.loss={loss}", f"dpo.beta={beta}", f"dpo.desirable_weight={wd}",
                      f"dpo.undesirable_weight={wu}", "dpo.reference=model")
    _, reference = ours(folder)
    objective = build_objective(cfg)
    assert isinstance(objective, Kto)
    objective.attach(Runtime(cfg, model, model, reference.requires_grad_(False), torch.device("cpu"), None, None,
                             None, None))

    def rows_from(prefix):
        ids = batch[f"{prefix}input_ids"]
        keep = batch[f"{prefix}completion_mask"].bool() & batch[f"{prefix}attention_mask"].bool()
        return ids[:, :-1], ids[:, 1:], keep[:, 1:]
    x, y, m = rows_from("")
    ours_batch = {"x": x, "y": y, "loss_mask": m, "label": batch["label"].bool()}
    if loss == "kto":
        ours_batch.update(zip(("kl_x", "kl_y", "kl_loss_mask"), rows_from("KL_")))
    objective.before_step(model, [ours_batch])
    part = objective.loss(model, ours_batch, 1.0 / len(rows))   # the mean over the examples, one process
    part.loss.backward()
    assert part.loss.item() == pytest.approx(reference_loss.item(), abs=1e-5)
    stats = objective.step_stats(dict(zip(objective.stat_names, part.stats.tolist())))
    assert ("kl" in stats) == (loss == "kto")   # apo_zero_unpaired logs no KL estimate: it has none
    pairs = [("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"),
             ("reward_margin", "rewards/margins"), ("logp_chosen", "logps/chosen"), ("logp_rejected", "logps/rejected")]
    for mine, key in pairs + ([("kl", "kl")] if loss == "kto" else []):
        assert stats[mine] == pytest.approx(metrics[key], abs=1e-4), mine
    grads = dict(model.named_parameters())
    assert set(grads) == set(theirs)
    for name, p in grads.items():
        torch.testing.assert_close(p.grad, theirs[name], atol=1e-5, rtol=0, msg=name)
    assert max(g.abs().max().item() for g in theirs.values()) > 1e-3


@pytest.mark.parametrize("form", ["messages", "text"])
def test_prepared_examples_equal_trl_tokens(folder, tmp_path, form):
    """Our prompt and completion ids of each unpaired row equal TRL's tokenization of the same row, and every
    completion token carries loss."""
    pytest.importorskip("trl")
    rows = rows_of(hf_tiny.make_unpaired_file(tmp_path / f"{form}.jsonl", n=8, form=form, seed=2))
    trainer = trl_trainer(folder, folder, rows, tmp_path)
    cfg = resolve_model(load_config("dpo", [f"model.path={folder}", "train.device=cpu", "dpo.loss=kto"]))
    tok = build_tokenizer(cfg)
    template = preference.pair_template(tok, None)
    for n, (row, theirs) in enumerate(zip(rows, trainer.train_dataset)):
        where = f"row {n}"
        p, c, cm = preference.encode_example(preference.example_of(row, where), tok, template, where)
        assert (p, c) == (theirs["prompt_ids"], theirs["completion_ids"]), n
        assert all(cm)


def test_kto_equals_its_formula():
    """Ethayarajh et al. 2024 eq. 7 by hand: a desirable example with log-ratio 2 against z = 0.5 at beta 0.5 loses
    w_D (1 - sigmoid(0.75)); an undesirable one with log-ratio -1 loses w_U (1 - sigmoid(0.75))."""
    t = torch.tensor
    loss, reward = kto(t([-4.0, -7.0]), t([-6.0, -6.0]), t([True, False]), t(0.5), 0.5, 1.5, 0.7)
    s = 1 / (1 + math.exp(-0.75))
    assert loss.tolist() == pytest.approx([1.5 * (1 - s), 0.7 * (1 - s)], abs=1e-6)
    assert reward.tolist() == pytest.approx([1.0, -0.5], abs=1e-6)


# ----------------------------------------------------------------------------- data


def test_unpaired_rows_pairs_among_them_and_a_pair_set_read_as_examples(folder, tmp_path):
    """An examples set: its rows in order, a pair row among them giving its chosen (desirable) and rejected
    (undesirable) responses; example i's second sequence is its prompt with example (i + N/2) mod N's completion,
    cut like a pair. A pair set trained with kto reads as two examples a pair, labelled true then false."""
    cfg = resolve_model(load_config("dpo", [f"model.path={folder}", "train.device=cpu", "dpo.loss=kto",
                                            "data.seq_len=64"]))
    tok = build_tokenizer(cfg)
    src = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "one plus one ?", "completion": " two", "label": True},
            {"prompt": "two plus two ?", "chosen": " four", "rejected": " five"},
            {"prompt": "three plus one ?", "completion": " seven", "label": False}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    st = preference.prepare_pairs([str(src)], str(tmp_path / "ex"), tok, str(folder), seq_len=64)
    assert (st.kind, st.pairs, st.desirable) == ("examples", 4, 2)
    ds = UnpairedDataset(tmp_path / "ex", "train", 64, None, tok.eot_id, "ex", "examples")
    assert ds.label.tolist() == [True, True, False, False] and ds.source[:, 1].tolist() == [1, 2, 2, 3]
    assert ds.partner.tolist() == [2, 3, 0, 1]
    texts = [(tok.decode(list(a[0])), tok.decode(list(b[0]))) for a, b in (ds.sequences(i) for i in range(4))]
    eot = tok.decode([tok.eot_id])
    assert texts[0] == ("one plus one ? two" + eot, "one plus one ? five" + eot)
    assert texts[3] == ("three plus one ? seven" + eot, "three plus one ? four" + eot)
    b = ds.batch([0, 3])
    assert b["label"].tolist() == [True, False] and b["x"].shape == b["kl_x"].shape == (2, 64)
    prompt = len(tok.encode("one plus one ?"))
    assert b["loss_mask"][0].sum().item() == len(tok.encode(" two")) + 1 and not b["loss_mask"][0, :prompt - 1].any()

    pairs = tmp_path / "prefs.jsonl"
    hf_tiny.make_preference_file(pairs, n=6, form="text", seed=4)
    preference.prepare_pairs([str(pairs)], str(tmp_path / "pp"), tok, str(folder))
    both = UnpairedDataset(tmp_path / "pp", "train", 64, None, tok.eot_id, "pp", "pairs")
    assert both.num_samples == 12 and both.label.tolist() == [True, False] * 6
    pair = rows_of(pairs)[1]
    own = [tok.decode(list(both.sequences(i)[0][0])) for i in (2, 3)]
    assert own == [pair["prompt"] + pair["chosen"] + eot, pair["prompt"] + pair["rejected"] + eot]
    for i in range(12):   # the partner is never an example of the same prompt
        assert both.partner[i] // 2 != i // 2


def test_what_kto_data_refuses(folder, tmp_path):
    """One message each, naming the row or the set: a label that is not true or false; an unpaired row in a set of
    pairs; an examples set trained with a paired loss; a set of one example (no mismatched partner)."""
    cfg = resolve_model(load_config("dpo", [f"model.path={folder}", "train.device=cpu", "dpo.loss=kto"]))
    tok = build_tokenizer(cfg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": " b", "label": "yes"}) + "\n")
    with pytest.raises(DataError) as e:
        preference.prepare_pairs([str(bad)], str(tmp_path / "bad"), tok, str(folder))
    assert f"{bad}:1: 'label' must be true" in e.value.message
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "a", "chosen": " b", "rejected": " c"}) + "\n"
                     + json.dumps({"prompt": "a", "completion": " b", "label": True}) + "\n")
    with pytest.raises(DataError) as e:
        preference.prepare_pairs([str(mixed)], str(tmp_path / "mixed"), tok, str(folder))
    assert f"{mixed}:2: an unpaired row" in e.value.message
    good = hf_tiny.make_unpaired_file(tmp_path / "good.jsonl", n=8, seed=3)
    paired = load_config("dpo", [f"model.path={folder}", f"data.path={good}", f"data.cache_dir={tmp_path / 'c'}"])
    with pytest.raises(DataError) as e:
        open_pair_datasets(paired.data, paired.dpo, tok, tok.vocab_size)
    assert "holds unpaired examples" in e.value.message and "dpo.loss=kto" in e.value.hint
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "a", "completion": " b", "label": True}) + "\n")
    single = load_config("dpo", [f"model.path={folder}", f"data.path={one}", f"data.cache_dir={tmp_path / 'c'}",
                                 "dpo.loss=kto"])
    with pytest.raises(DataError) as e:
        open_pair_datasets(single.data, single.dpo, tok, tok.vocab_size)
    assert "1 example;" in e.value.message


def test_kto_options_apply_to_kto_only(folder):
    with pytest.raises(ConfigError) as e:
        load_config("dpo", [f"model.path={folder}", "dpo.desirable_weight=2"])
    assert "dpo.desirable_weight does not apply to dpo.loss=dpo" in e.value.message
    with pytest.raises(ConfigError) as e:
        load_config("dpo", [f"model.path={folder}", "dpo.loss=kto", "dpo.label_smoothing=0.1"])
    assert "dpo.label_smoothing does not apply to dpo.loss=kto" in e.value.message


# ----------------------------------------------------------------------------- training


def args(folder, data, root, name, *extra):
    return [f"model.path={folder}", f"data.path={data[0]}", f"data.val_path={data[1]}", "dpo.loss=kto",
            "data.seq_len=48", "train.global_batch_size=8", "train.micro_batch_size=4", f"run.dir={root}",
            f"run.name={name}", f"data.cache_dir={root / 'cache'}", "monitor.port=0", "monitor.log_every=1",
            "train.sample_tokens=0", "optim.lr=1e-3", "optim.warmup_steps=0", "optim.schedule=constant",
            "train.threads=1", *extra]


@pytest.fixture(scope="module")
def feedback(tmp_path_factory):
    root = tmp_path_factory.mktemp("feedback")
    return (hf_tiny.make_unpaired_file(root / "train.jsonl", n=64, seed=0),
            hf_tiny.make_unpaired_file(root / "val.jsonl", n=16, seed=9))


@pytest.fixture(scope="module")
def one_process(folder, feedback, tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    res = run_cli("train", "dpo", *args(folder, feedback, root, "run", "train.max_steps=16", "train.eval_every=8"))
    return root, res.stdout + res.stderr


def test_train_kto_raises_the_reward_margin_and_logs_it(folder, feedback, one_process):
    """From the reference (loss 1 - sigmoid(0) = 0.5 at step 1, z = 0), 16 steps raise the margin between the
    desirable and the undesirable rewards on the training and the validation examples; metrics.jsonl and
    status.json carry the KL estimate and the rewards; a second run of the same weights and data at the recipe's
    own log cadence reads the precomputed reference back and logs the same losses, KL and rewards."""
    root, log = one_process
    run = root / "run"
    train = nodes.events(run, "train")
    assert [e["step"] for e in train] == list(range(1, 17))
    assert train[0]["loss"] == pytest.approx(0.5, abs=1e-6) and train[0]["kl"] == 0
    late = train[-4:]
    assert all(e["reward_margin"] > 0.1 for e in late) and all(e["reward_chosen"] > e["reward_rejected"] for e in late)
    assert all(0 < e["desirable"] < 1 for e in train)
    evals = nodes.events(run, "eval")
    assert [e["step"] for e in evals] == [8, 16]
    assert evals[-1]["val_reward_margin"] > 0.1 and evals[-1]["val_loss"] < 0.5 and "val_kl" in evals[-1]
    status = json.loads((run / "status.json").read_text())
    assert status["kl"] == train[-1]["kl"] and status["val_kl"] == evals[-1]["val_kl"]
    assert "computing the reference log-probabilities of 64 examples" in log
    refs = sorted((root / "cache").glob("pairs-*/*_examples.ref-*.npy"))
    assert len(refs) == 2 and np.load(refs[0]).shape in ((64, 2), (16, 2))
    # the recipe's own log cadence (every 10 steps, and before each evaluation): the same training, and each
    # logged step's KL and rewards
    recipe = [a for a in args(folder, feedback, root, "again", "train.max_steps=16", "train.eval_every=8")
              if a != "monitor.log_every=1"]
    again = run_cli("train", "dpo", *recipe)
    assert "computing the reference" not in again.stdout + again.stderr
    logged = nodes.events(root / "again", "train")
    assert [e["step"] for e in logged if "kl" in e] == [8, 10, 16]
    by_step = {e["step"]: e for e in train}
    for e in logged:
        assert e["loss"] == pytest.approx(by_step[e["step"]]["loss"], abs=1e-6)
        if "kl" in e:
            for k in ("kl", "reward_margin", "reward_chosen", "desirable"):
                assert e[k] == pytest.approx(by_step[e["step"]][k], abs=1e-6), k
    again_evals = nodes.events(root / "again", "eval")
    assert [e["val_loss"] for e in again_evals] == pytest.approx([e["val_loss"] for e in evals], abs=1e-6)


def test_dashboard_shows_the_kl_estimate_and_the_rewards(one_process, tmp_path):
    """`trainbox dashboard` of the finished kto run: /metrics carries the last step's KL estimate as a Prometheus
    gauge, and the page draws it (16 steps and 2 validations) under its own caption, and the desirable and
    undesirable rewards and their margin (headless Chromium)."""
    root, _ = one_process
    last = nodes.events(root / "run", "train")[-1]
    with nodes.dashboard(root / "run") as url:
        gauges = nodes.gauges(url)
        assert gauges["trainbox_kl"] == pytest.approx(last["kl"])
        assert gauges["trainbox_reward_margin"] == pytest.approx(last["reward_margin"])
        page = nodes.chart_points(url, tmp_path / "p")
        if page is None:
            pytest.skip("headless browser check needs Debian's chromium package")
        points, dom = page
    assert points["accuracy"] == 16 + 2 and points["rewards"] == 3 * 16, points
    assert "KL estimate (kto)" in dom and "reward undesirable" in dom


@pytest.mark.slow
def test_two_processes_equal_one(folder, feedback, one_process, tmp_path):
    """train.parallel=ddp over 2 processes (gloo), 2 micro-batches of 2 each: the KL estimate is the step's over
    both ranks, so every step's loss and KL equal one process's with 2 micro-batches of 4 (a constant learning rate:
    the 4 steps follow the 16-step run's)."""
    root, _ = one_process
    two = tmp_path / "two"
    run_cli("train", "dpo", "--nproc", "2", *args(folder, feedback, two, "run", "train.max_steps=4",
                                                   "train.micro_batch_size=2", "train.parallel=ddp"), timeout=600)
    a, b = nodes.events(root / "run", "train")[:4], nodes.events(two / "run", "train")
    assert len(b) == 4
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5) and y["kl"] == pytest.approx(x["kl"], abs=1e-5)
    assert any(e["kl"] > 0 for e in a)
