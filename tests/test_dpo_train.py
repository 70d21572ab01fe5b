"""`trainbox train dpo` end to end on CPU: a tiny Llama folder (every weight) and the same folder under LoRA
(model.family=hf), on raw preference JSONL; what it logs (metrics.jsonl, status, /metrics, the dashboard, loss.png);
the three references agree; a run killed with SIGKILL resumes to the uninterrupted run's losses bit for bit, with
the precomputed reference read back or computed again; ddp and fsdp on two processes equal one."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import nodes
import numpy as np
import pytest
import torch
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "tests"))
import hf_tiny  # noqa: E402

from trainbox.config import load_config  # noqa: E402
from trainbox.objective.preference import sequence_logps  # noqa: E402
from trainbox.train.loop import Trainer, train  # noqa: E402

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_tiny.make_model(tmp_path_factory.mktemp("dpo") / "base", seed=1)


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefs")
    return (hf_tiny.make_preference_file(root / "train.jsonl", n=64, seed=0),
            hf_tiny.make_preference_file(root / "val.jsonl", n=16, seed=9))


def args(folder, prefs, root, name, *extra):
    return [f"model.path={folder}", f"data.path={prefs[0]}", "data.seq_len=48", "train.global_batch_size=8",
            "train.micro_batch_size=4", f"run.dir={root}", f"run.name={name}", f"data.cache_dir={root / 'cache'}",
            "monitor.port=0", "monitor.log_every=1", "train.sample_tokens=0", "optim.lr=1e-3",
            "optim.warmup_steps=0", "train.threads=1", *extra]


def events(run_dir, kind="train"):
    """The run's `kind` events; a line the live run is still writing is left out (nodes.events), as the tests poll
    metrics.jsonl while the trainer appends to it."""
    return nodes.events(run_dir, kind)


def losses(run_dir):
    return {e["step"]: e["loss"] for e in events(run_dir)}


def test_train_dpo_logs_rewards_everywhere(folder, prefs, tmp_path):
    """The CLI trains on raw JSONL (validation from data.val_path): the first step's loss is log 2 (the policy is
    the reference), the reward accuracy and margin rise, and the preference values are in metrics.jsonl (train and
    eval events), status.json, the /metrics JSON of `trainbox dashboard`, and loss.png's second row; the reference
    log-probabilities are stored beside the prepared pairs and a second run of the same weights and data reads
    them."""
    root = tmp_path / "runs"
    run_cli("train", "dpo", *args(folder, prefs, root, "cli", f"data.val_path={prefs[1]}", "train.max_steps=16",
                                  "train.eval_every=8", "train.eval_tokens=4096"))
    run = root / "cli"
    train = events(run)
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen",
                "logp_rejected"):
        assert all(math.isfinite(e[key]) for e in train), key
    assert train[-1]["reward_accuracy"] > 0.9 and train[-1]["reward_margin"] > train[1]["reward_margin"] > 0
    assert train[-1]["tokens"] == 16 * 8 * 2 * 48   # pairs x 2 sequences x seq_len a step
    ev = events(run, "eval")
    assert [e["step"] for e in ev] == [8, 16] and ev[-1]["val_pairs"] == 16 and ev[-1]["val_reward_accuracy"] > 0.8
    status = json.loads((run / "status.json").read_text())
    assert status["reward_accuracy"] == train[-1]["reward_accuracy"] and status["val_reward_accuracy"] > 0.8
    stored = list((root / "cache").glob("pairs-*/data_train_pairs.ref-*.npy"))
    assert len(stored) == 2   # train and val pairs' (the val file prepared in a cache folder of its own too)
    assert (run / "loss.png").stat().st_size > 20_000
    again = run_cli("train", "dpo", *args(folder, prefs, root, "again", "train.max_steps=2"))
    assert "dpo: reference log-probabilities of" in again.stderr + again.stdout
    assert "computing the reference" not in again.stderr + again.stdout
    assert losses(root / "again")[2] == losses(run)[2]


def test_dashboard_shows_the_preference_charts(folder, prefs, tmp_path):
    """`trainbox dashboard` of a finished dpo run: /metrics carries the last step's reward values, as JSON and as
    Prometheus gauges, and the page draws the reward accuracy and rewards charts (headless Chromium)."""
    import urllib.request
    root = tmp_path / "runs"
    train(load_config("dpo", args(folder, prefs, root, "dash", "train.max_steps=6")))
    with nodes.dashboard(root / "dash") as url:
        m = json.loads(urllib.request.urlopen(url + "/metrics").read())
        last = events(root / "dash")[-1]
        assert m["reward_accuracy"] == last["reward_accuracy"] and m["reward_margin"] == last["reward_margin"] > 0
        gauges = nodes.gauges(url)
        assert gauges["trainbox_reward_accuracy_ratio"] == pytest.approx(last["reward_accuracy"])
        assert gauges["trainbox_reward_margin"] == pytest.approx(last["reward_margin"])
        assert gauges["trainbox_reward_chosen"] == pytest.approx(last["reward_chosen"])
        page = nodes.chart_points(url, tmp_path / "p")
        if page is None:
            pytest.skip("headless browser check needs Debian's chromium package")
        points, dom = page
        assert points["accuracy"] == 6 and points["rewards"] == 18, points
        assert "reward accuracy" in dom


@pytest.mark.parametrize("family", ["llama", "hf"])
def test_the_references_agree(folder, prefs, tmp_path, family):
    """precompute and a frozen copy (llama) or the base with its adapters off (hf: LoRA, no copy) give the same
    losses; under LoRA the reference stays the base after the adapters trained."""
    extra = ["model.family=hf", "lora.dropout=0", "optim.lr=1e-2"] if family == "hf" else []
    runs = {}
    for ref in ("precompute", "model"):
        cfg = load_config("dpo", args(folder, prefs, tmp_path, f"{family}-{ref}", "train.max_steps=6",
                                      f"dpo.reference={ref}", *extra))
        trainer = Trainer(cfg)
        trainer.run()
        runs[ref] = losses(cfg.run_dir)
        assert (trainer.reference is not None) == (ref == "model" and family == "llama")
    assert runs["precompute"][1] == pytest.approx(math.log(2), abs=1e-6)
    for step, v in runs["precompute"].items():
        assert runs["model"][step] == pytest.approx(v, abs=1e-5), step
    if family == "hf":   # the trained LoRA model's reference is the base model, read again from the folder
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        batch = trainer.train_data.batch([0, 1])
        got = trainer.objective._reference(trainer.runtime())(batch)
        token = torch.log_softmax(base(input_ids=batch["x"]).logits, -1).gather(-1, batch["y"][..., None])[..., 0]
        torch.testing.assert_close(got, (token * batch["loss_mask"]).sum(-1), atol=1e-5, rtol=0)
        assert not torch.allclose(got, sequence_logps(trainer.model, batch)[0], atol=1e-3)   # the policy moved


def test_the_loop_sends_each_micro_batchs_trained_rows(folder, prefs, tmp_path):
    """Each micro-batch the loop sends carries its trained targets' flat indices, found on the host, which its
    forward's head takes instead of reading them back from the device (kernels/fused_ce.trained_rows)."""
    cfg = load_config("dpo", args(folder, prefs, tmp_path, "rows", "train.max_steps=1"))
    trainer = Trainer(cfg)
    trainer.setup()
    sent = trainer._send_batches(0)
    assert len(sent) == 2   # global 8 pairs, micro 4
    for b in sent:
        rows, total = b["rows"]
        assert total == b["y"].numel()
        assert torch.equal(rows, (b["loss_mask"] & (b["y"] != -100)).reshape(-1).nonzero().squeeze(1))


