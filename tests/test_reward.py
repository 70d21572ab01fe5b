"""train.objective=reward, a reward model on preference pairs, against its references: TRL's RewardTrainer (its own
compute_loss on its own batch, a transformers LlamaForSequenceClassification: the loss, the rewards and every
gradient of a tiny Llama in fp32), the sequences TRL tokenizes from the same rows, and transformers' scoring of the
exported folder; `trainbox train reward` end to end, its exact resume and what it refuses."""
from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "tests"))
import hf_tiny  # noqa: E402

from trainbox.config import load_config  # noqa: E402
from trainbox.data.pairs import open_pair_datasets  # noqa: E402
from trainbox.model.build import build_model, build_tokenizer, resolve_model  # noqa: E402
from trainbox.model.load import load_init_weights  # noqa: E402
from trainbox.objective import build_objective  # noqa: E402
from trainbox.objective.reward import Reward, reward_loss  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["eos", "im_end"])
def folder(request, tmp_path_factory):
    """A tiny Llama folder whose tokenizer pads with its end-of-text (pad = eos, as most) or with <|im_end|>, which
    is not the id the rows are padded with: the score must then be read within each sequence's length."""
    out = hf_tiny.make_model(tmp_path_factory.mktemp("reward") / "base", seed=3)
    if request.param == "im_end":
        tok = transformers.AutoTokenizer.from_pretrained(out)
        tok.pad_token = "<|im_end|>"
        tok.save_pretrained(out)
    return out


def ours(folder, *overrides):
    cfg = resolve_model(load_config("reward", [f"model.path={folder}", "train.device=cpu", "data.seq_len=64",
                                               *overrides]))
    tok = build_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.vocab_size, 64, run=cfg)
    if cfg.run.init_from:   # the llama family's folder (LoRA's base is loaded by the build)
        load_init_weights(cfg.run.init_from, model, cfg.model)
    return cfg, tok, model


def trl_trainer(folder, rows, tmp_path, peft_config=None, **args):
    from trl import RewardConfig, RewardTrainer

    datasets = pytest.importorskip("datasets")
    config = RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), report_to=[],
                          use_cpu=True, bf16=False, fp16=False, max_length=None, seed=0, **args)
    return RewardTrainer(model=str(folder), args=config, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=transformers.AutoTokenizer.from_pretrained(folder), peft_config=peft_config)


def our_batch(train, batch, n):
    """Our micro-batch of the pairs in TRL's `batch` (its sampler shuffles them), after checking that each of TRL's
    sequences (right-padded with its pad id) is ours, row for row."""
    ids = batch["input_ids"]
    theirs_rows = [ids[r, :int(batch["attention_mask"][r].sum())].tolist() for r in range(2 * n)]
    pairs = [[seq.tolist() for seq, _ in train.sequences(i)] for i in range(n)]
    mine = train.batch(np.array([pairs.index([theirs_rows[r], theirs_rows[n + r]]) for r in range(n)]))
    for row in range(2 * n):
        assert mine["x"][row, :len(theirs_rows[row])].tolist() == theirs_rows[row], row
    return mine