@pytest.mark.parametrize("disable", [True, False])
def test_the_policy_trains_without_dropout_by_default(folder, prefs, tmp_path, disable):
    """dpo.disable_dropout (TRL's default too): the resolved config holds lora.dropout and model.dropout at 0 and no
    dropout module of the policy drops anything, so its log-probabilities in train mode are those of eval mode, as
    the reference's are taken; false keeps the dropout the config asks for."""
    cfg = load_config("dpo", args(folder, prefs, tmp_path, f"drop-{disable}", "model.family=hf", "lora.dropout=0.5",
                                  "train.max_steps=1", f"dpo.disable_dropout={str(disable).lower()}"))
    trainer = Trainer(cfg)
    trainer.setup()
    assert trainer.cfg.lora.dropout == (0.0 if disable else 0.5) and cfg.lora.dropout == 0.5
    with torch.no_grad():   # LoRA's B starts at 0: move it, so the adapters (and their dropout) count
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = trainer.train_data.batch([0, 1])
    trainer.model.train()
    train_mode = sequence_logps(trainer.model, batch)[0]
    trainer.model.eval()
    eval_mode = sequence_logps(trainer.model, batch)[0]
    assert torch.equal(train_mode, eval_mode) == disable


@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo"])
def test_every_loss_trains(folder, prefs, tmp_path, loss):
    """Each loss lowers itself and raises the reward accuracy; simpo and orpo build no reference at all."""
    beta = {"ipo": "0.5", "simpo": "2.0", "orpo": "0.1"}[loss]
    cfg = load_config("dpo", args(folder, prefs, tmp_path, loss, "train.max_steps=16", f"dpo.loss={loss}",
                                  f"dpo.beta={beta}"))
    train(cfg)
    ev = events(cfg.run_dir)
    assert ev[-1]["loss"] < ev[0]["loss"] and ev[-1]["reward_accuracy"] >= 0.75, [e["loss"] for e in ev]
    stored = list((tmp_path / "cache").glob("pairs-*/*.ref-*.npy"))
    assert bool(stored) == (loss == "ipo")


def _segment(cmd, log):
    out = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "trainbox", "train", "dpo", *cmd], stdout=out,
                            stderr=subprocess.STDOUT, env=ENV), out


def _own(folder, prefs, run_root):
    """The killed run's arguments: the recipe's own settings (dpo logs every step), 40 steps, a save every 10."""
    return [a for a in args(folder, prefs, run_root, "run", "train.max_steps=40", "train.checkpoint_every=10",
                            "train.keep_last=2") if a != "monitor.log_every=1"]


@pytest.fixture(scope="module")
def straight(folder, prefs, tmp_path_factory):
    """The uninterrupted run both SIGKILL cases compare with: step -> loss."""
    root = tmp_path_factory.mktemp("straight")
    run_cli("train", "dpo", *_own(folder, prefs, root))
    want = losses(root / "run")
    assert sorted(want) == list(range(1, 41))   # the rewards of each step, at log_every 10 too
    return want


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.parametrize("lose_cache", [False, True])
def test_sigkill_resumes_bit_for_bit_with_the_precomputed_reference(folder, prefs, straight, tmp_path, lose_cache):
    """SIGKILL mid-run, then the same command: it resumes from the newest checkpoint and every logged loss equals an
    uninterrupted run's bit for bit, whether the precomputed reference is read back or (its file deleted) computed
    again from the initial weights before the checkpoint is loaded."""
    want = straight
    root = tmp_path / "killed"
    cmd = _own(folder, prefs, root)
    proc, out = _segment(cmd, tmp_path / "first.log")
    deadline = time.time() + 180
    while not (root / "run" / "metrics.jsonl").is_file() or max(losses(root / "run"), default=0) < 25:
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out.close()
    before = max(losses(root / "run"))   # the last step the killed run logged
    assert before < 40
    if lose_cache:
        for f in (root / "cache").glob("pairs-*/*.ref-*.npy"):
            f.unlink()
    res = run_cli("train", "dpo", *cmd)
    log = res.stdout + res.stderr
    assert "resuming from" in log and ("computing the reference" in log) == lose_cache
    got = losses(root / "run")
    assert sorted(got) == list(range(1, 41)) and got == want
    # the killed run's log moves to superseded/ when it holds steps past the checkpoint resumed from (none when the
    # kill fell between a save and the next step's line)
    start = int(re.search(r"resuming from \S+ at step (\d+)", log).group(1))
    lost = [e for p in (root / "run" / "superseded").glob("*/metrics.jsonl") for e in events(p.parent)]
    assert {e["step"] for e in lost} == (set(range(1, before + 1)) if before > start else set())
    assert all(e["loss"] == want[e["step"]] for e in lost)