@pytest.mark.parametrize("form, center", [("messages", None), ("text", None), ("implicit", 0.01)])
def test_loss_rewards_and_gradients_equal_trl(folder, tmp_path, form, center):
    """TRL's RewardTrainer.compute_loss on the batch its collator makes (a LlamaForSequenceClassification, which
    reads each sequence at its last token that is not the padding id), and our objective on the batch of the pairs
    trainbox prepares from the same rows, with the same score head: the loss, the rewards and every parameter's
    gradient agree (fp32, CPU), and so do the sequences themselves."""
    pytest.importorskip("trl")
    rows = [json.loads(line) for line in open(hf_tiny.make_preference_file(tmp_path / "p.jsonl", n=6, form=form))]
    trainer = trl_trainer(folder, rows, tmp_path, **({"center_rewards_coefficient": center} if center else {}))
    batch, reference_loss, theirs, metrics = hf_tiny.trl_step(trainer)

    cfg, tok, model = ours(folder, f"data.path={tmp_path / 'p.jsonl'}",
                           *([f"reward.center_coefficient={center}"] if center else []))
    with torch.no_grad():
        model.score.weight.copy_(trainer.model.score.weight)
    objective = build_objective(cfg)
    assert isinstance(objective, Reward)
    train, _ = objective.open_datasets(cfg, tok, tok.vocab_size)
    n, ids = len(rows), batch["input_ids"]
    mine = our_batch(train, batch, n)
    part = objective.loss(model, mine, 1.0 / n)   # the mean over the pairs, one process
    part.loss.backward()
    assert part.loss.item() == pytest.approx(reference_loss.item(), abs=1e-6)
    stats = objective.step_stats(dict(zip(objective.stat_names, (part.stats * n).tolist())))
    assert stats["reward_accuracy"] / n == pytest.approx(metrics["accuracy"], abs=1e-6)
    assert stats["reward_margin"] / n == pytest.approx(metrics["margin"], abs=1e-5)
    with torch.no_grad():
        scores = trainer.model(input_ids=ids, attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    torch.testing.assert_close(model(mine["x"], score_at=mine["score_at"]).logits, scores, atol=1e-5, rtol=0)
    grads = {k: p.grad for k, p in model.named_parameters() if k != "lm_head.weight"}
    assert set(grads) == set(theirs)
    for name, g in grads.items():
        torch.testing.assert_close(g, theirs[name], atol=1e-5, rtol=0, msg=name)
    assert theirs["score.weight"].abs().max() > 1e-3
    assert model.lm_head.weight.grad is None and not model.lm_head.weight.requires_grad   # not trained


def test_lora_reward_equals_trl_with_peft(tmp_path):
    """model.family=hf (LoRA r=8 on every linear layer of the base, the score head trained whole) against TRL's
    RewardTrainer with PEFT's SEQ_CLS LoRA of the same settings (the score in modules_to_save), with the same
    adapter and head weights: the loss and the gradient of every adapter and of the head agree (fp32, CPU)."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("trl")
    folder = hf_tiny.make_model(tmp_path / "base", seed=3)
    rows = [json.loads(line) for line in open(hf_tiny.make_preference_file(tmp_path / "p.jsonl", n=6))]
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    trainer = trl_trainer(folder, rows, tmp_path, peft_config=lora)
    theirs = dict(trainer.model.named_parameters())
    with torch.no_grad():   # B of every adapter starts at 0: a nonzero one makes the test see A's gradients too
        for name, p in theirs.items():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    batch, reference_loss, grads, _ = hf_tiny.trl_step(trainer)

    cfg, tok, model = ours(folder, "model.family=hf", "lora.r=8", "lora.alpha=16", "lora.dropout=0",
                           f"data.path={tmp_path / 'p.jsonl'}")
    head = "base_model.model.score.modules_to_save.default.weight"
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == len([n for n in theirs if "lora_" in n]) > 0
    with torch.no_grad():
        for name, p in adapters.items():
            p.copy_(theirs[name.removeprefix("peft.")])
        model.score.weight.copy_(theirs[head])
    objective = build_objective(cfg)
    train, _ = objective.open_datasets(cfg, tok, tok.vocab_size)
    part = objective.loss(model, our_batch(train, batch, len(rows)), 1.0 / len(rows))
    part.loss.backward()
    assert part.loss.item() == pytest.approx(reference_loss.item(), abs=1e-6)
    for name, p in adapters.items():
        torch.testing.assert_close(p.grad, grads[name.removeprefix("peft.")], atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(model.score.weight.grad, grads[head], atol=1e-6, rtol=0)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {*adapters, "score.weight"}


@pytest.mark.slow   # the LoRA reward's loss and gradients are held to TRL's in the fast tier
def test_a_lora_reward_run_exports_merged_and_transformers_scores_as_we_do(tmp_path):
    """`trainbox train reward model.family=hf`, then `export --merge`: a LlamaForSequenceClassification of the base
    with the adapters folded in, whose scores are the run's; the adapter alone is refused (the head is no
    adapter)."""
    folder = hf_tiny.make_model(tmp_path / "base", seed=3)
    path = hf_tiny.make_preference_file(tmp_path / "p.jsonl", n=32)
    run_cli("train", "reward", "model.family=hf", f"model.path={folder}", f"data.path={path}", "data.seq_len=64",
            "train.global_batch_size=8", "train.max_steps=6", "optim.lr=1e-3", f"run.dir={tmp_path / 'runs'}",
            "monitor.port=0", "monitor.plot=false", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    run = tmp_path / "runs" / "reward"
    import yaml
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["lora"]["dropout"] == 0 and resolved["train"]["sample_tokens"] == 0   # reward.disable_dropout
    refused = run_cli("export", str(run), "--format", "hf", "--out", str(tmp_path / "a"), check=False)
    assert refused.returncode == 2 and "add --merge" in refused.stderr and not (tmp_path / "a").exists()
    run_cli("export", str(run), "--format", "hf", "--merge", "--out", str(tmp_path / "rm"))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32)
    assert hf.config.architectures == ["LlamaForSequenceClassification"] and hf.config.num_labels == 1
    from trainbox.model.hf.hf import load_lora_run
    model, _, _ = load_lora_run(run, torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "rm")
    chats = [[{"role": "user", "content": "what is one plus two"}, {"role": "assistant", "content": a}]
             for a in ("one plus two equals three", "it equals seven", "three")]
    enc = tok([tok.apply_chat_template(c, tokenize=False) for c in chats], return_tensors="pt", padding=True,
              add_special_tokens=False)
    with torch.no_grad():
        theirs = hf.eval()(**enc).logits.squeeze(-1)
        mine = model(enc["input_ids"], score_at=enc["attention_mask"].sum(-1) - 1).logits
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert model.score.weight.abs().max() > 0 and not torch.equal(theirs[0], theirs[1])


def test_the_loss_by_hand():
    chosen, rejected = torch.tensor([1.0, -0.5]), torch.tensor([0.2, 0.5])
    want = -torch.log(torch.sigmoid(chosen - rejected)) + 0.1 * (chosen + rejected) ** 2
    torch.testing.assert_close(reward_loss(chosen, rejected, 0.1), want)
    torch.testing.assert_close(reward_loss(chosen, rejected, None), -torch.log(torch.sigmoid(chosen - rejected)))


def _losses(run) -> dict[int, float]:
    events = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`trainbox train reward` on a tiny Llama folder, with validation pairs, 24 steps, checkpoints every 12."""
    root = tmp_path_factory.mktemp("reward-run")
    base = hf_tiny.make_model(root / "base", seed=3)
    hf_tiny.make_preference_file(root / "train.jsonl", n=96, seed=1)
    hf_tiny.make_preference_file(root / "val.jsonl", n=24, seed=2)
    args = [f"model.path={base}", f"data.path={root / 'train.jsonl'}", f"data.val_path={root / 'val.jsonl'}",
            "data.seq_len=64", "train.global_batch_size=8", "train.max_steps=24", "train.checkpoint_every=12",
            "train.eval_every=12", "optim.lr=2e-3", "optim.warmup_steps=2", f"run.dir={root / 'runs'}",
            "monitor.port=0", "monitor.plot=false", f"data.cache_dir={root / 'cache'}"]
    proc = run_cli("train", "reward", *args, cwd=root)
    return root, args, proc


def test_train_reward_learns_exports_and_transformers_scores_as_we_do(run):
    """The run raises the validation accuracy and margin; the export is a LlamaForSequenceClassification that
    transformers loads and whose scores (at the last token other than the padding id) are our model's; `generate`
    and GGUF are refused in one message each."""
    root, _, proc = run
    out = root / "runs" / "reward"
    events = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [e for e in events if "val_reward_accuracy" in e]
    assert len(evals) == 2 and evals[-1]["val_reward_accuracy"] >= 0.9, evals
    assert _losses(out)[1] > 0.6   # log 2 = 0.693: the new score head starts near 0 on both sequences
    assert evals[-1]["val_loss"] < 0.3 and evals[-1]["val_reward_margin"] > 1, evals
    assert not (out / "samples.txt").exists()   # a reward model does not generate
    inspected = run_cli("inspect", str(out)).stdout   # the run's pairs, as it reads them
    assert "96 pairs" in inspected and "12 steps per epoch" in inspected, inspected

    run_cli("export", str(out), "--format", "hf", "--out", str(root / "rm"))
    config = json.loads((root / "rm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(root / "rm", dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(root / "rm")
    from trainbox.model.load import load_for_inference
    model, _, _ = load_for_inference(out, generates=False)
    chats = [[{"role": "user", "content": "what is one plus two"}, {"role": "assistant", "content": a}]
             for a in ("one plus two equals three", "it equals seven")]
    texts = [tok.apply_chat_template(c, tokenize=False) for c in chats]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        theirs = hf(**enc).logits.squeeze(-1)
        last = enc["attention_mask"].sum(-1) - 1
        mine = model.eval()(enc["input_ids"], score_at=last).logits
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert theirs[0] > theirs[1]   # the right sum scores higher

    for args, says in ((["generate", str(out), "--prompt", "hi"], "holds a reward model"),
                       (["export", str(out), "--format", "gguf", "--out", str(root / "rm.gguf")], "GGUF files hold")):
        p = run_cli(*args, check=False)
        assert p.returncode == 2 and says in p.stderr.splitlines()[0] and "Traceback" not in p.stderr, p.stderr


def test_a_resumed_reward_run_continues_exactly(run):
    """The run's checkpoint at step 12 (as after a crash there) resumed to the end: steps 13 to 24 lose what the
    uninterrupted run lost, bit for bit (CPU)."""
    root, args, _ = run
    whole = root / "runs" / "reward"
    cut = root / "cut" / "reward"
    shutil.copytree(whole, cut, ignore=shutil.ignore_patterns("step_00000024", "metrics.jsonl"))
    (cut / "checkpoints" / "latest").write_text("step_00000012")
    run_cli("train", "reward", *[a for a in args if not a.startswith("run.dir=")], f"run.dir={root / 'cut'}",
            cwd=root)
    want, got = _losses(whole), _losses(cut)
    assert sorted(got) == list(range(13, 25)), sorted(got)
    assert got == {s: want[s] for s in got}


@pytest.mark.parametrize("overrides, says", [
    (["train.objective=dpo", "reward.center_coefficient=0.1"], "reward.center_coefficient applies to "
                                                                "train.objective=reward"),
    (["model.family=gpt", "model.path=null"], "model.family=gpt does not take"),
    (["data.packing=true"], "one sequence a row"),
    (["reward.max_prompt_len=64"], "leaves no room"),
])
def test_refused_settings_name_the_key(overrides, says):
    from trainbox.errors import ConfigError
    with pytest.raises((ConfigError, ValueError)) as e:
        load_config("reward", ["model.path=/nowhere", "data.seq_len=64", *overrides])
    assert says in str(e.value)


def test_reward_pairs_are_the_dpo_pairs(folder, tmp_path):
    """open_pair_datasets under the reward section reads the same pairs as under dpo; only the reward's batch
    carries score_at."""
    path = hf_tiny.make_preference_file(tmp_path / "p.jsonl", n=8)
    cfg, tok, _ = ours(folder, f"data.path={path}", f"data.cache_dir={tmp_path / 'c'}")
    reward, _ = open_pair_datasets(cfg.data, cfg.reward, tok, tok.vocab_size)
    dpo = load_config("dpo", [f"model.path={folder}", f"data.path={path}", "data.seq_len=64",
                              f"data.cache_dir={tmp_path / 'c'}"])
    pairs, _ = open_pair_datasets(dpo.data, dpo.dpo, tok, tok.vocab_size)
    a, b = reward.batch(np.arange(8)), pairs.batch(np.arange(8))
    assert "score_at" not in a and all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("parallel", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_two_processes_equal_one(run, tmp_path, parallel):
    """train.parallel=fsdp or ddp over 2 processes (gloo), the same command otherwise: every step's loss, and the
    validation's loss and accuracy, equal the one-process run's (the score head in the root unit, the token head
    frozen and never run)."""
    root, args, _ = run
    run_cli("train", "reward", "--nproc", "2", *[a for a in args if not a.startswith("run.dir=")],
            f"run.dir={tmp_path}", f"train.parallel={parallel}", "train.micro_batch_size=2", cwd=root, timeout=600)
    want, got = _losses(root / "runs" / "reward"), _losses(tmp_path / "reward")
    assert sorted(got) == sorted(want) == list(range(1, 25))
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], abs=1e-5)
    evals = [[e for e in map(json.loads, open(d / "metrics.jsonl")) if e["event"] == "eval"]
             for d in (root / "runs" / "reward", tmp_path / "reward")]
    for a, b in zip(*evals, strict=True):
        assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-5)
        assert b["val_reward_accuracy"] == a["val_reward_accuracy"]


def test_the_plan_counts_a_reward_models_weights_and_no_logits(folder):
    """`trainbox plan` of a reward run on an H100: every weight in fp32 (the frozen token head too: it is not a LoRA
    base loaded in bf16), the score head among the trainable ones, and no token head's logits among the
    activations (the same run as dpo keeps them)."""
    from trainbox.plan import gpu, make_plan, run_vocab
    cfg = resolve_model(load_config("reward", [f"model.path={folder}", "data.seq_len=64"]))
    plan = make_plan(cfg, run_vocab(cfg), gpu("H100"))
    c = plan.counts
    assert c.frozen == run_vocab(cfg) * 32   # the token head alone (width 32): the score head trains
    assert plan.memory.params == 4 * c.total and plan.base == "fp32"
    pairs = resolve_model(load_config("dpo", [f"model.path={folder}", "data.seq_len=64"]))
    logits = 8 * 64 * run_vocab(pairs)   # 4 pairs: 8 sequences of 64 positions, a logit each per id
    assert plan.activations.other < make_plan(pairs, run_vocab(pairs), gpu("H100")).activations.other - logits