@pytest.fixture(scope="module")
def one_process(folder, prefs, tmp_path_factory):
    """The 4-step single-process run both layouts compare with (its root: run/ and cache/)."""
    one = tmp_path_factory.mktemp("one")
    train(load_config("dpo", args(folder, prefs, one, "run", "train.max_steps=4")))
    return one


@pytest.mark.parametrize("parallel", [pytest.param(p, marks=pytest.mark.slow) for p in ("ddp", "fsdp")])
def test_two_processes_equal_one(folder, prefs, one_process, tmp_path, parallel):
    """train.parallel=ddp or fsdp over 2 processes (gloo), each preparing the raw JSONL: the precompute splits the
    pairs over the ranks and every step's loss and reward accuracy equal one process's."""
    one = one_process
    two = tmp_path / "two"
    run_cli("train", "dpo", "--nproc", "2", *args(folder, prefs, two, "run", "train.max_steps=4",
                                                   f"train.parallel={parallel}", "train.micro_batch_size=2"),
            timeout=600)
    a, b = events(one / "run"), events(two / "run")
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5) and y["reward_accuracy"] == x["reward_accuracy"]
    refs = [np.load(f) for f in sorted((one / "cache").glob("pairs-*/*.ref-*.npy"))] + \
        [np.load(f) for f in sorted((two / "cache").glob("pairs-*/*.ref-*.npy"))]
    np.testing.assert_allclose(refs[0], refs[1], atol=1e-5)


@pytest.mark.slow
def test_the_real_run_in_miniature_raises_the_reward_accuracy(tmp_path):
    """benchmarks/dpo_real_run.py at its tiny size (SFT of a 2-layer Llama on 400 Shakespeare rows, DPO on 240
    pairs from held-out plays, chosen the true next line, rejected its words shuffled): SFT lowers its loss and DPO
    takes the reward accuracy from chance to well above it (thresholds several of chance's standard deviations
    above 0.5 for the last 10 steps' 160 pairs and the 64 validation pairs) and raises the validation chosen
    responses' likelihood."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dpo_real_run.py"), "--size", "tiny",
                           "--sft-steps", "40", "--sft-rows", "400", "--dpo-steps", "30", "--dpo-lr", "1e-4",
                           "--pairs", "240", "--val-pairs", "64", "--seq-len", "64", "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads(proc.stdout)["metrics"]
    assert m["sft"]["final_loss"] < m["sft"]["first_loss"] - 1.0
    d = m["dpo"]
    assert d["first_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert d["reward_accuracy_first"] == 0   # the policy is the reference: every reward 0, no pair ahead
    assert d["reward_accuracy_end"] > 0.75 and d["reward_accuracy_end"] > d["reward_accuracy_start"]
    assert d["val"][-1]["reward_accuracy"] > 0.7 and d["val"][-1]["reward_margin"] > d["val"][0]["reward_margin"]
    assert d["val"][-1]["reward_chosen"] > 0   # the held-out chosen responses are likelier than before
    assert (tmp_path / "runs" / "dpo" / "loss.png").is_file()
